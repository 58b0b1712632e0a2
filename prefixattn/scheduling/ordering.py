"""Group ordering policies behind one interface, looked up by name.

A policy takes the prefix groups and (optionally) per-request output lengths and returns the groups in the order
the token batcher should admit them. Built in:

* ``fcfs``: arrival order (smallest request id of each group first).
* ``dfs``: prefix-tree order (SGLang's prefix-aware order; maximizes reuse with an LRU cache).
* ``batchllm``: BatchLLM Eq. 3/4. ``R_group = mean(L_decode) / (L_prefix + sum L_distinct)``, larger first; with
  no (or constant) output lengths this is Eq. 4, ``1 / (L_prefix + sum L_distinct)``: groups with fewer prefill
  tokens first, so long prefills come later and mix with the earlier groups' decodes.
* ``blendserve``: BlendServe's compute-density order with the dual scanner (:mod:`.blendserve`).

Ties are broken by the smallest request id in the group, never by hashing or set order.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from prefixattn.scheduling.blendserve import blendserve_order
from prefixattn.scheduling.group_arrays import first_request, group_arrays, processed_tokens
from prefixattn.scheduling.grouping import PrefixGroup
from prefixattn.scheduling.output_lengths import output_lens_array

#: ``policy(groups, output_lens, **options) -> groups in order``. ``output_lens`` is None or a float64 array
#: indexed by request id. A policy may split a group into pieces (same prefix, disjoint members) but must return
#: every request exactly once.
OrderingPolicy = Callable[..., list[PrefixGroup]]


def fcfs_order(groups: Sequence[PrefixGroup], output_lens=None) -> list[PrefixGroup]:
    """Arrival order: by smallest request id."""
    return [groups[i] for i in np.argsort(first_request(groups), kind="stable")]


def dfs_order(groups: Sequence[PrefixGroup], output_lens=None) -> list[PrefixGroup]:
    """Prefix-tree (DFS) order from ``PrefixGroup.dfs_rank``; groups without a rank keep their relative place
    after the ranked ones."""
    rank = np.fromiter((g.dfs_rank for g in groups), dtype=np.int64, count=len(groups))
    rank = np.where(rank >= 0, rank, np.iinfo(np.int64).max)
    return [groups[i] for i in np.lexsort((first_request(groups), rank))]


def batchllm_order(groups: Sequence[PrefixGroup], output_lens=None) -> list[PrefixGroup]:
    """BatchLLM Eq. 3/4: larger ``mean(L_decode) / (L_prefix + sum L_distinct)`` first."""
    prefill = processed_tokens(groups).astype(np.float64)
    if output_lens is None:
        decode = np.ones(len(groups))
    else:
        owner, ids, _ = group_arrays(groups)
        decode = np.bincount(owner, weights=output_lens[ids], minlength=len(groups)) / \
            np.bincount(owner, minlength=len(groups))
    ratio = decode / np.maximum(prefill, 1.0)
    return [groups[i] for i in np.lexsort((first_request(groups), -ratio))]


#: Policies by name; :func:`register_ordering` adds more.
ORDERINGS: dict[str, OrderingPolicy] = {
    "fcfs": fcfs_order,
    "dfs": dfs_order,
    "batchllm": batchllm_order,
    "blendserve": blendserve_order,
}
#: The policy :func:`order_groups` uses when none is named.
DEFAULT_ORDERING = "batchllm"


def register_ordering(name: str, policy: OrderingPolicy) -> None:
    """Add (or replace) an ordering policy under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not callable(policy):
        raise ValueError(f"policy: expected a callable, got {type(policy).__name__}")
    ORDERINGS[name] = policy


def order_groups(groups: Sequence[PrefixGroup], ordering: str = DEFAULT_ORDERING, *, output_lens=None,
                 **options) -> list[PrefixGroup]:
    """Order prefix groups for admission with the named policy.

    Parameters
    ----------
    groups : Sequence[PrefixGroup]
        Groups from :func:`prefixattn.scheduling.group_prompts`.
    ordering : str
        A name in :data:`ORDERINGS`: ``fcfs``, ``dfs``, ``batchllm`` (default) or ``blendserve``.
    output_lens : None, float or array-like
        Output length per request (indexed by request id; e.g. from
        :func:`prefixattn.scheduling.estimate_output_lens`), a constant, or None (unknown: treated as constant).
    **options
        Passed to the policy (``blendserve``: ``cost_model``, ``split_requests``, ``default_output_len``).

    Returns
    -------
    list[PrefixGroup]
        The groups in order (``blendserve`` may split large groups into pieces with the same prefix).

    Raises
    ------
    ValueError
        Unknown ``ordering``, empty ``groups``, bad ``output_lens``.

    Examples
    --------
    >>> from prefixattn.scheduling import group_prompts
    >>> groups = group_prompts([[1] * 50 + [2], [1] * 50 + [3], [4, 5, 6]])
    >>> [g.request_ids for g in order_groups(groups, "batchllm")]   # 3 prefill tokens before 52
    [[2], [0, 1]]
    >>> [g.request_ids for g in order_groups(groups, "fcfs")]
    [[0, 1], [2]]
    """
    if not isinstance(ordering, str):
        raise ValueError(f"ordering: expected a policy name (str) from {sorted(ORDERINGS)}, got "
                         f"{type(ordering).__name__}")
    if ordering not in ORDERINGS:
        raise ValueError(f"ordering: expected one of {sorted(ORDERINGS)}, got {ordering!r}")
    groups = list(groups)
    if not groups:
        raise ValueError("groups: expected at least one PrefixGroup, got none")
    if not all(isinstance(g, PrefixGroup) for g in groups):
        bad = next(i for i, g in enumerate(groups) if not isinstance(g, PrefixGroup))
        raise ValueError(f"groups[{bad}]: expected a PrefixGroup, got {type(groups[bad]).__name__}")
    num_requests = 1 + max(max(g.request_ids) for g in groups)
    out = output_lens_array(output_lens, num_requests)
    result = list(ORDERINGS[ordering](groups, out, **options))
    if sum(len(g.request_ids) for g in result) != sum(len(g.request_ids) for g in groups):
        raise ValueError(f"ordering: policy {ordering!r} lost or duplicated requests")
    return result
