"""partition_groups with a two-resource cost (ResourceCost): modeled replica times (compute + memory + serial floor)
balanced, splits only of groups over a fair share, the floor of long decodes respected, deterministic;
GroupCostModel.resources."""

import numpy as np
import pytest

from prefixattn.scheduling import PrefixGroup, group_prompts, saving_ratio
from prefixattn.scheduling.partition import PIECE_SHARE, ResourceCost, partition_groups
from tests.scheduling.synthetic import case1_like

#: Toy prices: a decode token's KV reads per context token, and a solo decode step, relative to a prefill token.
_KV_PRICE = 1e-3
_STEP_PRICE = 0.5


def toy_cost(output_lens, critical=True, kv_price=_KV_PRICE, step_price=_STEP_PRICE):
    """compute = tokens through the GEMMs, memory = KV token reads of the decodes, critical = longest decode."""
    outs = np.asarray(output_lens, dtype=np.float64)

    def cost(g: PrefixGroup) -> ResourceCost:
        d = outs[np.asarray(g.request_ids)]
        p = np.asarray(g.prompt_lens, dtype=np.float64)
        return ResourceCost(compute=float(g.processed_tokens + d.sum()),
                            memory=float((p * d + d * d / 2).sum()) * kv_price,
                            critical=float(d.max()) * step_price if critical else 0.0)

    return cost


def _mixed_batch(seed=0, docs=60, long_groups=24, long_size=(2, 5)):
    """Compute-heavy groups (long shared documents, short outputs) and memory-heavy ones (short prompts, long
    outputs), shuffled: BlendServe's mix in miniature."""
    rng = np.random.default_rng(seed)
    prompts, outs = [], []
    for _ in range(docs):
        doc = rng.integers(0, 30000, int(rng.integers(300, 900))).tolist()
        for _ in range(int(rng.integers(2, 8))):
            prompts.append(doc + rng.integers(0, 30000, int(rng.integers(20, 80))).tolist())
            outs.append(int(rng.integers(2, 20)))
    for _ in range(long_groups):
        head = rng.integers(0, 30000, 16).tolist()
        for _ in range(int(rng.integers(*long_size))):
            prompts.append(head + rng.integers(0, 30000, int(rng.integers(50, 150))).tolist())
            outs.append(int(rng.integers(700, 2000)))
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order], [outs[i] for i in order]


def _check_cover(p, num_requests):
    assert sorted(r for g in p.groups for r in g.request_ids) == list(range(num_requests))


def _modeled_times(p, cost, n):
    """Compute + memory + the largest floor per replica, from the cost itself."""
    times = np.zeros(n)
    floors = np.zeros(n)
    for g, r in zip(p.groups, p.replicas.tolist()):
        c = cost(g)
        times[r] += c.compute + c.memory
        floors[r] = max(floors[r], c.critical)
    return times + floors


@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_modeled_times_balanced(num_replicas):
    prompts, outs = _mixed_batch(seed=num_replicas)
    groups = group_prompts(prompts)
    cost = toy_cost(outs)
    mix = np.array([cost(g).memory / cost(g).compute for g in groups])
    assert mix.max() / mix.min() > 20  # precondition: compute-heavy and memory-heavy groups
    p = partition_groups(groups, num_replicas, cost)
    _check_cover(p, len(prompts))
    fair_time = sum(cost(g).compute + cost(g).memory for g in groups) / num_replicas
    times = _modeled_times(p, cost, num_replicas)
    assert p.pressure == pytest.approx(times / fair_time)
    assert p.makespan == pytest.approx(times.max()) and p.balance == pytest.approx(times.max() / fair_time)
    assert p.balance <= 1.05
    assert p.resource_loads.sum(axis=0) == pytest.approx(
        [sum(cost(g)[k] for g in p.groups) for k in range(2)])


def test_the_floor_changes_the_assignment_for_the_better():
    # balanced on compute + memory alone, the replicas holding the long decodes also get their share of the rest;
    # with the floor, the modeled makespan (floor included) is lower
    prompts, outs = _mixed_batch(seed=8, docs=30, long_groups=6, long_size=(1, 2))
    groups = group_prompts(prompts)
    cost = toy_cost(outs, step_price=4.0)
    fair_time = sum(cost(g).compute + cost(g).memory for g in groups) / 4
    assert max(cost(g).critical for g in groups) > fair_time / 3  # precondition: floors that matter
    n = 4
    with_floor = partition_groups(groups, n, cost)
    scalar = partition_groups(groups, n, lambda g: cost(g).compute + cost(g).memory)
    assert _modeled_times(scalar, cost, n).max() > 1.02 * with_floor.makespan


def test_only_groups_over_a_fair_share_are_split_and_the_prefix_is_counted():
    # one memory-heavy group: many long decodes behind a short shared prefix, more than a replica's fair time
    prompts, outs = _mixed_batch(seed=5, long_groups=1, long_size=(14, 15))
    groups = group_prompts(prompts)
    cost = toy_cost(outs, critical=False)
    n = 3
    fair = np.array([sum(cost(g)[k] for g in groups) for k in range(2)]) / n
    over = [i for i, g in enumerate(groups) if cost(g).memory > fair[1] or cost(g).compute > fair[0]]
    big = cost(groups[over[0]])
    assert len(over) == 1 and big.memory > fair[1] and big.compute + big.memory > fair.sum()  # precondition
    p = partition_groups(groups, n, cost)
    _check_cover(p, len(prompts))
    assert p.split == over
    reps = p.request_replicas()
    for i, g in enumerate(groups):
        if i not in over:
            assert len(set(reps[g.request_ids].tolist())) == 1, "a group was split without being forced"
    holders = {int(r) for r, s in zip(p.replicas, p.source) if s == over[0]}
    assert len(holders) == n
    # one piece per holding replica (pieces on one replica merged), each recomputing the shared prefix once
    assert sum(1 for s in p.source if s == over[0]) == len(holders)
    assert p.recomputed_tokens == (len(holders) - 1) * groups[over[0]].prefix_len
    # the saving lost is exactly the recomputation
    single = saving_ratio(prompts, groups)
    assert p.saving_ratio() == pytest.approx(single - p.recomputed_tokens / sum(map(len, prompts)), abs=1e-12)
    assert p.balance <= 1.05


def test_no_split_when_disallowed_or_single_replica():
    prompts, outs = _mixed_batch(seed=5, long_groups=1)
    groups = group_prompts(prompts)
    cost = toy_cost(outs)
    assert partition_groups(groups, 3, cost, allow_split=False).split == []
    one = partition_groups(groups, 1, cost)
    assert one.split == [] and len(one.groups) == len(groups) and (one.replicas == 0).all()


def test_the_replica_with_the_longest_decode_gets_less_other_work():
    # one request decodes so long that its serial floor exceeds a replica's fair time: its replica should hold
    # little else (KV reads left out: only compute and the floor count here)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 30000, 200).tolist() for _ in range(80)]
    outs = [10] * 80
    outs[17] = 4000
    groups = group_prompts(prompts)
    cost = toy_cost(outs, kv_price=0.0)
    p = partition_groups(groups, 4, cost)
    reps = p.request_replicas()
    mine = reps[17]
    counts = np.bincount(reps, minlength=4)
    assert counts[mine] < counts.min(initial=10**9, where=np.arange(4) != mine)
    # and the modeled makespan is the serial floor's replica, with the others no higher
    assert p.pressure[mine] == pytest.approx(p.pressure.max())
    without_floor = partition_groups(groups, 4, toy_cost(outs, critical=False, kv_price=0.0))
    assert np.bincount(without_floor.request_replicas(), minlength=4)[without_floor.request_replicas()[17]] > \
        counts[mine]


def test_nested_groups_are_cut_at_their_boundaries():
    # a shared system prompt over many documents (levels=2): the top group is over every fair share, its documents
    # are not, so every document stays on one replica
    prompts = case1_like(400, seed=2)
    groups = group_prompts(prompts, levels=2)
    assert len(groups) == 1 and groups[0].children
    outs = [int(x) for x in np.random.default_rng(0).integers(2, 40, len(prompts))]
    p = partition_groups(groups, 4, toy_cost(outs))
    _check_cover(p, len(prompts))
    assert p.split == [0]
    reps = p.request_replicas()
    for child in groups[0].children:
        assert len(set(reps[child.request_ids].tolist())) == 1
    assert p.balance < 1.05
    assert p.recomputed_tokens == (len(set(p.replicas.tolist())) - 1) * groups[0].prefix_len


def test_pieces_are_small_enough_to_balance():
    # a single group (one shared prefix, many requests) over 4 replicas: pieces of at most PIECE_SHARE of a fair
    # share, evened out to within one piece
    rng = np.random.default_rng(1)
    head = rng.integers(0, 30000, 30).tolist()
    prompts = [head + rng.integers(0, 30000, int(rng.integers(50, 400))).tolist() for _ in range(300)]
    outs = [int(x) for x in rng.integers(5, 200, 300)]
    groups = group_prompts(prompts)
    p = partition_groups(groups, 4, toy_cost(outs, critical=False))
    assert p.split == [0] and len(p.groups) == 4
    assert p.balance <= 1 + PIECE_SHARE


def test_deterministic():
    prompts, outs = _mixed_batch(seed=9)
    groups = group_prompts(prompts)
    a = partition_groups(groups, 4, toy_cost(outs))
    b = partition_groups(group_prompts(prompts), 4, toy_cost(outs))
    assert a.replicas.tolist() == b.replicas.tolist()
    assert [g.request_ids for g in a.groups] == [g.request_ids for g in b.groups]


@pytest.mark.parametrize("cost, kwargs, match", [
    pytest.param(lambda g: ResourceCost(-1.0, 1.0), {}, "expected finite costs >= 0", id="negative-compute"),
    pytest.param(lambda g: ResourceCost(1.0, float("nan")), {}, "expected finite costs >= 0", id="nan-memory"),
    pytest.param(lambda g: ResourceCost(1.0, 1.0) if g.request_ids[0] == 0 else 1.0, {}, "expected a ResourceCost",
                 id="mixed-cost-kinds"),
    pytest.param(lambda g: ResourceCost(1.0, 1.0), dict(split="fill"), "split: a ResourceCost cost",
                 id="fill-with-resources"),
])
def test_bad_vector_costs(cost, kwargs, match):
    groups = group_prompts([[0, 1, 2], [0, 1, 3], [5, 6]])
    groups.sort(key=lambda g: g.request_ids[0])
    with pytest.raises(ValueError, match=match):
        partition_groups(groups, 2, cost, **kwargs)


def test_group_cost_model_resources_add_up_to_the_scalar_cost():
    from prefixattn.sim.step_cost import CostModel
    from prefixattn.sim.group_cost import GroupCostModel

    model = GroupCostModel(CostModel("a100", "llama-3.1-8b"), output_lens=[4, 3000, 20])
    g = PrefixGroup(prefix_len=64, request_ids=[0, 1, 2], prompt_lens=[300, 100, 900])
    r = model.resources(g)
    assert r.compute + r.memory == pytest.approx(model(g))
    assert r.critical == pytest.approx(3000 * model.solo_step_s)
    # a long decode is memory-heavy, a long prompt compute-heavy
    long_out = model.resources(PrefixGroup(prefix_len=0, request_ids=[1], prompt_lens=[100]))
    long_in = model.resources(PrefixGroup(prefix_len=0, request_ids=[0], prompt_lens=[4000]))
    assert long_out.memory / long_out.compute > 1 > long_in.memory / long_in.compute
