"""The planner's block tree: :func:`block_prefix_tree` over the leading blocks of each request's block-table row, and
a per-thread cache of the last tree (shared with the compiled planner, :mod:`prefixattn.planner.compiled`)."""

from __future__ import annotations

import threading

import numpy as np

from prefixattn.lcp_tree.nodes import LcpTree
from prefixattn.lcp_tree.sort_dense import lcp_interval_tree


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
    The compiled planner builds the same tree (:func:`prefixattn.planner.compiled.tree.block_tree`) and shares the
    tree cache below, its rows copied by the compiled call (:func:`compiled_cache`, :func:`keep_compiled_tree`).
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
    """This thread's tree cache entry ``(rows, num_blocks, tree, max_id)``, or None."""
    return getattr(_last_tree, "state", _NO_STATE)[0]


def remember_tree(rows: np.ndarray, num_blocks: np.ndarray, tree: LcpTree) -> LcpTree:
    """Freeze ``tree`` and keep it as this thread's last tree when it has nodes; returns ``tree``."""
    for a in (tree.order, tree.lcp, tree.depth, tree.lb, tree.rb, tree.parent):
        # Shared by the plans of every step that reuses it; read-only always, so the compiled planner sees one
        # array type (numba compiles a variant per writability).
        a.setflags(write=False)
    if tree.num_nodes:
        # The replaced entry's row buffer is reused (a fresh 2 MB buffer costs its page faults: ~2x the copy); the
        # entry is dropped first, so an interrupted copy leaves none rather than its tree with other rows.
        last, spare, in_use = getattr(_last_tree, "state", _NO_STATE)
        same = last is not None and last[0].shape == rows.shape and last[0].dtype == rows.dtype
        if same:
            _last_tree.state = (None, spare, in_use)
        buffer = last[0] if same else np.empty(rows.shape, dtype=rows.dtype)
        np.copyto(buffer, rows)
        _last_tree.state = ((buffer, num_blocks, tree, UNKNOWN_MAX_ID), spare, in_use)
    return tree


def compiled_cache(dtype: np.dtype) -> tuple:
    """``(entry, spare)``: this thread's cache entry (:func:`cached_entry`) and the buffer of
    :data:`COMPILED_CACHE_MAX_ENTRIES` ids of ``dtype`` the compiled planner copies a new tree's rows into (a new one
    when the table's dtype changed). The spare never holds the entry's rows (two buffers take turns), so the entry
    stays whole until :func:`keep_compiled_tree` replaces it, whatever fails in between."""
    entry, spare, in_use = getattr(_last_tree, "state", _NO_STATE)
    if spare is None or spare.dtype != dtype:
        spare = np.empty(COMPILED_CACHE_MAX_ENTRIES, dtype=dtype)
        _last_tree.state = (entry, spare, in_use)
    return entry, spare


def keep_compiled_tree(rows: np.ndarray, num_blocks: np.ndarray, tree: LcpTree, max_id: int) -> None:
    """Make ``(rows, num_blocks, tree, max_id)`` this thread's entry, ``rows`` a view of the spare buffer of
    :func:`compiled_cache` that the compiled planner wrote (``max_id``: the largest of each row's first
    ``num_blocks[r]`` ids); the buffer of the last rows it kept becomes the spare (one assignment: an interrupt leaves
    the old state or the new one)."""
    _, spare, in_use = _last_tree.state
    _last_tree.state = ((rows, num_blocks, tree, max_id), in_use, spare)


def set_cached_blocks(num_blocks: np.ndarray, max_id: int) -> None:
    """Give this thread's entry new block counts and their largest id: the compiled planner found its tree still
    that of the rows, which only grew past every LCP, and wrote their new ids into the entry's rows."""
    entry, spare, in_use = _last_tree.state
    _last_tree.state = ((entry[0], num_blocks, entry[2], max_id), spare, in_use)


#: Largest row matrix (entries) the compiled tree keeps in the cache: the size of each of its two row buffers (256 KB
#: of int32 ids, 512 KB of int64; allocated at a thread's first compiled plan, kept by clear_tree_cache). The compiled
#: build is one vectorized pass over the shared prefix, as is the cache's check, and keeping the rows costs a copy:
#: past this size (a 256 x 256 table) the cache would only add that copy (a 263 x 2,056 table: ~45 us per numpy copy
#: on the 2-core host) and hold larger buffers per thread.
COMPILED_CACHE_MAX_ENTRIES = 1 << 16

#: An entry's ``max_id`` when it is not known (the numpy planner's entries): the compiled checks then range-check the
#: cached ids like any other (:func:`prefixattn.planner.compiled.checks.check_values`' ``cache_max``).
UNKNOWN_MAX_ID = np.iinfo(np.int64).max

#: Per thread, the last tree with nodes, with the rows and block counts it was built from. An engine's decode loop
#: replans the same shareable rows every step until a request's shareable KV crosses a block boundary (at block
#: size 16, 15 of 16 steps when the requests' lengths are aligned); a tree costs ~40 numpy calls (~150 us on the
#: 2-core host) and, for long prefixes, a pass over the rows; the check is two comparisons. Reused only on equal rows
#: (the tree depends on nothing else; the compiled planner also when rows only grew past every LCP, as in an engine's
#: decode steps: :func:`prefixattn.planner.compiled.tree.block_tree`), never across threads. ``state``:
#: ``(entry, spare, in_use)``, the entry ``(rows, num_blocks, tree, max_id)`` or None (``max_id``: the largest of
#: each row's first ``num_blocks[r]`` ids, or ``UNKNOWN_MAX_ID``) and the compiled planner's two row
#: buffers (:func:`compiled_cache`), in one attribute so that each change is one assignment.
_last_tree = threading.local()
_NO_STATE = (None, None, None)


def clear_tree_cache() -> None:
    """Forget this thread's last tree (benchmarks time cold plans with it); the row buffers stay."""
    _, spare, in_use = getattr(_last_tree, "state", _NO_STATE)
    _last_tree.state = (None, spare, in_use)
