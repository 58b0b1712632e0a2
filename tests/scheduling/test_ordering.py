"""Ordering policies (fcfs, dfs, batchllm Eq. 3/4, blendserve density + dual scanner) and output-length estimates."""

import numpy as np
import pytest

from prefixattn.scheduling import (DEFAULT_ORDERING, ORDERINGS, DensityModel, PrefixGroup, estimate_output_lens,
                                   group_prompts, order_groups, register_ordering, sample_requests)
from prefixattn.scheduling.blendserve import densities, dual_scan
from prefixattn.scheduling.ordering import processed_tokens
from tests.scheduling.synthetic import case1_like


def _ids(groups):
    return [r for g in groups for r in g.request_ids]


@pytest.fixture(scope="module")
def groups():
    return group_prompts(case1_like(300, seed=5))


@pytest.mark.parametrize("name", sorted(ORDERINGS))
def test_every_policy_returns_every_request_once(groups, name):
    out = order_groups(groups, name)
    assert sorted(_ids(out)) == list(range(300))
    assert _ids(order_groups(groups, name)) == _ids(out)  # deterministic


def test_fcfs_and_dfs(groups):
    firsts = [min(g.request_ids) for g in order_groups(groups, "fcfs")]
    assert firsts == sorted(firsts)
    shuffled = [groups[i] for i in np.random.default_rng(0).permutation(len(groups))]
    assert [g.dfs_rank for g in order_groups(shuffled, "dfs")] == sorted(g.dfs_rank for g in groups)


def test_batchllm_eq4_and_eq3(groups):
    out = order_groups(groups, "batchllm")
    prefill = processed_tokens(out)
    assert (np.diff(prefill) >= 0).all()  # Eq. 4: fewer prefill tokens first
    # Eq. 3 with known output lengths: larger mean(decode) / prefill first.
    out_lens = np.random.default_rng(1).integers(1, 500, 300).astype(float)
    ordered = order_groups(groups, "batchllm", output_lens=out_lens)
    ratio = [np.mean(out_lens[g.request_ids]) / p for g, p in zip(ordered, processed_tokens(ordered))]
    assert all(a >= b for a, b in zip(ratio, ratio[1:]))
    # A constant output length is Eq. 4 again.
    assert _ids(order_groups(groups, "batchllm", output_lens=64)) == _ids(out)


def test_batchllm_ties_by_request_id():
    groups = [PrefixGroup(0, [5], [10]), PrefixGroup(0, [2], [10]), PrefixGroup(0, [9], [10])]
    assert _ids(order_groups(groups, "batchllm")) == [2, 5, 9]


def test_blendserve_densities_follow_the_cost_model():
    model = DensityModel()
    # one request: p = 512, d = 256 -> Comp / Mem from the paper's formulas
    g = [PrefixGroup(0, [0], [512])]
    rho, comp, mem = densities(g, np.array([256.0]), model)
    want_comp = ((512 + 256) * model.params * 2 + 512 ** 2 * model.hidden * model.num_layers * 4) / model.compute
    want_mem = (512 * 256 + 256 ** 2 / 2) * model.kv_dim * model.num_layers * 4 / model.bandwidth
    assert comp[0] == pytest.approx(want_comp) and mem[0] == pytest.approx(want_mem)
    assert rho[0] == pytest.approx(want_comp / want_mem)
    # sharing lowers a group's compute (its prefix is computed once)
    shared = [PrefixGroup(400, [0, 1], [512, 512])]
    rho2, comp2, _ = densities(shared, np.array([256.0, 256.0]), model)
    assert comp2[0] < 2 * want_comp


def test_blendserve_interleaves_compute_and_memory_heavy_groups():
    # 20 short-output (compute-heavy) and 20 long-output (memory-heavy) singletons.
    groups = [PrefixGroup(0, [i], [600]) for i in range(40)]
    out_lens = np.array([16.0] * 20 + [8000.0] * 20)
    order = _ids(order_groups(groups, "blendserve", output_lens=out_lens))
    heavy = [r >= 20 for r in order]
    assert heavy[:1] == [False] and any(heavy[:5])  # both ends are scanned from the start
    assert sorted(order) == list(range(40))


def test_blendserve_splits_large_groups():
    groups = [PrefixGroup(3, list(range(10)), [8] * 10)]
    out = order_groups(groups, "blendserve", split_requests=4)
    assert sorted(len(g.request_ids) for g in out) == [2, 4, 4]
    assert all(g.prefix_len == 3 for g in out)
    with pytest.raises(ValueError, match=r"split_requests: expected a positive int or None"):
        order_groups(groups, "blendserve", split_requests=0)


def test_dual_scan_memory_split():
    # equal densities: plain left-to-right (DFS) order
    assert dual_scan(np.array([2.0, 2.0, 2.0]), np.ones(3), 2.0) == [0, 1, 2]
    # root density equal to the right end: all memory to the right cursor
    assert dual_scan(np.array([5.0, 1.0]), np.ones(2), 1.0) == [1, 0]


def test_register_and_errors(groups):
    register_ordering("reverse-test", lambda gs, out: list(reversed(gs)))
    try:
        assert _ids(order_groups(groups, "reverse-test")) == _ids(list(reversed(groups)))
    finally:
        del ORDERINGS["reverse-test"]
    assert DEFAULT_ORDERING in ORDERINGS
    with pytest.raises(ValueError, match=r"ordering: expected one of"):
        order_groups(groups, "nope")
    with pytest.raises(ValueError, match=r"groups: expected at least one PrefixGroup"):
        order_groups([], "fcfs")
    with pytest.raises(ValueError, match=r"output_lens: expected finite lengths >= 0"):
        order_groups(groups, "batchllm", output_lens=-np.ones(300))
    with pytest.raises(ValueError, match=r"output_lens: expected one length per request"):
        order_groups(groups, "batchllm", output_lens=np.ones(3))
    with pytest.raises(ValueError, match=r"policy: expected a callable"):
        register_ordering("x", 3)


def test_output_length_estimation_per_subtree():
    s, d = list(range(100, 110)), list(range(200, 220))
    prompts = [s + d + [i, 1] for i in range(4)] + [s + [50 + i, 1] for i in range(4)] + [[7, 7, 7], [6, 6, 6]]
    groups = group_prompts(prompts, levels=None)
    est = estimate_output_lens(groups, [0, 4, 9], [100, 10, 40])
    assert est[:4].tolist() == [100.0] * 4  # the document subtree's sample
    assert est[4:8].tolist() == [10.0, 55.0, 55.0, 55.0]  # the system-prompt group's pooled mean (with siblings)
    assert est[8] == 50.0 and est[9] == 40.0  # no group with samples: the batch mean; sampled: measured
    ids = sample_requests(groups, rate=0.5, seed=2)
    assert (sample_requests(groups, rate=0.5, seed=2) == ids).all() and len(ids) >= 1
    with pytest.raises(ValueError, match=r"rate: expected a probability"):
        sample_requests(groups, rate=0)
    with pytest.raises(ValueError, match=r"sampled_ids: expected at least one sampled request"):
        estimate_output_lens(groups, [], [])
    assert estimate_output_lens(groups, [], [], default=3.0).tolist() == [3.0] * 10
