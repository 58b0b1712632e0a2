"""Compiled (numba) node selection, split rule and work list: one call from the tree to the kernel's tables.

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)``. Each function
computes what its numpy counterpart does, as loops instead of vectorized passes; the numpy code is the definition:

* :func:`select_nodes`: :func:`prefixattn.planner.node_choice.select_shared_nodes` (the cost rule is not restated:
  :func:`prefixattn.planner.cost_rule.sharing_pays_off` itself, compiled);
* :func:`_class_split`: :func:`prefixattn.planner.split_rule.class_split` (piece budget, grains, pieces, the wave-aware
  step and its modeled makespan);
* :func:`work_list`: :func:`prefixattn.planner.work_list.build_work_list` (suffix tiles, merge units, gather rows, LPT
  order);
* :func:`plan_core`: the three in one call, plus the modeled launch times of ``Plan.stats``.

Not compiled (plan() runs the numpy path for them, :mod:`prefixattn.planner.compiled`): ``window_left >= 0``
(:mod:`prefixattn.planner.window` between the node choice and the work list).

Constants of other modules (table layout, split rule) come in as arguments, never as globals: numba's on-disk cache
is keyed by this file's own source, so a global from another module would stay compiled in after it changed. For the
same reason the three compiled modules never call each other. The one exception, the cost rule, is compiled from its
numpy definition and pinned by :data:`COST_RULE_SOURCE_HASH`. ``tests/test_plan_native.py`` checks that
both paths give equal Plan fields.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prefixattn.kernels import layout as K
from prefixattn.planner import cost_rule, split_rule as S

#: The first 16 hex digits of the sha256 of :mod:`prefixattn.planner.cost_rule`'s file, which :func:`select_nodes`
#: compiles in (its function and constants): numba's on-disk cache keys this file's functions on this file alone, so
#: a change to the rule must change this file too, or a cached ``select_nodes`` would keep the old rule.
#: ``tests/test_cost_rule.py`` fails until this matches.
COST_RULE_SOURCE_HASH = "12393037dbf5207a"
#: :func:`prefixattn.planner.cost_rule.sharing_pays_off`, compiled: the rule's one definition, called per node.
_sharing_pays_off = njit(nogil=True)(cost_rule.sharing_pays_off)

#: ``sharing`` modes as the compiled code takes them (:mod:`prefixattn.planner.options`' ``_SHARING_MODES`` order).
SHARING_AUTO, SHARING_ALWAYS, SHARING_NEVER = 0, 1, 2


def layout_args() -> np.ndarray:
    """The kernel's table layout (:mod:`prefixattn.kernels.layout`) as an int64 array argument, never a global: numba's
    on-disk cache is keyed by this file alone and would keep a compiled global after the layout changed."""
    return np.array([K.ITEM_FIELDS, K.ITEM_KIND, K.ITEM_REQ, K.ITEM_KV_START, K.ITEM_KV_END, K.ITEM_ROW_START,
            K.ITEM_NUM_ROWS, K.ITEM_Q_POS, K.ITEM_DEST, K.ITEM_MROW, K.KIND_SHARED, K.KIND_SUFFIX,
            K.GATHER_FIELDS, K.GATHER_TOKEN, K.GATHER_WS_ROW, K.GATHER_MROW,
            K.MROW_FIELDS, K.MROW_WS_FIRST, K.MROW_WS_STRIDE, K.MROW_NUM_STATES,
            K.RANGE_FIELDS, K.RANGE_FIRST, K.RANGE_END, K.RANGES_SIZE], dtype=np.int64)


def rule_args() -> np.ndarray:
    """The split rule's constants (``R_*`` order) as a float64 array argument (same reason as :func:`layout_args`)."""
    return np.array([S.SPLIT_TOLERANCE, S.CRITICAL_PATH_TARGET, S.MIN_PIECE_OVERHEADS, S.WAVE_CANDIDATES,
                     S.LONG_PROGRAM_FRACTION, S.WAVE_GAIN_MIN, S.WAVE_EXTRA_ITEMS_PER_SM], dtype=np.float64)



@njit(cache=True, nogil=True)
def _cdiv(a, b):
    """``ceil(a / b)`` for ``b > 0``; no division when ``0 <= a <= b`` (a decode request's one tile: a 64-bit
    division costs ~15-40 cycles, paid per request)."""
    if 0 <= a <= b:
        return 1 if a > 0 else 0
    return -(-a // b)


#: A node's members are found by scanning the request mask when the node holds at least 1/8 of the requests (the
#: scan reads one flag per request; the sort ~log2(size) passes over the node's members).
_SCAN_MIN_SHARE = 8


@njit(cache=True, nogil=True)
def _sorted_members(order, lo, hi, mark, out):
    """``out[:] = sorted(order[lo:hi + 1])`` (distinct request indices below ``mark.shape[0]``): a sort for a small
    node, a scan over a request mask for a large one (a node of all 256 requests: ~0.5 us instead of ~4 us)."""
    size = hi - lo + 1
    if size * _SCAN_MIN_SHARE < mark.shape[0]:
        out[:] = order[lo:hi + 1]
        out.sort()
        return
    for i in range(lo, hi + 1):
        mark[order[i]] = True
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
    ends = np.empty(num_nodes, dtype=np.int64)
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
            min_sh = min(min_sh, shareable[r])
            rows += q_len[r]
            if q_len[r] > rows_per_decode:  # read once per chunk tile unshared
                extra += _cdiv(q_len[r], rows_per_chunk) - 1
        ends[k] = min(depth[k] * block_size, min_sh)
        p = parent[k]
        if p >= 0:
            start[k] = eff_end[p]
            level[k] = level[p] + 1
        tokens = ends[k] - start[k]
        ok = tokens > 0
        if ok and sharing == SHARING_AUTO:
            ok = _sharing_pays_off(rb[k] - lb[k] + 1, rows, _cdiv(rows, rows_per_shared), tokens, group, head_dim,
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
        offsets[j + 1] = offsets[j] + rb[k] - lb[k] + 1
    members = np.empty(offsets[num_kept], dtype=np.int64)
    kv_start = np.empty(num_kept, dtype=np.int64)
    kv_end = np.empty(num_kept, dtype=np.int64)
    depth_blocks = np.empty(num_kept, dtype=np.int64)
    mark = np.zeros(num_reqs, dtype=np.bool_)
    for j in range(num_kept):
        k = kept[j]
        kv_start[j], kv_end[j], depth_blocks[j] = start[k], ends[k], depth[k]
        seg = members[offsets[j]:offsets[j + 1]]
        _sorted_members(order, lb[k], rb[k], mark, seg)  # requests ascending within each node
        for r in seg:
            suffix_start[r] = max(suffix_start[r], ends[k])  # deeper kept nodes end later
    return kv_start, kv_end, depth_blocks, offsets, members, suffix_start


#: Entries of the ``rule`` argument (:func:`rule_args`): the split rule's constants.
(R_TOLERANCE, R_TARGET, R_MIN_PIECE_OVERHEADS, R_WAVE_CANDIDATES, R_LONG_FRACTION, R_WAVE_GAIN_MIN,
 R_WAVE_EXTRA, NUM_RULE) = range(8)
#: Entries of a row of the ``costs`` argument (one row per work class: its ProgramCost).
C_FIXED_US, C_TILE_US, C_SLOTS, C_FIXED_TOKENS, NUM_COST = range(5)


@njit(cache=True, nogil=True)
def _min_piece(min_split_tokens, fixed_tokens, rule):
    return min(float(min_split_tokens), rule[R_MIN_PIECE_OVERHEADS] * fixed_tokens)


@njit(cache=True, nogil=True)
def _split_budget(tokens, num_kv_heads, num_sms, min_split_tokens, fixed_tokens, rule):
    """Piece budget (float; ``inf`` for an empty launch): :func:`prefixattn.planner.split_rule.piece_budget` of the fair
    share."""
    fair = float(tokens) * num_kv_heads / num_sms
    if fair <= 0:
        return np.inf
    budget = max(rule[R_TOLERANCE] * fair, min(float(min_split_tokens), rule[R_TARGET] * fair))
    return max(budget, _min_piece(min_split_tokens, fixed_tokens, rule))


@njit(cache=True, nogil=True)
def _grain(block_n, budget):
    grain = block_n
    while grain > budget and grain % 2 == 0:
        grain //= 2
    return grain


@njit(cache=True, nogil=True)
def _pieces(length, budget, per_piece, grain):
    """Pieces of one range (:func:`prefixattn.planner.split_rule.split_pieces`)."""
    if length <= budget:
        return 1 if length > 0 else 0
    return _cdiv(_cdiv(length, grain), per_piece)


@njit(cache=True, nogil=True)
def _price(lengths, m, pieces, grain, block_n, num_kv_heads, num_sms, slots, cost, long_fraction):
    """``(makespan_us, ideal_us)``: :func:`prefixattn.planner.split_rule.modeled_makespan` of the class's programs (one
    pass for the longest program, one for the sums)."""
    n = lengths.shape[0]
    programs = 0
    for i in range(n):
        programs += m[i] * num_kv_heads * pieces[i]
    # prefixattn.autotune.program_cost.residency
    per_sm = int(cost[C_SLOTS])
    tile = cost[C_TILE_US] * min(per_sm, max(1, _cdiv(programs, num_sms))) / per_sm
    t_max = 0.0
    for i in range(n):
        if pieces[i] > 0:
            t = cost[C_FIXED_US] + tile * _cdiv(min(_cdiv(_cdiv(lengths[i], grain), pieces[i]) * grain, lengths[i]),
                                                block_n)
            t_max = max(t_max, t)
    n_long = 0
    work_long = rest = 0.0
    for i in range(n):
        if pieces[i] > 0:
            t = cost[C_FIXED_US] + tile * _cdiv(min(_cdiv(_cdiv(lengths[i], grain), pieces[i]) * grain, lengths[i]),
                                                block_n)
            count = m[i] * num_kv_heads * pieces[i]
            if t >= long_fraction * t_max:
                n_long += count
                work_long += count * t
            else:
                rest += count * t
    if n_long == 0:
        return 0.0, 0.0
    waves = _cdiv(n_long, slots)
    idle = waves * slots * t_max - work_long
    return waves * t_max + max(0.0, rest - idle) / slots, (work_long + rest) / slots


@njit(cache=True, nogil=True)
def _class_split(lengths, m, block_n, num_kv_heads, num_sms, min_split_tokens, cost, rule):
    """``(pieces, grain, makespan_us, ideal_us)`` of one work class:
    :func:`prefixattn.planner.split_rule.class_split`."""
    n = lengths.shape[0]
    tokens = longest = 0
    for i in range(n):
        tokens += lengths[i] * m[i]
        longest = max(longest, lengths[i])
    budget = _split_budget(tokens, num_kv_heads, num_sms, min_split_tokens, cost[C_FIXED_TOKENS], rule)
    grain = _grain(block_n, budget)
    per_piece = max(1, int(budget // grain)) if budget < np.inf else 1
    pieces = np.empty(n, dtype=np.int64)
    items = 0
    for i in range(n):
        pieces[i] = _pieces(lengths[i], budget, per_piece, grain)
        items += m[i] * pieces[i]
    if longest == 0:
        return pieces, grain, 0.0, 0.0
    slots = num_sms * int(cost[C_SLOTS])
    best, ideal = _price(lengths, m, pieces, grain, block_n, num_kv_heads, num_sms, slots, cost,
                         rule[R_LONG_FRACTION])
    if budget < np.inf:
        floor = _min_piece(min_split_tokens, cost[C_FIXED_TOKENS], rule)
        limit = items + int(rule[R_WAVE_EXTRA]) * num_sms // num_kv_heads
        grains_max = _cdiv(longest, grain)
        trial = np.empty(n, dtype=np.int64)
        for k in range(2, int(rule[R_WAVE_CANDIDATES]) + 1):
            b = grain * _cdiv(grains_max, k)
            if b >= budget:
                continue
            if b < floor:
                break
            per = max(1, b // grain)
            count = 0
            for i in range(n):
                trial[i] = _pieces(lengths[i], b, per, grain)
                count += m[i] * trial[i]
            if count > limit:
                break
            span, work = _price(lengths, m, trial, grain, block_n, num_kv_heads, num_sms, slots, cost,
                                rule[R_LONG_FRACTION])
            if span < best * (1.0 - rule[R_WAVE_GAIN_MIN]):
                pieces[:] = trial
                best, ideal = span, work
    return pieces, grain, best, ideal


@njit(cache=True, nogil=True)
def _piece_bound(lo, hi, c, pieces, grain):
    """``[start, end)`` of piece ``c`` (:func:`prefixattn.planner.work_list._piece_bounds`)."""
    if pieces == 1:
        return lo, hi
    tiles = _cdiv(hi - lo, grain)
    return lo + (c * tiles // pieces) * grain, min(lo + ((c + 1) * tiles // pieces) * grain, hi)


@njit(cache=True, nogil=True)
def _suffix_tiles(q_start, q_len, kv_len, suffix_start, causal, rows_per_suffix):
    """Suffix tiles (:func:`prefixattn.planner.work_list._suffix_tiles`): ``(req, first, rows, tok0, lo, hi, qpos)``."""
    num_reqs = q_len.shape[0]
    first = np.empty(num_reqs, dtype=np.int64)
    n = 0
    for r in range(num_reqs):
        first[r] = n
        n += _cdiv(q_len[r], rows_per_suffix)
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
            lo, hi = _piece_bound(kv_start[k], kv_end[k], c, n_pieces[k], grain)
            for mt in range(_cdiv(node_rows, rows_per_shared)):
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
    else:
        s_ranges, s_items = 0, ranges_size
        s_gather = s_items + n_items * item_fields
        s_mrows = s_gather + num_gather * gather_fields
        buf = flat = np.empty(s_mrows + num_mrows * mrow_fields + extra, dtype=np.int32)
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
def work_list(lay, rule, costs, kv_start, kv_end, offsets, members, suffix_start, q_start, q_len, kv_len, causal,
              rows_per_shared, rows_per_chunk, rows_per_decode, block_n_shared, block_n_chunk, block_n_decode,
              num_kv_heads, num_sms, min_split_tokens, extra, dest, dest_lay):
    """``(flat, items, gather, mrows, num_ws_rows, num_units, class_ends, modeled, in_dest)``:
    :func:`prefixattn.planner.work_list.build_work_list` (``modeled``: ``[NUM_CLASSES, 2]`` modeled makespan and ideal
    microseconds of each class's launch, :func:`_class_split`), the tables written straight
    into one int32 staging buffer: ``dest`` at ``dest_lay``'s offsets (``in_dest``) when given, ``extra`` is 0 (the
    workspace stages its table itself) and the step fits its capacities, else a new ``flat`` = ``[ranges, items,
    gather, mrows, extra entries]`` (:func:`prefixattn.planner.device_tables.metadata_to_device`'s layout)."""
    i_kind, i_req, i_kv0, i_kv1, i_row0, i_nrows, i_qpos, i_dest, i_mrow = (
        lay[1], lay[2], lay[3], lay[4], lay[5], lay[6], lay[7], lay[8], lay[9])
    kind_suffix, m_first, m_stride, m_states = lay[11], lay[17], lay[18], lay[19]
    t_req, t_first, t_rows, t_tok0, t_lo, t_hi, t_qpos = _suffix_tiles(q_start, q_len, kv_len, suffix_start, causal,
                                                                        rows_per_chunk)
    num_tiles, num_nodes, num_reqs = t_req.shape[0], kv_start.shape[0], q_len.shape[0]
    # ---- split rule over the unsplit work, one work class at a time
    t_decode = np.empty(num_tiles, dtype=np.bool_)
    node_rows = np.zeros(num_nodes, dtype=np.int64)
    node_len = np.empty(num_nodes, dtype=np.int64)
    node_m = np.empty(num_nodes, dtype=np.int64)
    for k in range(num_nodes):
        for m in range(offsets[k], offsets[k + 1]):
            node_rows[k] += q_len[members[m]]
        node_len[k] = kv_end[k] - kv_start[k]
        node_m[k] = _cdiv(node_rows[k], rows_per_shared)
    num_decode_tiles = 0
    for t in range(num_tiles):
        t_decode[t] = q_len[t_req[t]] <= rows_per_decode
        num_decode_tiles += t_decode[t]
    # Each suffix class's tiles as their own arrays (class_of[t]: the tile's index in its class's arrays).
    class_of = np.empty(num_tiles, dtype=np.int64)
    len_ch = np.empty(num_tiles - num_decode_tiles, dtype=np.int64)
    len_de = np.empty(num_decode_tiles, dtype=np.int64)
    i_ch = i_de = 0
    for t in range(num_tiles):
        if t_decode[t]:
            class_of[t], len_de[i_de], i_de = i_de, max(t_hi[t] - t_lo[t], 0), i_de + 1
        else:
            class_of[t], len_ch[i_ch], i_ch = i_ch, max(t_hi[t] - t_lo[t], 0), i_ch + 1
    n_pieces, grain_sh, span_sh, ideal_sh = _class_split(node_len, node_m, block_n_shared, num_kv_heads, num_sms,
                                                         min_split_tokens, costs[0], rule)
    p_ch, grain_ch, span_ch, ideal_ch = _class_split(len_ch, np.ones(len_ch.shape[0], dtype=np.int64), block_n_chunk,
                                                     num_kv_heads, num_sms, min_split_tokens, costs[1], rule)
    p_de, grain_de, span_de, ideal_de = _class_split(len_de, np.ones(len_de.shape[0], dtype=np.int64),
                                                     block_n_decode, num_kv_heads, num_sms, min_split_tokens,
                                                     costs[2], rule)
    t_pieces = np.empty(num_tiles, dtype=np.int64)
    for t in range(num_tiles):
        t_pieces[t] = p_de[class_of[t]] if t_decode[t] else p_ch[class_of[t]]
    modeled = np.array([[span_sh, ideal_sh], [span_ch, ideal_ch], [span_de, ideal_de]])
    # ---- states per request (shared ones numbered node by node, top-down) and merge units
    shared_states, slot_base, tile_ws_base, tile_mrow_base, num_units, num_ws_rows, num_mrows = _merge_units(
        offsets, members, n_pieces, t_req, t_rows, t_pieces, num_reqs)
    num_shared = num_gather = num_chunk = num_decode = 0
    for k in range(num_nodes):
        num_shared += n_pieces[k] * _cdiv(node_rows[k], rows_per_shared)
        num_gather += n_pieces[k] * node_rows[k]
    for t in range(num_tiles):
        if t_decode[t]:
            num_decode += t_pieces[t]
        else:
            num_chunk += t_pieces[t]
    n_items = num_shared + num_chunk + num_decode
    class_ends = np.empty(3, dtype=np.int64)
    class_ends[0], class_ends[1], class_ends[2] = num_shared, num_shared + num_chunk, n_items
    # dest: a workspace's buffer, which stages its table itself (extra == 0)
    in_dest = extra == 0 and dest_lay.shape[0] > 0 and _fits_dest(dest_lay, n_items, num_gather, num_mrows,
                                                                   num_ws_rows, q_len)
    flat, items, gather, mrows = _table_views(dest, dest_lay, in_dest, lay, class_ends, num_gather, num_mrows, extra)
    for t in range(num_tiles):
        if tile_mrow_base[t] >= 0:
            for i in range(t_rows[t]):
                j = tile_mrow_base[t] + i
                mrows[j, m_first] = tile_ws_base[t] + i
                mrows[j, m_stride] = t_rows[t]
                mrows[j, m_states] = shared_states[t_req[t]] + t_pieces[t]
    # ---- items: shared (node, piece, M tile), then suffix (tile, piece) of the chunk and the decode class; gather
    # rows of the shared ones
    _shared_items(items, gather, lay, kv_start, kv_end, offsets, members, q_start, q_len, t_first, t_rows,
                  tile_ws_base, tile_mrow_base, n_pieces, slot_base, grain_sh, rows_per_chunk, rows_per_shared)
    it_chunk, it_decode = num_shared, num_shared + num_chunk
    for t in range(num_tiles):
        unit = tile_mrow_base[t] >= 0
        grain = grain_de if t_decode[t] else grain_ch
        for c in range(t_pieces[t]):
            lo, hi = _piece_bound(t_lo[t], t_hi[t], c, t_pieces[t], grain)
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
    _longest_first(items, i_kv0, i_kv1, class_ends)
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

    ``lay``: :func:`layout_args`, ``rule``: :func:`rule_args`, ``costs``: :func:`cost_args`, ``params``:
    int64 ``[NUM_PARAMS]``
    (``P_*``), ``width``: block-table columns to stage (the batch reads them; 0: none); ``dest``, ``dest_lay``: a
    workspace's int32 host buffer and its layout (``D_*``; empty: none), which gets the tables when they fit.
    Returns ``(kv_start, kv_end, depth_blocks, offsets, members, flat, items, gather, mrows, table_fits,
    num_ws_rows, num_units, class_ends, modeled, in_dest)``; ``flat`` holds the block table's used columns
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
