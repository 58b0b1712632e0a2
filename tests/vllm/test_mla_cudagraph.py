"""The MLA backend under vLLM's full CUDA graphs, everything up to the capture (CPU): the builder's support level,
the capture metadata, and a padded decode step that replays the captured launch and matches the reference.

As in test_cudagraph.py: a CPU has no graphs to capture; these tests pin that a graph-safe step's launch has exactly
the captured arguments (grids, workspace addresses), so replaying the captured launch runs that step's plan.
"""

import types

import pytest
import torch

from tests.launch_count import fixed_launch_args
from tests.tolerances import ATTENTION_TOL
from tests.vllm.test_cudagraph import BLOCK, CAPTURE_SIZE, MAX_BLOCKS_PER_REQ, _common, full_graph_config

pytestmark = pytest.mark.vllm

#: Small latent widths keep the interpreter fast; vLLM's builder reads them from the layer.
KV_LORA_RANK, ROPE_DIM = 64, 16
HEADS = 4  # the tiny DeepSeek-V3's
NUM_BLOCKS = 24
SCALE = 0.2


def _prefill_standin():
    """vLLM's MLA prefill backend as the builder uses it (its prefill path is vLLM's own, not under test here)."""
    return types.SimpleNamespace(prepare_metadata=lambda metadata: None)


@pytest.fixture(scope="module")
def vllm_config(tiny_deepseek_v3):
    config = full_graph_config(tiny_deepseek_v3)
    # What the builder reads of the group's first MLA layer (vLLM's MLAAttention holds these).
    config.compilation_config.static_forward_context["layers.0.attn"] = types.SimpleNamespace(
        q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=32, qk_rope_head_dim=ROPE_DIM, v_head_dim=32,
        scale=SCALE, prefill_backend=types.SimpleNamespace(clone=_prefill_standin))
    return config


@pytest.fixture
def parts(vllm_config):
    """``(builder, impl)`` of one KV cache group, built under vLLM's current config as vLLM builds them."""
    return build_parts(vllm_config)


def build_parts(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from prefixattn.integrations.vllm.mla_backend import PrefixAttnMLAImpl, PrefixAttnMLAMetadataBuilder

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=KV_LORA_RANK + ROPE_DIM,
                            dtype=torch.float32)
    with set_current_vllm_config(vllm_config):
        builder = PrefixAttnMLAMetadataBuilder(spec, ["layers.0.attn"], vllm_config, torch.device("cpu"))
        impl = PrefixAttnMLAImpl(num_heads=HEADS, head_size=KV_LORA_RANK + ROPE_DIM, scale=SCALE, num_kv_heads=1,
                                 alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                                 attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
                                 kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=32, qk_rope_head_dim=ROPE_DIM,
                                 qk_head_dim=32 + ROPE_DIM, v_head_dim=32, kv_b_proj=None)
    return builder, impl


def test_builder_declares_uniform_decode_graphs(vllm_config, parts):
    from vllm.v1.attention.backend import AttentionCGSupport

    from prefixattn.integrations.vllm.mla_backend import PrefixAttnMLAMetadataBuilder

    assert PrefixAttnMLAMetadataBuilder.get_cudagraph_support(vllm_config, None) == AttentionCGSupport.UNIFORM_BATCH
    builder, _ = parts
    attn = builder.graph_attn
    assert attn is not None and attn.use_cuda_graph and attn.graph_max_q_len == 1
    assert attn.workspace.capacity.max_tokens == CAPTURE_SIZE


def test_capture_then_padded_replay_reuses_the_launch(parts):
    """Capture metadata for the full capture size, then 5 real decodes under a shared latent prefix padded to it:
    the replayed step's launch has the captured arguments and its real rows match the reference."""
    import prefixattn

    builder, impl = parts
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(NUM_BLOCKS, BLOCK, KV_LORA_RANK + ROPE_DIM, generator=g)
    q = torch.zeros(CAPTURE_SIZE, HEADS, KV_LORA_RANK + ROPE_DIM)  # the graph's static input

    dummy = _common([1] * CAPTURE_SIZE, [200] * CAPTURE_SIZE, [[0] * MAX_BLOCKS_PER_REQ] * CAPTURE_SIZE)
    meta = builder.build_for_cudagraph_capture(dummy)
    assert meta.graph_attn is builder.graph_attn and meta.decode_plan.num_tokens == CAPTURE_SIZE
    assert meta.decode_plan.work.items[:, 3].max() == 1  # KV cut to each dummy request's own token
    impl.forward_mqa(q, cache, meta, None)
    captured = fixed_launch_args(meta.decode_plan)

    table = [[5, 6, 11, 12, 1, 0], [5, 6, 11, 12, 2, 0], [5, 6, 11, 12, 3, 0], [5, 6, 11, 12, 4, 0],
             [7, 8, 9, 13, 14, 0]]
    seq_lens = [72, 67, 79, 65, 77]
    meta = builder.build(0, _common([1] * 5, seq_lens, table, num_padded_reqs=3, num_tokens_padded=CAPTURE_SIZE))
    p = meta.decode_plan
    assert meta.graph_attn is builder.graph_attn and p.num_tokens == 5 and p.has_shared
    q.copy_(torch.randn(CAPTURE_SIZE, HEADS, KV_LORA_RANK + ROPE_DIM, generator=g))
    # As vLLM's MLA layer hands it over: the absorbed query and the rotary query apart.
    out, lse = impl.forward_mqa((q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]), cache, meta, None)
    assert lse is None and fixed_launch_args(p) == captured
    ref = prefixattn.reference_mla_attention(q[:5], cache, torch.arange(6), torch.tensor(seq_lens),
                                             torch.tensor(table), kv_lora_rank=KV_LORA_RANK, sm_scale=SCALE)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(out[:5], ref, atol=atol, rtol=rtol)


def test_a_step_with_prefills_plans_its_decodes_eagerly(parts):
    """vLLM runs a mixed step piecewise: its decodes (first, as vLLM orders them) plan into the eager workspace."""
    builder, _ = parts
    meta = builder.build(0, _common([1, 5], [20, 45], [[1, 2, 3], [1, 4, 5]]))
    assert (meta.num_decodes, meta.num_prefills) == (1, 1)
    assert meta.graph_attn is None and meta.decode_plan.workspace is builder.eager_attn.workspace
    assert meta.decode_plan.num_requests == 1


def test_a_stale_graph_plan_is_refused(parts):
    builder, impl = parts
    first = builder.build(0, _common([1, 1], [20, 33], [[1, 2, 3], [1, 4, 5]]))
    builder.build(0, _common([1], [20], [[1, 2, 3]]))
    with pytest.raises(ValueError, match="attn_metadata: expected the builder's latest plan"):
        impl.forward_mqa(torch.zeros(2, HEADS, KV_LORA_RANK + ROPE_DIM),
                         torch.zeros(NUM_BLOCKS, BLOCK, KV_LORA_RANK + ROPE_DIM), first, None)


def test_the_builder_warms_up_the_mla_variants_of_its_decodes(parts):
    # vLLM's dummy runs and graph captures launch these; under the interpreter nothing is compiled, only listed.
    builder, _ = parts
    report = builder.warmup_reports[0]
    assert report.mode == "skipped"
    lines = "\n".join(report.lines())
    assert f"mla_attention float32 h{HEADS} latent {KV_LORA_RANK}+{ROPE_DIM} page {BLOCK} shared no-lse" in lines
    assert "decode no-lse" in lines and "chunk" not in lines  # decodes only: one query row each
    assert len(builder.warmup_reports) == 1  # without prefix caching no prefill has a cached context


def test_with_prefix_caching_the_builder_warms_up_the_prefill_contexts_attention(vllm_config, monkeypatch):
    from prefixattn.integrations.vllm import backend

    monkeypatch.setattr(backend, "_warmed_up", {})
    monkeypatch.setattr(vllm_config.cache_config, "enable_prefix_caching", True)
    builder, _ = build_parts(vllm_config)
    # Every head its own, keys of qk_nope_head_dim + rope_dim (32 + 16), chunks up to the step's token budget.
    lines = "\n".join(builder.warmup_reports[1].lines())
    assert f"prefix_attention float32 h{HEADS}/{HEADS} d48" in lines and "chunk" in lines
