"""Compiled (numba) work list: :func:`prefixattn.planner.work_list.build_work_list` as loops, the tables written
straight into their staging buffer (a workspace's host buffer when the step fits its capacities, else one new int32
buffer laid out as :func:`prefixattn.planner.device_tables.metadata_to_device` lays it out).

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)`` but the
stage's Python side at the end. The table layout (:mod:`prefixattn.kernels.layout`) comes in as an argument
(:func:`layout_args`), never as globals: numba's on-disk cache is keyed by this file alone and would keep a compiled
global after the layout changed. For the same reason what it compiles in from another file, the split rule's
:func:`cdiv` and the rows and entries of its packed results (``T_*``, ``N_*``, ``S_*``), comes with a pin:
:data:`SPLIT_SOURCE_HASH` (``tests/test_plan_compiled.py`` fails until it matches).
"""

from __future__ import annotations

import weakref

import numpy as np
from numba import njit

from prefixattn.kernels import layout as K
from prefixattn.planner.compiled.device_tables import table_fits, table_into_flat
from prefixattn.planner.compiled.split_rule import (N_PIECES, N_ROWS, S_END_DECODE, S_END_SHARED, S_GRAIN_CHUNK,
                                                    S_GRAIN_DECODE, S_GRAIN_SHARED, S_TILES, T_DECODE, T_FIRST, T_HI,
                                                    T_LO, T_PIECES, T_QPOS, T_REQ, T_ROWS, T_TOK0, cdiv)
from prefixattn.planner.work_list import WorkList

#: The first 16 hex digits of the sha256 of :mod:`prefixattn.planner.compiled.split_rule`'s file, whose ``cdiv`` and
#: packed rows and entries this file compiles in (module docstring).
SPLIT_SOURCE_HASH = "7876032bb90a33ca"


def layout_args() -> np.ndarray:
    """The kernel's table layout (:mod:`prefixattn.kernels.layout`) as an int64 array argument (module docstring)."""
    return np.array([K.ITEM_FIELDS, K.ITEM_KIND, K.ITEM_REQ, K.ITEM_KV_START, K.ITEM_KV_END, K.ITEM_ROW_START,
                     K.ITEM_NUM_ROWS, K.ITEM_Q_POS, K.ITEM_DEST, K.ITEM_MROW, K.KIND_SHARED, K.KIND_SUFFIX,
                     K.GATHER_FIELDS, K.GATHER_TOKEN, K.GATHER_WS_ROW, K.GATHER_MROW,
                     K.MROW_FIELDS, K.MROW_WS_FIRST, K.MROW_WS_STRIDE, K.MROW_NUM_STATES,
                     K.RANGE_FIELDS, K.RANGE_FIRST, K.RANGE_END, K.RANGES_SIZE, K.SECTION_ALIGN], dtype=np.int64)


@njit(cache=True, nogil=True)
def build_work_list(lay, kv_start, kv_end, offsets, members, q_start, q_len, tiles, node_split, scalars,
                    rows_per_shared, rows_per_chunk, extra, dest, dest_lay, runs):
    """``(flat, items, gather, mrows, num_ws_rows, num_units, in_dest)``: the chosen candidate's nodes and split
    (:mod:`prefixattn.planner.compiled.split_rule`'s ``split_work``: packed ``tiles``, ``node_split``, ``scalars``)
    as the kernel's tables, written straight into one int32 staging buffer: ``dest`` at ``dest_lay``'s offsets
    (``in_dest``) when given, ``extra`` is 0 (the workspace stages its table itself) and the step fits its
    capacities, else a new ``flat`` = ``[ranges, items, gather, mrows, extra entries]``. ``runs``: the requests'
    prefix runs (:func:`prefix_runs`)."""
    num_tiles = scalars[S_TILES]
    grain_sh, grain_ch, grain_de = scalars[S_GRAIN_SHARED], scalars[S_GRAIN_CHUNK], scalars[S_GRAIN_DECODE]
    class_ends = scalars[S_END_SHARED:S_END_DECODE + 1]
    node_rows, n_pieces = node_split[N_ROWS], node_split[N_PIECES]
    t_req, t_rows, t_first = tiles[T_REQ, :num_tiles], tiles[T_ROWS, :num_tiles], tiles[T_FIRST]
    t_pieces = tiles[T_PIECES, :num_tiles]
    # ---- states per request (shared ones numbered node by node, top-down) and merge units
    shared_states, slot_base, tile_ws_base, tile_mrow_base, num_units, num_ws_rows, num_mrows = _merge_units(
        offsets, members, n_pieces, t_req, t_rows, t_pieces, q_len.shape[0])
    num_gather = 0
    for k in range(node_rows.shape[0]):
        num_gather += n_pieces[k] * node_rows[k]
    in_dest = extra == 0 and dest_lay.shape[0] > 0 and _fits_dest(dest_lay, class_ends[2], num_gather, num_mrows,
                                                                   num_ws_rows, q_len)
    flat, items, gather, mrows = _table_views(dest, dest_lay, in_dest, lay, class_ends, num_gather, num_mrows, extra)
    _merge_rows(mrows, lay, t_req, t_rows, t_pieces, tile_ws_base, tile_mrow_base, shared_states)
    # ---- items: shared (node, piece, M tile), then suffix (tile, piece) of the chunk and the decode class; gather
    # rows of the shared ones
    _shared_items(items, gather, lay, kv_start, kv_end, offsets, members, q_start, q_len, t_first, t_rows,
                  tile_ws_base, tile_mrow_base, n_pieces, slot_base, grain_sh, rows_per_chunk, rows_per_shared)
    _suffix_items(items, lay, class_ends, tiles, num_tiles, t_pieces, tile_ws_base, tile_mrow_base, shared_states,
                  grain_ch, grain_de)
    _longest_first(items, lay[3], lay[4], lay[2], class_ends, runs)
    return flat, items, gather, mrows, num_ws_rows, num_units, in_dest


@njit(cache=True, nogil=True)
def _merge_units(offsets, members, n_pieces, t_req, t_rows, t_pieces, num_reqs):
    """Shared states per request and each membership's first slot (node by node, top-down), and the merge units:
    suffix tiles with more than one state, their workspace and merge-row bases (-1: no unit)."""
    num_nodes, num_tiles = n_pieces.shape[0], t_req.shape[0]
    shared_states = np.zeros(num_reqs, dtype=np.int64)
    slot_base = np.empty(members.shape[0], dtype=np.int64)
    for k in range(num_nodes):
        for m in range(offsets[k], offsets[k + 1]):
            slot_base[m] = shared_states[members[m]]
            shared_states[members[m]] += n_pieces[k]
    tile_ws_base = np.full(num_tiles, -1, dtype=np.int64)
    tile_mrow_base = np.full(num_tiles, -1, dtype=np.int64)
    num_units = num_ws_rows = num_mrows = 0
    for t in range(num_tiles):
        if shared_states[t_req[t]] > 0 or t_pieces[t] > 1:
            tile_ws_base[t], tile_mrow_base[t] = num_ws_rows, num_mrows
            num_ws_rows += (shared_states[t_req[t]] + t_pieces[t]) * t_rows[t]
            num_mrows += t_rows[t]
            num_units += 1
    return shared_states, slot_base, tile_ws_base, tile_mrow_base, num_units, num_ws_rows, num_mrows


@njit(cache=True, nogil=True)
def _merge_rows(mrows, lay, t_req, t_rows, t_pieces, tile_ws_base, tile_mrow_base, shared_states):
    """The merge-row table: one row per token of a merge unit, where its states start in the workspace, their stride
    and how many (the kernel merges when the last of them reports)."""
    m_first, m_stride, m_states = lay[17], lay[18], lay[19]
    for t in range(t_req.shape[0]):
        if tile_mrow_base[t] >= 0:
            for i in range(t_rows[t]):
                j = tile_mrow_base[t] + i
                mrows[j, m_first] = tile_ws_base[t] + i
                mrows[j, m_stride] = t_rows[t]
                mrows[j, m_states] = shared_states[t_req[t]] + t_pieces[t]


@njit(cache=True, nogil=True)
def _suffix_items(items, lay, class_ends, tiles, num_tiles, t_pieces, tile_ws_base, tile_mrow_base, shared_states,
                  grain_chunk, grain_decode):
    """Suffix items (tile, piece) into the chunk and decode sections of ``items`` (``class_ends``), tile order within
    each; a tile of a merge unit writes its workspace states, after its request's shared ones."""
    i_kind, i_req, i_kv0, i_kv1, i_row0, i_nrows, i_qpos, i_dest, i_mrow = (
        lay[1], lay[2], lay[3], lay[4], lay[5], lay[6], lay[7], lay[8], lay[9])
    kind_suffix = lay[11]
    it_chunk, it_decode = class_ends[0], class_ends[1]
    for t in range(num_tiles):
        unit = tile_mrow_base[t] >= 0
        decode = tiles[T_DECODE, t] != 0
        grain = grain_decode if decode else grain_chunk
        req, rows = tiles[T_REQ, t], tiles[T_ROWS, t]
        for c in range(t_pieces[t]):
            lo, hi = piece_bound(tiles[T_LO, t], tiles[T_HI, t], c, t_pieces[t], grain)
            if decode:
                it, it_decode = it_decode, it_decode + 1
            else:
                it, it_chunk = it_chunk, it_chunk + 1
            items[it, i_kind] = kind_suffix
            items[it, i_req] = req
            items[it, i_kv0] = lo
            items[it, i_kv1] = hi
            items[it, i_row0] = tiles[T_TOK0, t]
            items[it, i_nrows] = rows
            items[it, i_qpos] = tiles[T_QPOS, t]
            items[it, i_dest] = tile_ws_base[t] + (shared_states[req] + c) * rows if unit else -1
            items[it, i_mrow] = tile_mrow_base[t] if unit else -1


@njit(cache=True, nogil=True)
def _shared_items(items, gather, lay, kv_start, kv_end, offsets, members, q_start, q_len, t_first, t_rows,
                  tile_ws_base, tile_mrow_base, n_pieces, slot_base, grain, rows_per_suffix, rows_per_shared):
    """Shared items (node, piece, M tile) into ``items[:num_shared]`` and their gather rows
    (:func:`prefixattn.planner.work_list._shared_items`); returns the items written."""
    i_kind, i_req, i_kv0, i_kv1, i_row0, i_nrows, i_qpos, i_dest, i_mrow = (lay[1], lay[2], lay[3], lay[4], lay[5],
                                                                          lay[6], lay[7], lay[8], lay[9])
    kind_shared, g_tok, g_ws, g_mrow = lay[10], lay[13], lay[14], lay[15]
    g = 0
    it = 0
    for k in range(kv_start.shape[0]):
        node_rows = 0
        for m in range(offsets[k], offsets[k + 1]):
            node_rows += q_len[members[m]]
        for c in range(n_pieces[k]):
            seg_off = g
            for m in range(offsets[k], offsets[k + 1]):  # the node's packed rows, member by member
                r = members[m]
                tile, in_tile = t_first[r], 0  # row i of r is row i % rows_per_suffix of its tile (no division)
                for i in range(q_len[r]):
                    if in_tile == rows_per_suffix:
                        tile, in_tile = tile + 1, 0
                    gather[g, g_tok] = q_start[r] + i
                    gather[g, g_ws] = tile_ws_base[tile] + (slot_base[m] + c) * t_rows[tile] + in_tile
                    gather[g, g_mrow] = tile_mrow_base[tile] + in_tile
                    in_tile += 1
                    g += 1
            lo, hi = piece_bound(kv_start[k], kv_end[k], c, n_pieces[k], grain)
            for mt in range(cdiv(node_rows, rows_per_shared)):
                items[it, i_kind] = kind_shared
                items[it, i_req] = members[offsets[k]]  # any member: same blocks
                items[it, i_kv0] = lo
                items[it, i_kv1] = hi
                items[it, i_row0] = seg_off + mt * rows_per_shared
                items[it, i_nrows] = min(rows_per_shared, node_rows - mt * rows_per_shared)
                items[it, i_qpos] = kv_end[k]
                items[it, i_dest] = -1
                items[it, i_mrow] = -1
                it += 1
    return it


@njit(cache=True, nogil=True)
def piece_bound(lo, hi, c, pieces, grain):
    """``[start, end)`` of piece ``c`` (:func:`prefixattn.planner.work_list._piece_bounds`)."""
    if pieces == 1:
        return lo, hi
    tiles = cdiv(hi - lo, grain)
    return lo + (c * tiles // pieces) * grain, min(lo + ((c + 1) * tiles // pieces) * grain, hi)


#: Entries of :func:`work_list`'s ``dest_lay``: offsets of the class ranges and of the item, gather and merge-row
#: tables in ``dest`` (int32 elements), then the capacities the step must fit to be written there (all of them but
#: the table's width: a step written there is never refused afterwards for them).
(D_RANGES, D_ITEMS, D_GATHER, D_MROWS, D_MAX_ITEMS, D_MAX_GATHER, D_MAX_MROWS, D_MAX_WS_ROWS, D_MAX_TOKENS,
 D_MAX_REQUESTS, NUM_DEST_FIELDS) = range(11)


@njit(cache=True, nogil=True)
def _fits_dest(dest_lay, n_items, num_gather, num_mrows, num_ws_rows, q_len):
    num_tokens = 0
    for r in range(q_len.shape[0]):
        num_tokens += q_len[r]
    return (n_items <= dest_lay[D_MAX_ITEMS] and num_gather <= dest_lay[D_MAX_GATHER]
            and num_mrows <= dest_lay[D_MAX_MROWS] and num_ws_rows <= dest_lay[D_MAX_WS_ROWS]
            and num_tokens <= dest_lay[D_MAX_TOKENS] and q_len.shape[0] <= dest_lay[D_MAX_REQUESTS])


@njit(cache=True, nogil=True)
def _table_views(dest, dest_lay, in_dest, lay, class_ends, num_gather, num_mrows, extra):
    """``(flat, items, gather, mrows)``: the class ranges written and the tables as views of ``dest`` at
    ``dest_lay``'s sections (``in_dest``; ``flat`` empty), else of a new ``flat`` = ``[ranges, items, gather, mrows,
    extra entries]``."""
    item_fields, gather_fields, mrow_fields = lay[0], lay[12], lay[16]
    range_fields, r_first, r_end, ranges_size = lay[20], lay[21], lay[22], lay[23]
    n_items = class_ends[class_ends.shape[0] - 1]
    if in_dest:
        buf, flat = dest, dest[:0]
        s_ranges, s_items, s_gather, s_mrows = (dest_lay[D_RANGES], dest_lay[D_ITEMS], dest_lay[D_GATHER],
                                                dest_lay[D_MROWS])
    else:  # sections at multiples of lay[24] entries (K.SECTION_ALIGN), the padding zeroed
        align = lay[24]
        s_ranges, s_items = 0, ranges_size
        s_gather = cdiv(s_items + n_items * item_fields, align) * align
        s_mrows = cdiv(s_gather + num_gather * gather_fields, align) * align
        end = cdiv(s_mrows + num_mrows * mrow_fields, align) * align
        buf = flat = np.empty(end + extra, dtype=np.int32)
        buf[s_items + n_items * item_fields:s_gather] = 0
        buf[s_gather + num_gather * gather_fields:s_mrows] = 0
        buf[s_mrows + num_mrows * mrow_fields:end] = 0
    first = 0
    for c in range(class_ends.shape[0]):
        rec = s_ranges + c * range_fields
        for f in range(range_fields):
            buf[rec + f] = 0
        buf[rec + r_first] = first
        buf[rec + r_end] = class_ends[c]
        first = class_ends[c]
    items = buf[s_items:s_items + n_items * item_fields].reshape(n_items, item_fields)
    gather = buf[s_gather:s_gather + num_gather * gather_fields].reshape(num_gather, gather_fields)
    mrows = buf[s_mrows:s_mrows + num_mrows * mrow_fields].reshape(num_mrows, mrow_fields)
    return flat, items, gather, mrows


#: A run of items takes a counting sort when its lengths span at most 2 values per item plus this many (the counts
#: cost a pass over the span): a decode step's suffix items, whose lengths lie within a block of each other.
_COUNT_SPAN_SLACK = 64


@njit(cache=True, nogil=True)
def _sorted_run(length, lo, hi, out):
    """``out[lo:hi]``: the indices ``lo .. hi - 1`` by ``length``, longest first, stable. A counting sort when the
    lengths span few values, else one sort of int64 keys ``(-length) << 32 | index`` (lengths in ``[0, 2^31)``, fewer
    than 2^32 items: unique keys, so the unstable sort gives the stable order)."""
    if hi <= lo:
        return
    top = bottom = length[lo]
    for i in range(lo, hi):
        top, bottom = max(top, length[i]), min(bottom, length[i])
    span = top - bottom
    if span <= 2 * (hi - lo) + _COUNT_SPAN_SLACK:
        first = np.zeros(span + 2, dtype=np.int64)  # first[d]: where the items of length top - d start
        for i in range(lo, hi):
            first[top - length[i] + 1] += 1
        for d in range(span + 1):
            first[d + 1] += first[d]
        for i in range(lo, hi):
            d = top - length[i]
            out[lo + first[d]] = i
            first[d] += 1
        return
    key = np.empty(hi - lo, dtype=np.int64)
    for i in range(lo, hi):
        key[i - lo] = (-length[i] << 32) | i
    key.sort()
    for j in range(hi - lo):
        out[lo + j] = key[j] & 0xFFFFFFFF


@njit(cache=True, nogil=True)
def _longest_first(items, i_kv0, i_kv1, i_req, class_ends, runs):
    """Items by KV length, longest first, stable (LPT), within each work class (``class_ends``: one past each
    class's last item), in place; a prefix run's items together (:func:`_run_major`, in a class holding a run of
    >= 2 requests); a class already in order is left untouched (a decode step's equal lengths). Each class is
    sorted by :func:`_sorted_run` (272 items of a staggered decode step under a 2,048-token prefix, lengths 2,048
    and 296-311: ~2 us; a stable argsort took ~9 us)."""
    n = items.shape[0]
    length = np.empty(n, dtype=np.int64)
    for i in range(n):
        length[i] = np.int64(items[i, i_kv1]) - items[i, i_kv0]
    num_reqs = runs.shape[0]
    run_size = np.zeros(num_reqs, dtype=np.int64)
    for r in range(num_reqs):
        run_size[runs[r]] += 1
    order = np.empty(n, dtype=np.int64)
    lo = 0
    for c in range(class_ends.shape[0]):
        hi = class_ends[c]
        grouped = False
        if c > 0:  # the suffix classes (a shared item reads its node once: in no run)
            for i in range(lo, hi):
                if run_size[runs[items[i, i_req]]] > 1:
                    grouped = True
                    break
        ordered = not grouped
        if ordered:
            for i in range(lo + 1, hi):
                if length[i] > length[i - 1]:
                    ordered = False
                    break
        if not ordered:
            _sorted_run(length, lo, hi, order)
            if grouped:
                _run_major(items, i_req, length, runs, run_size, lo, hi, order)
            copy = items[lo:hi].copy()
            for i in range(lo, hi):
                j = order[i] - lo
                for f in range(items.shape[1]):  # element loop: a row-slice assignment per item cost ~2x
                    items[i, f] = copy[j, f]
        lo = hi


@njit(cache=True, nogil=True)
def _run_major(items, i_req, length, runs, run_size, lo, hi, order):
    """``order[lo:hi]`` (longest first, stable) regrouped: the items of a run of >= 2 requests (``run_size``) one
    group, every other item one of its own; each group at the place of its longest item, groups of equal longest
    by id (the run's first request, else the number of requests + the item's index), the LPT order inside a group
    (:func:`prefixattn.ragged.runs_longest_first`): a counting sort over the groups' ranks."""
    num_reqs = runs.shape[0]
    group = np.empty(hi - lo, dtype=np.int64)
    for i in range(lo, hi):
        g = runs[items[i, i_req]]
        group[i - lo] = g if run_size[g] > 1 else num_reqs + i
    longest = np.full(num_reqs + hi, -1, dtype=np.int64)
    for i in range(lo, hi):
        longest[group[i - lo]] = max(longest[group[i - lo]], length[i])
    keys = np.empty(hi - lo, dtype=np.int64)
    num_groups = 0
    for i in range(lo, hi):
        g = group[i - lo]
        if longest[g] >= 0:  # the group's first item: its key, once
            keys[num_groups] = (-longest[g] << 32) | g
            longest[g] = -1
            num_groups += 1
    keys = np.sort(keys[:num_groups])
    rank = np.empty(num_reqs + hi, dtype=np.int64)  # read only at this class's groups, all set here
    for k in range(num_groups):
        rank[keys[k] & 0xFFFFFFFF] = k
    count = np.zeros(num_groups + 1, dtype=np.int64)
    for i in range(lo, hi):
        count[rank[group[i - lo]] + 1] += 1
    for k in range(num_groups):
        count[k + 1] += count[k]
    lpt = order[lo:hi].copy()
    for j in range(hi - lo):
        k = rank[group[lpt[j] - lo]]
        order[lo + count[k]] = lpt[j]
        count[k] += 1


@njit(cache=True, nogil=True)
def prefix_runs(table, kv_len, members, block_size):
    """:func:`prefixattn.planner.work_list.prefix_runs`, as one loop."""
    n = kv_len.shape[0]
    run = np.empty(n, dtype=np.int64)
    alone = np.zeros(n, dtype=np.bool_)
    for m in members:
        alone[m] = True
    previous = 0
    for r in range(n):
        blocks = (np.int64(kv_len[r]) + block_size - 1) // block_size
        run[r] = r
        shorter = min(blocks, previous)
        if r > 0 and shorter > 0 and not alone[r] and not alone[r - 1]:
            col = (shorter - 1) // 2
            if table[r, col] == table[r - 1, col]:
                run[r] = run[r - 1]
        previous = blocks
    return run


# ---- the stage's Python side

#: The kernel's table layout as :func:`build_work_list` takes it.
LAYOUT = layout_args()
_NO_DEST = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64))
#: ``dest_lay`` per workspace (weak keys: a dropped wrapper's buffers are freed), and the last one read (a weak
#: reference and its layout: one call where the dictionary's lookup cost ~1.5 us a step).
_dest_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_last_dest = [lambda: None, None]


def work_list(nodes, split, inputs, o, tiles, *, workspace, width: int) -> tuple[WorkList, object, bool]:
    """The work-list stage: ``(work list, staged, written)``. With ``workspace`` (``width`` 0: it stages its table
    itself) the tables go straight into its host buffer when the step fits its capacities (``written``); else into
    one new int32 buffer with the block table's first ``width`` columns after them when its ids fit int32
    (``staged``: the buffer and whether the table is in it, as
    :func:`prefixattn.planner.device_tables.metadata_to_device` reads it)."""
    table = inputs.table
    rows, cols = table.shape[0], min(width, table.shape[1])
    dest, dest_lay = _dest_args(workspace)
    packed, node_split, scalars = split.packed
    tile_rows = tiles.tile_rows(o.group)
    fits = bool(width) and table_fits(table, cols)
    flat, items, gather, mrows, num_ws_rows, num_units, in_dest = build_work_list(
        LAYOUT, nodes.kv_start, nodes.kv_end, nodes.offsets, nodes.members, inputs.indptr[:-1], inputs.q_len,
        packed, node_split, scalars, tile_rows.rows_per_shared_tile, tile_rows.rows_per_chunk_tile,
        rows * width if fits else 0, dest, dest_lay, prefix_runs(table, inputs.lens, nodes.members, o.block_size))
    if fits:
        table_into_flat(flat, table, width)
    work = WorkList(items=items, gather=gather, mrows=mrows, num_ws_rows=num_ws_rows, num_units=num_units,
                    class_ends=split.class_ends, modeled_us=split.modeled)
    return work, (None if in_dest else (flat, fits)), in_dest


def _dest_args(workspace) -> tuple:
    """``(dest, dest_lay)`` of :func:`build_work_list`: ``workspace``'s host buffer and its sections and capacities
    (``D_*``); empty arrays without a workspace."""
    if workspace is None:
        return _NO_DEST
    ref, lay = _last_dest
    if ref() is workspace:
        return workspace.host_buffer(), lay
    lay = _dest_layouts.get(workspace)
    if lay is None:
        c, lay = workspace.capacity, np.empty(NUM_DEST_FIELDS, dtype=np.int64)
        for index, name in ((D_RANGES, "ranges"), (D_ITEMS, "items"), (D_GATHER, "gather"), (D_MROWS, "mrows")):
            lay[index] = workspace.section_start(name)
        # The capacities PlanWorkspace.overflow checks but the table's width (a step over it is refused after the
        # write: PlanWorkspace.refused_after_writing).
        lay[D_MAX_ITEMS], lay[D_MAX_GATHER] = c.max_items, c.max_gather_rows
        lay[D_MAX_MROWS], lay[D_MAX_WS_ROWS] = c.max_merge_rows, c.max_ws_rows
        lay[D_MAX_TOKENS], lay[D_MAX_REQUESTS] = c.max_tokens, c.max_requests
        _dest_layouts[workspace] = lay
    _last_dest[:] = [weakref.ref(workspace), lay]
    return workspace.host_buffer(), lay
