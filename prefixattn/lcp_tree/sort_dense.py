"""The planner's sort: (order, LCPs) of a dense matrix of short integer rows (block ids) by leader refinement, and
:func:`lcp_interval_tree`, their :class:`~prefixattn.lcp_tree.nodes.LcpTree` (numpy only)."""

from __future__ import annotations

import numpy as np

from prefixattn.lcp_tree.nodes import LcpTree, tree_from_lcp
from prefixattn.ragged import run_lengths, run_starts

#: Padding value in the row matrix: below every real id (ids are >= 0), so a row that is a prefix of another sorts
#: first and never matches past its end.
_PAD = -1
_INT64_MAX = int(np.iinfo(np.int64).max)


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
