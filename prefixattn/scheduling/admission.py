"""Memory-centric admission (BatchLLM sec. 4.3, Algorithm 2): may one more request start next to the started ones?

One definition shared by :class:`prefixattn.scheduling.TokenBatcher` (and so the simulator) and the vLLM scheduler
(``integrations/vllm/scheduler.py``). Numpy only.

A started request is projected to its estimated end: its prompt plus its *reserved* output (the output-length
estimate, clipped by :func:`reserved_output` so that a few very long outputs cannot reserve the whole pool, as
SGLang clips its reservations), or what it already holds when that is more. The started set's projected footprint
is the sum of those ends (every request at its end at once: an upper bound of the projected peak), and a request
starts only while that sum plus its own end fits the KV budget. The first request always may start (nothing else
would ever run it). :func:`projected_peak_blocks` is the exact peak when requests free their blocks as they end
(used where a share of the pool, not the whole pool, is at stake).
"""

from __future__ import annotations

import numpy as np


def reserved_output(estimate: float, clip: int | None) -> tuple[int, int]:
    """``(full, reserved)`` output tokens of one request: the estimate rounded up, and that clipped by ``clip``
    (None: unclipped)."""
    full = int(np.ceil(estimate))
    return full, full if clip is None else min(full, clip)


def blocks(tokens, block_size: int):
    """KV blocks holding ``tokens`` (int or int array): ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


def end_tokens(held, own, reserved, generated):
    """Tokens a started request holds at its estimated end: its own prompt plus its reserved output (or what it
    has generated, when more), or what it holds now when that is more (a recomputation can hold more).

    Parameters are ints or equally shaped int64 arrays: tokens ``held`` now, ``own`` prompt tokens (after any
    shared prefix counted elsewhere), ``reserved`` output tokens (:func:`reserved_output`), ``generated`` so far.
    """
    return np.maximum(held, own + np.maximum(reserved, generated))


def projected_blocks(held, own, reserved, generated, block_size: int) -> int:
    """Blocks the started requests (arrays, one entry each) hold when every one is at its estimated end."""
    ends = end_tokens(np.asarray(held, np.int64), np.asarray(own, np.int64), np.asarray(reserved, np.int64),
                      np.asarray(generated, np.int64))
    return int(blocks(ends, block_size).sum())


def admits(projected: int, candidate: int, capacity: float, anything_started: bool) -> bool:
    """Algorithm 2's test: ``candidate`` more blocks fit next to the ``projected`` ones within ``capacity``; the
    first request always starts."""
    return projected + candidate <= capacity or not anything_started


def projected_peak_blocks(cur: np.ndarray, rem: np.ndarray, block_size: int) -> int:
    """Peak blocks of requests holding ``cur`` tokens that each grow one token per step for ``rem`` (>= 1) more
    steps and then free everything: the peak is just before one of them ends, ``t = rem_j - 1``.

    Examples
    --------
    >>> projected_peak_blocks(np.array([10, 10]), np.array([1, 5]), block_size=4)   # 10 + 14 tokens at t = 4
    6
    """
    order = np.argsort(rem, kind="stable")
    r, c = rem[order], cur[order]
    alive = np.arange(r.shape[0], 0, -1)  # requests still holding at t = r_j - 1 (rem >= r_j)
    tokens = np.cumsum(c[::-1])[::-1] + alive * (r - 1)
    return int(((tokens + alive * (block_size - 1)) // block_size).max())
