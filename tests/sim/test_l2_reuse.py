"""L2 reuse of prefix groups in the cost model: a paged kernel reads a group prefix that fits in L2 from HBM once and
one that does not per member, nothing changes without groups, the fused kernel's longest-first order loses reuse the
batch order keeps, and the engine hands the cost model its steps' groups."""

import numpy as np
import pytest

from prefixattn.sim.calibration import Calibration
from prefixattn.sim.engine import Engine
from prefixattn.sim.l2_reuse import group_ids_from_lens, issue_order, l2_reuse_tokens
from prefixattn.sim.policies import make_policy
from prefixattn.sim.step_cost import KERNEL_KINDS, CostModel, SharedRun, StepShape
from prefixattn.sim.workloads import shared_prefix_workload


@pytest.fixture(scope="module")
def cm():
    return CostModel("h200", "llama-3.1-8b")


def _grouped(prefix, own, members, n_groups=1, share=False):
    """Decodes of ``n_groups`` groups of ``members`` rows over a ``prefix``-token prefix, each row with ``own`` more
    tokens (a scalar or one per row), rows sorted by group; ``share``: the kernel shares the prefix too."""
    n = members * n_groups
    kv = prefix + np.broadcast_to(np.asarray(own), (n,)).astype(np.int64)
    lens = np.full(n, prefix, dtype=np.int64)
    runs = [SharedRun(prefix, members) for _ in range(n_groups)]
    shape = StepShape(q_lens=np.ones(n, dtype=np.int64), kv_lens=kv, num_sampled=n,
                      group_lens=lens, group_runs=runs, group_ids=np.repeat(np.arange(n_groups), members))
    if share:
        shape.shared_lens, shape.shared_nodes = lens.copy(), list(runs)
    return shape


def _plain(shape):
    return StepShape(q_lens=shape.q_lens, kv_lens=shape.kv_lens, num_sampled=shape.num_sampled,
                     shared_lens=shape.shared_lens, shared_nodes=shape.shared_nodes)


def _hbm_tokens(cm, shape, kernel):
    """KV tokens the kernel reads from HBM per layer (its memory time at the attention HBM rate)."""
    _, _, memory_s, _ = cm.attention_time(shape, kernel)
    rate = cm.hw.hbm_bandwidth * cm.calib.attn_decode_bw_efficiency
    return memory_s * rate / cm.model.kv_bytes_per_token


def test_paged_reads_a_prefix_that_fits_in_l2_once(cm):
    shape = _grouped(prefix=1000, own=200, members=8, n_groups=4)
    plain = _hbm_tokens(cm, _plain(shape), "paged")
    assert plain == pytest.approx(32 * 1200)
    # 7 of each group's 8 members re-read the 1000-token prefix from L2
    assert _hbm_tokens(cm, shape, "paged") == pytest.approx(32 * 1200 - 4 * 7 * 1000)
    assert cm.step_cost(shape, "paged").attention < cm.step_cost(_plain(shape), "paged").attention


def test_paged_reads_a_prefix_too_big_for_l2_per_member(cm):
    # 40,000 tokens x 4 KiB per token and layer = 164 MB of one layer's prefix: more than the H200's L2
    assert 40_000 * cm.model.kv_bytes_per_token / cm.model.num_layers > cm.hw.l2_bytes
    shape = _grouped(prefix=40_000, own=200, members=4)
    assert _hbm_tokens(cm, shape, "paged") == pytest.approx(_hbm_tokens(cm, _plain(shape), "paged"))
    # a smaller L2 turns a fitting prefix into one read per member
    tiny = CostModel("h200", "llama-3.1-8b", Calibration({"l2_usable_fraction": 1e-6}))
    fits = _grouped(prefix=1000, own=200, members=8)
    assert _hbm_tokens(tiny, fits, "paged") == pytest.approx(8 * 1200)


@pytest.mark.parametrize("kernel", KERNEL_KINDS)
def test_no_groups_no_effect(cm, kernel):
    for share in (False, True):
        shape = _grouped(prefix=1000, own=np.arange(48) * 7, members=6, n_groups=8, share=share)
        empty = _plain(shape)
        empty.group_lens = np.zeros_like(shape.group_lens)
        for other in (empty, _plain(shape)):
            a, b = cm.step_cost(other, kernel, split_k=True), cm.step_cost(_plain(shape), kernel, split_k=True)
            assert (a.total, a.attention, a.memory_s) == (b.total, b.attention, b.memory_s)


def test_shared_nodes_read_the_prefix_once_whatever_the_l2(cm):
    # the fused and cascade kernels' shared nodes already read the prefix once: no group re-reads remain
    shape = _grouped(prefix=1000, own=200, members=8, n_groups=4, share=True)
    for kernel in ("fused", "cascade"):
        assert _hbm_tokens(cm, shape, kernel) == pytest.approx(4 * 1000 + 32 * 200)
        assert cm.step_cost(shape, kernel).attention == cm.step_cost(_plain(shape), kernel).attention


def test_the_fused_kernels_run_order_keeps_the_reuse_plain_longest_first_loses(cm):
    # 24 groups of 4 whose members' own lengths differ widely: sorted plainly longest first, a group's members land
    # far apart; the planner's order keeps each group's rows together, as the batch order does
    own = np.random.default_rng(0).permutation(np.arange(96) * 40)
    shape = _grouped(prefix=1000, own=own, members=4, n_groups=24)
    paged, fused = _hbm_tokens(cm, shape, "paged"), _hbm_tokens(cm, shape, "fused")
    unshared = _hbm_tokens(cm, _plain(shape), "fused")
    assert paged == pytest.approx(unshared - 24 * 3 * 1000)
    assert fused == pytest.approx(paged)
    kv, ids = shape.kv_lens.astype(np.float64), shape.groups()
    grp = np.asarray(shape.group_lens, dtype=np.float64)
    reuse = {order: l2_reuse_tokens(kv, grp, ids, issue_order(kv, order, ids), cm._kv_token_bytes,
                                    cm._l2_capacity).sum() for order in ("longest-first", "runs-longest-first")}
    assert reuse["runs-longest-first"] == 24 * 3 * 1000 > reuse["longest-first"]


def test_cascade_factor_scales_its_byte_rate_only(cm):
    shape = _grouped(prefix=1000, own=200, members=8, n_groups=4, share=True)
    slow = CostModel("h200", "llama-3.1-8b", Calibration({"cascade_attention_factor": 0.5}))
    _, c_fast, m_fast, _ = cm.attention_time(shape, "cascade")
    _, c_slow, m_slow, _ = slow.attention_time(shape, "cascade")
    assert c_slow == c_fast and m_slow == pytest.approx(2 * m_fast)
    assert slow.attention_time(shape, "paged") == cm.attention_time(shape, "paged")


def test_reuse_distance_and_group_ids():
    own = np.array([1000.0, 1000.0, 1000.0, 1000.0])
    grp = np.array([800.0, 0.0, 800.0, 800.0])
    ids = np.array([0, -1, 0, 0])
    # capacity for one row between members: the member after the unrelated row misses, the adjacent one hits
    got = l2_reuse_tokens(own, grp, ids, np.arange(4), 1.0, 1500.0)
    assert got.tolist() == [0.0, 0.0, 0.0, 800.0]
    assert l2_reuse_tokens(own, grp, ids, np.arange(4), 1.0, 2000.0).tolist() == [0.0, 0.0, 800.0, 800.0]
    assert issue_order(np.array([1.0, 3.0, 2.0, 3.0]), "longest-first").tolist() == [1, 3, 2, 0]
    # a group at its longest row, longest first inside; rows in no group alone
    runs = issue_order(np.array([1.0, 3.0, 2.0, 3.0, 5.0]), "runs-longest-first", np.array([0, -1, 0, 1, 1]))
    assert runs.tolist() == [4, 3, 1, 2, 0]
    assert group_ids_from_lens(np.array([16, 16, 0, 900, 900, 900, 16])).tolist() == [0, 0, -1, 2, 2, 2, 3]
    with pytest.raises(ValueError, match="group_ids"):
        l2_reuse_tokens(own, grp, ids[:3], np.arange(4), 1.0, 1.0)
    with pytest.raises(ValueError, match="order"):
        issue_order(own, "shortest-first")


@pytest.mark.parametrize("policy", ["nanoflow-dfs", "prefixattn", "vllm"])
def test_engine_hands_the_cost_model_its_groups(policy):
    w = shared_prefix_workload(48, prefix_len=256, distinct_len=64, share_degree=6, output_len=8)
    eng = Engine(w, CostModel("a100", "mistral-7b"), make_policy(policy))
    shapes = []
    cost = eng._cost
    eng._cost = lambda shape: (shapes.append(shape), cost(shape))[1]
    eng.run()
    grouped = [s for s in shapes if s.group_lens is not None]
    if policy == "vllm":  # its prefixes live in the block cache, not in groups the engine hands out
        assert grouped == []
        return
    assert grouped
    for s in grouped:
        ids = s.groups()
        assert ids.shape == s.q_lens.shape and len(s.group_runs) == ids.max() + 1
        for g, run in enumerate(s.group_runs):
            rows = ids == g
            assert rows.sum() >= 2 and set(s.group_lens[rows].tolist()) == {run.kv_len}
            assert run.num_queries == int(s.q_lens[rows].sum())
        assert (s.group_lens[ids < 0] == 0).all()
