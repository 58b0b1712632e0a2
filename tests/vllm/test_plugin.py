"""Plugin registration: idempotent, lazy, cheap, reachable through vLLM's entry point, selectable by name."""

import json
import subprocess
import sys

import pytest

from tests.vllm.engine import REPO

pytestmark = pytest.mark.vllm


def _in_fresh_process(code: str, env: dict | None = None) -> dict:
    """Run ``code`` (which prints one JSON line last) in a new interpreter; vLLM's registry is per process."""
    import os

    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_register_is_idempotent_and_get_name_matches():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from prefixattn.integrations.vllm.plugin import BACKEND_CLASS_PATH, BACKEND_NAME, register

    register()
    members_before = list(AttentionBackendEnum.__members__)
    register()
    register()
    assert list(AttentionBackendEnum.__members__) == members_before
    member = AttentionBackendEnum[BACKEND_NAME]
    assert member.get_path() == BACKEND_CLASS_PATH
    backend = member.get_class()
    assert backend.get_name() == BACKEND_NAME == "PREFIXATTN"
    assert AttentionBackendEnum[backend.get_name()] is member  # vLLM's Attention layer does exactly this lookup


def test_register_imports_nothing_heavy():
    # vLLM calls register() in every process it starts: it must not import prefixattn, its kernels or the backend.
    out = _in_fresh_process(
        "import json, sys, time; import vllm.v1.attention.backends.registry\n"
        "before = set(sys.modules); t = time.perf_counter()\n"
        "from prefixattn.integrations.vllm.plugin import register; register()\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(json.dumps(dict(new=new, seconds=time.perf_counter() - t)))")
    ours = {"prefixattn", "prefixattn.integrations", "prefixattn.integrations.vllm",
            "prefixattn.integrations.vllm.plugin"}
    heavy = [m for m in out["new"] if m.startswith(("prefixattn", "triton")) and m not in ours]
    assert heavy == []  # neither the backend nor the API (prefixattn/__init__.py imports its names on first use)
    assert set(out["new"]) <= ours


def test_vllm_loads_the_plugin_from_the_entry_point():
    out = _in_fresh_process(
        "import json\n"
        "from importlib.metadata import entry_points\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "load_general_plugins()\n"
        "eps = [e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'prefixattn']\n"
        "print(json.dumps(dict(eps=eps, registered='PREFIXATTN' in E.__members__,\n"
        "                      cpu=E.CPU_ATTN.get_path())))")
    assert out["eps"] == ["prefixattn.integrations.vllm.plugin:register"]
    assert out["registered"]
    assert out["cpu"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"  # no override unless asked


def test_override_env_makes_cpu_attn_resolve_to_prefixattn():
    out = _in_fresh_process(
        "import json\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "load_general_plugins(); load_general_plugins()\n"
        "over = E.CPU_ATTN.get_path()\n"
        "from prefixattn.integrations.vllm.plugin import clear_override; clear_override('CPU_ATTN')\n"
        "print(json.dumps(dict(over=over, after=E.CPU_ATTN.get_path())))",
        env={"PREFIXATTN_VLLM_OVERRIDE": "CPU_ATTN"})
    assert out["over"] == "prefixattn.integrations.vllm.backend.PrefixAttnBackend"
    assert out["after"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


def test_mla_name_and_mla_overrides_resolve_to_the_mla_backend():
    # vLLM refuses a backend whose is_mla() differs from the model's: MLA names resolve to the MLA backend.
    out = _in_fresh_process(
        "import json\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "load_general_plugins(); load_general_plugins()\n"
        "mla = E['PREFIXATTN_MLA'].get_class()\n"
        "print(json.dumps(dict(mla=E.PREFIXATTN_MLA.get_path(), name=mla.get_name(), is_mla=mla.is_mla(),\n"
        "                      cpu_mla=E.CPU_MLA.get_path(), cpu=E.CPU_ATTN.get_path())))",
        env={"PREFIXATTN_VLLM_OVERRIDE": "CPU_MLA,CPU_ATTN"})
    assert out["mla"] == out["cpu_mla"] == "prefixattn.integrations.vllm.mla_backend.PrefixAttnMLABackend"
    assert out["name"] == "PREFIXATTN_MLA" and out["is_mla"]
    assert out["cpu"] == "prefixattn.integrations.vllm.backend.PrefixAttnBackend"


def test_override_of_unknown_backend_names_valid_ones():
    from prefixattn.integrations.vllm.plugin import override_backend

    with pytest.raises(ValueError, match="Unknown attention backend: 'NO_SUCH'.*PREFIXATTN"):
        override_backend("NO_SUCH")


def test_users_select_it_by_name():
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from prefixattn.integrations.vllm.plugin import BACKEND_CLASS_PATH, register

    register()
    selected = AttentionConfig(backend="PREFIXATTN").backend
    # The name is an alias of vLLM's built-in CUSTOM member: it pickles as CUSTOM, which every process knows.
    assert selected is AttentionBackendEnum.CUSTOM is AttentionBackendEnum["PREFIXATTN"]
    assert selected.get_path() == BACKEND_CLASS_PATH


def test_a_custom_backend_of_another_plugin_is_not_taken_over():
    # Another plugin registered vLLM's CUSTOM first: prefixattn leaves it alone and registers a member of its own
    # (which works wherever vLLM forks or runs in-process), with a warning saying it does not survive a spawn.
    out = _in_fresh_process(
        "import json, logging\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E, register_backend\n"
        "register_backend(E.CUSTOM, 'other.plugin.Backend')\n"
        "records = []\n"
        "logging.getLogger('prefixattn.integrations.vllm.plugin').addHandler(type('H', (logging.Handler,), "
        "{'emit': lambda self, r: records.append(r.getMessage())})())\n"
        "from prefixattn.integrations.vllm.plugin import register; register(); register()\n"
        "print(json.dumps(dict(custom=E.CUSTOM.get_path(), ours=E['PREFIXATTN'].get_path(),\n"
        "                      alias=E['PREFIXATTN'] is E.CUSTOM, warnings=records)))")
    assert out["custom"] == "other.plugin.Backend"
    assert out["ours"] == "prefixattn.integrations.vllm.backend.PrefixAttnBackend" and not out["alias"]
    assert len(out["warnings"]) == 1 and "does not survive a spawned engine process" in out["warnings"][0]


def test_engine_args_select_it_by_name_in_a_fresh_process(tiny_llama):
    # What `LLM(..., attention_backend="PREFIXATTN")` and `--attention-backend PREFIXATTN` go through: vLLM loads
    # the plugin from the entry point itself, nothing registered by hand.
    out = _in_fresh_process(
        "import json\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"args = EngineArgs(model={tiny_llama!r}, attention_backend='PREFIXATTN', skip_tokenizer_init=True,\n"
        "                  max_model_len=256, kv_cache_memory_bytes=1 << 24)\n"
        "cfg = args.create_engine_config()\n"
        "print(json.dumps(dict(backend=cfg.attention_config.backend.name,\n"
        "                      path=cfg.attention_config.backend.get_path())))")
    assert out == dict(backend="CUSTOM", path="prefixattn.integrations.vllm.backend.PrefixAttnBackend")
