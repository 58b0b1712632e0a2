"""Which re-reads of a prefix group's KV an attention launch serves from L2 instead of HBM (modeled).

The requests of one prefix group read the same KV positions. When a launch runs a group's members close together,
the later members find those lines still in L2 and HBM delivers them once. The model is an LRU stack distance: a
launch issues its rows' CTAs in its order and the GPU list-schedules them, so between one member starting its reads
and the next member starting its own, the launch streams the KV of the rows issued between them (the earlier member
included). The later member's group tokens hit L2 when those bytes fit the L2 capacity; otherwise HBM delivers them
again. A group whose prefix alone is larger than the capacity never hits: the earlier member streams past it.

The order is a property of the kernel (:data:`ROW_ORDERS`): a kernel that walks the batch in its order keeps a group's
rows adjacent when the batch holds them sorted by group (as the engines and the GPU check's model steps do); one that
issues its items longest first spreads a group over the launch, and only members whose lengths land them close
together still meet in L2; prefixattn's planner issues longest first but a group's rows together, at the place of
its longest row (``runs-longest-first``: :func:`prefixattn.planner.work_list.prefix_runs`).
"""

from __future__ import annotations

import numpy as np

from prefixattn.ragged import runs_longest_first

#: Issue orders of the launches: ``batch`` (row order as given), ``longest-first`` (by KV read, stable) and
#: ``runs-longest-first`` (longest first, a group's rows together at the place of its longest row).
ROW_ORDERS = ("batch", "longest-first", "runs-longest-first")


def issue_order(own_tokens: np.ndarray, order: str, group_ids: np.ndarray | None = None) -> np.ndarray:
    """Row indices in the order a launch issues them.

    Parameters
    ----------
    own_tokens : np.ndarray
        ``[n]`` KV tokens each row's CTAs read in this launch (float or int).
    order : {"batch", "longest-first", "runs-longest-first"}
    group_ids : np.ndarray, optional
        ``[n]`` int group of each row (-1: none), for ``runs-longest-first`` (None: every row alone).

    Returns
    -------
    np.ndarray
        ``[n]`` int64 permutation.
    """
    if order not in ROW_ORDERS:
        raise ValueError(f"order: expected one of {ROW_ORDERS}, got {order!r}")
    n = own_tokens.shape[0]
    if order == "batch":
        return np.arange(n, dtype=np.int64)
    own = np.asarray(own_tokens, dtype=np.float64)
    if order == "longest-first" or group_ids is None:
        return np.argsort(-own, kind="stable").astype(np.int64)
    ids = np.asarray(group_ids, dtype=np.int64)
    if ids.shape != (n,):
        raise ValueError(f"group_ids: expected shape ({n},) like own_tokens, got {ids.shape}")
    group = np.where(ids >= 0, ids, ids.max(initial=0) + 1 + np.arange(n))  # a row in no group: alone
    return runs_longest_first(own, group).astype(np.int64)


def group_ids_from_lens(group_lens: np.ndarray) -> np.ndarray:
    """Groups of a batch held sorted by group: each run of equal nonzero ``group_lens`` is one group.

    Parameters
    ----------
    group_lens : np.ndarray
        ``[n]`` tokens of each row's KV inside its group's shared prefix (0: in no group of >= 2).

    Returns
    -------
    np.ndarray
        ``[n]`` int64 group index (-1 where ``group_lens`` is 0). Two adjacent groups of equal prefix length become
        one group (their rows read different KV, so this overstates reuse by at most one member per such pair).
    """
    g = np.asarray(group_lens)
    ids = np.full(g.shape[0], -1, dtype=np.int64)
    if g.shape[0] == 0:
        return ids
    starts = np.ones(g.shape[0], dtype=bool)
    starts[1:] = g[1:] != g[:-1]
    run = np.cumsum(starts) - 1
    ids[g > 0] = run[g > 0]
    return ids


def l2_reuse_tokens(own_tokens, group_tokens, group_ids, order: np.ndarray, bytes_per_token: float,
                    capacity_bytes: float) -> np.ndarray:
    """Tokens of each row's reads that L2 serves (the rest come from HBM), by LRU stack distance.

    Parameters
    ----------
    own_tokens : np.ndarray
        ``[n]`` KV tokens each row reads in this launch.
    group_tokens : np.ndarray
        ``[n]`` of those, the tokens inside the row's group prefix (0 where none; at most ``own_tokens``).
    group_ids : np.ndarray
        ``[n]`` int group of each row (-1: none).
    order : np.ndarray
        ``[n]`` int permutation: the launch's issue order (:func:`issue_order`).
    bytes_per_token : float
        KV bytes of one token in one layer over all KV heads (> 0).
    capacity_bytes : float
        L2 bytes a line read by every SM can occupy (>= 0).

    Returns
    -------
    np.ndarray
        ``[n]`` float64 tokens served from L2; the first member of each run of hits reads from HBM.

    Examples
    --------
    >>> import numpy as np
    >>> own = np.array([1000.0, 1000.0, 1000.0]); grp = np.array([800.0, 800.0, 0.0])
    >>> l2_reuse_tokens(own, grp, np.array([0, 0, -1]), np.arange(3), 4096.0, 60 * 2 ** 20).tolist()
    [0.0, 800.0, 0.0]
    """
    own = np.asarray(own_tokens, dtype=np.float64)
    grp = np.asarray(group_tokens, dtype=np.float64)
    ids = np.asarray(group_ids, dtype=np.int64)
    n = own.shape[0]
    for name, arr in (("group_tokens", grp), ("group_ids", ids), ("order", order)):
        if arr.shape != (n,):
            raise ValueError(f"{name}: expected shape ({n},) like own_tokens, got {arr.shape}")
    out = np.zeros(n, dtype=np.float64)
    members = np.nonzero((ids >= 0) & (grp > 0))[0]
    if members.size < 2:
        return out
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n, dtype=np.int64)
    streamed = np.zeros(n + 1, dtype=np.float64)
    streamed[1:] = np.cumsum(own[order] * bytes_per_token)
    # each member after its group's first (in issue order) against the member issued just before it
    by_group = members[np.lexsort((pos[members], ids[members]))]
    same = ids[by_group[1:]] == ids[by_group[:-1]]
    cur, prev = by_group[1:][same], by_group[:-1][same]
    distance = streamed[pos[cur]] - streamed[pos[prev]]
    hit = distance <= capacity_bytes
    out[cur[hit]] = np.minimum(grp[cur[hit]], grp[prev[hit]])
    return out
