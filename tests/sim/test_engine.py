"""Engine invariants under every policy: memory never over capacity, every request finishes, tokens conserved."""

import numpy as np
import pytest

from prefixattn.sim.engine import FINISHED, Engine
from prefixattn.sim.kvpool import KVPool, prefix_block_keys
from prefixattn.sim.policies import make_policy, policy_names
from prefixattn.sim.workloads import Request, Workload, batchllm_microbenchmark, shared_prefix_workload

ENGINE_POLICIES = ["vllm", "vllm-nopc", "vllm-nocp", "vllm-plain", "sglang"]


def _available(name):
    try:
        make_policy(name)
        return True
    except ValueError:
        return False


ALL_POLICIES = [p for p in policy_names() if _available(p)]


def mixed_workload(n=120, seed=3):
    """Shared-prefix groups with uneven prompt and output lengths (some outputs long enough to cross many blocks)."""
    rng = np.random.default_rng(seed)
    reqs = []
    prefixes = [rng.integers(0, 30000, size=int(rng.integers(20, 400)), dtype=np.int32) for _ in range(12)]
    for i in range(n):
        p = prefixes[int(rng.integers(0, len(prefixes)))]
        distinct = rng.integers(0, 30000, size=int(rng.integers(1, 300)), dtype=np.int32)
        reqs.append(Request(i, np.concatenate([p, distinct]), int(rng.choice([1, 2, 17, 64, 300]))))
    return Workload("mixed", reqs)


def run_checked(workload, cost, policy):
    eng = Engine(workload, cost, make_policy(policy), check=True)
    res = eng.run()
    return eng, res


def assert_invariants(eng, res, workload):
    # every request finished with exactly its output
    assert all(s.state == FINISHED for s in eng.seqs)
    assert [s.generated for s in eng.seqs] == [r.output_len for r in workload.requests]
    # token conservation: every prefill token executed belongs to some attempt's uncached context, and every
    # request ends with the KV of its prompt and all but its last output token
    assert eng.prefill_executed == eng.attempt_work
    assert [s.computed for s in eng.seqs] == [r.prompt_len + r.output_len - 1 for r in workload.requests]
    # every output token came from exactly one decode or one completed prefill (recompute prefills sample too)
    assert eng.decode_executed + eng.prefill_samples == sum(r.output_len for r in workload.requests)
    assert eng.prefill_samples >= len(workload.requests)
    # memory: never above capacity, nothing referenced at the end
    assert eng.pool.peak_used <= eng.pool.num_blocks
    eng.pool.check()
    assert eng.pool.used == 0
    assert 0.0 <= res.saving_ratio <= 1.0
    assert res.time_s > 0 and res.steps == sum(eng.timeline.count)
    assert res.modeled


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_invariants_roomy(policy, cost):
    w = mixed_workload()
    eng, res = run_checked(w, cost, policy)
    assert_invariants(eng, res, w)
    assert res.preemptions == 0


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_invariants_under_memory_pressure(policy, tight_cost):
    w = mixed_workload(n=400, seed=5)
    eng, res = run_checked(w, tight_cost, policy)
    assert_invariants(eng, res, w)
    assert eng.pool.peak_used > 0.8 * eng.pool.num_blocks  # the pool really was the constraint


def test_preemption_by_recompute_happens_and_is_accounted(tight_cost):
    # long outputs overcommit vLLM's admission (it reserves prompt blocks only), forcing recompute preemptions
    w = shared_prefix_workload(64, prefix_len=200, distinct_len=200, share_degree=4, output_len=600)
    eng, res = run_checked(w, tight_cost, "vllm")
    assert res.preemptions > 0
    assert res.recomputed_tokens > 0
    assert_invariants(eng, res, w)


def test_prefix_caching_saves_prompt_tokens(cost):
    w = batchllm_microbenchmark(1000, 100, 8, num_requests=64, output_len=4)
    on = Engine(w, cost, make_policy("vllm")).run()
    off = Engine(w, cost, make_policy("vllm-nopc")).run()
    assert off.saving_ratio == 0.0
    # 8 groups of 8 sharing 992 whole blocks of a 1100-token prompt: at most 7/8 * 992/1100 can be saved
    assert 0.3 < on.saving_ratio <= 7 / 8 * 992 / 1100 + 1e-9
    assert on.time_s < off.time_s


def test_block_keys_follow_prefixes():
    a = np.arange(100, dtype=np.int32)
    b = a.copy()
    b[40] = 7
    ka, kb = prefix_block_keys(a, 16), prefix_block_keys(b, 16)
    assert len(ka) == 6 and ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))


def test_lru_evicts_oldest_and_radix_only_leaves():
    for mode in ("lru", "radix"):
        pool = KVPool(4, 16, mode)
        assert pool.allocate(3)
        b0 = pool.promote(10, 0, None, 0.0)
        b1 = pool.promote(11, 1, b0, 0.0)
        c0 = pool.promote(20, 0, None, 0.0)
        pool.release([b0, b1], 0, 0, now=1.0)
        pool.release([c0], 0, 0, now=2.0)
        assert pool.available() == 4 and pool.used == 0
        assert pool.allocate(2)  # one free + one eviction: the deepest of the oldest (b1)
        assert 11 not in pool.table and 10 in pool.table and 20 in pool.table
        assert pool.allocate(1)  # next: b0 (now a leaf), older than c0
        assert set(pool.table) == {20}
        assert not pool.allocate(2)
        pool.check()


def long_output_workload(n_short=200, n_long=12, seed=7):
    """Short chat-like requests and a few memory-intensive ones (short prompt, ~3K-token output) sharing a system
    prompt per kind: the policies with a memory split put the long ones in their own class."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 30000, size=32, dtype=np.int32) for _ in range(2)]
    reqs = []
    for i in range(n_short + n_long):
        long = i % ((n_short + n_long) // n_long) == 0
        own = rng.integers(0, 30000, size=int(rng.integers(20, 60 if long else 400)), dtype=np.int32)
        out = int(rng.integers(2500, 3500)) if long else int(rng.integers(4, 200))
        reqs.append(Request(i, np.concatenate([systems[int(long)], own]), out))
    return Workload("long-output", reqs)


@pytest.mark.parametrize("policy", [p for p in ("prefixattn", "blendserve") if p in ALL_POLICIES])
def test_memory_split_keeps_invariants_under_pressure(policy, tight_cost):
    w = long_output_workload()
    pol = make_policy(policy)
    eng = Engine(w, tight_cost, pol, check=True)
    res = eng.run()
    assert_invariants(eng, res, w)
    assert 0.0 < pol.class_shares[1] < 1.0  # both classes present: the split was in force
    assert pol.batcher.stats["finished"] == len(w)


@pytest.mark.parametrize("policy", [p for p in ("prefixattn", "blendserve") if p in ALL_POLICIES])
def test_peak_projection_keeps_invariants_under_pressure(policy, tight_cost):
    """The simulator's scheduled policies admit with the vLLM scheduler's rule under either projection; ``peak``
    (named ``<policy>-peak``) keeps every engine invariant under memory pressure too."""
    w = mixed_workload(n=400, seed=5)
    pol = make_policy(policy, projection="peak")
    assert pol.name == f"{policy}-peak"
    eng = Engine(w, tight_cost, pol, check=True)
    res = eng.run()
    assert_invariants(eng, res, w)
    assert pol.batcher.projection == "peak"
    assert eng.pool.peak_used > 0.8 * eng.pool.num_blocks
