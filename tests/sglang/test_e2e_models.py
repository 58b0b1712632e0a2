"""End to end on CPU with SGLang's own model code: tiny random Gemma 3 (a windowed and a full layer), gpt-oss
(sinks in every layer, a windowed and a full layer, 4 experts) and DeepSeek-V3 (MLA over the latent pool) give the
same greedy tokens with prefixattn's backends as with SGLang's own attention backends, in fp32 and (Gemma 3) with fp8
e4m3 KV pools, unscaled and scaled.

Each model serves one session (``tests/sglang/model_run.py``): a prompt prefilled and cached, two more that get its
24-token prefix from the radix cache (shared KV slots) and prefill the rest, then 4 greedy decode steps of all three.
The references are SGLang's: ``torch_native`` for Gemma 3 (whose window, 16 keys, ends inside the shared prefix),
SGLang's Triton backend, in the Triton interpreter, for gpt-oss (SGLang refuses gpt-oss on torch_native, which has no
sinks). Each comparison has a control: the same reference with the feature switched off gives other tokens, so a
backend that ignored the window or the sinks could not pass. The runs happen in a subprocess per model (SGLang's
published server config and process group cannot be undone in the pytest process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# The near-tie bound of every engine e2e test (the SGLang backends differ by <= 5e-7 per layer, measured against
# prefixattn's reference, far below it).
from tests.vllm.tiny_model import MIN_TOP2_GAP

pytestmark = pytest.mark.sglang

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A model's runs take ~20-40 s on 2 cores; only a hang should reach this.
RUN_TIMEOUT_S = 600
#: Same tokens are not enough on their own (Gemma 3 normalizes each attention output, so some wrong attentions keep
#: the greedy tokens): each generated token's log-probability must agree too. Measured: <= 6e-6 between the backends
#: (fp32 model; fp8 pools hold the same values on both sides); a k_scale applied when writing but not when reading
#: moves them by 0.06 (and changes tokens).
LOGPROB_ATOL = 1e-4
#: gpt-oss sink logits that carry no mass (exp(-30) ~ 1e-13 of a row's denominator): the no-sinks control.
NO_SINKS = (-30.0,) * 4


def run_models(tmp_path, arch: str, runs: list[dict]) -> dict:
    spec = dict(arch=arch, model_dir=str(tmp_path / arch), runs=runs)
    in_path, out_path = tmp_path / f"{arch}.in.json", tmp_path / f"{arch}.out.json"
    in_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.sglang.model_run", str(in_path), str(out_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        from tests.sglang.model_run import STAGE_MARK

        stages = [line[len(STAGE_MARK):] for line in proc.stderr.splitlines() if line.startswith(STAGE_MARK)]
        raise AssertionError(f"SGLang model run {arch} failed at stage {stages[-1] if stages else 'import'!r} "
                             f"(rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())


def _assert_same_generation(got: dict, ref: dict) -> None:
    assert got["tokens"] == ref["tokens"]
    diff = max(abs(a - b) for g, r in zip(got["logprobs"], ref["logprobs"]) for a, b in zip(g, r))
    assert diff <= LOGPROB_ATOL


def _window_lefts(run: dict) -> set:
    return {window for _, plans in run["plans"] for window, _ in plans}


def _shared_in_decode(run: dict, window_left: int) -> list:
    """Shared nodes of the plan for layers with ``window_left``, at every decode step."""
    return [dict(plans)[window_left] for mode, plans in run["plans"] if mode == "DECODE"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return run_models(tmp_path_factory.mktemp("gemma3"), "gemma3", [
        dict(name="torch_native", backend="torch_native"),
        dict(name="prefixattn", backend="prefixattn"),
        dict(name="prefixattn_page4", backend="prefixattn", page_size=4),
        dict(name="torch_native_no_window", backend="torch_native", no_window=True),
        dict(name="torch_native_fp8", backend="torch_native", kv_cache_dtype="fp8_e4m3"),
        dict(name="prefixattn_fp8", backend="prefixattn", kv_cache_dtype="fp8_e4m3"),
        dict(name="prefixattn_fp8_scaled", backend="prefixattn", kv_cache_dtype="fp8_e4m3", kv_scale=0.5),
    ])


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return run_models(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", [
        dict(name="triton", backend="triton"),
        dict(name="prefixattn", backend="prefixattn"),
        dict(name="triton_no_sinks", backend="triton", sinks=NO_SINKS),
    ])


def test_gemma3_window_matches_torch_native(gemma3):
    ref = gemma3["torch_native"]
    assert ref["backend_class"].endswith("torch_native_backend.TorchNativeAttnBackend")
    assert ref["cached"] == [24, 24], "requests 1 and 2 got the prefix from the radix cache"
    assert ref["min_top2_gap"] > MIN_TOP2_GAP
    for name in ("prefixattn", "prefixattn_page4"):
        got = gemma3[name]
        assert got["backend_class"] == "prefixattn.integrations.sglang.backend.PrefixAttnBackend"
        _assert_same_generation(got, ref)
        # Two plans per step: the windowed layer's (SGLang's sliding_window_size = 16 - 1) and the full layer's.
        assert _window_lefts(got) == {15, -1}
    # The full layer shares the 24 cached prefix tokens among all three requests at every decode step; the windowed
    # layer's windows (16 keys at positions 28-33) start inside the prefix, so it shares nothing (prefixattn/planner/window.py).
    assert _shared_in_decode(gemma3["prefixattn"], -1) == [[[[0, 1, 2], 24]]] * 4
    assert _shared_in_decode(gemma3["prefixattn"], 15) == [[]] * 4
    assert all(shared and all(kv_end == 24 for _, kv_end in shared)
               for shared in _shared_in_decode(gemma3["prefixattn_page4"], -1))


def test_gemma3_window_changes_the_tokens(gemma3):
    """The control: without the window, SGLang's own backend gives other tokens."""
    assert gemma3["torch_native_no_window"]["tokens"] != gemma3["torch_native"]["tokens"]


def test_gemma3_fp8_pool_matches_torch_native(gemma3):
    """fp8 e4m3 pool, no checkpoint scales (SGLang stores and reads the plain cast), both backends on their own pool."""
    ref, got = gemma3["torch_native_fp8"], gemma3["prefixattn_fp8"]
    assert ref["min_top2_gap"] > MIN_TOP2_GAP
    _assert_same_generation(got, ref)
    assert _shared_in_decode(got, -1) == [[[[0, 1, 2], 24]]] * 4
    # e4m3's rounding changes a token of the session: the pool's dtype reaches the attention.
    assert ref["tokens"] != gemma3["torch_native"]["tokens"]


def test_gemma3_scaled_fp8_pool_matches_torch_native(gemma3):
    """fp8 e4m3 with per-tensor scales as SGLang's fp8 KV quant method leaves them on the layers (k 0.5, v 1.0: the
    pool holds k / k_scale, read back times k_scale) against torch_native's unscaled e4m3 pool (torch_native passes
    no scales to the pool and reads none). Power-of-two scales commute with fp8 rounding (fp8(k / 0.5) = fp8(k) / 0.5
    away from overflow), so the two pools hold the same values once dequantized and the tokens must agree; a scale
    applied on one side only doubles every key of the session and changes them. test_backend.py checks non-power-of-
    two scales and e5m2 against the reference (e5m2 end to end: the reference's greedy choices come within 4e-4 of a
    tie on this model, under MIN_TOP2_GAP)."""
    ref, got = gemma3["torch_native_fp8"], gemma3["prefixattn_fp8_scaled"]
    _assert_same_generation(got, ref)


def test_gpt_oss_sinks_match_sglang_triton(gpt_oss):
    ref, got = gpt_oss["triton"], gpt_oss["prefixattn"]
    assert ref["backend_class"].endswith("triton_backend.TritonAttnBackend")
    assert ref["min_top2_gap"] > MIN_TOP2_GAP
    _assert_same_generation(got, ref)
    assert _window_lefts(got) == {63, -1}  # layer 0 windowed (OSS_WINDOW - 1), layer 1 full
    assert _shared_in_decode(got, -1) == [[[[0, 1, 2], 24]]] * 4
    assert _shared_in_decode(got, 63) == [[[[0, 1, 2], 24]]] * 4  # the window covers the whole prefix


def test_gpt_oss_sinks_change_the_tokens(gpt_oss):
    """The control: without sink mass, SGLang's own backend gives other tokens."""
    assert gpt_oss["triton_no_sinks"]["tokens"] != gpt_oss["triton"]["tokens"]


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    return run_models(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", [
        dict(name="torch_native", backend="torch_native"),
        dict(name="prefixattn", backend="prefixattn"),
        dict(name="prefixattn_page4", backend="prefixattn", page_size=4),
    ])


def test_deepseek_v3_mla_matches_torch_native(deepseek_v3):
    """MLA over SGLang's latent pool (DeepSeek-V3's absorbed form in every batch, the reference's too): SGLang's own
    torch_native backend's tokens, with the 24 cached prompt tokens shared by all three requests at every decode."""
    ref = deepseek_v3["torch_native"]
    assert ref["cached"] == [24, 24] and ref["min_top2_gap"] > MIN_TOP2_GAP
    for name in ("prefixattn", "prefixattn_page4"):
        got = deepseek_v3[name]
        assert got["backend_class"] == "prefixattn.integrations.sglang.mla_backend.PrefixAttnMLABackend"
        _assert_same_generation(got, ref)
        assert _shared_in_decode(got, -1) == [[[[0, 1, 2], 24]]] * 4
