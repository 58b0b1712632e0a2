"""NaN in, NaN out through the kernels, and merge counters that survive a failed launch;
with ``plan(nan_guard=True)`` a non-finite V value at a key a row does not see (causal diagonal, sliding-window
edge) never reaches that row.

The reference's side of these rules is tested in tests/test_bad_input.py; here the fused kernel and the merge
kernels must agree with it: NaN in q or in a K/V row a query sees gives NaN (not the ``(0, -inf)`` of a row that saw
nothing), a NaN LSE in a merge gives NaN (it must not erase the other state), a row with no visible KV stays
``(0, -inf)``, and the plan after one whose counters an interrupted launch left non-zero gives the right answer.
"""

import contextlib
import math

import pytest
import torch

from prefixattn import (PrefixSharedAttention, attention, merge_states, merge_states_n, plan, prefix_attention,
                        reference_attention)
from prefixattn.autotune.lookup import fixed_config
from prefixattn.kernels.nan_redo import NAN_REDO_BY_LANE_TILE
from tests.prefix_batches import make_batch


def _batch(device, **kw):
    # Two requests sharing two blocks (a shared-node item plus suffixes and a merge), then one alone.
    args = dict(q_lens=[1, 3, 2], extra_lens=[3, 5, 2], paths=[("a",), ("a",), ()], level_blocks={"a": 2},
                block_size=4, num_qo_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    args.update(kw)
    b = make_batch(0, **args)
    for name in ("q", "k_cache", "v_cache", "qo_indptr", "kv_lens", "block_table"):
        setattr(b, name, getattr(b, name).to(device))
    return b


#: One long request that the planner splits into split-k chunks and merges (with num_sms=8, min_split_tokens=8).
_SPLIT = dict(q_lens=[1], extra_lens=[40], paths=[()], level_blocks={})


def _run(b, **plan_kw):
    p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, **plan_kw)
    got = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True)
    return p, got, want


def _same_nan_pattern_and_values(got, want):
    (o, lse), (o_ref, lse_ref) = got, want
    assert torch.equal(torch.isnan(o), torch.isnan(o_ref)), "NaN where the reference has NaN, nowhere else"
    assert torch.equal(torch.isnan(lse), torch.isnan(lse_ref))
    torch.testing.assert_close(o.float(), o_ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("sharing", ["always", "never"])
def test_nan_in_q_gives_nan(device, sharing):
    b = _batch(device)
    b.q[2, 1, 3] = math.nan  # request 1, its second query row, head 1
    p, got, want = _run(b, sharing=sharing)
    assert torch.isnan(want[0][2, 1]).all()
    _same_nan_pattern_and_values(got, want)


@pytest.mark.parametrize("sharing", ["always", "never"])
def test_nan_in_a_visible_shared_k_row_gives_nan(device, sharing):
    b = _batch(device)
    shared_block = int(b.block_table[0, 0])
    b.k_cache[shared_block, 1, 0, 0] = math.nan  # position 1: seen by every row of requests 0 and 1
    p, got, want = _run(b, sharing=sharing)
    if sharing == "always":
        assert p.shared_nodes, "the NaN sits in a shared node's KV"
    assert torch.isnan(want[0][:4]).all() and not torch.isnan(want[0][4:]).any()
    _same_nan_pattern_and_values(got, want)


def test_nan_in_a_visible_v_row_gives_nan(device):
    b = _batch(device)
    own_block = int(b.block_table[2, 0])
    b.v_cache[own_block, 0, 0, 5] = math.nan  # request 2's position 0
    _, got, want = _run(b, sharing="always")
    assert torch.isnan(want[0][4:, :, 5]).all()
    _same_nan_pattern_and_values(got, want)


def test_split_k_merge_keeps_nan(device):
    # One long request split into chunks: the NaN chunk's state must not be erased by the finite ones.
    b = _batch(device, **_SPLIT)
    b.k_cache[int(b.block_table[0, 2]), 0, 0, 0] = math.nan
    p, got, want = _run(b, num_sms=8, min_split_tokens=8)
    assert p.stats["num_units"] >= 1 and p.work.num_ws_rows > 0, "the request is split and merged"
    _same_nan_pattern_and_values(got, want)


def test_chunks_a_row_does_not_see_stay_empty(device):
    # A causal prefill split into chunks: the early rows see nothing of the later chunks, whose partial states
    # must be (0, -inf) and weigh nothing in the merge (never NaN, which "empty iff l == 0" must keep true).
    b = _batch(device, q_lens=[40], extra_lens=[40], paths=[()], level_blocks={})
    p, got, want = _run(b, num_sms=8, min_split_tokens=8)
    assert p.work.num_ws_rows > 0, "the prefill is split and merged"
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    _same_nan_pattern_and_values(got, want)


def test_merge_states_nan_lse_is_not_erased(device):
    v = torch.randn(2, 2, 64, device=device)
    s_a = torch.tensor([[math.nan, 0.5], [1.0, -math.inf]], device=device)
    s_b = torch.tensor([[2.0, math.nan], [-math.inf, -math.inf]], device=device)
    out, lse = merge_states(v, s_a, v + 1, s_b)
    assert torch.isnan(lse[0]).all() and torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1, 0], v[1, 0])  # one empty state: the other unchanged
    assert lse[1, 1] == -math.inf and (out[1, 1] == 0).all()  # both empty: (0, -inf)


def test_merge_states_nan_value_is_not_erased(device):
    v = torch.randn(1, 1, 64, device=device)
    v_nan = v.clone()
    v_nan[0, 0, 3] = math.nan
    out, _ = merge_states(v, torch.zeros(1, 1, device=device), v_nan, torch.zeros(1, 1, device=device))
    assert torch.isnan(out[0, 0, 3]) and torch.isfinite(out[0, 0, :3]).all()


def test_merge_states_n_nan_lse(device):
    v = torch.randn(1, 3, 2, 64, device=device)
    s = torch.tensor([[[0.0, 1.0], [math.nan, 2.0], [3.0, -math.inf]]], device=device)
    out, lse = merge_states_n(v, s)
    assert torch.isnan(lse[0, 0]) and torch.isnan(out[0, 0]).all()
    assert torch.isfinite(lse[0, 1]) and torch.isfinite(out[0, 1]).all()


@pytest.mark.parametrize("batch_kw, plan_kw", [(dict(), dict(sharing="always")),
                                               (_SPLIT, dict(num_sms=8, min_split_tokens=8))],
                         ids=["shared", "split-k"])
def test_counters_left_by_an_interrupted_launch_do_not_poison_the_next_plan(device, batch_kw, plan_kw):
    # An interrupted launch (a kill, a device fault, an exception between programs) can leave merge counters
    # non-zero. The launches reset the counters they complete but never zero them first, so a later plan() must: a
    # wrapper's workspace keeps its counters from step to step, and the next step's plan starts them from zero.
    b = _batch(device, **batch_kw)
    attn = PrefixSharedAttention(**b.heads, q_dtype=b.q.dtype, max_tokens=16, max_requests=4,
                                 max_blocks_per_request=16, device=device, **plan_kw)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True)
    p = attn.plan(*b.metadata)
    assert p.num_merge_rows > 0, "the plan merges states"
    attn.workspace.counters.fill_(1)  # what an interrupted layer of the previous step left
    p = attn.plan(*b.metadata)
    for _ in range(2):  # this layer and the next: each leaves the counters at zero
        out, lse = attn.run(b.q, b.k_cache, b.v_cache, return_lse=True)
        torch.testing.assert_close(out, want[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, want[1], atol=1e-4, rtol=1e-4)
        assert (p.counters == 0).all()
    # The free plan() gives every plan its own counters, zeroed once by plan().
    p.counters.fill_(1)
    fresh = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, **plan_kw)
    assert (fresh.counters == 0).all()
    torch.testing.assert_close(attention(b.q, b.k_cache, b.v_cache, fresh), want[0], atol=1e-4, rtol=1e-4)


def test_a_launch_that_raises_mid_layer_leaves_the_counters_at_zero(device, monkeypatch):
    # The shared class's launch runs (its rows report), then the decode class's launch raises on the host (a compile
    # error, an out-of-memory launch): attention() zeroes the counters behind it before the error propagates, so
    # the plan's next layer is right. (A device fault has no such host-side moment: on CUDA it ends the context, and
    # with it every later launch of the process; only a new context and a new plan() run again.)
    b = _batch(device)
    p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, sharing="always")
    assert len(p.work_classes) == 2 and p.num_merge_rows > 0
    real = prefix_attention.prefix_attention_kernel

    class FailSecond:
        calls = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                FailSecond.calls += 1
                if FailSecond.calls == 2:
                    raise RuntimeError("launch failed")
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", FailSecond())
    with pytest.raises(RuntimeError, match="launch failed"):
        attention(b.q, b.k_cache, b.v_cache, p)
    assert (p.counters == 0).all(), "the first launch's reports were undone"
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", real)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata)
    torch.testing.assert_close(attention(b.q, b.k_cache, b.v_cache, p), want, atol=1e-4, rtol=1e-4)


# The interpreter's numpy matmul warns on the inf products of the rows that do see the value (expected there).
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("sharing", ["always", "never"])
def test_non_finite_v_at_a_causally_hidden_key_stays_hidden(device, bad, sharing):
    # Request 1's 3 query rows sit at positions 10, 11, 12; position 11 is hidden from the first row but loaded in
    # the same (diagonal) tile: 0 * NaN in the P @ V dot would leak it. Rows that see it get NaN/inf as the
    # reference does, the row that does not stays finite.
    b = _batch(device)
    pos = int(b.kv_lens[1]) - 2
    b.v_cache[int(b.block_table[1, pos // 4]), pos % 4, 0, 7] = bad
    _, got, want = _run(b, sharing=sharing, nan_guard=True)
    assert torch.isfinite(want[0][1]).all() and not torch.isfinite(want[0][2:4, :, 7]).any()
    assert torch.equal(torch.isinf(got[0]), torch.isinf(want[0]))
    _same_nan_pattern_and_values(got, want)
    # Without the guard (the default: the check costs registers in the decode launch) the hidden value leaks into
    # the row that does not see it, and nowhere else.
    _, leaky, _ = _run(b, sharing=sharing)
    assert not torch.isfinite(leaky[0][1, :, 7]).all() and torch.isfinite(leaky[0][0]).all()


def test_nan_v_left_of_a_sliding_window_stays_hidden(device):
    # Rows at positions 8..13 with W = 3: key 5 is in row 0's window only; later rows load it in the same edge tile.
    b = _batch(device, q_lens=[6], extra_lens=[14], paths=[()], level_blocks={})
    p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, window_left=3, nan_guard=True)
    pos = 14 - 6 - 3
    b.v_cache[int(b.block_table[0, pos // 4]), pos % 4, 0, 9] = math.nan
    got = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True, window_left=3)
    assert torch.isnan(want[0][0, :, 9]).all() and torch.isfinite(want[0][1:]).all()
    _same_nan_pattern_and_values(got, want)


def test_plans_without_merges_share_placeholders_no_launch_touches(device):
    # The free plan() gives plans in which no rows merge one shared set of counters and workspace (3 allocations
    # less a plan): no launch may read or write them, with or without lse, and a plan that merges gets its own.
    b = _batch(device)
    p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, sharing="never")
    again = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, sharing="never")
    assert p.work.num_ws_rows == 0 and p.num_merge_rows == 0, "a plan without merges"
    assert all(getattr(p, n) is getattr(again, n) for n in ("counters", "ws_o", "ws_lse"))
    merging = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, sharing="always")
    assert merging.work.num_ws_rows > 0 and merging.counters is not p.counters and merging.ws_o is not p.ws_o
    for t, poison in ((p.counters, 7), (p.ws_o, math.nan), (p.ws_lse, math.nan)):
        t.fill_(poison)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True)
    torch.testing.assert_close(attention(b.q, b.k_cache, b.v_cache, p), want[0], atol=1e-4, rtol=1e-4)
    out, lse = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    torch.testing.assert_close((out, lse), want, atol=1e-4, rtol=1e-4)
    assert (p.counters == 7).all() and p.ws_o.isnan().all() and p.ws_lse.isnan().all(), "a launch wrote them"


@pytest.mark.parametrize("sharing", ["always", "never"])
def test_nan_guard_redoes_only_the_lanes_that_came_out_non_finite(device, sharing):
    # NaN in one (query row, head) lane of a suffix tile: the guard redoes that lane key by key (NaN, as in the
    # reference) and leaves the tile's other lanes their tiled result, bit for bit the unguarded launch's.
    b = _batch(device)
    b.q[2, 1, 3] = math.nan  # request 1, its second query row, head 1
    _, got, want = _run(b, sharing=sharing, nan_guard=True)
    _, plain, _ = _run(b, sharing=sharing)
    assert torch.isnan(want[0][2, 1]).all() and torch.isfinite(want[0][2, 0]).all()
    _same_nan_pattern_and_values(got, want)
    torch.testing.assert_close(got, plain, atol=0, rtol=0, equal_nan=True)


#: Suffix tiles of 128 x 16 at head_dim 80 (padded to 128): 128 x 128 lanes x dims, the kernel's lane-by-lane redo
#: (NAN_REDO_BY_LANE_TILE); the interpreter's default tiles take the all-at-once one.
_LANE_BY_LANE_TILES = {"shared": {"block_m": 16, "block_n": 16}, "suffix": {"block_m": 128, "block_n": 16},
                       "launch": {"num_warps": 4, "num_stages": 2}}


# The interpreter's numpy matmul warns on the NaN products of the row that does see the value (expected there).
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("tiles", [None, _LANE_BY_LANE_TILES], ids=["all-lanes", "lane-by-lane"])
def test_nan_guard_redo_spans_pages_and_tiles_with_soft_cap_and_gqa(device, tiles):
    # One 5-row chunk over 42 keys in 4-key pages (several KV tiles), 4 query heads per KV head, a padded head size
    # (80 -> 128) and a soft cap: a NaN V at the last key, which only the last row sees, is loaded by the diagonal
    # tile for every row. The redo (lane by lane, key by key) gives the reference: NaN in that row's heads of that KV
    # head, at that dimension only; every other lane finite. (Not over an fp8 cache here: the Triton 3.6
    # and 3.9 interpreters convert fp8 NaN and inf to finite values, e5m2 NaN to 114688.)
    b = _batch(device, q_lens=[5], extra_lens=[42], paths=[()], level_blocks={}, num_qo_heads=8, num_kv_heads=2,
               head_dim=80)
    last = 42 - 1
    b.v_cache[int(b.block_table[0, last // 4]), last % 4, 1, 11] = math.nan
    with contextlib.nullcontext() if tiles is None else fixed_config(tiles):
        p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, logits_soft_cap=20.0, nan_guard=True)
    lane_by_lane = p.tiles.chunk.block_m * p.tiles.block_d >= NAN_REDO_BY_LANE_TILE.value
    assert lane_by_lane == (tiles is not None), "the redo this case is for"
    got = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True, logits_soft_cap=20.0)
    assert torch.isnan(want[0][4, 4:, 11]).all() and torch.isfinite(want[0][:4]).all()
    assert torch.isfinite(want[0][4, :4]).all() and torch.isfinite(want[1]).all()
    _same_nan_pattern_and_values(got, want)
    # Without the guard the value leaks into the rows that do not see it: the redo is what kept them finite.
    with contextlib.nullcontext() if tiles is None else fixed_config(tiles):
        unguarded = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, logits_soft_cap=20.0)
    leaky = attention(b.q, b.k_cache, b.v_cache, unguarded)
    assert not torch.isfinite(leaky[:4, 4:, 11]).all()
