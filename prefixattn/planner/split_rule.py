"""The split-k rule: split a KV range when its program would read more than its launch's fair share per SM, and
further where the launch's waves would otherwise run ragged.

The planner's stage after the node choice: :func:`split_work` cuts one candidate's nodes and its requests' suffix tiles
into pieces and prices the launches (modeled), without building the work list, so that the choice between sharing plans
(:mod:`prefixattn.planner.choose`) compares prices and only the chosen one is built
(:mod:`prefixattn.planner.work_list`). Numpy; the compiled split (:mod:`prefixattn.planner.compiled.split_rule`)
computes the same. A work class is one launch that runs every work item once per KV head; a program's KV work is the
tokens it reads (a SHARED item reads its node's KV once for all its packed rows). The *fair share* is the launch's total
KV work over the SMs, ``sum(tokens x programs) / num_sms``; it does not change with splitting (pieces read the same
tokens). Counting programs instead (split only while ``items x kv_heads < num_sms``) left one program at 13.2x the fair
share for 32 decodes under an 8,192-token prefix (GQA 32:4, sm90 tiles, 132 SMs).

Rule, per work class (each class is its own launch and has the GPU to itself):

1. (:func:`piece_budget`, :func:`split_pieces`) every range longer than the budget ``SPLIT_TOLERANCE x fair share``
   is cut into the fewest pieces of whole KV tiles that keep each piece within the budget (never below
   ``MIN_PIECE_OVERHEADS`` x the program's fixed cost); pieces of one range are merged by the last to finish.
2. (:func:`class_split`) the tokens alone ignore two things the H100 measurements show: a program's fixed cost (~7
   us at one program per SM, ~300 KV positions; :mod:`prefixattn.autotune.program_cost`) and whole waves. 292 equal
   shared programs (2.21 waves of work) ran as 3 full waves, 3 x 908 = the measured 2721 us
   (bench/results/gpu/nvidia-h100-80gb-hbm3-ba41bb7.csv, mixed256 32768/128/256 GQA 32:4). So finer budgets are
   tried too (the longest range in 2 .. ``WAVE_CANDIDATES`` pieces), each priced by the calibrated program cost
   under list scheduling (:func:`modeled_makespan`), and the cheapest is kept when it gains at least
   ``WAVE_GAIN_MIN``; a refinement adds at most ``WAVE_EXTRA_ITEMS_PER_SM x num_sms / num_kv_heads`` items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from prefixattn.autotune.program_cost import residency
from prefixattn.ragged import expand as _expand, offsets

#: The bound the issue sets on the critical path (sm90, 132 SMs, Fig. 8 shapes and FlashInfer's cascade grid).
CRITICAL_PATH_TARGET = 1.25
#: A program may read up to this multiple of the fair share before its range is split. Above 1: a range a little over
#: the fair share is left whole (a split adds a program start, a partial state and a merge read to save a few
#: percent; with LPT order the other SMs absorb the excess). Below CRITICAL_PATH_TARGET: pieces are cut to at most
#: this budget, so the target holds with 4% to spare for the fixed cost below, which the KV-only ratio ignores.
SPLIT_TOLERANCE = 1.2
#: A piece reads at least this many times the program's fixed cost (in KV positions of the class's binary): below
#: it a split mostly buys program starts and merges.
MIN_PIECE_OVERHEADS = 2
#: Finer budgets the wave-aware step tries: the longest range in 2 .. this many pieces.
WAVE_CANDIDATES = 16
#: Programs within this fraction of the longest one's modeled time form the first waves of a launch (LPT order); the
#: rest fill what those waves leave idle.
LONG_PROGRAM_FRACTION = 0.9
#: A finer split is kept only when it shortens the modeled launch by at least this fraction (model error is ~10%
#: rms: smaller gains are noise, and every piece costs a partial state and its merge).
WAVE_GAIN_MIN = 0.03
#: The wave-aware step adds at most this many items per SM per KV head to a class (the workspace capacities bound
#: them: prefixattn.planner.workspace).
WAVE_EXTRA_ITEMS_PER_SM = 8


def fair_share(lengths: np.ndarray, programs: np.ndarray, *, num_kv_heads: int, num_sms: int) -> float:
    """KV tokens per SM when the launch's KV work is spread evenly.

    Parameters
    ----------
    lengths : ndarray, ``[num_ranges]`` int
        KV tokens of each range (a shared node, a suffix tile).
    programs : ndarray, ``[num_ranges]`` int, or None
        Items reading the whole range (M tiles of a node's packed rows; 1 for a suffix tile), each run per KV head;
        None: one each.
    """
    # Integer sums are exact (and equal to the float64 sum below 2^53 tokens): no float copies.
    tokens = int(lengths.sum() if programs is None else (lengths.astype(np.int64) * programs).sum())
    return _fair_share_of(tokens, num_kv_heads=num_kv_heads, num_sms=num_sms)


def _fair_share_of(tokens: int, *, num_kv_heads: int, num_sms: int) -> float:
    return float(tokens) * num_kv_heads / num_sms


def piece_budget(fair: float, *, min_split_tokens: int, overhead_tokens: float) -> float:
    """Most KV tokens one piece may read: ``SPLIT_TOLERANCE x fair``, raised toward ``min_split_tokens`` only as far as
    ``CRITICAL_PATH_TARGET x fair`` (that floor never breaks the target), and never below ``MIN_PIECE_OVERHEADS x
    overhead_tokens`` (the program's fixed cost in KV positions; or ``min_split_tokens`` if smaller, as tests ask for
    tiny pieces): in a launch whose fair share is below that the target yields to the programs' fixed cost. ``inf``
    for an empty launch."""
    if fair <= 0:
        return float("inf")
    budget = max(SPLIT_TOLERANCE * fair, min(min_split_tokens, CRITICAL_PATH_TARGET * fair))
    return max(budget, min_piece(min_split_tokens, overhead_tokens))


def min_piece(min_split_tokens: int, overhead_tokens: float) -> float:
    """The shortest piece worth a program: ``MIN_PIECE_OVERHEADS`` fixed costs, or ``min_split_tokens`` if less."""
    return min(float(min_split_tokens), MIN_PIECE_OVERHEADS * overhead_tokens)


def split_grain(block_n: int, budget: float) -> int:
    """Piece boundaries fall on multiples of this (from a range's start): the kernel's KV tile, halved while one tile
    alone exceeds the budget (a 128-token suffix tile under a ~100-token budget). A piece shorter than a tile costs
    the kernel a masked tile (no extra bytes: masked lanes are not loaded)."""
    grain = block_n
    while grain > budget and grain % 2 == 0:
        grain //= 2
    return grain


def split_pieces(lengths: np.ndarray, *, budget: float, grain: int) -> np.ndarray:
    """Pieces per range: the fewest that keep every piece within ``budget`` tokens when whole grains are dealt out
    evenly (:func:`prefixattn.planner.work_list._piece_bounds`: pieces differ by at most one grain, so ``ceil(grains /
    pieces) <= grains_per_piece``); 1 for a range within the budget, 0 for an empty one.

    Parameters
    ----------
    lengths : ndarray, ``[num_ranges]`` int
    budget : float
        Most KV tokens per piece (:func:`piece_budget`).
    grain : int
        Piece boundaries are whole grains from the range's start (:func:`split_grain`).

    Returns
    -------
    ndarray, ``[num_ranges]`` int64
    """
    if not lengths.shape[0] or not math.isfinite(budget) or lengths.max() <= budget:
        return (lengths > 0).astype(np.int64)  # nothing to split (the common case: one numpy pass)
    lengths = lengths.astype(np.int64)
    per_piece = max(1, int(budget // grain))
    grains = -(-lengths // grain)
    # A range within the budget stays whole even when its last grain is partial (97 tokens under a 100-token
    # budget is 7 grains of 16, one more than fit).
    return np.where(lengths <= budget, (lengths > 0).astype(np.int64), -(-grains // per_piece))


def modeled_makespan(program_us: np.ndarray, count: np.ndarray, slots: int) -> tuple[float, float]:
    """``(makespan, ideal)`` modeled microseconds of a launch of ``count[i]`` programs of ``program_us[i]`` each on
    ``slots`` program slots in LPT order: the longest programs (within ``LONG_PROGRAM_FRACTION`` of the longest) run
    in whole waves, the others fill the idle slot time of those waves and spread evenly past them; ``ideal`` is all
    programs' time spread evenly over the slots. Equal programs give ``ceil(n / slots)`` waves exactly (what the H100
    showed); a launch of one program is that program. Sums run left to right, as the compiled planner's loops."""
    live = count > 0
    if not live.any():
        return 0.0, 0.0
    us, n = program_us[live], count[live]
    t_max = float(us.max())
    long = us >= LONG_PROGRAM_FRACTION * t_max
    work = n * us
    work_long = float(np.cumsum(work[long])[-1])
    rest = float(np.cumsum(work[~long])[-1]) if (~long).any() else 0.0
    waves = -(-int(n[long].sum()) // slots)
    idle = waves * slots * t_max - work_long
    return waves * t_max + max(0.0, rest - idle) / slots, (work_long + rest) / slots


def _piece_tokens(lengths: np.ndarray, pieces: np.ndarray, grain: int) -> np.ndarray:
    """The longest piece of each range (:func:`prefixattn.planner.work_list._piece_bounds` deals whole grains
    evenly)."""
    grains = -(-lengths // grain)
    return np.minimum(-(-grains // np.maximum(pieces, 1)) * grain, lengths)


def class_split(lengths: np.ndarray, m_tiles, cost, *, block_n: int, num_kv_heads: int, num_sms: int,
                min_split_tokens: int) -> tuple[np.ndarray, int, float, float]:
    """The rule for one work class (module docstring): ``(pieces, grain, makespan_us, ideal_us)``.

    ``lengths`` ``[num_ranges]``: KV tokens of each range; ``m_tiles``: the items that read each range whole (M tiles
    of a shared node's packed rows; 1 for a suffix tile), an array or an int; ``cost``: the class's
    :class:`~prefixattn.autotune.program_cost.ProgramCost`. ``makespan_us`` is the modeled launch
    (:func:`modeled_makespan`), ``ideal_us`` its programs' time over the slots (both modeled).
    """
    lengths = lengths.astype(np.int64, copy=False)
    m = np.asarray(m_tiles, dtype=np.int64)
    tokens = int((lengths * m).sum()) if lengths.shape[0] else 0
    budget = piece_budget(_fair_share_of(tokens, num_kv_heads=num_kv_heads, num_sms=num_sms),
                          min_split_tokens=min_split_tokens, overhead_tokens=cost.fixed_tokens)
    grain = split_grain(block_n, budget)
    pieces = split_pieces(lengths, budget=budget, grain=grain)
    if not lengths.shape[0] or int(lengths.max()) == 0:
        return pieces, grain, 0.0, 0.0
    slots = num_sms * cost.slots_per_sm

    def price(p):
        count = m * num_kv_heads * p
        tile = cost.tile_us * residency(int(count.sum()), num_sms=num_sms, slots_per_sm=cost.slots_per_sm) / \
            cost.slots_per_sm
        us = cost.fixed_us + tile * -(-_piece_tokens(lengths, p, grain) // block_n)
        return modeled_makespan(us, count, slots)

    best, ideal = price(pieces)
    if math.isfinite(budget):
        floor = min_piece(min_split_tokens, cost.fixed_tokens)
        limit = int((m * pieces).sum()) + WAVE_EXTRA_ITEMS_PER_SM * num_sms // num_kv_heads
        grains_max = -(-int(lengths.max()) // grain)
        for k in range(2, WAVE_CANDIDATES + 1):
            b = grain * -(-grains_max // k)
            if b >= budget:
                continue
            if b < floor:
                break
            p = split_pieces(lengths, budget=b, grain=grain)
            if int((m * p).sum()) > limit:
                break
            span, work = price(p)
            if span < best * (1.0 - WAVE_GAIN_MIN):
                pieces, best, ideal = p, span, work
    return pieces, grain, best, ideal


def split_ranges(*, node_lengths: np.ndarray, node_m_tiles: np.ndarray, tile_lengths: np.ndarray, tile_decode,
                 block_n_shared: int, block_n_chunk: int, block_n_decode: int, num_kv_heads: int, num_sms: int,
                 min_split_tokens: int, costs: tuple,
                 decode_kv_heads: int = 1) -> tuple[np.ndarray, int, np.ndarray, tuple, tuple]:
    """The rule for one step, one work class at a time: ``(node_pieces, shared_grain, tile_pieces, tile_grains,
    modeled)``.

    The shared nodes (``node_lengths``/``node_m_tiles`` ``[num_nodes]``: KV tokens of each node and the M tiles of
    packed rows that read it), the chunk tiles and the decode tiles (``tile_lengths`` ``[num_tiles]``, KV tokens of
    each suffix tile; ``tile_decode``: a bool per tile, or one bool for all) are split by :func:`class_split`, each
    class with its own :class:`~prefixattn.autotune.program_cost.ProgramCost` (``costs``: shared, chunk, decode).
    Grains are each class's KV tile (:func:`split_grain`); ``tile_grains``: the chunk class's and the decode
    class's. ``modeled``: ``(makespan_us, ideal_us)`` per class (modeled). A decode program attends
    ``decode_kv_heads`` KV heads (``block_n_decode`` positions of each per step): the decode class has
    ``num_kv_heads // decode_kv_heads`` programs per tile.
    """
    common = dict(num_kv_heads=num_kv_heads, num_sms=num_sms, min_split_tokens=min_split_tokens)
    decode_common = dict(common, num_kv_heads=num_kv_heads // decode_kv_heads)
    node_pieces, shared_grain, *shared_model = class_split(node_lengths, node_m_tiles, costs[0],
                                                           block_n=block_n_shared, **common)
    if not isinstance(tile_decode, np.ndarray):  # one class of suffix tiles
        block_n, cost = (block_n_decode, costs[2]) if tile_decode else (block_n_chunk, costs[1])
        tile_pieces, grain, *model = class_split(tile_lengths, 1, cost, block_n=block_n,
                                                 **(decode_common if tile_decode else common))
        empty = (0.0, 0.0)
        suffix = (empty, tuple(model)) if tile_decode else (tuple(model), empty)
        grains = (block_n_chunk, grain) if tile_decode else (grain, block_n_decode)
        return node_pieces, shared_grain, tile_pieces, grains, (tuple(shared_model), *suffix)
    tile_pieces = np.empty(tile_lengths.shape[0], dtype=np.int64)
    grains, models = [], [tuple(shared_model)]
    for c, is_decode, block_n in ((1, False, block_n_chunk), (2, True, block_n_decode)):
        of = tile_decode == is_decode
        tile_pieces[of], grain, *model = class_split(tile_lengths[of], 1, costs[c], block_n=block_n,
                                                     **(decode_common if is_decode else common))
        grains.append(grain)
        models.append(tuple(model))
    return node_pieces, shared_grain, tile_pieces, tuple(grains), tuple(models)


@dataclass(slots=True)
class Tiles:
    """Suffix tiles (one per ``rows_per_chunk`` rows of each request with queries) as flat arrays: each tile's
    request, its first row within the request, its rows, its first token, its KV range ``[lo, hi)`` and the KV
    position its first row sees; ``first[r]``: the first tile of request ``r``; ``decode``: per tile, whether it is
    of the decode class (its request's rows fit one decode tile), or one bool for all."""

    req: np.ndarray
    first: np.ndarray
    row0: np.ndarray | int
    rows: np.ndarray
    tok0: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    qpos: np.ndarray
    decode: np.ndarray | bool


def suffix_tiles(*, q_start, q_len, kv_len, suffix_start, causal, rows_per_suffix, rows_per_decode) -> Tiles:
    """Tiles of ``rows_per_suffix`` rows (the chunk tile; at least ``rows_per_decode``); a tile's KV range runs from
    its request's ``suffix_start`` to the last position its rows see (causal) or to ``kv_len``."""
    max_q = int(q_len.max()) if q_len.shape[0] else 0
    if max_q > rows_per_suffix:
        tiles_per_req = -(-q_len // rows_per_suffix)
        req, rank = _expand(tiles_per_req)
        row0 = rank * rows_per_suffix
        rows = np.minimum(rows_per_suffix, q_len[req] - row0)
    else:  # decode and short chunks: one tile per request with queries
        tiles_per_req = (q_len > 0).astype(np.int64)
        req, row0 = tiles_per_req.nonzero()[0], 0
        rows = q_len[req]
    first = tiles_per_req.cumsum() - tiles_per_req
    kv = kv_len[req]
    if causal:
        qpos = kv - q_len[req]
        if isinstance(row0, np.ndarray):
            qpos += row0
        hi = qpos + rows
    else:
        hi = qpos = kv  # every row sees the whole range: the causal loop stays empty
    tok0 = q_start[req] + row0 if isinstance(row0, np.ndarray) else q_start[req]
    # A decode step (every request within a decode tile) has no chunk tile: no per-tile flags.
    decode = True if max_q <= rows_per_decode else q_len[req] <= rows_per_decode
    return Tiles(req=req, first=first, row0=row0, rows=rows, tok0=tok0, lo=suffix_start[req], hi=hi, qpos=qpos,
                 decode=decode)


@dataclass(slots=True)
class NodeRows:
    """The shared nodes' packed query rows: per node its rows (its members' query rows) and the M tiles of them;
    per membership (node-major) its query rows and the packed-row offsets (None without nodes, and from the compiled
    split, whose work list counts them itself)."""

    node_rows: np.ndarray
    node_mtiles: np.ndarray
    mem_ql: np.ndarray | None = None
    row_off: np.ndarray | None = None


def node_rows(*, q_len: np.ndarray, nodes, rows_per_shared: int) -> NodeRows:
    """:class:`NodeRows` of ``nodes`` (:class:`~prefixattn.planner.work_list.SharedNodes`)."""
    if len(nodes):
        mem_ql = q_len[nodes.members]
        row_off = offsets(mem_ql)  # packed rows: members' query rows, node by node
        rows = row_off[nodes.offsets[1:]] - row_off[nodes.offsets[:-1]]
    else:
        mem_ql = row_off = None
        rows = nodes.offsets[1:] - nodes.offsets[:-1]
    return NodeRows(node_rows=rows, node_mtiles=-(-rows // rows_per_shared), mem_ql=mem_ql, row_off=row_off)


@dataclass(slots=True)
class SplitPieces:
    """A candidate's suffix tiles and node rows, and the pieces of each node and tile (what the numpy work list
    reads; the compiled one reads :attr:`Split.packed`)."""

    tiles: Tiles
    rows: NodeRows
    node_pieces: np.ndarray
    tile_pieces: np.ndarray


@dataclass(slots=True)
class Split:
    """One sharing candidate cut into pieces and priced: the grains (the shared class's; ``tile_grains``: the chunk
    class's and the decode class's), each work class's modeled launch ``modeled`` ``[NUM_CLASSES, 2]`` (makespan and
    ideal microseconds), the item count of each class as the work list will hold them (``class_ends``: one past each
    class's last item) and its :class:`SplitPieces` (``tiles``, ``rows``, ``node_pieces``, ``tile_pieces`` read
    through). ``packed``: the compiled split's packed tiles, nodes and scalars, what the compiled work list reads
    (None from numpy); ``pieces_of``: the pieces, or (the compiled split) a function that builds them from
    ``packed`` when first read, so a step that reads none builds none."""

    shared_grain: int
    tile_grains: tuple
    modeled: np.ndarray
    class_ends: tuple
    reads_saved: int  # KV positions per KV head the nodes save (shared_reads_saved)
    pieces_of: object
    packed: object = None

    @property
    def pieces(self) -> SplitPieces:
        if not isinstance(self.pieces_of, SplitPieces):
            self.pieces_of = self.pieces_of()
        return self.pieces_of

    @property
    def tiles(self) -> Tiles:
        return self.pieces.tiles

    @property
    def rows(self) -> NodeRows:
        return self.pieces.rows

    @property
    def node_pieces(self) -> np.ndarray:
        return self.pieces.node_pieces

    @property
    def tile_pieces(self) -> np.ndarray:
        return self.pieces.tile_pieces


def split_work(nodes, suffix_start: np.ndarray, *, q_start, q_len, kv_len, causal: bool, rows_per_shared: int,
               rows_per_chunk: int, rows_per_decode: int, block_n_shared: int, block_n_chunk: int,
               block_n_decode: int, num_kv_heads: int, num_sms: int, min_split_tokens: int, costs: tuple,
               decode_kv_heads: int = 1) -> Split:
    """The split stage for one candidate (``nodes``, ``suffix_start``: the node choice's): its suffix tiles, the
    nodes' packed rows, :func:`split_ranges` over them and the resulting item counts per class."""
    t = suffix_tiles(q_start=q_start, q_len=q_len, kv_len=kv_len, suffix_start=suffix_start, causal=causal,
                     rows_per_suffix=rows_per_chunk, rows_per_decode=rows_per_decode)
    nr = node_rows(q_len=q_len, nodes=nodes, rows_per_shared=rows_per_shared)
    n_pieces, grain_shared, t_pieces, t_grains, modeled = split_ranges(
        node_lengths=nodes.kv_end - nodes.kv_start, node_m_tiles=nr.node_mtiles,
        tile_lengths=np.maximum(t.hi - t.lo, 0), tile_decode=t.decode, block_n_shared=block_n_shared,
        block_n_chunk=block_n_chunk, block_n_decode=block_n_decode, num_kv_heads=num_kv_heads, num_sms=num_sms,
        min_split_tokens=min_split_tokens, costs=costs, decode_kv_heads=decode_kv_heads)
    num_shared = int((n_pieces * nr.node_mtiles).sum())
    if isinstance(t.decode, np.ndarray):
        num_decode = int(t_pieces[t.decode].sum())
    else:
        num_decode = int(t_pieces.sum()) if t.decode else 0
    n = num_shared + int(t_pieces.sum())
    return Split(pieces_of=SplitPieces(tiles=t, rows=nr, node_pieces=n_pieces, tile_pieces=t_pieces),
                 shared_grain=grain_shared, tile_grains=t_grains, modeled=np.array(modeled, dtype=np.float64),
                 class_ends=(num_shared, n - num_decode, n), reads_saved=shared_reads_saved(nodes))


def shared_reads_saved(nodes) -> int:
    """KV positions (per KV head) the shared ``nodes`` save against reading each member's prefix on its own: every
    member beyond a node's first reads the node's KV once less."""
    if not len(nodes):
        return 0
    return int(np.dot(nodes.kv_end - nodes.kv_start, nodes.offsets[1:] - nodes.offsets[:-1] - 1))
