"""Hashes of fixed-size chunks of integer rows (token ids or block ids), as engines hash KV blocks. Numpy only.

Comparing two rows chunk by chunk through one hash per chunk costs one comparison per chunk instead of one per id,
so a sort over rows that share long prefixes (documents read by several queries) does work per distinct chunk, not
per id. Hashing itself is one streaming pass: each chunk's hash is an integer matrix-vector product, which numpy
runs at memory speed.

Each chunk gets two linear hashes, both over 64-bit words (two ids per word) times fixed random odd 64-bit
multipliers, wrapping mod 2**64: ``h0`` over the words ``(id0, id1), (id2, id3), ...`` and ``h1`` over
``(id1, id2), (id3, id4), ..., (id63, 0)``. Why two: a difference in the high id of a word is multiplied by 2**32,
so that hash sees it only through the low 32 bits of its multiplier; every id is a low id in one of the two. For ids
below ``2**k``, two distinct chunks hash alike in both with probability at most about ``2**-(98 - 2k)`` over the
multipliers (``2**-64`` for a 2**17-token vocabulary; ``2**-34`` for arbitrary 32-bit ids). Users that need exact
answers compare ids wherever the hashes differ; equal hashes are trusted.
"""

from __future__ import annotations

import numpy as np

#: Ids per chunk. 64 ids cross a ~1.1k-token document in ~17 comparisons per row; a sort key of 64 uint32 ids
#: (256 bytes) is still cheap to compare where rows diverge. Must be even (two ids per 64-bit word).
CHUNK = 64
#: Chunks hashed per block: bounds the gathered copy at 1M ids (4 MB, cache-sized) whatever the batch size.
_BLOCK_CHUNKS = 1 << 14
#: Fixed seed of the multipliers: hashes (and so any order derived from them) are the same in every run.
_SEED = 0x5EED_C4A5


def _multipliers(chunk: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(_SEED + chunk)
    odd = [rng.integers(0, 2**63, chunk // 2, dtype=np.uint64) * np.uint64(2) + np.uint64(1) for _ in range(2)]
    return odd[0], odd[1]  # odd multipliers: a difference in a low id is never multiplied away


def as_uint32(values: np.ndarray) -> np.ndarray:
    """``values`` (ids in ``[0, 2**32 - 1]``) as a contiguous uint32 array: a view for 4-byte ids, else a copy."""
    values = np.ascontiguousarray(values)
    if values.dtype == np.uint32:
        return values
    if values.dtype == np.int32:
        return values.view(np.uint32)  # ids are >= 0: same bits
    return values.astype(np.uint32)


def _edge_windows(values: np.ndarray, width: int) -> tuple[np.ndarray, int]:
    """Windows of ``width`` ids over the last ``width`` ids of ``values`` followed by zeros; and the offset of its
    first window in ``values``: for chunks too near the end for the plain window view."""
    base = max(0, values.shape[0] - width)
    pad = np.zeros(2 * width, dtype=np.uint32)
    pad[:values.shape[0] - base] = values[base:]
    return np.lib.stride_tricks.sliding_window_view(pad, width)[:width + 1], base


def chunk_hashes(values: np.ndarray, starts: np.ndarray, num_chunks: np.ndarray, chunk: int = CHUNK
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hash the first ``num_chunks[i]`` whole chunks of every row ``i``.

    Parameters
    ----------
    values : np.ndarray
        ``[total]`` uint32 ids of all rows back to back (see :func:`as_uint32`).
    starts : np.ndarray
        ``[N]`` int64 offset of each row's first id in ``values``.
    num_chunks : np.ndarray
        ``[N]`` int64 whole chunks to hash per row; row ``i``'s chunk ``k`` is
        ``values[starts[i] + k * chunk : starts[i] + (k + 1) * chunk]`` and must lie inside ``values``.
    chunk : int
        Ids per chunk (even).

    Returns
    -------
    first : np.ndarray
        ``[N]`` int64 index of row ``i``'s chunk 0 in the hash arrays (its chunks are contiguous there).
    h0, h1 : np.ndarray
        ``[sum(num_chunks)]`` uint64 hashes of each chunk (see the module notes).

    Examples
    --------
    >>> v = np.arange(8, dtype=np.uint32).repeat(2)      # a row of 16 ids: 0, 0, 1, 1, ..., 7, 7
    >>> first, h0, h1 = chunk_hashes(np.concatenate([v, v]), np.array([0, 16]), np.array([2, 2]), chunk=8)
    >>> first.tolist(), bool(h0[0] == h0[2] and h1[0] == h1[2]), bool(h0[0] == h0[1])
    ([0, 2], True, False)
    """
    if chunk % 2:
        raise ValueError(f"chunk: expected an even number of ids (two per 64-bit word), got {chunk}")
    first = np.zeros(num_chunks.shape[0], dtype=np.int64)
    np.cumsum(num_chunks[:-1], out=first[1:])
    total = int(num_chunks.sum())
    h0 = np.empty(total, dtype=np.uint64)
    h1 = np.empty(total, dtype=np.uint64)
    if total == 0:
        return first, h0, h1
    k0, k1 = _multipliers(chunk)
    # Each window holds the chunk plus two ids: the shifted words of h1 need one, and a second keeps every row of
    # the gathered block a whole number of 64-bit words long (aligned word views).
    width = chunk + 2
    inner = max(0, values.shape[0] - width + 1)
    edge, edge_base = _edge_windows(values, width)
    windows = np.lib.stride_tricks.sliding_window_view(values, width) if inner else edge
    # Start of every chunk: row start + k * chunk for k < num_chunks (one repeat, no per-row Python).
    rank = np.arange(total, dtype=np.int64) - np.repeat(first, num_chunks)
    pos = np.repeat(starts, num_chunks) + rank * chunk
    for lo in range(0, total, _BLOCK_CHUNKS):
        hi = min(total, lo + _BLOCK_CHUNKS)
        at = pos[lo:hi]
        near_end = at >= inner
        block = windows[np.where(near_end, 0, at)]  # [b, width] contiguous copy, one memcpy per chunk
        if near_end.any():
            block[near_end] = edge[at[near_end] - edge_base]
        block[:, chunk:] = 0  # the two extra ids belong to the next chunk: not hashed
        np.matmul(block[:, :chunk].view(np.uint64), k0, out=h0[lo:hi])
        np.matmul(block[:, 1:chunk + 1].view(np.uint64), k1, out=h1[lo:hi])
    return first, h0, h1
