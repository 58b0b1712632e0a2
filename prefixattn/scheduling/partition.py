"""Prefix-affinity data parallelism: whole prefix groups to N engine replicas, balancing their cost.

Sharding an offline batch by row (round-robin) or at random splits every prefix group across the replicas, so every
replica recomputes every shared prefix: with share degree ~7 and 8 replicas most of BatchLLM's saving is gone.
:func:`partition_groups` assigns whole groups (from :func:`prefixattn.scheduling.group_prompts`) instead:

1. **Split only what must be split.** The fair share of a replica is ``total cost / N``. A group whose cost alone
   exceeds it cannot fit any assignment that meets the fair share; only such groups are split. Every piece is a
   contiguous run of the group's requests (prefix-tree order, so nested groups stay together as far as possible)
   that keeps the shared prefix and computes it once more: those tokens are counted in
   :attr:`Partition.recomputed_tokens`. Nothing else is ever split, and a split is kept only when it lowers the
   makespan below that of the best whole-group assignment (a split of a small group can cost more than it evens).
2. **LPT** for the whole groups: in decreasing cost, each to the least-loaded replica (Graham's bound: makespan
   <= 4/3 of the optimum).
3. **Spread** the split groups over every replica, one piece each, sized to the replica's room below a common
   level (equal pieces when the whole groups are balanced), so each replica keeps the batch's mix of compute- and
   memory-heavy work (BlendServe sec. 6.1). (``split="fill"``
   instead water-fills: the fewest pieces topping the least-loaded replicas up to one level, least recomputation,
   but a replica may end up with one kind of work only.)
4. **Refinement.** While it lowers the most-loaded replica: move one of its groups to another replica, or swap one
   of its groups with a cheaper group of another replica (the pair that lowers the pair's maximum most). Pieces of
   one split group that end on the same replica are merged back (no recomputation there).

The cost of a group is the caller's: a callable ``cost(group) -> float``. :func:`token_cost` is a dependency-free
proxy (prefill tokens after sharing plus weighted decode tokens); :class:`prefixattn.sim.group_cost.GroupCostModel`
turns the simulator's per-step cost model into one (modeled seconds). Everything here is deterministic: ties go to
the lower group index and the lower replica index.

**Two resources and a floor.** One number per group cannot balance a batch that mixes compute-heavy groups (long
prompts, short outputs) with memory-heavy ones (long outputs whose decode reads a large KV cache): on BlendServe
Trace #1 two replicas with equal summed cost differ by 25% in simulated time when one holds the long-output (video)
groups. A cost that returns a :class:`ResourceCost` (:meth:`prefixattn.sim.group_cost.GroupCostModel.resources`:
``compute`` and ``memory`` seconds and ``critical``, the serial floor of the group's longest decode) switches to
the vector model. A replica's modeled time is

    ``compute_r + memory_r + critical_r``

with ``critical_r`` the largest floor among its groups (not a sum): that request advances one token per step
whatever the batch, and once the rest of the replica's work is done each of its steps still pays a weight read. The
terms add up because the engine runs a step's operators one after the other (GEMMs compute-bound, decode attention
memory-bound). The simulator agrees within ~5% per replica (Trace #1, N = 2 to 16), where ``max(compute, memory)``
does not: the replica holding every video decode at N = 2 has the *smaller* max (827 s vs 1133 s) and is the slower
one (1763 s vs 1403 s; the floor adds 294 s to it). Balancing each resource against its own fair share on top
(``max(compute_r / C, memory_r / M, time_r / F)``) was tried and gave higher simulated makespans at N = 8 and 16
(529 s vs 498 s, 358 s vs 345 s): a replica holding only compute-heavy work is not slower than its sum. The pressure
of a replica is its modeled time over the fair time ``F = (sum compute + sum memory) / N``; the modeled makespan is
``F x`` the largest pressure (above 1.0 when a floor exceeds the fair time: no assignment can do better than the
longest decode).

The two resources decide what is split: a group above the fair share of either (``compute > sum compute / N`` or
``memory > sum memory / N``) is cut into pieces of at most :data:`PIECE_SHARE` of a fair share of each (at
nested-group boundaries where possible), so the memory-heavy groups are spread. Everything is placed greedily
(largest modeled time first, each item to the replica whose pressure it raises least), from two starts (see
:func:`_assign_vector`), then refined by moves and swaps between any two replicas that lower the larger of the two
pressures; the better result is kept. Pieces of one group that end on one replica are merged back, so a split group
recomputes its prefix at most once per replica that holds a piece of it.

Baselines: :func:`shard_requests` (round-robin, random) and :func:`sharded_saving_ratio`, the saving ratio N
independent engines reach when each groups only its own share of the batch.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup, group_prompts, saving_ratio
from prefixattn.scheduling.sequences import pack_sequences


class ResourceCost(NamedTuple):
    """A group's cost on two resources plus its serial lower bound, seconds (see the module notes).

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
_SPLIT_MARGIN = 1e-9
#: Refinement steps at most per replica: each accepted step lowers the makespan or the number of replicas at the
#: makespan, so this only bounds pathological inputs.
_REFINE_STEPS_PER_REPLICA = 64
#: A move or swap must lower the most-loaded replica by more than this fraction of the mean load to be taken
#: (no churn on float noise).
_REFINE_MIN_GAIN = 1e-12
#: Vector costs: a move or swap must lower the pair's pressure by more than this (a fraction of the fair time):
#: the pairwise search touches every replica, and steps of a few ppm only churn (many replicas pinned by their
#: serial floor can otherwise trade thousands of such steps at N = 64).
_REFINE_MIN_GAIN_VECTOR = 1e-4

#: Vector costs: a group above a fair share is cut into pieces of at most this fraction of a fair share (of each
#: resource), fine enough for the moves and swaps to even out both resources to within a few percent.
PIECE_SHARE = 0.125

SHARDINGS = ("round-robin", "random")
SPLIT_MODES = ("spread", "fill")


def token_cost(output_lens=None, *, decode_weight: float = 1.0) -> GroupCost:
    """A cost proxy without a model: prefill tokens after sharing + ``decode_weight`` x output tokens.

    Parameters
    ----------
    output_lens : array-like of int, optional
        ``[num_requests]`` (expected) output tokens per request id; None counts prefill only.
    decode_weight : float
        Cost of one decode token relative to one prefill token (decode is memory-bound: a token costs more).

    Returns
    -------
    callable
        ``cost(group) -> float``.

    Examples
    --------
    >>> g = PrefixGroup(prefix_len=4, request_ids=[0, 1], prompt_lens=[6, 9])
    >>> token_cost()(g), token_cost([10, 20], decode_weight=2.0)(g)
    (11.0, 71.0)
    """
    if not isinstance(decode_weight, (int, float)) or not math.isfinite(decode_weight) or decode_weight < 0:
        raise ValueError(f"decode_weight: expected a finite number >= 0, got {decode_weight!r}")
    outs = None
    if output_lens is not None:
        outs = np.asarray(output_lens, dtype=np.float64)
        if outs.ndim != 1 or (outs < 0).any() or not np.isfinite(outs).all():
            raise ValueError(f"output_lens: expected a 1-D array of token counts >= 0, got shape {outs.shape}")

    def cost(group: PrefixGroup) -> float:
        c = float(group.processed_tokens)
        if outs is not None:
            c += decode_weight * float(outs[np.asarray(group.request_ids, dtype=np.int64)].sum())
        return c

    return cost


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
        return _replica_loads(self.resources, self.critical, self.replicas, self.num_replicas)[0]

    @property
    def pressure(self) -> np.ndarray:
        """``[num_replicas]`` each replica's modeled time over the fair time ``total / N`` (the vector model of the
        module notes for vector costs; ``load / mean load`` otherwise)."""
        if self.resources is None:
            mean = self.total_cost / self.num_replicas
            return self.loads / mean if mean > 0 else np.ones(self.num_replicas)
        return _pressure(*_replica_loads(self.resources, self.critical, self.replicas, self.num_replicas), self.fair)

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


# ---------------------------------------------------------------------------------------------------- splitting
def _restrict(group: PrefixGroup, keep: set, top: bool) -> PrefixGroup | list | None:
    """``group`` limited to the requests in ``keep`` (order kept). A nested group left with one request dissolves
    into its parent (returned as ``[request_id]``); a top-level one becomes a singleton with ``prefix_len`` 0."""
    ids = [r for r in group.request_ids if r in keep]
    if not ids:
        return None
    if len(ids) == 1 and not top:
        return ids
    lens = dict(zip(group.request_ids, group.prompt_lens))
    children = []
    for c in group.children:
        sub = _restrict(c, keep, top=False)
        if isinstance(sub, PrefixGroup):
            children.append(sub)
    single = len(ids) == 1
    return PrefixGroup(prefix_len=0 if single else group.prefix_len, request_ids=ids,
                       prompt_lens=[lens[r] for r in ids], children=[] if single else children,
                       parent_prefix_len=group.parent_prefix_len, dfs_rank=group.dfs_rank)


def _piece(group: PrefixGroup, lo: int, hi: int) -> PrefixGroup:
    return _restrict(group, set(group.request_ids[lo:hi]), top=True)


def _cut(group: PrefixGroup, lo: int, budget: float, cost: GroupCost) -> tuple[PrefixGroup, int]:
    """The longest run ``request_ids[lo:hi]`` of ``group`` (as a piece keeping its prefix) costing at most
    ``budget``, one request at least; returns ``(piece, hi)``. Bisection: ``cost`` must not decrease when requests
    are added."""
    n = group.num_requests
    best_hi = lo + 1
    a, b = lo + 1, n
    while a <= b:
        mid = (a + b) // 2
        if cost(_piece(group, lo, mid)) <= budget:
            best_hi, a = mid, mid + 1
        else:
            b = mid - 1
    return _piece(group, lo, best_hi), best_hi


def _split_weighted(group: PrefixGroup, weights: Sequence[float], cost: GroupCost) -> list:
    """``group`` cut into ``len(weights)`` contiguous runs whose costs are about proportional to ``weights``
    (bisection on the leading run's cost; every run keeps one request at least, so a run may be None when the
    group has fewer requests than weights)."""
    n = group.num_requests
    w = np.asarray(weights, dtype=np.float64)
    k = w.shape[0]
    whole = cost(group)
    frac = np.cumsum(w) / w.sum()
    cuts = [0]
    for q in range(1, k):
        if cuts[-1] >= n:
            cuts.append(n)
            continue
        lo, hi = cuts[-1] + 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(_piece(group, 0, mid)) >= whole * frac[q - 1]:
                hi = mid
            else:
                lo = mid + 1
        cuts.append(min(lo, n))
    cuts.append(n)
    return [_piece(group, a, b) if b > a else None for a, b in zip(cuts[:-1], cuts[1:])]


def _water_level(loads: np.ndarray, extra: float) -> float:
    """Level ``T`` with ``sum(max(0, T - loads)) == extra``: filling the least-loaded replicas up to it."""
    srt = np.sort(loads)
    level = srt[0] + extra
    for m in range(1, srt.shape[0] + 1):
        level = (extra + float(srt[:m].sum())) / m
        if m == srt.shape[0] or level <= srt[m]:
            break
    return level


def _check_groups(groups) -> list:
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


def _costs(groups: list, cost: GroupCost, where: str = "cost") -> np.ndarray:
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


# ---------------------------------------------------------------------------------------------------- assignment
def _lpt(costs: np.ndarray, n: int, loads=None) -> np.ndarray:
    order = sorted(range(costs.shape[0]), key=lambda i: (-costs[i], i))
    heap = [(0.0 if loads is None else float(loads[r]), r) for r in range(n)]
    heapq.heapify(heap)
    out = np.empty(costs.shape[0], dtype=np.int64)
    for i in order:
        load, r = heapq.heappop(heap)
        out[i] = r
        heapq.heappush(heap, (load + float(costs[i]), r))
    return out


def _refine(costs: np.ndarray, rep: np.ndarray, n: int) -> np.ndarray:
    """Moves and swaps out of the most-loaded replica while they lower it (see the module notes)."""
    rep = rep.copy()
    loads = np.bincount(rep, weights=costs, minlength=n)
    min_gain = _REFINE_MIN_GAIN * max(float(loads.mean()), 1e-300)
    for _ in range(_REFINE_STEPS_PER_REPLICA * n):
        a = int(np.argmax(loads))
        mine = np.flatnonzero(rep == a)
        best = None  # (new max of the two replicas, kind, i, j, b)
        for b in np.argsort(loads, kind="stable").tolist():
            if b == a:
                continue
            gap = loads[a] - loads[b]
            if gap <= min_gain:
                break
            ca = costs[mine]
            # move: one group of a with 0 < c < gap
            ok = (ca > 0) & (ca < gap)
            if ok.any():
                new = np.maximum(loads[a] - ca, loads[b] + ca)
                new[~ok] = np.inf
                i = int(np.argmin(new))
                if best is None or new[i] < best[0] - min_gain:
                    best = (float(new[i]), "move", int(mine[i]), -1, b)
            theirs = np.flatnonzero(rep == b)
            if theirs.size:
                d = ca[:, None] - costs[theirs][None, :]
                ok = (d > 0) & (d < gap)
                if ok.any():
                    new = np.maximum(loads[a] - d, loads[b] + d)
                    new[~ok] = np.inf
                    i, j = np.unravel_index(int(np.argmin(new)), new.shape)
                    if best is None or new[i, j] < best[0] - min_gain:
                        best = (float(new[i, j]), "swap", int(mine[i]), int(theirs[j]), b)
        if best is None or best[0] >= loads[a] - min_gain:
            break
        _, kind, i, j, b = best
        rep[i] = b
        loads[a] -= costs[i]
        loads[b] += costs[i]
        if kind == "swap":
            rep[j] = a
            loads[b] -= costs[j]
            loads[a] += costs[j]
    return rep


def _merge_pieces(groups: list, source: np.ndarray, rep: np.ndarray, originals: list, cost: GroupCost):
    """Pieces of one split group that landed on one replica become one piece again."""
    keyed: dict = {}
    for i, (s, r) in enumerate(zip(source.tolist(), rep.tolist())):
        keyed.setdefault((s, r), []).append(i)
    if all(len(v) == 1 for v in keyed.values()):
        return groups, source, rep, None
    out_g, out_s, out_r = [], [], []
    for (s, r), idx in sorted(keyed.items(), key=lambda kv: kv[1][0]):
        if len(idx) == 1:
            out_g.append(groups[idx[0]])
        else:
            members = {m for i in idx for m in groups[i].request_ids}
            out_g.append(_restrict(originals[s], members, top=True))
        out_s.append(s)
        out_r.append(r)
    return (out_g, np.asarray(out_s, dtype=np.int64), np.asarray(out_r, dtype=np.int64),
            None if cost is None else _costs(out_g, cost))


def partition_groups(groups: Sequence[PrefixGroup], num_replicas: int, cost: GroupCost | None = None, *,
                     allow_split: bool = True, split: str = "spread", refine: bool = True) -> Partition:
    """Assign prefix groups to ``num_replicas`` engine replicas, minimizing the most-loaded replica's cost.

    Parameters
    ----------
    groups : Sequence[PrefixGroup]
        Top-level groups, e.g. from :func:`prefixattn.scheduling.group_prompts` (any nesting depth); every request in
        exactly one.
    num_replicas : int
        ``N >= 1``.
    cost : callable, optional
        ``cost(group) -> float`` (finite, >= 0, not decreasing when requests are added), or
        ``cost(group) -> ResourceCost`` for the two-resource model of the module notes (e.g.
        ``GroupCostModel(...).resources``): compute and memory balanced each against its fair share, the serial
        floor of long decodes respected, and the ``Partition`` reports ``resources``/``pressure``. Default:
        :func:`token_cost` (prefill tokens after sharing).
    allow_split : bool
        Split groups that alone exceed the fair share ``total / N`` (default). With False groups are never split and
        the makespan is at least the largest group's cost.
    split : {"spread", "fill"}
        How a forced split is cut (scalar costs; a ``ResourceCost`` cost always cuts fine pieces, see the notes).
        ``spread`` (default): one piece per replica, sized to the replica's room below a common level once the whole
        groups are placed, so every replica gets a share of the group and keeps the batch's mix of compute- and
        memory-heavy work (BlendServe sec. 6.1: each data-parallel block keeps the root's compute density).
        ``fill``: the fewest pieces, topping the least-loaded replicas up to one level (least recomputation; a
        replica may get only one kind of work).
    refine : bool
        Improve the LPT assignment by moves and swaps (default).

    Returns
    -------
    Partition
        Deterministic for the same inputs.

    Raises
    ------
    ValueError
        ``groups`` empty or not PrefixGroups (or a request in two), ``num_replicas`` not a positive int, a cost that
        is not a finite number >= 0.

    Examples
    --------
    >>> from prefixattn.scheduling import group_prompts
    >>> doc_a, doc_b = [1] * 8, [2] * 8
    >>> groups = group_prompts([doc_a + [3], doc_b + [4], doc_a + [5], doc_b + [6]])
    >>> p = partition_groups(groups, 2)
    >>> p.request_replicas().tolist(), p.split
    ([0, 1, 0, 1], [])
    """
    originals = _check_groups(groups)
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
        raise ValueError(f"num_replicas: expected a positive int, got {num_replicas!r}")
    n = int(num_replicas)
    if split not in SPLIT_MODES:
        raise ValueError(f"split: expected one of {SPLIT_MODES}, got {split!r}")
    if cost is None:
        cost = token_cost()
    elif not callable(cost):
        raise ValueError(f"cost: expected a callable cost(group) -> float, got {type(cost).__name__}")
    if isinstance(cost(originals[0]), ResourceCost):
        if split != "spread":
            raise ValueError(f"split: a ResourceCost cost cuts groups its own way (fine pieces); expected 'spread', "
                             f"got {split!r}")
        return _partition_vector(originals, n, cost, allow_split, refine)
    base_costs = _costs(originals, cost)
    fair = float(base_costs.sum()) / n
    to_split = [s for s, g in enumerate(originals)
                if allow_split and n > 1 and base_costs[s] > fair * (1 + _SPLIT_MARGIN) and g.num_requests > 1]
    best = _assign(originals, base_costs, [], n, cost, refine, split)
    if to_split:
        # a split pays its recomputation; keep it only where it actually lowers the makespan
        with_split = _assign(originals, base_costs, to_split, n, cost, refine, split)
        if with_split.makespan < best.makespan * (1 - _SPLIT_MARGIN):
            best = with_split
    return best


def _assign(originals: list, base_costs: np.ndarray, to_split: list, n: int, cost: GroupCost,
            refine: bool, split: str) -> Partition:
    """The groups in ``to_split`` spread (or water-filled), LPT for the whole groups, refinement, merged pieces."""
    whole = [s for s in range(len(originals)) if s not in set(to_split)]
    work = [originals[s] for s in whole]
    source = list(whole)
    costs = [float(base_costs[s]) for s in whole]
    if to_split and split == "spread":
        # whole groups by LPT first; then every split group is cut into one piece per replica, sized to the
        # replica's room below the common water level (equal pieces when the whole groups are balanced)
        rep = _lpt(np.asarray(costs, dtype=np.float64), n).tolist()
        loads = np.bincount(np.asarray(rep, dtype=np.int64), weights=costs, minlength=n) if work else np.zeros(n)
        level = _water_level(loads, float(base_costs[to_split].sum()))
        room = np.maximum(level - loads, 0.0)
        targets = [r for r in range(n) if room[r] > 0]
        for s in to_split:
            for r, p in zip(targets, _split_weighted(originals[s], room[targets], cost)):
                if p is not None:
                    work.append(p)
                    source.append(s)
                    costs.append(float(cost(p)))
                    rep.append(r)
        to_split = []
    else:
        rep = _lpt(np.asarray(costs, dtype=np.float64), n).tolist()
    if to_split:
        # Water-filling: the split groups' requests, as one stream, top the least-loaded replicas up to one level;
        # each piece keeps its group's prefix (the recomputation makes the last pieces overshoot a little, which
        # the refinement below evens out).
        loads = np.bincount(np.asarray(rep, dtype=np.int64), weights=costs, minlength=n) if work else np.zeros(n)
        level = _water_level(loads, float(base_costs[to_split].sum()))
        stream = [(s, 0) for s in to_split]  # (group, next request) still to place
        for r in np.argsort(loads, kind="stable").tolist():
            while stream and loads[r] < level * (1 - _SPLIT_MARGIN):
                s, lo = stream[0]
                piece, hi = _cut(originals[s], lo, level - loads[r], cost)
                c = float(cost(piece))
                work.append(piece)
                source.append(s)
                costs.append(c)
                rep.append(r)
                loads[r] += c
                if hi == originals[s].num_requests:
                    stream.pop(0)
                else:
                    stream[0] = (s, hi)
        for s, lo in stream:  # what the overshoot left: one piece per group to the least-loaded replica
            piece = _piece(originals[s], lo, originals[s].num_requests)
            r = int(np.argmin(loads))
            c = float(cost(piece))
            work.append(piece)
            source.append(s)
            costs.append(c)
            rep.append(r)
            loads[r] += c
    source = np.asarray(source, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    rep = np.asarray(rep, dtype=np.int64)
    if refine and n > 1:
        rep = _refine(costs, rep, n)
    work, source, rep, merged_costs = _merge_pieces(work, source, rep, originals, cost)
    if merged_costs is not None:
        costs = merged_costs
    work, source, rep, order, really_split, recomputed = _in_tree_order(work, source, rep, originals)
    return Partition(num_replicas=n, groups=work, replicas=rep, costs=costs[order], source=source,
                     split=really_split, recomputed_tokens=recomputed)


def _in_tree_order(work: list, source: np.ndarray, rep: np.ndarray, originals: list):
    """The final pieces in the batch's prefix-tree order (the order group_prompts gave), pieces of a group in their
    cut order; returns ``(work, source, rep, order, split, recomputed)``: ``order`` is the permutation applied,
    ``split`` the groups really cut (more than one piece left after merging) and ``recomputed`` the prompt tokens
    their extra pieces compute again."""
    order = sorted(range(len(work)), key=lambda i: (int(source[i]), min(work[i].request_ids)))
    work = [work[i] for i in order]
    source, rep = source[order], rep[order]
    really_split = sorted(int(s) for s in set(source.tolist()) if int((source == s).sum()) > 1)
    recomputed = sum(work[i].processed_tokens for i in range(len(work)) if int(source[i]) in really_split) - \
        sum(originals[s].processed_tokens for s in really_split)
    return work, source, rep, order, really_split, int(recomputed)


# ---------------------------------------------------------------------------------------------------- vector costs
def _pressure(res: np.ndarray, crit: np.ndarray, fair: np.ndarray, with_memory: bool = True) -> np.ndarray:
    """Pressure of replicas (or candidate replicas) with resource loads ``res`` ``[..., 2]`` and critical times
    ``crit`` ``[...]``: ``(compute + memory + critical) / (C + M)`` (module notes; 0 for an all-zero batch).
    ``with_memory=False`` leaves memory out: only the second start of the search uses it (:func:`_assign_vector`)."""
    f_time = float(fair.sum())
    time = res[..., 0] + (res[..., 1] if with_memory else 0.0) + crit
    return time / f_time if f_time > 0 else np.zeros(res.shape[:-1])


def _resource_costs(groups: list, cost: GroupCost, where: str = "cost") -> tuple[np.ndarray, np.ndarray]:
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


def _atoms(group: PrefixGroup, too_big: Callable[[PrefixGroup], bool]) -> list:
    """Runs of ``group``'s request ids (prefix-tree order) that a split may not cut: every nested group that is not
    ``too_big`` whole, every other request alone; a nested group that is too big is cut into its own atoms."""
    pos = {r: i for i, r in enumerate(group.request_ids)}
    spans = sorted((pos[c.request_ids[0]], c) for c in group.children if c.request_ids)
    out, i, k = [], 0, 0
    n = group.num_requests
    while i < n:
        if k < len(spans) and spans[k][0] == i:
            child = spans[k][1]
            k += 1
            if too_big(child):
                out += _atoms(child, too_big)
            else:
                out.append(list(child.request_ids))
            i += child.num_requests
        else:
            out.append([group.request_ids[i]])
            i += 1
    return out


def _split_fine(group: PrefixGroup, cost: GroupCost, fair: np.ndarray) -> list:
    """``group`` cut into contiguous pieces (each keeping the shared prefix) of at most :data:`PIECE_SHARE` of a fair
    share of either resource, at nested-group boundaries where possible (one request at least per piece)."""
    limit = PIECE_SHARE * fair
    lens = dict(zip(group.request_ids, group.prompt_lens))

    def share(g: PrefixGroup) -> float:
        c = cost(g)
        return max((c[k] / limit[k] if limit[k] > 0 else 0.0) for k in range(2))

    def whole(sub: PrefixGroup) -> PrefixGroup:  # a nested group as a top-level piece (its whole prefix shared)
        return _restrict(sub, set(sub.request_ids), top=True)

    atoms = _atoms(group, lambda child: share(whole(child)) > 1.0)
    # each atom's own share (a request alone pays its whole prompt: a slight overestimate, for sizing only)
    sizes = [share(PrefixGroup(prefix_len=0, request_ids=a, prompt_lens=[lens[a[0]]])) if len(a) == 1 else
             share(_restrict(group, set(a), top=True)) for a in atoms]
    pieces, run, acc = [], [], 0.0
    for a, sz in zip(atoms, sizes):
        if run and acc + sz > 1.0:
            pieces.append(run)
            run, acc = [], 0.0
        run = run + a
        acc += sz
    if run:
        pieces.append(run)
    return [_restrict(group, set(ids), top=True) for ids in pieces]


def _greedy(res: np.ndarray, crit: np.ndarray, fair: np.ndarray, n: int, with_memory: bool = True) -> np.ndarray:
    """Largest item first (by its own pressure) to the replica whose pressure it raises least; ties to the replica
    with the lower pressure now, then the lower index."""
    own = _pressure(res, crit, fair, with_memory)
    order = sorted(range(res.shape[0]), key=lambda i: (-own[i], i))
    loads = np.zeros((n, 2))
    rcrit = np.zeros(n)
    now = np.zeros(n)
    out = np.empty(res.shape[0], dtype=np.int64)
    for i in order:
        new = _pressure(loads + res[i], np.maximum(rcrit, crit[i]), fair, with_memory)
        r = min(range(n), key=lambda b: (new[b], now[b], b))
        out[i] = r
        loads[r] += res[i]
        rcrit[r] = max(rcrit[r], crit[i])
        now[r] = new[r]
    return out


def _replica_loads(res: np.ndarray, crit: np.ndarray, rep: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``([n, 2] summed compute/memory, [n] critical time)`` of the replicas under assignment ``rep``."""
    loads = np.zeros((n, 2))
    np.add.at(loads, rep, res)
    rcrit = np.zeros(n)
    np.maximum.at(rcrit, rep, crit)
    return loads, rcrit


def _without(crit_items: np.ndarray) -> np.ndarray:
    """For each item of one replica, the replica's critical time once that item left (max of the others)."""
    if crit_items.size == 0:
        return crit_items
    top = int(np.argmax(crit_items))
    first = float(crit_items[top])
    second = float(np.delete(crit_items, top).max()) if crit_items.size > 1 else 0.0
    out = np.full(crit_items.shape, first)
    out[top] = second
    return out


def _refine_vector(res: np.ndarray, crit: np.ndarray, fair: np.ndarray, rep: np.ndarray, n: int) -> np.ndarray:
    """Moves and swaps between two replicas that lower the larger of their two pressures, taken from the replica
    with the highest pressure that has one (so the max pressure, then the next ones, go down); the best such step
    of that replica each time."""
    rep = rep.copy()
    loads, rcrit = _replica_loads(res, crit, rep, n)
    for _ in range(_REFINE_STEPS_PER_REPLICA * n):
        p = _pressure(loads, rcrit, fair)
        min_gain = _REFINE_MIN_GAIN_VECTOR
        step = None
        for a in sorted(range(n), key=lambda r: (-p[r], r)):
            mine = np.flatnonzero(rep == a)
            if mine.size == 0:
                continue
            ra, ca = res[mine], crit[mine]
            crit_a_wo = _without(ca)
            best = None  # (new pair max, kind, i, j, b)
            for b in range(n):
                if b == a or p[b] >= p[a] - min_gain:
                    continue
                # move one item of a to b
                new_a = _pressure(loads[a] - ra, crit_a_wo, fair)
                new_b = _pressure(loads[b] + ra, np.maximum(rcrit[b], ca), fair)
                pair = np.maximum(new_a, new_b)
                i = int(np.argmin(pair))
                if best is None or pair[i] < best[0] - min_gain:
                    best = (float(pair[i]), "move", int(mine[i]), -1, b)
                theirs = np.flatnonzero(rep == b)
                if theirs.size:
                    rb, cb = res[theirs], crit[theirs]
                    crit_b_wo = _without(cb)
                    la = loads[a] - ra[:, None, :] + rb[None, :, :]
                    lb = loads[b] - rb[None, :, :] + ra[:, None, :]
                    new_a = _pressure(la, np.maximum(crit_a_wo[:, None], cb[None, :]), fair)
                    new_b = _pressure(lb, np.maximum(crit_b_wo[None, :], ca[:, None]), fair)
                    pair = np.maximum(new_a, new_b)
                    i, j = np.unravel_index(int(np.argmin(pair)), pair.shape)
                    if pair[i, j] < best[0] - min_gain:
                        best = (float(pair[i, j]), "swap", int(mine[i]), int(theirs[j]), b)
            if best is not None and best[0] < p[a] - min_gain:
                step = (a,) + best[1:]
                break
        if step is None:
            break
        a, kind, i, j, b = step
        rep[i] = b
        if kind == "swap":
            rep[j] = a
        for r in (a, b):
            mine = rep == r
            loads[r] = res[mine].sum(axis=0)
            rcrit[r] = crit[mine].max() if mine.any() else 0.0
    return rep


def _assign_vector(originals: list, res0: np.ndarray, crit0: np.ndarray, fair: np.ndarray, to_split: list, n: int,
                   cost: GroupCost, refine: bool) -> Partition:
    """Vector costs: the groups in ``to_split`` cut fine, everything placed greedily, refined, pieces merged."""
    split_set = set(to_split)
    work, source = [], []
    res_parts, crit_parts = [], []  # whole groups keep their known costs; only pieces are priced
    for s, g in enumerate(originals):
        if s in split_set:
            pieces = _split_fine(g, cost, fair)
            piece_res, piece_crit = _resource_costs(pieces, cost)
        else:
            pieces, piece_res, piece_crit = [g], res0[s:s + 1], crit0[s:s + 1]
        work += pieces
        source += [s] * len(pieces)
        res_parts.append(piece_res)
        crit_parts.append(piece_crit)
    res, crit = np.concatenate(res_parts), np.concatenate(crit_parts)
    source = np.asarray(source, dtype=np.int64)
    # Two starts, the better kept: the greedy on the pressure itself, and one that leaves memory out of it. Pairwise
    # steps cannot leave a plateau where every replica sits at the same pressure: when many replicas hold a long
    # decode each, the first start may spread the decodes one per replica and even the rest out around them, while
    # the second stacks decodes of similar length (a replica's floor is its longest one only) and fills the others.
    best_rep, best_key = None, None
    for with_memory in ((True, False) if n > 1 else (True,)):
        rep = _greedy(res, crit, fair, n, with_memory)
        if refine and n > 1:
            rep = _refine_vector(res, crit, fair, rep, n)
        key = tuple(np.sort(_pressure(*_replica_loads(res, crit, rep, n), fair))[::-1].tolist())
        if best_key is None or key < best_key:
            best_rep, best_key = rep, key
    rep = best_rep
    work, source, rep, _ = _merge_pieces(work, source, rep, originals, None)
    work, source, rep, _, really_split, recomputed = _in_tree_order(work, source, rep, originals)
    res, crit = _resource_costs(work, cost)  # merged pieces are new groups: priced again
    return Partition(num_replicas=n, groups=work, replicas=rep, costs=res.sum(axis=1), source=source,
                     split=really_split, recomputed_tokens=recomputed, resources=res, critical=crit,
                     fair=fair.copy())


def _partition_vector(originals: list, n: int, cost: GroupCost, allow_split: bool, refine: bool) -> Partition:
    res0, crit0 = _resource_costs(originals, cost)
    fair = res0.sum(axis=0) / n
    own = np.max(np.where(fair > 0, res0 / np.where(fair > 0, fair, 1.0), 0.0), axis=1)
    to_split = [s for s, g in enumerate(originals)
                if allow_split and n > 1 and own[s] > 1 + _SPLIT_MARGIN and g.num_requests > 1]
    best = _assign_vector(originals, res0, crit0, fair, [], n, cost, refine)
    if to_split:
        # a split pays its recomputation; keep it only where it actually lowers the modeled makespan
        with_split = _assign_vector(originals, res0, crit0, fair, to_split, n, cost, refine)
        if with_split.makespan < best.makespan * (1 - _SPLIT_MARGIN):
            best = with_split
    return best


# ---------------------------------------------------------------------------------------------------- baselines
def shard_requests(num_requests: int, num_replicas: int, how: str = "round-robin", seed: int = 0) -> np.ndarray:
    """Naive sharding by row: ``[num_requests]`` int64 replica per request id.

    ``round-robin``: request ``i`` to replica ``i % N``; ``random``: a seeded random permutation dealt round-robin
    (equal shard sizes, what a shuffled ``Dataset.split`` gives).

    Examples
    --------
    >>> shard_requests(5, 2).tolist()
    [0, 1, 0, 1, 0]
    """
    for name, v, lo in (("num_requests", num_requests, 1), ("num_replicas", num_replicas, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if how == "round-robin":
        return np.arange(num_requests, dtype=np.int64) % num_replicas
    if how == "random":
        out = np.empty(num_requests, dtype=np.int64)
        out[np.random.default_rng(seed).permutation(num_requests)] = np.arange(num_requests) % num_replicas
        return out
    raise ValueError(f"how: expected one of {SHARDINGS}, got {how!r}")


def sharded_saving_ratio(prompts, request_replicas, *, levels: int | None = 1, min_shared_tokens: int = 1) -> float:
    """Saving ratio (BatchLLM Eq. 2) of N replicas that each group only their own share of the batch.

    Parameters
    ----------
    prompts : Sequence[Sequence[int]] | PackedSequences
        The whole batch.
    request_replicas : array-like of int
        ``[num_requests]`` replica of each request (e.g. :meth:`Partition.request_replicas`, :func:`shard_requests`).
    levels, min_shared_tokens
        Passed to :func:`group_prompts` on each shard.

    Returns
    -------
    float
        ``1 - sum(processed tokens of each shard) / logical tokens``.

    Examples
    --------
    >>> prompts = [[1, 1, 1, 2], [1, 1, 1, 3]]
    >>> sharded_saving_ratio(prompts, [0, 0]), sharded_saving_ratio(prompts, [0, 1])
    (0.375, 0.0)
    """
    packed = pack_sequences(prompts, name="prompts", min_len=1)
    reps = np.asarray(request_replicas)
    n = packed.lengths.shape[0]
    if reps.shape != (n,) or not np.issubdtype(reps.dtype, np.integer) or (reps < 0).any():
        raise ValueError(f"request_replicas: expected {n} replica ids >= 0 (one per prompt), got shape {reps.shape} "
                         f"dtype {reps.dtype}")
    logical = int(packed.lengths.sum())
    saved = 0.0
    for r in np.unique(reps).tolist():
        ids = np.flatnonzero(reps == r)
        shard = [packed.values[packed.offsets[i]:packed.offsets[i] + packed.lengths[i]] for i in ids.tolist()]
        groups = group_prompts(shard, levels=levels, min_shared_tokens=min_shared_tokens)
        saved += saving_ratio(shard, groups) * float(packed.lengths[ids].sum())
    return saved / logical
