"""An offline batch's prefix groups assigned to N engine replicas, measured against the baselines.

The partitioner (:mod:`prefixattn.scheduling.partition`) is numpy-only. This module is glue, and lives with the
simulator for that reason (sim may import scheduling, never the other way round): it reads prompts with the
simulator's JSONL loader / seed workloads and, with ``cost="sim"`` (the default), prices groups with the simulator's
cost model (:class:`prefixattn.sim.group_cost.GroupCostModel`) on two resources (compute, memory, plus the serial
floor of long decodes: the modeled replica time is their sum, the largest floor only); ``cost="sim-scalar"``
balances compute + memory without the floor. ``prefixattn partition`` (:mod:`prefixattn.cli.partition`) prints it.
"""

from __future__ import annotations

import numpy as np


def _rows(partition, prompts) -> list[dict]:
    rows = []
    pressure = partition.pressure
    res = partition.resource_loads
    for r in range(partition.num_replicas):
        idx = np.flatnonzero(partition.replicas == r)
        groups = [partition.groups[i] for i in idx.tolist()]
        row = dict(replica=r, groups=len(groups), requests=sum(g.num_requests for g in groups),
                   prompt_tokens=sum(g.logical_tokens for g in groups),
                   computed_tokens=sum(g.processed_tokens for g in groups),
                   cost=float(partition.costs[idx].sum()), pressure=float(pressure[r]))
        if res is not None:
            row.update(compute=float(res[r, 0]), memory=float(res[r, 1]))
        rows.append(row)
    return rows


def summarize(workload, num_replicas: int, *, levels: int = 1, cost: str = "sim", model=None, gpu=None,
              decode_weight: float = 1.0, allow_split: bool = True, split: str = "spread", seed: int = 0) -> dict:
    """Partition ``workload`` (a :class:`prefixattn.sim.workloads.Workload`) and measure it against the baselines.

    Returns a dict: ``partition`` (the :class:`Partition`), ``replicas`` (per-replica rows), ``saving`` (ratio per
    strategy, single replica and optimal included), ``kept`` (fraction of the single-replica ratio per strategy),
    ``balance``, ``split_groups``, ``recomputed_tokens``, ``cost`` (what priced the groups).
    """
    from prefixattn.scheduling import group_prompts, optimal_saving_ratio, saving_ratio
    from prefixattn.scheduling.partition import partition_groups, shard_requests, sharded_saving_ratio, token_cost

    prompts = [r.prompt for r in workload.requests]
    outs = [r.output_len for r in workload.requests]
    groups = group_prompts(prompts, levels=levels)
    if cost in ("sim", "sim-scalar"):
        from prefixattn.sim.step_cost import CostModel
        from prefixattn.sim.group_cost import GroupCostModel
        from prefixattn.sim.workloads import PAPER_SETTINGS

        paper_model, paper_gpu = PAPER_SETTINGS.get(workload.name, ("mistral-7b", "a100"))
        model, gpu = model or paper_model, gpu or paper_gpu
        model_fn = GroupCostModel(CostModel(gpu, model), output_lens=outs)
        fn = model_fn.resources if cost == "sim" else model_fn
        cost_label = f"sim ({model} on {gpu}, modeled s; " + (
            "two resources: compute, memory, serial floor)" if cost == "sim" else "one number: compute + memory)")
    elif cost == "tokens":
        fn = token_cost(outs, decode_weight=decode_weight)
        cost_label = f"tokens (prefill after sharing + {decode_weight:g} x decode)"
    else:
        raise ValueError(f"cost: expected 'sim', 'sim-scalar' or 'tokens', got {cost!r}")
    part = partition_groups(groups, num_replicas, fn, allow_split=allow_split, split=split)
    single = saving_ratio(prompts, groups)
    saving = {"single replica": single, "optimal": optimal_saving_ratio(prompts),
              "prefix-affinity": sharded_saving_ratio(prompts, part.request_replicas(len(prompts)), levels=levels),
              "round-robin": sharded_saving_ratio(prompts, shard_requests(len(prompts), num_replicas),
                                                  levels=levels),
              "random": sharded_saving_ratio(prompts, shard_requests(len(prompts), num_replicas, "random", seed),
                                             levels=levels)}
    kept = {k: (v / single if single else 1.0) for k, v in saving.items()
            if k in ("prefix-affinity", "round-robin", "random")}
    return dict(workload=workload.name, output_len_assumption=workload.info.get("output_len_assumption"),
                num_requests=len(prompts), num_groups=len(groups), levels=levels,
                num_replicas=num_replicas, cost=cost_label, partition=part, replicas=_rows(part, prompts),
                balance=part.balance, split_groups=part.split, recomputed_tokens=part.recomputed_tokens,
                saving=saving, kept=kept)
