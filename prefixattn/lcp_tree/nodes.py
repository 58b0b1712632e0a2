"""The one tree builder: the lcp-intervals of a sorted row list (:func:`tree_from_lcp`), as the planner's
:class:`LcpTree` (those nodes only) or the scheduler's :class:`PrefixTree` (a root and one leaf per row added).

Node convention (both trees): a node is an *lcp-interval*, a run ``order[lb..rb]`` (inclusive) of at least two sorted
rows that all share their first ``depth`` entries, with ``depth`` maximal for that run (Abouelhoda, Kurtz &
Ohlebusch, "Replacing suffix trees with enhanced suffix arrays", 2004). Nested runs are children, so multi-level
sharing (system prompt > document > query) comes out as a chain of nodes with no grouping input. The root (depth 0,
every row) is not an lcp-interval: :class:`LcpTree` leaves it implicit (parent ``-1``), :class:`PrefixTree` makes it
node 0 and adds the rows as leaves, with exclusive bounds ``lo = lb``, ``hi = rb + 1``. The builder needs only the
neighbour LCPs of an order in which rows sharing a prefix are contiguous, so it serves both sorts of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LcpTree:
    """Prefix tree of ``n`` integer rows, nodes in post-order (every child before its parent).

    Attributes
    ----------
    order : ndarray, ``[n]`` int64
        Row indices in lexicographic order of the rows.
    lcp : ndarray, ``[n]`` int64
        ``lcp[i]`` = common prefix length of rows ``order[i-1]`` and ``order[i]``; ``lcp[0] = 0``.
    depth, lb, rb, parent : ndarray, ``[num_nodes]`` int64
        Node ``k`` holds rows ``order[lb[k]:rb[k] + 1]`` (at least two) which share their first ``depth[k]`` entries;
        ``parent[k]`` is the enclosing node, ``-1`` under the root (depth 0, not a node).
    """

    order: np.ndarray
    lcp: np.ndarray
    depth: np.ndarray
    lb: np.ndarray
    rb: np.ndarray
    parent: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.depth.shape[0])

    def members(self, node: int) -> np.ndarray:
        """Row indices under ``node`` (in sorted order)."""
        return self.order[self.lb[node]: self.rb[node] + 1]


def tree_from_lcp(lcp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """lcp-intervals of a sorted row list with a stack, visiting only the positions where ``lcp`` changes.

    Between two change points the stack top already has depth ``lcp[i]``, so nothing is pushed or popped: the Python
    loop runs over change points (about two per sharing group), not over rows. Returns ``(depth, lb, rb, parent)``
    in post-order (``lcp[0]`` is not read).
    """
    n = lcp.shape[0]
    ext = np.zeros(n + 1, dtype=np.int64)  # ext[i] = lcp[i] for 1 <= i < n; ext[n] = 0 closes every open interval
    ext[1:n] = lcp[1:]
    changes = (ext[1:] != ext[:-1]).nonzero()[0] + 1
    values = ext[changes]
    if not (values[1::2] != 0).any() and (values[0::2] != 0).all():
        # One level (runs of one nonzero LCP between zeros: disjoint groups): run k opens at changes[2k] and closes
        # at changes[2k + 1], as the stack below would find it, with no Python loop.
        opens, closes = changes[0::2], changes[1::2]
        return values[0::2].copy(), opens - 1, closes - 1, np.full(opens.shape[0], -1, dtype=np.int64)
    depth: list[int] = []
    lbs: list[int] = []
    rbs: list[int] = []
    parent: list[int] = []
    stack: list[list] = [[0, 0, []]]  # [depth, lb, child node ids]; the root (depth 0) is never emitted
    for i in changes.tolist():
        d = int(ext[i])
        lb = i - 1
        last = -1
        while d < stack[-1][0]:
            node_depth, lb, children = stack.pop()
            last = len(depth)
            depth.append(node_depth)
            lbs.append(lb)
            rbs.append(i - 1)
            parent.append(-1)
            for c in children:
                parent[c] = last
            if d <= stack[-1][0]:  # the enclosing interval is already open: it is the parent
                stack[-1][2].append(last)
                last = -1
        if d > stack[-1][0]:  # a new interval opens at lb; a node just closed (if any) is its first child
            stack.append([d, lb, [last] if last >= 0 else []])
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return as_array(depth), as_array(lbs), as_array(rbs), as_array(parent)


@dataclass(frozen=True)
class PrefixTree:
    """Compact prefix tree of ``N`` rows; node 0 is the (empty) root, every row is one leaf.

    Internal nodes have at least two children (the root may have one). A leaf hangs under the internal node at the
    depth where its row stops sharing; a row that is a prefix of another row (or a duplicate) is a leaf whose own
    edge is empty (``depth[leaf] == depth[parent[leaf]]``). Leaves of a subtree are the contiguous sorted positions
    ``lo[v]:hi[v]``. Nodes are numbered as a walk over the sorted positions reaches them (see
    :func:`prefix_tree_from_lcp`).

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
        kids = kids[np.lexsort((self.lo[kids], self.parent[kids]))]
        counts = np.bincount(self.parent[kids], minlength=self.num_nodes)
        indptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return indptr, kids

    def shared_tokens(self) -> int:
        """Ids stored once per tree node: ``sum(lengths) - sum(lcp)`` (the optimum of prefix sharing)."""
        return int(self.lengths.sum() - self.lcp.sum())


def _boundary_owners(lcp: np.ndarray, depth: np.ndarray, lb: np.ndarray) -> np.ndarray:
    """``[N + 1]`` int64: the lcp-interval each boundary between sorted positions ``j - 1`` and ``j`` lies inside
    at depth ``lcp[j]`` (an index into ``depth``), ``-1`` for the root (LCP 0, and the ends 0 and ``N``)."""
    n = lcp.shape[0]
    owner = np.full(n + 1, -1, dtype=np.int64)
    inside = np.flatnonzero(lcp[1:] > 0) + 1
    if inside.shape[0]:
        # Intervals of one depth are disjoint: boundary j's is the one of depth lcp[j] starting last at or before
        # j - 1, found by one search over the intervals keyed by (depth, lb).
        key = depth * n + lb
        by_key = np.argsort(key)
        at = np.searchsorted(key[by_key], lcp[inside] * n + inside - 1, side="right") - 1
        owner[inside] = by_key[at]
    return owner


def prefix_tree_from_lcp(order: np.ndarray, lcp: np.ndarray, lengths: np.ndarray) -> PrefixTree:
    """:class:`PrefixTree` of rows sorted into ``order`` with neighbour LCPs ``lcp`` (``[N]`` int64 each) and row
    lengths ``lengths`` (``[N]`` int64, by row): the lcp-intervals of :func:`tree_from_lcp`, a root over them and one
    leaf per row under the deepest interval holding its position (the root when it shares nothing).

    Node ids follow a walk over the sorted positions: at position ``i`` the interval whose first inner boundary is
    ``i`` (between positions ``i - 1`` and ``i``; at most one), then the leaf of position ``i``; the root is 0. The
    post-order visits children left to right.
    """
    n = order.shape[0]
    depth, lb, rb, parent = tree_from_lcp(lcp)
    m = depth.shape[0]
    owner = _boundary_owners(lcp, depth, lb)
    ext = np.zeros(n + 1, dtype=np.int64)  # the LCP at each boundary, 0 at both ends
    ext[1:n] = lcp[1:]
    # A leaf lies in the deeper of the intervals at its two boundaries.
    leaf_parent = np.where(ext[:-1] >= ext[1:], owner[:-1], owner[1:])
    first_boundary = np.zeros(m, dtype=np.int64)
    inside = np.flatnonzero(owner >= 0)
    nodes, first = np.unique(owner[inside], return_index=True)  # every interval holds >= 1 inner boundary
    first_boundary[nodes] = inside[first]
    walk = np.concatenate([2 * first_boundary, 2 * np.arange(n, dtype=np.int64) + 1])  # an interval before its leaf
    ids = np.empty(m + n, dtype=np.int64)
    ids[np.argsort(walk)] = np.arange(1, m + n + 1, dtype=np.int64)
    to_id = np.append(ids[:m], 0)  # interval index -> node id; index -1 (the root) -> 0
    num_nodes = 1 + m + n
    out = {name: np.empty(num_nodes, dtype=np.int64) for name in ("parent", "depth", "lo", "hi", "leaf")}
    positions = np.arange(n, dtype=np.int64)
    for name, root, inner, leaves in (("parent", -1, to_id[parent], to_id[leaf_parent]),
                                      ("depth", 0, depth, lengths[order]), ("lo", 0, lb, positions),
                                      ("hi", n, rb + 1, positions + 1), ("leaf", -1, -1, positions)):
        out[name][0] = root
        out[name][ids[:m]] = inner
        out[name][ids[m:]] = leaves
    # Post-order: by end position; at one end the leaf first, then the intervals closing there, deepest first.
    post_order = np.lexsort((-out["depth"], out["leaf"] < 0, out["hi"]))
    return PrefixTree(order=order, lcp=lcp, lengths=lengths, post_order=post_order, **out)
