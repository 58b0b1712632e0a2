"""TokenBatcher behaviour on hand-built cases (the state machine test covers the invariants at random)."""

import numpy as np
import pytest

from prefixattn.scheduling import ChunkKind, PrefixGroup, TokenBatcher, group_prompts


def _chunks(plan):
    return [(c.kind.name, c.request_id, c.start, c.num_tokens) for c in plan.chunks]


def _run_to_end(batcher, finish_after: dict[int, int], max_steps=10_000):
    """Drive the batcher like an engine: a request finishes once it has produced ``finish_after[r]`` tokens."""
    produced: dict[int, int] = {}
    plans = []
    for _ in range(max_steps):
        if batcher.done:
            return plans
        plan = batcher.step()
        plans.append(plan)
        for r in plan.preempted:
            produced[r] = max(produced.get(r, 1), 1)
        for kind, r in zip(plan.kinds.tolist(), plan.request_ids.tolist()):
            if kind == ChunkKind.DECODE:
                produced[r] = produced.get(r, 1) + 1
        for r in sorted(produced):
            if batcher.request_state(r) == "decode" and produced[r] >= finish_after[r]:
                batcher.finish(r)
                del produced[r]
        for r in range(len(finish_after)):
            if batcher.request_state(r) == "decode":
                produced.setdefault(r, 1)
    raise AssertionError("not done")


def test_prefix_then_distinct_then_decode_with_chunking():
    prompts = [[1] * 10 + [2, 3], [1] * 10 + [4, 5]]
    b = TokenBatcher(token_budget=4, kv_blocks=100, block_size=4)
    b.add_groups(group_prompts(prompts))
    assert _chunks(b.step()) == [("PREFIX", 0, 0, 4)]
    assert _chunks(b.step()) == [("PREFIX", 0, 4, 4)]
    assert _chunks(b.step()) == [("PREFIX", 0, 8, 2)]  # the ten shared tokens
    assert _chunks(b.step()) == [("DISTINCT", 0, 10, 2), ("DISTINCT", 1, 10, 2)]
    plan = b.step()
    assert _chunks(plan) == [("DECODE", 0, 12, 1), ("DECODE", 1, 12, 1)]
    # shared prefix blocks counted once: 3 blocks of prefix + 1 block per request
    assert plan.kv_blocks_used == 3 + 2


def test_nested_levels_are_computed_in_order():
    s, d = [9] * 4, [8] * 4
    prompts = [s + d + [1, 0], s + d + [2, 0], s + [3, 0], s + [4, 0]]
    b = TokenBatcher(token_budget=64, kv_blocks=100, block_size=2)
    b.add_groups(group_prompts(prompts, levels=None))
    first = b.step()
    assert [(c.kind.name, c.start, c.num_tokens) for c in first.chunks] == [("PREFIX", 0, 4)]
    second = b.step()
    kinds = [(c.kind.name, c.start, c.num_tokens) for c in second.chunks]
    # the document level (tokens 4..7) starts next to the requests that share only the system prompt
    assert sorted(kinds) == [("DISTINCT", 4, 2), ("DISTINCT", 4, 2), ("PREFIX", 4, 4)]
    third = b.step()
    assert ("DISTINCT", 0, 8, 2) in _chunks(third) and ("DISTINCT", 1, 8, 2) in _chunks(third)
    node = b.prefix_node(int(second.nodes[second.kinds == ChunkKind.PREFIX][0]))
    assert (node.start, node.size, node.parent) == (4, 4, int(first.nodes[0]))


def test_no_request_count_cap():
    groups = [PrefixGroup(0, [i], [3]) for i in range(1000)]
    b = TokenBatcher(token_budget=4096, kv_blocks=4096, block_size=16)
    b.add_groups(groups)
    assert b.step().total_tokens == 3000
    assert (b.step().kinds == ChunkKind.DECODE).sum() == 1000  # memory allows all of them: no cap


def test_stall_free_order_decodes_first():
    b = TokenBatcher(token_budget=3, kv_blocks=100, block_size=4)
    b.add_groups([PrefixGroup(0, [i], [1]) for i in range(5)])
    assert b.step().request_ids.tolist() == [0, 1, 2]  # prefills in admission order
    plan = b.step()
    assert plan.kinds.tolist() == [ChunkKind.DECODE] * 3  # running decodes take the budget before new prompts
    b.finish(0)
    plan = b.step()
    assert _chunks(plan) == [("DECODE", 1, 2, 1), ("DECODE", 2, 2, 1), ("DISTINCT", 3, 0, 1)]


def test_underestimated_outputs_cause_counted_preemption():
    # Estimates of 1 token let all four start; their real outputs (20 tokens) do not fit next to each other.
    groups = [PrefixGroup(0, [i], [8]) for i in range(4)]
    b = TokenBatcher(token_budget=64, kv_blocks=12, block_size=4, output_lens=1)
    b.add_groups(groups)
    plans = _run_to_end(b, {i: 20 for i in range(4)})
    assert b.stats["preemptions"] > 0
    assert b.stats["recomputed_tokens"] > 0
    assert sum(len(p.preempted) for p in plans) == b.stats["preemptions"]
    assert all(p.kv_blocks_used <= 12 for p in plans)
    assert b.stats["finished"] == 4
    # With honest estimates the reservation avoids preemption altogether.
    honest = TokenBatcher(token_budget=64, kv_blocks=12, block_size=4, output_lens=20)
    honest.add_groups(groups)
    _run_to_end(honest, {i: 20 for i in range(4)})
    assert honest.stats["preemptions"] == 0


def test_request_alone_outgrowing_memory_is_truncated():
    b = TokenBatcher(token_budget=16, kv_blocks=2, block_size=4)
    b.add_groups([PrefixGroup(0, [0], [4])])
    truncated = []
    for _ in range(20):
        plan = b.step()
        truncated += plan.truncated
        if b.done:
            break
    assert truncated == [0] and b.done and b.stats["truncated"] == 1 and b.kv_blocks_used == 0


def test_never_fitting_requests_are_rejected_up_front():
    b = TokenBatcher(token_budget=16, kv_blocks=4, block_size=4)
    ok = PrefixGroup(0, [0], [4])
    huge = PrefixGroup(0, [1], [40])
    with pytest.raises(ValueError, match=r"groups: requests \[1\] can never fit.*kv_blocks=4 blocks of 4 tokens"):
        b.add_groups([ok, huge])
    b.add_groups([ok])  # nothing was added by the failed call
    capped = TokenBatcher(token_budget=16, kv_blocks=4, block_size=4, max_output_len=64)
    with pytest.raises(ValueError, match=r"can never fit: their shared prefix, prompt and 64 output token"):
        capped.add_groups([ok])
    with pytest.raises(ValueError, match=r"request 0 was already added"):
        b.add_groups([ok])


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(token_budget=0, kv_blocks=8), r"token_budget: expected an int in \[1, 16777216\], got 0",
                 id="zero-budget"),
    pytest.param(dict(token_budget=-5, kv_blocks=8), r"token_budget: expected an int", id="negative-budget"),
    pytest.param(dict(token_budget=1 << 40, kv_blocks=8), r"token_budget: expected an int", id="huge-budget"),
    pytest.param(dict(token_budget=8, kv_blocks=0), r"kv_blocks: expected an int", id="zero-blocks"),
    pytest.param(dict(token_budget=8, kv_blocks=1 << 50), r"kv_blocks: expected an int", id="huge-blocks"),
    pytest.param(dict(token_budget=8, kv_blocks=8, block_size=0), r"block_size: expected an int", id="zero-block-size"),
    pytest.param(dict(token_budget=8.5, kv_blocks=8), r"token_budget: expected an int", id="float-budget"),
    pytest.param(dict(token_budget=8, kv_blocks=8, output_lens=-1), r"output_lens: expected None, a length >= 0",
                 id="negative-output"),
    pytest.param(dict(token_budget=8, kv_blocks=8, output_lens=np.array([1.0, np.nan])), r"output_lens: expected a 1-D",
                 id="nan-outputs"),
    pytest.param(dict(token_budget=8, kv_blocks=8, max_output_len=0), r"max_output_len: expected an int",
                 id="zero-max-output"),
])
def test_bad_budgets(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenBatcher(**kwargs)


def test_finish_and_abort_errors():
    b = TokenBatcher(token_budget=16, kv_blocks=16, block_size=4)
    b.add_groups([PrefixGroup(0, [0], [4]), PrefixGroup(0, [1], [4])])
    with pytest.raises(ValueError, match=r"request_id: expected a decoding request, got request 0 in state waiting"):
        b.finish(0)
    with pytest.raises(ValueError, match=r"request_id: expected a request added to this batcher, got 7"):
        b.finish(7)
    b.abort(1)
    with pytest.raises(ValueError, match=r"request_id: expected an unfinished request, got request 1 \(aborted\)"):
        b.abort(1)
    b.step()
    b.finish(0)
    assert b.done and b.kv_blocks_used == 0
    with pytest.raises(ValueError, match=r"groups\[0\]: expected a PrefixGroup"):
        b.add_groups(["x"])
    with pytest.raises(ValueError, match=r"node: expected a prefix level id"):
        b.prefix_node(0)


def test_same_input_same_schedule():
    rng = np.random.default_rng(0)
    prompts = [[1, 1, 1] + rng.integers(0, 3, int(rng.integers(1, 9))).tolist() for _ in range(40)]
    outs = {i: int(rng.integers(1, 30)) for i in range(40)}

    def run():
        b = TokenBatcher(token_budget=16, kv_blocks=24, block_size=2)
        b.add_groups(group_prompts(prompts, levels=None))
        return [(p.kinds.tolist(), p.request_ids.tolist(), p.starts.tolist(), p.num_tokens.tolist())
                for p in _run_to_end(b, outs)]

    assert run() == run()
