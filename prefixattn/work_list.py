"""The flat work list of one step: shared-node tiles, per-request suffix tiles, split-k chunks and merge units.

Numpy only, built on the host by :func:`prefixattn.plan`; the table layout (column indices) is
:mod:`prefixattn.kernels.layout`, shared with the kernel. Vectorized over requests, shared nodes and tiles: no Python
loop.

Vocabulary
----------
* suffix tile: up to ``rows_per_suffix`` consecutive query rows of one request; its KV range runs from the end of the
  request's deepest shared node to the last position its rows see (causal) or to ``kv_len``.
* merge unit: the rows of one suffix tile when they get more than one partial state (shared levels, split chunks);
  state ``s`` of the unit lives at workspace rows ``ws_base + s * num_rows + row``. Rows with a single state (no
  sharing, no split) have no unit: their item writes straight to ``out``, as plain paged attention does.
* merge row: one row of a merge unit, as the kernel sees it (``mrows`` table): where its states live and how many
  there are. Every state of a merge row is written by exactly one program per query head, so the kernel counts
  arrivals per (merge row, query head) and the arrival that completes the count merges that row and head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixattn.kernels import layout as K
from prefixattn.split_rule import split_ranges

_I32 = np.int32


@dataclass(frozen=True)
class SharedNode:
    """A shared prefix node chosen by the planner: KV positions ``[kv_start, kv_end)`` of every request in
    ``requests`` (ascending) live in the same physical blocks, and every query row of those requests sees them all."""

    kv_start: int
    kv_end: int
    requests: np.ndarray
    depth_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.kv_end - self.kv_start


@dataclass(frozen=True)
class SharedNodes:
    """The kept shared nodes as flat arrays, top-down (a node before its descendants).

    Node ``k`` covers KV ``[kv_start[k], kv_end[k])`` of requests ``members[offsets[k]:offsets[k + 1]]``
    (ascending).
    """

    kv_start: np.ndarray  # [num_nodes] int64
    kv_end: np.ndarray  # [num_nodes] int64
    depth_blocks: np.ndarray  # [num_nodes] int64
    offsets: np.ndarray  # [num_nodes + 1] int64
    members: np.ndarray  # [num_memberships] int64

    def __len__(self) -> int:
        return int(self.kv_start.shape[0])

    @staticmethod
    def empty() -> "SharedNodes":
        z = np.zeros(0, dtype=np.int64)
        return SharedNodes(kv_start=z, kv_end=z, depth_blocks=z, offsets=np.zeros(1, dtype=np.int64), members=z)

    def to_list(self) -> list[SharedNode]:
        return [SharedNode(kv_start=int(self.kv_start[k]), kv_end=int(self.kv_end[k]),
                           requests=self.members[self.offsets[k]:self.offsets[k + 1]],
                           depth_blocks=int(self.depth_blocks[k])) for k in range(len(self))]


@dataclass(frozen=True)
class WorkList:
    """Host arrays of one step's work (int32, kernel column layout)."""

    items: np.ndarray  # [num_items, ITEM_FIELDS], longest KV range first
    gather: np.ndarray  # [num_gather, GATHER_FIELDS]
    mrows: np.ndarray  # [num_mrows, MROW_FIELDS]
    num_ws_rows: int
    num_units: int  # merge units (suffix tiles whose rows merge); their rows are the merge rows

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape[0], dtype=np.int64)
    if x.shape[0] > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(n) for n in lengths)`` without a Python loop."""
    total = int(lengths.sum())
    if total == 0 or lengths.max() <= 1:  # decode batches and unsplit ranges: all zeros, skip the repeat
        return np.zeros(total, dtype=np.int64)
    return np.arange(total, dtype=np.int64) - np.repeat(_exclusive_cumsum(lengths), lengths)


def _run_starts(*keys: np.ndarray) -> np.ndarray:
    """Mask of the positions where any key differs from the previous position (position 0 always starts a run)."""
    n = keys[0].shape[0]
    change = np.zeros(n, dtype=bool)
    if n:
        change[0] = True
        for key in keys:
            change[1:] |= key[1:] != key[:-1]
    return change


def _piece_bounds(lo, hi, piece, pieces, block_n: int, split: bool = True):
    """[start, end) of piece ``piece`` of ``pieces`` over [lo, hi): whole KV tiles dealt out evenly (the last piece
    takes the partial tile), so pieces differ by at most one tile. ``split=False``: one piece per range. ``block_n``
    is the split grain (:func:`prefixattn.split_rule.split_grain`): the KV tile, or a fraction of it."""
    if not split:
        return lo, hi
    tiles = -(-(hi - lo) // block_n)
    start = lo + (piece * tiles // pieces) * block_n
    end = np.minimum(lo + ((piece + 1) * tiles // pieces) * block_n, hi)
    return start, end


def build_work_list(
    *,
    q_start: np.ndarray,
    q_len: np.ndarray,
    kv_len: np.ndarray,
    causal: bool,
    nodes: SharedNodes,
    suffix_start: np.ndarray,
    rows_per_shared: int,
    rows_per_suffix: int,
    block_n_shared: int,
    block_n_suffix: int,
    num_kv_heads: int,
    num_sms: int,
    min_split_tokens: int,
) -> WorkList:
    """Turn the chosen shared nodes into the kernel's work list.

    ``nodes`` must be in top-down order (a node before its descendants): a request's states are numbered in that
    order (shared levels, each with its split chunks, then the suffix chunks). ``suffix_start[r]`` is the end of the
    deepest node holding request ``r`` (0 if none).
    """
    num_reqs = q_len.shape[0]
    # ---- suffix tiles (one per rows_per_suffix rows of each request that has queries) -------------------------
    active = np.flatnonzero(q_len > 0)
    tiles_per_req = np.zeros(num_reqs, dtype=np.int64)
    tiles_per_req[active] = -(-q_len[active] // rows_per_suffix)
    first_tile = _exclusive_cumsum(tiles_per_req)
    t_req = np.repeat(np.arange(num_reqs, dtype=np.int64), tiles_per_req)
    t_row0 = ragged_arange(tiles_per_req) * rows_per_suffix
    t_rows = np.minimum(rows_per_suffix, q_len[t_req] - t_row0)
    t_tok0 = q_start[t_req] + t_row0
    t_lo = suffix_start[t_req]
    if causal:
        t_qpos = kv_len[t_req] - q_len[t_req] + t_row0
        t_hi = t_qpos + t_rows
    else:
        t_hi = kv_len[t_req]
        t_qpos = t_hi  # every row sees the whole range: the causal loop stays empty
    t_len = np.maximum(t_hi - t_lo, 0)
    num_tiles = t_req.shape[0]

    # ---- shared nodes as flat arrays: one entry per (node, member request), nodes in top-down order ----------
    num_nodes = len(nodes)
    node_start, node_end, mem_req = nodes.kv_start, nodes.kv_end, nodes.members
    node_size = np.diff(nodes.offsets)
    mem_node = np.repeat(np.arange(num_nodes, dtype=np.int64), node_size)
    mem_first = _exclusive_cumsum(node_size)
    mem_ql = q_len[mem_req]
    node_rows = np.bincount(mem_node, weights=mem_ql, minlength=num_nodes).astype(np.int64)
    node_mtiles = -(-node_rows // rows_per_shared)

    # ---- split-k decision over the unsplit work (prefixattn.split_rule: the critical path) -------------------
    n_pieces, grain_shared, t_pieces, grain_suffix = split_ranges(
        node_lengths=node_end - node_start, node_m_tiles=node_mtiles, tile_lengths=t_len,
        block_n_shared=block_n_shared, block_n_suffix=block_n_suffix, num_kv_heads=num_kv_heads, num_sms=num_sms,
        min_split_tokens=min_split_tokens)

    # ---- states per request and merge units ----------------------------------------------------------------
    # A request's shared states are numbered node by node (top-down): its slot base in node k is the number of
    # pieces of the earlier nodes that hold it, an exclusive cumsum within each request's entries.
    shared_states = np.zeros(num_reqs, dtype=np.int64)
    if num_nodes:
        mem_pieces = n_pieces[mem_node]
        by_req = np.argsort(mem_req, kind="stable")
        csum = np.cumsum(mem_pieces[by_req]) - mem_pieces[by_req]
        run_start = _run_starts(mem_req[by_req])
        mem_slot_base = np.empty_like(mem_req)
        mem_slot_base[by_req] = csum - csum[run_start][np.cumsum(run_start) - 1]
        shared_states = np.bincount(mem_req, weights=mem_pieces, minlength=num_reqs).astype(np.int64)
    t_shared = shared_states[t_req]
    t_states = t_shared + t_pieces
    needs_unit = (t_shared > 0) | (t_pieces > 1)
    t_unit = np.where(needs_unit, np.cumsum(needs_unit) - 1, -1)
    unit_tiles = np.flatnonzero(needs_unit)
    num_units = unit_tiles.shape[0]
    unit_ws_base = _exclusive_cumsum(t_states[unit_tiles] * t_rows[unit_tiles])
    num_ws_rows = int((t_states[unit_tiles] * t_rows[unit_tiles]).sum())
    tile_ws_base = np.full(num_tiles, -1, dtype=np.int64)
    tile_ws_base[unit_tiles] = unit_ws_base
    # Merge rows: the rows of the units, unit by unit; a unit's row i is merge row tile_mrow_base[tile] + i.
    unit_rows = t_rows[unit_tiles]
    tile_mrow_base = np.full(num_tiles, -1, dtype=np.int64)
    tile_mrow_base[unit_tiles] = _exclusive_cumsum(unit_rows)
    m_unit = np.repeat(np.arange(num_units, dtype=np.int64), unit_rows)
    mrows = np.empty((m_unit.shape[0], K.MROW_FIELDS), dtype=np.int64)
    mrows[:, K.MROW_WS_FIRST] = unit_ws_base[m_unit] + ragged_arange(unit_rows)
    mrows[:, K.MROW_WS_STRIDE] = unit_rows[m_unit]
    mrows[:, K.MROW_NUM_STATES] = t_states[unit_tiles][m_unit]

    # ---- shared items: (node, split chunk, M tile of packed rows) ------------------------------------------
    if num_nodes:
        # Packed rows of each node: its members' query rows, request by request.
        row_mem = np.repeat(np.arange(mem_req.shape[0], dtype=np.int64), mem_ql)
        row_i = ragged_arange(mem_ql)
        row_req = mem_req[row_mem]
        node_row_off = _exclusive_cumsum(node_rows)
        tok = q_start[row_req] + row_i
        tile = first_tile[row_req] + row_i // rows_per_suffix
        ws0 = tile_ws_base[tile] + mem_slot_base[row_mem] * t_rows[tile] + row_i % rows_per_suffix
        mrow = tile_mrow_base[tile] + row_i % rows_per_suffix
        # One segment per (node, split piece): it repeats the node's packed rows.
        seg_node = np.repeat(np.arange(num_nodes, dtype=np.int64), n_pieces)
        seg_c = ragged_arange(n_pieces)
        seg_rows = node_rows[seg_node]
        seg_gather_off = _exclusive_cumsum(seg_rows)
        g_seg = np.repeat(np.arange(seg_node.shape[0], dtype=np.int64), seg_rows)
        g_row = node_row_off[seg_node][g_seg] + ragged_arange(seg_rows)
        gather = np.empty((g_row.shape[0], K.GATHER_FIELDS), dtype=np.int64)
        gather[:, K.GATHER_TOKEN] = tok[g_row]
        gather[:, K.GATHER_WS_ROW] = ws0[g_row] + seg_c[g_seg] * t_rows[tile[g_row]]
        gather[:, K.GATHER_MROW] = mrow[g_row]
        i_seg = np.repeat(np.arange(seg_node.shape[0], dtype=np.int64), node_mtiles[seg_node])
        i_mt = ragged_arange(node_mtiles[seg_node])
        i_node, i_c = seg_node[i_seg], seg_c[i_seg]
        kv_lo, kv_hi = _piece_bounds(node_start[i_node], node_end[i_node], i_c, n_pieces[i_node], grain_shared,
                                     split=bool((n_pieces > 1).any()))
        shared_items = np.zeros((i_seg.shape[0], K.ITEM_FIELDS), dtype=np.int64)
        shared_items[:, K.ITEM_KIND] = K.KIND_SHARED
        shared_items[:, K.ITEM_REQ] = mem_req[mem_first[i_node]]  # any member: same blocks
        shared_items[:, K.ITEM_KV_START] = kv_lo
        shared_items[:, K.ITEM_KV_END] = kv_hi
        shared_items[:, K.ITEM_ROW_START] = seg_gather_off[i_seg] + i_mt * rows_per_shared
        shared_items[:, K.ITEM_NUM_ROWS] = np.minimum(rows_per_shared, node_rows[i_node] - i_mt * rows_per_shared)
        shared_items[:, K.ITEM_Q_POS] = node_end[i_node]
        shared_items[:, K.ITEM_DEST] = -1
        shared_items[:, K.ITEM_MROW] = -1
    else:  # plain paged attention: skip ~30 numpy calls on empty arrays
        shared_items = np.zeros((0, K.ITEM_FIELDS), dtype=np.int64)
        gather = np.zeros((0, K.GATHER_FIELDS), dtype=np.int64)

    # ---- suffix items: (suffix tile, split chunk) ------------------------------------------------------------
    s_tile = np.repeat(np.arange(num_tiles, dtype=np.int64), t_pieces)
    s_c = ragged_arange(t_pieces)
    s_lo, s_hi = _piece_bounds(t_lo[s_tile], t_hi[s_tile], s_c, t_pieces[s_tile], grain_suffix,
                               split=bool((t_pieces > 1).any()))
    has_unit = t_unit[s_tile] >= 0
    it = np.zeros((s_tile.shape[0], K.ITEM_FIELDS), dtype=np.int64)
    it[:, K.ITEM_KIND] = K.KIND_SUFFIX
    it[:, K.ITEM_REQ] = t_req[s_tile]
    it[:, K.ITEM_KV_START] = s_lo
    it[:, K.ITEM_KV_END] = s_hi
    it[:, K.ITEM_ROW_START] = t_tok0[s_tile]
    it[:, K.ITEM_NUM_ROWS] = t_rows[s_tile]
    it[:, K.ITEM_Q_POS] = t_qpos[s_tile]
    it[:, K.ITEM_DEST] = np.where(has_unit, tile_ws_base[s_tile] + (t_shared[s_tile] + s_c) * t_rows[s_tile], -1)
    it[:, K.ITEM_MROW] = np.where(has_unit, tile_mrow_base[s_tile], -1)
    items = np.concatenate([shared_items, it])
    # Longest KV range first (LPT): the long programs start in the first wave, short ones fill the tail.
    order = np.argsort(-(items[:, K.ITEM_KV_END] - items[:, K.ITEM_KV_START]), kind="stable")
    items = items[order]
    return WorkList(items=items.astype(_I32), gather=gather.astype(_I32), mrows=mrows.astype(_I32),
                    num_ws_rows=num_ws_rows, num_units=num_units)
