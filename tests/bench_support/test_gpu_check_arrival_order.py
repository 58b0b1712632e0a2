"""bench/gpu_check/arrival_order.py: the engine-default schedule of the whole-batch runs (arrival order, chunked
prefill, an LRU prefix cache, recompute preemption) runs every request to its output length over valid physical
blocks."""

import numpy as np
import pytest

from gpu_check import arrival_order as ao


def _prompts(n_groups=3, per_group=4, prefix=40, own=9, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        head = rng.integers(0, 1000, prefix)
        out += [np.concatenate([head, rng.integers(0, 1000, own)]) for _ in range(per_group)]
    return out


def _check_steps(steps, prompts, outputs, block_size, num_blocks):
    decodes = 0
    for lay in steps:
        assert lay.block_table.max() < num_blocks and lay.qo_indptr[-1] == len(lay.slots) == len(lay.positions)
        assert len(set(lay.slots.tolist())) == len(lay.slots)  # new tokens land in distinct slots
        decodes += int((lay.q_lens == 1).sum()) if lay.kind == "decode" else 0
        # Decodes first; each row's queries are the last q_len positions of its KV.
        q = lay.q_lens
        for i in range(len(q)):
            pos = lay.positions[lay.qo_indptr[i]:lay.qo_indptr[i + 1]]
            assert pos[0] == lay.kv_lens[i] - q[i] and pos[-1] == lay.kv_lens[i] - 1
    return decodes


def test_every_request_runs_to_its_output_length_and_the_cache_skips_shared_prompts():
    prompts, block_size = _prompts(n_groups=1), 16
    outputs = [3] * len(prompts)
    # A 49-token budget admits the first request alone; the other three arrive once its blocks are cached.
    stats = {}
    steps = ao.schedule(prompts, outputs, token_budget=49, num_blocks=200, block_size=block_size, stats=stats)
    _check_steps(steps, prompts, outputs, block_size, 200)
    assert stats == dict(preemptions=0, cached_tokens=3 * 32)
    assert sum(len(lay.sampled_rows) for lay in steps) == sum(outputs)  # every output token once
    computed = sum(int(lay.num_tokens) for lay in steps)
    # The first request computes its 49-token prompt, the others 49 - 32 (two full cached blocks); then the decodes.
    assert computed == 49 + 3 * 17 + sum(outputs) - len(prompts)
    many = _prompts(n_groups=3)
    steps = ao.schedule(many, [3] * len(many), token_budget=64, num_blocks=200, block_size=block_size)
    _check_steps(steps, many, [3] * len(many), block_size, 200)
    assert sum(len(lay.sampled_rows) for lay in steps) == 3 * len(many)


def test_a_small_pool_preempts_the_newest_and_recomputes_it():
    prompts = _prompts(n_groups=4, per_group=2, prefix=48, own=20, seed=1)
    outputs = [40] * len(prompts)  # 68 + 40 positions: 7 blocks each, two requests outgrow the 12 blocks
    stats = {}
    steps = ao.schedule(prompts, outputs, token_budget=128, num_blocks=12, block_size=16, stats=stats)
    _check_steps(steps, prompts, outputs, 16, 12)
    # A preempted request keeps its outputs: recomputing its prompt and outputs samples its next token.
    assert stats["preemptions"] > 0 and sum(len(lay.sampled_rows) for lay in steps) == sum(outputs)
    with pytest.raises(RuntimeError, match="more than the pool's 2 blocks"):
        ao.schedule(prompts, outputs, token_budget=128, num_blocks=2, block_size=16)
