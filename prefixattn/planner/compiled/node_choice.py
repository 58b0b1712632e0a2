"""Compiled (numba) node choice: :func:`prefixattn.planner.node_choice.select_shared_nodes` as loops.

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)`` but the
stage's Python side at the end. The cost rules are not restated: :mod:`prefixattn.planner.cost_rule`'s functions
themselves, compiled. numba's on-disk cache keys this file's functions on this file alone, so a change to the rule must
change this file too, or a cached :func:`select_nodes` would keep the old rule: :data:`COST_RULE_SOURCE_HASH` pins it
(``tests/test_cost_rule.py`` fails until it matches).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prefixattn.planner import cost_rule
from prefixattn.planner.options import SHARING_APART as APART
from prefixattn.planner.window import windowed
from prefixattn.planner.work_list import SharedNodes

#: The first 16 hex digits of the sha256 of :mod:`prefixattn.planner.cost_rule`'s file, which :func:`select_nodes`
#: compiles in (its functions and constants).
COST_RULE_SOURCE_HASH = "0b11787081dee105"


#: :func:`prefixattn.planner.cost_rule.sharing_pays_off`, compiled: the rule's one definition, called per node.
_sharing_pays_off = njit(nogil=True)(cost_rule.sharing_pays_off)
#: :func:`prefixattn.planner.cost_rule.request_sharing_pays_off` and its ``unshared_reads``, compiled, called per
#: request.
_request_sharing_pays_off = njit(nogil=True)(cost_rule.request_sharing_pays_off)
_unshared_reads = njit(nogil=True)(cost_rule.unshared_reads)

#: ``sharing`` modes as the compiled code takes them (:mod:`prefixattn.planner.options`' ``_SHARING_MODES`` order,
#: then its ``SHARING_APART``).
SHARING_AUTO, SHARING_ALWAYS, SHARING_NEVER, SHARING_APART = 0, 1, 2, 3


#: A node's members are found by scanning the request mask when the node holds at least 1/8 of the requests (the
#: scan reads one flag per request; the sort ~log2(size) passes over the node's members).
_SCAN_MIN_SHARE = 8


@njit(cache=True, nogil=True)
def _sorted_members(order, lo, hi, joins, mark, out):
    """``out[:] = sorted(r for r in order[lo:hi + 1] if joins[r])`` (distinct request indices below
    ``mark.shape[0]``): a sort for a small node, a scan over a request mask for a large one (a node of all 256
    requests: ~0.5 us instead of ~4 us)."""
    size = hi - lo + 1
    if size * _SCAN_MIN_SHARE < mark.shape[0]:
        j = 0
        for i in range(lo, hi + 1):
            if joins[order[i]]:
                out[j] = order[i]
                j += 1
        out.sort()
        return
    for i in range(lo, hi + 1):
        mark[order[i]] = joins[order[i]]
    j = 0
    for r in range(mark.shape[0]):
        if mark[r]:
            out[j] = r
            mark[r] = False
            j += 1


@njit(cache=True, nogil=True)
def select_nodes(order, depth, lb, rb, parent, shareable, q_len, block_size, rows_per_shared, group, head_dim,
                 elt_bytes, sharing, rows_per_chunk, rows_per_decode):
    """``(kv_start, kv_end, depth_blocks, offsets, members, suffix_start)`` of
    :func:`prefixattn.planner.node_choice.select_shared_nodes` (nodes top-down: by level, then post-order index)."""
    num_nodes = depth.shape[0]
    num_reqs = q_len.shape[0]
    suffix_start = np.zeros(num_reqs, dtype=np.int64)
    if num_nodes == 0 or sharing == SHARING_NEVER:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, np.zeros(1, dtype=np.int64), z, suffix_start
    joins = np.ones(num_reqs, dtype=np.bool_)
    if sharing == SHARING_APART:
        for r in range(num_reqs):
            reads = _unshared_reads(q_len[r], rows_per_chunk, rows_per_decode)
            joins[r] = _request_sharing_pays_off(q_len[r], reads, shareable[r], rows_per_shared, group, head_dim,
                                                 elt_bytes)
    ends = np.empty(num_nodes, dtype=np.int64)
    size = np.zeros(num_nodes, dtype=np.int64)
    start = np.zeros(num_nodes, dtype=np.int64)
    eff_end = np.zeros(num_nodes, dtype=np.int64)
    level = np.zeros(num_nodes, dtype=np.int64)
    keep = np.zeros(num_nodes, dtype=np.bool_)
    # Post-order: every child before its parent, so the reverse visits parents first (the numpy level-by-level walk).
    for k in range(num_nodes - 1, -1, -1):
        min_sh = np.iinfo(np.int64).max
        rows = extra = 0
        for i in range(lb[k], rb[k] + 1):
            r = order[i]
            if not joins[r]:
                continue
            size[k] += 1
            min_sh = min(min_sh, shareable[r])
            rows += q_len[r]
            extra += _unshared_reads(q_len[r], rows_per_chunk, rows_per_decode) - 1
        ends[k] = min(depth[k] * block_size, min_sh)
        p = parent[k]
        if p >= 0:
            start[k] = eff_end[p]
            level[k] = level[p] + 1
        tokens = ends[k] - start[k]
        ok = tokens > 0 and size[k] > 0
        if ok and (sharing == SHARING_AUTO or sharing == SHARING_APART):
            ok = _sharing_pays_off(size[k], rows, -(-rows // rows_per_shared), tokens, group, head_dim,
                                   elt_bytes, extra)
        keep[k] = ok
        eff_end[k] = ends[k] if ok else start[k]
    # Kept nodes top-down: by level, post-order index within a level (the numpy stable sort by level).
    num_kept = 0
    max_level = 0
    for k in range(num_nodes):
        if keep[k]:
            num_kept += 1
            max_level = max(max_level, level[k])
    kept = np.empty(num_kept, dtype=np.int64)
    j = 0
    for lv in range(max_level + 1):
        for k in range(num_nodes):
            if keep[k] and level[k] == lv:
                kept[j] = k
                j += 1
    offsets = np.zeros(num_kept + 1, dtype=np.int64)
    for j in range(num_kept):
        k = kept[j]
        offsets[j + 1] = offsets[j] + size[k]
    members = np.empty(offsets[num_kept], dtype=np.int64)
    kv_start = np.empty(num_kept, dtype=np.int64)
    kv_end = np.empty(num_kept, dtype=np.int64)
    depth_blocks = np.empty(num_kept, dtype=np.int64)
    mark = np.zeros(num_reqs, dtype=np.bool_)
    for j in range(num_kept):
        k = kept[j]
        kv_start[j], kv_end[j], depth_blocks[j] = start[k], ends[k], depth[k]
        seg = members[offsets[j]:offsets[j + 1]]
        _sorted_members(order, lb[k], rb[k], joins, mark, seg)  # requests ascending within each node
        for r in seg:
            suffix_start[r] = max(suffix_start[r], ends[k])  # deeper kept nodes end later
    return kv_start, kv_end, depth_blocks, offsets, members, suffix_start


# ---- the stage's Python side

#: ``sharing`` as :func:`select_nodes` takes it.
SHARING_CODES = {"auto": SHARING_AUTO, "always": SHARING_ALWAYS, "never": SHARING_NEVER, APART: SHARING_APART}


def nodes(tree, inputs, o, tiles, *, sharing: str) -> tuple[SharedNodes, np.ndarray]:
    """The node stage: :func:`prefixattn.planner.node_choice.select_shared_nodes`, then the numpy window stage
    (:func:`prefixattn.planner.window.windowed`). ``o``: the plan's options; ``tiles``: its
    :class:`~prefixattn.planner.tiles.AttentionTiles`."""
    rows = tiles.tile_rows(o.group)
    kv_start, kv_end, depth_blocks, offsets, members, suffix_start = select_nodes(
        tree.order, tree.depth, tree.lb, tree.rb, tree.parent, inputs.shareable, inputs.q_len, o.block_size,
        rows.rows_per_shared_tile, o.group, o.cost_head_dim, o.kv_dtype.itemsize, SHARING_CODES[sharing],
        rows.rows_per_chunk_tile, rows.decode_class_rows)
    chosen = SharedNodes(kv_start=kv_start, kv_end=kv_end, depth_blocks=depth_blocks, offsets=offsets,
                         members=members)
    return windowed(chosen, suffix_start, inputs, o)
