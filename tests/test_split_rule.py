"""The split-k rule (prefixattn.planner.split_rule): plan-level checks, no kernel runs.

The full-size shapes are planned for an H100 (the sm90 table's tiles and program costs, 132 SMs) on this CPU host:
plan() builds only host tables, so the whole grid (109 plans) takes a few seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.batches.shapes import DTYPES, Shape, build_batch, fig8_shapes
from prefixattn import plan
from prefixattn.autotune.buckets import dtype_name
from prefixattn.autotune.lookup import planning_target
from prefixattn.autotune.program_cost import LAUNCH_GAP_US, ProgramCost, class_costs, residency
from prefixattn.autotune.targets import get_target
from prefixattn.kernels import layout as K
from prefixattn.planner.split_rule import (CRITICAL_PATH_TARGET, MIN_PIECE_OVERHEADS, SPLIT_TOLERANCE, WAVE_GAIN_MIN,
                                   class_split, modeled_makespan, piece_budget, split_grain, split_pieces)
from tests.test_plan import check_work_list

H100_SMS = 132


def cascade_grid() -> list[Shape]:
    """FlashInfer's cascade grid as the issue states it: batch 16-256, shared 1K-32K, own 128-2K, MHA 32:32 and GQA
    32:4 / 32:8, head_dim 128, page 16, bf16, one group."""
    return [Shape(scenario="decode", num_decode=batch, num_prefill=0, shared=shared, distinct=own, per_group=0,
                  num_qo_heads=32, num_kv_heads=kv, head_dim=128, dtype="bfloat16",
                  paper=f"cascade:{batch}/{shared}/{own}")
            for kv in (32, 4, 8) for batch in (16, 64, 256) for shared in (1024, 8192, 32768)
            for own in (128, 512, 2048)]


SHAPES = fig8_shapes(scaled=False) + fig8_shapes(scaled=False, gqa=True) + cascade_grid()


def _plan_sm90(shape: Shape):
    b = build_batch(shape, metadata_only=True)
    with planning_target("sm90"):
        p = plan(b.qo_indptr, b.kv_lens, b.block_table, block_size=shape.block_size,
                 num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                 q_dtype=DTYPES[shape.dtype], num_sms=H100_SMS, num_blocks=b.num_blocks)
    return b, p


def _kv_lengths(p) -> np.ndarray:
    return p.work.items[:, K.ITEM_KV_END].astype(np.int64) - p.work.items[:, K.ITEM_KV_START]


def _repriced(p) -> tuple[float, float]:
    """``(step, ideal)``: the plan's own items priced again with its class costs (each item's own length; plan()
    priced each range's longest piece for all its pieces, so the two agree to a grain per piece)."""
    costs = class_costs(p.tiles, head_dim=p.head_dim, dtype=dtype_name(p.q_dtype),
                        kv_bytes=(p.kv_dtype or p.q_dtype).itemsize, target=get_target("sm90"))
    lengths = _kv_lengths(p)
    step = ideal = 0.0
    for c in range(K.NUM_CLASSES):
        first, end = p.work.class_range(c)
        if end == first:
            continue
        cost, block_n = costs[c], p.tiles.of(c).block_n
        count = np.full(end - first, p.num_kv_heads)
        share = residency(int(count.sum()), num_sms=H100_SMS, slots_per_sm=cost.slots_per_sm)
        us = cost.fixed_us + cost.tile_us * share / cost.slots_per_sm * -(-lengths[first:end] // block_n)
        span, work = modeled_makespan(us, count, H100_SMS * cost.slots_per_sm)
        step, ideal = step + span, ideal + work
    return step, ideal


def test_modeled_stats_on_fig8_and_the_cascade_grid():
    worst = {}
    for shape in SHAPES:
        _, p = _plan_sm90(shape)
        step, ideal = _repriced(p)
        # The stats are the model of the plan's own items (modeled microseconds; critical path = step / ideal).
        gaps = (p.num_launches - 1) * LAUNCH_GAP_US
        assert p.stats["modeled_step_us"] == pytest.approx(step + gaps, rel=0.05)
        assert p.stats["critical_path"] == pytest.approx(step / ideal, rel=0.05)
        assert sum(p.stats["modeled_class_us"]) + gaps == pytest.approx(p.stats["modeled_step_us"], abs=0.05)
        if ideal > 100.0:  # launches of at least ~100 us of work; shorter ones are one wave of fixed costs
            worst[f"{shape.paper}/h{shape.num_qo_heads}:{shape.num_kv_heads}"] = p.stats["critical_path"]
    over = {k: round(v, 3) for k, v in worst.items() if v > CRITICAL_PATH_TARGET}
    assert not over, f"modeled critical path above {CRITICAL_PATH_TARGET}: {over}"


def test_whole_waves_are_split_where_the_model_gains():
    """The H100's 2721-us mixed step (292 equal shared programs, 2.21 waves of work run as 3 full waves): the shared
    class is now split so its modeled launch is within 10% of its programs' time spread over the slots."""
    shape = next(s for s in fig8_shapes(scaled=False, gqa=True) if s.paper == "mixed256:32768/128/256")
    b, p = _plan_sm90(shape)
    first, end = p.work.class_range(K.CLASS_SHARED)
    assert end - first > 73, "the shared node's M tiles are split"
    span, ideal = _repriced_class(p, K.CLASS_SHARED)
    assert span <= 1.1 * ideal
    check_work_list(p, b.qo_indptr, b.kv_lens, b.block_table)


def _repriced_class(p, c):
    cost = class_costs(p.tiles, head_dim=p.head_dim, dtype=dtype_name(p.q_dtype), kv_bytes=p.q_dtype.itemsize,
                       target=get_target("sm90"))[c]
    first, end = p.work.class_range(c)
    lengths = _kv_lengths(p)[first:end]
    count = np.full(end - first, p.num_kv_heads)
    share = residency(int(count.sum()), num_sms=H100_SMS, slots_per_sm=cost.slots_per_sm)
    us = cost.fixed_us + cost.tile_us * share / cost.slots_per_sm * -(-lengths // p.tiles.of(c).block_n)
    return modeled_makespan(us, count, H100_SMS * cost.slots_per_sm)


COST = ProgramCost(fixed_us=5.0, tile_us=1.0, block_n=64, slots_per_sm=1, source="calibrated")


def test_wave_aware_split_of_equal_ranges():
    # 73 equal ranges x 4 heads = 292 programs on 132 slots: unsplit 3 waves of the whole range; split in 4, 1168
    # programs in 9 waves of a quarter (8.85 waves of work): the model keeps the finer split.
    lengths = np.full(73, 32768)
    kw = dict(block_n=64, num_kv_heads=4, num_sms=132, min_split_tokens=256)
    pieces, grain, span, ideal = class_split(lengths, 1, COST, **kw)
    whole = COST.fixed_us + COST.tile_us * 32768 / 64
    assert modeled_makespan(np.array([whole]), np.array([292]), 132) == (3 * whole, 292 * whole / 132)
    assert (pieces == pieces[0]).all() and pieces[0] > 1 and grain == 64
    assert span < (1 - WAVE_GAIN_MIN) * 3 * whole and span <= 1.1 * ideal
    # A launch that fills its waves is left alone: 132 x 4 ranges, one wave each.
    pieces, _, span, ideal = class_split(np.full(132, 32768), 1, COST, **dict(kw, num_kv_heads=1))
    assert (pieces == 1).all() and span == pytest.approx(ideal)


def test_modeled_makespan_long_programs_first():
    # 10 programs of 100 us and 500 of 1 us on 8 slots: 2 waves of the long ones leave 6 slots x 100 us idle, which
    # the short ones (500 us of work) fill.
    span, ideal = modeled_makespan(np.array([100.0, 1.0]), np.array([10, 500]), 8)
    assert span == 200.0 and ideal == pytest.approx(1500 / 8)
    assert modeled_makespan(np.array([1.0]), np.array([0]), 8) == (0.0, 0.0)
    assert modeled_makespan(np.array([7.0]), np.array([1]), 132) == (7.0, 7.0 / 132)


def test_residency():
    assert residency(10, num_sms=132, slots_per_sm=4) == 1  # one program per SM: the SM's bandwidth to itself
    assert residency(300, num_sms=132, slots_per_sm=4) == 3
    assert residency(10_000, num_sms=132, slots_per_sm=4) == 4


@pytest.mark.parametrize("paper, kv_heads", [("cascade:16/1024/128", 4), ("cascade:16/8192/512", 8),
                                             ("cascade:64/32768/128", 4)])
def test_split_plans_cover_every_position_once(paper, kv_heads, node_rule_only):
    # Full-size plans that split their shared node: the host simulation of the kernel's bookkeeping (coverage,
    # workspace rows, merge counts) holds.
    shape = next(s for s in SHAPES if s.paper == paper and s.num_kv_heads == kv_heads)
    b, p = _plan_sm90(shape)
    kinds = p.work.items[:, K.ITEM_KIND]
    assert len(p.nodes) == 1 and (kinds == K.KIND_SHARED).sum() > 1, "the shared node is split"
    if paper == "cascade:16/1024/128":
        # The decode class's fair share is ~62 tokens, but a piece must read at least MIN_PIECE_OVERHEADS program
        # fixed costs (~90 KV positions each on sm90): the 128-token suffixes stay whole.
        cost = class_costs(p.tiles, head_dim=128, dtype="bf16", kv_bytes=2, target=get_target("sm90"))[2]
        assert MIN_PIECE_OVERHEADS * cost.fixed_tokens > shape.distinct
        suffix = _kv_lengths(p)[kinds == K.KIND_SUFFIX]
        assert (suffix == shape.distinct).all() and suffix.size == shape.num_decode
    check_work_list(p, b.qo_indptr, b.kv_lens, b.block_table)


def test_budget_floors():
    kw = dict(min_split_tokens=256, overhead_tokens=40.0)
    # MIN_SPLIT_TOKENS raises the budget only up to the target ...
    assert piece_budget(1000.0, **kw) == SPLIT_TOLERANCE * 1000
    assert piece_budget(210.0, **kw) == 256
    assert piece_budget(100.0, **kw) == CRITICAL_PATH_TARGET * 100
    # ... and the program's fixed cost sets the last floor (or a smaller min_split_tokens a caller asks for).
    assert piece_budget(10.0, **kw) == MIN_PIECE_OVERHEADS * 40.0
    assert piece_budget(10.0, min_split_tokens=16, overhead_tokens=40.0) == 16
    assert piece_budget(0.0, **kw) == float("inf")


def test_pieces_stay_within_the_budget():
    from prefixattn.planner.work_list import _piece_bounds

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5000, 500)
    for budget, block_n in ((100.0, 16), (116.4, 128), (700.0, 64), (64.0, 64), (float("inf"), 16)):
        grain = split_grain(block_n, budget)
        assert grain <= max(budget, 1) and block_n % grain == 0
        pieces = split_pieces(lengths, budget=budget, grain=grain)
        assert ((pieces == 0) == (lengths == 0)).all()
        within = lengths <= budget
        assert (pieces[within & (lengths > 0)] == 1).all(), "a range within the budget stays whole"
        idx = np.repeat(np.arange(lengths.size), pieces)
        piece = np.arange(idx.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        lo, hi = _piece_bounds(np.zeros(idx.size, np.int64), lengths[idx], piece, pieces[idx], grain)
        assert (hi > lo).all() and (hi - lo <= budget).all()
        # The fewest pieces: one fewer would put more than the budget's whole grains in some piece.
        if np.isfinite(budget):
            fewer = np.maximum(pieces - 1, 1)
            assert (-(-lengths // grain) > fewer * max(1, int(budget // grain)))[pieces > 1].all()
        else:
            assert (pieces <= 1).all()


def test_modeled_stats_edge_cases():
    # no query rows: no items, no modeled time
    p = plan(torch.tensor([0, 0]), torch.tensor([5]), torch.tensor([[0, 1]]), block_size=4, num_qo_heads=2,
             num_kv_heads=1, head_dim=64, q_dtype=torch.float32)
    assert p.num_items == 0 and p.stats["critical_path"] == 0.0 and p.stats["modeled_step_us"] == 0.0
