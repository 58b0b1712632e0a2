"""The fused kernel compiles for GPU targets: block_id x block_stride in 64 bits; the merge's memory ordering on AMD.

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

from prefixattn.autotune.targets import writes_own_l2_fences

_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
from prefixattn.planner.tiles import choose_tiles
from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel as kernel

dtype = sys.argv[1]
tiles = choose_tiles(head_dim=128, group=4, max_q_len=1, dtype={"*fp16": torch.float16, "*bf16": torch.bfloat16}[dtype])
pointers = {"out_ptr": dtype, "lse_ptr": "*fp32", "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "counters_ptr": "*i32",
            "q_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype, "item_range_ptr": "*i32", "items_ptr": "*i32",
            "gather_ptr": "*i32", "mrows_ptr": "*i32", "block_table_ptr": "*i32", "sinks_ptr": "*fp32",
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
# The tiles a plan would pick for a Llama-like decode step; tensor-core dots as on a real GPU.
constexprs = dict(IS_SHARED=True, HAS_LSE=True, HAS_SOFT_CAP=False, HAS_WINDOW=False, HAS_SINKS=False,
                  HAS_KV_SCALE=False, USE_NAN_GUARD=False, USE_FP32_DOT=False, IS_HIP=False, USE_L2_FENCES=False,
                  USE_PDL=False,
                  PAGE_SIZE=16, KV_HEADS=1, BLOCK_M=tiles.shared.block_m, BLOCK_N=tiles.shared.block_n,
                  BLOCK_D=tiles.block_d, HAS_V_HEAD_DIM=False, BLOCK_DV=tiles.block_d)
# Every integer scalar, strides included, as i32: the worst case, where only an explicit cast gives 64 bits.
floats = ("qk_scale", "soft_cap_log2", "v_scale")
signature = {name: pointers.get(name, "constexpr" if name in constexprs else "fp32" if name in floats else "i32")
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
    # (Any layout: a slice layout's encoding nests angle brackets.)
    assert re.search(r"%blk\w* = arith\.extsi %blk\w* : tensor<\d+xi32[^\n]*? to tensor<\d+xi64", ttgir)
    # The machine code multiplies in 64 bits.
    assert "mul.lo.s64" in ptx or "mul.wide.s32" in ptx


_AMD_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prefixattn.autotune.lookup import select_config
from prefixattn.autotune.targets import get_target
from prefixattn.tuning.compile_specs import fused_job
from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel as fn

t = get_target(sys.argv[1])
cfg = select_config(head_dim=128, dtype="bf16", group=4, max_q_len=1, target=t).config
job = fused_job(target=t, dtype="bf16", head_dim=128, config=cfg, variant="decode", has_lse=False)
src = ASTSource(fn=fn, signature=dict(job.signature), constexprs=dict(job.constexprs),
                attrs={tuple(k): v for k, v in job.attrs.items()})
ck = triton.compile(src, target=GPUTarget(t.backend, t.arch, t.warp_size), options=dict(job.options))
sys.stdout.write(ck.asm["amdgcn"])
"""

#: What each CDNA target emits for an agent-scope release before an atomic and for an acquire after one (the
#: AMDGPU memory model): gfx942's L2 is per XCD, so release writes it back and acquire invalidates it; gfx90a's L2 is
#: device-coherent, so only the per-CU L1 is invalidated on acquire. ``reset``: the counter's reset, an AND with 0
#: (LLVM makes it a swap of 0 on gfx90a).
_AMD_ORDERING = {"gfx942": {"release": "buffer_wbl2", "acquire": "buffer_inv sc1", "returns": " sc0",
                            "reset": "buffer_atomic_and"},
                 "gfx90a": {"release": None, "acquire": "buffer_wbinvl1_vol", "returns": " glc",
                            "reset": "global_atomic_swap"}}


@pytest.mark.compile
@pytest.mark.parametrize("arch", sorted(_AMD_ORDERING))
def test_merge_reports_are_ordered_on_amd(arch):
    """The in-launch merge on CDNA: every wave waits for its own workspace stores before the CTA barrier (a barrier
    orders LDS only; ``s_waitcnt vmcnt(0)`` counts stores on CDNA), the report is a release atomic, and only the
    merging path pays an acquire (its AND with 0 that resets the counter, then a cache invalidate) - none after
    the reports themselves. Under a Triton that misplaces the fences of gfx942's buffer atomics (before 3.9), the
    kernel writes them itself; Triton's own misplaced ones stay, so there the reports do pay an invalidate."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _AMD_SCRIPT, arch], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [ln.strip() for ln in run.stdout.splitlines() if ln.strip() and not ln.strip().startswith((";", "."))]
    rule = _AMD_ORDERING[arch]
    fences_by_hand = writes_own_l2_fences(arch)
    reports = [i for i, ln in enumerate(lines) if "atomic_add" in ln and rule["returns"] in ln]
    # The merging lane's acquire is the atomic that resets its counter to zero (no memset per layer).
    acquires = [i for i, ln in enumerate(lines) if rule["reset"] in ln]
    assert not [ln for ln in lines if "atomic" in ln and "atomic_add" not in ln and rule["reset"] not in ln]
    assert not [ln for ln in lines if "atomic_add" in ln and rule["returns"] not in ln], "every add is a report"
    # The inline-asm waits keep their ;;#ASMSTART markers in the raw text: count them there.
    # One report site: a work class's binary runs one kind of item (the shared class here).
    assert run.stdout.count(";;#ASMSTART\n\ts_waitcnt vmcnt(0)\n\t;;#ASMEND") == len(reports) == 1
    for i in reports:
        # The report follows the CTA barrier with no store in between (address arithmetic may sit there).
        barrier = max((j for j in range(i) if lines[j] == "s_barrier"), default=-1)
        assert 0 <= i - barrier <= 24, "the report follows the CTA barrier"
        since = lines[barrier:i]
        assert not [ln for ln in since if "_store" in ln], "no store between the barrier and the report"
        if rule["release"]:
            assert any(ln.startswith(rule["release"]) for ln in since), "release writes L2 back"
        if not fences_by_hand:
            assert not any(rule["acquire"] in ln for ln in lines[i:i + 12]), "reports pay no acquire"
    assert len(acquires) == 1
    for i in acquires:
        # The invalidate follows the acquire atomic before the CTA barrier that lets the other waves read states.
        inv = next(j for j in range(i, len(lines)) if rule["acquire"] in lines[j])
        barrier = next(j for j in range(i, len(lines)) if lines[j] == "s_barrier")
        assert inv < barrier, "the merging path invalidates before any wave reads the states"
