"""Cutting prefix groups into pieces for :func:`prefixattn.scheduling.partition_groups`, and merging them back.

A piece is a contiguous run of a group's requests (prefix-tree order) that keeps the group's shared prefix: each extra
piece computes that prefix once more.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup
from prefixattn.scheduling.partition_result import GroupCost, scalar_costs

#: Vector costs: a group above a fair share is cut into pieces of at most this fraction of a fair share (of each
#: resource), fine enough for the moves and swaps to even out both resources to within a few percent.
PIECE_SHARE = 0.125


def restrict_group(group: PrefixGroup, keep: set, top: bool) -> PrefixGroup | list | None:
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
        sub = restrict_group(c, keep, top=False)
        if isinstance(sub, PrefixGroup):
            children.append(sub)
    single = len(ids) == 1
    return PrefixGroup(prefix_len=0 if single else group.prefix_len, request_ids=ids,
                       prompt_lens=[lens[r] for r in ids], children=[] if single else children,
                       parent_prefix_len=group.parent_prefix_len, dfs_rank=group.dfs_rank)


def take_run(group: PrefixGroup, lo: int, hi: int) -> PrefixGroup:
    return restrict_group(group, set(group.request_ids[lo:hi]), top=True)


def cut_to_budget(group: PrefixGroup, lo: int, budget: float, cost: GroupCost) -> tuple[PrefixGroup, int]:
    """The longest run ``request_ids[lo:hi]`` of ``group`` (as a piece keeping its prefix) costing at most
    ``budget``, one request at least; returns ``(piece, hi)``. Bisection: ``cost`` must not decrease when requests
    are added."""
    n = group.num_requests
    best_hi = lo + 1
    a, b = lo + 1, n
    while a <= b:
        mid = (a + b) // 2
        if cost(take_run(group, lo, mid)) <= budget:
            best_hi, a = mid, mid + 1
        else:
            b = mid - 1
    return take_run(group, lo, best_hi), best_hi


def split_weighted(group: PrefixGroup, weights: Sequence[float], cost: GroupCost) -> list:
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
            if cost(take_run(group, 0, mid)) >= whole * frac[q - 1]:
                hi = mid
            else:
                lo = mid + 1
        cuts.append(min(lo, n))
    cuts.append(n)
    return [take_run(group, a, b) if b > a else None for a, b in zip(cuts[:-1], cuts[1:])]


def water_level(loads: np.ndarray, extra: float) -> float:
    """Level ``T`` with ``sum(max(0, T - loads)) == extra``: filling the least-loaded replicas up to it."""
    srt = np.sort(loads)
    level = srt[0] + extra
    for m in range(1, srt.shape[0] + 1):
        level = (extra + float(srt[:m].sum())) / m
        if m == srt.shape[0] or level <= srt[m]:
            break
    return level


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


def split_fine(group: PrefixGroup, cost: GroupCost, fair: np.ndarray) -> list:
    """``group`` cut into contiguous pieces (each keeping the shared prefix) of at most :data:`PIECE_SHARE` of a fair
    share of either resource, at nested-group boundaries where possible (one request at least per piece)."""
    limit = PIECE_SHARE * fair
    lens = dict(zip(group.request_ids, group.prompt_lens))

    def share(g: PrefixGroup) -> float:
        c = cost(g)
        return max((c[k] / limit[k] if limit[k] > 0 else 0.0) for k in range(2))

    def whole(sub: PrefixGroup) -> PrefixGroup:  # a nested group as a top-level piece (its whole prefix shared)
        return restrict_group(sub, set(sub.request_ids), top=True)

    atoms = _atoms(group, lambda child: share(whole(child)) > 1.0)
    # each atom's own share (a request alone pays its whole prompt: a slight overestimate, for sizing only)
    sizes = [share(PrefixGroup(prefix_len=0, request_ids=a, prompt_lens=[lens[a[0]]])) if len(a) == 1 else
             share(restrict_group(group, set(a), top=True)) for a in atoms]
    pieces, run, acc = [], [], 0.0
    for a, sz in zip(atoms, sizes):
        if run and acc + sz > 1.0:
            pieces.append(run)
            run, acc = [], 0.0
        run = run + a
        acc += sz
    if run:
        pieces.append(run)
    return [restrict_group(group, set(ids), top=True) for ids in pieces]


def merge_pieces(groups: list, source: np.ndarray, rep: np.ndarray, originals: list, cost: GroupCost):
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
            out_g.append(restrict_group(originals[s], members, top=True))
        out_s.append(s)
        out_r.append(r)
    return (out_g, np.asarray(out_s, dtype=np.int64), np.asarray(out_r, dtype=np.int64),
            None if cost is None else scalar_costs(out_g, cost))


def in_tree_order(work: list, source: np.ndarray, rep: np.ndarray, originals: list):
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
