"""What one program of a work class's launch costs, calibrated on GPU measurements: the model plan() prices a step
with (the split rule's fixed cost and waves, ``Plan.stats``) and the benchmarks print as modeled step times.

A class's launch runs its programs (work item x KV head) in table order on ``num_sms x slots_per_sm`` slots, each
program on the next free slot. A program costs ``fixed_us`` (its start, first dependent loads and epilogue) plus
``tile_us`` per KV tile of ``block_n`` positions it reads, both at its binary's occupancy: at full occupancy the
programs of an SM share its bandwidth, which the per-tile cost already holds.

The numbers come from ``configs/<target>.program_cost.json``, fitted by ``bench/fit_program_cost.py`` to the
committed H100 tile sweeps (one entry per binary the sweeps ran: item kind, tile, warps, stages; its fit error
beside it). A binary the sweeps did not run is priced from the nearest measured binary of its kind, scaled by its
bytes per tile and its estimated occupancy (``source="scaled"``); a target without measurements from sm90's entries
scaled by its bandwidth per SM (``"analytic"``). Everything here is a model: label its outputs modeled.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
from dataclasses import dataclass, replace

from prefixattn.autotune.buckets import dtype_name
from prefixattn.autotune.config_space import DTYPE_BYTES, part_registers, part_shared_bytes
from prefixattn.autotune.targets import Target, get_target

#: plan() on a host without a known GPU prices steps for the tuning target, as it takes its SM count
#: (``prefixattn.planner.options.DEFAULT_NUM_SMS``).
DEFAULT_TARGET = "sm90"
#: Program costs with this format (``bench/fit_program_cost.py`` writes it).
COST_FORMAT = 1
#: Item kinds as the calibration names them: a shared class binary, and a suffix (chunk or decode) class binary.
KINDS = ("shared", "suffix")
#: Time between two dependent kernels on one stream (the first drains, the next starts), as a step's class launches
#: run: an assumption of ~2 us on H100 under CUDA graphs (published kernel-boundary figures are 1-3 us), not
#: measured here; the sweeps fit a whole replay's constant, not the gap between launches inside it.
LAUNCH_GAP_US = 2.0


@dataclass(frozen=True)
class ProgramCost:
    """One work class's program cost on one target (modeled)."""

    fixed_us: float
    tile_us: float  # per KV tile of block_n rows (positions of one KV head) at full residency (:func:`residency`)
    block_n: int
    slots_per_sm: int  # programs one SM holds at once (the binary's occupancy)
    source: str  # "calibrated", "scaled" or "analytic" (module docstring)
    #: KV heads a program attends: a tile's block_n rows hold block_n // kv_heads positions of each (a decode binary
    #: with several heads per program prices as the same tile, modeled: the same bytes and dots a step).
    kv_heads: int = 1

    @property
    def fixed_tokens(self) -> float:
        """The fixed cost in KV positions (of each of its heads) the same program reads in that time."""
        return self.fixed_us / self.tile_us * self.block_n / self.kv_heads if self.tile_us > 0 else 0.0



def residency(programs: int, *, num_sms: int, slots_per_sm: int) -> int:
    """Programs one SM holds at once in a launch of ``programs``: the hardware spreads programs over the SMs first,
    so with fewer than ``num_sms x slots_per_sm`` each SM holds ``ceil(programs / num_sms)``, and their tiles share
    its bandwidth among that many: a tile costs ``tile_us x residency / slots_per_sm`` (the H100 sweeps' small decode
    launches ran up to ~2x faster per tile than full ones)."""
    return min(slots_per_sm, max(1, -(-programs // num_sms)))


def binary_name(kind: str, block_m: int, block_n: int, num_warps: int, num_stages: int) -> str:
    """A binary's key in the calibration file: its item kind, tile and launch (``shared 128x64 w8 s3``)."""
    return f"{kind} {block_m}x{block_n} w{num_warps} s{num_stages}"


@functools.lru_cache(maxsize=None)
def calibration(target_name: str) -> dict:
    """The target's calibration file (``{}`` when it has none). A broken shipped file raises: a packaging bug."""
    path = importlib.resources.files("prefixattn.autotune").joinpath("configs", f"{target_name}.program_cost.json")
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("format") != COST_FORMAT or data.get("target") != target_name:
        raise ValueError(f"{path}: expected format {COST_FORMAT} for target {target_name!r}, got format "
                         f"{data.get('format')!r} for {data.get('target')!r}")
    return data


def _occupancy(kind: str, tiles, head_dim: int, dtype: str, launch, target: Target) -> int:
    """Estimated programs per SM of a binary the sweeps did not run (the analytic register and shared-memory fits of
    :mod:`~prefixattn.autotune.config_space`)."""
    regs = part_registers(tiles, head_dim, dtype, launch.num_warps, target)
    smem = part_shared_bytes(tiles, head_dim, dtype, launch.num_stages, target)
    threads = launch.num_warps * target.warp_size
    limits = [target.max_programs_per_sm, target.max_threads_per_sm // threads,
              target.regs_per_sm // max(1, regs * threads), target.shared_per_sm // max(1, smem)]
    return max(1, min(limits))


def program_cost(kind: str, block_m: int, block_n: int, launch, *, head_dim: int, dtype: str, kv_bytes: int,
                 target: Target) -> ProgramCost:
    """The modeled cost of one program of the binary (``kind`` of :data:`KINDS`, its tile and ``launch``
    options) for ``head_dim`` and K/V elements of ``kv_bytes`` bytes, on ``target``."""
    return _program_cost(kind, block_m, block_n, launch.num_warps, launch.num_stages, head_dim, dtype, kv_bytes,
                         target.name)


@functools.lru_cache(maxsize=1024)
def _program_cost(kind, block_m, block_n, num_warps, num_stages, head_dim, dtype, kv_bytes,
                  target_name) -> ProgramCost:
    from prefixattn.autotune.config_space import LaunchOptions, Tiles

    target = get_target(target_name)
    measured = calibration(target_name) or calibration(DEFAULT_TARGET)
    ref_target = target if calibration(target_name) else get_target(DEFAULT_TARGET)
    entries = {k: v for k, v in measured["binaries"].items() if k.startswith(kind + " ")}
    # K and V bytes per KV position relative to the calibration's (the per-tile cost is bandwidth: it scales so).
    bytes_ratio = head_dim * kv_bytes / (measured["head_dim"] * DTYPE_BYTES[measured["dtype"]])
    name = binary_name(kind, block_m, block_n, num_warps, num_stages)
    if name in entries:
        e, source = entries[name], "calibrated"
        slots, tile = e["slots_per_sm"], e["tile_us"]
    else:  # the nearest measured binary of the kind: same rows and KV tile first, then warps and stages
        def distance(key):
            _, tile, w, st = key.split()
            m, n = (int(x) for x in tile.split("x"))
            return (abs(math.log2(m / block_m)), abs(math.log2(n / block_n)), abs(math.log2(int(w[1:]) / num_warps)),
                    abs(int(st[1:]) - num_stages), key)

        e = entries[min(entries, key=distance)]
        launch = LaunchOptions(num_warps=num_warps, num_stages=num_stages)
        slots = _occupancy(kind, Tiles(block_m, block_n), head_dim, dtype, launch, target)
        # Per SM the same bandwidth: a tile of other width, or more programs sharing the SM, scales its time.
        tile = e["tile_us"] * (block_n / e["block_n"]) * (slots / e["slots_per_sm"])
        source = "scaled"
    if bytes_ratio != 1.0 and source == "calibrated":
        source = "scaled"
    tile *= bytes_ratio
    if ref_target is not target:  # another GPU: its bandwidth per SM against the calibrated one's
        tile *= (ref_target.mem_bw_gbs / ref_target.num_sms) / (target.mem_bw_gbs / target.num_sms)
        source = "analytic"
    return ProgramCost(fixed_us=float(e["fixed_us"]), tile_us=float(tile), block_n=block_n, slots_per_sm=int(slots),
                       source=source)


#: :func:`class_costs`' results by (tiles, head_dim, dtype, kv_bytes, target), tiles and target by identity and held
#: (the planner asks with the same objects step after step: a lookup instead of three cost fits a plan).
_class_costs_memo: dict = {}
_MAX_CLASS_COSTS = 256


def class_costs(tiles, *, head_dim: int, dtype, kv_bytes: int, target: Target | None = None) -> tuple:
    """``(shared, chunk, decode)`` :class:`ProgramCost` of a step's class binaries (``tiles``: its
    :class:`~prefixattn.planner.tiles.AttentionTiles`; ``dtype``: q's, a name or a torch dtype) on ``target`` (None:
    :data:`DEFAULT_TARGET`)."""
    key = (id(tiles), head_dim, dtype, kv_bytes, id(target))
    hit = _class_costs_memo.get(key)
    if hit is not None and hit[0] is tiles and hit[1] is target:
        return hit[2]
    name = dtype_name(dtype)
    on = target or get_target(DEFAULT_TARGET)
    out = tuple(_with_kv_heads(program_cost(kind, ct.block_m, ct.block_n, ct.launch, head_dim=head_dim, dtype=name,
                                            kv_bytes=kv_bytes, target=on), ct.kv_heads)
                for kind, ct in (("shared", tiles.shared), ("suffix", tiles.chunk), ("suffix", tiles.decode)))
    if len(_class_costs_memo) >= _MAX_CLASS_COSTS:
        _class_costs_memo.clear()
    _class_costs_memo[key] = (tiles, target, out)
    return out


def _with_kv_heads(cost: ProgramCost, kv_heads: int) -> ProgramCost:
    """``cost`` of the same binary attending ``kv_heads`` KV heads per program (its tile's rows shared among them)."""
    return cost if kv_heads == 1 else replace(cost, kv_heads=kv_heads)
