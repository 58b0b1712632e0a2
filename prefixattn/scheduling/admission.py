"""Memory-centric admission (BatchLLM sec. 4.3, Algorithm 2): may one more request start next to the started ones?

The one definition of the reservation, the KV projection and the admit decision, used by
:class:`prefixattn.scheduling.TokenBatcher` (and so by the simulator's BatchLLM/BlendServe/prefixattn policies) and by
the vLLM scheduler (``prefixattn/integrations/vllm/scheduler.py``): each caller only describes its requests in the two
columns below, in its own memory model; :class:`AdmissionRule` does the rest. Numpy only.

Each request is described by

* ``now``: KV tokens it holds once its pending prefill (or recomputation) is done: its own prompt tokens (after any
  shared prefix, whose blocks the caller counts once per group as ``shared`` blocks) plus its output so far;
* ``more``: output tokens still reserved: its *reserved* output (:meth:`AdmissionRule.reservation`: the estimate,
  at most the request's hard limit, clipped so that a few very long outputs cannot reserve the whole pool, as SGLang
  clips its reservations) less what it generated, at least 0 (:func:`growth`).

Two projections of the started set's KV footprint (:data:`PROJECTIONS`):

* ``"ends"`` (the default everywhere): every request at its end at once, ``sum(blocks(now + more))``: an upper
  bound of the peak, so a started set that fits never preempts while the estimates hold;
* ``"peak"``: requests grow one token per step and free their blocks when they end
  (:func:`projected_peak_blocks`): admits more, and stays preemption-free while the running requests decode every
  step.

A request starts only while the projection of the started set plus it, plus the shared blocks, stays within the
rule's capacity (BatchLLM's ``M_threshold``, in blocks); the first request always may start (nothing else would ever
run it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Projections of the started requests' KV (see the module notes); the first is every caller's default.
PROJECTIONS = ("ends", "peak")


def reserved_output(estimate: float, clip: int | None) -> tuple[int, int]:
    """``(full, reserved)`` output tokens of one request: the estimate rounded up, and that clipped by ``clip``
    (None: unclipped)."""
    full = int(np.ceil(estimate))
    return full, full if clip is None else min(full, clip)


def blocks(tokens, block_size: int):
    """KV blocks holding ``tokens`` (int or int array): ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


def growth(now, reserved, generated):
    """``(now, more)`` columns of requests (ints or equally shaped int arrays): ``now`` as given, ``more`` the
    ``reserved`` output tokens (:meth:`AdmissionRule.reservation`) not yet ``generated``, at least 0."""
    return now, np.maximum(np.asarray(reserved, np.int64) - np.asarray(generated, np.int64), 0)


def ends_blocks(now, more, block_size: int) -> int:
    """Blocks of requests holding ``now`` tokens when every one has grown by its ``more`` tokens (all at their ends
    at once): an upper bound of their peak."""
    return int(blocks(np.asarray(now, np.int64) + np.asarray(more, np.int64), block_size).sum())


def peak_blocks(now, more, block_size: int) -> int:
    """Peak blocks of requests holding ``now`` tokens that each grow one token per step for ``max(more, 1)`` steps
    and then free everything (:func:`projected_peak_blocks`); 0 for no requests."""
    now = np.asarray(now, np.int64)
    if not now.size:
        return 0
    return projected_peak_blocks(now, np.maximum(np.asarray(more, np.int64), 1), block_size)


def projected_peak_blocks(cur: np.ndarray, rem: np.ndarray, block_size: int) -> int:
    """Peak blocks of requests holding ``cur`` tokens that each grow one token per step for ``rem`` (>= 1) more
    steps and then free everything: the peak is just before one of them ends, ``t = rem_j - 1``. The tokens of the
    requests alive at ``t`` are rounded up to blocks together, with one partial block's slack per request (at least
    their blocks counted one by one, at most one block per request more).

    Examples
    --------
    >>> projected_peak_blocks(np.array([10, 10]), np.array([1, 5]), block_size=4)   # 20 tokens at t = 0
    6
    """
    order = np.argsort(rem, kind="stable")
    r, c = rem[order], cur[order]
    alive = np.arange(r.shape[0], 0, -1)  # requests still holding at t = r_j - 1 (rem >= r_j)
    tokens = np.cumsum(c[::-1])[::-1] + alive * (r - 1)
    return int(((tokens + alive * (block_size - 1)) // block_size).max())


#: Blocks of requests under each projection: ``f(now, more, block_size) -> int``.
PROJECT = {"ends": ends_blocks, "peak": peak_blocks}


@dataclass(frozen=True)
class AdmissionRule:
    """BatchLLM Algorithm 2 with one projection: the reservation, the projection and the admit decision.

    Parameters
    ----------
    capacity : float
        Blocks the projected started set may fill (BatchLLM's ``M_threshold``: a fraction of the KV cache).
    block_size : int
        Tokens per KV block.
    projection : {"ends", "peak"}
        How the started requests' KV is projected (see the module notes).
    clip : int, optional
        Cap on each request's output *as a reservation* (SGLang's clip); None: unclipped.

    Examples
    --------
    >>> rule = AdmissionRule(capacity=9, block_size=4, projection="ends")
    >>> started = rule.start(now=[8, 8], more=[8, 4])   # 4 + 3 blocks at their ends; then 3 or 2 more
    >>> started.fits(now=4, more=8, anything_started=True), started.fits(now=4, more=4, anything_started=True)
    (False, True)
    """

    capacity: float
    block_size: int
    projection: str = PROJECTIONS[0]
    clip: int | None = None

    def __post_init__(self) -> None:
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection: expected one of {PROJECTIONS}, got {self.projection!r}")

    def reservation(self, estimate: float, limit: float | None = None) -> tuple[int, int]:
        """``(full, reserved)`` output tokens of a request: its output-length ``estimate`` (at most its hard
        ``limit``, such as ``max_tokens``) rounded up, and that clipped by :attr:`clip`."""
        return reserved_output(estimate if limit is None else min(estimate, limit), self.clip)

    def projected(self, now, more) -> int:
        """Blocks of requests ``(now, more)`` (arrays, one entry each) under this rule's projection."""
        return PROJECT[self.projection](now, more, self.block_size)

    def admits(self, projected: float, candidate: float, anything_started: bool) -> bool:
        """``candidate`` more blocks fit next to the ``projected`` ones within the capacity; the first request
        always starts."""
        return projected + candidate <= self.capacity or not anything_started

    def start(self, now=(), more=(), shared_blocks: int = 0) -> "AdmissionPass":
        """The started requests ``(now, more)`` and their ``shared_blocks`` (prefixes, counted once), as one
        scheduling pass starts more of them (:class:`AdmissionPass`)."""
        return AdmissionPass(self, now, more, shared_blocks)


class AdmissionPass:
    """The started set's projection during one scheduling pass: :meth:`fits` tests a candidate, :meth:`add` counts
    one that started. Under ``"ends"`` the projection is a sum and grows by each start; under ``"peak"`` it is
    recomputed over the started set and the candidate."""

    def __init__(self, rule: AdmissionRule, now, more, shared_blocks: int) -> None:
        self.rule = rule
        self.shared = int(shared_blocks)
        self.is_sum = rule.projection == "ends"
        now, more = np.asarray(now, np.int64).ravel(), np.asarray(more, np.int64).ravel()
        if self.is_sum:
            self.total = rule.projected(now, more)
        else:
            self.now, self.more = now, more

    def projected(self, now=None, more=None) -> int:
        """Blocks of the started set, plus the request ``(now, more)`` when given, shared blocks included."""
        if self.is_sum:
            own = 0 if now is None else int(blocks(int(now) + int(more), self.rule.block_size))
            return self.total + own + self.shared
        cur, rem = self.now, self.more
        if now is not None:
            cur, rem = np.append(cur, int(now)), np.append(rem, int(more))
        return self.rule.projected(cur, rem) + self.shared

    def fits(self, now=None, more=None, *, shared: int = 0, anything_started: bool) -> bool:
        """Whether a request ``(now, more)`` (None: none, only ``shared`` blocks, e.g. a prefix level) and its
        ``shared`` blocks not yet counted may start (the first request always may)."""
        return self.rule.admits(self.projected(now, more), shared, anything_started)

    def add(self, now=None, more=None, *, shared: int = 0) -> None:
        """Count a started request ``(now, more)`` (None: none) and ``shared`` blocks."""
        self.shared += int(shared)
        if now is None:
            return
        if self.is_sum:
            self.total += int(blocks(int(now) + int(more), self.rule.block_size))
        else:
            self.now, self.more = np.append(self.now, int(now)), np.append(self.more, int(more))
