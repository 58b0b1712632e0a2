"""The queues of :class:`prefixattn.scheduling.TokenBatcher`: what runs, what is ready to start, what waits.

Requests are slots of the request store and prefix levels ids of the prefix levels
(:mod:`prefixattn.scheduling.batch_state`). Sets are insertion-ordered dicts (the decode order and the victims'
order follow admission); the ready queues are heaps keyed by admission rank, one per memory class.
"""

from __future__ import annotations

import heapq

import numpy as np


class WorkQueues:
    """Pending groups, started requests, ready requests and levels, partial levels.

    Parameters
    ----------
    num_classes : int
        Memory classes (:mod:`prefixattn.scheduling.class_shares`): one ready heap each.
    """

    def __init__(self, num_classes: int) -> None:
        self.groups: list[tuple[list[int], list[int]]] = []  # pending groups: (top levels, top-level slots)
        self.next_group = 0  # the first group not admitted yet
        self.decoding: dict[int, None] = {}  # slots in decode, insertion ordered
        self.prefilling: dict[int, None] = {}  # slots with a partial prefill
        # per memory class, a heap (rank, slot): chain complete, not started
        self.ready: list[list[tuple[int, int]]] = [[] for _ in range(num_classes)]
        self.ready_nodes: list[tuple[int, int]] = []  # heap (rank, level): parent complete, not started
        self.partial_nodes: dict[int, None] = {}  # started levels not yet complete

    def anything_started(self) -> bool:
        return bool(self.decoding or self.prefilling)

    def started_slots(self) -> np.ndarray:
        """``[S]`` int64 the started requests: decoding, then prefilling, each in start order."""
        return np.fromiter([*self.decoding, *self.prefilling], dtype=np.int64)

    def stop(self, s: int) -> None:
        """Slot ``s`` no longer runs (finished, aborted or preempted)."""
        if s in self.decoding:
            del self.decoding[s]
        if s in self.prefilling:
            del self.prefilling[s]

    def push_ready(self, cls: int, rank: int, s: int) -> None:
        heapq.heappush(self.ready[cls], (rank, s))

    def push_ready_node(self, rank: int, v: int) -> None:
        heapq.heappush(self.ready_nodes, (rank, v))

    def next_class(self, held: set[int]) -> int:
        """The class whose ready heap holds the earliest-ranked request, skipping ``held``; -1 when none."""
        best, best_rank = -1, None
        for c, heap in enumerate(self.ready):
            if heap and c not in held and (best_rank is None or heap[0][0] < best_rank):
                best, best_rank = c, heap[0][0]
        return best
