"""Compact prefix tree (radix tree) over a batch of integer sequences: sort, LCP array, tree from the LCP stack.

Offline, all rows are known up front, so instead of inserting rows one by one into a radix tree (what online
engines do) we sort the rows lexicographically, take the longest common prefix (LCP) of each pair of neighbours,
and build the compact tree from the LCP array with one stack pass (the classic LCP-interval construction). The LCP
of any two rows is the minimum of the neighbour LCPs between them, so the neighbour LCPs describe the whole tree.

The code is generic over integer sequences: the scheduler runs it over prompt token ids, and the kernel planner can
run it over block-table rows (block ids) to find which requests share KV blocks right now.

Sorting is an MSD refinement: rows that still tie are compared a window of ids at a time; each round sorts only the
still-tied rows by (segment, window) with one byte-string argsort and compares neighbouring windows with a
vectorized first-mismatch search, which also yields the LCP. The window widens round by round (long shared prefixes
need few rounds) but stays within a fixed element budget so memory is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixattn.scheduling.sequences import PackedSequences, pack_sequences

#: First comparison window (ids). Most rows diverge within a few dozen ids, so start small and widen.
_FIRST_WINDOW = 16
#: Widest comparison window (ids): long shared prefixes (documents of ~1k tokens) are crossed in a few rounds.
_MAX_WINDOW = 1024
#: Ids gathered per refinement round (rows x window): ~16M int64 keeps one round's temporaries near 300 MB.
_ROUND_ELEMENTS = 1 << 24


def _gather_windows(values: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """``[m, width]`` copies of ``values[pos[i]:pos[i] + width]``; ids past the end of ``values`` read as 0."""
    total = values.shape[0]
    if total >= width:
        inside = pos <= total - width
        windows = np.lib.stride_tricks.sliding_window_view(values, width)
        if inside.all():
            return windows[pos]  # one contiguous row copy per window: much faster than element-wise fancy indexing
        out = np.zeros((pos.shape[0], width), dtype=values.dtype)
        out[inside] = windows[pos[inside]]
        outside = ~inside
    else:
        out = np.zeros((pos.shape[0], width), dtype=values.dtype)
        outside = np.ones(pos.shape[0], dtype=bool)
    idx = pos[outside, None] + np.arange(width, dtype=np.int64)[None, :]
    out[outside] = np.where(idx < total, values[np.minimum(idx, max(total - 1, 0))] if total else 0, 0)
    return out


def _window_keys(values: np.ndarray, pos: np.ndarray, remaining: np.ndarray, seg: np.ndarray,
                 width: int) -> np.ndarray:
    """Sort keys ``[m, width + 2]`` uint32 holding big-endian bytes: segment id (2 words), then ``id + 1`` per id
    of the window and 0 past the row's end.

    Big-endian unsigned words compare bytewise in numeric order, so a key row viewed as one byte string sorts by
    (segment, window) lexicographically, and the 0 after a row's end sorts it before its extensions.
    """
    m = pos.shape[0]
    keys = np.empty((m, width + 2), dtype=np.uint32)
    keys[:, 0] = seg >> 32
    keys[:, 1] = seg & 0xFFFFFFFF
    body = keys[:, 2:]
    np.add(_gather_windows(values, pos, width), 1, out=body, casting="unsafe")
    body *= np.arange(width, dtype=np.int64)[None, :] < remaining[:, None]
    keys.byteswap(inplace=True)
    return keys


def sort_and_lcp(values: np.ndarray, offsets: np.ndarray, lengths: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Sort rows lexicographically and return the LCP of each row with its predecessor.

    Row ``i`` is ``values[offsets[i]:offsets[i] + lengths[i]]`` (rows stored back to back, optionally truncated).
    A row sorts before every longer row it prefixes. Ties (identical rows) keep ascending row index, so the result
    never depends on hashing or memory layout.

    Parameters
    ----------
    values : np.ndarray
        ``[total]`` integer ids in ``[0, 2**32 - 2]`` (unchecked: call :func:`pack_sequences` first).
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
    >>> order, lcp = sort_and_lcp(np.array([3, 1, 3, 0, 3]), np.array([0, 2, 4, 5]))
    >>> order.tolist(), lcp.tolist()
    ([2, 1, 0], [0, 1, 1])
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets) if lengths is None else np.asarray(lengths, dtype=np.int64)
    values = values.view(np.uint32) if values.dtype == np.int32 else values  # ids are >= 0: same bits
    starts = offsets[:-1]
    n = lengths.shape[0]
    order = np.arange(n, dtype=np.int64)
    lcp = np.zeros(n, dtype=np.int64)
    if n < 2:
        return order, lcp
    # Rows still tied, by sorted position, and the segment (tie group) of each: the position where the segment
    # starts. A segment's positions are contiguous, so sorting by (segment, window) keeps each row in its range.
    active_pos = np.arange(n, dtype=np.int64)
    active_seg = np.zeros(n, dtype=np.int64)
    depth = 0
    window = _FIRST_WINDOW
    while active_pos.size:
        m = active_pos.size
        width = int(min(window, max(_FIRST_WINDOW, _ROUND_ELEMENTS // m)))
        rows = order[active_pos]
        keys = _window_keys(values, starts[rows] + depth, lengths[rows] - depth, active_seg, width)
        # Segments whose rows all agree on this window need no sort (common while crossing a long shared prefix).
        same_seg = active_seg[1:] == active_seg[:-1]
        differ = (keys[1:, 2:] != keys[:-1, 2:]).any(axis=1)
        dirty_seg = np.zeros(m, dtype=bool)
        dirty_seg[1:] = same_seg & differ
        if dirty_seg.any():
            seg_id = np.cumsum(~np.concatenate(([False], same_seg)))  # 1-based dense segment index per row
            dirty_rows = np.isin(seg_id, seg_id[dirty_seg])
            sub = np.flatnonzero(dirty_rows)
            perm = np.argsort(keys[sub].view(f"S{4 * (width + 2)}").ravel(), kind="stable")
            sub_sorted = sub[perm]
            rows[sub] = rows[sub_sorted]
            keys[sub] = keys[sub_sorted]
            order[active_pos] = rows
            mismatch = keys[1:, 2:] != keys[:-1, 2:]
            differ = mismatch.any(axis=1)
            first = mismatch.argmax(axis=1)
            del mismatch
        else:
            first = np.zeros(m - 1, dtype=np.int64)
        del keys
        # A row ending strictly inside the window has a 0 there, so rows tying with it are duplicates. A row
        # ending exactly at the window edge still ties with its longer extensions and goes one more round.
        ended = lengths[rows] < depth + width
        split = same_seg & differ
        dup = same_seg & ~differ & ended[1:]
        lcp[active_pos[1:][split]] = depth + first[split]
        lcp[active_pos[1:][dup]] = lengths[rows[1:][dup]]
        # New segments start where the old segment or the window changes; keep those that still tie and continue.
        new_start = np.ones(m, dtype=bool)
        new_start[1:] = ~(same_seg & ~differ)
        start_idx = np.flatnonzero(new_start)
        sizes = np.diff(np.append(start_idx, m))
        keep_seg = (sizes >= 2) & ~ended[start_idx]
        keep = np.repeat(keep_seg, sizes)
        new_seg = np.repeat(active_pos[start_idx], sizes)
        active_pos = active_pos[keep]
        active_seg = new_seg[keep]
        depth += width
        window = min(window * 2, _MAX_WINDOW)
    return order, lcp


@dataclass(frozen=True)
class PrefixTree:
    """Compact prefix tree of ``N`` rows; node 0 is the (empty) root, every row is one leaf.

    Internal nodes have at least two children (the root may have one). A leaf hangs under the internal node at the
    depth where its row stops sharing; a row that is a prefix of another row (or a duplicate) is a leaf whose own
    edge is empty (``depth[leaf] == depth[parent[leaf]]``). Leaves of a subtree are the contiguous sorted positions
    ``lo[v]:hi[v]``.

    Attributes
    ----------
    order : np.ndarray
        ``[N]`` int64 row index at each sorted position.
    lcp : np.ndarray
        ``[N]`` int64 LCP with the previous sorted row (``lcp[0] = 0``).
    lengths : np.ndarray
        ``[N]`` int64 row lengths, indexed by row.
    parent : np.ndarray
        ``[num_nodes]`` int64 parent node (-1 for the root).
    depth : np.ndarray
        ``[num_nodes]`` int64 ids from the row start to the end of the node (its prefix length).
    lo, hi : np.ndarray
        ``[num_nodes]`` int64 sorted-position range of the node's leaves.
    leaf : np.ndarray
        ``[num_nodes]`` int64 sorted position of a leaf's row, -1 for internal nodes.
    post_order : np.ndarray
        ``[num_nodes]`` int64 nodes with every node after all of its descendants (root last).
    """

    order: np.ndarray
    lcp: np.ndarray
    lengths: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    leaf: np.ndarray
    post_order: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.order.shape[0])

    @property
    def num_leaves(self) -> np.ndarray:
        """``[num_nodes]`` int64 rows in each node's subtree."""
        return self.hi - self.lo

    def children(self) -> tuple[np.ndarray, np.ndarray]:
        """Children of every node in sorted (left to right) order, as CSR.

        Returns
        -------
        indptr : np.ndarray
            ``[num_nodes + 1]``; the children of ``v`` are ``indices[indptr[v]:indptr[v + 1]]``.
        indices : np.ndarray
            ``[num_nodes - 1]`` child node ids.
        """
        kids = np.flatnonzero(self.parent >= 0)
        # A leaf with an empty edge and its sibling internal node can share ``lo``; leaves sort first (they are the
        # shorter rows).
        kids = kids[np.lexsort((self.leaf[kids] < 0, self.lo[kids], self.parent[kids]))]
        counts = np.bincount(self.parent[kids], minlength=self.num_nodes)
        indptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return indptr, kids

    def shared_tokens(self) -> int:
        """Ids stored once per tree node: ``sum(lengths) - sum(lcp)`` (the optimum of prefix sharing)."""
        return int(self.lengths.sum() - self.lcp.sum())


def build_tree(sorted_lengths: np.ndarray, lcp: np.ndarray) -> dict[str, np.ndarray]:
    """Build the compact tree from sorted row lengths and the neighbour LCP array in one stack pass, O(N).

    Parameters
    ----------
    sorted_lengths : np.ndarray
        ``[N]`` lengths of the rows in sorted order.
    lcp : np.ndarray
        ``[N]`` neighbour LCPs from :func:`sort_and_lcp`.

    Returns
    -------
    dict
        ``parent, depth, lo, hi, leaf, post_order`` arrays as in :class:`PrefixTree`.
    """
    lens = sorted_lengths.tolist()
    lcps = lcp.tolist()
    n = len(lens)
    parent = [-1]
    depth = [0]
    lo = [0]
    hi = [n]
    leaf = [-1]
    post: list[int] = []
    stack = [0]
    for i in range(n):
        cut = lcps[i] if i else 0
        last = -1
        top = stack[-1]
        # Pop the previous leaf and every internal node deeper than the shared prefix; each popped node is the
        # parent of the one popped before it (the stack is a root-to-leaf path).
        while leaf[top] >= 0 or depth[top] > cut:
            stack.pop()
            hi[top] = i
            post.append(top)
            if last >= 0:
                parent[last] = top
            last = top
            top = stack[-1]
        if last >= 0:
            if depth[top] < cut:  # the shared prefix ends inside an edge: split it with a new internal node
                new = len(depth)
                parent.append(top)
                depth.append(cut)
                lo.append(lo[last])
                hi.append(-1)
                leaf.append(-1)
                parent[last] = new
                stack.append(new)
            else:
                parent[last] = top
        new = len(depth)
        parent.append(stack[-1])
        depth.append(lens[i])
        lo.append(i)
        hi.append(i + 1)
        leaf.append(i)
        stack.append(new)
    last = -1
    while stack:
        top = stack.pop()
        if leaf[top] < 0:
            hi[top] = n
        post.append(top)
        if last >= 0:
            parent[last] = top
        last = top
    return dict(parent=np.array(parent, dtype=np.int64), depth=np.array(depth, dtype=np.int64),
                lo=np.array(lo, dtype=np.int64), hi=np.array(hi, dtype=np.int64),
                leaf=np.array(leaf, dtype=np.int64), post_order=np.array(post, dtype=np.int64))


def prefix_tree(seqs, *, drop_last: int = 0, name: str = "seqs") -> PrefixTree:
    """Compact prefix tree of a batch of integer sequences (token ids or block ids).

    Parameters
    ----------
    seqs : Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray | PackedSequences
        ``N >= 1`` rows of ids in ``[0, 2**32 - 2]``; see :func:`pack_sequences`.
    drop_last : int
        Build the tree over each row without its last ``drop_last`` ids (rows must be at least that long). The
        scheduler passes 1: a request must compute its last prompt token itself to get its first output token.
    name : str
        Argument name used in error messages.

    Returns
    -------
    PrefixTree

    Examples
    --------
    >>> t = prefix_tree([[1, 2, 3], [1, 2, 4], [7]])
    >>> t.depth[t.parent[t.leaf >= 0]].tolist()   # the two [1, 2, ...] rows share an internal node of depth 2
    [2, 2, 0]
    >>> t.shared_tokens()
    5
    """
    packed = pack_sequences(seqs, name=name, min_len=max(1, drop_last))
    return prefix_tree_packed(packed, drop_last=drop_last)


def prefix_tree_packed(packed: PackedSequences, *, drop_last: int = 0) -> PrefixTree:
    """:func:`prefix_tree` on an already checked :class:`PackedSequences`."""
    lengths = packed.lengths - drop_last
    order, lcp = sort_and_lcp(packed.values, packed.offsets, lengths)
    arrays = build_tree(lengths[order], lcp)
    return PrefixTree(order=order, lcp=lcp, lengths=lengths, **arrays)
