"""partition_groups: whole groups to replicas (split only when forced), balance, determinism, baselines."""

import itertools
import json

import numpy as np
import pytest

from prefixattn.scheduling import PrefixGroup, group_prompts, saving_ratio
from prefixattn.scheduling.partition import (Partition, partition_groups, shard_requests, sharded_saving_ratio,
                                             token_cost)
from tests.scheduling.synthetic import case1_like, nested_random


def _groups_of(prompts, levels=1):
    return group_prompts(prompts, levels=levels)


def _check_cover(p: Partition, n: int):
    """Every request in exactly one group, every group on a valid replica."""
    ids = sorted(r for g in p.groups for r in g.request_ids)
    assert ids == list(range(n))
    assert p.replicas.shape == (len(p.groups),) and p.costs.shape == (len(p.groups),)
    assert ((p.replicas >= 0) & (p.replicas < p.num_replicas)).all()
    reps = p.request_replicas(n)
    assert (reps >= 0).all()


def _big_group_batch(seed=0, big=200, small=30):
    """One group of ``big`` requests behind a 50-token prefix, plus ``small`` groups of 3 requests."""
    rng = np.random.default_rng(seed)
    prompts = []
    head = rng.integers(0, 30000, 50).tolist()
    for _ in range(big):
        prompts.append(head + rng.integers(0, 30000, int(rng.integers(20, 60))).tolist())
    for _ in range(small):
        doc = rng.integers(0, 30000, 80).tolist()
        for _ in range(3):
            prompts.append(doc + rng.integers(0, 30000, int(rng.integers(20, 60))).tolist())
    return [prompts[i] for i in rng.permutation(len(prompts))]


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4, 8])
def test_whole_groups_when_none_exceeds_fair_share(num_replicas):
    prompts = case1_like(300, seed=num_replicas)
    groups = _groups_of(prompts)
    cost = token_cost()
    total = sum(cost(g) for g in groups)
    assert max(cost(g) for g in groups) <= total / num_replicas  # precondition: nothing is forced to split
    p = partition_groups(groups, num_replicas)
    _check_cover(p, len(prompts))
    assert p.split == [] and p.recomputed_tokens == 0
    assert len(p.groups) == len(groups)
    reps = p.request_replicas()
    for g in groups:
        assert len(set(reps[g.request_ids].tolist())) == 1, "a group was split without being forced"
    # the partition keeps the single-replica saving exactly, and the replicas regrouping their shards agree
    single = saving_ratio(prompts, groups)
    assert p.saving_ratio() == pytest.approx(single, abs=1e-12)
    assert sharded_saving_ratio(prompts, reps) >= single - 1e-12


@pytest.mark.parametrize("num_replicas", [2, 4, 8])
def test_balance_on_many_small_groups(num_replicas):
    # ~40 groups per replica: LPT + refinement should land within 5% of total / N (the target)
    prompts = case1_like(280 * num_replicas // 2, seed=11)
    groups = _groups_of(prompts)
    p = partition_groups(groups, num_replicas)
    assert p.balance <= 1.05
    lpt_only = partition_groups(groups, num_replicas, refine=False)
    assert p.makespan <= lpt_only.makespan + 1e-9


def _brute_force_makespan(costs, n):
    best = np.inf
    for assign in itertools.product(range(n), repeat=len(costs)):
        best = min(best, np.bincount(assign, weights=costs, minlength=n).max())
    return best


@pytest.mark.parametrize("seed", range(6))
def test_within_lpt_bound_of_the_optimum(seed):
    rng = np.random.default_rng(seed)
    # 7 groups of random size and prefix; exhaustive optimum over 2 and 3 replicas (no splitting)
    prompts = []
    for _ in range(7):
        head = rng.integers(0, 30000, int(rng.integers(5, 200))).tolist()
        for _ in range(int(rng.integers(2, 6))):
            prompts.append(head + rng.integers(0, 30000, int(rng.integers(2, 100))).tolist())
    groups = _groups_of(prompts)
    cost = token_cost()
    costs = np.array([cost(g) for g in groups])
    for n in (2, 3):
        p = partition_groups(groups, n, allow_split=False)
        opt = _brute_force_makespan(costs, n)
        assert p.makespan <= (4 / 3 - 1 / (3 * n)) * opt + 1e-9
        assert p.makespan >= opt - 1e-9


@pytest.mark.parametrize("split", ["spread", "fill"])
@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_only_the_oversized_group_is_split(num_replicas, split):
    prompts = _big_group_batch(seed=num_replicas)
    groups = _groups_of(prompts)
    cost = token_cost()
    total = sum(cost(g) for g in groups)
    over = [i for i, g in enumerate(groups) if cost(g) > total / num_replicas]
    assert len(over) == 1
    big = groups[over[0]]
    p = partition_groups(groups, num_replicas, split=split)
    _check_cover(p, len(prompts))
    assert p.split == over
    reps = p.request_replicas()
    for i, g in enumerate(groups):
        if i != over[0]:
            assert len(set(reps[g.request_ids].tolist())) == 1
    pieces = [g for g, s in zip(p.groups, p.source.tolist()) if s == over[0]]
    # spread: one equal piece per replica (each keeps the batch's mix); fill: as few as the level needs
    assert len(pieces) == num_replicas if split == "spread" else 2 <= len(pieces) <= num_replicas
    assert len({int(r) for r, s in zip(p.replicas, p.source) if s == over[0]}) == len(pieces)  # one per replica
    # every piece keeps the prefix; the recomputation is one prefix per extra piece, and it is what was lost
    assert all(q.prefix_len == big.prefix_len for q in pieces if q.num_requests > 1)
    assert p.recomputed_tokens == (len(pieces) - 1) * big.prefix_len
    # the pieces really share what they claim (validated by grouping's own checker) and the accounting agrees
    assert saving_ratio(prompts, p.groups) == pytest.approx(p.saving_ratio(), abs=1e-12)
    logical = sum(len(x) for x in prompts)
    assert saving_ratio(prompts, groups) - p.saving_ratio() == pytest.approx(p.recomputed_tokens / logical)
    assert p.balance <= 1.05


def test_spread_gives_every_replica_a_share_of_each_split_group():
    # a prefill-heavy and a decode-heavy group, both above the fair share: with "spread" every replica gets a piece
    # of each (the mix that keeps a replica neither only compute- nor only memory-bound)
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, 30000, 16).tolist(), rng.integers(0, 30000, 16).tolist()
    prompts = [a + rng.integers(0, 30000, 600).tolist() for _ in range(40)] + \
        [b + rng.integers(0, 30000, 40).tolist() for _ in range(40)]
    outs = np.array([2] * 40 + [600] * 40)
    groups = _groups_of(prompts)
    assert len(groups) == 2
    p = partition_groups(groups, 4, token_cost(outs))
    reps = p.request_replicas()
    for r in range(4):
        assert (reps[:40] == r).any() and (reps[40:] == r).any()
    assert p.recomputed_tokens == 2 * 3 * 16 and p.balance <= 1.05


def test_no_split_when_disallowed():
    prompts = _big_group_batch()
    groups = _groups_of(prompts)
    p = partition_groups(groups, 4, allow_split=False)
    assert p.split == [] and len(p.groups) == len(groups)
    cost = token_cost()
    reps = p.request_replicas()
    assert all(len(set(reps[g.request_ids].tolist())) == 1 for g in groups)
    assert p.makespan >= max(cost(g) for g in groups) and p.recomputed_tokens == 0


@pytest.mark.parametrize("seed", range(4))
def test_nested_groups_split_into_valid_pieces(seed):
    rng = np.random.default_rng(seed)
    prompts = nested_random(rng, 200, alphabet=2, max_len=14)
    groups = _groups_of(prompts, levels=None)
    p = partition_groups(groups, 4)
    _check_cover(p, len(prompts))
    # grouping's checker validates every piece (nested children inside their parent, prefixes really shared)
    assert saving_ratio(prompts, p.groups) == pytest.approx(p.saving_ratio(), abs=1e-12)
    for g in p.groups:
        for sub, _ in g.walk():
            assert sub.num_requests >= 1
            assert all(c.num_requests >= 2 for c in sub.children)


def test_split_kept_only_when_it_lowers_the_makespan():
    # the document group exceeds total / 2, but splitting 2 requests recomputes its 1100-token prefix: worse
    rng = np.random.default_rng(0)
    d1, d2 = rng.integers(0, 30000, 1100).tolist(), rng.integers(0, 30000, 600).tolist()
    prompts = [d1 + rng.integers(0, 30000, 400).tolist(), d1 + rng.integers(0, 30000, 300).tolist(),
               d2 + rng.integers(0, 30000, 300).tolist(), d2 + rng.integers(0, 30000, 350).tolist(), [1, 2, 3]]
    groups = _groups_of(prompts)
    cost = token_cost()
    big = max(groups, key=cost)
    assert cost(big) > sum(cost(g) for g in groups) / 2
    p = partition_groups(groups, 2)
    assert p.split == [] and p.recomputed_tokens == 0
    assert p.makespan == cost(big)


def test_cli_prints_the_summary(tmp_path, capsys):
    from prefixattn.cli import main

    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt_len": 300, "prefix_id": f"doc{i % 5}", "prefix_len": 200, "output_len": 20} for i in range(40)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out_json = tmp_path / "out.json"
    assert main(["partition", "--replicas", "4", str(path), "--cost", "tokens", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "40 requests, 5 groups" in text and "load balance" in text
    # 5 documents x 8 requests, 7 x 200 tokens saved per document, of 40 x 300: 7000 / 12000 kept whole
    assert "prefix-affinity  0.5833  kept 100.00%" in text
    data = json.loads(out_json.read_text())
    reps = {}
    for g in data["partition"]["groups"]:
        for r in g["request_ids"]:
            reps[r] = g["replica"]
    assert sorted(reps) == list(range(40))
    assert all(len({reps[i] for i in range(k, 40, 5)}) == 1 for k in range(5))  # each document on one replica
    assert data["kept"]["round-robin"] < 1.0 and data["num_replicas"] == 4
    # modeled cost from the simulator, and errors as exit code 2 with a message naming the argument
    assert main(["partition", "--replicas", "2", str(path)]) == 0
    assert "sim (mistral-7b on a100" in capsys.readouterr().out
    assert main(["partition", "--replicas", "0", str(path)]) == 2
    assert "--replicas: expected a positive int, got 0" in capsys.readouterr().err
    assert main(["partition", "--replicas", "2", str(tmp_path / "missing.jsonl")]) == 2


def test_deterministic():
    prompts = _big_group_batch(seed=5)
    groups = _groups_of(prompts)
    outs = np.random.default_rng(0).integers(1, 300, len(prompts))
    a = partition_groups(groups, 3, token_cost(outs, decode_weight=2.0))
    b = partition_groups(_groups_of(prompts), 3, token_cost(outs, decode_weight=2.0))
    assert np.array_equal(a.request_replicas(), b.request_replicas())
    assert np.array_equal(a.costs, b.costs) and a.split == b.split


def test_single_replica_and_more_replicas_than_groups():
    prompts = [[1] * 10 + [2], [1] * 10 + [3], [5, 6, 7]]
    groups = _groups_of(prompts)
    p1 = partition_groups(groups, 1)
    assert p1.request_replicas().tolist() == [0, 0, 0] and p1.balance == pytest.approx(1.0)
    p8 = partition_groups(groups, 8)
    _check_cover(p8, 3)
    # the 2-request group exceeds total/8: split into one-request pieces (which share nothing: 10 tokens again)
    assert p8.split == [0] and p8.recomputed_tokens == 10
    assert len(set(p8.request_replicas().tolist())) == 3


def test_output_lengths_change_the_assignment():
    # prompt-only costs A=100, B=100, C=150, D=50 pair A+B against C+D; A and B generate 300 tokens each, so with
    # output lengths in the cost they must go to different replicas
    groups = [PrefixGroup(0, [i], [n]) for i, n in enumerate((100, 100, 150, 50))]
    outs = np.array([300, 300, 1, 1])
    prompt_only = partition_groups(groups, 2).request_replicas()
    assert prompt_only[0] == prompt_only[1]
    with_outputs = partition_groups(groups, 2, token_cost(outs))
    reps = with_outputs.request_replicas()
    assert reps[0] != reps[1]
    assert with_outputs.makespan == 100 + 300 + 150 + 1


def test_round_robin_and_random_shards():
    rr = shard_requests(10, 3)
    assert rr.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    rnd = shard_requests(10, 3, "random", seed=1)
    assert sorted(np.bincount(rnd).tolist()) == [3, 3, 4]
    assert np.array_equal(rnd, shard_requests(10, 3, "random", seed=1))
    assert not np.array_equal(rnd, shard_requests(10, 3, "random", seed=2))


def test_naive_sharding_loses_the_saving():
    prompts = case1_like(350, seed=3)
    groups = _groups_of(prompts)
    single = saving_ratio(prompts, groups)
    p = partition_groups(groups, 8)
    ours = sharded_saving_ratio(prompts, p.request_replicas())
    rr = sharded_saving_ratio(prompts, shard_requests(len(prompts), 8))
    rnd = sharded_saving_ratio(prompts, shard_requests(len(prompts), 8, "random"))
    assert ours >= 0.99 * single
    # share degree ~7 over 8 replicas: a naive shard rarely holds two requests of one document
    assert rr < 0.5 * single and rnd < 0.5 * single
    assert sharded_saving_ratio(prompts, np.zeros(len(prompts), dtype=np.int64)) == pytest.approx(single)


def test_summary_numbers():
    prompts = _big_group_batch(seed=2)
    p = partition_groups(_groups_of(prompts), 3)
    s = p.summary()
    assert s["num_replicas"] == 3 and sum(s["requests_per_replica"]) == len(prompts)
    assert s["makespan"] == pytest.approx(max(s["loads"])) and s["balance"] >= 1.0
    assert [len(p.replica_groups(r)) for r in range(3)] == np.bincount(p.replicas, minlength=3).tolist()


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(groups=[], num_replicas=2), "groups: expected a non-empty list", id="no-groups"),
    pytest.param(dict(groups=["x"], num_replicas=2), r"groups\[0\]: expected a PrefixGroup", id="not-a-group"),
    pytest.param(dict(groups=[PrefixGroup(0, [0], [3]), PrefixGroup(0, [0], [3])], num_replicas=2), "request 0 twice",
                 id="request-in-two-groups"),
    pytest.param(dict(groups=[PrefixGroup(0, [0], [3])], num_replicas=0),
                 "num_replicas: expected a positive int, got 0", id="zero-replicas"),
    pytest.param(dict(groups=[PrefixGroup(0, [0], [3])], num_replicas=2.0), "num_replicas: expected a positive int",
                 id="float-replicas"),
    pytest.param(dict(groups=[PrefixGroup(0, [0], [3])], num_replicas=2, cost=[1.0]), "cost: expected a callable",
                 id="cost-not-callable"),
    pytest.param(dict(groups=[PrefixGroup(0, [0], [3])], num_replicas=2, split="even"), "split: expected one of",
                 id="unknown-split"),
    pytest.param(dict(groups=[PrefixGroup(0, [0], [3])], num_replicas=2, cost=lambda g: float("nan")), "finite cost",
                 id="nan-cost"),
    pytest.param(dict(groups=[PrefixGroup(0, [0], [3])], num_replicas=2, cost=lambda g: -1.0), "finite cost >= 0",
                 id="negative-cost"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        partition_groups(**kwargs)


def test_bad_baseline_input():
    with pytest.raises(ValueError, match="how: expected one of"):
        shard_requests(4, 2, "hash")
    with pytest.raises(ValueError, match="num_replicas: expected a positive int"):
        shard_requests(4, 0)
    with pytest.raises(ValueError, match="request_replicas: expected 2 replica ids"):
        sharded_saving_ratio([[1, 2], [1, 3]], [0])
    with pytest.raises(ValueError, match="decode_weight"):
        token_cost(decode_weight=-1)
