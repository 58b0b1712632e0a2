"""Cost model: monotonicity in every input that adds work, kernel-kind orderings the design relies on, memory."""

import numpy as np
import pytest

from prefixattn.sim.calibration import Calibration
from prefixattn.sim.step_cost import CostModel, SharedRun, StepShape


@pytest.fixture(scope="module")
def cm():
    return CostModel("a100", "mistral-7b")


def decode(n, kv):
    return StepShape(q_lens=np.ones(n, dtype=np.int64), kv_lens=np.full(n, kv, dtype=np.int64), num_sampled=n)


def prefill(q, kv=None):
    return StepShape(q_lens=np.array([q]), kv_lens=np.array([kv or q]), num_sampled=1)


@pytest.mark.parametrize("kernel", ["paged", "cascade", "fused"])
def test_monotone_in_batch_and_context(cm, kernel):
    for kv in (128, 1024, 4096):
        times = [cm.step_cost(decode(n, kv), kernel).total for n in (1, 8, 64, 256, 1024)]
        assert all(a <= b for a, b in zip(times, times[1:])), times
    for n in (1, 64, 512):
        times = [cm.step_cost(decode(n, kv), kernel).total for kv in (16, 256, 2048, 16384)]
        assert all(a <= b for a, b in zip(times, times[1:])), times


def test_monotone_in_prefill_tokens(cm):
    times = [cm.step_cost(prefill(q)).total for q in (16, 128, 512, 2048, 8192)]
    assert all(a < b for a, b in zip(times, times[1:])), times
    # context before the chunk adds attention work
    assert cm.step_cost(prefill(512, 4096)).attention > cm.step_cost(prefill(512, 512)).attention


def test_slower_hardware_is_slower():
    step = decode(128, 2048)
    a100 = CostModel("a100", "llama-3-8b").step_cost(step).gpu
    h100 = CostModel("h100", "llama-3-8b").step_cost(step).gpu
    h200 = CostModel("h200", "llama-3-8b").step_cost(step).gpu
    assert a100 > h100 > h200


def test_efficiency_factors_scale_time():
    step = prefill(2048)
    fast = CostModel("a100", "mistral-7b", Calibration({"gemm_efficiency": 0.9})).step_cost(step).linear
    slow = CostModel("a100", "mistral-7b", Calibration({"gemm_efficiency": 0.5})).step_cost(step).linear
    assert slow > fast


def test_shared_kernels_read_prefix_once(cm):
    # 25 groups of 8 decodes over a 1100-token prefix: reading the prefix once per group beats reading it per request
    q = np.ones(200, dtype=np.int64)
    shape = dict(q_lens=q, kv_lens=np.full(200, 1550), num_sampled=200, shared_lens=np.full(200, 1100),
                 shared_nodes=[SharedRun(1100, 8) for _ in range(25)])
    paged = cm.step_cost(StepShape(**shape), "paged")
    cascade = cm.step_cost(StepShape(**shape), "cascade")
    fused = cm.step_cost(StepShape(**shape), "fused")
    assert cascade.attention < paged.attention and fused.attention < paged.attention
    assert fused.launches < cascade.launches  # one launch per layer instead of level + suffix + merge


def test_split_k_removes_the_long_prefix_tail(cm):
    # few requests over a long shared prefix (BatchLLM sec. 6.3.3's bad case): the unsplit grid leaves SMs idle
    shape = dict(q_lens=np.ones(4, dtype=np.int64), kv_lens=np.full(4, 8050), num_sampled=4,
                 shared_lens=np.full(4, 8000), shared_nodes=[SharedRun(8000, 4)])
    no_split = cm.step_cost(StepShape(**shape), "fused", split_k=False).attention
    split = cm.step_cost(StepShape(**shape), "fused", split_k=True).attention
    assert split < 0.5 * no_split
    # a full grid is not split (prefixattn's rule), so split-k changes nothing there
    full = dict(q_lens=np.ones(256, dtype=np.int64), kv_lens=np.full(256, 8050), num_sampled=256,
                shared_lens=np.full(256, 8000), shared_nodes=[SharedRun(8000, 256)])
    assert cm.step_cost(StepShape(**full), "fused", split_k=True).attention == \
        cm.step_cost(StepShape(**full), "fused", split_k=False).attention


def test_cost_rule_matches_the_planner(cm):
    rule = pytest.importorskip("prefixattn.planner.cost_rule")
    options = pytest.importorskip("prefixattn.planner.options")  # needs torch; the sim does not
    m = cm.model
    for requests, rows, tokens in [(2, 2, 16), (2, 2, 80), (64, 64, 16), (64, 64, 48), (8, 300, 1100), (400, 400, 16)]:
        ours = cm.sharing_pays_off(requests, rows, tokens)
        m_tiles = -(-rows * (m.num_heads // m.num_kv_heads) // cm.calib.attn_block_m)
        theirs = rule.sharing_pays_off(num_requests=requests, num_rows=rows, num_m_tiles=m_tiles, num_tokens=tokens,
                                       group=m.num_heads // m.num_kv_heads, head_dim=m.head_dim, elt_bytes=2)
        assert ours == bool(theirs), (requests, rows, tokens)
    assert cm.calib.split_k_min_tokens == options.MIN_SPLIT_TOKENS


def test_overlap_backend_never_slower(cm):
    for step in (decode(256, 2048), prefill(2048), decode(8, 16384)):
        assert cm.step_cost(step, backend="overlap").total <= cm.step_cost(step).total


def test_kv_capacity(cm):
    # Mistral-7B keeps 0.125 MiB per token (BatchLLM sec. 2.2); weights ~13.5 GiB
    assert cm.kv_bytes_per_token == 128 * 1024
    tokens = cm.kv_pool_tokens(0.9, 2048, 256)
    assert 350_000 < tokens < 500_000
    assert cm.kv_pool_tokens(0.9, 32768, 256) < tokens  # a bigger profile batch leaves less for KV
    with pytest.raises(ValueError, match="model"):
        CostModel("mi250x-gcd", "qwen2-7b").kv_pool_tokens(0.1, 2048, 256)


def test_bad_arguments(cm):
    with pytest.raises(ValueError, match="kernel"):
        cm.step_cost(decode(1, 10), kernel="flash")
    with pytest.raises(ValueError, match="backend"):
        cm.step_cost(decode(1, 10), backend="async")
    with pytest.raises(ValueError, match="gpu"):
        CostModel("tpu", "mistral-7b")


def test_measured_kernel_time():
    from prefixattn.sim.step_cost import measured_kernel_time

    base = measured_kernel_time("a100", bytes_moved=1e9, flops=1e12, launches=1)
    assert measured_kernel_time("a100", bytes_moved=2e9, flops=1e12, launches=1) >= base
    assert measured_kernel_time("a100", bytes_moved=1e9, flops=1e12, launches=3) > base
    assert measured_kernel_time("h100", bytes_moved=1e9, flops=1e12, launches=1) < base
    with pytest.raises(ValueError, match="bytes_moved"):
        measured_kernel_time("a100", bytes_moved=-1, flops=0, launches=0)
