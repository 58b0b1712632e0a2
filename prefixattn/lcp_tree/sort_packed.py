"""The scheduler's sort: (order, LCPs) of packed token-id rows by an MSD refinement driven by chunk hashes, and
:func:`tree_of_rows`, their :class:`~prefixattn.lcp_tree.nodes.PrefixTree` (numpy only).

Sorting is an MSD refinement over rows that still tie (segments), one fixed-size chunk of ids per round, all vectorized,
driven by chunk hashes (:mod:`prefixattn.chunk_hash`, computed once in one streaming pass). A segment whose rows all
hash alike on the round's chunk moves on by a chunk with no sort and no id read: crossing a shared document costs one
hash comparison per row and chunk, so the work grows with the distinct chunks, not the ids. A segment whose hashes
differ is sorted by the chunk's ids (one integer lexsort for all such segments at once, see :func:`_sort_keys`), and the
first mismatch of the sorted neighbours inside that chunk gives the exact LCP; rows still tied on the whole chunk go on
from after it. Ids are compared by their native bytes: any fixed order of the ids gives a valid tree order, and skipping
a byte swap saves a pass. The order and the LCPs are those of a plain lexicographic sort (they do not depend on the
hashes) unless two different chunks at the same depth of tied rows had equal hashes, which :mod:`prefixattn.chunk_hash`
bounds at about 2**-64 per compared pair of token chunks."""

from __future__ import annotations

import numpy as np

from prefixattn.chunk_hash import CHUNK, as_uint32, chunk_hashes
from prefixattn.lcp_tree.nodes import PrefixTree, prefix_tree_from_lcp

#: End-of-row marker in the comparison windows: above every id (ids are at most 2**32 - 2).
_END = np.uint32(0xFFFFFFFF)


def _gather_windows(values: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """``[m, width]`` uint32 copies of ``values[pos[i]:pos[i] + width]``; ids past the end of ``values`` read as
    :data:`_END`."""
    total = values.shape[0]
    if total >= width:
        inside = pos <= total - width
        windows = np.lib.stride_tricks.as_strided(values, shape=(total - width + 1, width),
                                                  strides=(values.strides[0], values.strides[0]), writeable=False)
        if inside.all():
            # One contiguous row copy per window: much faster than element-wise fancy indexing.
            return windows[pos].astype(np.uint32, copy=False)
        out = np.full((pos.shape[0], width), _END, dtype=np.uint32)
        out[inside] = windows[pos[inside]]
        outside = ~inside
    else:
        out = np.full((pos.shape[0], width), _END, dtype=np.uint32)
        outside = np.ones(pos.shape[0], dtype=bool)
    idx = pos[outside, None] + np.arange(width, dtype=np.int64)[None, :]
    if total:
        out[outside] = np.where(idx < total, values[np.minimum(idx, total - 1)], _END)
    return out


def _windows(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, rows: np.ndarray, depth: np.ndarray,
             width: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows ``[m, width]`` of ``rows`` from ``depth`` on, :data:`_END` past each row's end; and the ids each
    row has left from ``depth``."""
    remaining = lengths[rows] - depth
    win = _gather_windows(values, starts[rows] + depth, width)
    ending = remaining < width
    if ending.any():  # past a row's end: the end marker (the gather read the next row's ids there)
        cols = np.arange(width, dtype=np.int64)[None, :]
        if ending.sum() * 4 > rows.shape[0]:
            np.putmask(win, cols >= remaining[:, None], _END)
        else:
            idx = np.flatnonzero(ending)
            win[idx] = np.where(cols < remaining[idx, None], win[idx], _END)
    return win, remaining


def _sort_keys(key: np.ndarray, seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stable order of the ``[m, C]`` uint32 ``key`` rows by (``seg``, the keys' native bytes, as ``memcmp``), and
    the id mismatches ``[m - 1, C]`` of the sorted neighbours. ``seg`` is non-decreasing (segments contiguous).

    Rows of a segment agree up to the first column where any of them differs from the segment's first row; the
    two ids from there (``C - 2`` at the latest), read as one big-endian uint64, order like their bytes, so one
    two-key integer ``lexsort`` sorts the rows. Only rows tied on (segment, those two ids) whose other ids differ,
    rare for token chunks, are sorted again by their whole byte strings (a 256-byte string sort is several times
    slower than the lexsort)."""
    m, width = key.shape
    new_seg = np.ones(m, dtype=bool)
    new_seg[1:] = seg[1:] != seg[:-1]
    seg_start = np.flatnonzero(new_seg)
    sizes = np.diff(np.append(seg_start, m))
    differs = key != key[np.repeat(seg_start, sizes)]
    col = differs.argmax(axis=1)
    col[~differs[np.arange(m), col]] = width  # a row equal to its segment's first: no column
    cut = np.minimum(np.minimum.reduceat(col, seg_start), max(0, width - 2))
    head_cols = np.repeat(cut, sizes)[:, None] + np.arange(min(2, width), dtype=np.int64)[None, :]
    head = np.take_along_axis(key, head_cols, axis=1)
    head = np.ascontiguousarray(head).view(f">u{4 * head.shape[1]}").ravel().astype(np.uint64)
    order = np.lexsort((head, seg))
    key, head, seg = key[order], head[order], seg[order]
    kmis = key[1:] != key[:-1]
    tied = (seg[1:] == seg[:-1]) & (head[1:] == head[:-1])
    redo = tied & kmis.any(axis=1)
    if redo.any():
        run = np.cumsum(np.concatenate([[True], ~tied]))  # runs of equal (segment, head), numbered
        pos = np.flatnonzero(np.isin(run, run[1:][redo]))
        by_bytes = np.argsort(key[pos].view(f"S{4 * width}").ravel(), kind="stable")
        by_bytes = by_bytes[np.argsort(run[pos][by_bytes], kind="stable")]
        order[pos] = order[pos][by_bytes]
        key[pos] = key[pos][by_bytes]
        kmis = key[1:] != key[:-1]
    return order, kmis


def _sort_chunk(*, values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, rows: np.ndarray, sub: np.ndarray,
                seg_id: np.ndarray, depth: int, pair_differ: np.ndarray, pair_lcp: np.ndarray,
                ended: np.ndarray) -> None:
    """One round of :func:`sort_and_lcp` for the tied rows ``rows[sub]`` whose chunk at ``depth`` must be compared:
    sorts them within their segments (``rows`` in place) by the chunk's ids and writes, per sorted position ``i`` of
    ``sub``, whether row ``i`` differs from row ``i - 1`` of its segment, their LCP if so, and whether the row ends
    inside the chunk."""
    key, key_left = _windows(values, starts, lengths, rows[sub], np.full(sub.size, depth, np.int64), CHUNK)
    by_segment, kmis = _sort_keys(key, seg_id[sub])
    rows[sub] = rows[sub][by_segment]
    key_left = key_left[by_segment]
    kfirst = kmis.argmax(axis=1)
    kdiff = kmis[np.arange(sub.size - 1), kfirst]
    inner = seg_id[sub][1:] == seg_id[sub][:-1]
    pair_differ[sub[1:][inner]] = kdiff[inner]
    pair_lcp[sub[1:][inner]] = depth + kfirst[inner]
    ended[sub] = key_left < CHUNK


def sort_and_lcp(values: np.ndarray, offsets: np.ndarray, lengths: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Sort rows into a prefix-tree (trie) order and return the LCP of each row with its predecessor.

    Row ``i`` is ``values[offsets[i]:offsets[i] + lengths[i]]`` (rows stored back to back, optionally truncated).
    The order is lexicographic over a fixed order of the ids (their native uint32 bytes, compared as bytes; a row
    comes after the longer rows it prefixes): what matters is that rows sharing any prefix are contiguous, so the
    LCP of two rows is the minimum of the neighbour LCPs between them. Identical rows keep ascending row index, so
    the result does not depend on memory layout (nor on the chunk hashes, barring a collision: see the module notes).

    Parameters
    ----------
    values : np.ndarray
        ``[total]`` integer ids in ``[0, 2**32 - 2]`` (unchecked: :func:`prefixattn.scheduling.pack_sequences`
        checks them).
    offsets : np.ndarray
        ``[N + 1]`` int64 row boundaries.
    lengths : np.ndarray, optional
        ``[N]`` int64 row lengths to compare, at most ``offsets[i + 1] - offsets[i]`` (default: whole rows).

    Returns
    -------
    order : np.ndarray
        ``[N]`` int64; ``order[k]`` is the row at sorted position ``k``.
    lcp : np.ndarray
        ``[N]`` int64; ``lcp[k]`` is the common prefix length of rows ``order[k - 1]`` and ``order[k]``;
        ``lcp[0] = 0``.

    Examples
    --------
    >>> order, lcp = sort_and_lcp(np.array([3, 1, 3, 1, 3]), np.array([0, 2, 4, 5]))
    >>> order.tolist(), lcp.tolist()    # [3, 1] twice, then [3], which prefixes them
    ([0, 1, 2], [0, 2, 1])
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets) if lengths is None else np.asarray(lengths, dtype=np.int64)
    starts = offsets[:-1]
    n = lengths.shape[0]
    order = np.arange(n, dtype=np.int64)
    lcp = np.zeros(n, dtype=np.int64)
    if n < 2:
        return order, lcp
    values = as_uint32(values)
    num_chunks = lengths // CHUNK
    first_chunk, h0, h1 = chunk_hashes(values, starts, num_chunks, chunk=CHUNK)
    # Rows still tied, by sorted position, and the segment (tie group) of each, named by the position where it
    # starts. Round ``level`` looks at chunk ``level`` of every active row: all of them share their first
    # ``level * CHUNK`` ids with their segment. A segment's positions are contiguous and stay so: rows are only
    # reordered within their segment.
    active_pos = np.arange(n, dtype=np.int64)
    active_seg = np.zeros(n, dtype=np.int64)
    level = 0
    while active_pos.size:
        active_pos, active_seg = _lcp_round(
            values=values, starts=starts, lengths=lengths, num_chunks=num_chunks, first_chunk=first_chunk, h0=h0,
            h1=h1, order=order, lcp=lcp, active_pos=active_pos, active_seg=active_seg, level=level)
        level += 1
    return order, lcp


def _segments_to_sort(*, rows: np.ndarray, new_seg: np.ndarray, seg_id: np.ndarray, level: int,
                      num_chunks: np.ndarray, first_chunk: np.ndarray, h0: np.ndarray, h1: np.ndarray
                      ) -> np.ndarray:
    """Per segment, whether its rows must be compared on chunk ``level``."""
    # Segments whose rows all have this whole chunk with equal hashes stay tied, unsorted. The others (a pair
    # hashing apart, or a row ending inside the chunk) are sorted by the chunk's ids.
    whole = num_chunks[rows] > level
    idx = np.where(whole, first_chunk[rows] + level, 0)
    alike = whole[1:] & whole[:-1]
    if h0.size:
        g0, g1 = h0[idx], h1[idx]  # one random gather per row, not two
        alike &= (g0[1:] == g0[:-1]) & (g1[1:] == g1[:-1])
    to_sort = np.zeros(int(seg_id[-1]) + 1, dtype=bool)
    to_sort[seg_id[1:][~alike & ~new_seg[1:]]] = True
    to_sort[seg_id[~whole]] = True
    return to_sort


def _lcp_round(*, values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, num_chunks: np.ndarray,
               first_chunk: np.ndarray, h0: np.ndarray, h1: np.ndarray, order: np.ndarray, lcp: np.ndarray,
               active_pos: np.ndarray, active_seg: np.ndarray, level: int) -> tuple[np.ndarray, np.ndarray]:
    """Round ``level`` of :func:`sort_and_lcp`: sorts the active rows' tied segments on chunk ``level`` (``order``
    in place), writes the LCP of every row that stops tying (``lcp`` in place) and returns the rows still tied
    and their segments, ``(active_pos, active_seg)``."""
    m = active_pos.size
    rows = order[active_pos]
    depth = level * CHUNK
    new_seg = np.ones(m, dtype=bool)
    new_seg[1:] = active_seg[1:] != active_seg[:-1]
    seg_id = np.cumsum(new_seg) - 1
    to_sort = _segments_to_sort(rows=rows, new_seg=new_seg, seg_id=seg_id, level=level, num_chunks=num_chunks,
                                first_chunk=first_chunk, h0=h0, h1=h1)
    pair_differ = np.zeros(m, dtype=bool)  # [i]: row i differs from row i - 1 (same segment)
    pair_lcp = np.zeros(m, dtype=np.int64)
    ended = np.zeros(m, dtype=bool)
    sub = np.flatnonzero(to_sort[seg_id])
    if sub.size:
        _sort_chunk(values=values, starts=starts, lengths=lengths, rows=rows, sub=sub, seg_id=seg_id, depth=depth,
                    pair_differ=pair_differ, pair_lcp=pair_lcp, ended=ended)
        order[active_pos] = rows
    same_seg = ~new_seg[1:]
    differ = pair_differ[1:]
    # A row ending strictly inside the chunk has an end marker there, so rows tying with it are duplicates. A
    # row ending exactly at the chunk's end still ties with its longer extensions and goes on.
    split = same_seg & differ
    dup = same_seg & ~differ & ended[1:]
    lcp[active_pos[1:][split]] = pair_lcp[1:][split]
    lcp[active_pos[1:][dup]] = lengths[rows[1:][dup]]
    # New segments start where the old segment or the chunk changes; keep those that still tie and continue.
    starts_here = np.ones(m, dtype=bool)
    starts_here[1:] = ~(same_seg & ~differ)
    start_idx = np.flatnonzero(starts_here)
    sizes = np.diff(np.append(start_idx, m))
    keep_seg = (sizes >= 2) & ~ended[start_idx]
    keep = np.repeat(keep_seg, sizes)
    return active_pos[keep], np.repeat(active_pos[start_idx], sizes)[keep]


def tree_of_rows(values: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> PrefixTree:
    """:class:`PrefixTree` of rows ``values[offsets[i]:offsets[i] + lengths[i]]`` (unchecked, as :func:`sort_and_lcp`).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order, lcp = sort_and_lcp(values, offsets, lengths)
    return prefix_tree_from_lcp(order, lcp, lengths)
