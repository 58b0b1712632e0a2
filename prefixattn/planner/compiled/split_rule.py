"""Compiled (numba) split stage: :func:`prefixattn.planner.split_rule.split_work` as loops (the suffix tiles, the
nodes' packed rows, the split rule one work class at a time and the item count of each class).

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)`` but the
stage's Python side at the end; each computes what its numpy counterpart does: :func:`class_split` is
:func:`prefixattn.planner.split_rule.class_split` (piece budget, grains, pieces, the wave-aware step and its modeled
makespan), :func:`split_ranges` is :func:`~prefixattn.planner.split_rule.split_ranges`, :func:`split_work` is
:func:`~prefixattn.planner.split_rule.split_work`. The split rule's constants come in as an argument
(:func:`rule_args`), never as globals (numba's on-disk cache is keyed by a function's own file). The compiled work list
(:mod:`prefixattn.planner.compiled.work_list`) compiles in :func:`cdiv` and pins this file for it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prefixattn.planner import split_rule as S
from prefixattn.planner.split_rule import NodeRows, Split, SplitPieces, Tiles

#: Entries of the ``rule`` argument (:func:`rule_args`): the split rule's constants.
(R_TOLERANCE, R_TARGET, R_MIN_PIECE_OVERHEADS, R_WAVE_CANDIDATES, R_LONG_FRACTION, R_WAVE_GAIN_MIN,
 R_WAVE_EXTRA, NUM_RULE) = range(8)
#: Entries of a row of the ``costs`` argument (one row per work class: its ProgramCost).
C_FIXED_US, C_TILE_US, C_SLOTS, C_FIXED_TOKENS, NUM_COST = range(5)


def rule_args() -> np.ndarray:
    """The split rule's constants (``R_*`` order) as a float64 array argument (numba's cache: see above)."""
    return np.array([S.SPLIT_TOLERANCE, S.CRITICAL_PATH_TARGET, S.MIN_PIECE_OVERHEADS, S.WAVE_CANDIDATES,
                     S.LONG_PROGRAM_FRACTION, S.WAVE_GAIN_MIN, S.WAVE_EXTRA_ITEMS_PER_SM], dtype=np.float64)


@njit(cache=True, nogil=True)
def cdiv(a, b):
    """``ceil(a / b)`` for ``b > 0``; no division when ``0 <= a <= b`` (a decode request's one tile: a 64-bit
    division costs ~15-40 cycles, paid per request)."""
    if 0 <= a <= b:
        return 1 if a > 0 else 0
    return -(-a // b)


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
def _pow2_shift(x):
    """``log2(x)`` when ``x`` is a power of two, else -1 (KV tiles and grains are: a shift replaces a division)."""
    if x <= 0 or x & (x - 1) != 0:
        return -1
    shift = 0
    while (1 << shift) < x:
        shift += 1
    return shift


@njit(cache=True, nogil=True)
def _cdiv_by(a, b, shift):
    """``cdiv(a, b)`` for ``a >= 0``; a shift when ``b == 2**shift`` (``shift >= 0``)."""
    if shift >= 0:
        return (a + b - 1) >> shift
    return cdiv(a, b)


@njit(cache=True, nogil=True)
def _pieces(length, grains, budget, per_piece):
    """Pieces of one range of ``grains`` grains (:func:`prefixattn.planner.split_rule.split_pieces`)."""
    if length <= budget:
        return 1 if length > 0 else 0
    return grains if per_piece == 1 else cdiv(grains, per_piece)


@njit(cache=True, nogil=True)
def _price(grains, m, pieces, blocks, grain, block_n, shift_b, lengths, num_kv_heads, num_sms, slots, cost,
           long_fraction):
    """``(makespan_us, ideal_us)``: :func:`prefixattn.planner.split_rule.modeled_makespan` of the class's programs.
    ``grains``: each range's grains; ``blocks``: scratch, gets the KV tiles of each range's longest piece (one pass
    for them and the longest program, one for the sums: a division at most per range, none for a whole one)."""
    n = lengths.shape[0]
    programs = 0
    top = -1
    for i in range(n):
        p = pieces[i]
        programs += m[i] * num_kv_heads * p
        if p > 0:
            per = grains[i] if p == 1 else cdiv(grains[i], p)
            blocks[i] = _cdiv_by(min(per * grain, lengths[i]), block_n, shift_b)
            top = max(top, blocks[i])
    if top < 0:
        return 0.0, 0.0
    # prefixattn.autotune.program_cost.residency
    per_sm = int(cost[C_SLOTS])
    tile = cost[C_TILE_US] * min(per_sm, max(1, cdiv(programs, num_sms))) / per_sm
    t_max = cost[C_FIXED_US] + tile * top
    n_long = 0
    work_long = rest = 0.0
    for i in range(n):
        if pieces[i] > 0:
            t = cost[C_FIXED_US] + tile * blocks[i]
            count = m[i] * num_kv_heads * pieces[i]
            if t >= long_fraction * t_max:
                n_long += count
                work_long += count * t
            else:
                rest += count * t
    waves = cdiv(n_long, slots)
    idle = waves * slots * t_max - work_long
    return waves * t_max + max(0.0, rest - idle) / slots, (work_long + rest) / slots


@njit(cache=True, nogil=True)
def class_split(lengths, m, block_n, num_kv_heads, num_sms, min_split_tokens, cost, rule):
    """``(pieces, grain, makespan_us, ideal_us)`` of one work class:
    :func:`prefixattn.planner.split_rule.class_split`."""
    n = lengths.shape[0]
    tokens = longest = 0
    for i in range(n):
        tokens += lengths[i] * m[i]
        longest = max(longest, lengths[i])
    budget = _split_budget(tokens, num_kv_heads, num_sms, min_split_tokens, cost[C_FIXED_TOKENS], rule)
    grain = _grain(block_n, budget)
    shift_g, shift_b = _pow2_shift(grain), _pow2_shift(block_n)
    per_piece = max(1, int(budget // grain)) if budget < np.inf else 1
    grains = np.empty(n, dtype=np.int64)
    pieces = np.empty(n, dtype=np.int64)
    items = 0
    for i in range(n):
        grains[i] = _cdiv_by(lengths[i], grain, shift_g)
        pieces[i] = _pieces(lengths[i], grains[i], budget, per_piece)
        items += m[i] * pieces[i]
    if longest == 0:
        return pieces, grain, 0.0, 0.0
    slots = num_sms * int(cost[C_SLOTS])
    blocks = np.empty(n, dtype=np.int64)
    best, ideal = _price(grains, m, pieces, blocks, grain, block_n, shift_b, lengths, num_kv_heads, num_sms, slots,
                         cost, rule[R_LONG_FRACTION])
    if budget < np.inf:
        floor = _min_piece(min_split_tokens, cost[C_FIXED_TOKENS], rule)
        limit = items + int(rule[R_WAVE_EXTRA]) * num_sms // num_kv_heads
        grains_max = _cdiv_by(longest, grain, shift_g)
        trial = np.empty(n, dtype=np.int64)
        for k in range(2, int(rule[R_WAVE_CANDIDATES]) + 1):
            b = grain * cdiv(grains_max, k)
            if b >= budget:
                continue
            if b < floor:
                break
            per = max(1, b // grain)
            count = 0
            for i in range(n):
                trial[i] = _pieces(lengths[i], grains[i], b, per)
                count += m[i] * trial[i]
            if count > limit:
                break
            span, work = _price(grains, m, trial, blocks, grain, block_n, shift_b, lengths, num_kv_heads, num_sms,
                                slots, cost, rule[R_LONG_FRACTION])
            if span < best * (1.0 - rule[R_WAVE_GAIN_MIN]):
                pieces[:] = trial
                best, ideal = span, work
    return pieces, grain, best, ideal


@njit(cache=True, nogil=True)
def split_ranges(node_len, node_m, tile_len, t_decode, block_n_shared, block_n_chunk, block_n_decode, num_kv_heads,
                 decode_kv_heads, num_sms, min_split_tokens, costs, rule):
    """``(node_pieces, grain_shared, tile_pieces, grain_chunk, grain_decode, modeled)``: the rule one work class at a
    time (:func:`prefixattn.planner.split_rule.split_ranges`; ``modeled``: ``[3, 2]`` makespan and ideal us)."""
    num_tiles = tile_len.shape[0]
    num_decode_tiles = 0
    for t in range(num_tiles):
        num_decode_tiles += t_decode[t]
    # Each suffix class's tiles as their own arrays (class_of[t]: the tile's index in its class's arrays).
    class_of = np.empty(num_tiles, dtype=np.int64)
    len_ch = np.empty(num_tiles - num_decode_tiles, dtype=np.int64)
    len_de = np.empty(num_decode_tiles, dtype=np.int64)
    i_ch = i_de = 0
    for t in range(num_tiles):
        if t_decode[t]:
            class_of[t], len_de[i_de], i_de = i_de, tile_len[t], i_de + 1
        else:
            class_of[t], len_ch[i_ch], i_ch = i_ch, tile_len[t], i_ch + 1
    n_pieces, grain_sh, span_sh, ideal_sh = class_split(node_len, node_m, block_n_shared, num_kv_heads, num_sms,
                                                        min_split_tokens, costs[0], rule)
    p_ch, grain_ch, span_ch, ideal_ch = class_split(len_ch, np.ones(len_ch.shape[0], dtype=np.int64), block_n_chunk,
                                                    num_kv_heads, num_sms, min_split_tokens, costs[1], rule)
    p_de, grain_de, span_de, ideal_de = class_split(len_de, np.ones(len_de.shape[0], dtype=np.int64), block_n_decode,
                                                    num_kv_heads // decode_kv_heads, num_sms, min_split_tokens,
                                                    costs[2], rule)
    t_pieces = np.empty(num_tiles, dtype=np.int64)
    for t in range(num_tiles):
        t_pieces[t] = p_de[class_of[t]] if t_decode[t] else p_ch[class_of[t]]
    modeled = np.array([[span_sh, ideal_sh], [span_ch, ideal_ch], [span_de, ideal_de]])
    return n_pieces, grain_sh, t_pieces, grain_ch, grain_de, modeled


#: Rows of the packed suffix tiles (:func:`_suffix_tiles`): each tile's request, rows, first token, KV range
#: ``[lo, hi)``, the KV position its first row sees, its class (1: decode), its split-k pieces (:func:`split_work`);
#: ``T_FIRST`` holds each request's first tile.
T_REQ, T_ROWS, T_TOK0, T_LO, T_HI, T_QPOS, T_DECODE, T_PIECES, T_FIRST, NUM_T = range(10)
#: Rows of :func:`split_work`'s per-node array: each node's packed query rows, their M tiles, its split-k pieces.
N_ROWS, N_MTILES, N_PIECES, NUM_N = range(4)
#: Entries of :func:`split_work`'s scalars: the suffix tiles, each class's grain, one past each class's last item,
#: the KV positions the nodes save (:func:`prefixattn.planner.split_rule.shared_reads_saved`).
(S_TILES, S_GRAIN_SHARED, S_GRAIN_CHUNK, S_GRAIN_DECODE, S_END_SHARED, S_END_CHUNK, S_END_DECODE, S_READS_SAVED,
 NUM_S) = range(9)


@njit(cache=True, nogil=True)
def _suffix_tiles(q_start, q_len, kv_len, suffix_start, causal, rows_per_suffix, rows_per_decode):
    """Suffix tiles (:func:`prefixattn.planner.split_rule.suffix_tiles`) packed into one array ``[NUM_T, max(tiles,
    requests)]`` (rows ``T_*``; numba's boxing costs ~0.3 us per array returned) and the tile count."""
    num_reqs = q_len.shape[0]
    n = 0
    for r in range(num_reqs):
        n += cdiv(q_len[r], rows_per_suffix)
    tiles = np.empty((NUM_T, max(n, num_reqs)), dtype=np.int64)
    t = 0
    for r in range(num_reqs):
        tiles[T_FIRST, r] = t
        row0 = 0
        decode = q_len[r] <= rows_per_decode
        while row0 < q_len[r]:
            rows = min(rows_per_suffix, q_len[r] - row0)
            tiles[T_REQ, t], tiles[T_ROWS, t], tiles[T_TOK0, t] = r, rows, q_start[r] + row0
            tiles[T_LO, t], tiles[T_DECODE, t] = suffix_start[r], decode
            if causal:
                tiles[T_QPOS, t] = kv_len[r] - q_len[r] + row0
                tiles[T_HI, t] = tiles[T_QPOS, t] + rows
            else:  # every row sees the whole range
                tiles[T_QPOS, t] = tiles[T_HI, t] = kv_len[r]
            row0 += rows_per_suffix
            t += 1
    return tiles, n


@njit(cache=True, nogil=True)
def _unsplit_work(kv_start, kv_end, offsets, members, q_len, tiles, num_tiles, rows_per_shared):
    """What the split rule prices, before any split: ``(node_split, node_len, tile_len, t_decode)``, each node's
    packed rows and M tiles (rows ``N_ROWS``, ``N_MTILES``; ``N_PIECES`` left for the split) and KV length, and each
    suffix tile's KV length and class (decode or chunk)."""
    num_nodes = kv_start.shape[0]
    node_split = np.zeros((NUM_N, num_nodes), dtype=np.int64)
    node_len = np.empty(num_nodes, dtype=np.int64)
    for k in range(num_nodes):
        for m in range(offsets[k], offsets[k + 1]):
            node_split[N_ROWS, k] += q_len[members[m]]
        node_len[k] = kv_end[k] - kv_start[k]
        node_split[N_MTILES, k] = cdiv(node_split[N_ROWS, k], rows_per_shared)
    tile_len = np.empty(num_tiles, dtype=np.int64)
    t_decode = np.empty(num_tiles, dtype=np.bool_)
    for t in range(num_tiles):
        tile_len[t] = max(tiles[T_HI, t] - tiles[T_LO, t], 0)
        t_decode[t] = tiles[T_DECODE, t] != 0
    return node_split, node_len, tile_len, t_decode


@njit(cache=True, nogil=True)
def split_work(kv_start, kv_end, offsets, members, suffix_start, q_start, q_len, kv_len, causal, rows_per_shared,
               rows_per_chunk, rows_per_decode, block_n_shared, block_n_chunk, block_n_decode, num_kv_heads,
               decode_kv_heads, num_sms, min_split_tokens, costs, rule):
    """One candidate's split (:func:`prefixattn.planner.split_rule.split_work`): ``(tiles, node_split, scalars,
    modeled)``: the suffix tiles packed (:func:`_suffix_tiles`, their pieces in row ``T_PIECES``), each node's
    packed rows, M tiles and pieces (rows ``N_*``), the tile count, grains, class ends and reads saved (``S_*``) and
    each class's
    modeled launch ``[3, 2]``: four arrays, not eleven values (numba's boxing costs ~0.3 us per array returned)."""
    tiles, n = _suffix_tiles(q_start, q_len, kv_len, suffix_start, causal, rows_per_chunk, rows_per_decode)
    node_split, node_len, tile_len, t_decode = _unsplit_work(kv_start, kv_end, offsets, members, q_len, tiles, n,
                                                             rows_per_shared)
    n_pieces, grain_sh, t_pieces, grain_ch, grain_de, modeled = split_ranges(
        node_len, node_split[N_MTILES], tile_len, t_decode, block_n_shared, block_n_chunk, block_n_decode,
        num_kv_heads, decode_kv_heads, num_sms, min_split_tokens, costs, rule)
    node_split[N_PIECES] = n_pieces
    tiles[T_PIECES, :n] = t_pieces
    scalars = np.empty(NUM_S, dtype=np.int64)
    scalars[S_TILES], scalars[S_GRAIN_SHARED] = n, grain_sh
    scalars[S_GRAIN_CHUNK], scalars[S_GRAIN_DECODE] = grain_ch, grain_de
    _class_ends(scalars[S_END_SHARED:S_END_DECODE + 1], node_split[N_MTILES], n_pieces, t_decode, t_pieces)
    saved = 0  # prefixattn.planner.split_rule.shared_reads_saved
    for k in range(kv_start.shape[0]):
        saved += (kv_end[k] - kv_start[k]) * (offsets[k + 1] - offsets[k] - 1)
    scalars[S_READS_SAVED] = saved
    return tiles, node_split, scalars, modeled


@njit(cache=True, nogil=True)
def _class_ends(out, node_m, n_pieces, t_decode, t_pieces):
    """One past each work class's last item (shared, chunk, decode: the item table's sections) into ``out``."""
    num_shared = num_chunk = num_decode = 0
    for k in range(node_m.shape[0]):
        num_shared += n_pieces[k] * node_m[k]
    for t in range(t_decode.shape[0]):
        if t_decode[t]:
            num_decode += t_pieces[t]
        else:
            num_chunk += t_pieces[t]
    out[0], out[1] = num_shared, num_shared + num_chunk
    out[2] = num_shared + num_chunk + num_decode


# ---- the stage's Python side

#: The rule's constants as :func:`split_work` takes them.
RULE = rule_args()


def split(nodes, suffix_start: np.ndarray, inputs, o, tiles, *, num_sms: int, costs: tuple) -> Split:
    """The split stage for one candidate: :func:`prefixattn.planner.split_rule.split_work` (``nodes``,
    ``suffix_start``: the node stage's; ``o``: the plan's options; ``tiles``: its
    :class:`~prefixattn.planner.tiles.AttentionTiles`; ``costs``: each class's
    :class:`~prefixattn.autotune.program_cost.ProgramCost`)."""
    t = tiles.tile_rows(o.group).split_args
    packed, node_split, scalars, modeled = split_work(
        nodes.kv_start, nodes.kv_end, nodes.offsets, nodes.members, suffix_start, inputs.indptr[:-1], inputs.q_len,
        inputs.lens, o.causal, t["rows_per_shared"], t["rows_per_chunk"], t["rows_per_decode"], t["block_n_shared"],
        t["block_n_chunk"], t["block_n_decode"], o.num_kv_heads, t["decode_kv_heads"], num_sms, o.min_split_tokens,
        cost_args(costs), RULE)
    n, grain_sh, grain_ch, grain_de, end_sh, end_ch, end_de, saved = scalars.tolist()  # S_* order
    num_requests = inputs.lens.shape[0]
    return Split(shared_grain=grain_sh, tile_grains=(grain_ch, grain_de), modeled=modeled,
                 class_ends=(end_sh, end_ch, end_de), reads_saved=saved, packed=(packed, node_split, scalars),
                 pieces_of=lambda: _unpack_pieces(packed, node_split, n, num_requests))


def _unpack_pieces(packed: np.ndarray, node_split: np.ndarray, n: int, num_requests: int) -> SplitPieces:
    """The :class:`SplitPieces` of :func:`split_work`'s packed arrays (``n`` tiles): views, built only when read (the
    compiled work list reads the packed arrays; 9 slices and the NodeRows cost ~4 us a step)."""
    tile = Tiles(req=packed[T_REQ, :n], first=packed[T_FIRST, :num_requests], row0=0, rows=packed[T_ROWS, :n],
                 tok0=packed[T_TOK0, :n], lo=packed[T_LO, :n], hi=packed[T_HI, :n], qpos=packed[T_QPOS, :n],
                 decode=packed[T_DECODE, :n] != 0)
    return SplitPieces(tiles=tile, rows=NodeRows(node_rows=node_split[N_ROWS], node_mtiles=node_split[N_MTILES]),
                       node_pieces=node_split[N_PIECES], tile_pieces=packed[T_PIECES, :n])


#: :func:`cost_args` per costs tuple (by identity, holding the tuple), cleared when it reaches this many.
_COST_MEMO_MAX = 256
_cost_memo: dict = {}


def cost_args(costs: tuple) -> np.ndarray:
    """The work classes' :class:`~prefixattn.autotune.program_cost.ProgramCost` as :func:`split_work`'s float64
    ``[3, NUM_COST]`` argument (``C_*`` columns), memoized by identity (the planner's costs come from a memo)."""
    hit = _cost_memo.get(id(costs))
    if hit is not None and hit[0] is costs:
        return hit[1]
    out = np.empty((len(costs), NUM_COST), dtype=np.float64)
    for i, c in enumerate(costs):
        out[i, C_FIXED_US], out[i, C_TILE_US] = c.fixed_us, c.tile_us
        out[i, C_SLOTS], out[i, C_FIXED_TOKENS] = c.slots_per_sm, c.fixed_tokens
    if len(_cost_memo) >= _COST_MEMO_MAX:
        _cost_memo.clear()
    _cost_memo[id(costs)] = (costs, out)
    return out
