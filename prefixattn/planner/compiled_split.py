"""Compiled (numba) split rule: :mod:`prefixattn.planner.split_rule` as loops, called by
:mod:`prefixattn.planner.compiled_core`.

Imported only when numba is (:mod:`prefixattn.planner.compiled`); every function is ``@njit(cache=True)`` and
computes what its numpy counterpart does:

* :func:`class_split`: :func:`prefixattn.planner.split_rule.class_split` (piece budget, grains, pieces, the
  wave-aware step and its modeled makespan);
* :func:`split_ranges`: :func:`prefixattn.planner.split_rule.split_ranges` (the rule one work class at a time);
* :func:`piece_bound`: :func:`prefixattn.planner.work_list._piece_bounds` (where each piece starts and ends).

The split rule's constants come in as an argument (:func:`rule_args`), never as globals (numba's on-disk cache is
keyed by a function's own file). :mod:`~prefixattn.planner.compiled_core` calls into this module, so its cached
functions hold this file's code compiled in: it pins this file by :data:`compiled_core.SPLIT_SOURCE_HASH
<prefixattn.planner.compiled_core.SPLIT_SOURCE_HASH>` (``tests/test_split_rule.py`` fails until that matches). This
module imports no other compiled module.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from prefixattn.planner import split_rule as S

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
def _pieces(length, budget, per_piece, grain):
    """Pieces of one range (:func:`prefixattn.planner.split_rule.split_pieces`)."""
    if length <= budget:
        return 1 if length > 0 else 0
    return cdiv(cdiv(length, grain), per_piece)


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
    tile = cost[C_TILE_US] * min(per_sm, max(1, cdiv(programs, num_sms))) / per_sm
    t_max = 0.0
    for i in range(n):
        if pieces[i] > 0:
            t = cost[C_FIXED_US] + tile * cdiv(min(cdiv(cdiv(lengths[i], grain), pieces[i]) * grain, lengths[i]),
                                                block_n)
            t_max = max(t_max, t)
    n_long = 0
    work_long = rest = 0.0
    for i in range(n):
        if pieces[i] > 0:
            t = cost[C_FIXED_US] + tile * cdiv(min(cdiv(cdiv(lengths[i], grain), pieces[i]) * grain, lengths[i]),
                                                block_n)
            count = m[i] * num_kv_heads * pieces[i]
            if t >= long_fraction * t_max:
                n_long += count
                work_long += count * t
            else:
                rest += count * t
    if n_long == 0:
        return 0.0, 0.0
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
        grains_max = cdiv(longest, grain)
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
def split_ranges(node_len, node_m, tile_len, t_decode, block_n_shared, block_n_chunk, block_n_decode, num_kv_heads,
                 num_sms, min_split_tokens, costs, rule):
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
                                                    num_kv_heads, num_sms, min_split_tokens, costs[2], rule)
    t_pieces = np.empty(num_tiles, dtype=np.int64)
    for t in range(num_tiles):
        t_pieces[t] = p_de[class_of[t]] if t_decode[t] else p_ch[class_of[t]]
    modeled = np.array([[span_sh, ideal_sh], [span_ch, ideal_ch], [span_de, ideal_de]])
    return n_pieces, grain_sh, t_pieces, grain_ch, grain_de, modeled


@njit(cache=True, nogil=True)
def piece_bound(lo, hi, c, pieces, grain):
    """``[start, end)`` of piece ``c`` (:func:`prefixattn.planner.work_list._piece_bounds`)."""
    if pieces == 1:
        return lo, hi
    tiles = cdiv(hi - lo, grain)
    return lo + (c * tiles // pieces) * grain, min(lo + ((c + 1) * tiles // pieces) * grain, hi)
