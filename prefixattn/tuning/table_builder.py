"""Building the shipped tile tables (``configs/<target>.json``) without a GPU: analytic choice, compile-verified.

For each target, head size, dtype and mode (decode: one query token per request; chunked prefill) the builder picks
ONE config for all the mode's buckets: the survivor of the pruned space with the least total relative slowdown
``sum over buckets of estimate(config, bucket) / estimate(best config for that bucket, bucket)`` under the analytic
cost model. One config per mode keeps the set of binaries small enough to compile-check every one of them for every
target (``prefixattn compile-check``); configs a compile report shows spilling or over the shared-memory limit are
excluded and the next best is taken. The table is written by work class (:mod:`prefixattn.autotune.tables`): a
decode config's shared and decode tiles in the decode rows, a chunked-prefill config's chunk tile and the shared
tile it was ranked with in the chunk rows. Measurements on a GPU override rows bucket by bucket in
``configs/<target>.measured.json`` (the same format, written by hand from a sweep's results, never by the builder).
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import replace
from pathlib import Path

from prefixattn.autotune import cost_model, tables
from prefixattn.autotune.buckets import Bucket, make_bucket
from prefixattn.autotune.config_space import (DTYPE_BYTES, HEAD_DIMS, LaunchOptions, attention_space,
                                              launch_space, part_registers, prune)
from prefixattn.autotune.targets import Target
from prefixattn.tuning.launch_limits import DECODE_SUFFIX_MAX_REGS, DECODE_SUFFIX_WARPS, required_pipeline_depth

#: The bucket grid of a shipped table: GQA groups of common models (MHA, Llama-3-8B's 4, up to 16), query tokens per
#: shared node from a small group to a big one, decode vs a prefill chunk, shared KV from a short system prompt to a
#: long document.
GRID_GROUPS = (1, 4, 16)
GRID_Q_ROWS = (16, 1024)
GRID_MAX_Q_LEN = {"decode": (1,), "chunked_prefill": (512,)}
GRID_KV_LEN = (1024, 16384)
#: Shared-memory estimate scale of the builder's second attempt (see best_cover).
SMEM_RETRY_FACTOR = 0.5
#: Group the mode's config must also serve (every M tile must hold one query row with all its GQA heads).
MAX_GROUP = 16


def grid(head_dim: int, dtype: str, mode: str) -> list[Bucket]:
    return [make_bucket(head_dim=head_dim, dtype=dtype, group=g, q_rows=q, max_q_len=l, kv_len=kv)
            for g in GRID_GROUPS for q in GRID_Q_ROWS for l in GRID_MAX_Q_LEN[mode] for kv in GRID_KV_LEN]


def _analytic_launch(lo: LaunchOptions, target: Target) -> bool:
    """Launch options the analytic tables may use: HIP knobs at Triton's defaults (the model cannot tell them apart;
    only timings can), and enough
    stages for the K/V tiles in flight compile-check requires."""
    if cost_model.tiles_in_flight(lo.num_stages, target) < required_pipeline_depth(target):
        return False  # compile-check fails a default below the depth (NVIDIA: num_stages >= 3)
    return lo.waves_per_eu == 0 and lo.matrix_instr_nonkdim == 0 and lo.kpack == 1


def _least_regret(candidates, buckets, target, has_shared, extra_row=None):
    """The candidate with the least total relative slowdown over ``buckets`` (None if none is finite).
    ``extra_row(candidate)``: more costs appended to the candidate's row (scored against their own column bests)."""
    costs = [[cost_model.estimate_seconds(c, b, target, has_shared=has_shared) for b in buckets]
             + (extra_row(c) if extra_row else []) for c in candidates]
    if not costs:
        return None
    best = [min(col) for col in zip(*costs)]
    scored = []
    for c, row in zip(candidates, costs):
        finite = all(math.isfinite(x) for x in row) and all(math.isfinite(b) for b in best)
        regret = sum(x / b for x, b in zip(row, best)) if finite else math.inf
        scored.append((regret, cost_model.knob_distance(c), c))
    scored.sort(key=lambda s: (s[0], s[1], s[2]))
    return scored[0][2] if math.isfinite(scored[0][0]) else None


def is_excluded(name: str, exclude) -> bool:
    """``name`` is in ``exclude``, or matches one of its patterns (``fnmatch``: a failed launch with shared items
    excludes every suffix-only launch option of the same binary, ``<name>_sfw*``)."""
    return name in exclude or any("*" in p and fnmatch.fnmatchcase(name, p) for p in exclude)


def _suffix_options(cfg, target, shape, exclude, mode="chunked_prefill"):
    options = [replace(cfg, suffix_launch=lo) for lo in launch_space(target) if _analytic_launch(lo, target)]
    options = [c for c in prune(options, target, **shape) if not is_excluded(c.short(), exclude)]
    if mode == "decode" and not target.is_hip:
        # Where nothing fits the budget (fp32 at head_dim 256: FMA dots hold both operands), the lightest ones.
        small = [c for c in options if part_registers(c.suffix, shape["head_dim"], shape["dtype"],
                                                      c.suffix_launch.num_warps, target) <= DECODE_SUFFIX_MAX_REGS]
        four = [c for c in small if c.suffix_launch.num_warps == DECODE_SUFFIX_WARPS]
        options = four or small or options
    return options


def _light_suffix_pool(pool, target, shape):
    """The configs of ``pool`` whose suffix tiles fit DECODE_SUFFIX_MAX_REGS at DECODE_SUFFIX_WARPS warps (all of
    ``pool`` when none does). The suffix tiles are one constexpr pair for both kinds of launches, so this must hold
    before the ranking: the model alone ranks 16x64 suffix tiles first (fewer, larger KV steps), which need 8 warps
    to stay under the budget."""
    def light(tiles):
        return part_registers(tiles, shape["head_dim"], shape["dtype"], DECODE_SUFFIX_WARPS,
                              target) <= DECODE_SUFFIX_MAX_REGS
    fits = [c for c in pool if light(c.suffix)]
    return fits or pool


def best_cover(target: Target, head_dim: int, dtype: str, mode: str, exclude=frozenset()):
    """The config with the least total relative slowdown over the mode's grid (None if nothing survives), with
    the suffix-only launch options chosen the same way for steps without shared nodes.

    The suffix tiles are one constexpr pair for both kinds of launches, so the ranking scores every candidate on
    both: its launch with shared items over the grid, plus its suffix tiles' best suffix-only launch over the grid
    (steps without shared nodes count as much as steps with them). Ranking on the shared launch alone picks the
    suffix tiles that suit 8 warps and 1 program per SM (16x128 on sm90), which a suffix-only decode launch then
    runs at ~230 registers, 1-2 programs per SM instead of 4 with 16x32 tiles.
    """
    buckets = grid(head_dim, dtype, mode)
    # The shared-memory estimate is loose (compiled kernels use 0.4-1.1x of it); when it leaves nothing, retry at
    # half of it and let compile-check judge (fp32 at head_dim 256 with the default 3 stages on a 99 KiB L40S).
    for smem_factor in (1.0, SMEM_RETRY_FACTOR):
        shape = dict(head_dim=head_dim, dtype=dtype, group=MAX_GROUP, smem_factor=smem_factor)
        pool = [c for c in prune(attention_space(target), target, **shape)
                if not is_excluded(c.short(), exclude) and _analytic_launch(c.launch, target)]
        if mode == "decode" and not target.is_hip:
            pool = _light_suffix_pool(pool, target, shape)
        suffix_rows: dict = {}

        def suffix_only_row(cfg):
            if cfg.suffix not in suffix_rows:
                rows = [[cost_model.estimate_seconds(c, b, target, has_shared=False) for b in buckets]
                        for c in _suffix_options(cfg, target, shape, exclude, mode)]
                suffix_rows[cfg.suffix] = min(rows, key=sum) if rows else [math.inf] * len(buckets)
            return suffix_rows[cfg.suffix]

        for cfg in _ranked(pool, buckets, target, suffix_only_row):
            chosen = _least_regret(_suffix_options(cfg, target, shape, exclude, mode), buckets, target, has_shared=False)
            if chosen is not None:
                return chosen
    return None


def _ranked(pool, buckets, target, extra_row=None):
    remaining = list(pool)
    while remaining:
        best = _least_regret(remaining, buckets, target, has_shared=True, extra_row=extra_row)
        if best is None:
            return
        yield best
        remaining.remove(best)


def build_table(target: Target, *, head_dims=HEAD_DIMS, dtypes=tuple(DTYPE_BYTES), exclude: dict | None = None,
                source: str = "analytic cost model (prefixattn.autotune.cost_model), compile-checked") -> dict:
    """The shipped table of ``target`` (:func:`prefixattn.autotune.tables.table_json`): :func:`best_cover`'s config of
    each head size, dtype and mode in every bucket of the mode's grid. ``exclude`` maps (head_dim, dtype) to names
    of configs to skip (:meth:`~prefixattn.autotune.config_space.AttentionConfig.short`), recorded in the table."""
    exclude = exclude or {}
    rows: dict = {}
    for head_dim in head_dims:
        for dtype in dtypes:
            for mode in GRID_MAX_Q_LEN:
                cfg = best_cover(target, head_dim, dtype, mode, frozenset(exclude.get((head_dim, dtype), ())))
                if cfg is not None:
                    rows.update({b: cfg for b in grid(head_dim, dtype, mode)})
    excluded = {f"d{hd}-{dt}": sorted(names) for (hd, dt), names in sorted(exclude.items()) if names}
    return tables.table_json(rows, target=target.name, source=source, excluded_after_compile_check=excluded)


def exclusions_from_table(path: Path) -> dict:
    """The exclusions an existing table recorded (so rebuilding never re-picks a config that failed before)."""
    if not Path(path).is_file():
        return {}
    out: dict = {}
    for key, names in json.loads(Path(path).read_text()).get("excluded_after_compile_check", {}).items():
        hd, dt = key[1:].split("-")
        out[(int(hd), dt)] = set(names)
    return out


def write_table(table: dict, directory: Path) -> Path:
    """Write ``table`` (:func:`build_table`) as ``directory/<target>.json``; returns the path."""
    return tables.write_table(table, Path(directory) / f"{table['target']}.json")
