"""bench/gpu_check/model_layout.py: the model step's batches come from the TokenBatcher on each of its workloads and are
laid out as a prefix-caching engine lays them out (checked here on a CPU: the GPU run times these layouts)."""

import numpy as np
import pytest

from gpu_check import model_layout as ml


@pytest.fixture(scope="module", params=["batchllm-case1", "docs-qa-8k", "shared-prompt-4k"])
def run(request):
    prompts, outputs = ml.workload(request.param, 16, 32)
    batcher, steps = ml.run_batcher(prompts, outputs, token_budget=64, kv_blocks=300, block_size=16)
    return prompts, outputs, batcher, steps


def test_every_request_runs_to_its_output_length(run):
    prompts, outputs, batcher, steps = run
    assert batcher.done and batcher.stats["finished"] == len(prompts)
    decodes = sum(int((s.kinds == 0).sum()) for s in steps)
    # The first output token comes with the last prefill chunk; each further one is a decode (no preemption here).
    assert batcher.stats["preemptions"] == 0 and decodes == sum(outputs) - len(prompts)


def test_layouts_share_whole_prefix_blocks_and_own_the_rest(run):
    prompts, _, batcher, steps = run
    picked = ml.select_steps(steps, 2)
    assert {ml.step_kind(s) for s in picked} == {"decode", "mixed"}
    for batch in picked:
        lay = ml.layout(batch, batcher, prompts, 16)
        r = len(lay.kv_lens)
        assert lay.qo_indptr[-1] == lay.positions.shape[0] == lay.slots.shape[0]
        assert (lay.kv_lens >= lay.q_lens).all() and lay.block_table.max() < lay.num_blocks
        # New tokens land in distinct slots; each row's queries are the last q_len positions of its KV.
        assert len(set(lay.slots.tolist())) == len(lay.slots)
        for i in range(r):
            pos = lay.positions[lay.qo_indptr[i]:lay.qo_indptr[i + 1]]
            assert pos[0] == lay.kv_lens[i] - lay.q_lens[i] and pos[-1] == lay.kv_lens[i] - 1
        # Groups are consecutive rows listing the same leading blocks for their shared tokens, and nothing more.
        assert [m for g, _ in lay.groups for m in g] == list(range(r))
        for members, tokens in lay.groups:
            n = tokens // 16
            lead = lay.block_table[members, :n]
            assert (lead == lead[0]).all()
            if len(members) > 1:
                assert tokens and len({tuple(lay.block_table[m, n:n + 1]) for m in members}) == len(members)
        # Decode steps sample every row; mixed steps put the decodes first.
        if lay.kind == "decode":
            assert (lay.q_lens == 1).all() and len(lay.sampled_rows) == r
        else:
            q = lay.q_lens
            assert (np.diff((q > 1).astype(int)) >= 0).all()


def test_kv_traffic_counts_each_cached_position_once_and_the_l2_rereads_of_groups():
    """Two requests share a 32-token prefix (two blocks), each has 8 tokens of its own: unshared reads 80 tokens,
    distinct 48; the second member's 32-token re-read of the prefix fits an L2 of 32 tokens' bytes, not of 31."""
    lay = ml.StepLayout(step=1, kind="decode", qo_indptr=np.array([0, 1, 2]), kv_lens=np.array([40, 40]),
                        block_table=np.array([[0, 1, 2], [0, 1, 3]]), num_blocks=4, positions=np.array([39, 39]),
                        slots=np.array([0, 0]), sampled_rows=np.array([0, 1]), groups=[([0, 1], 32)])
    t = ml.kv_traffic(lay, 16, 10, l2_bytes=320)
    assert (t["read"], t["unique"], t["l2_reread"]) == (800, 480, 320) and t["l2_reread_fraction"] == 0.4
    assert ml.kv_traffic(lay, 16, 10, l2_bytes=310)["l2_reread"] == 0


def test_group_item_span_of_the_plans_without_sharing_is_adjacent_where_longest_first_is_not():
    """The model step's ``group_item_span``: (span of a group's prefix re-reads / their count) per group and class,
    the median. On a BatchLLM case 1 decode step planned without sharing, the prefix runs keep every group's items
    adjacent; the same items longest first (the order before the runs) spread them."""
    import torch

    import prefixattn
    from prefixattn.kernels import layout as K

    items = np.zeros((6, K.ITEM_FIELDS), dtype=np.int32)
    items[:, K.ITEM_REQ] = [0, 2, 1, 3, 4, 5]
    assert ml.group_item_span(items, (0, 0, 6), [([0, 1], 32), ([2, 3], 32)]) == 1.5
    assert np.isnan(ml.group_item_span(items, (0, 0, 6), []))
    prompts, outputs = ml.workload("batchllm-case1", 48, 1)
    batcher, steps = ml.run_batcher(prompts, outputs, token_budget=2048, kv_blocks=4000, block_size=16)
    lay = ml.layout(max((s for s in steps if ml.step_kind(s) == "decode"), key=lambda s: len(s.kinds)), batcher,
                    prompts, 16)
    p = prefixattn.plan(*(torch.from_numpy(a) for a in (lay.qo_indptr, lay.kv_lens, lay.block_table)),
                        block_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128, q_dtype=torch.bfloat16,
                        num_blocks=lay.num_blocks, sharing="never", device="cpu")
    assert ml.group_item_span(p.work.items, p.work.class_ends, lay.groups) == 1.0
    lengths = p.work.items[:, K.ITEM_KV_END] - p.work.items[:, K.ITEM_KV_START]
    longest_first = p.work.items[np.argsort(-lengths, kind="stable")]  # one class: a decode step unshared
    assert ml.group_item_span(longest_first, p.work.class_ends, lay.groups) > 2
