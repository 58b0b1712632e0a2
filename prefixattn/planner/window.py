"""Sliding windows and prefix sharing: which part of a shared prefix every member's window covers (host, numpy).

With a left window ``W`` the query at KV position ``p`` sees keys ``p - W .. p`` (FlashInfer's ``window_left``;
vLLM's ``sliding_window=S`` is ``W = S - 1``). Request ``r`` with ``q_len`` queries ending at ``kv_len``:

* its first row sees keys from ``first_r = kv_len - q_len - W``: no row of ``r`` reads anything before it;
* its last row sees keys from ``all_r = kv_len - 1 - W``: every row of ``r`` sees ``[all_r, kv_len - q_len]``.

A shared-node item runs with no mask (:mod:`prefixattn.kernels.prefix_attention_kernel`), so a request may stay a
member of a node only where all of its rows see all of the node. For each member of each kept node, in the request's
top-down chain of nodes (which covers ``[0, suffix_start)`` without gaps):

* the node ends at or before ``first_r``: the request reads nothing from it and leaves it;
* the node starts at or after ``all_r``: every row sees all of it; the request stays;
* otherwise (partly visible): the request leaves this node and every deeper one, and its own suffix items start at
  this node's start (the kernel skips the tiles left of each item's window and masks the edge tiles).

Nodes left with no member are dropped; a node that keeps one member still reads its range once, correctly. This
runs after the cost rule chose the nodes (:func:`prefixattn.planner.node_choice.select_shared_nodes`), so a node
the window thins out may share less than the rule assumed; never more.
"""

from __future__ import annotations

import numpy as np

from prefixattn.planner.work_list import SharedNodes


def window_shared_nodes(nodes: SharedNodes, suffix_start: np.ndarray, *, kv_len: np.ndarray, q_len: np.ndarray,
                        window_left: int) -> tuple[SharedNodes, np.ndarray]:
    """Restrict the planner's kept nodes to what every member's window covers (see the module docstring).

    Parameters
    ----------
    nodes : SharedNodes
        Kept nodes, top-down (a node before its descendants), members ascending.
    suffix_start : ``[num_requests]`` int64
        End of the deepest kept node holding each request (0 if none).
    kv_len, q_len : ``[num_requests]`` int64
    window_left : int
        ``W >= 0``.

    Returns
    -------
    (SharedNodes, suffix_start): the nodes with the members that keep reading them (empty nodes dropped, order
    kept) and each request's new suffix start (its suffix items cover the KV from there), never left of its first
    row's window.
    """
    # No row of a request reads KV left of its first row's window: its suffix items start there at the latest (the
    # split rule then sizes chunks by what is really read).
    window_start = np.maximum(kv_len - q_len - window_left, 0)
    if len(nodes) == 0:
        return nodes, np.maximum(suffix_start, window_start)
    counts = np.diff(nodes.offsets)
    node_of = np.repeat(np.arange(len(nodes), dtype=np.int64), counts)
    req = nodes.members
    start, end = nodes.kv_start[node_of], nodes.kv_end[node_of]
    first = kv_len[req] - q_len[req] - window_left
    all_rows = kv_len[req] - 1 - window_left
    before = end <= first
    partial = ~before & (start < all_rows)
    # Each request's cut: the start of its first partly visible node (its chain is ordered by position).
    cut = np.full(kv_len.shape[0], np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(cut, req[partial], start[partial])
    stay = ~before & (start < cut[req])
    new_suffix = np.maximum(np.where(cut < np.iinfo(np.int64).max, cut, suffix_start), window_start)
    kept_nodes = np.flatnonzero(np.bincount(node_of[stay], minlength=len(nodes)) > 0)
    new_counts = np.bincount(node_of[stay], minlength=len(nodes))[kept_nodes]
    return SharedNodes(kv_start=nodes.kv_start[kept_nodes], kv_end=nodes.kv_end[kept_nodes],
                       depth_blocks=nodes.depth_blocks[kept_nodes], offsets=np.r_[0, np.cumsum(new_counts)],
                       members=req[stay]), new_suffix


def windowed(nodes: SharedNodes, suffix_start: np.ndarray, inputs, o) -> tuple[SharedNodes, np.ndarray]:
    """The window stage as the pipeline calls it after either back-end's node choice: :func:`window_shared_nodes`
    under a sliding window (``o.window_left >= 0``; ``inputs``: the checks'), the nodes as they are without one."""
    if o.window_left < 0:
        return nodes, suffix_start
    # int64: the compiled checks pass int32 lengths through, and numpy's int32 sums with Python ints stay int32
    return window_shared_nodes(nodes, suffix_start, kv_len=inputs.lens.astype(np.int64, copy=False),
                               q_len=inputs.q_len, window_left=o.window_left)
