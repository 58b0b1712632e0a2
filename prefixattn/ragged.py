"""Small numpy helpers for ragged (run-length) arrays and grouped orders, shared by the planner's modules (and the
simulator's model of the planner's issue order).

Written for the host planner's per-call cost: each is one or two numpy calls on small arrays (``np.r_`` and
``np.diff(..., append=)`` go through Python-level machinery that costs 5-20 us per call on the 2-core host).
"""

from __future__ import annotations

import numpy as np


def offsets(counts: np.ndarray) -> np.ndarray:
    """``[0, cumsum(counts)]`` as int64 (``len(counts) + 1`` entries)."""
    out = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    """``cumsum(x) - x`` as int64."""
    out = np.zeros(x.shape[0], dtype=np.int64)
    if x.shape[0] > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def run_starts(x: np.ndarray) -> np.ndarray:
    """Mask of the positions where ``x`` differs from the previous position (position 0 always starts a run)."""
    out = np.empty(x.shape[0], dtype=bool)
    out[:1] = True
    np.not_equal(x[1:], x[:-1], out=out[1:])
    return out


def run_lengths(starts: np.ndarray, total: int) -> np.ndarray:
    """Lengths of the runs starting at the (ascending) positions ``starts`` of an array of ``total`` entries."""
    out = np.empty(starts.shape[0], dtype=np.int64)
    if starts.shape[0]:
        np.subtract(starts[1:], starts[:-1], out=out[:-1])
        out[-1] = total - starts[-1]
    return out


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(n) for n in lengths)`` without a Python loop."""
    total = int(lengths.sum())
    if total == 0 or lengths.max() <= 1:  # decode batches and unsplit ranges: all zeros, skip the repeat
        return np.zeros(total, dtype=np.int64)
    return np.arange(total, dtype=np.int64) - exclusive_cumsum(lengths).repeat(lengths)


def expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, rank)``: entry ``i`` repeated ``counts[i]`` times, and each copy's index within its entry
    (``np.repeat(arange, counts)`` and :func:`ragged_arange`), with no repeat when every count is 0 or 1 (decode
    rows, unsplit ranges, single-tile nodes: the common case)."""
    if counts.shape[0] and counts.max() > 1:
        return np.arange(counts.shape[0], dtype=np.int64).repeat(counts), ragged_arange(counts)
    owner = counts.nonzero()[0]
    return owner, np.zeros(owner.shape[0], dtype=np.int64)


def runs_longest_first(length: np.ndarray, group: np.ndarray, within: np.ndarray | None = None) -> np.ndarray:
    """The order that issues the longest first with each group's entries together: every group at the place of its
    longest entry (groups of equal longest by id), longest first inside a group, ties by index; ``within``
    (optional, non-negative ints): a key before all (each value ordered apart, ascending). ``length``: ``[n]``,
    non-negative; ``group``: ``[n]`` non-negative int64 ids below 2^32 (an entry alone: an id of its own).
    Returns the ``[n]`` permutation (the planner's prefix runs and the simulator's ``runs-longest-first``)."""
    key = group if within is None else (within.astype(np.int64) << 32) + group
    _, inverse = np.unique(key, return_inverse=True)
    longest = np.zeros(inverse.max(initial=-1) + 1, dtype=length.dtype)
    np.maximum.at(longest, inverse, length)
    keys = (np.arange(length.shape[0]), -length, group, -longest[inverse])
    return np.lexsort(keys if within is None else keys + (within,))
