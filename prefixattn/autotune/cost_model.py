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

The same program terms (:func:`program_seconds`) also price a real work list (:func:`launch_time`, issue 14's
evidence, ``bench/test_kernel_time_modeled.py``): every planned item's programs, its merge reports, a launch that
takes the longest of its longest program, its programs over the SM slots and its roofline; the kernel's structure
(tiles in flight, split rule, merge scheme) is a parameter (:class:`KernelStructure`), and :func:`cascade_time`
applies it to a three-launch cascade of the same work. Modelled seconds, labelled so wherever they are printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prefixattn.autotune.buckets import Bucket, make_bucket
from prefixattn.autotune.config_space import (DTYPE_BYTES, AttentionConfig, LaunchOptions, Tiles, block_d,
                                              config_registers, config_shared_bytes, part_registers,
                                              part_shared_bytes)
from prefixattn.autotune.targets import Target
from prefixattn.kernels import layout as K

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
    """Resident programs per SM/CU. ``registers``/``shared_bytes`` override the estimates (measured values);
    ``has_shared=False``: a launch of suffix items only (the shared branch compiled out)."""
    lo = cfg.launch_for(has_shared)
    if has_shared:
        est_regs = config_registers(cfg, bucket.head_dim, bucket.dtype, target)
        est_smem = config_shared_bytes(cfg, bucket.head_dim, bucket.dtype, target)
    else:
        est_regs = part_registers(cfg.suffix, bucket.head_dim, bucket.dtype, lo.num_warps, target)
        est_smem = part_shared_bytes(cfg.suffix, bucket.head_dim, bucket.dtype, lo.num_stages, target)
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

    Both kinds of programs share the SMs of one launch; the model adds their times (the fused launch removes the
    second launch's tail and overhead, not the work). ``has_shared=False`` models a step without shared nodes: every
    query row is suffix work, under ``cfg.suffix_launch``.
    """
    occ = occupancy(cfg, bucket, target, registers, shared_bytes, has_shared)
    if occ < 1:
        return math.inf
    lo = cfg.launch_for(has_shared)
    shared, suffix = step_work(bucket, cfg)
    if not has_shared:
        # Every request already has its suffix programs; unshared, each also reads the prefix KV itself.
        suffix = PartWork(suffix.programs, suffix.rows, suffix.kv_len + bucket.kv_len)
        return _part_seconds(cfg.suffix, suffix, bucket, lo, target, occ)
    return (_part_seconds(cfg.shared, shared, bucket, lo, target, occ)
            + _part_seconds(cfg.suffix, suffix, bucket, lo, target, occ))


def _knob_distance(cfg: AttentionConfig) -> tuple:
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
    scored.sort(key=lambda sc: (sc[0], _knob_distance(sc[1]), sc[1]))
    return scored


# ---------------------------------------------------------------------------------------------------------------
# Modelled time of one planned launch (issue 14's evidence): the program terms above over a real work list.
# ---------------------------------------------------------------------------------------------------------------

#: Sim hardware preset of each target's reference product, for the launch overhead (prefixattn.sim.presets).
TARGET_HARDWARE = {"sm80": "a100", "sm90": "h100", "gfx90a": "mi250x-gcd", "gfx942": "mi300x"}
#: Launch overhead of a target without a sim preset (the NVIDIA presets' value).
DEFAULT_LAUNCH_OVERHEAD_S = 4e-6
#: Dependent round trips of one report to a merge unit (load the counter row, atomic add with acq_rel: the address
#: of the atomic depends on the load) and of one merge of a completed unit (load its states, then store).
REPORT_ROUND_TRIPS = 1
MERGE_ROUND_TRIPS = 1
#: Heads one program of the merge kernel combines (its BLOCK_H: one program per (token, head tile)).
MERGE_HEADS_PER_PROGRAM = 8
SPLIT_RULES = ("critical_path", "program_count")
MERGE_SCHEMES = ("vector", "serial")


@dataclass(frozen=True)
class KernelStructure:
    """The structure of the fused kernel as parameters of one model: ``pipelined`` (block ids loaded a tile ahead,
    so ``num_stages - 1`` K/V tiles in flight; ``False``: the block-table load inside the loop, one tile), the split
    rule (``"critical_path"``: :mod:`prefixattn.split_rule`; ``"program_count"``: split only while ``items x KV
    heads < SMs``, one program per SM of equal KV work, at least ``min_split_tokens``), and the merge
    (``"vector"``: one report to all of a program's units, one masked merge pass; ``"serial"``: one report and one
    merge per unit in turn)."""

    pipelined: bool = True
    split: str = "critical_path"
    merge: str = "vector"

    def __post_init__(self):
        if self.split not in SPLIT_RULES:
            raise ValueError(f"split: expected one of {SPLIT_RULES}, got {self.split!r}")
        if self.merge not in MERGE_SCHEMES:
            raise ValueError(f"merge: expected one of {MERGE_SCHEMES}, got {self.merge!r}")


#: Today's kernel, and the one issue 14 read (1 tile in flight, program-count split, serial merge reports).
AFTER = KernelStructure()
BEFORE = KernelStructure(pipelined=False, split="program_count", merge="serial")


@dataclass(frozen=True)
class Ranges:
    """KV ranges of one launch, one entry per work item (split pieces are separate entries), all ``[n]`` int64:
    ``kind`` (layout.KIND_SHARED / KIND_SUFFIX), ``kv_len`` (tokens), ``rows`` (query rows of the item), ``units``
    (merge units it reports to: 0 writes straight to the output), ``states`` (partial states per row of its units,
    for the merge bytes)."""

    kind: np.ndarray
    kv_len: np.ndarray
    rows: np.ndarray
    units: np.ndarray
    states: np.ndarray

    def select(self, mask) -> "Ranges":
        return Ranges(*(getattr(self, f)[mask] for f in ("kind", "kv_len", "rows", "units", "states")))


@dataclass(frozen=True)
class LaunchTime:
    """Modelled time of one launch and what it is made of (seconds, bytes, FLOPs; all modelled)."""

    seconds: float
    makespan: float  # max(longest program, programs' time over the slots)
    floor: float  # max(bytes / HBM bandwidth, FLOPs / peak): the roofline of this launch's own traffic
    overhead: float  # launch overhead
    programs: int
    occupancy: int  # resident programs per SM (the occupancy, fewer when the launch has fewer programs)
    bytes: float
    flops: float
    critical_program: float  # the longest program's time
    critical_round_trips: float  # its dependent round trips (KV loop + merge tail; merges spread over pieces)
    mean_round_trips: float


def launch_overhead_s(target: Target) -> float:
    """Device-side gap per kernel launch of the sim preset of ``target`` (an assumption there, labelled so)."""
    name = TARGET_HARDWARE.get(target.name)
    if name is None:
        return DEFAULT_LAUNCH_OVERHEAD_S
    from prefixattn.sim.presets import get_hardware  # lazy: the sim package is not needed for tuning

    return get_hardware(name).launch_overhead_s


def roofline_floor(*, bytes_moved: float, flops: float, target: Target, dtype: str = "bf16") -> float:
    """``max(bytes / HBM bandwidth, FLOPs / matrix peak)``: no kernel moving and computing this finishes sooner."""
    peak = (target.fp32_tflops if dtype == "fp32" else target.matmul_tflops) * 1e12
    return max(bytes_moved / (target.mem_bw_gbs * 1e9), flops / peak)


def ranges_from_work(items: np.ndarray, gather: np.ndarray, mrows: np.ndarray) -> Ranges:
    """The work items of a planned launch (``prefixattn.Plan.work``: ``items``, ``gather``, ``mrows``, the int32
    tables of :mod:`prefixattn.kernels.layout`) as :class:`Ranges`."""
    items = items.astype(np.int64)
    n = items.shape[0]
    kind = items[:, K.ITEM_KIND]
    kv_len = np.maximum(items[:, K.ITEM_KV_END] - items[:, K.ITEM_KV_START], 0)
    rows = items[:, K.ITEM_NUM_ROWS]
    # Merge rows are laid out unit by unit, each unit's rows at consecutive workspace rows; the next unit starts
    # past all of this one's states (>= 2), so a unit starts where WS_FIRST does not step by one.
    first = mrows[:, K.MROW_WS_FIRST].astype(np.int64)
    unit_of = np.cumsum(np.r_[True, first[1:] != first[:-1] + 1]) - 1 if first.size else first
    units = np.zeros(n, np.int64)
    states = np.ones(n, np.int64)
    suffix = np.flatnonzero((kind == K.KIND_SUFFIX) & (items[:, K.ITEM_MROW] >= 0))
    units[suffix] = 1
    states[suffix] = mrows[items[suffix, K.ITEM_MROW], K.MROW_NUM_STATES]
    shared = np.flatnonzero(kind == K.KIND_SHARED)
    if shared.size:
        per = rows[shared]
        item_of_row = np.repeat(np.arange(shared.size), per)
        g = np.repeat(items[shared, K.ITEM_ROW_START] - np.cumsum(per) + per, per) + np.arange(per.sum())
        mrow = gather[g, K.GATHER_MROW].astype(np.int64)
        pairs = np.unique(np.stack([item_of_row, unit_of[mrow]]), axis=1)
        units[shared] = np.bincount(pairs[0], minlength=shared.size)
        states[shared] = mrows[gather[items[shared, K.ITEM_ROW_START], K.GATHER_MROW], K.MROW_NUM_STATES]
    return Ranges(kind=kind, kv_len=kv_len, rows=rows, units=units, states=states)


def ranges_from_plan(plan) -> Ranges:
    """:func:`ranges_from_work` of a :class:`prefixattn.Plan`'s host tables."""
    return ranges_from_work(plan.work.items, plan.work.gather, plan.work.mrows)


def config_from_tiles(tiles, suffix_class: int = K.CLASS_DECODE) -> AttentionConfig:
    """A config of a plan's :class:`~prefixattn.attention_configs.AttentionTiles` (``plan.tiles``): its shared
    class and one suffix class (``suffix_class``)."""
    suffix = tiles.of(suffix_class)
    return AttentionConfig(Tiles(tiles.shared.block_m, tiles.shared.block_n), Tiles(suffix.block_m, suffix.block_n),
                           tiles.shared.launch, suffix.launch)


def split_counts(r: Ranges, rule: str, *, block_n_shared: int, block_n_suffix: int, num_kv_heads: int,
                 num_sms: int, min_split_tokens: int) -> tuple[np.ndarray, int, int]:
    """``(pieces per entry, shared grain, suffix grain)`` of the unsplit ranges ``r`` (a plan built with
    ``num_sms=1``) under ``rule`` (:data:`SPLIT_RULES`)."""
    from prefixattn.split_rule import split_ranges

    shared = r.kind == K.KIND_SHARED
    if rule == "critical_path":
        node_pieces, g_sh, tile_pieces, g_sf = split_ranges(
            node_lengths=r.kv_len[shared], node_m_tiles=np.ones(int(shared.sum()), np.int64),
            tile_lengths=r.kv_len[~shared], tile_decode=True, block_n_shared=block_n_shared,
            block_n_chunk=block_n_suffix, block_n_decode=block_n_suffix, num_kv_heads=num_kv_heads, num_sms=num_sms,
            min_split_tokens=min_split_tokens)
        pieces = np.zeros(r.kind.size, np.int64)
        pieces[shared], pieces[~shared] = node_pieces, tile_pieces
        return pieces, g_sh, g_sf
    # Issue 14's rule: split only while items x KV heads leave SMs idle, then one program per SM of equal KV work
    # (at least min_split_tokens), at most one piece per KV tile.
    nonzero = int(np.count_nonzero(r.kv_len))
    if nonzero == 0 or nonzero * num_kv_heads >= num_sms:
        return (r.kv_len > 0).astype(np.int64), block_n_shared, block_n_suffix
    chunk = max(min_split_tokens, -(-int(r.kv_len.sum()) * num_kv_heads // num_sms))
    grain = np.where(shared, block_n_shared, block_n_suffix)
    return np.minimum(-(-r.kv_len // chunk), -(-r.kv_len // grain)), block_n_shared, block_n_suffix


def resplit(r: Ranges, rule: str, **split) -> Ranges:
    """The unsplit ranges ``r`` split by ``rule`` (:func:`split_counts`), each piece a separate entry in the order
    of ``r``: a split range's rows get one more state per extra piece, and a split suffix tile a merge unit."""
    from prefixattn.work_list import _piece_bounds

    pieces, g_sh, g_sf = split_counts(r, rule, **split)
    shared = r.kind == K.KIND_SHARED
    idx = np.repeat(np.arange(r.kind.size), pieces)
    piece = np.arange(idx.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    grain = np.where(shared[idx], g_sh, g_sf)
    lo, hi = _piece_bounds(np.zeros(idx.size, np.int64), r.kv_len[idx], piece, pieces[idx], grain)
    extra = pieces[idx] - 1
    split_suffix = (~shared[idx]) & (extra > 0)
    return Ranges(kind=r.kind[idx], kv_len=hi - lo, rows=r.rows[idx],
                  units=np.where(split_suffix, np.maximum(r.units[idx], 1), r.units[idx]),
                  states=r.states[idx] + extra)


@dataclass(frozen=True)
class _Programs:
    """Per-entry arrays of one launch (every entry ``count`` identical programs): KV ``steps``, ``bytes`` and
    ``flops`` per program, ``tail`` round trips after the loop; ``depth`` K/V tiles in flight."""

    steps: np.ndarray
    count: np.ndarray
    bytes: np.ndarray
    flops: np.ndarray
    tail: np.ndarray
    depth: int


def _schedule(p: _Programs, *, occ: int, target: Target, dtype: str) -> LaunchTime:
    """The launch of programs ``p``, no sooner than any of: its longest program alone on an SM (with what one SM
    can pull, :data:`SM_MAX_BW_GBS`), its programs' time at the occupancy spread over the SM slots (the work list
    is longest first, so LPT order), and its roofline; plus one launch overhead."""
    programs = int(p.count.sum())
    over = launch_overhead_s(target)
    if programs == 0:
        return LaunchTime(0.0, 0.0, 0.0, 0.0, 0, occ, 0.0, 0.0, 0.0, 0.0, 0.0)
    resident = min(occ, math.ceil(programs / target.num_sms))
    common = dict(steps=p.steps, depth=p.depth, flops=p.flops, bytes_moved=p.bytes, target=target, dtype=dtype,
                  tail_round_trips=p.tail)
    shared = program_seconds(resident=resident, bw=sm_bandwidth(programs, target), **common)
    alone = program_seconds(resident=1, bw=SM_MAX_BW_GBS * 1e9, **common)
    total_bytes, total_flops = float((p.bytes * p.count).sum()), float((p.flops * p.count).sum())
    longest = int(np.argmax(alone))
    makespan = max(float(alone[longest]), float((shared * p.count).sum()) / (target.num_sms * resident))
    floor = roofline_floor(bytes_moved=total_bytes, flops=total_flops, target=target, dtype=dtype)
    rts = round_trips(p.steps, p.depth) + p.tail
    return LaunchTime(seconds=max(makespan, floor) + over, makespan=makespan, floor=floor, overhead=over,
                      programs=programs, occupancy=resident, bytes=total_bytes, flops=total_flops,
                      critical_program=float(alone[longest]), critical_round_trips=float(rts[longest]),
                      mean_round_trips=float((rts * p.count).sum()) / programs)


def launch_time(r: Ranges, cfg: AttentionConfig, target: Target, *, head_dim: int, dtype: str, group: int,
                num_kv_heads: int, structure: KernelStructure = AFTER, has_shared: bool | None = None,
                in_kernel_merge: bool = True) -> LaunchTime:
    """Modelled time of one launch of the fused kernel over ``r`` (every entry run once per KV head).

    Per program (:func:`program_seconds`): the padded tiles' FLOPs; K and V of its range, its query rows and its
    output (fp32 partial states for rows with units) in bytes; the KV loop's round trips at ``structure``'s tiles in
    flight, and its merge tail: a shared-node program is taken to complete its units (shared tiles usually arrive
    last), so ``"serial"`` pays a report and a merge round trip per unit and ``"vector"`` one report and one merge
    pass; a suffix program with a unit one report. ``in_kernel_merge=False`` (a cascade's attention launches): no
    reports, the states are merged by a later launch. Occupancy from ``cfg``'s launch with or without shared items.
    """
    has_shared = bool((r.kind == K.KIND_SHARED).any()) if has_shared is None else has_shared
    occ = occupancy(cfg, make_bucket(head_dim=head_dim, dtype=dtype, group=group, q_rows=1, max_q_len=1,
                                     kv_len=1), target, has_shared=has_shared)
    lo = cfg.launch_for(has_shared)
    depth = tiles_in_flight(lo.num_stages, target) if structure.pipelined else 1
    shared = r.kind == K.KIND_SHARED
    block_m = np.where(shared, cfg.shared.block_m, cfg.suffix.block_m)
    block_n = np.where(shared, cfg.shared.block_n, cfg.suffix.block_n)
    elt, bd = DTYPE_BYTES[dtype], block_d(head_dim)
    steps = -(-r.kv_len // block_n)
    lanes = (r.rows * group).astype(np.float64)
    to_ws = r.units > 0
    out_bytes = lanes * np.where(to_ws, head_dim * 4 + 4, head_dim * elt)
    nbytes = 2.0 * r.kv_len * head_dim * elt + lanes * head_dim * elt + out_bytes
    flops = 4.0 * block_m * steps * block_n * bd
    tail = np.zeros(r.kind.size, np.float64)
    if in_kernel_merge:
        # Reports: every program with units; "serial" one per unit in turn. Merges: each unit once, by its last
        # arriver, taken to be a shared-node program, spread evenly over the shared pieces of its rows (states - 1
        # of them when the suffix is one piece).
        reports = np.where(structure.merge == "serial", r.units, 1) * REPORT_ROUND_TRIPS * to_ws
        merges = np.where(structure.merge == "serial", r.units, 1) * MERGE_ROUND_TRIPS
        share = np.where(shared & to_ws, 1.0 / np.maximum(r.states - 1, 1), 0.0)
        tail = reports + share * merges
        nbytes = nbytes + share * lanes * (r.states * (head_dim + 1) * 4 + head_dim * elt)
    count = np.full(r.kind.size, num_kv_heads, np.int64)
    return _schedule(_Programs(steps, count, nbytes, flops, tail, depth), occ=occ, target=target, dtype=dtype)


def cascade_time(unsplit: Ranges, cfg: AttentionConfig, target: Target, *, head_dim: int, dtype: str, group: int,
                 num_kv_heads: int, min_split_tokens: int, structure: KernelStructure = AFTER) -> list[LaunchTime]:
    """The same model applied to a three-launch cascade (FlashInfer-style) over the same work: shared-node
    attention (its ranges split by ``structure.split`` against their own launch's fair share), per-request suffix
    attention (suffix-only occupancy, split likewise), then a merge launch over every row with more than one state
    (one program per token and :data:`MERGE_HEADS_PER_PROGRAM` heads: its states in, the output out). Same tiles,
    tiles in flight and per-program costs as the fused launch; each launch pays its own overhead and tail. Shapes
    without shared nodes run the suffix launch (and a merge only if it splits). ``unsplit``: a plan with
    ``num_sms=1``."""
    shared = unsplit.kind == K.KIND_SHARED
    split = dict(block_n_shared=cfg.shared.block_n, block_n_suffix=cfg.suffix.block_n, num_kv_heads=num_kv_heads,
                 num_sms=target.num_sms, min_split_tokens=min_split_tokens)
    common = dict(head_dim=head_dim, dtype=dtype, group=group, num_kv_heads=num_kv_heads, structure=structure,
                  in_kernel_merge=False)
    launches = []
    if shared.any():
        launches.append(launch_time(resplit(unsplit.select(shared), structure.split, **split), cfg, target,
                                    has_shared=True, **common))
    suffix = resplit(unsplit.select(~shared), structure.split, **split)
    launches.append(launch_time(suffix, cfg, target, has_shared=False, **common))
    # Rows merged by the third launch: every suffix row with a shared state or split pieces (its states: shared
    # levels + 1, plus the tile's extra pieces).
    sf = unsplit.select(~shared)
    extra = split_counts(sf, structure.split, **split)[0] - 1
    states = sf.states + np.maximum(extra, 0)
    merged = (sf.units > 0) | (extra > 0)
    if merged.any():
        elt = DTYPE_BYTES[dtype]
        rows = sf.rows[merged].astype(np.float64)
        heads = group * num_kv_heads
        per_prog = MERGE_HEADS_PER_PROGRAM * (states[merged] * (head_dim + 1) * 4.0 + head_dim * elt)
        count = (rows * math.ceil(heads / MERGE_HEADS_PER_PROGRAM)).astype(np.int64)
        zeros = np.zeros(per_prog.size)
        # The merge kernel is light (a few dozen registers): the SM's program limit bounds its occupancy.
        launches.append(_schedule(_Programs(zeros.astype(np.int64), count, per_prog, zeros,
                                            np.full(per_prog.size, float(MERGE_ROUND_TRIPS)), 1),
                                  occ=target.max_programs_per_sm, target=target, dtype=dtype))
    return launches

