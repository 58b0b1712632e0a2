"""What :func:`prefixattn.scheduling.partition_groups` prices and returns: group costs, the assignment, replica loads.

See :mod:`prefixattn.scheduling.partition` for the model (a replica's modeled time is ``compute + memory + critical``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup


class ResourceCost(NamedTuple):
    """A group's cost on two resources plus its serial lower bound, seconds (:mod:`prefixattn.scheduling.partition`).

    Attributes
    ----------
    compute : float
        Throughput-bound time: prefill and decode tokens through the GEMMs at a full batch.
    memory : float
        Memory-bound time: KV read by decode attention.
    critical : float
        Serial floor of the group's longest decode: its output tokens x the time of a one-sequence decode step (the
        weights read once per token), its KV reads apart (they are in ``memory``). Not additive: a replica's is the
        largest of its groups'.
    """

    compute: float
    memory: float
    critical: float = 0.0


GroupCost = Callable[[PrefixGroup], "float | ResourceCost"]

#: A group counts as over the fair share only past this relative margin: float noise must not split a group whose
#: cost equals the fair share (N = 1, or one group per replica).
SPLIT_MARGIN = 1e-9


@dataclass
class Partition:
    """Groups (whole, or pieces of split ones) assigned to replicas.

    Attributes
    ----------
    num_replicas : int
    groups : list[PrefixGroup]
        Every request in exactly one; pieces of a split group keep its ``prefix_len`` (a one-request piece has 0).
    replicas : np.ndarray
        ``[len(groups)]`` int64 replica of each group.
    costs : np.ndarray
        ``[len(groups)]`` float64 cost of each group.
    source : np.ndarray
        ``[len(groups)]`` int64 index, into the groups given to :func:`partition_groups`, of what each came from.
    split : list[int]
        Indices of the given groups that were split (their pieces share ``source``).
    recomputed_tokens : int
        Prompt tokens computed more than once because of splits (each extra piece's copy of the prefix).
    resources : np.ndarray, optional
        Vector costs only: ``[len(groups), 2]`` float64 compute and memory seconds of each group (``costs`` is
        their sum).
    critical : np.ndarray, optional
        Vector costs only: ``[len(groups)]`` float64 serial time of each group's longest request.
    fair : np.ndarray, optional
        Vector costs only: ``[2]`` fair share (``total / N``) of compute and memory of the batch's unsplit groups.
    """

    num_replicas: int
    groups: list
    replicas: np.ndarray
    costs: np.ndarray
    source: np.ndarray
    split: list = field(default_factory=list)
    recomputed_tokens: int = 0
    resources: np.ndarray | None = None
    critical: np.ndarray | None = None
    fair: np.ndarray | None = None

    @property
    def loads(self) -> np.ndarray:
        """``[num_replicas]`` summed cost per replica."""
        return np.bincount(self.replicas, weights=self.costs, minlength=self.num_replicas)

    @property
    def resource_loads(self) -> np.ndarray | None:
        """Vector costs only: ``[num_replicas, 2]`` summed compute and memory seconds per replica."""
        if self.resources is None:
            return None
        return replica_loads(self.resources, self.critical, self.replicas, self.num_replicas)[0]

    @property
    def pressure(self) -> np.ndarray:
        """``[num_replicas]`` each replica's modeled time over the fair time ``total / N`` (the vector model of the
        notes of :mod:`prefixattn.scheduling.partition` for vector costs; ``load / mean load`` otherwise)."""
        if self.resources is None:
            mean = self.total_cost / self.num_replicas
            return self.loads / mean if mean > 0 else np.ones(self.num_replicas)
        loads, crit = replica_loads(self.resources, self.critical, self.replicas, self.num_replicas)
        return replica_pressure(loads, crit, self.fair)

    @property
    def total_cost(self) -> float:
        return float(self.costs.sum())

    @property
    def makespan(self) -> float:
        """Cost of the most-loaded replica (vector costs: fair time x the largest pressure, modeled seconds)."""
        if self.resources is None:
            return float(self.loads.max())
        return float(self.fair.sum() * self.pressure.max())

    @property
    def balance(self) -> float:
        """``makespan / (total cost / N)``: 1.0 is a perfect balance (vector costs: the largest pressure)."""
        if self.resources is not None:
            return float(self.pressure.max())
        mean = self.total_cost / self.num_replicas
        return self.makespan / mean if mean > 0 else 1.0

    @property
    def num_requests(self) -> int:
        return sum(g.num_requests for g in self.groups)

    @property
    def processed_tokens(self) -> int:
        """Prompt tokens the replicas compute with this assignment's sharing (recomputation included)."""
        return sum(g.processed_tokens for g in self.groups)

    @property
    def logical_tokens(self) -> int:
        return sum(g.logical_tokens for g in self.groups)

    def saving_ratio(self) -> float:
        """BatchLLM Eq. 2 over all replicas: ``1 - processed / logical`` prompt tokens."""
        logical = self.logical_tokens
        return 1.0 - self.processed_tokens / logical if logical else 0.0

    def replica_groups(self, replica: int) -> list:
        """The groups of one replica, in prefix-tree order of the batch."""
        idx = np.flatnonzero(self.replicas == replica)
        return [self.groups[i] for i in idx.tolist()]

    def request_replicas(self, num_requests: int | None = None) -> np.ndarray:
        """``[num_requests]`` int64 replica of each request id (-1 where a request is in no group)."""
        n = self.num_requests if num_requests is None else int(num_requests)
        out = np.full(n, -1, dtype=np.int64)
        for g, r in zip(self.groups, self.replicas.tolist()):
            out[np.asarray(g.request_ids, dtype=np.int64)] = r
        return out

    def summary(self) -> dict:
        """Plain numbers: loads, balance, split groups, recomputation, saving ratio."""
        return dict(num_replicas=self.num_replicas, num_groups=len(self.groups), loads=self.loads.tolist(),
                    total_cost=self.total_cost, makespan=self.makespan, balance=self.balance,
                    split_groups=list(self.split), recomputed_tokens=self.recomputed_tokens,
                    saving_ratio=self.saving_ratio(), pressure=self.pressure.tolist(),
                    resource_loads=None if self.resources is None else self.resource_loads.tolist(),
                    requests_per_replica=np.bincount(
                        self.replicas, weights=[g.num_requests for g in self.groups],
                        minlength=self.num_replicas).astype(np.int64).tolist())


def replica_pressure(res: np.ndarray, crit: np.ndarray, fair: np.ndarray, with_memory: bool = True) -> np.ndarray:
    """Pressure of replicas (or candidate replicas) with resource loads ``res`` ``[..., 2]`` and critical times
    ``crit`` ``[...]``: ``(compute + memory + critical) / (C + M)`` (notes of :mod:`prefixattn.scheduling.partition`;
    0 for an all-zero batch). ``with_memory=False`` leaves memory out: only the second start of the search uses it
    (:func:`prefixattn.scheduling.partition_assign.assign_vector`)."""
    f_time = float(fair.sum())
    time = res[..., 0] + (res[..., 1] if with_memory else 0.0) + crit
    return time / f_time if f_time > 0 else np.zeros(res.shape[:-1])


def replica_loads(res: np.ndarray, crit: np.ndarray, rep: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``([n, 2] summed compute/memory, [n] critical time)`` of the replicas under assignment ``rep``."""
    loads = np.zeros((n, 2))
    np.add.at(loads, rep, res)
    rcrit = np.zeros(n)
    np.maximum.at(rcrit, rep, crit)
    return loads, rcrit


# ------------------------------------------------------------------------------------------------ checks, pricing
def check_partition_groups(groups) -> list:
    if isinstance(groups, (PrefixGroup, str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError(f"groups: expected a non-empty list of PrefixGroup, got "
                         f"{type(groups).__name__ if not isinstance(groups, Sequence) else 'an empty list'}")
    seen = set()
    for i, g in enumerate(groups):
        if not isinstance(g, PrefixGroup):
            raise ValueError(f"groups[{i}]: expected a PrefixGroup, got {type(g).__name__}")
        if not g.request_ids:
            raise ValueError(f"groups[{i}]: expected at least one request id, got none")
        dup = seen.intersection(g.request_ids)
        if dup:
            raise ValueError(f"groups[{i}]: expected every request in one group, got request {min(dup)} twice")
        seen.update(g.request_ids)
    return list(groups)


def scalar_costs(groups: list, cost: GroupCost, where: str = "cost") -> np.ndarray:
    out = np.empty(len(groups), dtype=np.float64)
    for i, g in enumerate(groups):
        c = cost(g)
        try:
            c = float(c)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected a number for every group, got {type(c).__name__}") from None
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"{where}: expected a finite cost >= 0 for every group, got {c} for group {i}")
        out[i] = c
    return out


def resource_costs(groups: list, cost: GroupCost, where: str = "cost") -> tuple[np.ndarray, np.ndarray]:
    """``([len(groups), 2] compute/memory, [len(groups)] critical)`` of vector costs, checked."""
    res = np.empty((len(groups), 2), dtype=np.float64)
    crit = np.empty(len(groups), dtype=np.float64)
    for i, g in enumerate(groups):
        c = cost(g)
        if not isinstance(c, ResourceCost):
            raise ValueError(f"{where}: expected a ResourceCost for every group (the first group got one), got "
                             f"{type(c).__name__} for group {i}")
        v = (float(c.compute), float(c.memory), float(c.critical))
        if not all(math.isfinite(x) and x >= 0 for x in v):
            raise ValueError(f"{where}: expected finite costs >= 0 for every group, got {tuple(c)} for group {i}")
        res[i], crit[i] = v[:2], v[2]
    return res, crit
