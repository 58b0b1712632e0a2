"""The numpy node choice: which nodes of the block prefix tree a step shares (:func:`select_shared_nodes`).

Walks the tree top-down, one level at a time, vectorized over the nodes of a level; the sharing cost rule
(:mod:`prefixattn.planner.cost_rule`) decides each node. The compiled planner's ``select_nodes``
(:mod:`prefixattn.planner.compiled.node_choice`) computes the same per node, as loops.
"""

from __future__ import annotations

import numpy as np

from prefixattn.lcp_tree import LcpTree
from prefixattn.planner.cost_rule import request_sharing_pays_off, sharing_pays_off, unshared_reads
from prefixattn.planner.options import SHARING_APART
from prefixattn.planner.tiles import DECODE_CLASS_ALL_ROWS
from prefixattn.planner.work_list import SharedNodes
from prefixattn.ragged import expand, offsets

#: The sentinel after the last sorted request: a node's ``rb + 1`` may equal the request count, and the reduceat
#: over ``(lb, rb + 1)`` pairs needs a valid index whose value never wins a minimum.
_INT64_MAX = int(np.iinfo(np.int64).max)


def _node_levels(parent: np.ndarray) -> np.ndarray:
    """Ancestors per node (0 under the root), one vectorized step per tree level."""
    level = np.zeros(parent.shape[0], dtype=np.int64)
    ancestor = parent.copy()
    while (ancestor >= 0).any():
        has = ancestor >= 0
        level += has
        ancestor = np.where(has, parent[np.maximum(ancestor, 0)], -1)
    return level


def joining_requests(*, q_len: np.ndarray, shareable: np.ndarray, rows_per_shared: int, rows_per_chunk: int,
                      rows_per_decode: int, group: int, head_dim: int, elt_bytes: int) -> np.ndarray:
    """Which requests may join a node under ``SHARING_APART``: :func:`request_sharing_pays_off` at each one's
    :func:`unshared_reads` (bool per request; ``q_len``, ``shareable``: int64)."""
    return request_sharing_pays_off(q_len=q_len, reads=unshared_reads(q_len, rows_per_chunk, rows_per_decode),
                                    shareable=shareable, rows_per_shared=rows_per_shared, group=group,
                                    head_dim=head_dim, elt_bytes=elt_bytes)


def select_shared_nodes(tree: LcpTree, *, shareable: np.ndarray, q_len: np.ndarray, block_size: int,
                        rows_per_shared: int, group: int, head_dim: int, elt_bytes: int, sharing: str = "auto",
                        rows_per_chunk: int = 1,
                        rows_per_decode: int = DECODE_CLASS_ALL_ROWS) -> tuple[SharedNodes, np.ndarray]:
    """Walk the tree top-down, one level at a time, and keep the nodes the cost rule accepts (``sharing="auto"``),
    every node with KV (``"always"``, for tests and benchmarks) or none (``"never"``: plain paged attention).
    Under ``SHARING_APART`` (:mod:`prefixattn.planner.options`) a request that gains from no node
    (:func:`request_sharing_pays_off`) joins none: each node is decided, and holds, only its other requests.
    ``rows_per_chunk``/``rows_per_decode``: a request of more rows than ``rows_per_decode`` reads an unshared node
    once per chunk tile of ``rows_per_chunk`` rows (:func:`sharing_pays_off`'s ``extra_reads``).

    Returns the kept nodes (top-down, requests ascending within each) and ``suffix_start[r]``: the end of the deepest
    kept node holding request ``r`` (0 if none).
    """
    num_nodes = tree.num_nodes
    suffix_start = np.zeros(q_len.shape[0], dtype=np.int64)
    if num_nodes == 0 or sharing == "never":
        return SharedNodes.empty(), suffix_start
    if sharing == SHARING_APART:
        joins = joining_requests(q_len=q_len, shareable=shareable, rows_per_shared=rows_per_shared,
                                 rows_per_chunk=rows_per_chunk, rows_per_decode=rows_per_decode, group=group,
                                 head_dim=head_dim, elt_bytes=elt_bytes)
    else:
        joins = np.ones(q_len.shape[0], dtype=bool)
    # Nodes are intervals [lb, rb] of the sorted order: one reduceat over (lb, rb + 1) pairs gives every node's
    # minimum shareable length (the +inf sentinel makes rb + 1 == n a valid index).
    n = tree.order.shape[0]
    sorted_shareable = np.empty(n + 1, dtype=np.int64)
    sorted_shareable[:n] = np.where(joins, shareable, _INT64_MAX)[tree.order]  # a request that joins no node: no cap
    sorted_shareable[n] = _INT64_MAX
    bounds = np.empty(2 * num_nodes, dtype=np.int64)
    bounds[0::2] = tree.lb
    bounds[1::2] = tree.rb + 1
    min_shareable = np.minimum.reduceat(sorted_shareable, bounds)[::2]
    ends = np.minimum(tree.depth * block_size, min_shareable)

    def node_sums(per_request: np.ndarray) -> np.ndarray:
        """Sum of ``per_request`` over each node's joining requests."""
        cum = offsets(np.where(joins, per_request, 0)[tree.order])
        return cum[tree.rb + 1] - cum[tree.lb]

    rows = node_sums(q_len)
    # Unshared, a request past a decode tile's rows reads a node's KV once per chunk tile: its extra reads.
    extra_reads = node_sums(unshared_reads(q_len, rows_per_chunk, rows_per_decode) - 1)
    sizes = node_sums(np.ones_like(q_len))
    one_level = bool((tree.parent < 0).all())  # one level of sharing (disjoint nodes): the common case
    level = np.zeros(num_nodes, dtype=np.int64) if one_level else _node_levels(tree.parent)
    # A node starts where its nearest kept ancestor ends; a dropped node passes its own start down, so its tokens
    # go back to its children or to the requests' suffixes.
    start = np.zeros(num_nodes, dtype=np.int64)
    effective_end = np.zeros(num_nodes, dtype=np.int64)
    keep = np.zeros(num_nodes, dtype=bool)
    for depth in range(int(level.max()) + 1):
        idx = slice(None) if one_level else (level == depth).nonzero()[0]
        if not one_level:
            parent = tree.parent[idx]
            start[idx] = np.where(parent >= 0, effective_end[np.maximum(parent, 0)], 0)
        tokens = ends[idx] - start[idx]
        ok = (tokens > 0) & (sizes[idx] > 0)
        if sharing in ("auto", SHARING_APART):
            ok &= sharing_pays_off(num_requests=sizes[idx], num_rows=rows[idx],
                                   num_m_tiles=-(-rows[idx] // rows_per_shared), num_tokens=tokens, group=group,
                                   head_dim=head_dim, elt_bytes=elt_bytes, extra_reads=extra_reads[idx])
        keep[idx] = ok
        if not one_level:
            effective_end[idx] = np.where(ok, ends[idx], start[idx])
    kept = keep.nonzero()[0]
    if not one_level:
        kept = kept[np.argsort(level[kept], kind="stable")]  # top-down
    node_of, rank = expand(tree.rb[kept] - tree.lb[kept] + 1)
    members = tree.order[tree.lb[kept][node_of] + rank]
    joined = joins[members]
    members, node_of = members[joined], node_of[joined]
    counts = sizes[kept]
    # Requests ascending within each node: one sort of (node, request) keys.
    key = node_of * q_len.shape[0]
    members = np.sort(key + members) - key
    kept_ends = ends[kept]
    if one_level:  # disjoint nodes: each request in at most one
        suffix_start[members] = kept_ends[node_of]
    else:
        np.maximum.at(suffix_start, members, kept_ends[node_of])  # deeper kept nodes end later
    nodes = SharedNodes(kv_start=start[kept], kv_end=kept_ends, depth_blocks=tree.depth[kept],
                        offsets=offsets(counts), members=members)
    return nodes, suffix_start


def requests_may_stay_apart(tree: LcpTree, *, q_len: np.ndarray, max_q_len: int, shareable: np.ndarray,
                            rows_per_shared: int, rows_per_chunk: int, rows_per_decode: int, group: int,
                            head_dim: int, elt_bytes: int) -> bool:
    """Whether a top-level node of ``tree`` holds both a request that gains from no node
    (:func:`joining_requests`) and one that may: then the plan with the former apart (``SHARING_APART``) can differ,
    and :mod:`prefixattn.planner.choose` prices it too. ``q_len``, ``shareable``: int64 per request;
    ``max_q_len``: ``q_len``'s largest.

    Only steps with a chunk (a request of more than ``rows_per_decode`` rows) are looked at: a decode request fails
    the request rule only at a few shareable tokens (fp16, head_dim 128: at most 4 at MHA, 36 at GQA 8), under nodes
    too short for the node rule to keep for its neighbours either, and decode steps skip the check's host time.
    """
    if tree.num_nodes == 0 or max_q_len <= rows_per_decode:
        return False
    joins = joining_requests(q_len=q_len, shareable=shareable, rows_per_shared=rows_per_shared,
                             rows_per_chunk=rows_per_chunk, rows_per_decode=rows_per_decode, group=group,
                             head_dim=head_dim, elt_bytes=elt_bytes)
    roots = tree.parent < 0
    cum = offsets(joins[tree.order].astype(np.int64))
    lb, rb = tree.lb[roots], tree.rb[roots]
    joined = cum[rb + 1] - cum[lb]
    return bool(((joined > 0) & (joined < rb - lb + 1)).any())
