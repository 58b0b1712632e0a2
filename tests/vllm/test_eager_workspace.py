"""Eager vLLM steps (prefill chunks, mixed batches, decodes without full graphs) plan into the builder's eager
wrapper: one capacity-sized workspace reused by every step (the same device buffers), vLLM's device block table
read in place; a step beyond the scheduler's limits falls back to a per-step plan() and is counted."""

import pytest
import torch

from tests.tolerances import ATTENTION_TOL
from tests.vllm.test_cudagraph import BLOCK, HKV, HQ, NUM_BLOCKS, D, _builder, _common

pytestmark = pytest.mark.vllm

MAX_TOKENS, MAX_SEQS = 48, 4  # the scheduler limits the eager workspace is sized by


@pytest.fixture
def vllm_config(tiny_llama):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))
    config.scheduler_config.max_num_batched_tokens = MAX_TOKENS
    config.scheduler_config.max_num_seqs = MAX_SEQS
    return config


def _run_step(builder, q_lens, seq_lens, table, g):
    """Build the step's metadata, run one layer through the impl (K/V write + attention), check the reference."""
    import prefixattn

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, split_kv_cache

    common = _common(q_lens, seq_lens, table)
    meta = builder.build(0, common)
    t = int(sum(q_lens))
    kv_cache = torch.randn(NUM_BLOCKS, HKV, BLOCK, 2 * D, generator=g)
    query, key, value = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    output = torch.full((t, HQ, D), float("nan"))
    PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV).forward(
        None, query, key, value, kv_cache, meta, output)
    k_cache, v_cache = split_kv_cache(kv_cache, D)
    qo = torch.zeros(len(q_lens) + 1, dtype=torch.long)
    qo[1:] = torch.tensor(q_lens).cumsum(0)
    ref = prefixattn.reference_attention(query, k_cache, v_cache, qo, torch.tensor(seq_lens), torch.tensor(table))
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output, ref, atol=atol, rtol=rtol)
    return meta


def _addresses(p) -> dict:
    return {name: getattr(p, name).data_ptr() for name in ("items", "gather", "mrows", "counters",
                                                            "ws_o", "ws_lse")}


def test_two_eager_steps_of_different_shapes_reuse_one_workspace(vllm_config):
    builder = _builder(vllm_config)
    attn = builder.eager_attn
    assert attn is not None and not attn.use_cuda_graph and builder.graph_attn is None
    cap = attn.workspace.capacity
    assert (cap.max_tokens, cap.max_requests, cap.max_blocks_per_request) == (MAX_TOKENS, MAX_SEQS, 0)
    g = torch.Generator().manual_seed(5)
    # A prefill chunk next to decodes under a shared 4-block prefix, then three requests with other lengths.
    first = _run_step(builder, [1, 9, 1], [70, 75, 66],
                      [[5, 6, 7, 8, 1, 0], [5, 6, 7, 8, 2, 0], [5, 6, 7, 8, 3, 0]], g)
    addresses = _addresses(first.plan)
    assert first.plan.workspace is attn.workspace and first.plan.has_shared and first.plan.num_items
    assert first.plan.block_table.data_ptr() == _common([1], [1], [[0]]).block_table_tensor.data_ptr()  # in place
    second = _run_step(builder, [17, 1, 2, 4], [80, 69, 71, 30],
                       [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 0], [5, 6, 7, 8, 12, 0], [13, 14, 0, 0, 0, 0]], g)
    assert second.plan.workspace is attn.workspace and second.plan.has_shared
    assert second.plan.num_tokens != first.plan.num_tokens and second.plan.num_items != first.plan.num_items
    assert _addresses(second.plan) == addresses  # the same device buffers at every step
    ws = attn.workspace
    assert addresses["items"] == ws.items.data_ptr() and addresses["ws_o"] == ws.ws_o.data_ptr()
    assert builder.capacity_fallbacks == 0


def test_a_step_beyond_the_scheduler_limits_falls_back_to_a_per_step_plan(vllm_config, caplog):
    builder = _builder(vllm_config)
    g = torch.Generator().manual_seed(6)
    five = [[5, 6, 1 + r, 0] for r in range(MAX_SEQS + 1)]  # one request more than max_num_seqs
    with caplog.at_level("WARNING"):
        meta = _run_step(builder, [1] * (MAX_SEQS + 1), [40] * (MAX_SEQS + 1), five, g)
    assert meta.plan.workspace is None and builder.capacity_fallbacks == 1
    assert "max_requests: expected at most 4" in caplog.text and "capacity_fallbacks" in caplog.text
    # the next step within the limits is back in the workspace
    meta = _run_step(builder, [1, 2], [40, 41], [[5, 6, 1, 0], [5, 6, 2, 0]], g)
    assert meta.plan.workspace is builder.eager_attn.workspace and builder.capacity_fallbacks == 1


def test_a_stale_eager_plan_is_refused(vllm_config):
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl

    builder = _builder(vllm_config)
    first = builder.build(0, _common([1, 3], [20, 33], [[1, 2, 3], [1, 4, 5]]))
    builder.build(0, _common([2], [20], [[1, 2, 3]]))
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=0.125, num_kv_heads=HKV)
    with pytest.raises(ValueError, match="plan: expected the latest plan of its workspace"):
        impl.forward(None, torch.zeros(4, HQ, D), torch.zeros(4, HKV, D), torch.zeros(4, HKV, D),
                     torch.zeros(NUM_BLOCKS, HKV, BLOCK, 2 * D), first, torch.zeros(4, HQ, D))
