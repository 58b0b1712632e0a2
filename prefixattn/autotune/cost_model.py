"""Analytic cost of a fused-kernel config on a target: the stand-in for timings until a GPU measures them.

Everything that turns a config into a number lives here, behind one function (:func:`estimate_seconds`), so a table
of measured timings (``prefixattn tune``) replaces it without touching the lookup.

The model, per kind of program (shared-node tiles, suffix tiles) of one representative step:

* work per program: FLOPs of the two dots over the padded tile (``4 * BLOCK_M * kv_padded * BLOCK_D``; an M tile
  larger than the rows it holds still pays for every lane) and bytes moved (K and V of its KV range read once per
  program, query tile in, output tile out);
* occupancy: resident programs per SM/CU from registers, shared memory, threads and the program limit;
* one wave of resident programs takes the longest of its compute time, its memory time and its latency chain: the
  dependent memory round trips of one program (``ceil(KV tiles / tiles in flight)``, :func:`tiles_in_flight`, times
  the target's :data:`MEM_LATENCY_S`) plus the per-tile compute chain;
* the kernel takes ``ceil(programs / (SMs x occupancy))`` waves (the tail effect).

Bigger shared M tiles re-read the node's KV fewer times (the reason to share a prefix); bigger tiles cost
occupancy and padding. The numbers are datasheet peaks: only the ranking of configs is meant, never the seconds.

A planned step is priced by the calibrated model instead (:mod:`prefixattn.autotune.program_cost`: program costs
fitted to the H100 measurements); this one only ranks configs where no measurement exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prefixattn.autotune.buckets import Bucket
from prefixattn.autotune.config_space import (DTYPE_BYTES, AttentionConfig, LaunchOptions, Tiles, block_d,
                                              part_registers, part_shared_bytes)
from prefixattn.autotune.targets import Target

#: Dependent global-memory round trip per target (issue a load whose address depends on the previous one, use the
#: data: an HBM miss through L2). Assumed, not measured here: the order of published pointer-chase microbenchmarks
#: (several hundred ns on A100/H100, more on CDNA's larger fabric); one named constant per target, to be replaced by a
#: measurement on the device. The latency a KV loop exposes once per ``tiles_in_flight`` tiles.
MEM_LATENCY_S = {"sm80": 700e-9, "sm89": 700e-9, "sm90": 700e-9, "gfx90a": 900e-9, "gfx942": 900e-9,
                 "gfx950": 900e-9}
#: Any other target (a Target built by hand).
DEFAULT_MEM_LATENCY_S = 700e-9
#: Dependent chain of one KV step after its loads land (dot, row max, exp, dot): a few hundred cycles at ~1.5 GHz.
STEP_CHAIN_S = 150e-9
#: Per-step work that overlaps with nothing (loop control, barriers around the shared-memory ring, row-statistics
#: updates): a few dozen cycles. It is what makes fewer, larger KV steps cheaper when memory time dominates.
STEP_OVERHEAD_S = 30e-9
#: What one SM/CU can pull from L2/HBM on its own (~64 B/cycle at 1.4-2.1 GHz): with few busy SMs, each gets more
#: than its 1/num_sms share of HBM bandwidth, up to this.
SM_MAX_BW_GBS = 100.0
#: Fixed cost of starting a program (argument loads, work-item decode, epilogue stores): ~1 microsecond.
PROGRAM_OVERHEAD_S = 1e-6
#: Representative step: KV heads of the 7-8B models BatchLLM evaluates (Llama-3-8B, Mistral-7B), tokens per step
#: (BatchLLM's 2048-token chunk with prefill, 256 decoding requests without), and the distinct (suffix) KV length
#: per request (BatchLLM's microbenchmarks use 200-2000 distinct tokens).
NUM_KV_HEADS = 8
PREFILL_STEP_TOKENS = 2048
DECODE_STEP_TOKENS = 256
SUFFIX_KV_LEN = 512


@dataclass(frozen=True)
class PartWork:
    """The programs of one kind in the representative step."""

    programs: int
    rows: int  # valid (query row x head) lanes per program
    kv_len: int  # keys each program attends to


def step_work(bucket: Bucket, cfg: AttentionConfig) -> tuple[PartWork, PartWork]:
    """(shared, suffix) work of the representative step of ``bucket`` under ``cfg``'s M tiles."""
    step_tokens = PREFILL_STEP_TOKENS if bucket.max_q_len > 1 else DECODE_STEP_TOKENS
    nodes = max(1, step_tokens // bucket.q_rows)
    shared_rows = bucket.q_rows * bucket.group
    shared_programs = nodes * math.ceil(shared_rows / cfg.shared.block_m) * NUM_KV_HEADS
    requests = max(1, step_tokens // bucket.max_q_len)
    suffix_rows = bucket.max_q_len * bucket.group
    suffix_programs = requests * math.ceil(suffix_rows / cfg.suffix.block_m) * NUM_KV_HEADS
    return (PartWork(shared_programs, min(shared_rows, cfg.shared.block_m), bucket.kv_len),
            PartWork(suffix_programs, min(suffix_rows, cfg.suffix.block_m), max(bucket.max_q_len, SUFFIX_KV_LEN)))


def occupancy(cfg: AttentionConfig, bucket: Bucket, target: Target, registers: int | None = None,
              shared_bytes: int | None = None, has_shared: bool = True) -> int:
    """Resident programs per SM/CU of the shared class's binary (``has_shared``) or a suffix class's (the config's
    suffix tiles under its suffix launch). ``registers``/``shared_bytes`` override the estimates (measured
    values)."""
    lo = cfg.launch_for(has_shared)
    tiles = cfg.shared if has_shared else cfg.suffix
    est_regs = part_registers(tiles, bucket.head_dim, bucket.dtype, lo.num_warps, target)
    est_smem = part_shared_bytes(tiles, bucket.head_dim, bucket.dtype, lo.num_stages, target)
    regs = registers if registers is not None else est_regs
    smem = shared_bytes if shared_bytes is not None else est_smem
    threads = lo.num_warps * target.warp_size
    limits = [target.max_programs_per_sm, target.max_threads_per_sm // threads,
              target.regs_per_sm // max(1, regs * threads)]
    if smem > 0:
        # The prune already admitted this program's shared memory (its estimate is loose): at least one fits.
        limits.append(max(1, target.shared_per_sm // smem))
    if target.is_hip and lo.waves_per_eu:
        # The hint caps registers so that this many waves fit per SIMD; occupancy is at least that.
        limits = [max(min(limits), lo.waves_per_eu * 4 // lo.num_warps)]
    return max(0, min(limits))


def mem_latency_s(target: Target) -> float:
    """The dependent global-memory round trip of ``target`` (:data:`MEM_LATENCY_S`)."""
    return MEM_LATENCY_S.get(target.name, DEFAULT_MEM_LATENCY_S)


def tiles_in_flight(num_stages: int, target: Target) -> int:
    """K/V tiles one program keeps in flight at ``num_stages`` (what ``prefixattn compile-check`` reads from the
    compiled loops): with asynchronous copies (NVIDIA, gfx950) one stage is the tile being consumed, so
    ``num_stages - 1`` (sm_90, num_stages 3: ``async_wait {num = 2}`` with K and V one commit group each: 2);
    AMD's stream pipeliner loads the next tile into registers during this one (gfx90a/gfx942, num_stages 2: one
    LDS buffer + the prefetch: 2)."""
    if target.is_hip and not target.async_copy:
        return max(1, num_stages)
    return max(1, num_stages - 1)


def round_trips(kv_tiles, depth: int):
    """Dependent memory round trips of a loop over ``kv_tiles`` tiles (an int >= 0, or an array of them) with
    ``depth`` of them in flight."""
    return -(-kv_tiles // max(1, depth))


def program_seconds(*, steps, depth: int, flops, bytes_moved, resident: int, bw: float, target: Target,
                    dtype: str, tail_round_trips=0):
    """Modelled time of one program (scalars, or numpy arrays of programs) sharing its SM/CU with ``resident - 1``
    others: the longest of its compute (``resident`` programs' FLOPs on one SM's share of the matrix peak), its
    memory (their bytes at ``bw`` bytes/s per SM) and its latency chain (:func:`round_trips` of ``steps`` KV tiles at
    ``depth`` in flight, plus the per-tile compute chain), plus per-step and per-program fixed costs and
    ``tail_round_trips`` dependent round trips after the loop (merge reports and merges)."""
    peak = (target.fp32_tflops if dtype == "fp32" else target.matmul_tflops) * 1e12 / target.num_sms
    latency = round_trips(steps, depth) * mem_latency_s(target) + steps * STEP_CHAIN_S
    return (np.maximum(np.maximum(resident * flops / peak, resident * bytes_moved / bw), latency)
            + steps * STEP_OVERHEAD_S + PROGRAM_OVERHEAD_S + tail_round_trips * mem_latency_s(target))


def sm_bandwidth(programs: int, target: Target) -> float:
    """Bytes/s one busy SM/CU gets: its share of HBM among the busy ones (idle SMs leave theirs to the others), up
    to what one SM can pull (:data:`SM_MAX_BW_GBS`)."""
    active_sms = max(1, min(target.num_sms, programs))
    return min(target.mem_bw_gbs * 1e9 / active_sms, SM_MAX_BW_GBS * 1e9)


def _part_seconds(tiles: Tiles, work: PartWork, bucket: Bucket, launch, target: Target, occ: int) -> float:
    if work.programs == 0:
        return 0.0
    bd = block_d(bucket.head_dim)
    b = DTYPE_BYTES[bucket.dtype]
    steps = math.ceil(work.kv_len / tiles.block_n)
    flops = 4.0 * tiles.block_m * steps * tiles.block_n * bd
    bytes_moved = 2.0 * work.kv_len * bd * b + 2.0 * work.rows * bd * b
    # A partial wave leaves SMs with fewer resident programs than the occupancy allows.
    resident = min(occ, math.ceil(work.programs / target.num_sms))
    wave = program_seconds(steps=steps, depth=tiles_in_flight(launch.num_stages, target), flops=flops,
                           bytes_moved=bytes_moved, resident=resident, bw=sm_bandwidth(work.programs, target),
                           target=target, dtype=bucket.dtype)
    waves = math.ceil(work.programs / (target.num_sms * resident))
    return float(waves * wave)


def estimate_seconds(cfg: AttentionConfig, bucket: Bucket, target: Target, *, registers: int | None = None,
                     shared_bytes: int | None = None, has_shared: bool = True) -> float:
    """Modelled time of the representative step of ``bucket``; ``inf`` when ``cfg`` cannot be resident at all.

    The shared and the suffix programs are launches of their own classes, each at its binary's occupancy; the model
    adds their times. ``has_shared=False`` models a step without shared nodes: every query row is suffix work.
    ``registers``/``shared_bytes``: measured values of the binary of ``has_shared``'s class.
    """
    occ_suffix = occupancy(cfg, bucket, target, None if has_shared else registers,
                           None if has_shared else shared_bytes, has_shared=False)
    if occ_suffix < 1:
        return math.inf
    shared, suffix = step_work(bucket, cfg)
    if not has_shared:
        # Every request already has its suffix programs; unshared, each also reads the prefix KV itself.
        suffix = PartWork(suffix.programs, suffix.rows, suffix.kv_len + bucket.kv_len)
        return _part_seconds(cfg.suffix, suffix, bucket, cfg.launch_for(False), target, occ_suffix)
    occ_shared = occupancy(cfg, bucket, target, registers, shared_bytes, has_shared=True)
    if occ_shared < 1:
        return math.inf
    return (_part_seconds(cfg.shared, shared, bucket, cfg.launch, target, occ_shared)
            + _part_seconds(cfg.suffix, suffix, bucket, cfg.launch_for(False), target, occ_suffix))


def knob_distance(cfg: AttentionConfig) -> tuple:
    """Tie-break toward Triton's defaults: configs the model cannot tell apart should change as little as possible.
    The suffix-only launch counts after the shared one (without it, configs differing only in ``suffix_launch`` tie
    and the name order picks: 2 warps and ``num_stages`` 1 on gfx942 decode, the first name in sort order)."""
    def dist(lo: LaunchOptions) -> tuple:
        return (lo.waves_per_eu != 0, lo.matrix_instr_nonkdim != 0, lo.kpack != 1, abs(lo.num_warps - 4),
                abs(lo.num_stages - 2))

    return dist(cfg.launch) + dist(cfg.launch_for(False))


def rank(configs, bucket: Bucket, target: Target) -> list[tuple[float, AttentionConfig]]:
    """``(seconds, config)`` best first; ties broken toward default knobs, then by config order (deterministic)."""
    scored = [(estimate_seconds(c, bucket, target), c) for c in configs]
    scored.sort(key=lambda sc: (sc[0], knob_distance(sc[1]), sc[1]))
    return scored
