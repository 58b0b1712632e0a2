"""Compiled (numba) metadata checks and block prefix tree: the same order, LCPs and lcp-intervals as
:mod:`prefixattn.lcp_tree`, the same accept/refuse decisions as :func:`prefixattn.validation.check_host_metadata`.

Imported only when numba is (:mod:`prefixattn.planner.compiled` chooses); every function is ``@njit(cache=True)``.
The definitions of what is computed are :func:`prefixattn.lcp_tree.sorted_rows_lcp` (lexicographic order of the
padded rows, then the row index; LCP of sorted neighbours) and :func:`prefixattn.lcp_tree.tree_from_lcp` (the
lcp-interval stack, nodes in post-order); ``tests/test_plan_native.py`` checks both paths give equal arrays.

Algorithm (the numpy one, per segment instead of per round): rows are grouped by their first entry; each group of
tied rows is compared with its first row (the leader) over the columns not yet known equal, which places every other
row before or after the leader by (first mismatch, value there); rows still tied form new segments. Comparisons run
over chunks of ``_CHUNK`` columns with no early exit inside a chunk, so LLVM vectorizes them (one pass over the
shared prefix per row per level of sharing).

:func:`check_values` answers only "valid or not" plus what a valid batch yields: on invalid input plan() runs the
numpy checks, which raise the ``ValueError`` with its message (one definition of every message). The conditions are
the same: ``qo_indptr[0] == 0``, non-decreasing, its last entry and every ``kv_lens`` entry in ``[0, 2^31)``,
``kv_lens >= q_len``, enough table columns, every used block id in ``[0, num_blocks)``. :func:`check_and_tree` is
plan()'s one call for both.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: Padding past a row's end: below every real id (ids are >= 0), as in prefixattn.lcp_tree.sort_dense.
_PAD = -1
_INT64_MAX = np.iinfo(np.int64).max
#: Columns of the first chunk of the mismatch scan, and of the last scalar scan (a multiple of the SIMD width).
_CHUNK = 16
#: Shortest shareable overlap of neighbouring rows (columns) for which the checks find their LCP, the tree build's
#: hint. The fused pass costs ~1.5x the checks' own and pays where the tree build would stream long rows from memory
#: again. Check + tree of 256 rows, cold, on the 2-core host: under a 32K-token prefix (2,048 columns) 71-87 -> 59 us;
#: under 8K (512 columns) 30-34 us either way; under 2K (128) hints cost ~3 us more than they save.
_HINT_MIN_COLUMNS = 1024


@njit(cache=True, nogil=True)
def _differ(a, b):
    """Any ``a[k] != b[k]`` (equal-length 1-D slices): a full reduction with no early exit, which LLVM vectorizes
    (indexing from 0 over ``range(n)``: numba's negative-index wraparound check on ``range(lo, hi)`` indices kept the
    loop scalar, ~1 ns per entry instead of ~0.1)."""
    acc = 0
    for k in range(a.shape[0]):
        acc |= a[k] ^ b[k]
    return acc != 0


@njit(cache=True, nogil=True)
def _mismatch(rows, a, b, start, stop, hint):
    """First column in ``[start, stop)`` where rows ``a`` and ``b`` differ, ``stop`` if none.

    ``hint``: where the previous row of the segment left the leader (rows under one shared prefix all leave it at
    the prefix's end): one vectorized pass confirms it. Otherwise chunks of doubling size from ``_CHUNK`` (a row
    that differs early costs little, a long shared prefix a few vectorized passes); the chunk holding the mismatch
    is halved down to ``_CHUNK`` columns, then scanned."""
    if start < hint < stop:
        if _differ(rows[a, start:hint], rows[b, start:hint]):
            stop = hint  # the mismatch is before the hint
        elif rows[a, hint] != rows[b, hint]:
            return hint
        else:
            start = hint + 1
    j, size = start, _CHUNK
    while j < stop:
        e = min(j + size, stop)
        if _differ(rows[a, j:e], rows[b, j:e]):
            lo, hi = j, e
            while hi - lo > _CHUNK:
                mid = (lo + hi) // 2
                if _differ(rows[a, lo:mid], rows[b, lo:mid]):
                    hi = mid
                else:
                    lo = mid
            for k in range(lo, hi):
                if rows[a, k] != rows[b, k]:
                    return k
        j, size = e, 2 * size
    return stop


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


# ---- metadata value checks (plan()'s, compiled; the messages stay in prefixattn.validation) ----------------

_INT32_MAX = 2 ** 31 - 1


@njit(cache=True, nogil=True)
def _row_bounds(row):
    """``(min, max)`` of a non-empty 1-D slice (indexed from 0: vectorized)."""
    lo = row[0]
    hi = row[0]
    for k in range(row.shape[0]):
        lo = min(lo, row[k])
        hi = max(hi, row[k])
    return lo, hi


@njit(cache=True, nogil=True)
def _row_bounds_and_differ(row, prev):
    """``(min, max, differ)``: :func:`_row_bounds` of ``row`` and whether ``row[:len(prev)]`` differs from ``prev``,
    in one vectorized pass (``row`` is read once for both)."""
    lo = hi = row[0]
    acc = row[0] ^ row[0]  # the row's dtype: an int64 accumulator over int32 ids halved the vector width
    for k in range(prev.shape[0]):
        v = row[k]
        lo = min(lo, v)
        hi = max(hi, v)
        acc |= v ^ prev[k]
    tail_lo, tail_hi = _row_bounds(row[prev.shape[0]:]) if row.shape[0] > prev.shape[0] else (lo, hi)
    return min(lo, tail_lo), max(hi, tail_hi), acc != 0


@njit(cache=True, nogil=True)
def _blocks(tokens, block_size, shift):
    """Blocks holding ``tokens >= 0`` tokens; a shift when ``block_size`` is a power of two (``shift >= 0``): the
    division was most of the checks' time (four 64-bit divisions per request, ~5 us for 256 requests)."""
    if shift >= 0:
        return (tokens + block_size - 1) >> shift
    return (tokens + block_size - 1) // block_size


@njit(cache=True, nogil=True)
def check_values(indptr, lens, table, block_size, block_shift, num_blocks, causal, sharing_never, cache_rows,
                 cache_blocks, cache_max):
    """Check the metadata's values; derive the planner's per-request lengths, in one pass over the used table.

    Parameters
    ----------
    indptr : ``[num_requests + 1]`` int64; lens : ``[num_requests]`` int64; table : ``[num_requests, cols]``
        int32/int64.
    block_shift : int
        ``log2(block_size)`` when it is a power of two, else ``-1``.
    num_blocks : int
        Blocks in the cache, ``-1`` when not given.
    cache_rows, cache_blocks, cache_max : ``[num_requests or 0, w]``, ``[num_requests or 0]``, int
        The tree cache's rows, shareable blocks and largest cached id (``_INT64_MAX``: not known). Each cached row's
        first ``cache_blocks[r]`` ids (what its tree is of) are compared with the table's in the checks' pass. They
        came from a checked table: while every row so far equals its cached row and ``cache_max < num_blocks``, only
        the ids past them are range-checked, ``cache_max`` counting in ``max_block_id`` for them (a warm decode step
        under a 2,048-token prefix: check_and_tree ~7.6 -> ~4.9 us on the 2-core host).

    Returns
    -------
    ``(ok, max_block_id, q_len, shareable, shareable_blocks, max_q_len, width, same_rows, prev_lcp)``: ``ok`` False
    means the numpy checks must run (they raise); ``shareable`` is what plan() shares (``kv_len - q_len`` when
    causal, else ``kv_len``; 0 without queries), ``shareable_blocks`` its blocks (all 0 with ``sharing_never``: no
    tree), ``width`` the table columns the batch reads (at least 1), ``same_rows`` whether the cache has a row per
    request, each at most as long as the batch's and equal to it over its length (the cached tree applies when the
    block counts match too, or when the rows that grew did so past every LCP: :func:`_grown_past_lcps`),
    and ``prev_lcp[r]`` the shareable columns rows ``r - 1`` and ``r`` have in common (their LCP; 0 for rows read
    while the cache still matched, whose tree is not built, and for overlaps under ``_HINT_MIN_COLUMNS``; empty for a
    table narrower than that): :func:`sorted_rows_lcp`'s hints.
    """
    n = lens.shape[0]
    q_len = np.empty(n, dtype=np.int64)
    shareable = np.empty(n, dtype=np.int64)
    sh_blocks = np.empty(n, dtype=np.int64)
    cols = table.shape[1]
    hints = not sharing_never and cols >= _HINT_MIN_COLUMNS  # loop-invariant: the loop without hints stays as lean
    prev_lcp = np.zeros(n if hints else 0, dtype=np.int64)  # empty: no hints
    fail = (False, -1, q_len, shareable, sh_blocks, 0, 1, False, prev_lcp)
    if indptr[0] != 0 or indptr[n] > _INT32_MAX:
        return fail
    upper = num_blocks if num_blocks >= 0 else np.iinfo(np.int64).max
    same = cache_rows.shape[0] == n and cache_blocks.shape[0] == n
    trusted = same and cache_max < upper  # the rows so far equal their cached ones, whose ids are in range
    hint = -1
    max_q_len = 0
    width = 1
    max_id = -1
    for r in range(n):
        q = indptr[r + 1] - indptr[r]
        if q < 0 or lens[r] < 0 or lens[r] > _INT32_MAX or lens[r] < q:
            return fail
        q_len[r] = q
        max_q_len = max(max_q_len, q)
        shareable[r] = (lens[r] - q if causal else lens[r]) if q > 0 else 0
        sh_blocks[r] = 0 if sharing_never else _blocks(shareable[r], block_size, block_shift)
        used = _blocks(lens[r], block_size, block_shift)
        if used > cols:
            return fail
        start = 0  # the first id of the row to range-check
        if same:  # the cached tree is of cache_rows[r, :cache_blocks[r]]
            lo = cache_blocks[r]
            same = lo <= sh_blocks[r] and not _differ(cache_rows[r, :lo], table[r, :lo])
            if trusted and same:
                start = lo
            elif trusted:  # the first row off the cache: the rows before it count their cached ids now
                trusted = False
                max_id = max(max_id, _cached_ids_max(table, cache_blocks, r))
        # Once the cache stops matching (a tree will be built): the row's LCP with the previous one, checked in the
        # same pass as the row's ids (by the previous row's LCP, which a group under one prefix shares). It bounds
        # the row's LCP with any earlier row of its group (equal columns are transitive), so the tree build skips
        # what is known equal: one read of a long shared prefix instead of two (263 rows under a 32K-token prefix:
        # check + tree ~87 -> ~60 us).
        common = min(sh_blocks[r - 1], sh_blocks[r]) if hints and r and not same else 0
        if used:
            width = max(width, used)
        if used > start:
            if common < _HINT_MIN_COLUMNS:
                lo, hi = _row_bounds(table[r, start:used])
            else:
                verify = hint if 0 < hint <= common else 0
                lo, hi, differ = _row_bounds_and_differ(table[r, :used], table[r - 1, :verify])
                if differ:  # the mismatch is before the previous row's
                    hint = _mismatch(table, r - 1, r, 0, verify, -1)
                elif verify == common or table[r, verify] != table[r - 1, verify]:
                    hint = verify
                else:
                    hint = _mismatch(table, r - 1, r, verify + 1, common, -1)
                prev_lcp[r] = hint
            if lo < 0 or hi >= upper:
                return fail
            max_id = max(max_id, np.int64(hi))
    if trusted:  # every row equals its cached row: their cached ids count as their largest
        max_id = max(max_id, cache_max)
    return True, max_id, q_len, shareable, sh_blocks, max_q_len, width, same, prev_lcp


@njit(cache=True, nogil=True)
def _cached_ids_max(table, cache_blocks, n):
    """The largest id of the first ``cache_blocks[r]`` of rows ``r < n`` (-1: none)."""
    top = -1
    for r in range(n):
        if cache_blocks[r]:
            top = max(top, np.int64(_row_bounds(table[r, :cache_blocks[r]])[1]))
    return top


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
def check_and_tree(indptr, lens, table, block_size, block_shift, num_blocks, causal, sharing_never, cache_rows,
                   cache_blocks, cache_max, cache_order, cache_lcp, use_cache, stage, keep):
    """:func:`check_values`, then the block prefix tree of the shareable blocks, in one call; a valid batch's table
    is staged into ``stage`` (``[rows, cols]`` int32, a workspace's host block table; ``(0, 0)``: none) too
    (:func:`_stage_table`), and a new tree's rows into ``keep``.

    ``cache_*``: the tree cache's rows, block counts, largest cached id, and its tree's order and LCPs (``use_cache``:
    compare with them first; rows that only grew past every LCP keep the tree, and their new ids are written into
    ``cache_rows`` past their old ends, which the cache never compares). ``keep``: 1-D, the table's dtype, gets
    ``table[:, :tree_width]`` in C order when a new tree has nodes and the rows fit (``kept``), for the tree cache
    (:func:`prefixattn.lcp_tree.compiled_cache`'s spare buffer); copied here while the table is in cache (~8 -> ~3 us
    for 256 x 144 ids on the 2-core host, against numpy's copy after the call).

    Returns ``(ok, max_block_id, max_q_len, width, tree_width, status, lengths, tree, staged, kept, entry_max)``:
    ``width``, the table columns the batch reads (at least 1); ``tree_width``, the longest row of shareable blocks;
    ``lengths`` ``[3, num_requests]``: ``q_len, shareable, shareable_blocks``; ``status`` 1: the cached tree applies
    as it is (``tree`` empty; ``kept``: its rows were copied into ``keep``, wider), 3: it applies, ``cache_rows`` hold
    the grown rows (the cache takes the new block counts), 2: a new tree with nodes, 0: a tree without nodes; ``tree``
    packs ``order, lcp`` (``num_requests`` each) then ``depth, lb, rb, parent`` (one per node): two arrays, not nine
    (numba's boxing costs ~0.3 us per array returned: it unpickles the array type); ``staged``: ``stage`` got the
    table; ``entry_max``: the entry's ``cache_max`` when the rows were kept or grew in place (their largest
    shareable id; an unknown one stays unknown when they grew).
    """
    ok, max_id, q_len, shareable, sh_blocks, max_q_len, width, same_rows, prev_lcp = check_values(
        indptr, lens, table, block_size, block_shift, num_blocks, causal, sharing_never, cache_rows, cache_blocks,
        cache_max)
    n = lens.shape[0]
    lengths = np.empty((3, n), dtype=np.int64)
    lengths[0], lengths[1], lengths[2] = q_len, shareable, sh_blocks
    empty = np.zeros(0, dtype=np.int64)
    tree_width = 0
    if not ok:
        return ok, max_id, max_q_len, width, tree_width, 0, lengths, empty, False, False, cache_max
    for r in range(n):
        tree_width = max(tree_width, sh_blocks[r])
    staged = _stage_table(stage, table, n, width, max_id)
    if use_cache and same_rows:
        if not _differ(cache_blocks, sh_blocks):
            return ok, max_id, max_q_len, width, tree_width, 1, lengths, empty, staged, False, cache_max
        if _grown_past_lcps(cache_order, cache_lcp, cache_blocks, sh_blocks):
            if tree_width <= cache_rows.shape[1]:  # the new ids fit the cached rows: written past their old ends
                entry_max = cache_max
                for r in range(n):
                    for c in range(cache_blocks[r], sh_blocks[r]):
                        cache_rows[r, c] = table[r, c]
                        entry_max = max(entry_max, np.int64(table[r, c]))
                return ok, max_id, max_q_len, width, tree_width, 3, lengths, empty, staged, False, entry_max
            # wider: the spare gets every row (else the entry stays)
            kept, entry_max = _keep_rows(keep, table, n, tree_width, sh_blocks)
            return ok, max_id, max_q_len, width, tree_width, 1, lengths, empty, staged, kept, entry_max
    if prev_lcp.shape[0] != n:
        prev_lcp = np.zeros(n, dtype=np.int64)  # no hints
    order, lcp, depth, lb, rb, parent = lcp_interval_tree(table, tree_width, sh_blocks, prev_lcp)
    m = depth.shape[0]
    tree = np.empty(2 * n + 4 * m, dtype=np.int64)
    tree[:n], tree[n:2 * n] = order, lcp
    for k, a in enumerate((depth, lb, rb, parent)):
        tree[2 * n + k * m:2 * n + (k + 1) * m] = a
    kept, entry_max = _keep_rows(keep, table, n, tree_width, sh_blocks) if m > 0 else (False, np.int64(-1))
    return ok, max_id, max_q_len, width, tree_width, 2 if m else 0, lengths, tree, staged, kept, entry_max


@njit(cache=True, nogil=True)
def _stage_table(stage, table, n, width, max_id):
    """Copy the first ``width`` columns of the ``n`` rows of a checked ``table`` into int32 ``stage`` (columns the
    table lacks: 0), when they fit it and the ids the kernel reads fit int32 (cells past a request's blocks are never
    read: wrapped); False, with nothing written, otherwise (the caller stages or refuses). Here rather than in
    numpy: no int64 temporary and no Python slicing, ~4 us less a step for 256 x 148 ids on the 2-core host."""
    if n > stage.shape[0] or width > stage.shape[1] or max_id > _INT32_MAX:
        return False
    cols = min(width, table.shape[1])
    for r in range(n):
        for c in range(cols):
            stage[r, c] = table[r, c]
        for c in range(cols, width):
            stage[r, c] = 0
    return True
