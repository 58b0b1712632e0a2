"""The sharing cost rules (prefixattn.planner.cost_rule) are defined once: the numpy planner, the compiled planner
and the simulator all decide with them, and agree node by node (and member by member) across the threshold."""

from __future__ import annotations

import numpy as np
import pytest

from prefixattn.lcp_tree import block_prefix_tree
from prefixattn.planner import cost_rule
from prefixattn.planner.cost_rule import request_sharing_pays_off, sharing_pays_off, unshared_reads
from prefixattn.planner.node_choice import select_shared_nodes
from prefixattn.planner.options import SHARING_APART

BLOCK_SIZE = 16
#: Node sizes (KV tokens) swept: every case below crosses its threshold inside this range.
TOKENS = range(1, 400)
#: (query rows per request, group, head_dim, KV element bytes, rows per shared tile, rows per chunk tile, rows per
#: decode tile): decode batches, fp8, GQA 1 and 8, and prefill chunks that the rule's extra_reads term prices.
CASES = [
    ([1, 1], 8, 128, 2, 16, 16, 16),
    ([1] * 64, 8, 128, 2, 16, 16, 16),
    ([1] * 5, 1, 64, 1, 64, 64, 64),
    ([40, 1, 1], 4, 128, 2, 32, 32, 16),
    ([100, 100], 1, 128, 2, 64, 32, 16),
]


def _one_node_batch(num_tokens: int, q_len: list[int]):
    """Requests whose first ``num_tokens`` KV positions are the same blocks: one node of ``num_tokens`` tokens."""
    shared = -(-num_tokens // BLOCK_SIZE)
    table = np.array([list(range(shared)) + [100 + r] for r in range(len(q_len))], dtype=np.int64)
    shareable = np.full(len(q_len), num_tokens, dtype=np.int64)
    return block_prefix_tree(table, shareable, BLOCK_SIZE), shareable, np.array(q_len, dtype=np.int64)


def _expected(num_tokens, q_len, group, head_dim, elt_bytes, rows_shared, rows_chunk, rows_decode, apart):
    """``(kept, members)``: the node rule over every request, or (``apart``) over those the request rule lets join."""
    reads = [int(unshared_reads(q, rows_chunk, rows_decode)) for q in q_len]
    members = [r for r, q in enumerate(q_len) if not apart or request_sharing_pays_off(
        q_len=q, reads=reads[r], shareable=num_tokens, rows_per_shared=rows_shared, group=group, head_dim=head_dim,
        elt_bytes=elt_bytes)]
    rows = sum(q_len[r] for r in members)
    kept = bool(members) and bool(sharing_pays_off(
        num_requests=len(members), num_rows=rows, num_m_tiles=-(-rows // rows_shared), num_tokens=num_tokens,
        group=group, head_dim=head_dim, elt_bytes=elt_bytes, extra_reads=sum(reads[r] - 1 for r in members)))
    return kept, members


@pytest.mark.parametrize("apart", [False, True], ids=["auto", "apart"])
@pytest.mark.parametrize("case", CASES)
def test_numpy_and_compiled_planners_keep_a_node_exactly_when_the_rule_says(case, apart):
    compiled = pytest.importorskip("prefixattn.planner.compiled.node_choice")
    q_len, group, head_dim, elt_bytes, rows_shared, rows_chunk, rows_decode = case
    sharing = SHARING_APART if apart else "auto"
    code = compiled.SHARING_APART if apart else compiled.SHARING_AUTO
    verdicts = set()
    for tokens in TOKENS:
        tree, shareable, q = _one_node_batch(tokens, q_len)
        want, members = _expected(tokens, q_len, group, head_dim, elt_bytes, rows_shared, rows_chunk, rows_decode,
                                  apart)
        verdicts.add(want)
        nodes, _ = select_shared_nodes(tree, shareable=shareable, q_len=q, block_size=BLOCK_SIZE,
                                       rows_per_shared=rows_shared, group=group, head_dim=head_dim,
                                       elt_bytes=elt_bytes, sharing=sharing, rows_per_chunk=rows_chunk,
                                       rows_per_decode=rows_decode)
        assert (nodes.kv_end.shape[0] == 1) == want, ("numpy", tokens)
        kv_start, kv_end, _, _, compiled_members, _ = compiled.select_nodes(
            tree.order, tree.depth, tree.lb, tree.rb, tree.parent, shareable, q, BLOCK_SIZE, rows_shared, group,
            head_dim, elt_bytes, code, rows_chunk, rows_decode)
        assert (kv_end.shape[0] == 1) == want, ("compiled", tokens)
        if want:
            assert (int(kv_start[0]), int(kv_end[0])) == (0, tokens)
            assert nodes.members.tolist() == compiled_members.tolist() == members, tokens
    assert verdicts == {False, True}, "the sweep must cross the rule's threshold"


#: Request rows swept by the request rule's tests: decode rows, short and full chunks, a chunk past 16 tiles.
REQUEST_ROWS = [1, 4, 16, 17, 40, 64, 127, 128, 129, 2048]


def test_unshared_reads_count_a_requests_suffix_tiles():
    rows_per_chunk, rows_per_decode = 128, 16
    assert [int(unshared_reads(q, rows_per_chunk, rows_per_decode)) for q in REQUEST_ROWS] == [
        1, 1, 1, 1, 1, 1, 1, 1, 2, 16]
    assert unshared_reads(np.array(REQUEST_ROWS), rows_per_chunk, rows_per_decode).tolist() == [
        int(unshared_reads(q, rows_per_chunk, rows_per_decode)) for q in REQUEST_ROWS]


@pytest.mark.parametrize("rows_shared,rows_chunk", [(128, 128), (64, 128)])
def test_a_chunk_of_full_chunk_tiles_never_gains(rows_shared, rows_chunk):
    """Its suffix tiles read the prefix once per chunk tile, as many reads as its rows fill shared M tiles (or
    fewer, where shared tiles are no taller): sharing adds only states, whatever the prefix's length."""
    q_len = np.array([rows_chunk * k for k in (1, 2, 16)], dtype=np.int64)
    for shareable in (1, 512, 10**6):
        assert not request_sharing_pays_off(
            q_len=q_len, reads=unshared_reads(q_len, rows_chunk, 16), shareable=np.full(3, shareable),
            rows_per_shared=rows_shared, group=1, head_dim=128, elt_bytes=2).any()


def test_the_request_rule_bounds_every_node_that_holds_the_request():
    """A request that fails at its whole shareable length adds cost to any node of fewer tokens: its term (KV bytes
    saved minus states added, as the node rule counts them) grows with the node's tokens, and fails at the top."""
    fixed = dict(rows_per_shared=64, group=4, head_dim=128, elt_bytes=2)
    for q in REQUEST_ROWS:
        reads = int(unshared_reads(q, 128, 16))
        verdicts = [bool(request_sharing_pays_off(q_len=q, reads=reads, shareable=t, **fixed))
                    for t in range(1, 3000)]
        assert verdicts == sorted(verdicts), q  # False up to a threshold, True from it on (or never)
        assert any(verdicts) == (reads * fixed["rows_per_shared"] > q), q


def test_the_docstring_example():
    fixed = dict(rows_per_shared=128, group=1, head_dim=128, elt_bytes=2)
    first = {q: next((t for t in range(1, 5000) if request_sharing_pays_off(
        q_len=q, reads=int(unshared_reads(q, 128, 16)), shareable=t, **fixed)), None) for q in (2048, 64, 1)}
    assert first == {2048: None, 64: 517, 1: 5}


def test_the_request_rule_works_on_arrays_as_on_scalars():
    rng = np.random.default_rng(1)
    q_len, shareable = rng.integers(1, 3000, 500), rng.integers(1, 5000, 500)
    reads = unshared_reads(q_len, 128, 16)
    fixed = dict(rows_per_shared=64, group=8, head_dim=128, elt_bytes=1)
    vector = request_sharing_pays_off(q_len=q_len, reads=reads, shareable=shareable, **fixed)
    scalar = [bool(request_sharing_pays_off(q_len=int(q), reads=int(r), shareable=int(s), **fixed))
              for q, r, s in zip(q_len, reads, shareable)]
    assert vector.tolist() == scalar
    assert 0 < vector.sum() < 500


def test_the_simulator_decides_with_the_same_rule():
    step_cost = pytest.importorskip("prefixattn.sim.step_cost")
    assert step_cost.sharing_pays_off is cost_rule.sharing_pays_off
    cm = step_cost.CostModel("a100", "mistral-7b")
    m = cm.model
    group = m.num_heads // m.num_kv_heads
    verdicts = set()
    for requests, rows in [(2, 2), (64, 64), (8, 300), (400, 400)]:
        for tokens in TOKENS:
            m_tiles = -(-rows * group // cm.calib.attn_block_m)
            want = bool(sharing_pays_off(num_requests=requests, num_rows=rows, num_m_tiles=m_tiles,
                                         num_tokens=tokens, group=group, head_dim=m.head_dim,
                                         elt_bytes=m.dtype_bytes))
            verdicts.add(want)
            assert cm.sharing_pays_off(requests, rows, tokens) == want, (requests, rows, tokens)
    assert verdicts == {False, True}


def test_the_rule_works_on_arrays_as_on_scalars():
    rng = np.random.default_rng(0)
    args = dict(num_requests=rng.integers(2, 300, 500), num_rows=rng.integers(2, 600, 500),
                num_m_tiles=rng.integers(1, 20, 500), num_tokens=rng.integers(1, 5000, 500),
                extra_reads=rng.integers(0, 10, 500))
    fixed = dict(group=4, head_dim=128, elt_bytes=2)
    vector = sharing_pays_off(**args, **fixed)
    scalar = [sharing_pays_off(**{k: int(v[i]) for k, v in args.items()}, **fixed) for i in range(500)]
    assert vector.tolist() == scalar
    assert 0 < vector.sum() < 500


def test_the_compiled_planner_pins_the_rule_it_compiled_in():
    """numba's on-disk cache keys the compiled node choice on its own file alone: after a change to cost_rule.py this
    fails until COST_RULE_SOURCE_HASH is updated, which changes that file and so recompiles select_nodes."""
    node_choice = pytest.importorskip("prefixattn.planner.compiled.node_choice")
    from prefixattn.planner.compiled import source_hash

    assert node_choice.COST_RULE_SOURCE_HASH == source_hash(cost_rule)
