"""The K/V write kernel compiles for GPU targets, with 64-bit cache offsets and no spills on sm_90.

The interpreter does not overflow like a GPU does: slot // block_size x block stride must be 64-bit in the compiled
IR (a cache past 2^31 elements, vllm#47671). A kernel defined under TRITON_INTERPRET=1 cannot be compiled: this runs
in a separate process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prefixattn.autotune.targets import get_target
from prefixattn.tuning.compile_specs import build_signature
from prefixattn.kernels.kv_write_kernel import kv_write_kernel as kernel
from prefixattn.kv_write import kv_write_tiles

t = get_target(sys.argv[1])
cache = sys.argv[2]  # Triton element type of the caches: bf16, or fp8e4nv / fp8e5 (IS_FP8: quantized stores)
is_fp8 = cache != "bf16"
hkv, d = 8, 128  # Llama-3-8B-like KV heads; K/V rows of a fused qkv projection (row stride 48 heads)
bt, bh, bd = kv_write_tiles(num_kv_heads=hkv, head_dim=d)
values = dict(num_tokens=100, num_slots=16000, num_kv_heads=hkv, head_dim=d, block_size=16, k_scale=1.0, v_scale=1.0,
              stride_k_t=48 * d, stride_k_h=d, stride_k_d=1, stride_v_t=48 * d, stride_v_h=d, stride_v_d=1,
              stride_kc_blk=16 * hkv * 2 * d, stride_kc_tok=hkv * 2 * d, stride_kc_head=2 * d, stride_kc_d=1,
              stride_vc_blk=16 * hkv * 2 * d, stride_vc_tok=hkv * 2 * d, stride_vc_head=2 * d, stride_vc_d=1)
# int32 slots: only the explicit cast makes the offsets 64-bit (int64 slots, as vLLM passes, are 64-bit anyway)
ptrs = dict(k_cache_ptr=cache, v_cache_ptr=cache, key_ptr="bf16", value_ptr="bf16", slot_mapping_ptr="i32",
            k_scale_ptr="fp32" if is_fp8 else cache, v_scale_ptr="fp32" if is_fp8 else cache)
fp8 = dict(fp8e4nv=(448.0, 3, 7), fp8e5=(57344.0, 2, 15)).get(cache, (0.0, 0, 0))
consts = dict(BLOCK_T=bt, BLOCK_H=bh, BLOCK_D=bd, IS_FP8=is_fp8, FP8_MAX=fp8[0], FP8_MANT_BITS=fp8[1],
              FP8_EXP_BIAS=fp8[2], USE_SOFT_FP8_CAST=False)  # the soft cast is the interpreter's
sig, consts, attrs = build_signature(list(kernel.arg_names), ptrs, values, consts, t)
sig["num_tokens"], _ = "i32", consts.pop("num_tokens", None)  # do_not_specialize: never a constant
ck = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                    target=GPUTarget(t.backend, t.arch, t.warp_size), options=dict(num_warps=4))
out = {"ttgir": ck.asm["ttgir"]}
if t.backend == "cuda":
    from prefixattn.tuning.compile_analysis import parse_ptxas
    from prefixattn.tuning.compile_check import _ptxas_log

    out["ptxas"] = parse_ptxas(_ptxas_log(ck.asm["ptx"], t.arch))
print(json.dumps(out))
"""


def _compile(target: str, cache: str = "bf16") -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _SCRIPT, target, cache], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.compile
def test_sm90_offsets_are_64_bit_and_nothing_spills():
    out = _compile("sm90")
    ttgir = out["ttgir"]
    for cache in ("kc", "vc"):
        assert re.search(rf"= arith\.extsi %stride_{cache}_blk : i32 to i64", ttgir)
    # block id (from the 64-bit slot) x block stride, in i64
    assert re.search(r"= arith\.muli %blk3\w*, %\w+ : tensor<[\dx]+xi64", ttgir)
    assert out["ptxas"]["spill_bytes"] == 0 and out["ptxas"]["stack_bytes"] == 0


@pytest.mark.compile
def test_compiles_for_amd():
    assert "tt.func public @kv_write_kernel" in _compile("gfx942")["ttgir"]


@pytest.mark.compile
@pytest.mark.parametrize("target, cache", [("sm90", "fp8e4nv"), ("sm90", "fp8e5"), ("sm80", "fp8e5"),
                                           ("gfx942", "fp8e4nv"), ("gfx942", "fp8e5")])
def test_fp8_quantizing_stores_compile(target, cache):
    # IS_FP8 on a GPU: IEEE division, saturation and the hardware's float-to-fp8 cast (round to nearest even), not
    # the interpreter's integer encoding.
    out = _compile(target, cache)
    ttgir = out["ttgir"]
    assert "tt.precise_divf" in ttgir  # IEEE x / scale, as vLLM's CUDA op (Triton's "/" is approximate)
    assert "tt.fp_to_fp" in ttgir and "tt.bitcast" not in ttgir
    assert re.search(r"tt\.store .*tensor<[\dx]+x!tt\.ptr<f8E(4M3FN|5M2)>", ttgir)
    if "ptxas" in out:
        assert out["ptxas"]["spill_bytes"] == 0 and out["ptxas"]["stack_bytes"] == 0
