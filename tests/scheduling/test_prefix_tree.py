"""Sort + LCP + compact tree, against a brute-force sort and direct pairwise LCPs."""

import numpy as np
import pytest

from prefixattn.lcp_tree import sort_packed as prefix_tree_module  # where sort_and_lcp lives (patched below)
from prefixattn.lcp_tree import lcp_interval_tree, prefix_tree_from_lcp
from prefixattn.scheduling import PackedSequences, pack_sequences, prefix_tree, sort_and_lcp
from tests.scheduling.synthetic import nested_random


def _lcp(a, b) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _trie_key(row) -> bytes:
    """The documented order: ids compared by their native uint32 bytes, a row after the rows it prefixes."""
    return np.asarray(row, dtype=np.uint32).tobytes() + b"\xff\xff\xff\xff"


def _brute(rows):
    order = sorted(range(len(rows)), key=lambda i: (_trie_key(rows[i]), i))
    return order, [0] + [_lcp(rows[a], rows[b]) for a, b in zip(order, order[1:])]


def test_hand_built():
    rows = [[5, 6, 7], [5, 6], [1], [5, 6, 7], [5, 9, 0, 0], []]
    packed = pack_sequences(rows, min_len=0)
    order, lcp = sort_and_lcp(packed.values, packed.offsets)
    # small ids sort like numbers; a row comes after the rows it prefixes; identical rows keep their row order
    assert order.tolist() == [2, 0, 3, 1, 4, 5]
    assert lcp.tolist() == [0, 0, 3, 2, 1, 0]


def test_truncated_rows():
    packed = pack_sequences([[1, 2, 3], [1, 2, 4], [1, 9]])
    order, lcp = sort_and_lcp(packed.values, packed.offsets, packed.lengths - 1)
    assert order.tolist() == [0, 1, 2]  # [1, 2] == [1, 2] (row order kept), then [1]
    assert lcp.tolist() == [0, 2, 1]


@pytest.mark.parametrize("chunk", [2, 4, 64])
def test_random_against_brute_force(monkeypatch, chunk):
    # Tiny chunks force many refinement rounds, chunk edges inside shared prefixes and rows ending on edges.
    monkeypatch.setattr(prefix_tree_module, "CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for _ in range(150):
        rows = nested_random(rng, int(rng.integers(1, 30)), max_len=int(rng.integers(1, 20)))
        packed = pack_sequences(rows)
        for drop in (0, 1):
            order, lcp = sort_and_lcp(packed.values, packed.offsets, packed.lengths - drop)
            want_order, want_lcp = _brute([r[:len(r) - drop] for r in rows])
            assert order.tolist() == want_order
            assert lcp.tolist() == want_lcp


def test_hashes_only_skip_work(monkeypatch):
    # Chunks whose hashes differ are compared by their ids, so hashes that differ even for equal chunks (here:
    # every chunk hashes to its own index) change nothing: the hashes decide only what may be skipped.
    real = prefix_tree_module.chunk_hashes

    def all_distinct(values, starts, num_chunks, chunk):
        first, h0, h1 = real(values, starts, num_chunks, chunk)
        return first, np.arange(h0.size, dtype=np.uint64), h1

    monkeypatch.setattr(prefix_tree_module, "CHUNK", 4)
    rng = np.random.default_rng(5)
    for _ in range(40):
        rows = nested_random(rng, int(rng.integers(2, 30)), max_len=int(rng.integers(4, 30)))
        packed = pack_sequences(rows)
        want = sort_and_lcp(packed.values, packed.offsets)
        monkeypatch.setattr(prefix_tree_module, "chunk_hashes", all_distinct)
        got = sort_and_lcp(packed.values, packed.offsets)
        monkeypatch.setattr(prefix_tree_module, "chunk_hashes", real)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_tree_structure_matches_lcas():
    rng = np.random.default_rng(3)
    for _ in range(60):
        rows = nested_random(rng, int(rng.integers(1, 25)))
        tree = prefix_tree(rows)
        n = len(rows)
        leaf_node = {int(tree.leaf[v]): v for v in range(tree.num_nodes) if tree.leaf[v] >= 0}
        assert sorted(leaf_node) == list(range(n))
        # every row's leaf sits at its own length; internal nodes have >= 2 children, except possibly the root
        for pos, v in leaf_node.items():
            assert tree.depth[v] == len(rows[tree.order[pos]])
        indptr, kids = tree.children()
        for v in range(tree.num_nodes):
            if tree.leaf[v] < 0 and v != 0:
                assert indptr[v + 1] - indptr[v] >= 2
                assert tree.depth[v] > tree.depth[tree.parent[v]]
            assert tree.hi[v] - tree.lo[v] == sum(1 for p, u in leaf_node.items() if _is_ancestor(tree, v, u))
        # depth of the lowest common ancestor of two leaves == their LCP
        for a in range(n):
            for b in range(a + 1, n):
                lca = _lca(tree, leaf_node[a], leaf_node[b])
                assert tree.depth[lca] == _lcp(rows[tree.order[a]], rows[tree.order[b]])
        assert tree.shared_tokens() == sum(len(r) for r in rows) - int(tree.lcp.sum())
        post = tree.post_order.tolist()
        assert sorted(post) == list(range(tree.num_nodes))
        assert all(post.index(v) < post.index(tree.parent[v]) for v in range(1, tree.num_nodes))


def _is_ancestor(tree, a, v):
    while v >= 0:
        if v == a:
            return True
        v = tree.parent[v]
    return False


def _lca(tree, u, v):
    anc = set()
    while u >= 0:
        anc.add(int(u))
        u = tree.parent[u]
    while v not in anc:
        v = tree.parent[v]
    return v


def test_block_ids_and_packed_input():
    # The planner's use: rows of KV block ids; a 2-D array and PackedSequences are accepted as they are.
    tables = np.array([[4, 8, 15], [4, 8, 16], [23, 42, 42]], dtype=np.int32)
    tree = prefix_tree(tables)
    assert tree.order.tolist() == [0, 1, 2] and tree.lcp.tolist() == [0, 2, 0]
    packed = PackedSequences(values=tables.ravel(), offsets=np.array([0, 3, 6, 9]))
    assert prefix_tree(packed).lcp.tolist() == [0, 2, 0]


def test_identical_rows_keep_row_order():
    order, lcp = sort_and_lcp(np.array([7, 7, 7, 7, 7, 7]), np.array([0, 2, 4, 6]))
    assert order.tolist() == [0, 1, 2] and lcp.tolist() == [0, 2, 2]


def test_large_ids_use_a_fixed_byte_order():
    # 256 = bytes 00 01 00 00 and 1 = 01 00 00 00: compared bytewise, 256 comes first. Any fixed order is a valid
    # tree order; this pins down that the order is the same every time.
    order, lcp = sort_and_lcp(np.array([1, 256, 2**32 - 2]), np.array([0, 1, 2, 3]))
    assert order.tolist() == [1, 0, 2] and lcp.tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad, match", [
    pytest.param([], r"prompts: expected at least one sequence", id="no-rows"),
    pytest.param([[1, 2], []], r"prompts\[1\]: expected at least 1 id", id="empty-row"),
    pytest.param([[1, 2], [1.5, 2]], r"prompts\[1\]: expected a sequence of integer ids", id="float-ids"),
    pytest.param([[1, 2], "ab"], r"prompts\[1\]: expected a sequence of integer ids, got str", id="string-row"),
    pytest.param([[1, -2]], r"prompts\[0\]: expected ids in \[0, 4294967294\], got -2", id="negative-id"),
    pytest.param([np.array([1.0, 2.0])], r"prompts\[0\]: expected integer ids, got dtype float64", id="float-array"),
    pytest.param([np.zeros((2, 2), np.int64)], r"prompts\[0\]: expected a 1-D sequence", id="2d-row"),
    pytest.param([[1], 5], r"prompts\[1\]: expected a sequence of integer ids, got int", id="int-row"),
    pytest.param(np.zeros((0, 3), np.int64), r"prompts: expected at least one sequence", id="empty-2d-array"),
    pytest.param(np.zeros(3, np.int64), r"prompts: expected a sequence of rows or a 2-D integer array", id="1d-array"),
    pytest.param([[2**32]], r"prompts\[0\]: expected ids in", id="id-too-large"),
])
def test_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(bad)


def _node_sets(depth, members) -> set:
    return {(int(d), frozenset(int(r) for r in m)) for d, m in zip(depth, members)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_both_sorts_build_the_same_nodes(seed):
    # The planner's sort (a row before the rows it prefixes, ids numerically) and the scheduler's (a row after them,
    # ids by native bytes) order rows differently, but the one builder gives the same nodes from either: every node
    # of >= 2 rows sharing depth > 0 ids, as (depth, set of rows). A PrefixTree built over the planner's order is a
    # valid tree too (its LCAs are the rows' LCPs): the root and leaves do not depend on the order's convention.
    rng = np.random.default_rng(seed)
    for _ in range(60):
        rows = nested_random(rng, int(rng.integers(1, 30)), alphabet=int(rng.integers(2, 5)))
        rows = [r[:int(rng.integers(0, len(r) + 1))] if rng.random() < 0.2 else r for r in rows]  # empty rows too
        width = max(len(r) for r in rows)
        dense = np.zeros((len(rows), max(width, 1)), dtype=np.int64)
        for i, r in enumerate(rows):
            dense[i, :len(r)] = r
        lengths = np.array([len(r) for r in rows])
        block = lcp_interval_tree(dense, lengths)
        want = _node_sets(block.depth, [block.members(k) for k in range(block.num_nodes)])
        values = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows] + [np.zeros(0, np.int64)])
        tree = prefix_tree_module.tree_of_rows(values, np.concatenate([[0], np.cumsum(lengths)]), lengths)
        on_dense = prefix_tree_from_lcp(block.order, block.lcp, lengths)
        for t in (tree, on_dense):
            inner = [v for v in range(t.num_nodes) if t.leaf[v] < 0 and t.depth[v] > 0]
            assert _node_sets(t.depth[inner], [t.order[t.lo[v]:t.hi[v]] for v in inner]) == want, rows
        leaf_node = {int(on_dense.leaf[v]): v for v in range(on_dense.num_nodes) if on_dense.leaf[v] >= 0}
        for a in range(len(rows)):
            for b in range(a + 1, len(rows)):
                lca = _lca(on_dense, leaf_node[a], leaf_node[b])
                assert on_dense.depth[lca] == _lcp(rows[block.order[a]], rows[block.order[b]])


def test_node_numbering_and_post_order():
    # Node ids follow the sorted positions (an interval at its first inner boundary, before that position's leaf);
    # the post-order visits children left to right. Sorted rows: [1, 2, 3], [1, 2], [1, 5], [7].
    tree = prefix_tree([[1, 2], [1, 2, 3], [7], [1, 5]])
    assert tree.order.tolist() == [1, 0, 3, 2] and tree.lcp.tolist() == [0, 2, 1, 0]
    assert tree.parent.tolist() == [-1, 2, 4, 2, 0, 4, 0]
    assert tree.depth.tolist() == [0, 3, 2, 2, 1, 2, 1]
    assert tree.lo.tolist() == [0, 0, 0, 1, 0, 2, 3] and tree.hi.tolist() == [4, 1, 2, 2, 3, 3, 4]
    assert tree.leaf.tolist() == [-1, 0, -1, 1, -1, 2, 3]
    assert tree.post_order.tolist() == [1, 3, 2, 5, 4, 6, 0]


@pytest.mark.parametrize("rows, fast", [
    pytest.param([[5, 6, 7], (5, 6), [2**31 - 1, 0]], True, id="lists-and-tuples"),
    pytest.param(([1], [1], [1, 2]), True, id="tuple-of-lists"),
    pytest.param([[1, 2], [3, 2**31]], False, id="beyond-int32"),
    pytest.param([[1, True], [0, False]], False, id="bools"),
    pytest.param([[1, np.int64(3)], [4]], False, id="numpy-scalars"),
    pytest.param([[7] * 100, list(range(64)), [2**32 - 2]], False, id="long-and-largest-id"),
])
def test_list_packing_paths_agree(rows, fast):
    # Lists/tuples of int32-range ints take the marshal fast path; anything else (ids of 2**31 and more, bools,
    # numpy scalars) the per-row conversion. Both give the same ids and offsets.
    packed = pack_sequences(rows)
    assert packed.values.dtype == (np.int32 if fast else np.int64)  # int32: the marshal path ran
    want = [int(x) for r in rows for x in r]
    assert packed.values.tolist() == want
    assert packed.offsets.tolist() == np.cumsum([0] + [len(r) for r in rows]).tolist()


@pytest.mark.parametrize("bad, match", [
    pytest.param([[1, 2], [3, [4]]], r"prompts\[1\]: expected a sequence of integer ids", id="nested-list"),
    pytest.param([[1, 2], [3, -1]], r"prompts\[1\]: expected ids in \[0, 4294967294\], got -1 at position 1",
                 id="negative-int32"),
    pytest.param([[1, 2], (3, "a")], r"prompts\[1\]: expected a sequence of integer ids", id="string-element"),
    pytest.param([[1, 2], [3, None]], r"prompts\[1\]: expected a sequence of integer ids", id="none-element"),
])
def test_list_packing_fast_path_names_the_bad_row(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(bad)


def test_lists_and_arrays_give_the_same_tree():
    # Near-collisions: a tiny vocabulary, shared prefixes ending just before, at and after chunk boundaries, empty
    # tails (duplicates), length-1 rows; lists (marshal path) and int32 arrays must sort and share alike, and both as
    # the brute force does.
    rng = np.random.default_rng(11)
    base = rng.integers(0, 3, 300).tolist()
    cuts = rng.choice([1, 63, 64, 65, 128, 129, 300], 400)
    rows = [base[:int(cut)] + rng.integers(0, 2, int(rng.integers(0, 70))).tolist() for cut in cuts]
    rows += [[0], [0], base, list(base)]
    from_lists = prefix_tree(rows)
    from_arrays = prefix_tree([np.asarray(r, dtype=np.int32) for r in rows])
    want_order, want_lcp = _brute(rows)
    for tree in (from_lists, from_arrays):
        assert tree.order.tolist() == want_order and tree.lcp.tolist() == want_lcp


@pytest.mark.parametrize("width", [1, 2, 5, 64])
def test_sort_keys_matches_a_byte_string_sort(width):
    # The integer two-id sort plus its byte-string fallback: the same stable order as sorting (segment, bytes), on
    # keys from a tiny alphabet (ties on the two ids that are compared first, differences after them), large ids
    # (byte order is not numeric order) and the end marker.
    rng = np.random.default_rng(width)
    for _ in range(30):
        m = int(rng.integers(2, 60))
        key = rng.choice(np.array([0, 1, 256, 2**32 - 2, 0xFFFFFFFF], dtype=np.uint32), size=(m, width))
        if rng.random() < 0.5:
            key[:, :width // 2] = key[0, :width // 2]  # a shared start: rows differ only later in the chunk
        seg = np.sort(rng.integers(0, 4, m))
        order, kmis = prefix_tree_module._sort_keys(key, seg)
        want = sorted(range(m), key=lambda i: (int(seg[i]), key[i].tobytes(), i))
        assert order.tolist() == want
        assert np.array_equal(kmis, key[want][1:] != key[want][:-1])
