"""Compiled (numba) node selection and work list: one call from the tree to the kernel's tables.

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)``. Each function
computes what its numpy counterpart does, as loops instead of vectorized passes; the numpy code is the definition:

* :func:`select_nodes`: :func:`prefixattn.planner.node_choice.select_shared_nodes` (the cost rules are not restated:
  :mod:`prefixattn.planner.cost_rule`'s functions themselves, compiled);
* the split rule, per work class: :mod:`prefixattn.planner.compiled_split`
  (:func:`prefixattn.planner.split_rule.split_ranges`);
* :func:`work_list`: :func:`prefixattn.planner.work_list.build_work_list` (suffix tiles, merge units, gather rows, LPT
  order);
* :func:`plan_core`: the three in one call, plus the modeled launch times of ``Plan.stats``.

Not compiled (plan() runs the numpy path for them, :mod:`prefixattn.planner.compiled`): ``window_left >= 0``
(:mod:`prefixattn.planner.window` between the node choice and the work list).

Constants of other modules (table layout, split rule) come in as arguments, never as globals: numba's on-disk cache
is keyed by this file's own source, so a global from another module would stay compiled in after it changed. For the
same reason a compiled function of another file is called only where that file is pinned here by its source hash:
the cost rule (compiled from its numpy definition, :data:`COST_RULE_SOURCE_HASH`) and the compiled split rule
(:data:`SPLIT_SOURCE_HASH`); :mod:`~prefixattn.planner.compiled_tree` and this module never call each other.
``tests/test_plan_native.py`` checks that both paths give equal Plan fields.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from numba import njit

from prefixattn.kernels import layout as K
from prefixattn.planner import cost_rule
from prefixattn.planner.compiled_split import cdiv, piece_bound, split_ranges

#: The first 16 hex digits of the sha256 of :mod:`prefixattn.planner.cost_rule`'s file, which :func:`select_nodes`
#: compiles in (its function and constants): numba's on-disk cache keys this file's functions on this file alone, so
#: a change to the rule must change this file too, or a cached ``select_nodes`` would keep the old rule.
#: ``tests/test_cost_rule.py`` fails until this matches.
COST_RULE_SOURCE_HASH = "3192b78a9d5c186f"
#: The first 16 hex digits of the sha256 of :mod:`prefixattn.planner.compiled_split`'s file, whose functions
#: :func:`work_list` compiles in (same reason as above). ``tests/test_split_rule.py`` fails until this matches.
SPLIT_SOURCE_HASH = "3b99352d8035ad73"


def source_hash(module) -> str:
    """What the pins above hold for ``module``: the first 16 hex digits of the sha256 of its file (line endings
    normalized). The tests compare each pin with it."""
    return hashlib.sha256(Path(module.__file__).read_bytes().replace(b"\r\n", b"\n")).hexdigest()[:16]


#: :func:`prefixattn.planner.cost_rule.sharing_pays_off`, compiled: the rule's one definition, called per node.
_sharing_pays_off = njit(nogil=True)(cost_rule.sharing_pays_off)
#: :func:`prefixattn.planner.cost_rule.request_sharing_pays_off` and its ``unshared_reads``, compiled, called per
#: request.
_request_sharing_pays_off = njit(nogil=True)(cost_rule.request_sharing_pays_off)
_unshared_reads = njit(nogil=True)(cost_rule.unshared_reads)

#: ``sharing`` modes as the compiled code takes them (:mod:`prefixattn.planner.options`' ``_SHARING_MODES`` order,
#: then its ``SHARING_APART``).
SHARING_AUTO, SHARING_ALWAYS, SHARING_NEVER, SHARING_APART = 0, 1, 2, 3


def layout_args() -> np.ndarray:
    """The kernel's table layout (:mod:`prefixattn.kernels.layout`) as an int64 array argument, never a global: numba's
    on-disk cache is keyed by this file alone and would keep a compiled global after the layout changed."""
    return np.array([K.ITEM_FIELDS, K.ITEM_KIND, K.ITEM_REQ, K.ITEM_KV_START, K.ITEM_KV_END, K.ITEM_ROW_START,
            K.ITEM_NUM_ROWS, K.ITEM_Q_POS, K.ITEM_DEST, K.ITEM_MROW, K.KIND_SHARED, K.KIND_SUFFIX,
            K.GATHER_FIELDS, K.GATHER_TOKEN, K.GATHER_WS_ROW, K.GATHER_MROW,
            K.MROW_FIELDS, K.MROW_WS_FIRST, K.MROW_WS_STRIDE, K.MROW_NUM_STATES,
            K.RANGE_FIELDS, K.RANGE_FIRST, K.RANGE_END, K.RANGES_SIZE, K.SECTION_ALIGN], dtype=np.int64)


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
            ok = _sharing_pays_off(size[k], rows, cdiv(rows, rows_per_shared), tokens, group, head_dim, elt_bytes,
                                   extra)
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


@njit(cache=True, nogil=True)
def _suffix_tiles(q_start, q_len, kv_len, suffix_start, causal, rows_per_suffix):
    """Suffix tiles (:func:`prefixattn.planner.work_list._suffix_tiles`): ``(req, first, rows, tok0, lo, hi, qpos)``."""
    num_reqs = q_len.shape[0]
    first = np.empty(num_reqs, dtype=np.int64)
    n = 0
    for r in range(num_reqs):
        first[r] = n
        n += cdiv(q_len[r], rows_per_suffix)
    req = np.empty(n, dtype=np.int64)
    rows = np.empty(n, dtype=np.int64)
    tok0 = np.empty(n, dtype=np.int64)
    lo = np.empty(n, dtype=np.int64)
    hi = np.empty(n, dtype=np.int64)
    qpos = np.empty(n, dtype=np.int64)
    t = 0
    for r in range(num_reqs):
        row0 = 0
        while row0 < q_len[r]:
            req[t], rows[t], tok0[t], lo[t] = r, min(rows_per_suffix, q_len[r] - row0), q_start[r] + row0, \
                suffix_start[r]
            if causal:
                qpos[t] = kv_len[r] - q_len[r] + row0
                hi[t] = qpos[t] + rows[t]
            else:  # every row sees the whole range
                qpos[t] = hi[t] = kv_len[r]
            row0 += rows_per_suffix
            t += 1
    return req, first, rows, tok0, lo, hi, qpos


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


#: Entries of :func:`plan_core`'s ``dest_lay``: offsets of the class ranges and of the item, gather and merge-row
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


@njit(cache=True, nogil=True)
def _unsplit_work(kv_start, kv_end, offsets, members, q_len, t_req, t_lo, t_hi, rows_per_shared, rows_per_decode):
    """What the split rule prices, before any split: ``(node_rows, node_len, node_m, tile_len, t_decode)``, each
    node's packed rows, KV length and M tiles, and each suffix tile's KV length and class (decode or chunk)."""
    num_nodes, num_tiles = kv_start.shape[0], t_req.shape[0]
    node_rows = np.zeros(num_nodes, dtype=np.int64)
    node_len = np.empty(num_nodes, dtype=np.int64)
    node_m = np.empty(num_nodes, dtype=np.int64)
    for k in range(num_nodes):
        for m in range(offsets[k], offsets[k + 1]):
            node_rows[k] += q_len[members[m]]
        node_len[k] = kv_end[k] - kv_start[k]
        node_m[k] = cdiv(node_rows[k], rows_per_shared)
    tile_len = np.empty(num_tiles, dtype=np.int64)
    t_decode = np.empty(num_tiles, dtype=np.bool_)
    for t in range(num_tiles):
        tile_len[t] = max(t_hi[t] - t_lo[t], 0)
        t_decode[t] = q_len[t_req[t]] <= rows_per_decode
    return node_rows, node_len, node_m, tile_len, t_decode


@njit(cache=True, nogil=True)
def _class_ends(node_rows, n_pieces, t_decode, t_pieces, rows_per_shared):
    """``(class_ends, num_gather)``: one past each work class's last item (shared, chunk, decode: the item table's
    sections) and the gather rows of the shared items, counted before any table is written."""
    num_shared = num_gather = num_chunk = num_decode = 0
    for k in range(node_rows.shape[0]):
        num_shared += n_pieces[k] * cdiv(node_rows[k], rows_per_shared)
        num_gather += n_pieces[k] * node_rows[k]
    for t in range(t_decode.shape[0]):
        if t_decode[t]:
            num_decode += t_pieces[t]
        else:
            num_chunk += t_pieces[t]
    class_ends = np.empty(3, dtype=np.int64)
    class_ends[0], class_ends[1] = num_shared, num_shared + num_chunk
    class_ends[2] = num_shared + num_chunk + num_decode
    return class_ends, num_gather


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
def _suffix_items(items, lay, class_ends, t_req, t_rows, t_tok0, t_lo, t_hi, t_qpos, t_decode, t_pieces, tile_ws_base,
                  tile_mrow_base, shared_states, grain_chunk, grain_decode):
    """Suffix items (tile, piece) into the chunk and decode sections of ``items`` (``class_ends``), tile order within
    each; a tile of a merge unit writes its workspace states, after its request's shared ones."""
    i_kind, i_req, i_kv0, i_kv1, i_row0, i_nrows, i_qpos, i_dest, i_mrow = (
        lay[1], lay[2], lay[3], lay[4], lay[5], lay[6], lay[7], lay[8], lay[9])
    kind_suffix = lay[11]
    it_chunk, it_decode = class_ends[0], class_ends[1]
    for t in range(t_req.shape[0]):
        unit = tile_mrow_base[t] >= 0
        grain = grain_decode if t_decode[t] else grain_chunk
        for c in range(t_pieces[t]):
            lo, hi = piece_bound(t_lo[t], t_hi[t], c, t_pieces[t], grain)
            if t_decode[t]:
                it, it_decode = it_decode, it_decode + 1
            else:
                it, it_chunk = it_chunk, it_chunk + 1
            items[it, i_kind] = kind_suffix
            items[it, i_req] = t_req[t]
            items[it, i_kv0] = lo
            items[it, i_kv1] = hi
            items[it, i_row0] = t_tok0[t]
            items[it, i_nrows] = t_rows[t]
            items[it, i_qpos] = t_qpos[t]
            items[it, i_dest] = tile_ws_base[t] + (shared_states[t_req[t]] + c) * t_rows[t] if unit else -1
            items[it, i_mrow] = tile_mrow_base[t] if unit else -1


@njit(cache=True, nogil=True)
def work_list(lay, rule, costs, kv_start, kv_end, offsets, members, suffix_start, q_start, q_len, kv_len, causal,
              rows_per_shared, rows_per_chunk, rows_per_decode, block_n_shared, block_n_chunk, block_n_decode,
              num_kv_heads, num_sms, min_split_tokens, extra, dest, dest_lay):
    """``(flat, items, gather, mrows, num_ws_rows, num_units, class_ends, modeled, in_dest)``:
    :func:`prefixattn.planner.work_list.build_work_list` (``modeled``: ``[NUM_CLASSES, 2]`` modeled makespan and ideal
    microseconds of each class's launch, :func:`~prefixattn.planner.compiled_split.class_split`), the tables written
    straight into one int32 staging buffer: ``dest`` at ``dest_lay``'s offsets (``in_dest``) when given, ``extra`` is 0
    (the workspace stages its table itself) and the step fits its capacities, else a new ``flat`` = ``[ranges, items,
    gather, mrows, extra entries]`` (:func:`prefixattn.planner.device_tables.metadata_to_device`'s layout)."""
    t_req, t_first, t_rows, t_tok0, t_lo, t_hi, t_qpos = _suffix_tiles(q_start, q_len, kv_len, suffix_start, causal,
                                                                        rows_per_chunk)
    # ---- split rule over the unsplit work, one work class at a time
    node_rows, node_len, node_m, tile_len, t_decode = _unsplit_work(kv_start, kv_end, offsets, members, q_len, t_req,
                                                                    t_lo, t_hi, rows_per_shared, rows_per_decode)
    n_pieces, grain_sh, t_pieces, grain_ch, grain_de, modeled = split_ranges(
        node_len, node_m, tile_len, t_decode, block_n_shared, block_n_chunk, block_n_decode, num_kv_heads, num_sms,
        min_split_tokens, costs, rule)
    # ---- states per request (shared ones numbered node by node, top-down) and merge units
    shared_states, slot_base, tile_ws_base, tile_mrow_base, num_units, num_ws_rows, num_mrows = _merge_units(
        offsets, members, n_pieces, t_req, t_rows, t_pieces, q_len.shape[0])
    class_ends, num_gather = _class_ends(node_rows, n_pieces, t_decode, t_pieces, rows_per_shared)
    # dest: a workspace's buffer, which stages its table itself (extra == 0)
    in_dest = extra == 0 and dest_lay.shape[0] > 0 and _fits_dest(dest_lay, class_ends[2], num_gather, num_mrows,
                                                                   num_ws_rows, q_len)
    flat, items, gather, mrows = _table_views(dest, dest_lay, in_dest, lay, class_ends, num_gather, num_mrows, extra)
    _merge_rows(mrows, lay, t_req, t_rows, t_pieces, tile_ws_base, tile_mrow_base, shared_states)
    # ---- items: shared (node, piece, M tile), then suffix (tile, piece) of the chunk and the decode class; gather
    # rows of the shared ones
    _shared_items(items, gather, lay, kv_start, kv_end, offsets, members, q_start, q_len, t_first, t_rows,
                  tile_ws_base, tile_mrow_base, n_pieces, slot_base, grain_sh, rows_per_chunk, rows_per_shared)
    _suffix_items(items, lay, class_ends, t_req, t_rows, t_tok0, t_lo, t_hi, t_qpos, t_decode, t_pieces, tile_ws_base,
                  tile_mrow_base, shared_states, grain_ch, grain_de)
    _longest_first(items, lay[3], lay[4], class_ends)
    return flat, items, gather, mrows, num_ws_rows, num_units, class_ends, modeled, in_dest


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
def _longest_first(items, i_kv0, i_kv1, class_ends):
    """Items by KV length, longest first, stable (LPT), within each work class (``class_ends``: one past each
    class's last item), in place; a class already in that order is left untouched (a decode step's equal lengths).
    Each class is sorted by :func:`_sorted_run` (272 items of a staggered decode step under a 2,048-token prefix,
    lengths 2,048 and 296-311: ~2 us; a stable argsort took ~9 us)."""
    n = items.shape[0]
    length = np.empty(n, dtype=np.int64)
    for i in range(n):
        length[i] = np.int64(items[i, i_kv1]) - items[i, i_kv0]
    run = np.empty(n, dtype=np.int64)
    lo = 0
    for c in range(class_ends.shape[0]):
        hi = class_ends[c]
        ordered = True
        for i in range(lo + 1, hi):
            if length[i] > length[i - 1]:
                ordered = False
                break
        if not ordered:
            _sorted_run(length, lo, hi, run)
            copy = items[lo:hi].copy()
            for i in range(lo, hi):
                j = run[i] - lo
                for f in range(items.shape[1]):  # element loop: a row-slice assignment per item cost ~2x
                    items[i, f] = copy[j, f]
        lo = hi


#: Entries of the ``params`` argument of :func:`plan_core` (one int64 array: one argument for numba to type-check).
(P_CAUSAL, P_SHARING, P_BLOCK_SIZE, P_GROUP, P_HEAD_DIM, P_ELT_BYTES, P_ROWS_SHARED, P_ROWS_CHUNK, P_ROWS_DECODE,
 P_BLOCK_N_SHARED, P_BLOCK_N_CHUNK, P_BLOCK_N_DECODE, P_KV_HEADS, P_SMS, P_MIN_SPLIT,
 NUM_PARAMS) = range(16)
_INT32_MAX = 2 ** 31 - 1


@njit(cache=True, nogil=True)
def _table_fits(table, cols):
    """Every entry of ``table[:, :cols]`` fits int32 (int32 tables: no scan)."""
    if table.itemsize == 4 or cols == 0:
        return True
    for r in range(table.shape[0]):
        row = table[r, :cols]
        hi = row[0]
        for k in range(row.shape[0]):
            hi = max(hi, row[k])
        if hi > _INT32_MAX:
            return False
    return True


@njit(cache=True, nogil=True)
def plan_core(lay, rule, costs, params, width, order, depth, lb, rb, parent, indptr, q_len, kv_len, shareable, table,
              dest, dest_lay):
    """The planner from the tree to the staging buffer, in one call.

    ``lay``: :func:`layout_args`, ``rule``: :func:`~prefixattn.planner.compiled_split.rule_args`, ``costs``:
    :func:`~prefixattn.planner.compiled.cost_args`, ``params``: int64 ``[NUM_PARAMS]`` (``P_*``), ``width``:
    block-table columns to stage (the batch reads them; 0: none); ``dest``, ``dest_lay``: a workspace's int32 host
    buffer and its layout (``D_*``; empty: none), which gets the tables when they fit. Returns ``(kv_start, kv_end,
    depth_blocks, offsets, members, flat, items, gather, mrows, table_fits, num_ws_rows, num_units, class_ends,
    modeled, in_dest)``; ``flat`` holds the block table's used columns
    after the tables when ``table_fits`` (and the tables unless ``in_dest``).
    """
    kv_start, kv_end, depth_blocks, offsets, members, suffix_start = select_nodes(
        order, depth, lb, rb, parent, shareable, q_len, params[P_BLOCK_SIZE], params[P_ROWS_SHARED],
        params[P_GROUP], params[P_HEAD_DIM], params[P_ELT_BYTES], params[P_SHARING],
        params[P_ROWS_CHUNK], params[P_ROWS_DECODE])
    rows = table.shape[0]
    cols = min(width, table.shape[1])
    fits = _table_fits(table, cols)
    flat, items, gather, mrows, num_ws_rows, num_units, class_ends, modeled, in_dest = work_list(
        lay, rule, costs, kv_start, kv_end, offsets, members, suffix_start, indptr[:-1], q_len, kv_len,
        params[P_CAUSAL] != 0, params[P_ROWS_SHARED], params[P_ROWS_CHUNK], params[P_ROWS_DECODE],
        params[P_BLOCK_N_SHARED], params[P_BLOCK_N_CHUNK], params[P_BLOCK_N_DECODE], params[P_KV_HEADS],
        params[P_SMS], params[P_MIN_SPLIT], rows * width if fits else 0, dest, dest_lay)
    if fits:
        base = flat.shape[0] - rows * width if rows * width else 0
        for r in range(rows):
            dst = flat[base + r * width:base + (r + 1) * width]
            src = table[r, :cols]
            for k in range(cols):
                dst[k] = src[k]
            for k in range(cols, width):
                dst[k] = 0
    return (kv_start, kv_end, depth_blocks, offsets, members, flat, items, gather, mrows, fits, num_ws_rows,
            num_units, class_ends, modeled, in_dest)
