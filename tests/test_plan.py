"""plan(): the block prefix tree, the cost rule and the work list, checked on the host (no kernel runs here)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from prefixattn import plan
from prefixattn.lcp_tree import lcp_interval_tree
from prefixattn.planner.cost_rule import sharing_pays_off
from prefixattn.planner.options import MIN_SPLIT_TOKENS
from prefixattn.planner.split_rule import MIN_PIECE_OVERHEADS, min_piece
from prefixattn.kernels import layout as K
from prefixattn.planner.work_list import prefix_runs
from tests.prefix_batches import make_batch, random_batch

HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64)


# ---------------------------------------------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------------------------------------------
def _brute_force_nodes(rows, lengths):
    """lcp-intervals by definition: for each depth, group rows by their prefix; keep groups of >= 2 rows whose
    depth is maximal for that exact set of rows."""
    found = {}
    for d in range(1, max(lengths, default=0) + 1):
        groups = {}
        for i, (row, n) in enumerate(zip(rows, lengths)):
            if n >= d:
                groups.setdefault(tuple(row[:d]), []).append(i)
        for members in groups.values():
            if len(members) >= 2:
                found[frozenset(members)] = d  # deeper depth for the same set overwrites
    return {(d, m) for m, d in found.items()}


def _tree_nodes(tree):
    return {(int(tree.depth[k]), frozenset(tree.members(k).tolist())) for k in range(tree.num_nodes)}


def test_tree_of_known_rows():
    rows = np.array([[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 5, 0], [3, 4, 0, 0], [7, 8, 9, 1], [3, 4, 0, 0]])
    lengths = np.array([4, 4, 3, 2, 4, 1])
    tree = lcp_interval_tree(rows, lengths)
    # {0,1,2,4} share [7, 8]; {0,1,4} share [7, 8, 9]; {0,4} are identical; {3,5} share [3].
    assert _tree_nodes(tree) == {(2, frozenset({0, 1, 2, 4})), (3, frozenset({0, 1, 4})), (4, frozenset({0, 4})),
                                 (1, frozenset({3, 5}))}
    by_members = {frozenset(tree.members(k).tolist()): k for k in range(tree.num_nodes)}
    parent = lambda s: tree.parent[by_members[frozenset(s)]]  # noqa: E731
    assert parent({0, 4}) == by_members[frozenset({0, 1, 4})]
    assert parent({0, 1, 4}) == by_members[frozenset({0, 1, 2, 4})]
    assert parent({0, 1, 2, 4}) == -1 and parent({3, 5}) == -1
    # Post-order: every child before its parent.
    assert all(tree.parent[k] == -1 or tree.parent[k] > k for k in range(tree.num_nodes))


def test_tree_without_sharing_and_degenerate_inputs():
    assert lcp_interval_tree(np.array([[1, 2], [3, 4], [5, 6]]), np.array([2, 2, 2])).num_nodes == 0
    assert lcp_interval_tree(np.zeros((0, 3), dtype=np.int64), np.zeros(0, dtype=np.int64)).num_nodes == 0
    assert lcp_interval_tree(np.array([[1, 2]]), np.array([2])).num_nodes == 0
    # Rows that share ids only past their lengths share nothing.
    assert lcp_interval_tree(np.array([[1, 2], [1, 3]]), np.array([0, 2])).num_nodes == 0


@pytest.mark.parametrize("seed", range(6))
def test_tree_without_shared_first_entries_is_the_lexicographic_order(seed):
    rng = np.random.default_rng(seed)
    n, width = int(rng.integers(2, 40)), int(rng.integers(1, 7))
    rows = rng.integers(0, 1000, (n, width))
    rows[:, 0] = rng.permutation(1000)[:n]  # distinct first entries (plan()'s shortcut for batches without sharing)
    lengths = rng.integers(0, width + 1, n)  # empty rows too: they sort first, by index
    tree = lcp_interval_tree(rows, lengths)
    expected = sorted(range(n), key=lambda i: (rows[i, :lengths[i]].tolist(), i))
    assert tree.num_nodes == 0
    assert tree.order.tolist() == expected and not tree.lcp.any()


@pytest.mark.parametrize("seed", range(8))
def test_tree_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, width = int(rng.integers(2, 40)), int(rng.integers(1, 7))
    rows = rng.integers(0, 3, (n, width))  # tiny alphabet: lots of shared prefixes at every depth
    lengths = rng.integers(0, width + 1, n)
    tree = lcp_interval_tree(rows, lengths)
    assert _tree_nodes(tree) == _brute_force_nodes(rows.tolist(), lengths.tolist())


# ---------------------------------------------------------------------------------------------------------------
# Shared nodes chosen by plan()
# ---------------------------------------------------------------------------------------------------------------
def _nodes(p):
    return [(n.kv_start, n.kv_end, n.requests.tolist()) for n in p.shared_nodes]


def _plan(qo, kv, table, **kw):
    kw = {**dict(block_size=4, q_dtype=torch.float32, **HEADS), **kw}
    return plan(torch.tensor(qo), torch.tensor(kv), torch.tensor(table), **kw)


def test_plan_finds_multi_level_sharing():
    # Requests 0-3 share a 2-block system prompt; 0 and 1 also share a 2-block document; 4 shares nothing.
    table = [[0, 1, 2, 3, 10, 11], [0, 1, 2, 3, 12, 13], [0, 1, 4, 14, 15, 0], [0, 1, 5, 16, 0, 0],
             [6, 7, 8, 9, 0, 0]]
    p = _plan([0, 1, 2, 3, 4, 5], [21, 22, 12, 10, 16], table, sharing="always")
    assert _nodes(p) == [(0, 8, [0, 1, 2, 3]), (8, 16, [0, 1])]


def test_plan_caps_a_node_at_the_first_query_position():
    # Both requests list blocks [0, 1, 2], but request 1's 6 query rows start at position 9: rows before position 9
    # are visible to all query rows, the rest of block 2 is not.
    p = _plan([0, 1, 7], [12, 15], [[0, 1, 2, 3], [0, 1, 2, 4]], sharing="always")
    assert _nodes(p) == [(0, 9, [0, 1])]
    # Not causal: every row sees every position, the whole common prefix is shared.
    p = _plan([0, 1, 7], [12, 15], [[0, 1, 2, 3], [0, 1, 2, 4]], sharing="always", causal=False)
    assert _nodes(p) == [(0, 12, [0, 1])]


def test_plan_ignores_requests_without_queries():
    p = _plan([0, 1, 1, 2], [9, 9, 9], [[0, 1, 2], [0, 1, 2], [0, 1, 3]], sharing="always")
    assert _nodes(p) == [(0, 8, [0, 2])]


def test_cost_rule_examples_from_its_docstring():
    kw = dict(group=8, head_dim=128, elt_bytes=2)
    assert not sharing_pays_off(num_requests=2, num_rows=2, num_m_tiles=1, num_tokens=64, **kw)
    assert sharing_pays_off(num_requests=2, num_rows=2, num_m_tiles=1, num_tokens=65, **kw)
    assert not sharing_pays_off(num_requests=64, num_rows=64, num_m_tiles=4, num_tokens=34, **kw)
    assert sharing_pays_off(num_requests=64, num_rows=64, num_m_tiles=4, num_tokens=35, **kw)


def test_cost_rule_drops_a_short_level_and_gives_its_tokens_to_the_next():
    # fp16, head_dim 128, GQA 8: a 1-block (4-token) prefix of 3 decode requests does not pay off, but with the
    # 16-block document below it two requests share 68 tokens from position 0.
    kw = dict(block_size=4, num_qo_heads=16, num_kv_heads=2, head_dim=128, q_dtype=torch.float16)
    doc = list(range(1, 18))
    table = [[0] + doc + [40], [0] + doc + [41], [0, 30, 31]]
    p = _plan([0, 1, 2, 3], [73, 73, 12], [r + [0] * (19 - len(r)) for r in table], **kw)
    assert _nodes(p) == [(0, 72, [0, 1])]
    assert _nodes(_plan([0, 1, 2, 3], [73, 73, 12], [r + [0] * (19 - len(r)) for r in table], sharing="never",
                        **kw)) == []


def test_cost_rule_prices_kv_bytes_at_the_cache_dtype():
    # fp16 q, head_dim 128, GQA 8, 2 decode requests under a 96-token prefix: with an fp16 cache the saved KV bytes
    # (1 x 96 x 2 x 128 x 2 = 49152) beat the added partial states (2 x 8 x 129 x 4 x 2 x 2 = 33024); with an fp8
    # cache they are half as many (24576) and the prefix stays unshared. The q rows are the same either way.
    kw = dict(block_size=16, num_qo_heads=16, num_kv_heads=2, head_dim=128, q_dtype=torch.float16)
    meta = ([0, 1, 2], [97, 97], [list(range(6)) + [6], list(range(6)) + [7]])
    fp16 = _plan(*meta, **kw)
    assert _nodes(fp16) == [(0, 96, [0, 1])] and fp16.kv_dtype == torch.float16  # default: q_dtype
    assert _nodes(_plan(*meta, kv_dtype=torch.float16, **kw)) == [(0, 96, [0, 1])]
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        p = _plan(*meta, kv_dtype=fp8, **kw)
        assert _nodes(p) == [] and p.kv_dtype == fp8
        assert p.kv_bytes_read() == 2 * 97 * 2 * 128 * 2 * 1  # requests x tokens x kv heads x head_dim x (K, V) x 1 B
    # A longer prefix pays off in fp8 too: 144 tokens save 1 x 144 x 2 x 128 = 36864 > 33024 bytes.
    long_meta = ([0, 1, 2], [146, 146], [list(range(10)), list(range(9)) + [10]])
    assert _nodes(_plan(*long_meta, kv_dtype=torch.float8_e4m3fn, **kw)) == [(0, 144, [0, 1])]


@pytest.mark.parametrize("capacities", [{}, dict(max_tokens=8, max_requests=4, max_blocks_per_request=16)])
def test_the_wrapper_prices_its_cache_dtype(capacities):
    from prefixattn import PrefixSharedAttention

    attn = PrefixSharedAttention(block_size=16, num_qo_heads=16, num_kv_heads=2, head_dim=128, q_dtype=torch.float16,
                                 kv_dtype=torch.float8_e5m2, device="cpu", **capacities)
    meta = (torch.tensor([0, 1, 2]), torch.tensor([97, 97]), torch.tensor([list(range(7)), list(range(6)) + [7]]))
    p = attn.plan(*meta)
    assert p.kv_dtype == torch.float8_e5m2 and _nodes(p) == []  # unshared at 1 byte per element (see above)
    assert _nodes(attn.plan(*meta, kv_dtype=torch.float16)) == [(0, 96, [0, 1])]


# ---------------------------------------------------------------------------------------------------------------
# The work list covers every (query row, visible KV position) exactly once, with consistent merge bookkeeping
# ---------------------------------------------------------------------------------------------------------------
def check_work_list(p, qo_indptr, kv_lens, block_table, *, causal=True):
    """Simulate the kernel's bookkeeping on the host; KV heads are the grid's second factor, so every item runs
    for every head and checking (row, position) pairs per item suffices."""
    w = p.work
    indptr, lens, table = (np.asarray(x.numpy(), dtype=np.int64) for x in (qo_indptr, kv_lens, block_table))
    req_of_tok = np.repeat(np.arange(len(lens)), np.diff(indptr))
    _check_classes(p, np.diff(indptr), table, lens)
    covered, ws_written, direct = [], [], []
    reports = np.zeros(w.mrows.shape[0], dtype=np.int64)
    ws_owner, mrow_tok = {}, {}
    for item in w.items.astype(np.int64):
        toks, ws_rows, mrows, pairs = _check_item(p, item, table, req_of_tok)
        covered.append(pairs)
        if ws_rows is None:
            direct.append(toks)
        else:
            ws_written.append(ws_rows)
            for tok, row, mrow in zip(toks, ws_rows, mrows):
                ws_owner[int(row)] = int(tok)
                assert mrow_tok.setdefault(int(mrow), int(tok)) == tok, "a merge row is one token"
            assert mrows.size == np.unique(mrows).size, "one report per merge row per item"
            reports[mrows] += 1
    _check_coverage(covered, indptr, lens, causal)
    _check_merges(w, int(indptr[-1]), ws_written, direct, reports, ws_owner, mrow_tok)


def _check_classes(p, q_lens, table, lens):
    """Work classes: items stored class by class (shared, chunk, decode), longest KV range first within each, but
    the suffix items of a prefix run of >= 2 requests together (runs longest first by their longest item, longest
    first inside one); a suffix item is of the decode class exactly when its request's rows fit one decode tile."""
    w = p.work
    group = p.num_qo_heads // p.num_kv_heads
    ends = w.class_ends
    assert len(ends) == K.NUM_CLASSES and list(ends) == sorted(ends) and ends[-1] == w.num_items
    item_class = np.repeat(np.arange(K.NUM_CLASSES), np.diff(np.r_[0, ends]))
    np.testing.assert_array_equal(w.ranges_table()[:, K.RANGE_END], ends)
    lengths = w.items[:, K.ITEM_KV_END].astype(np.int64) - w.items[:, K.ITEM_KV_START]
    runs = prefix_runs(table, lens, p.nodes.members, p.block_size)
    in_run = np.bincount(runs, minlength=runs.shape[0])[runs] > 1
    req = w.items[:, K.ITEM_REQ].astype(np.int64)
    # Each item's group: its request's run, else its own (a negative id).
    item_group = np.where(in_run[req] & (item_class != K.CLASS_SHARED), runs[req], -1 - np.arange(w.num_items))
    for c in range(K.NUM_CLASSES):
        first, end = w.class_range(c)
        g, ln = item_group[first:end], lengths[first:end]
        if not g.size:
            continue
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        assert np.unique(g).size == starts.size, "a run's items together"
        for a, b in zip(starts, np.r_[starts[1:], g.size]):
            assert (np.diff(ln[a:b]) <= 0).all(), "longest first inside a run"
        assert (np.diff(ln[starts]) <= 0).all(), "runs longest first"
    kinds = w.items[:, K.ITEM_KIND]
    assert ((kinds == K.KIND_SHARED) == (item_class == K.CLASS_SHARED)).all()
    suffix_reqs = w.items[item_class != K.CLASS_SHARED, K.ITEM_REQ].astype(np.int64)
    np.testing.assert_array_equal(item_class[item_class != K.CLASS_SHARED] == K.CLASS_DECODE,
                                  q_lens[suffix_reqs] <= p.tiles.rows_per_decode_tile(group))


def _check_item(p, item, table, req_of_tok):
    """One item's ``(tokens, workspace rows, merge rows, covered (token, position) keys)``, workspace and merge rows
    None for an item that writes its rows' output directly; checks its rows, its visible range and its blocks."""
    w = p.work
    group = p.num_qo_heads // p.num_kv_heads
    n, lo, hi, rep = item[K.ITEM_NUM_ROWS], item[K.ITEM_KV_START], item[K.ITEM_KV_END], item[K.ITEM_REQ]
    assert 0 < n and lo < hi, "no empty item"
    j = np.arange(n)
    if item[K.ITEM_KIND] == K.KIND_SHARED:
        toks = w.gather[item[K.ITEM_ROW_START] + j, K.GATHER_TOKEN].astype(np.int64)
        ws_rows = w.gather[item[K.ITEM_ROW_START] + j, K.GATHER_WS_ROW].astype(np.int64)
        mrows = w.gather[item[K.ITEM_ROW_START] + j, K.GATHER_MROW].astype(np.int64)
        assert n <= p.tiles.rows_per_shared_tile(p.num_qo_heads // p.num_kv_heads)
    else:
        assert item[K.ITEM_KIND] == K.KIND_SUFFIX
        toks = item[K.ITEM_ROW_START] + j
        ws_rows = item[K.ITEM_DEST] + j if item[K.ITEM_DEST] >= 0 else None
        mrows = item[K.ITEM_MROW] + j if item[K.ITEM_DEST] >= 0 else None
        assert (item[K.ITEM_MROW] >= 0) == (item[K.ITEM_DEST] >= 0)
        assert (req_of_tok[toks] == rep).all(), "a suffix tile holds one request's rows"
        assert n <= p.tiles.rows_per_chunk_tile(group)
    pos = np.arange(lo, hi)
    visible = pos[None, :] <= (item[K.ITEM_Q_POS] + j)[:, None]
    if item[K.ITEM_KIND] == K.KIND_SHARED:
        assert visible.all(), "a shared node ends before its rows' first query position"
    t_idx, p_idx = np.nonzero(visible)
    t, ps = toks[t_idx], pos[p_idx]
    # The representative's blocks ARE the row's blocks for every position the item reads for it.
    assert (table[rep, ps // p.block_size] == table[req_of_tok[t], ps // p.block_size]).all()
    return toks, ws_rows, mrows, t * (1 << 32) + ps


def _check_coverage(covered, indptr, lens, causal):
    """Every visible (row, position) exactly once, nothing else."""
    got = np.sort(np.concatenate(covered)) if covered else np.zeros(0, np.int64)
    want = []
    for r in range(len(lens)):
        for i in range(indptr[r + 1] - indptr[r]):
            last = lens[r] - (indptr[r + 1] - indptr[r]) + i if causal else lens[r] - 1
            want.append((indptr[r] + i) * (1 << 32) + np.arange(last + 1))
    want = np.sort(np.concatenate(want)) if want else np.zeros(0, np.int64)
    np.testing.assert_array_equal(got, want)


def _check_merges(w, num_tokens, ws_written, direct, reports, ws_owner, mrow_tok):
    """Workspace: every state of every merge row written exactly once, by the row's own token; one report per state
    (the kernel's merge condition: the report that completes NUM_STATES merges); every token in one merge row or
    written directly, never both."""
    mrows = w.mrows.astype(np.int64)
    ws_all = np.concatenate(ws_written) if ws_written else np.zeros(0, np.int64)
    assert ws_all.size == np.unique(ws_all).size == w.num_ws_rows
    unit_toks = set()
    for r in range(mrows.shape[0]):
        first, stride, states = mrows[r, [K.MROW_WS_FIRST, K.MROW_WS_STRIDE, K.MROW_NUM_STATES]]
        assert stride >= 1 and states >= 1 and reports[r] == states
        for s in range(states):
            assert ws_owner[int(first + s * stride)] == mrow_tok[r]
        unit_toks.add(mrow_tok[r])
    assert len(unit_toks) == mrows.shape[0], "one merge row per token"
    direct_toks = np.concatenate(direct) if direct else np.zeros(0, np.int64)
    assert direct_toks.size == np.unique(direct_toks).size
    assert not unit_toks & set(direct_toks.tolist())
    assert unit_toks | set(direct_toks.tolist()) == set(range(num_tokens))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal", [True, False])
def test_work_list_coverage_random_batches(seed, causal):
    b = random_batch(seed, num_requests=[1, 5, 17, 40, 64, 9][seed], levels=seed % 4, block_size=[1, 5, 16][seed % 3],
                     num_qo_heads=8, num_kv_heads=2, head_dim=64)
    for sharing, num_sms in (("auto", 132), ("always", 132), ("always", 4), ("never", 2)):
        p = plan(*b.metadata, **b.heads, causal=causal, sharing=sharing, num_sms=num_sms, min_split_tokens=8,
                 q_dtype=torch.float32)
        check_work_list(p, *b.metadata, causal=causal)


def test_work_list_split_k_and_long_prefill_tiles():
    # Two requests share 64 tokens; one is a 40-row prefill (several suffix tiles), one decodes. Few SMs: splits.
    b = make_batch(0, q_lens=[40, 1], extra_lens=[45, 30], paths=[("a",), ("a",)], level_blocks={"a": 4},
                   block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    p = plan(*b.metadata, **b.heads, sharing="always", num_sms=16, min_split_tokens=16, q_dtype=torch.float32)
    check_work_list(p, *b.metadata)
    kinds = p.work.items[:, K.ITEM_KIND]
    assert (kinds == K.KIND_SHARED).sum() > 1, "the 64-token shared node is split"
    assert p.work.num_units == -(-40 // p.tiles.rows_per_chunk_tile(4)) + 1
    assert p.work_classes == (K.CLASS_SHARED, K.CLASS_CHUNK, K.CLASS_DECODE)


def test_no_sharing_is_plain_paged_attention():
    b = random_batch(3, num_requests=12, levels=0, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32, num_sms=1)
    q_lens = np.diff(b.qo_indptr.numpy())
    rows = p.tiles.rows_per_chunk_tile(4)
    assert p.shared_nodes == [] and p.work.num_units == 0 and p.work.num_ws_rows == 0
    assert p.num_items == int((-(-q_lens // rows)).sum())
    assert (p.work.items[:, K.ITEM_DEST] == -1).all() and (p.work.items[:, K.ITEM_KIND] == K.KIND_SUFFIX).all()
    assert p.ws_o.shape[0] == 1 and p.num_launches == len(p.work_classes) and K.CLASS_SHARED not in p.work_classes  # placeholder


def _class_costs(p):
    """The work classes' program costs plan() priced ``p`` with."""
    from prefixattn.autotune.buckets import dtype_name
    from prefixattn.autotune.program_cost import class_costs

    return class_costs(p.tiles, head_dim=p.head_dim, dtype=dtype_name(p.q_dtype),
                       kv_bytes=(p.kv_dtype or p.q_dtype).itemsize)


def test_split_k_only_above_the_fair_share():
    b = make_batch(1, q_lens=[1, 1], extra_lens=[600, 700], paths=[(), ()], level_blocks={}, block_size=16,
                   num_qo_heads=8, num_kv_heads=2, head_dim=64)
    # 4 SMs: fair share (600 + 700) x 2 heads / 4 = 650 tokens; both ranges are within SPLIT_TOLERANCE of it.
    full = plan(*b.metadata, **b.heads, q_dtype=torch.float32, num_sms=4)
    assert full.num_items == 2 and full.work.num_units == 0
    # 64 SMs: fair share ~41 tokens, below the shortest piece worth its program (MIN_PIECE_OVERHEADS x the decode
    # binary's fixed cost in KV positions, under MIN_SPLIT_TOKENS): pieces of at most that many tokens, the target
    # (1.25 x 41 tokens) yields.
    split = plan(*b.metadata, **b.heads, q_dtype=torch.float32, num_sms=64)
    lengths = split.work.items[:, K.ITEM_KV_END] - split.work.items[:, K.ITEM_KV_START]
    cost = _class_costs(split)[K.CLASS_DECODE]
    floor = min_piece(MIN_SPLIT_TOKENS, cost.fixed_tokens)
    assert MIN_PIECE_OVERHEADS * cost.fixed_tokens < MIN_SPLIT_TOKENS and 41 < floor
    assert split.num_items > 4 and lengths.max() <= floor and lengths.sum() == b.kv_lens.sum()
    check_work_list(split, *b.metadata)


def test_thousand_tiny_requests_plan():
    rng = np.random.default_rng(0)
    n = 1000
    q_lens = rng.integers(1, 3, n).tolist()
    paths = [(f"g{int(g)}",) for g in rng.integers(0, 10, n)]
    b = make_batch(0, q_lens=q_lens, extra_lens=[q + 1 for q in q_lens], paths=paths,
                   level_blocks={f"g{g}": 2 for g in range(10)}, block_size=4, num_qo_heads=2, num_kv_heads=1,
                   head_dim=64)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32, sharing="always")
    assert len(p.shared_nodes) == 10
    check_work_list(p, *b.metadata)


# ---------------------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(logits_soft_cap=-30.0), r"logits_soft_cap: expected None, 0 \(off\) or a finite positive float"),
    (dict(window_left=1.5), r"window_left: expected None, -1 \(off\) or an int >= 0, got 1.5"),
    (dict(window_left=8, causal=False), r"window_left: expected -1 \(off\) with causal=False"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes: ALiBi is not supported yet"),
    (dict(sharing="sometimes"), "sharing: expected one of"),
    (dict(head_dim=36), r"head_dim: expected a head_dim that is a multiple of 8 in \[32, 256\], got (36|264)"),
    (dict(head_dim=264), r"head_dim: expected a head_dim that is a multiple of 8 in \[32, 256\], got (36|264)"),
    (dict(num_qo_heads=3), "num_qo_heads: expected a positive multiple of num_kv_heads=2"),
    (dict(num_sms=0), "num_sms: expected a positive int"),
    (dict(q_dtype=torch.int8), "q_dtype: expected one of"),
    (dict(kv_dtype=torch.float16), r"kv_dtype: expected None, the q_dtype \(float32\) or an fp8 dtype "
                                   r"\(float8_e4m3fn/float8_e5m2\), got torch.float16"),
    (dict(kv_dtype="fp8"), r"kv_dtype: expected None, the q_dtype \(float32\) or an fp8 dtype .*got 'fp8'"),
])
def test_plan_rejects_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan([0, 1], [5], [[0, 1]], **kw)


def test_plan_checks_metadata_values():
    with pytest.raises(ValueError, match="kv_lens: expected kv_lens"):
        _plan([0, 3], [2], [[0]])
    with pytest.raises(ValueError, match=r"block_table: expected block ids in \[0, 4\)"):
        _plan([0, 1], [5], [[0, 9]], num_blocks=4)


def test_shared_prefix_is_read_once():
    # 8 decode requests under one 64-token prefix, 1 M tile of packed rows: the plan reads exactly the unique KV.
    n = 8
    b = make_batch(4, q_lens=[1] * n, extra_lens=[9] * n, paths=[("p",)] * n, level_blocks={"p": 4},
                   block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="always")
    per_token = 2 * 64 * 2 * 2  # kv heads x head_dim x (K, V) x fp16
    assert p.kv_bytes_read() == (64 + n * 9) * per_token
    never = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="never")
    assert never.kv_bytes_read() == n * (64 + 9) * per_token


def test_prefix_runs_join_neighbours_sharing_half_the_shorter_ones_blocks():
    """Neighbouring requests join a run when they hold the same block at the middle of the shorter one's blocks and
    neither is in a shared node; a decode step planned unshared keeps a run's items together."""
    table = np.array([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 9, 6, 7], [8, 9, 0, 0], [1, 2, 3, 0]])
    lens = np.array([64, 60, 64, 49, 17, 40])  # blocks 4, 4, 4, 4, 2, 3 (block size 16)
    # middle columns: (4-1)//2 = 1 for 0-1, 1-2, 2-3; (2-1)//2 = 0 for 3-4; (2-1)//2 = 0 for 4-5
    assert prefix_runs(table, lens, np.array([], dtype=np.int64), 16).tolist() == [0, 0, 0, 3, 4, 5]
    assert prefix_runs(table, lens, np.array([1]), 16).tolist() == [0, 1, 2, 3, 4, 5]  # 1 reads its prefix once
    assert prefix_runs(table, np.array([64, 0, 64, 49, 17, 40]), np.array([], dtype=np.int64), 16).tolist() == [
        0, 1, 2, 3, 4, 5]  # no KV: in no run
    assert prefix_runs(np.zeros((3, 0), dtype=np.int32), np.zeros(3, dtype=np.int64), np.zeros(0, dtype=np.int64),
                       16).tolist() == [0, 1, 2]  # a table without columns (no request has KV)
    # Runs of two documents interleaved by length: longest first would alternate them, runs keep them apart.
    docs = np.array([[10, 11, 12, 20 + r] for r in range(4)] + [[30, 31, 32, 40 + r] for r in range(4)])
    kv = torch.tensor([64, 50, 62, 52, 63, 51, 61, 53])
    p = plan(torch.arange(9), kv, torch.from_numpy(docs), block_size=16, num_qo_heads=4, num_kv_heads=4,
             head_dim=64, sharing="never", device="cpu")
    reqs = p.work.items[:, K.ITEM_REQ].tolist()
    assert reqs == [0, 2, 3, 1, 4, 6, 7, 5] and sorted(kv.tolist(), reverse=True) != kv[reqs].tolist()
