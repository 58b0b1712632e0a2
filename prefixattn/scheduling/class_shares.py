"""Memory classes for :class:`prefixattn.scheduling.TokenBatcher` (BlendServe's dual scanner, sec. 3.4).

Each request has a class (e.g. compute-intensive 0, memory-intensive 1) and each class a share of the KV blocks
(``M_L + M_R = M``). While requests of another class wait to start, a request starts only if its class's *projected
peak* (the started requests of the class plus this one, each growing by one token per step until its estimated
output is done, then freeing its blocks) stays within the class's share; the first request of a class always may
start. The projections are :mod:`prefixattn.scheduling.admission`'s: a class fits when its ``ends`` or else its
``peak`` projection does, whichever projection the global admission uses. With a reservation clip the projection is
a rolling horizon: each request grows for at most ``clip`` more steps from now, so a long output that has used up
its clipped reservation still counts as growing, not as about to end. (The module is not named ``memory_classes``:
that is :func:`prefixattn.scheduling.memory_classes`, which assigns the classes.)
"""

from __future__ import annotations

import numpy as np

from prefixattn.scheduling.admission import ends_blocks, peak_blocks
from prefixattn.scheduling.batch_state import RequestStore


class ClassShares:
    """Per-class counts of waiting and started requests and the admission test against the class shares.

    Parameters
    ----------
    memory_classes : array-like of int or None
        Class of each request id (``0 .. K-1``; ids beyond the array are class 0).
    class_shares : sequence of float or None
        ``[K]`` fraction of the KV blocks each class may fill while another class waits; both None: one class, no
        limit.
    """

    def __init__(self, memory_classes, class_shares) -> None:
        self.classes, self.shares = _check_classes(memory_classes, class_shares)
        k = 1 if self.shares is None else self.shares.shape[0]
        self.waiting = np.zeros(k, np.int64)  # requests of each class not started (waiting or preempted)
        self.started: list[dict[int, None]] = [{} for _ in range(k)]  # started slots of each class

    @property
    def num_classes(self) -> int:
        return self.waiting.shape[0]

    def class_of(self, request_id: int) -> int:
        if self.classes is not None and request_id < self.classes.shape[0]:
            return int(self.classes[request_id])
        return 0

    def admits(self, req: RequestStore, s: int, kv_blocks: int, block_size: int, clip: int | None) -> bool:
        """Whether waiting request ``s`` may start under its class's share (always, without classes)."""
        if self.shares is None:
            return True
        c = int(req.cls[s])
        started = self.started[c]
        if not started:
            return True  # every class may run one request: none starves behind another class's work
        if not any(n > 0 for k, n in enumerate(self.waiting.tolist()) if k != c):
            return True  # nothing of another class waits: the share would only leave memory idle
        cap = self.shares[c] * kv_blocks
        idx = np.array([*started, s], dtype=np.int64)
        cur = np.maximum(req.computed[idx], req.target[idx])  # a partial prefill counts as complete
        # a rolling horizon: a long output past its clipped reservation still grows for up to `clip` more steps
        rem = req.est_full[idx] - req.generated[idx]
        if clip is not None:
            rem = np.minimum(rem, clip)
        rem = np.maximum(rem, 1)
        # the admission rule's two projections: everyone at its end at once (cheap) or else the peak
        return ends_blocks(cur, rem, block_size) <= cap or peak_blocks(cur, rem, block_size) <= cap


def _check_classes(memory_classes, class_shares):
    if memory_classes is None and class_shares is None:
        return None, None
    if memory_classes is None or class_shares is None:
        raise ValueError("memory_classes: expected memory_classes and class_shares together, got only "
                         f"{'class_shares' if memory_classes is None else 'memory_classes'}")
    shares = np.asarray(class_shares, dtype=np.float64)
    if shares.ndim != 1 or shares.size == 0 or not np.isfinite(shares).all() or (shares < 0).any() \
            or (shares > 1).any():
        raise ValueError(f"class_shares: expected a 1-D sequence of fractions in [0, 1], got {class_shares!r}")
    classes = np.asarray(memory_classes)
    if classes.ndim != 1 or not np.issubdtype(classes.dtype, np.integer) and classes.size:
        raise ValueError("memory_classes: expected a 1-D array of int classes (one per request id)")
    classes = classes.astype(np.int64)
    if classes.size and (classes.min() < 0 or classes.max() >= shares.size):
        raise ValueError(f"memory_classes: expected classes in [0, {shares.size}) (one share per class), got "
                         f"{int(classes[(classes < 0) | (classes >= shares.size)][0])}")
    return classes, shares
