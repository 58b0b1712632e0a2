"""Placing groups and pieces on replicas for :func:`prefixattn.scheduling.partition_groups`.

Scalar costs: LPT for the whole groups, the split groups spread (or water-filled), moves and swaps out of the
most-loaded replica. Two-resource costs: fine pieces, a greedy on the modeled pressure from two starts, moves and swaps
between any two replicas. Both end by merging the pieces of a group that share a replica (see the module notes of
:mod:`prefixattn.scheduling.partition` for why the two differ).
"""

from __future__ import annotations

import heapq

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup
from prefixattn.scheduling.partition_pieces import (cut_to_budget, in_tree_order, merge_pieces, split_fine,
                                                    split_weighted, take_run, water_level)
from prefixattn.scheduling.partition_result import (SPLIT_MARGIN, GroupCost, Partition, replica_loads,
                                                    replica_pressure, resource_costs)

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


# ---------------------------------------------------------------------------------------------------- scalar costs
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
    """Moves and swaps out of the most-loaded replica while they lower it (:mod:`prefixattn.scheduling.partition`)."""
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


def assign_scalar(originals: list, base_costs: np.ndarray, to_split: list, n: int, cost: GroupCost,
                  refine: bool, split: str) -> Partition:
    """The groups in ``to_split`` spread (or water-filled), LPT for the whole groups, refinement, merged pieces."""
    whole = [s for s in range(len(originals)) if s not in set(to_split)]
    work = [originals[s] for s in whole]
    source = list(whole)
    costs = [float(base_costs[s]) for s in whole]
    rep = _lpt(np.asarray(costs, dtype=np.float64), n).tolist()  # whole groups first

    def place(piece: PrefixGroup, s: int, r: int) -> float:
        c = float(cost(piece))
        work.append(piece)
        source.append(s)
        costs.append(c)
        rep.append(r)
        return c

    if to_split:
        loads = np.bincount(np.asarray(rep, dtype=np.int64), weights=costs, minlength=n) if work else np.zeros(n)
        level = water_level(loads, float(base_costs[to_split].sum()))
        if split == "spread":
            _spread(originals, to_split, loads, level, cost, place)
        else:
            _water_fill(originals, to_split, loads, level, cost, place)
    source = np.asarray(source, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    rep = np.asarray(rep, dtype=np.int64)
    if refine and n > 1:
        rep = _refine(costs, rep, n)
    work, source, rep, merged_costs = merge_pieces(work, source, rep, originals, cost)
    if merged_costs is not None:
        costs = merged_costs
    work, source, rep, order, really_split, recomputed = in_tree_order(work, source, rep, originals)
    return Partition(num_replicas=n, groups=work, replicas=rep, costs=costs[order], source=source,
                     split=really_split, recomputed_tokens=recomputed)


def _spread(originals: list, to_split: list, loads: np.ndarray, level: float, cost: GroupCost, place) -> None:
    """Every split group cut into one piece per replica, sized to the replica's room below the common water level
    (equal pieces when the whole groups are balanced)."""
    room = np.maximum(level - loads, 0.0)
    targets = [r for r in range(loads.shape[0]) if room[r] > 0]
    for s in to_split:
        for r, p in zip(targets, split_weighted(originals[s], room[targets], cost)):
            if p is not None:
                place(p, s, r)


def _water_fill(originals: list, to_split: list, loads: np.ndarray, level: float, cost: GroupCost, place) -> None:
    """The split groups' requests, as one stream, top the least-loaded replicas up to one level; each piece keeps its
    group's prefix (the recomputation makes the last pieces overshoot a little, which the refinement evens out)."""
    stream = [(s, 0) for s in to_split]  # (group, next request) still to place
    for r in np.argsort(loads, kind="stable").tolist():
        while stream and loads[r] < level * (1 - SPLIT_MARGIN):
            s, lo = stream[0]
            piece, hi = cut_to_budget(originals[s], lo, level - loads[r], cost)
            loads[r] += place(piece, s, r)
            if hi == originals[s].num_requests:
                stream.pop(0)
            else:
                stream[0] = (s, hi)
    for s, lo in stream:  # what the overshoot left: one piece per group to the least-loaded replica
        piece = take_run(originals[s], lo, originals[s].num_requests)
        r = int(np.argmin(loads))
        loads[r] += place(piece, s, r)


# ---------------------------------------------------------------------------------------------------- vector costs
def _greedy(res: np.ndarray, crit: np.ndarray, fair: np.ndarray, n: int, with_memory: bool = True) -> np.ndarray:
    """Largest item first (by its own pressure) to the replica whose pressure it raises least; ties to the replica
    with the lower pressure now, then the lower index."""
    own = replica_pressure(res, crit, fair, with_memory)
    order = sorted(range(res.shape[0]), key=lambda i: (-own[i], i))
    loads = np.zeros((n, 2))
    rcrit = np.zeros(n)
    now = np.zeros(n)
    out = np.empty(res.shape[0], dtype=np.int64)
    for i in order:
        new = replica_pressure(loads + res[i], np.maximum(rcrit, crit[i]), fair, with_memory)
        r = min(range(n), key=lambda b: (new[b], now[b], b))
        out[i] = r
        loads[r] += res[i]
        rcrit[r] = max(rcrit[r], crit[i])
        now[r] = new[r]
    return out


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
    loads, rcrit = replica_loads(res, crit, rep, n)
    for _ in range(_REFINE_STEPS_PER_REPLICA * n):
        p = replica_pressure(loads, rcrit, fair)
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
                new_a = replica_pressure(loads[a] - ra, crit_a_wo, fair)
                new_b = replica_pressure(loads[b] + ra, np.maximum(rcrit[b], ca), fair)
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
                    new_a = replica_pressure(la, np.maximum(crit_a_wo[:, None], cb[None, :]), fair)
                    new_b = replica_pressure(lb, np.maximum(crit_b_wo[None, :], ca[:, None]), fair)
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


def assign_vector(originals: list, res0: np.ndarray, crit0: np.ndarray, fair: np.ndarray, to_split: list, n: int,
                   cost: GroupCost, refine: bool) -> Partition:
    """Vector costs: the groups in ``to_split`` cut fine, everything placed greedily, refined, pieces merged."""
    split_set = set(to_split)
    work, source = [], []
    res_parts, crit_parts = [], []  # whole groups keep their known costs; only pieces are priced
    for s, g in enumerate(originals):
        if s in split_set:
            pieces = split_fine(g, cost, fair)
            piece_res, piece_crit = resource_costs(pieces, cost)
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
        key = tuple(np.sort(replica_pressure(*replica_loads(res, crit, rep, n), fair))[::-1].tolist())
        if best_key is None or key < best_key:
            best_rep, best_key = rep, key
    rep = best_rep
    work, source, rep, _ = merge_pieces(work, source, rep, originals, None)
    work, source, rep, _, really_split, recomputed = in_tree_order(work, source, rep, originals)
    res, crit = resource_costs(work, cost)  # merged pieces are new groups: priced again
    return Partition(num_replicas=n, groups=work, replicas=rep, costs=res.sum(axis=1), source=source,
                     split=really_split, recomputed_tokens=recomputed, resources=res, critical=crit,
                     fair=fair.copy())
