"""What a fused-kernel launch must reach and may use on a target: K/V tiles in flight, and the register budget of a
decode-shaped suffix-only launch.

The shipped-table builder (:mod:`prefixattn.tuning.table_builder`) places configs within these limits; the compile
check (:mod:`prefixattn.tuning.compile_specs`, :mod:`prefixattn.tuning.compile_check`) fails a binary that does
not keep them.
"""

from __future__ import annotations

from prefixattn.autotune.targets import Target

#: K/V tiles a fused-kernel KV loop must keep in flight on targets with asynchronous global->shared copies (sm80+:
#: ``cp.async``; sm90 also TMA): with one, every iteration waits a full memory round trip (~0.6-1 us) before its dot.
MIN_PIPELINE_DEPTH = 2

#: Registers per thread a decode-shaped suffix-only launch may use on NVIDIA: at most 128 leaves room for
#: 4 programs of 4 warps (or 2 of 8) in the 64K-register file, 16 resident warps to hide the per-tile instruction
#: chains (max, exp, row sums, barriers) the analytic model prices per program only. Without it the model picks
#: 16x64 tiles at 4 warps (~194 registers measured on sm_90, 2 programs per SM): the same bytes in flight per SM,
#: so the model sees them as equal and the bigger tile's fewer round trips win on small batches.
DECODE_SUFFIX_MAX_REGS = 128
#: Warps of a decode-shaped suffix-only launch on NVIDIA where a config fits DECODE_SUFFIX_MAX_REGS at it (4 warps
#: at <= 128 registers, so 4 programs share an SM). Measured on sm_90 (compile-check, Triton 3.9, bf16,
#: head_dim 128): 16x32 tiles at 4 warps, 3 stages: 126 registers, 0 spills, 37 KB shared memory -> 4 programs and
#: 16 warps per SM, each program its own KV stream with its own round trips; 16x64 at 8 warps (what the model picks
#: unconstrained): 80 registers, 72 KB -> 3 programs, 24 warps. The model prices both the same on memory (the same
#: bytes in flight per SM) and cannot see the benefit of more independent streams; more, smaller programs also
#: shorten the tail of a split-k launch.
DECODE_SUFFIX_WARPS = 4


def required_pipeline_depth(target: Target) -> int:
    """K/V tiles in flight the fused kernel must reach on ``target``: ``MIN_PIPELINE_DEPTH`` on NVIDIA (``cp.async``
    since sm80: the block ids are loaded a tile ahead, so the pipeliner can issue the next tile's copies before this
    tile's dots), 0 (reported only) on AMD, where the stream pipeliner's register prefetch is the compiler's choice."""
    return 0 if target.is_hip else MIN_PIPELINE_DEPTH
