"""The split-k rule on the critical path (prefixattn.split_rule): plan-level checks, no kernel runs.

The full-size shapes are planned for an H100 (the sm90 table's tiles, 132 SMs) on this CPU host: plan() builds only
host tables, so the whole grid (109 plans) takes ~2 s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.shapes import DTYPES, Shape, build_batch, fig8_shapes
from prefixattn import plan
from prefixattn.autotune.lookup import planning_target
from prefixattn.kernels import layout as K
from prefixattn.split_rule import (CRITICAL_PATH_TARGET, MIN_PIECE_OVERHEADS, PROGRAM_OVERHEAD_TOKENS,
                                   SPLIT_TOLERANCE, critical_path, piece_budget, split_grain, split_pieces)
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


def test_critical_path_on_fig8_and_the_cascade_grid():
    worst = {}
    for shape in SHAPES:
        _, p = _plan_sm90(shape)
        lengths = _kv_lengths(p)
        fair = lengths.sum() * p.num_kv_heads / H100_SMS
        # The stat is the definition: longest program's KV tokens over the launch's KV work per SM.
        assert p.stats["critical_path"] == pytest.approx(lengths.max() / fair)
        worst[f"{shape.paper}/h{shape.num_qo_heads}:{shape.num_kv_heads}"] = p.stats["critical_path"]
    over = {k: round(v, 3) for k, v in worst.items() if v > CRITICAL_PATH_TARGET}
    assert not over, f"critical path above {CRITICAL_PATH_TARGET}: {over}"
    # The rule splits only what it must: before it, 32 decodes under an 8,192-token prefix (GQA 32:4) read 13.2x.
    assert worst["decode32:8192/128/64/h32:4"] <= SPLIT_TOLERANCE


@pytest.mark.parametrize("paper, kv_heads", [("cascade:16/1024/128", 4), ("cascade:16/8192/512", 8),
                                             ("cascade:64/32768/128", 4)])
def test_split_plans_cover_every_position_once(paper, kv_heads):
    # Full-size plans that split both kinds (the first one with half-tile suffix pieces): the host simulation of the
    # kernel's bookkeeping (coverage, workspace rows, merge counts) holds.
    shape = next(s for s in SHAPES if s.paper == paper and s.num_kv_heads == kv_heads)
    b, p = _plan_sm90(shape)
    kinds = p.work.items[:, K.ITEM_KIND]
    assert len(p.nodes) == 1 and (kinds == K.KIND_SHARED).sum() > 1, "the shared node is split"
    if paper == "cascade:16/1024/128":
        # fair share ~93 tokens: a whole 128-token suffix would be 1.38x it; two 64-token pieces each (whatever the
        # table's suffix BLOCK_N: a half-tile piece when it is 128, a whole tile when it is 64)
        suffix = _kv_lengths(p)[kinds == K.KIND_SUFFIX]
        assert (suffix == shape.distinct // 2).all() and suffix.size == 2 * shape.num_decode
    check_work_list(p, b.qo_indptr, b.kv_lens, b.block_table)


def test_budget_floors():
    # MIN_SPLIT_TOKENS raises the budget only up to the target ...
    assert piece_budget(1000.0, min_split_tokens=256) == SPLIT_TOLERANCE * 1000
    assert piece_budget(210.0, min_split_tokens=256) == 256
    assert piece_budget(100.0, min_split_tokens=256) == CRITICAL_PATH_TARGET * 100
    # ... and the programs' fixed cost sets the last floor (or a smaller min_split_tokens a caller asks for).
    assert piece_budget(10.0, min_split_tokens=256) == MIN_PIECE_OVERHEADS * PROGRAM_OVERHEAD_TOKENS
    assert piece_budget(10.0, min_split_tokens=16) == 16
    assert piece_budget(0.0, min_split_tokens=256) == float("inf")


def test_pieces_stay_within_the_budget():
    from prefixattn.work_list import _piece_bounds

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


def test_critical_path_stat_edge_cases():
    assert critical_path(np.zeros(0, np.int64), num_kv_heads=2, num_sms=4) == 0.0
    # one item per SM, equal lengths: exactly the fair share
    assert critical_path(np.full(8, 100), num_kv_heads=2, num_sms=16) == pytest.approx(1.0)
    # no query rows: no items, the stat is 0
    p = plan(torch.tensor([0, 0]), torch.tensor([5]), torch.tensor([[0, 1]]), block_size=4, num_qo_heads=2,
             num_kv_heads=1, head_dim=64, q_dtype=torch.float32)
    assert p.num_items == 0 and p.stats["critical_path"] == 0.0
