"""Prefix-affinity data parallelism (MODELED): N engine replicas on BatchLLM case 1 and BlendServe Trace #1.

For N = 1, 2, 4, 8, 16 replicas and three ways to shard the batch:

* ``prefix-affinity``: :func:`prefixattn.scheduling.partition_groups` (whole groups, balanced on the simulator's
  per-group cost :class:`prefixattn.sim.group_cost.GroupCostModel`);
* ``round-robin``: request ``i`` to replica ``i % N`` (``Dataset.split`` by row);
* ``random``: a seeded random permutation dealt round-robin;

each replica runs the simulator's engine (policy ``prefixattn``) on its own share, grouping it itself. Rows:

* ``saving_ratio`` / ``saving_kept``: BatchLLM Eq. 2 over all replicas (each groups its shard), and its fraction of
  the single-replica ratio (target for prefix-affinity: >= 0.99);
* ``est_balance``: max replica cost / (total cost / N) on the group cost model (the partitioner's own objective);
* ``sim_makespan_s``: the slowest replica's simulated time; ``sim_balance``: it over (sum of replica times / N)
  (target: <= 1.05); ``makespan_over_t1_per_n``: it over (single-replica time / N), which also charges the lost
  sharing and the smaller batches of each replica;
* ``split_groups`` / ``recomputed_tokens`` (prefix-affinity only).

Every number is modeled (the simulator's cost model, A100 presets), labelled ``device=a100 (modeled)``.
"""

from __future__ import annotations

import numpy as np
import pytest

BENCHMARK = "partition"
REPLICAS = [1, 2, 4, 8, 16]
WORKLOADS = ["batchllm-case1", "blendserve-trace1"]
STRATEGIES = ["prefix-affinity", "round-robin", "random"]
POLICY = "prefixattn"
SEED = 0

_cache: dict = {}


def _setup(name: str) -> dict:
    """Workload, its groups, cost model, the single-replica saving and simulated time (once per workload)."""
    if name not in _cache:
        from prefixattn.scheduling import group_prompts, saving_ratio
        from prefixattn.sim.costmodel import CostModel
        from prefixattn.sim.group_cost import GroupCostModel
        from prefixattn.sim.workloads import PAPER_SETTINGS, get_workload

        w = get_workload(name, seed=SEED)
        model, gpu = PAPER_SETTINGS[name]
        prompts = [r.prompt for r in w.requests]
        groups = group_prompts(prompts)
        cost = CostModel(gpu, model)
        _cache[name] = dict(workload=w, prompts=prompts, groups=groups, cost=cost, gpu=gpu,
                            group_cost=GroupCostModel(cost, output_lens=[r.output_len for r in w.requests]),
                            single_saving=saving_ratio(prompts, groups), t1=_simulate(w, np.arange(len(w)), cost))
    return _cache[name]


def _simulate(workload, ids: np.ndarray, cost) -> float:
    from prefixattn.sim.engine import Engine
    from prefixattn.sim.policies import make_policy
    from prefixattn.sim.workloads import Request, Workload

    # the engine indexes sequences by rid: number the shard's requests from 0
    reqs = [Request(j, workload.requests[i].prompt, workload.requests[i].output_len)
            for j, i in enumerate(ids.tolist())]
    return Engine(Workload(f"{workload.name}-shard", reqs), cost, make_policy(POLICY)).run().time_s


def _shard_groups_cost(s: dict, reps: np.ndarray, n: int) -> np.ndarray:
    """Group-cost-model load of each replica when it groups its own shard (the baselines' estimate)."""
    from prefixattn.scheduling import group_prompts

    loads = np.zeros(n)
    for r in range(n):
        ids = np.flatnonzero(reps == r)
        if ids.size:
            shard = [s["prompts"][i] for i in ids.tolist()]
            for g in group_prompts(shard):
                g.request_ids = [int(ids[i]) for i in g.request_ids]  # back to batch request ids for the cost
                loads[r] += s["group_cost"](g)
    return loads


@pytest.mark.parametrize("num_replicas", REPLICAS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_partition_vs_naive_sharding(results, workload, num_replicas):
    from prefixattn.scheduling.partition import partition_groups, shard_requests, sharded_saving_ratio

    s = _setup(workload)
    n = num_replicas
    shape = f"{workload} N={n}"
    device = f"{s['gpu']} (modeled)"
    part = partition_groups(s["groups"], n, s["group_cost"])
    assignments = {"prefix-affinity": part.request_replicas(len(s["prompts"])),
                   "round-robin": shard_requests(len(s["prompts"]), n),
                   "random": shard_requests(len(s["prompts"]), n, "random", seed=SEED)}
    for strategy in STRATEGIES if n > 1 else STRATEGIES[:1]:
        reps = assignments[strategy]
        saving = sharded_saving_ratio(s["prompts"], reps)
        loads = part.loads if strategy == "prefix-affinity" else _shard_groups_cost(s, reps, n)
        times = np.array([_simulate(s["workload"], np.flatnonzero(reps == r), s["cost"]) for r in range(n)
                          if (reps == r).any()])
        makespan = float(times.max())
        add = lambda metric, value, unit: results.add(BENCHMARK, strategy, shape, metric, value, unit,  # noqa: E731
                                                      device=device)
        add("saving_ratio", saving, "fraction")
        add("saving_kept", saving / s["single_saving"], "fraction of 1 replica")
        add("est_balance", float(loads.max() / (loads.sum() / n)), "max/mean")
        add("sim_makespan_s", makespan, "s (modeled)")
        add("sim_balance", makespan / (times.sum() / n), "max/mean")
        add("makespan_over_t1_per_n", makespan / (s["t1"] / n), "x")
        if strategy == "prefix-affinity":
            add("split_groups", len(part.split), "groups")
            add("recomputed_tokens", part.recomputed_tokens, "tokens")
