"""Prefix tree over integer rows (block-id rows of a batch's block tables): sort rows, LCP of neighbours, LCP stack.

Numpy only. :func:`lcp_interval_tree` is the generic part (any non-negative integer rows: block ids here, token ids
in a scheduler); :func:`block_prefix_tree` applies it to the leading blocks of each request's block-table row.

A node is an *lcp-interval*: a run ``order[lb..rb]`` of at least two sorted rows that all share their first ``depth``
entries, with ``depth`` maximal for that run (Abouelhoda, Kurtz & Ohlebusch, "Replacing suffix trees with enhanced
suffix arrays", 2004). Nested runs are children, so multi-level sharing (system prompt > document > query) comes out
as a chain of nodes with no grouping input.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from prefixattn.ragged import run_lengths, run_starts

#: Padding value in the row matrix: below every real id (ids are >= 0), so a row that is a prefix of another sorts
#: first and never matches past its end.
_PAD = -1
_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class LcpTree:
    """Prefix tree of ``n`` integer rows, nodes in post-order (every child before its parent).

    Attributes
    ----------
    order : ndarray, ``[n]`` int64
        Row indices in lexicographic order of the rows.
    lcp : ndarray, ``[n]`` int64
        ``lcp[i]`` = common prefix length of rows ``order[i-1]`` and ``order[i]``; ``lcp[0] = 0``.
    depth, lb, rb, parent : ndarray, ``[num_nodes]`` int64
        Node ``k`` holds rows ``order[lb[k]:rb[k] + 1]`` (at least two) which share their first ``depth[k]`` entries;
        ``parent[k]`` is the enclosing node, ``-1`` under the root (depth 0, not a node).
    """

    order: np.ndarray
    lcp: np.ndarray
    depth: np.ndarray
    lb: np.ndarray
    rb: np.ndarray
    parent: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.depth.shape[0])

    def members(self, node: int) -> np.ndarray:
        """Row indices under ``node`` (in sorted order)."""
        return self.order[self.lb[node]: self.rb[node] + 1]


#: Rounds of :func:`sorted_rows_lcp` compare each tied row with its group's leader; with at most this many groups
#: whose rows are consecutive in the input (a benchmark batch, an engine's request order) each group is compared as
#: a slice of ``rows`` (no gathered copy: a 263 x 2056 table costs ~50 us per copy on the 2-core host).
_SLICED_GROUPS = 4


def _first_mismatch(rows: np.ndarray, members: np.ndarray, leaders: np.ndarray) -> np.ndarray:
    """First column where ``rows[members]`` differs from ``rows[leaders]`` (``width`` where none).

    Whole rows are compared, also the leading columns known to be equal: a column slice of a C-contiguous table is
    strided, and numpy compares strided rows ~1.5x and searches them ~6x slower (263 x 2056 int32: 170 us vs 97 us).
    """
    width = rows.shape[1]
    out = np.full(members.shape[0], width, dtype=np.int64)
    if not width or not members.shape[0]:
        return out
    # Group runs of one leader whose members are consecutive rows: compare slices against one broadcast row.
    bounds = run_starts(leaders).nonzero()[0]
    if bounds.shape[0] <= _SLICED_GROUPS:
        spans = [(int(lo), int(hi)) for lo, hi in zip(bounds, [*bounds[1:].tolist(), leaders.shape[0]])]
        if all(members[hi - 1] - members[lo] == hi - lo - 1 and (members[lo + 1:hi] - members[lo:hi - 1] == 1).all()
               for lo, hi in spans):
            for lo, hi in spans:
                _store_first_true(out, lo, rows[members[lo]:members[hi - 1] + 1] != rows[leaders[lo]])
            return out
    _store_first_true(out, 0, rows[members] != rows[leaders])
    return out


def _store_first_true(out: np.ndarray, at: int, diff: np.ndarray) -> None:
    first = diff.argmax(axis=1)
    found = diff[np.arange(diff.shape[0]), first]
    out[at:at + diff.shape[0]] = np.where(found, first, out[at:at + diff.shape[0]])


def sorted_rows_lcp(rows: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lexicographic order of the rows ``rows[i, :lengths[i]]`` (a row that is a prefix of another first, identical
    rows by index) and the LCP of each sorted row with the previous one (``lcp[0] = 0``; ``None`` when no two rows
    share their first entry: every LCP is 0).

    Refinement instead of a full sort: rows are grouped by their first entry; each group of tied rows is then compared
    with one of its rows (its leader) in one vectorized pass, which places every other row before or after the leader
    by (first mismatch, value there) and splits off the rows still tied with each other for the next round (at most
    one round per row: each round settles every leader). A batch costs one pass over its tied rows per level of
    sharing (a full sort of 2056-entry rows compared pairs of rows over their whole shared prefix: ~6 ms for 263
    requests). Same order and LCPs as sorting the padded rows (``_PAD`` past each end, then the row index).
    """
    n, width = rows.shape
    first = np.where(lengths > 0, rows[:, 0], _PAD) if width else np.full(n, _PAD)
    order = np.argsort(first, kind="stable").astype(np.int64, copy=False)
    sorted_first = first[order]
    tied = (sorted_first[1:] == sorted_first[:-1]) & (sorted_first[1:] != _PAD)
    if not tied.any():
        return order, None
    lcp = np.zeros(n, dtype=np.int64)
    starts = run_starts(sorted_first).nonzero()[0]
    sizes = run_lengths(starts, n)
    keep = (sizes >= 2) & (sorted_first[starts] != _PAD)
    seg_start, seg_size = starts[keep], sizes[keep]
    while seg_start.shape[0]:
        seg_start, seg_size = _refine(rows, lengths, order, lcp, seg_start, seg_size)
    return order, lcp


def _refine(rows, lengths, order, lcp, seg_start, seg_size):
    """One round of :func:`sorted_rows_lcp`: reorder each segment of tied rows around its first row (in place in
    ``order`` and ``lcp``) and return the segments still tied (start in ``order``, size)."""
    width = rows.shape[1]
    num_seg = seg_start.shape[0]
    seg_of = np.arange(num_seg, dtype=np.int64).repeat(seg_size)
    pos = np.arange(seg_of.shape[0], dtype=np.int64) + (seg_start - seg_size.cumsum() + seg_size).repeat(seg_size)
    elems = order[pos]
    is_leader = pos == seg_start[seg_of]
    leaders = elems[is_leader][seg_of]
    mism = _first_mismatch(rows, elems[~is_leader], leaders[~is_leader])
    raw = np.full(elems.shape[0], width, dtype=np.int64)
    raw[~is_leader] = mism
    # Padded rows (``_PAD`` past each end, then the row index) decide what the data alone does not.
    la, ll = lengths[elems], lengths[leaders]
    minlen = np.minimum(la, ll)
    in_data = raw < minlen
    m = np.minimum(raw, minlen)
    col = np.minimum(m, width - 1)
    differs = in_data | (la != ll)
    mstar = np.where(differs, m, width)
    va = np.where(in_data | (la > ll), rows[elems, col] if width else 0, np.where(la < ll, _PAD, elems))
    vl = np.where(in_data | (la < ll), rows[leaders, col] if width else 0, np.where(la > ll, _PAD, leaders))
    side = np.where(is_leader, 1, np.where(va > vl, 2, 0))
    # Below the leader: later mismatch = closer to it (ascending); above: descending.
    mkey = np.where(is_leader, 0, np.where(side == 2, -mstar, mstar))
    va = np.where(is_leader, 0, va)
    perm = np.lexsort((va, mkey, side, seg_of))
    elems, side, mkey, va, seg_of = elems[perm], side[perm], mkey[perm], va[perm], seg_of[perm]
    order[pos] = elems
    mfull = np.where(side == 1, _INT64_MAX, np.abs(mkey))
    pair = np.minimum(np.minimum(mfull[1:], mfull[:-1]), np.minimum(lengths[elems[1:]], lengths[elems[:-1]]))
    inner = seg_of[1:] == seg_of[:-1]
    lcp[pos[1:][inner]] = pair[inner]
    # Rows tied on (segment, side, mismatch, value) share one more column: the next round's segments.
    tie_start = run_starts(seg_of) | run_starts(side) | run_starts(mkey) | run_starts(va)
    starts = tie_start.nonzero()[0]
    sizes = run_lengths(starts, elems.shape[0])
    keep = (sizes >= 2) & (side[starts] != 1)
    return pos[starts[keep]], sizes[keep]


def tree_from_lcp(lcp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """lcp-intervals of a sorted row list with a stack, visiting only the positions where ``lcp`` changes.

    Between two change points the stack top already has depth ``lcp[i]``, so nothing is pushed or popped: the Python
    loop runs over change points (about two per sharing group), not over rows. Returns ``(depth, lb, rb, parent)``
    in post-order.
    """
    n = lcp.shape[0]
    ext = np.zeros(n + 1, dtype=np.int64)  # ext[i] = lcp[i] for 1 <= i < n; ext[n] = 0 closes every open interval
    ext[1:n] = lcp[1:]
    changes = (ext[1:] != ext[:-1]).nonzero()[0] + 1
    values = ext[changes]
    if not (values[1::2] != 0).any() and (values[0::2] != 0).all():
        # One level (runs of one nonzero LCP between zeros: disjoint groups): run k opens at changes[2k] and closes
        # at changes[2k + 1], as the stack below would find it, with no Python loop.
        opens, closes = changes[0::2], changes[1::2]
        return values[0::2].copy(), opens - 1, closes - 1, np.full(opens.shape[0], -1, dtype=np.int64)
    depth: list[int] = []
    lbs: list[int] = []
    rbs: list[int] = []
    parent: list[int] = []
    stack: list[list] = [[0, 0, []]]  # [depth, lb, child node ids]; the root (depth 0) is never emitted
    for i in changes.tolist():
        d = int(ext[i])
        lb = i - 1
        last = -1
        while d < stack[-1][0]:
            node_depth, lb, children = stack.pop()
            last = len(depth)
            depth.append(node_depth)
            lbs.append(lb)
            rbs.append(i - 1)
            parent.append(-1)
            for c in children:
                parent[c] = last
            if d <= stack[-1][0]:  # the enclosing interval is already open: it is the parent
                stack[-1][2].append(last)
                last = -1
        if d > stack[-1][0]:  # a new interval opens at lb; a node just closed (if any) is its first child
            stack.append([d, lb, [last] if last >= 0 else []])
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return as_array(depth), as_array(lbs), as_array(rbs), as_array(parent)


def _tree_without_nodes(order: np.ndarray) -> LcpTree:
    empty = np.zeros(0, dtype=np.int64)
    return LcpTree(order=order, lcp=np.zeros(order.shape[0], dtype=np.int64), depth=empty, lb=empty, rb=empty,
                   parent=empty)


def lcp_interval_tree(rows: np.ndarray, lengths: np.ndarray) -> LcpTree:
    """Prefix tree of integer rows: ``rows[i, :lengths[i]]`` is row ``i`` (entries >= 0; the rest is ignored)."""
    rows = np.asarray(rows)
    if rows.dtype.kind != "i":  # int32/int64 block ids are compared as they are (no copy of a long table)
        rows = rows.astype(np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n, width = rows.shape
    if n <= 1 or width == 0:
        return _tree_without_nodes(np.arange(n, dtype=np.int64))
    order, lcp = sorted_rows_lcp(rows, lengths)
    if lcp is None:
        # No two rows share their first entry (a batch without sharing): the first column alone orders the rows
        # (empty rows first, by index) and every LCP is 0.
        return _tree_without_nodes(order)
    depth, lb, rb, parent = tree_from_lcp(lcp)
    return LcpTree(order=order, lcp=lcp, depth=depth, lb=lb, rb=rb, parent=parent)


def block_prefix_tree(block_table: np.ndarray, shareable_lens: np.ndarray, block_size: int) -> LcpTree:
    """Prefix tree over the blocks of each request that hold *shareable* KV positions.

    Parameters
    ----------
    block_table : ndarray, ``[num_requests, max_blocks]`` integer
    shareable_lens : ndarray, ``[num_requests]`` integer
        KV positions of each request that every one of its query rows sees; a request with 0 takes no part.
    block_size : int

    Returns
    -------
    LcpTree over the rows ``block_table[r, :ceil(shareable_lens[r] / block_size)]``; a node's ``depth`` is in blocks.
    The compiled planner builds the same tree (:func:`prefixattn.plan_native_tree.check_and_tree`) and shares the
    tree cache below (:func:`cached_entry`, :func:`remember_tree`).
    """
    shareable_lens = np.asarray(shareable_lens, dtype=np.int64)
    num_blocks = (shareable_lens + block_size - 1) // block_size
    width = int(num_blocks.max()) if num_blocks.shape[0] else 0
    rows = np.asarray(block_table)[:, :width]
    last = cached_entry()
    if (last is not None and last[1].shape == num_blocks.shape and last[0].shape == rows.shape
            and (last[1] == num_blocks).all() and (last[0] == rows).all()):
        return last[2]
    return remember_tree(rows, num_blocks, lcp_interval_tree(rows, num_blocks))


def cached_entry():
    """This thread's tree cache entry ``(rows, num_blocks, tree)``, or None."""
    return getattr(_last_tree, "entry", None)


def remember_tree(rows: np.ndarray, num_blocks: np.ndarray, tree: LcpTree, *,
                  max_entries: int | None = None) -> LcpTree:
    """Freeze ``tree`` and keep it as this thread's last tree when it has nodes (and ``rows`` has at most
    ``max_entries`` entries); returns ``tree``."""
    for a in (tree.order, tree.lcp, tree.depth, tree.lb, tree.rb, tree.parent):
        # Shared by the plans of every step that reuses it; read-only always, so the compiled planner sees one
        # array type (numba compiles a variant per writability).
        a.setflags(write=False)
    if tree.num_nodes and (max_entries is None or rows.size <= max_entries):
        # The replaced entry's row buffer is reused (a fresh 2 MB buffer costs its page faults: ~2x the copy).
        last = cached_entry()
        same = last is not None and last[0].shape == rows.shape and last[0].dtype == rows.dtype
        buffer = last[0] if same else np.empty(rows.shape, dtype=rows.dtype)
        np.copyto(buffer, rows)
        _last_tree.entry = (buffer, num_blocks, tree)
    return tree


#: Largest row matrix (entries) the compiled tree keeps in the cache. The compiled build is one vectorized pass over
#: the shared prefix, as is the cache's check, and keeping the rows costs a copy: past this size (a 256 x 256 table,
#: ~0.25 MB) the cache would only add that copy (a 263 x 2,056 table: ~45 us per copy on the 2-core host).
COMPILED_CACHE_MAX_ENTRIES = 1 << 16

#: Per thread, the last tree with nodes, with the rows and block counts it was built from. An engine's decode loop
#: replans the same shareable rows every step until a request's shareable KV crosses a block boundary (at block
#: size 16, 15 of 16 steps when the requests' lengths are aligned); a tree costs ~40 numpy calls (~150 us on the
#: 2-core host) and, for long prefixes, a pass over the rows; the check is two comparisons. Reused only on equal rows
#: (the tree depends on nothing else), never across threads.
_last_tree = threading.local()


def clear_tree_cache() -> None:
    """Forget this thread's last tree (benchmarks time cold plans with it)."""
    _last_tree.entry = None
