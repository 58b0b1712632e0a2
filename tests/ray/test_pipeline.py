"""run_batch on a local Ray cluster: one actor per replica, groups whole, results exactly once in input order,
actor failures retried by Ray."""

import functools
import json

import numpy as np
import pytest

from prefixattn.integrations.ray.engines import SimulatedEngine
from prefixattn.integrations.ray.faults import FailOnce, InjectedFault
from prefixattn.integrations.ray.pipeline import run_batch
from prefixattn.scheduling import group_prompts, saving_ratio
from tests.ray.conftest import ACTOR_CPUS

SIM = functools.partial(SimulatedEngine, policy="prefixattn", model="mistral-7b", gpu="a100")


def _rows(num_requests=48, seed=0):
    """Documents shared by 2-7 queries (BatchLLM case 1 in miniature), shuffled; a tag column to check the join."""
    rng = np.random.default_rng(seed)
    rows = []
    while len(rows) < num_requests:
        doc = rng.integers(0, 30000, int(rng.integers(60, 160))).tolist()
        for _ in range(min(int(rng.integers(2, 8)), num_requests - len(rows))):
            query = rng.integers(0, 30000, int(rng.integers(10, 50))).tolist()
            rows.append(dict(prompt_token_ids=doc + query, max_tokens=int(rng.integers(4, 24))))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    for i, r in enumerate(rows):
        r["tag"] = f"req-{i}"
    return rows


def prompt_stats(prompts):
    """A deterministic callable engine: one output per prompt."""
    return [[len(p), int(sum(p)) % 997] for p in prompts]


def _check_exactly_once_in_order(result, rows):
    assert len(result.rows) == len(rows)
    assert [r["tag"] for r in result.rows] == [r["tag"] for r in rows]
    assert all(o["prompt_token_ids"] == r["prompt_token_ids"] for o, r in zip(result.rows, rows))
    assert result.duplicates_dropped == 0


def _check_groups_whole(result, rows):
    groups = group_prompts([r["prompt_token_ids"] for r in rows])
    reps = result.partition.request_replicas(len(rows))
    if not result.partition.split:
        for g in groups:
            assert len(set(reps[g.request_ids].tolist())) == 1


@pytest.fixture(scope="module")
def clean_run(ray_cluster):
    rows = _rows()
    return rows, run_batch(rows, SIM, num_replicas=3, num_cpus=ACTOR_CPUS)


def test_simulated_engine_on_three_replicas(clean_run):
    rows, result = clean_run
    _check_exactly_once_in_order(result, rows)
    _check_groups_whole(result, rows)
    assert result.partition.split == []
    # every request generated its own max_tokens, on the modeled clock of its replica
    assert [o["output_len"] for o in result.rows] == [r["max_tokens"] for r in rows]
    reps = result.partition.request_replicas(len(rows))
    for s in result.replica_stats:
        mine = [o for o, rep in zip(result.rows, reps) if rep == s["replica"]]
        assert s["requests"] == len(mine) and s["attempts"] == 1
        assert max(o["finish_time_s"] for o in mine) == pytest.approx(s["engine"]["modeled_time_s"])
        assert 0 < s["computed_tokens"] < s["prompt_tokens"]
    assert result.retried == []
    # whole groups: the replicas together keep the single-replica saving
    single = saving_ratio([r["prompt_token_ids"] for r in rows], group_prompts([r["prompt_token_ids"] for r in rows]))
    assert result.saving_ratio == pytest.approx(single) and result.single_replica_saving_ratio == pytest.approx(single)
    assert "3 replicas" in result.report()


def test_callable_engine_from_jsonl_and_from_a_dataset(ray_cluster, tmp_path):
    rows = _rows(40, seed=1)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = prompt_stats([r["prompt_token_ids"] for r in rows])
    from_file = run_batch(path, lambda: prompt_stats, num_replicas=2, num_cpus=ACTOR_CPUS)
    _check_exactly_once_in_order(from_file, rows)
    assert [o["output"] for o in from_file.rows] == expected
    ds = ray_cluster.data.from_items(rows)
    from_ds = run_batch(ds, lambda: prompt_stats, num_replicas=4, num_cpus=ACTOR_CPUS)
    _check_exactly_once_in_order(from_ds, rows)
    assert [o["output"] for o in from_ds.rows] == expected
    _check_groups_whole(from_ds, rows)
    assert sum(s["requests"] for s in from_ds.replica_stats) == len(rows)


@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_a_failed_actor_is_retried_without_loss_or_duplicates(clean_run, tmp_path, mode):
    rows, clean = clean_run
    result = run_batch(rows, FailOnce(SIM, tmp_path, mode=mode), num_replicas=3, num_cpus=ACTOR_CPUS)
    assert (tmp_path / "prefixattn-fault-injected").exists()  # the fault did fire
    _check_exactly_once_in_order(result, rows)
    assert [o["output_len"] for o in result.rows] == [r["max_tokens"] for r in rows]
    assert len(result.retried) == 1
    retried = result.retried[0]
    assert retried["attempts"] == 2
    stats = result.replica_stats[retried["replica"]]
    assert stats["attempts"] == 2 and retried["requests"] == stats["requests"]
    assert retried["groups"] == sorted({int(s) for s, r in zip(result.partition.source, result.partition.replicas)
                                        if r == retried["replica"]})
    assert "retried: replica" in result.report()
    # the retried replica's outputs are what the clean run computed (the engine is deterministic)
    assert [o["finish_time_s"] for o in result.rows] == [o["finish_time_s"] for o in clean.rows]


def test_failures_surface_when_retries_are_off(ray_cluster, tmp_path):
    rows = _rows(12, seed=3)
    with pytest.raises(Exception) as info:
        run_batch(rows, FailOnce(lambda: prompt_stats, tmp_path, mode="raise"), num_replicas=2,
                  num_cpus=ACTOR_CPUS, max_retries=0, retry_exceptions=False)
    assert InjectedFault.__name__ in str(info.value) or isinstance(info.value, InjectedFault)


@pytest.mark.parametrize("kwargs, match", [
    (dict(data=[], num_replicas=2), "data: expected at least one row"),
    (dict(data=[{"text": "hi"}], num_replicas=2), "expected a 'prompt_token_ids' column"),
    (dict(data=[{"prompt_token_ids": []}], num_replicas=2), "expected at least one token"),
    (dict(data=[{"prompt_token_ids": [1], "__row__": 3}], num_replicas=2), "reserved for the pipeline"),
    (dict(data=[[1, 2]], num_replicas=0), "num_replicas: expected a positive int, got 0"),
    (dict(data=[[1, 2]], num_replicas=2, max_retries=-1), "max_retries: expected an int >= 0"),
    (dict(data=42, num_replicas=2), "data: expected a ray.data.Dataset"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_batch(engine=lambda: prompt_stats, **kwargs)


def test_fault_injection_arguments():
    with pytest.raises(ValueError, match="mode: expected one of"):
        FailOnce(SIM, "/tmp", mode="hang")
    with pytest.raises(ValueError, match="engine_factory: expected a zero-argument callable"):
        FailOnce(3, "/tmp")
