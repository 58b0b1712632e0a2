"""Compiled (numba) metadata checks: the same accept/refuse decisions and lengths as
:func:`prefixattn.planner.checks.check_inputs` (:func:`prefixattn.validation.check_host_metadata`), in one pass over
the used block table.

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)`` but the
stage's Python side at the end. :func:`check_values` answers only "valid or not" plus what a valid batch yields: on
invalid input plan() runs the numpy checks, which raise the ``ValueError`` with its message (one definition of every
message). The conditions are the same: ``qo_indptr[0] == 0``, non-decreasing, its last entry and every ``kv_lens`` entry
in ``[0, 2^31)``, ``kv_lens >= q_len``, enough table columns, every used block id in ``[0, num_blocks)``.

The same pass reads what the compiled tree (:mod:`prefixattn.planner.compiled.tree`) needs from the rows: whether the
tree cache's rows still match (their ids were checked when cached: not range-checked again) and, for long rows, each
row's LCP with the previous one (the tree build then skips what is known equal: one read of a long shared prefix
instead of two). The row primitives :func:`_differ` and :func:`_mismatch` are the tree's too (it pins this file).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prefixattn.lcp_tree import compiled_cache
from prefixattn.planner.checks import Inputs
from prefixattn.validation import check_host_metadata, host_metadata_arrays

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
        The tree cache's rows, shareable blocks and largest cached id (int64's largest: not known). Each cached row's
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


# ---- the stage's Python side


class TreeHints:
    """What :func:`check` hands the compiled tree (:func:`prefixattn.planner.compiled.tree.tree`): the cache entry
    it compared (or None) and the buffer for the next rows (``keep``: :func:`prefixattn.lcp_tree.compiled_cache`),
    whether its rows still match, its table's dtype was the batch's, the shareable blocks per request and the LCP
    hints."""

    __slots__ = ("entry", "keep", "same_rows", "use_cache", "sh_blocks", "prev_lcp")

    def __init__(self, entry, keep, same_rows, use_cache, sh_blocks, prev_lcp):
        self.entry, self.keep, self.same_rows, self.use_cache = entry, keep, same_rows, use_cache
        self.sh_blocks, self.prev_lcp = sh_blocks, prev_lcp


#: The cache arguments when no cache entry is compared (one per table dtype: one compiled variant each).
NO_CACHE = {np.dtype(np.int32): np.zeros((0, 0), dtype=np.int32), np.dtype(np.int64): np.zeros((0, 0), dtype=np.int64)}
NO_BLOCKS = np.zeros(0, dtype=np.int64)


def check(qo_indptr, kv_lens, block_table, *, block_size: int, num_blocks: int | None, causal: bool,
          sharing: str) -> Inputs:
    """The check stage: :func:`prefixattn.planner.checks.check_inputs` (its messages: the numpy checks run when
    :func:`check_values` refuses); ``indptr`` and ``lens`` int32 when both came so (the compiled stages have variants
    for both)."""
    indptr, lens, table = host_metadata_arrays(qo_indptr, kv_lens, block_table, block_size=block_size,
                                               num_blocks=num_blocks, table_as_is=True, index_as_is=True)
    if not table.flags.c_contiguous:  # a column slice of an engine's table: one copy, not a new compiled variant
        table = np.ascontiguousarray(table)
    entry, keep = compiled_cache(table.dtype)
    # Same dtype only (another would compile another variant); the compiled check compares the row counts.
    use_cache = entry is not None and entry[0].dtype == table.dtype
    ok, max_id, q_len, shareable, sh_blocks, max_q_len, width, same_rows, prev_lcp = check_values(
        indptr, lens, table, block_size, _block_shift(block_size), -1 if num_blocks is None else int(num_blocks),
        causal, sharing == "never", entry[0] if use_cache else NO_CACHE[table.dtype],
        entry[1] if use_cache else NO_BLOCKS, entry[3] if use_cache else -1)
    if not ok:
        check_host_metadata(qo_indptr, kv_lens, block_table, block_size=block_size, num_blocks=num_blocks,
                            table_as_is=True)  # raises the message
        raise AssertionError("the compiled metadata checks refused a batch the numpy checks accept")
    return Inputs(indptr=indptr, lens=lens, table=table, max_block_id=max_id, q_len=q_len, shareable=shareable,
                  max_q_len=max_q_len, width=width,
                  tree_hints=TreeHints(entry, keep, same_rows, use_cache, sh_blocks, prev_lcp))


def _block_shift(block_size: int) -> int:
    """``log2(block_size)`` for a power of two, else -1."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1
