"""The split-k rule: split a KV range when its program would read more than the launch's fair share per SM.

Numpy only. A launch runs every work item once per KV head; a program's cost is the KV tokens it reads (a SHARED
item reads its node's KV once for all its packed rows). The *fair share* is the launch's total KV work over the SMs,
``sum(tokens x programs) / num_sms``; it does not change with splitting (pieces read the same tokens). The
*critical path* is the longest program's tokens over the fair share: no schedule of the launch finishes before
``critical_path x fair share``, and with every program at most the fair share the LPT order (longest first) fills the
SMs evenly. Counting programs instead (split only while ``items x kv_heads < num_sms``) left one program at 13.2x the
fair share for 32 decodes under an 8,192-token prefix (GQA 32:4, sm90 tiles, 132 SMs).

Rule (:func:`piece_budget`, :func:`split_pieces`): every range longer than the budget ``SPLIT_TOLERANCE x fair
share`` is cut into the fewest pieces of whole KV tiles that keep each piece within the budget; pieces of one range
are merged by the last of them to finish. Each work class (shared nodes, chunk tiles, decode tiles) is its own launch:
it is balanced against its own fair share, in its own KV tile width.
"""

from __future__ import annotations

import math

import numpy as np

#: The bound the issue sets on the critical path (sm90, 132 SMs, Fig. 8 shapes and FlashInfer's cascade grid).
CRITICAL_PATH_TARGET = 1.25
#: A program may read up to this multiple of the fair share before its range is split. Above 1: a range a little over
#: the fair share is left whole (a split adds a program start, a partial state and a merge read to save a few
#: percent; with LPT order the other SMs absorb the excess). Below CRITICAL_PATH_TARGET: pieces are cut to at most
#: this budget, so the target holds with 4% to spare for the fixed cost below, which the KV-only ratio ignores.
SPLIT_TOLERANCE = 1.2
#: Fixed cost of one program in KV tokens of one head (estimate, not measured: no GPU run yet). H100: one SM's share
#: of DRAM bandwidth is ~25 GB/s, ~50 tokens/us at head_dim 128 bf16 (512 B per token, K and V). A program start with
#: its first dependent loads (item row, block ids, then K) is ~0.5 us when two programs share an SM, ~25 tokens; a
#: decode piece's partial state (GQA 4: 4 x 129 fp32, written then read by the merge) is ~8 tokens.
PROGRAM_OVERHEAD_TOKENS = 32
#: A piece reads at least this many times the fixed cost: below it a split mostly buys program starts and merges.
MIN_PIECE_OVERHEADS = 2


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


def piece_budget(fair: float, *, min_split_tokens: int) -> float:
    """Most KV tokens one piece may read: ``SPLIT_TOLERANCE x fair``, raised toward ``min_split_tokens`` only as far as
    ``CRITICAL_PATH_TARGET x fair`` (that floor never breaks the target), and never below ``MIN_PIECE_OVERHEADS x
    PROGRAM_OVERHEAD_TOKENS`` (64 tokens; or ``min_split_tokens`` if smaller, as tests ask for tiny pieces): in a
    launch whose fair share is below ~51 tokens the target yields to the programs' fixed cost. ``inf`` for an empty
    launch."""
    if fair <= 0:
        return float("inf")
    budget = max(SPLIT_TOLERANCE * fair, min(min_split_tokens, CRITICAL_PATH_TARGET * fair))
    return max(budget, min(min_split_tokens, MIN_PIECE_OVERHEADS * PROGRAM_OVERHEAD_TOKENS))


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
    evenly (:func:`prefixattn.work_list._piece_bounds`: pieces differ by at most one grain, so ``ceil(grains /
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


def critical_path(kv_lengths: np.ndarray, *, num_kv_heads: int, num_sms: int) -> float:
    """The longest program's KV tokens over the fair share, from the items' KV lengths (0.0 for no items)."""
    if kv_lengths.size == 0:
        return 0.0
    fair = fair_share(kv_lengths, None, num_kv_heads=num_kv_heads, num_sms=num_sms)
    return float(kv_lengths.max()) / fair if fair > 0 else 0.0


def split_ranges(*, node_lengths: np.ndarray, node_m_tiles: np.ndarray, tile_lengths: np.ndarray, tile_decode,
                 block_n_shared: int, block_n_chunk: int, block_n_decode: int, num_kv_heads: int, num_sms: int,
                 min_split_tokens: int) -> tuple[np.ndarray, int, np.ndarray, int | np.ndarray]:
    """The rule for one step, one work class at a time: ``(node_pieces, shared_grain, tile_pieces, tile_grain)``.

    Each class is its own launch and has the whole GPU to itself, so each is balanced against its own fair share:
    the shared nodes (``node_lengths``/``node_m_tiles`` ``[num_nodes]``: KV tokens of each node and the M tiles of
    packed rows that read it), the chunk tiles and the decode tiles (``tile_lengths`` ``[num_tiles]``, KV tokens of
    each suffix tile; ``tile_decode``: a bool per tile, or one bool for all). Grains are each class's KV tile
    (:func:`split_grain`); ``tile_grain`` is an int when every tile is of one class, else an array per tile.
    """
    shared_tokens = int((node_lengths * node_m_tiles).sum()) if node_lengths.shape[0] else 0
    node_pieces, shared_grain = _class_pieces(node_lengths, shared_tokens, block_n_shared, num_kv_heads=num_kv_heads,
                                              num_sms=num_sms, min_split_tokens=min_split_tokens)
    common = dict(num_kv_heads=num_kv_heads, num_sms=num_sms, min_split_tokens=min_split_tokens)
    if not isinstance(tile_decode, np.ndarray):  # one class of suffix tiles
        block_n = block_n_decode if tile_decode else block_n_chunk
        tile_pieces, grain = _class_pieces(tile_lengths, int(tile_lengths.sum()), block_n, **common)
        return node_pieces, shared_grain, tile_pieces, grain
    tile_pieces = np.empty(tile_lengths.shape[0], dtype=np.int64)
    tile_grain = np.empty(tile_lengths.shape[0], dtype=np.int64)
    for is_decode, block_n in ((False, block_n_chunk), (True, block_n_decode)):
        of = tile_decode == is_decode
        lengths = tile_lengths[of]
        tile_pieces[of], tile_grain[of] = _class_pieces(lengths, int(lengths.sum()), block_n, **common)
    return node_pieces, shared_grain, tile_pieces, tile_grain


def _class_pieces(lengths: np.ndarray, tokens: int, block_n: int, *, num_kv_heads: int, num_sms: int,
                  min_split_tokens: int) -> tuple[np.ndarray, int]:
    """Pieces per range and the grain of one class whose programs read ``tokens`` KV tokens in all (one head)."""
    fair = _fair_share_of(tokens, num_kv_heads=num_kv_heads, num_sms=num_sms)  # one rounding, as one sum
    budget = piece_budget(fair, min_split_tokens=min_split_tokens)
    grain = split_grain(block_n, budget)
    return split_pieces(lengths, budget=budget, grain=grain), grain
