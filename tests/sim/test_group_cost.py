"""GroupCostModel: the simulator's cost model priced per prefix group (for the partitioner)."""

import numpy as np
import pytest

from prefixattn.scheduling import PrefixGroup, group_prompts
from prefixattn.scheduling.partition import partition_groups
from prefixattn.sim.step_cost import CostModel
from prefixattn.sim.group_cost import GroupCostModel
from prefixattn.sim.workloads import batchllm_microbenchmark


@pytest.fixture(scope="module")
def cost():
    return CostModel("a100", "mistral-7b")


def test_sharing_lowers_the_cost(cost):
    model = GroupCostModel(cost, output_lens=[50, 50])
    shared = PrefixGroup(prefix_len=1000, request_ids=[0, 1], prompt_lens=[1300, 1300])
    alone = [PrefixGroup(prefix_len=0, request_ids=[r], prompt_lens=[1300]) for r in (0, 1)]
    assert model(shared) < sum(model(g) for g in alone)
    # the paged kernel reads the prefix once per member: only the prefill saving remains
    paged = GroupCostModel(cost, output_lens=[50, 50], kernel="paged")
    assert model(shared) < paged(shared) < sum(paged(g) for g in alone)
    t = model.terms(shared)
    assert t["prefill_tokens"] == 1600 and t["decode_tokens"] == 100


def test_monotone_in_requests_and_lengths(cost):
    outs = np.arange(1, 9) * 40
    model = GroupCostModel(cost, output_lens=outs)
    ids = list(range(8))
    costs = [model(PrefixGroup(prefix_len=200, request_ids=ids[:k], prompt_lens=[400] * k)) for k in range(2, 9)]
    assert all(b > a for a, b in zip(costs, costs[1:]))
    longer = model(PrefixGroup(prefix_len=200, request_ids=ids[:3], prompt_lens=[800] * 3))
    assert longer > costs[1]
    assert model.prefill_s > 0 and model.decode_s > 0 and model.kv_read_s > 0


def test_tracks_the_total_of_a_simulated_run(cost):
    # a uniform workload: the sum of group costs is the same order as one replica's simulated time
    from prefixattn.sim.engine import Engine
    from prefixattn.sim.policies import make_policy

    w = batchllm_microbenchmark(1000, 200, 4, num_requests=96, output_len=64)
    groups = group_prompts(w.prompts())
    model = GroupCostModel(cost, output_lens=[r.output_len for r in w.requests])
    estimate = sum(model(g) for g in groups)
    simulated = Engine(w, cost, make_policy("batchllm")).run().time_s
    assert 0.5 < estimate / simulated < 2.0
    # and it drives the partitioner: equal groups, equal loads
    p = partition_groups(groups, 4, model)
    assert p.balance == pytest.approx(1.0, abs=0.02) and p.split == []


def test_bad_input(cost):
    with pytest.raises(ValueError, match="cost: expected a prefixattn.sim.step_cost.CostModel"):
        GroupCostModel("a100")
    with pytest.raises(ValueError, match="kernel: expected one of"):
        GroupCostModel(cost, kernel="flash")
    with pytest.raises(ValueError, match="output_lens: expected a 1-D array"):
        GroupCostModel(cost, output_lens=[[1]])
