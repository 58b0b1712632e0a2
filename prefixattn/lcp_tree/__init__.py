"""The prefix tree (compact radix tree) over integer rows, numpy only: the kernel planner's tree over block ids and
the scheduler's tree over prompt token ids.

All rows are known up front, so instead of inserting rows one by one into a radix tree (what online engines do) the
rows are sorted lexicographically, the longest common prefix (LCP) of each pair of sorted neighbours is taken, and
the tree is built from that LCP array with one stack pass (the lcp-interval construction). The LCP of any two rows is
the minimum of the neighbour LCPs between them, so any order in which rows sharing a prefix are contiguous, with its
neighbour LCPs, describes the whole tree.

Two ways to get ``(order, lcp)``, one per caller, because their rows differ in shape:

- :func:`sorted_rows_lcp` (:mod:`~prefixattn.lcp_tree.sort_dense`), the planner's: a dense ``[n, width]`` matrix
  of block ids (the block table's leading columns). Leader refinement: one vectorized whole-row comparison of each
  tied row with its group's leader per level of sharing, no hashing pass. Measured on the 2-core host (best of 30):
  263 rows of 2,056 blocks sharing one prefix 0.85 ms against 6.4 ms for the chunk hashes; 256 x 32 blocks in 16
  groups 0.29 ms against 0.33 ms.
  Order: ids numerically, a row *before* the rows it prefixes (padding ``-1`` past its end), ties by row index.
- :func:`sort_and_lcp` (:mod:`~prefixattn.lcp_tree.sort_packed`), the scheduler's: packed (ragged) token-id rows,
  up to hundreds of thousands of prompts of ~1.5k tokens, where a padded matrix would take gigabytes. MSD refinement
  over chunk hashes: a shared 64-id chunk costs one hash comparison per row (a ~1.1k-token document in ~17
  comparisons), so the work grows with the distinct chunks, not the ids. Order: ids by their native uint32 bytes,
  a row *after* the rows it prefixes, ties by row index.

Both orders give the same nodes as (depth, set of rows) (``tests/scheduling/test_prefix_tree.py`` pins them equal);
they are kept apart because each caller's output follows its order (the planner's work list and its golden plans,
the scheduler's group order and the simulator tables), so adopting the other's would reorder those outputs.

One tree builder, :func:`tree_from_lcp` (:mod:`~prefixattn.lcp_tree.nodes`, which documents the node convention),
emits the lcp-intervals; :class:`LcpTree` (the planner's: those nodes, post-order, inclusive bounds, parent ``-1``
under the implicit root) holds them as they are, :class:`PrefixTree` (the scheduler's: root 0, one leaf per row,
exclusive bounds) adds the root and the leaves (:func:`prefix_tree_from_lcp`). The compiled planner mirrors the
planner's path in numba (:mod:`prefixattn.planner.compiled.tree`).

Entry points: :func:`block_prefix_tree` (the planner, with a per-thread tree cache: :func:`cached_entry`,
:func:`remember_tree`, :func:`clear_tree_cache`; the compiled planner's :func:`compiled_cache`,
:func:`keep_compiled_tree`), :func:`lcp_interval_tree` (dense rows -> :class:`LcpTree`),
:func:`tree_of_rows` (packed rows -> :class:`PrefixTree`; :func:`prefixattn.scheduling.prefix_tree` checks and packs
user input first).
"""

from prefixattn.lcp_tree.blocks import (COMPILED_CACHE_MAX_ENTRIES, UNKNOWN_MAX_ID, block_prefix_tree, cached_entry,
                                        clear_tree_cache, compiled_cache, keep_compiled_tree, remember_tree,
                                        set_cached_blocks)
from prefixattn.lcp_tree.nodes import LcpTree, PrefixTree, prefix_tree_from_lcp, tree_from_lcp
from prefixattn.lcp_tree.sort_dense import lcp_interval_tree, sorted_rows_lcp
from prefixattn.lcp_tree.sort_packed import sort_and_lcp, tree_of_rows

__all__ = [
    "COMPILED_CACHE_MAX_ENTRIES", "LcpTree", "PrefixTree", "block_prefix_tree", "cached_entry", "clear_tree_cache",
    "compiled_cache", "keep_compiled_tree", "lcp_interval_tree", "prefix_tree_from_lcp", "remember_tree",
    "set_cached_blocks", "sort_and_lcp", "sorted_rows_lcp", "tree_from_lcp", "tree_of_rows", "UNKNOWN_MAX_ID",
]
