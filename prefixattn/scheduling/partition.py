"""Prefix-affinity data parallelism: whole prefix groups to N engine replicas, balancing their cost.

Sharding an offline batch by row (round-robin) or at random splits every prefix group across the replicas, so every
replica recomputes every shared prefix (share degree ~7 on 8 replicas loses most of BatchLLM's saving).
:func:`partition_groups` assigns whole groups (from :func:`prefixattn.scheduling.group_prompts`) instead, on one path:

1. **Price** every group with the caller's ``cost(group)``: a number (:func:`token_cost`, or
   :class:`prefixattn.sim.group_cost.GroupCostModel`) or a :class:`ResourceCost` (``GroupCostModel.resources``).
2. **Split only what must be split**: a group above the fair share ``total / N`` (of either resource) is cut into
   contiguous runs of its requests (prefix-tree order) that each keep, and recompute, the shared prefix
   (:attr:`Partition.recomputed_tokens`). The split is kept only if it lowers the makespan of the unsplit assignment.
3. **Place** (:mod:`prefixattn.scheduling.partition_assign`) and **merge back** pieces of one group that share a
   replica. Deterministic: ties go to the lower group index and the lower replica index.

Scalar costs: LPT for whole groups (Graham: makespan <= 4/3 of the optimum); a split group is spread, one piece per
replica sized to its room below a common level, so each replica keeps the batch's mix of compute- and memory-heavy
work (BlendServe sec. 6.1) (``split="fill"`` water-fills instead: fewest pieces, least recomputation); then moves and
swaps out of the most-loaded replica while they lower it.

Two resources: one number cannot balance compute-heavy groups (long prompts) against memory-heavy ones (long
outputs): on BlendServe Trace #1 two replicas with equal summed cost differ by 25% in simulated time. A replica's
modeled time is ``compute_r + memory_r + critical_r`` (``critical_r``: the largest serial floor of its groups, the
longest decode, not a sum); the terms add because an engine step runs its GEMMs (compute-bound) and decode attention
(memory-bound) one after the other. The simulator agrees within ~5% per replica (Trace #1, N = 2 to 16), where
``max(compute, memory)`` does not (N = 2: the replica with every video decode has the smaller max, 827 s vs 1133 s,
and is the slower, 1763 s vs 1403 s); balancing each resource against its own fair share gave higher simulated
makespans at N = 8 and 16 (529 s vs 498 s, 358 s vs 345 s). Pressure is modeled time over ``F = (sum compute + sum
memory) / N``; the modeled makespan is ``F x`` the largest pressure. Groups above a fair share are cut into pieces of
at most :data:`PIECE_SHARE` of it, placed greedily (largest first, to the replica whose pressure rises least) from
two starts, then refined by moves and swaps between any two replicas that lower the larger of their pressures.

Why two placements and not "a scalar cost is a two-resource cost with zeros": through the two-resource placement a
scalar cost gets other assignments. Its greedy breaks ties by pressure, its refinement also lowers replicas below the
maximum and stops at a coarser gain, and its fine pieces recompute far more prefix (on the inputs of
``scripts/scheduler_equality.py``, N = 2 to 16: makespans from 23% lower to 111% higher, up to 16x the recomputed
tokens with a prefill-only cost). So a scalar cost keeps its own placement and results: one entry path, two
placements.

Baselines: :func:`shard_requests` (round-robin, random) and :func:`sharded_saving_ratio`, the saving ratio N
independent engines reach when each groups only its own share of the batch.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from prefixattn.scheduling.checks import check_positive_int
from prefixattn.scheduling.grouping import PrefixGroup, group_prompts, saving_ratio
from prefixattn.scheduling.partition_assign import assign_scalar, assign_vector
from prefixattn.scheduling.partition_pieces import PIECE_SHARE
from prefixattn.scheduling.partition_result import (SPLIT_MARGIN, GroupCost, Partition, ResourceCost,
                                                    check_partition_groups, resource_costs, scalar_costs)
from prefixattn.scheduling.sequences import pack_sequences

__all__ = ["GroupCost", "PIECE_SHARE", "Partition", "ResourceCost", "SHARDINGS", "SPLIT_MODES", "partition_groups",
           "shard_requests", "sharded_saving_ratio", "token_cost"]

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
    originals = check_partition_groups(groups)
    n = check_positive_int("num_replicas", num_replicas)
    if split not in SPLIT_MODES:
        raise ValueError(f"split: expected one of {SPLIT_MODES}, got {split!r}")
    if cost is None:
        cost = token_cost()
    elif not callable(cost):
        raise ValueError(f"cost: expected a callable cost(group) -> float, got {type(cost).__name__}")
    vector = isinstance(cost(originals[0]), ResourceCost)
    if vector and split != "spread":
        raise ValueError(f"split: a ResourceCost cost cuts groups its own way (fine pieces); expected 'spread', "
                         f"got {split!r}")
    over, assign = _priced(originals, n, cost, vector, split, refine)
    to_split = [s for s, g in enumerate(originals) if allow_split and n > 1 and over[s] and g.num_requests > 1]
    best = assign([])
    if to_split:
        # a split pays its recomputation; keep it only where it actually lowers the (modeled) makespan
        with_split = assign(to_split)
        if with_split.makespan < best.makespan * (1 - SPLIT_MARGIN):
            best = with_split
    return best


def _priced(originals: list, n: int, cost: GroupCost, vector: bool, split: str, refine: bool):
    """``(over, assign)``: which groups exceed a fair share (``[len(originals)]`` bool) and ``assign(to_split)``,
    the placement for the cost's kind (a scalar cost, or a :class:`ResourceCost` balanced on both resources)."""
    if vector:
        res0, crit0 = resource_costs(originals, cost)
        fair = res0.sum(axis=0) / n
        own = np.max(np.where(fair > 0, res0 / np.where(fair > 0, fair, 1.0), 0.0), axis=1)

        def assign_two_resources(to_split: list) -> Partition:
            return assign_vector(originals, res0, crit0, fair, to_split, n, cost, refine)

        return own > 1 + SPLIT_MARGIN, assign_two_resources
    base_costs = scalar_costs(originals, cost)
    fair = float(base_costs.sum()) / n

    def assign_one_cost(to_split: list) -> Partition:
        return assign_scalar(originals, base_costs, to_split, n, cost, refine, split)

    return base_costs > fair * (1 + SPLIT_MARGIN), assign_one_cost


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
    num_requests = check_positive_int("num_requests", num_requests)
    num_replicas = check_positive_int("num_replicas", num_replicas)
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
