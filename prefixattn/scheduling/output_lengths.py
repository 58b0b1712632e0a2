"""Output lengths for ordering and KV reservation: given per request, a constant, or estimated by sampling.

BlendServe (sec. 3.2) samples a small fraction of the requests (1%), runs them, and estimates every other request's
output length as the mean over the sampled requests of its prefix subtree: requests sharing a prefix share
semantics and tend to produce similar lengths. A subtree without samples takes its enclosing subtree's mean (the
pooled mean of its siblings), and the batch-wide mean at the top.

At 1% a group of a few dozen requests is often missed entirely (80 video requests: 45% chance of no sample), and
its estimate is then the batch mean: 16K-token video outputs estimated at ~300 tokens. So by default every shared
group (at every nesting level) without a sample gets one, largest groups first, with at most ``ceil(rate * N)``
such extra samples (the sample stays below twice the rate).
"""

from __future__ import annotations

import math

from typing import Sequence

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup

#: BlendServe samples 1% of the requests (sec. 5, "p = 0.01").
DEFAULT_SAMPLE_RATE = 0.01


def _num_requests(groups: Sequence[PrefixGroup]) -> int:
    return 1 + max(max(g.request_ids) for g in groups)


def output_lens_array(output_lens, num_requests: int, *, name: str = "output_lens") -> np.ndarray | None:
    """Normalize ``output_lens`` (None, a constant, or one value per request) to a float64 array or None.

    Raises
    ------
    ValueError
        A negative or non-finite length, or an array of the wrong size.
    """
    if output_lens is None:
        return None
    if np.isscalar(output_lens):
        if isinstance(output_lens, bool) or not isinstance(output_lens, (int, float, np.integer, np.floating)):
            raise ValueError(f"{name}: expected None, a number or one length per request, got {output_lens!r}")
        value = float(output_lens)
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"{name}: expected a finite length >= 0, got {output_lens!r}")
        return np.full(num_requests, value)
    arr = np.asarray(output_lens, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] < num_requests:
        raise ValueError(f"{name}: expected one length per request ({num_requests}), got shape {arr.shape}")
    if not np.isfinite(arr).all() or (arr < 0).any():
        i = int(np.argmax(~np.isfinite(arr) | (arr < 0)))
        raise ValueError(f"{name}: expected finite lengths >= 0, got {arr[i]} for request {i}")
    return arr


def sample_requests(groups: Sequence[PrefixGroup], *, rate: float = DEFAULT_SAMPLE_RATE, seed: int = 0,
                    cover_groups: bool = True) -> np.ndarray:
    """Pick the requests to run first to measure output lengths: each with probability ``rate``, reproducibly,
    plus one in every shared group the draw missed (``cover_groups``).

    Parameters
    ----------
    groups : Sequence[PrefixGroup]
        Groups from :func:`prefixattn.scheduling.group_prompts`.
    rate : float
        Sampling probability in ``(0, 1]``.
    seed : int
        Seed of the generator (the same seed gives the same sample).
    cover_groups : bool
        Add one random member of every group with more than one request (nested groups included) that has no
        sampled member, largest groups first, at most ``ceil(rate * num_requests)`` of them. Singletons are left to
        the draw: covering them would mean measuring every request.

    Returns
    -------
    np.ndarray
        Sorted int64 request ids; at least one.

    Examples
    --------
    >>> from prefixattn.scheduling import group_prompts
    >>> ids = sample_requests(group_prompts([[1, 2, i] for i in range(300)]), rate=0.05, seed=1)
    >>> 5 <= len(ids) <= 30
    True
    >>> groups = group_prompts([[1, 2, i] for i in range(300)] + [[7, 8, i] for i in range(5)])
    >>> bool(set(sample_requests(groups, rate=0.01, seed=0).tolist()) & set(range(300, 305)))
    True
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
        raise ValueError(f"rate: expected a probability in (0, 1], got {rate!r}")
    n = _num_requests(groups)
    rng = np.random.default_rng(seed)
    mask = rng.random(n) < rate
    if not mask.any():
        mask[int(rng.integers(n))] = True
    if cover_groups:
        _cover_groups(groups, mask, rng, extra=math.ceil(rate * n))
    return np.flatnonzero(mask).astype(np.int64)


def _cover_groups(groups: Sequence[PrefixGroup], mask: np.ndarray, rng: np.random.Generator, extra: int) -> None:
    """Sample one member of each multi-request group without a sample, largest first, ``extra`` at most."""
    shared = [np.asarray(g.request_ids, dtype=np.int64) for top in groups for g, _ in top.walk()
              if len(g.request_ids) > 1]
    shared.sort(key=lambda ids: (-ids.size, int(ids.min())))
    for ids in shared:
        if extra == 0:
            return
        if not mask[ids].any():
            mask[int(ids[int(rng.integers(ids.size))])] = True
            extra -= 1


def estimate_output_lens(groups: Sequence[PrefixGroup], sampled_ids, sampled_lens, *,
                         default: float | None = None) -> np.ndarray:
    """Estimate every request's output length from measured samples, per prefix subtree (BlendServe sec. 3.2).

    A sampled request keeps its measured length. Any other request takes the mean of the samples in the deepest
    group containing it that has samples; a group without any takes the batch-wide sample mean.

    Parameters
    ----------
    groups : Sequence[PrefixGroup]
        Groups from :func:`prefixattn.scheduling.group_prompts` (nested groups are used when present).
    sampled_ids : array-like of int
        Request ids whose output lengths were measured.
    sampled_lens : array-like of float
        Their measured output lengths (>= 0), aligned with ``sampled_ids``.
    default : float, optional
        Used when nothing was sampled (else a ValueError).

    Returns
    -------
    np.ndarray
        ``[num_requests]`` float64 estimates.

    Examples
    --------
    >>> from prefixattn.scheduling import group_prompts
    >>> groups = group_prompts([[1, 2, 3, 4], [1, 2, 3, 5], [9, 8, 7]])
    >>> estimate_output_lens(groups, [0, 2], [10, 40]).tolist()
    [10.0, 10.0, 40.0]
    """
    n = _num_requests(groups)
    ids = np.asarray(sampled_ids, dtype=np.int64).reshape(-1)
    lens = np.asarray(sampled_lens, dtype=np.float64).reshape(-1)
    if ids.shape != lens.shape:
        raise ValueError(f"sampled_lens: expected one length per sampled id ({ids.size}), got {lens.size}")
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise ValueError(f"sampled_ids: expected request ids in [0, {n}), got {int(ids[(ids < 0) | (ids >= n)][0])}")
    if not np.isfinite(lens).all() or (lens < 0).any():
        raise ValueError("sampled_lens: expected finite lengths >= 0")
    if ids.size == 0:
        if default is None:
            raise ValueError("sampled_ids: expected at least one sampled request (or pass default=)")
        return np.full(n, float(default))
    total = np.zeros(n)
    count = np.zeros(n)
    np.add.at(total, ids, lens)
    np.add.at(count, ids, 1.0)
    global_mean = float(total.sum() / count.sum())
    out = np.full(n, global_mean)
    # Parents before children, so the deepest group with samples writes last.
    stack = [(g, global_mean) for g in reversed(list(groups))]
    while stack:
        g, inherited = stack.pop()
        members = np.asarray(g.request_ids, dtype=np.int64)
        c = count[members].sum()
        mean = total[members].sum() / c if c else inherited
        out[members] = mean
        stack.extend((child, mean) for child in reversed(g.children))
    measured = count > 0
    out[measured] = total[measured] / count[measured]
    return out


def request_output_lens(groups: Sequence[PrefixGroup], known, limits=None) -> np.ndarray | None:
    """Output lengths for ordering from what an engine's requests carry: an estimate (or measurement) on some, a
    limit (``max_tokens`` / ``max_new_tokens``) on some.

    A request with a known length keeps it; one without takes its prefix group's estimate from the known ones
    (:func:`estimate_output_lens`: requests sharing a prefix produce similar lengths) when its group has any, else its
    limit (else, unlimited, the mean of the known lengths, or of the finite limits when none is known). Every result
    is capped at the request's limit (it cannot generate more).

    Parameters
    ----------
    groups : Sequence[PrefixGroup]
        Groups from :func:`prefixattn.scheduling.group_prompts` over the same requests.
    known : array-like of float
        ``[num_requests]`` known lengths, NaN where a request carries none.
    limits : array-like of float, optional
        ``[num_requests]`` most tokens each may generate, ``inf`` (or NaN) where unlimited.

    Returns
    -------
    np.ndarray or None
        ``[num_requests]`` float64 lengths, or None when no request carries a length or a finite limit (then the
        orderings treat lengths as constant).

    Examples
    --------
    >>> from prefixattn.scheduling import group_prompts
    >>> groups = group_prompts([[1, 2, 3, 4], [1, 2, 3, 5], [9, 8, 7]])
    >>> request_output_lens(groups, [np.nan, 40, np.nan], [16, 64, 200]).tolist()   # capped; no sample: the limit
    [16.0, 40.0, 200.0]
    >>> request_output_lens(groups, [np.nan] * 3, [16, 64, 200]).tolist()
    [16.0, 64.0, 200.0]
    """
    n = _num_requests(groups)
    known = np.asarray(known, dtype=np.float64).reshape(-1)
    limits = np.full(n, np.inf) if limits is None else np.asarray(limits, dtype=np.float64).reshape(-1)
    if known.shape[0] != n or limits.shape[0] != n:
        raise ValueError(f"known, limits: expected one value per request ({n}), got {known.shape[0]} and "
                         f"{limits.shape[0]}")
    limits = np.where(np.isnan(limits), np.inf, limits)
    if (known < 0).any() or np.isinf(known).any() or (limits < 0).any():
        raise ValueError("known, limits: expected lengths >= 0 (NaN: unknown, limits inf: unlimited)")
    given = np.flatnonzero(~np.isnan(known))
    if given.size:
        out = estimate_output_lens(groups, given, known[given])
        covered = np.zeros(n, dtype=bool)  # in a top-level group with a known length
        for g in groups:
            members = np.asarray(g.request_ids, dtype=np.int64)
            covered[members] = bool((~np.isnan(known[members])).any())
        out = np.where(covered | ~np.isfinite(limits), out, limits)
    elif np.isfinite(limits).any():
        out = limits.copy()
        out[~np.isfinite(out)] = out[np.isfinite(out)].mean()
    else:
        return None
    return np.minimum(out, limits)
