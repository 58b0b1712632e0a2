"""Compiled (numba) value checks of plan()'s metadata and the per-request lengths the planner derives from them.

Imported only when numba is (:mod:`prefixattn.plan_native`); ``@njit(cache=True)``. :func:`check_values` answers
only "valid or not" plus what a valid batch yields: on invalid input plan() runs the numpy checks of
:func:`prefixattn.validation.check_host_metadata`, which raise the ``ValueError`` with its message (one definition of
every message). The checks here are the same conditions: ``qo_indptr[0] == 0``, non-decreasing, its last entry and
every ``kv_lens`` entry in ``[0, 2^31)``, ``kv_lens >= q_len``, enough table columns, and every used block id in
``[0, num_blocks)``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

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
def check_values(indptr, lens, table, block_size, num_blocks, causal, sharing_never):
    """Check the metadata's values; derive the planner's per-request lengths.

    Parameters
    ----------
    indptr : ``[num_requests + 1]`` int64; lens : ``[num_requests]`` int64; table : ``[num_requests, cols]``
        int32/int64.
    num_blocks : int
        Blocks in the cache, ``-1`` when not given.

    Returns
    -------
    ``(ok, max_block_id, q_len, shareable, shareable_blocks, max_q_len)``: ``ok`` False means the numpy checks must
    run (they raise); ``shareable`` is what plan() shares (``kv_len - q_len`` when causal, else ``kv_len``; 0 without
    queries) and ``shareable_blocks`` its blocks (all 0 with ``sharing_never``: no tree).
    """
    n = lens.shape[0]
    q_len = np.empty(n, dtype=np.int64)
    shareable = np.empty(n, dtype=np.int64)
    sh_blocks = np.empty(n, dtype=np.int64)
    fail = (False, -1, q_len, shareable, sh_blocks, 0)
    if indptr[0] != 0 or indptr[n] > _INT32_MAX:
        return fail
    max_q_len = 0
    max_needed = 0
    for r in range(n):
        q = indptr[r + 1] - indptr[r]
        if q < 0 or lens[r] < 0 or lens[r] > _INT32_MAX or lens[r] < q:
            return fail
        q_len[r] = q
        max_q_len = max(max_q_len, q)
        shareable[r] = (lens[r] - q if causal else lens[r]) if q > 0 else 0
        sh_blocks[r] = 0 if sharing_never else (shareable[r] + block_size - 1) // block_size
        max_needed = max(max_needed, (lens[r] + block_size - 1) // block_size)
    if max_needed > table.shape[1]:
        return fail
    upper = num_blocks if num_blocks >= 0 else np.iinfo(np.int64).max
    max_id = -1
    for r in range(n):
        used = (lens[r] + block_size - 1) // block_size
        if used:
            lo, hi = _row_bounds(table[r, :used])
            if lo < 0 or hi >= upper:
                return fail
            max_id = max(max_id, np.int64(hi))
    return True, max_id, q_len, shareable, sh_blocks, max_q_len
