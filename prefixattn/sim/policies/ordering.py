"""Thin adapters from workloads to :mod:`prefixattn.scheduling` (grouping and ordering live there, not here)."""

from __future__ import annotations

from prefixattn.scheduling import group_prompts, order_groups


def groups_of(workload, levels: int | None = 1, min_shared_tokens: int = 1) -> list:
    """Prefix groups of the workload's prompts (cached on the workload per (levels, min_shared_tokens))."""
    cache = workload.info.setdefault("_groups", {})
    key = (levels, min_shared_tokens)
    if key not in cache:
        cache[key] = group_prompts([r.prompt for r in workload.requests], levels=levels,
                                   min_shared_tokens=min_shared_tokens)
    return cache[key]


def request_ids_in_tree_order(workload) -> list:
    """Request indices in the prompts' prefix-tree (DFS) order: :func:`prefixattn.scheduling.order_groups` "dfs"
    over the whole tree, flattened (each group lists its requests in tree order)."""
    groups = order_groups(groups_of(workload, levels=None), "dfs")
    return [rid for g in groups for rid in g.request_ids]
