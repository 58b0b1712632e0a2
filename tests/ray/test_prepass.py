"""The distributed grouping pre-pass on a local Ray cluster: equal to driver-side grouping when every shared prefix
is at least bucket_tokens long; otherwise equal to group_prompts per first-k key, losing exactly the shallow sharing."""

import numpy as np
import pytest

from prefixattn.integrations.ray.prepass import bucket_of, group_by_key, group_prompts_distributed, prompt_key
from prefixattn.integrations.ray.pipeline import run_batch
from prefixattn.scheduling import group_prompts, saving_ratio
from tests.ray.conftest import ACTOR_CPUS

K = 8
BUCKETS = 4


def _docs_batch(num_docs=12, seed=0, system=()):
    """Documents (>= 40 tokens) shared by 1-6 queries, some documents nested (a longer document extending a
    shorter one), shuffled; an optional system prompt before every document."""
    rng = np.random.default_rng(seed)
    prompts, docs = [], []
    for d in range(num_docs):
        doc = rng.integers(0, 30000, int(rng.integers(40, 90))).tolist()
        if docs and d % 4 == 3:  # nesting: extends an earlier document
            doc = docs[-1] + doc[:20]
        docs.append(doc)
        for _ in range(int(rng.integers(1, 7))):
            prompts.append(list(system) + doc + rng.integers(0, 30000, int(rng.integers(3, 30))).tolist())
    prompts.append(list(system) + [5])  # shorter than k: keyed by the whole prompt
    return [prompts[i] for i in rng.permutation(len(prompts))]


def _dataset(ray_cluster, prompts):
    return ray_cluster.data.from_items([{"__row__": i, "prompt_token_ids": p} for i, p in enumerate(prompts)])


def _as_tuples(groups):
    """Groups as comparable tuples, in order (``dfs_rank`` apart: the merge numbers it by the list order, while
    ``group_prompts`` places a request whose whole prompt prefixes others at its tree position)."""
    def one(g):
        return (g.prefix_len, tuple(g.request_ids), tuple(g.prompt_lens), g.parent_prefix_len,
                tuple(one(c) for c in g.children))
    return [one(g) for g in groups]


@pytest.mark.parametrize("levels", [1, 2, None])
def test_equal_to_driver_grouping_when_sharing_is_at_least_k_deep(ray_cluster, levels):
    prompts = _docs_batch(seed=levels or 7)
    assert len({bucket_of(p, K, BUCKETS) for p in prompts}) > 1  # precondition: the work is spread
    expected = group_prompts(prompts, levels=levels)
    got = group_prompts_distributed(_dataset(ray_cluster, prompts), bucket_tokens=K, num_buckets=BUCKETS,
                                    levels=levels, num_cpus=ACTOR_CPUS)
    assert _as_tuples(got) == _as_tuples(expected)


def test_shallow_sharing_is_lost_exactly(ray_cluster):
    # a 4-token system prompt (< k) before every document: the driver shares it across documents, the buckets do
    # not; the result is group_prompts per first-k key, and the difference is the system prompt's recomputation
    system = [7, 7, 7, 7]
    prompts = _docs_batch(seed=3, system=system)
    got = group_prompts_distributed(_dataset(ray_cluster, prompts), bucket_tokens=K, num_buckets=BUCKETS,
                                    levels=None, num_cpus=ACTOR_CPUS)
    reference = group_by_key(prompts, list(range(len(prompts))), K, levels=None)
    assert _as_tuples(got) == _as_tuples(reference)
    driver = group_prompts(prompts, levels=None)
    assert _as_tuples(got) != _as_tuples(driver)
    keys = {prompt_key(p, K) for p in prompts}
    lost = (len(keys) - 1) * len(system)  # the system prompt, once per key instead of once
    logical = sum(map(len, prompts))
    assert saving_ratio(prompts, driver) - saving_ratio(prompts, got) == pytest.approx(lost / logical, abs=1e-12)


def test_run_batch_with_the_distributed_pre_pass(ray_cluster):
    prompts = _docs_batch(seed=11)
    rows = [dict(prompt_token_ids=p, tag=i) for i, p in enumerate(prompts)]
    driver = run_batch(rows, lambda: (lambda ps: [len(p) for p in ps]), num_replicas=2, num_cpus=ACTOR_CPUS)
    dist = run_batch(rows, lambda: (lambda ps: [len(p) for p in ps]), num_replicas=2, num_cpus=ACTOR_CPUS,
                     grouping="distributed", bucket_tokens=K, num_buckets=BUCKETS)
    assert [r["tag"] for r in dist.rows] == list(range(len(rows)))
    assert [r["output"] for r in dist.rows] == [len(p) for p in prompts]
    assert dist.partition.request_replicas().tolist() == driver.partition.request_replicas().tolist()
    assert dist.saving_ratio == pytest.approx(driver.saving_ratio)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bucket_tokens=0), "bucket_tokens: expected a positive int"),
    (dict(num_buckets=-1), "num_buckets: expected a positive int"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_prompts_distributed(None, **kwargs)


def test_bad_grouping():
    with pytest.raises(ValueError, match="grouping: expected one of"):
        run_batch([[1, 2]], lambda: (lambda ps: ps), num_replicas=1, grouping="cluster")
