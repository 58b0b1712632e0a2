"""Compiled (numba) block prefix tree: the same order, LCPs and lcp-intervals as
:func:`prefixattn.planner.tree.block_tree` (:mod:`prefixattn.lcp_tree`), and the same tree cache.

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)`` but the
stage's Python side at the end. The definitions of what is computed are :func:`prefixattn.lcp_tree.sorted_rows_lcp`
(lexicographic order of the padded rows, then the row index; LCP of sorted neighbours) and
:func:`prefixattn.lcp_tree.tree_from_lcp` (the lcp-interval stack, nodes in post-order); ``tests/test_plan_compiled.py``
checks both give equal arrays.

Algorithm (the numpy one, per segment instead of per round): rows are grouped by their first entry; each group of
tied rows is compared with its first row (the leader) over the columns not yet known equal, which places every other
row before or after the leader by (first mismatch, value there); rows still tied form new segments. Comparisons run
over chunks of columns with no early exit inside a chunk, so LLVM vectorizes them (one pass over the shared prefix
per row per level of sharing); the checks' LCP hints (:mod:`prefixattn.planner.compiled.checks`) skip what a row is
known to share with the previous one.

The row primitives are the checks' (:func:`~prefixattn.planner.compiled.checks._differ`, ``_mismatch``,
``_row_bounds``): numba's on-disk cache keys this file's functions on this file alone, so it pins that file by
:data:`CHECKS_SOURCE_HASH` (``tests/test_plan_compiled.py`` fails until the pin matches).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prefixattn.lcp_tree import LcpTree, keep_compiled_tree, set_cached_blocks
from prefixattn.planner.checks import Inputs
from prefixattn.planner.compiled.checks import NO_BLOCKS, NO_CACHE, _differ, _mismatch, _row_bounds

#: The first 16 hex digits of the sha256 of :mod:`prefixattn.planner.compiled.checks`' file, whose row primitives
#: this file's functions compile in (see the module docstring).
CHECKS_SOURCE_HASH = "7766ad06f26007df"
#: Padding past a row's end: below every real id (ids are >= 0), as in prefixattn.lcp_tree.sort_dense.
_PAD = -1
_INT64_MAX = np.iinfo(np.int64).max


@njit(cache=True, nogil=True)
def _key_less(s1, m1, v1, s2, m2, v2):
    if s1 != s2:
        return s1 < s2
    if m1 != m2:
        return m1 < m2
    return v1 < v2


@njit(cache=True, nogil=True)
def _sort_segment(idx, side, mkey, va, tmp):
    """Stable merge sort of the positions ``idx`` by ``(side, mkey, va)`` (in place; ``tmp`` as scratch)."""
    n = idx.shape[0]
    width = 1
    while width < n:
        lo = 0
        while lo < n - width:
            mid, hi = lo + width, min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                a, b = idx[i], idx[j]
                if _key_less(side[b], mkey[b], va[b], side[a], mkey[a], va[a]):
                    tmp[k] = b
                    j += 1
                else:
                    tmp[k] = a
                    i += 1
                k += 1
            while i < mid:
                tmp[k] = idx[i]
                i += 1
                k += 1
            while j < hi:
                tmp[k] = idx[j]
                j += 1
                k += 1
            idx[lo:hi] = tmp[lo:hi]
            lo += 2 * width
        width *= 2


#: Packed sort key ``side << 61 | (mkey + _MKEY_BIAS) << _VA_BITS | (va + 1)`` (side <= 2: below 2^63): fits when
#: |mkey| < 2^20 columns and -1 <= va < 2^40 - 1 (block ids, row indices); else the merge sort compares the keys.
_VA_BITS = 40
_MKEY_BIAS = 1 << 20


@njit(cache=True, nogil=True)
def _sort_keys(idx, side, mkey, va, key, tmp):
    """Positions ``idx`` ordered by ``(side, mkey, va)``. Ties may come out in any order: tied rows form the next
    segment, which is ordered from scratch, so the final order is the unique one of the padded rows."""
    n = idx.shape[0]
    for k in range(n):
        if not (-_MKEY_BIAS < mkey[k] < _MKEY_BIAS and -1 <= va[k] < (1 << _VA_BITS) - 1):
            _sort_segment(idx, side, mkey, va, tmp)
            return
        key[k] = (side[k] << 61) | ((mkey[k] + _MKEY_BIAS) << _VA_BITS) | (va[k] + 1)
    perm = np.argsort(key[:n])  # quicksort: ~2x the merge sort's speed, stability not needed (above)
    for k in range(n):
        tmp[k] = idx[perm[k]]
    idx[:] = tmp[:n]


#: Rows whose index fits the low bits of :func:`_stable_argsort`'s packed key.
_INDEX_BITS = 22


@njit(cache=True, nogil=True)
def _stable_argsort(first):
    """``argsort(first, kind="stable")``: a quicksort of ``(first + 1) << _INDEX_BITS | index`` (unique keys: any
    sort is stable; ~2x numba's merge sort) when it fits, else the merge sort."""
    n = first.shape[0]
    key = np.empty(n, dtype=np.int64)
    if n >= (1 << _INDEX_BITS):
        return np.argsort(first, kind="mergesort").astype(np.int64)
    for i in range(n):
        if not (-1 <= first[i] < (1 << (62 - _INDEX_BITS)) - 1):
            return np.argsort(first, kind="mergesort").astype(np.int64)
        key[i] = ((first[i] + 1) << _INDEX_BITS) | i
    key.sort()
    for i in range(n):
        key[i] &= (1 << _INDEX_BITS) - 1
    return key


@njit(cache=True, nogil=True)
def _refine_segment(rows, lengths, width, prev_lcp, order, lcp, st_start, st_size, st_depth, top, side, mkey, va,
                    mfull, elems, perm, key, tmp):
    """Order the segment on top of the stack (entry ``top``, popped) around its leader, set its neighbours' LCPs
    and push its tie groups; returns the new stack size."""
    s0, size, known = st_start[top], st_size[top], st_depth[top]
    leader = order[s0]
    ll = lengths[leader]
    hint = -1
    chain = _INT64_MAX  # min of prev_lcp from the leader to the member: columns they share (0 once a row is skipped)
    for k in range(size):
        e = order[s0 + k]
        elems[k] = e
        perm[k] = k
        if k == 0:
            side[k], mkey[k], va[k], mfull[k] = 1, 0, 0, _INT64_MAX
            continue
        chain = min(chain, prev_lcp[e]) if e == order[s0 + k - 1] + 1 else 0
        la = lengths[e]
        minlen = min(la, ll)
        m = _mismatch(rows, e, leader, max(min(known, minlen), min(chain, minlen)), minlen, hint)
        if m < minlen:
            hint = m
            v, vl = np.int64(rows[e, m]), np.int64(rows[leader, m])
            mstar = m
        elif la != ll:
            mstar = minlen
            v = _PAD if la < ll else np.int64(rows[e, m])
            vl = _PAD if la > ll else np.int64(rows[leader, m])
        else:  # identical padded rows: the row index decides
            mstar = width
            v, vl = e, leader
        s = 2 if v > vl else 0
        side[k], mkey[k], va[k] = s, (-mstar if s == 2 else mstar), v
        mfull[k] = mstar
    _sort_keys(perm[:size], side, mkey, va, key, tmp)
    for k in range(size):
        order[s0 + k] = elems[perm[k]]
    # LCPs of neighbours (a tie group's inner ones are refined when it is processed), then the tie groups.
    g = 0
    for k in range(size):
        p = perm[k]
        if k > 0:
            q = perm[k - 1]
            lcp[s0 + k] = min(min(mfull[p], mfull[q]), min(lengths[elems[p]], lengths[elems[q]]))
            if not (side[p] == side[q] and mkey[p] == mkey[q] and va[p] == va[q]):
                if k - g >= 2 and side[q] != 1:
                    st_start[top], st_size[top], st_depth[top] = s0 + g, k - g, mfull[q]
                    top += 1
                g = k
    q = perm[size - 1]
    if size - g >= 2 and side[q] != 1:
        st_start[top], st_size[top], st_depth[top] = s0 + g, size - g, mfull[q]
        top += 1
    return top


@njit(cache=True, nogil=True)
def sorted_rows_lcp(rows, width, lengths, prev_lcp):
    """``(order, lcp, any_tied)`` of :func:`prefixattn.lcp_tree.sorted_rows_lcp` over ``rows[:, :width]``
    (``lcp`` all 0 when nothing is tied: the numpy function returns None there).

    ``prev_lcp[r] <= LCP(rows[r - 1], rows[r])`` over their lengths (0: no hint): a row's mismatch with its segment's
    leader, when the rows between them are consecutive members, is searched from the smallest of those hints on
    (equal columns are transitive), not from the columns the segment knows equal."""
    n = rows.shape[0]
    first = np.empty(n, dtype=np.int64)
    for i in range(n):
        first[i] = rows[i, 0] if (lengths[i] > 0 and width > 0) else _PAD
    in_order = True
    for i in range(1, n):
        if first[i] < first[i - 1]:
            in_order = False
            break
    # Stable (rows of one first entry by index); a table already in order needs no sort.
    order = np.arange(n) if in_order else _stable_argsort(first)
    lcp = np.zeros(n, dtype=np.int64)
    # Segment stack: (start in order, size, columns known equal).
    st_start = np.empty(n + 1, dtype=np.int64)
    st_size = np.empty(n + 1, dtype=np.int64)
    st_depth = np.empty(n + 1, dtype=np.int64)
    top = 0
    any_tied = False
    i = 0
    while i < n:
        j = i + 1
        while j < n and first[order[j]] == first[order[i]]:
            j += 1
        if j - i >= 2 and first[order[i]] != _PAD:
            any_tied = True
            st_start[top], st_size[top], st_depth[top] = i, j - i, 1
            top += 1
        i = j
    if not any_tied:
        return order, lcp, False
    side = np.empty(n, dtype=np.int64)
    mkey = np.empty(n, dtype=np.int64)
    va = np.empty(n, dtype=np.int64)
    mfull = np.empty(n, dtype=np.int64)
    elems = np.empty(n, dtype=np.int64)
    perm = np.empty(n, dtype=np.int64)
    tmp = np.empty(n, dtype=np.int64)
    key = np.empty(n, dtype=np.int64)
    while top > 0:
        top = _refine_segment(rows, lengths, width, prev_lcp, order, lcp, st_start, st_size, st_depth, top - 1, side,
                              mkey, va, mfull, elems, perm, key, tmp)
    return order, lcp, True


@njit(cache=True, nogil=True)
def tree_from_lcp(lcp):
    """``(depth, lb, rb, parent)`` of :func:`prefixattn.lcp_tree.tree_from_lcp` (post-order)."""
    n = lcp.shape[0]
    depth = np.empty(n, dtype=np.int64)
    lb_out = np.empty(n, dtype=np.int64)
    rb_out = np.empty(n, dtype=np.int64)
    parent = np.empty(n, dtype=np.int64)
    num = 0
    st_depth = np.empty(n + 1, dtype=np.int64)
    st_lb = np.empty(n + 1, dtype=np.int64)
    st_pend = np.empty(n + 1, dtype=np.int64)  # children of stack entry s: pend[st_pend[s]:pend_len]
    pend = np.empty(n + 1, dtype=np.int64)
    pend_len = 0
    st_depth[0], st_lb[0], st_pend[0] = 0, 0, 0
    top = 0
    prev = 0
    for i in range(1, n + 1):
        d = lcp[i] if i < n else 0
        if d == prev:
            continue
        prev = d
        lb = i - 1
        last = -1
        while d < st_depth[top]:
            lb = st_lb[top]
            last = num
            depth[num], lb_out[num], rb_out[num], parent[num] = st_depth[top], lb, i - 1, -1
            num += 1
            for c in range(st_pend[top], pend_len):
                parent[pend[c]] = last
            pend_len = st_pend[top]
            top -= 1
            if d <= st_depth[top]:  # the enclosing interval is already open: it is the parent
                pend[pend_len] = last
                pend_len += 1
                last = -1
        if d > st_depth[top]:  # a new interval opens at lb; a node just closed (if any) is its first child
            top += 1
            st_depth[top], st_lb[top], st_pend[top] = d, lb, pend_len
            if last >= 0:
                pend[pend_len] = last
                pend_len += 1
    return depth[:num].copy(), lb_out[:num].copy(), rb_out[:num].copy(), parent[:num].copy()


@njit(cache=True, nogil=True)
def lcp_interval_tree(rows, width, lengths, prev_lcp):
    """``(order, lcp, depth, lb, rb, parent)`` of :func:`prefixattn.lcp_tree.lcp_interval_tree` over
    ``rows[:, :width]`` (the whole table is passed: one compiled variant per dtype, no strided slice); ``prev_lcp``:
    :func:`sorted_rows_lcp`'s hints."""
    n = rows.shape[0]
    empty = np.zeros(0, dtype=np.int64)
    if n <= 1 or width == 0:
        return np.arange(n).astype(np.int64), np.zeros(n, dtype=np.int64), empty, empty, empty, empty
    order, lcp, tied = sorted_rows_lcp(rows, width, lengths, prev_lcp)
    if not tied:
        return order, lcp, empty, empty, empty, empty
    depth, lb, rb, parent = tree_from_lcp(lcp)
    return order, lcp, depth, lb, rb, parent


@njit(cache=True, nogil=True)
def _grown_past_lcps(order, lcp, old_blocks, new_blocks):
    """Whether every row that grew (``new_blocks[r] > old_blocks[r]``, its first ``old_blocks[r]`` ids unchanged) did
    so past its LCP with both sorted neighbours (``order``, ``lcp``: the tree of the old rows): then every LCP and
    the order stay (a row's comparisons are decided before its old end), so the tree is that of the new rows too.
    (The right neighbour's is the one that matters: a row before it with an LCP equal to its old length is an equal
    row of a lower index, which stays before it; the left check is conservative.) An engine's decode step: requests
    cross block boundaries at different steps, so some row grows by a fresh block at nearly every step, past the
    prefix it shares. A refused step rebuilds without the checks' LCP hints for the rows read while the cache still
    matched (tables of >= ``_HINT_MIN_COLUMNS`` columns: a slower build, the same tree)."""
    n = order.shape[0]
    pos = np.empty(n, dtype=np.int64)
    for i in range(n):
        pos[order[i]] = i
    for r in range(n):
        if new_blocks[r] != old_blocks[r]:
            p = pos[r]
            near = lcp[p] if p > 0 else 0
            if p + 1 < n:
                near = max(near, lcp[p + 1])
            if near >= old_blocks[r]:
                return False
    return True


@njit(cache=True, nogil=True)
def _keep_rows(keep, table, n, width, blocks):
    """``table[:n, :width]`` into ``keep[:n * width]`` in C order when it fits: ``(whether it did, the largest of the
    rows' first blocks[r] ids)`` (the entry's ``cache_max``; -1: none), read while the row is in cache."""
    top = np.int64(-1)
    if n * width > keep.shape[0]:
        return False, top
    for r in range(n):
        out = keep[r * width:(r + 1) * width]
        src = table[r, :width]
        for c in range(width):
            out[c] = src[c]
        if blocks[r]:
            top = max(top, np.int64(_row_bounds(src[:blocks[r]])[1]))
    return True, top


@njit(cache=True, nogil=True)
def block_tree(table, sh_blocks, prev_lcp, same_rows, cache_rows, cache_blocks, cache_max, cache_order, cache_lcp,
               use_cache, keep):
    """The block prefix tree of the table's shareable blocks (``sh_blocks[r]`` of row ``r``), or the cached one.

    ``same_rows``: the checks found a cached row per request, each equal to the table's over its cached length;
    ``cache_*``: the tree cache's rows, block counts, largest cached id, and its tree's order and LCPs
    (``use_cache``: they are of this table's dtype). The cached tree applies when the block counts match, or when
    the rows that grew did so past every LCP (:func:`_grown_past_lcps`): then their new ids are written into
    ``cache_rows`` past their old ends (which the cache never compares), or, when wider than the cached rows, every
    row goes to ``keep``. ``keep``: 1-D, the table's dtype, gets ``table[:, :tree_width]`` in C order when a new tree
    has nodes and the rows fit (``kept``), for the tree cache (:func:`prefixattn.lcp_tree.compiled_cache`'s spare
    buffer); copied here while the table is in cache (~8 -> ~3 us for 256 x 144 ids on the 2-core host, against
    numpy's copy after the call). ``prev_lcp``: the checks' hints (empty: none).

    Returns ``(tree_width, status, tree, kept, entry_max)``: ``tree_width``, the longest row of shareable blocks;
    ``status`` 1: the cached tree applies as it is (``tree`` empty; ``kept``: its rows were copied into ``keep``,
    wider), 3: it applies, ``cache_rows`` hold the grown rows (the cache takes the new block counts), 2: a new tree
    with nodes, 0: a tree without nodes; ``tree`` packs ``order, lcp`` (``num_requests`` each) then ``depth, lb, rb,
    parent`` (one per node): one array, not six (numba's boxing costs ~0.3 us per array returned: it unpickles the
    array type); ``entry_max``: the entry's ``cache_max`` when the rows were kept or grew in place (their largest
    shareable id; an unknown one stays unknown when they grew).
    """
    n = sh_blocks.shape[0]
    empty = np.zeros(0, dtype=np.int64)
    tree_width = 0
    for r in range(n):
        tree_width = max(tree_width, sh_blocks[r])
    if use_cache and same_rows:
        if not _differ(cache_blocks, sh_blocks):
            return tree_width, 1, empty, False, cache_max
        if _grown_past_lcps(cache_order, cache_lcp, cache_blocks, sh_blocks):
            if tree_width <= cache_rows.shape[1]:  # the new ids fit the cached rows: written past their old ends
                entry_max = cache_max
                for r in range(n):
                    for c in range(cache_blocks[r], sh_blocks[r]):
                        cache_rows[r, c] = table[r, c]
                        entry_max = max(entry_max, np.int64(table[r, c]))
                return tree_width, 3, empty, False, entry_max
            # wider: the spare gets every row (else the entry stays)
            kept, entry_max = _keep_rows(keep, table, n, tree_width, sh_blocks)
            return tree_width, 1, empty, kept, entry_max
    if prev_lcp.shape[0] != n:
        prev_lcp = np.zeros(n, dtype=np.int64)  # no hints
    order, lcp, depth, lb, rb, parent = lcp_interval_tree(table, tree_width, sh_blocks, prev_lcp)
    m = depth.shape[0]
    tree = np.empty(2 * n + 4 * m, dtype=np.int64)
    tree[:n], tree[n:2 * n] = order, lcp
    for k, a in enumerate((depth, lb, rb, parent)):
        tree[2 * n + k * m:2 * n + (k + 1) * m] = a
    kept, entry_max = _keep_rows(keep, table, n, tree_width, sh_blocks) if m > 0 else (False, np.int64(-1))
    return tree_width, 2 if m else 0, tree, kept, entry_max


# ---- the stage's Python side

#: The arrays of a tree without nodes (read-only, as every compiled tree's: one array type for the compiled planner).
NO_NODES = np.zeros(0, dtype=np.int64)
NO_NODES.setflags(write=False)


def tree(inputs: Inputs, *, block_size: int, sharing: str) -> LcpTree:
    """The tree stage: :func:`prefixattn.planner.tree.block_tree`, with the compiled tree cache (the checks'
    :class:`~prefixattn.planner.compiled.checks.TreeHints`)."""
    h = inputs.tree_hints
    entry, keep, use = h.entry, h.keep, h.use_cache
    tree_width, status, packed, kept, entry_max = block_tree(
        inputs.table, h.sh_blocks, h.prev_lcp, h.same_rows, entry[0] if use else NO_CACHE[inputs.table.dtype],
        entry[1] if use else NO_BLOCKS, entry[3] if use else -1, entry[2].order if use else NO_NODES,
        entry[2].lcp if use else NO_NODES, use, keep)
    if status == 1 or status == 3:  # the cached tree: the same shareable rows as its step, or grown past every LCP
        got = entry[2]
    else:
        # Read-only, as every tree the compiled planner gets (one array type); the tree's arrays are views of it.
        packed.setflags(write=False)
        got = _unpack_tree(packed, inputs.lens.shape[0])
    if kept:  # a new tree with nodes, or the cached one grown past its rows' width: the call copied the rows
        keep_compiled_tree(keep[:h.sh_blocks.shape[0] * tree_width].reshape(-1, tree_width), h.sh_blocks, got,
                           entry_max)
    elif status == 3:  # the cached rows hold the grown ids: the entry takes the new block counts
        set_cached_blocks(h.sh_blocks, entry_max)
    return got


def _unpack_tree(packed: np.ndarray, n: int) -> LcpTree:
    """The :class:`LcpTree` of :func:`block_tree`'s packed array (views). Slices written out, and no node slices for
    a tree without nodes (every step of a batch without sharing): 2.6 -> 1.1 us on the 2-core host."""
    m = (packed.shape[0] - 2 * n) // 4
    if m == 0:
        return LcpTree(packed[:n], packed[n:], NO_NODES, NO_NODES, NO_NODES, NO_NODES)
    o = 2 * n
    return LcpTree(packed[:n], packed[n:o], packed[o:o + m], packed[o + m:o + 2 * m], packed[o + 2 * m:o + 3 * m],
                   packed[o + 3 * m:])
