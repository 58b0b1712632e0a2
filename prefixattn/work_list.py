"""The flat work list of one step: shared-node tiles, per-request suffix tiles, split-k chunks and merge units.

Numpy only, built on the host by :func:`prefixattn.plan`; the layout (column indices) is the kernel's, see
:mod:`prefixattn.kernels.prefix_attention`. Vectorized over requests and tiles; the only Python loop runs over the
shared nodes (a few per sharing group).

Vocabulary
----------
* suffix tile: up to ``rows_per_suffix`` consecutive query rows of one request; its KV range runs from the end of the
  request's deepest shared node to the last position its rows see (causal) or to ``kv_len``.
* merge unit: the rows of one suffix tile when they get more than one partial state (shared levels, split chunks);
  state ``s`` of the unit lives at workspace rows ``ws_base + s * num_rows + row``. Rows with a single state (no
  sharing, no split) have no unit: their item writes straight to ``out``, as plain paged attention does.
* report: an (item, unit) pair; a unit's ``expected`` count is its number of reports (a shared M tile can cover part of
  a unit's rows, so reports and states differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from prefixattn.kernels import prefix_attention as _kernel

#: The kernel's table layout (column indices, kinds) as plain ints for numpy.
K = SimpleNamespace(**{name: int(value) for name, value in vars(_kernel).items()
                       if name.isupper() and isinstance(getattr(value, "value", None), int)})
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
class WorkList:
    """Host arrays of one step's work (int32, kernel column layout)."""

    items: np.ndarray  # [num_items, ITEM_FIELDS], longest KV range first
    gather: np.ndarray  # [num_gather, GATHER_FIELDS]
    item_units: np.ndarray  # [num_reports]
    units: np.ndarray  # [num_units, UNIT_FIELDS]
    num_ws_rows: int

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape[0], dtype=np.int64)
    if x.shape[0] > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def _ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(n) for n in lengths)`` without a Python loop."""
    total = int(lengths.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(_exclusive_cumsum(lengths), lengths)


def _num_pieces(lengths: np.ndarray, chunk: float, block_n: int) -> np.ndarray:
    """Split-k pieces per KV range: enough that none exceeds ``chunk`` tokens, at most one per KV tile (so no piece
    is empty), 0 for an empty range."""
    lengths = lengths.astype(np.int64)
    if not np.isfinite(chunk):
        return (lengths > 0).astype(np.int64)
    return np.minimum(-(-lengths // int(chunk)), -(-lengths // block_n))


def _piece_bounds(lo, hi, piece, pieces, block_n: int):
    """[start, end) of piece ``piece`` of ``pieces`` over [lo, hi): whole KV tiles dealt out evenly (the last piece
    takes the partial tile), so pieces differ by at most one tile."""
    tiles = -(-(hi - lo) // block_n)
    start = lo + (piece * tiles // pieces) * block_n
    end = np.minimum(lo + ((piece + 1) * tiles // pieces) * block_n, hi)
    return start, end


def split_chunk_tokens(item_lengths: np.ndarray, *, num_kv_heads: int, num_sms: int, min_split_tokens: int) -> float:
    """KV tokens per split-k chunk, or ``inf`` when the unsplit grid already fills the device.

    Split only when ``items x kv_heads`` programs leave SMs idle; then aim for one program per SM with equal KV work,
    but never below ``min_split_tokens`` (a chunk must amortize its partial-state write and its program start).
    """
    num_items = int(np.count_nonzero(item_lengths))
    if num_items == 0 or num_items * num_kv_heads >= num_sms:
        return float("inf")
    total = int(item_lengths.sum()) * num_kv_heads
    return float(max(min_split_tokens, -(-total // num_sms)))


def build_work_list(
    *,
    q_start: np.ndarray,
    q_len: np.ndarray,
    kv_len: np.ndarray,
    causal: bool,
    nodes: list[SharedNode],
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
    t_row0 = _ragged_arange(tiles_per_req) * rows_per_suffix
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

    # ---- split-k decision over the unsplit work ------------------------------------------------------------
    node_rows = [int(q_len[n.requests].sum()) for n in nodes]
    node_mtiles = [-(-r // rows_per_shared) for r in node_rows]
    unsplit = np.concatenate([np.repeat([n.num_tokens for n in nodes], node_mtiles).astype(np.int64), t_len])
    chunk = split_chunk_tokens(unsplit, num_kv_heads=num_kv_heads, num_sms=num_sms,
                               min_split_tokens=min_split_tokens)
    t_pieces = _num_pieces(t_len, chunk, block_n_suffix)
    n_pieces = _num_pieces(np.array([n.num_tokens for n in nodes], dtype=np.int64), chunk, block_n_shared)

    # ---- states per request and merge units ----------------------------------------------------------------
    shared_states = np.zeros(num_reqs, dtype=np.int64)
    node_slot_base = []
    for k, node in enumerate(nodes):
        node_slot_base.append(shared_states[node.requests].copy())
        shared_states[node.requests] += n_pieces[k]
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
    unit_expected = t_pieces[unit_tiles].astype(np.int64)

    item_blocks: list[np.ndarray] = []
    gather_blocks: list[np.ndarray] = []
    report_blocks: list[np.ndarray] = []
    num_gather = 0
    num_reports = 0

    # ---- shared items: (node, split chunk, M tile of packed rows) ------------------------------------------
    for k, node in enumerate(nodes):
        members = node.requests
        ql = q_len[members]
        rows = node_rows[k]
        row_req = np.repeat(members, ql)
        row_i = _ragged_arange(ql)
        tok = q_start[row_req] + row_i
        tile = first_tile[row_req] + row_i // rows_per_suffix
        unit = t_unit[tile]
        slot0 = np.repeat(node_slot_base[k], ql)
        ws0 = tile_ws_base[tile] + slot0 * t_rows[tile] + row_i % rows_per_suffix
        mtile = np.arange(rows, dtype=np.int64) // rows_per_shared
        # Units each M tile reports to: runs of equal (M tile, unit) along the packed rows (both non-decreasing).
        starts = np.flatnonzero(np.r_[True, (np.diff(mtile) != 0) | (np.diff(unit) != 0)])
        pair_tile, pair_unit = mtile[starts], unit[starts]
        np.add.at(unit_expected, pair_unit, n_pieces[k])  # unit ids are 0..num_units-1 in tile order
        mt_count = node_mtiles[k]
        mt_ptr = np.searchsorted(pair_tile, np.arange(mt_count + 1))
        pieces = int(n_pieces[k])
        c = np.repeat(np.arange(pieces, dtype=np.int64), mt_count)
        mt = np.tile(np.arange(mt_count, dtype=np.int64), pieces)
        kv_lo, kv_hi = _piece_bounds(node.kv_start, node.kv_end, c, pieces, block_n_shared)
        it = np.zeros((pieces * mt_count, K.ITEM_FIELDS), dtype=np.int64)
        it[:, K.ITEM_KIND] = K.KIND_SHARED
        it[:, K.ITEM_REQ] = members[0]
        it[:, K.ITEM_KV_START] = kv_lo
        it[:, K.ITEM_KV_END] = kv_hi
        it[:, K.ITEM_ROW_START] = num_gather + c * rows + mt * rows_per_shared
        it[:, K.ITEM_NUM_ROWS] = np.minimum(rows_per_shared, rows - mt * rows_per_shared)
        it[:, K.ITEM_Q_POS] = node.kv_end
        it[:, K.ITEM_DEST] = -1
        it[:, K.ITEM_UNITS_START] = num_reports + c * pair_unit.shape[0] + mt_ptr[mt]
        it[:, K.ITEM_UNITS_END] = num_reports + c * pair_unit.shape[0] + mt_ptr[mt + 1]
        item_blocks.append(it)
        g = np.empty((pieces * rows, K.GATHER_FIELDS), dtype=np.int64)
        g[:, K.GATHER_TOKEN] = np.tile(tok, pieces)
        g[:, K.GATHER_WS_ROW] = np.tile(ws0, pieces) + np.repeat(np.arange(pieces), rows) * t_rows[np.tile(tile, pieces)]
        gather_blocks.append(g)
        report_blocks.append(np.tile(pair_unit, pieces))
        num_gather += pieces * rows
        num_reports += pieces * pair_unit.shape[0]

    # ---- suffix items: (suffix tile, split chunk) ------------------------------------------------------------
    s_tile = np.repeat(np.arange(num_tiles, dtype=np.int64), t_pieces)
    s_c = _ragged_arange(t_pieces)
    s_lo, s_hi = _piece_bounds(t_lo[s_tile], t_hi[s_tile], s_c, t_pieces[s_tile], block_n_suffix)
    s_unit = t_unit[s_tile]
    has_unit = s_unit >= 0
    it = np.zeros((s_tile.shape[0], K.ITEM_FIELDS), dtype=np.int64)
    it[:, K.ITEM_KIND] = K.KIND_SUFFIX
    it[:, K.ITEM_REQ] = t_req[s_tile]
    it[:, K.ITEM_KV_START] = s_lo
    it[:, K.ITEM_KV_END] = s_hi
    it[:, K.ITEM_ROW_START] = t_tok0[s_tile]
    it[:, K.ITEM_NUM_ROWS] = t_rows[s_tile]
    it[:, K.ITEM_Q_POS] = t_qpos[s_tile]
    it[:, K.ITEM_DEST] = np.where(has_unit, tile_ws_base[s_tile] + (t_shared[s_tile] + s_c) * t_rows[s_tile], -1)
    report_pos = num_reports + np.cumsum(has_unit) - has_unit
    it[:, K.ITEM_UNITS_START] = report_pos
    it[:, K.ITEM_UNITS_END] = report_pos + has_unit
    item_blocks.append(it)
    report_blocks.append(s_unit[has_unit])

    items = np.concatenate(item_blocks) if item_blocks else np.zeros((0, K.ITEM_FIELDS), dtype=np.int64)
    # Longest KV range first (LPT): the long programs start in the first wave, short ones fill the tail.
    order = np.argsort(-(items[:, K.ITEM_KV_END] - items[:, K.ITEM_KV_START]), kind="stable")
    items = items[order]

    units = np.zeros((num_units, K.UNIT_FIELDS), dtype=np.int64)
    units[:, K.UNIT_TOKEN_START] = t_tok0[unit_tiles]
    units[:, K.UNIT_NUM_ROWS] = t_rows[unit_tiles]
    units[:, K.UNIT_WS_BASE] = unit_ws_base
    units[:, K.UNIT_NUM_STATES] = t_states[unit_tiles]
    units[:, K.UNIT_EXPECTED] = unit_expected
    gather = np.concatenate(gather_blocks) if gather_blocks else np.zeros((0, K.GATHER_FIELDS), dtype=np.int64)
    reports = np.concatenate(report_blocks) if report_blocks else np.zeros(0, dtype=np.int64)
    return WorkList(items=items.astype(_I32), gather=gather.astype(_I32), item_units=reports.astype(_I32),
                    units=units.astype(_I32), num_ws_rows=num_ws_rows)
