"""The fused kernel compiles for a GPU target and computes block_id x block_stride in 64 bits.

The interpreter does not overflow like a GPU does, so 64-bit offsets (vllm#47671, sglang#20389) are proven on the
compiled IR. A kernel defined under TRITON_INTERPRET=1 cannot be compiled: this runs in a separate process.
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
import torch
from prefixattn.attention_configs import choose_tiles
from prefixattn.kernels.prefix_attention import prefix_attention_kernel as kernel

dtype = sys.argv[1]
tiles = choose_tiles(head_dim=128, group=4, max_q_len=1, dtype={"*fp16": torch.float16, "*bf16": torch.bfloat16}[dtype])
pointers = {"out_ptr": dtype, "lse_ptr": "*fp32", "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "counters_ptr": "*i32",
            "q_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype, "num_items_ptr": "*i32", "items_ptr": "*i32",
            "gather_ptr": "*i32", "mrows_ptr": "*i32", "block_table_ptr": "*i32"}
# The tiles a plan would pick for a Llama-like decode step; tensor-core dots as on a real GPU.
constexprs = dict(HAS_LSE=True, HAS_SHARED=True, USE_FP32_DOT=False, PAGE_SIZE=16, BLOCK_M_SHARED=tiles.block_m_shared,
                  BLOCK_N_SHARED=tiles.block_n_shared, BLOCK_M_SUFFIX=tiles.block_m_suffix,
                  BLOCK_N_SUFFIX=tiles.block_n_suffix, BLOCK_D=tiles.block_d)
# Every integer scalar, strides included, as i32: the worst case, where only an explicit cast gives 64 bits.
signature = {name: pointers.get(name, "constexpr" if name in constexprs else "fp32" if name == "qk_scale" else "i32")
             for name in kernel.arg_names}
compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
print(json.dumps({"ttgir": compiled.asm["ttgir"], "ptx": compiled.asm["ptx"]}))
"""


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["*fp16"])  # one dtype: the offset arithmetic does not depend on it
def test_block_offsets_are_64_bit_in_compiled_kernel(dtype):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _SCRIPT, dtype], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    asm = json.loads(run.stdout.strip().splitlines()[-1])
    ttgir, ptx = asm["ttgir"], asm["ptx"]
    for cache in ("k", "v"):
        # The block stride is widened to i64 ...
        assert re.search(rf"%{cache}_off\w* = arith\.extsi %stride_{cache}_blk : i32 to i64", ttgir)
        # ... and multiplied by the widened block id loaded from the block table, in i64.
        assert re.search(rf"%{cache}_off\w* = arith\.muli %blk\w*, %{cache}_off\w* : tensor<\d+xi64", ttgir)
    assert re.search(r"%blk\w* = arith\.extsi %blk\w* : tensor<\d+xi32[^>]*> to tensor<\d+xi64", ttgir)
    # The machine code multiplies in 64 bits.
    assert "mul.lo.s64" in ptx or "mul.wide.s32" in ptx
