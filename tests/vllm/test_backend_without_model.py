"""The backend as vLLM's own attention-backend tests (tests/v1/attention) build it: no model, so no layers in the
static forward context (the builder gets a placeholder layer name) and no model loader setting torch's default
dtype. The builder then takes the window from its KV cache spec, and the impl the model dtype from vLLM's config."""

import pytest
import torch

from tests.tolerances import ATTENTION_TOL

pytestmark = pytest.mark.vllm

BLOCK, HQ, HKV, D = 16, 4, 2, 64
NUM_BLOCKS = 12
WINDOW = 24  # vLLM's sliding_window: prefixattn's window_left 23
# Requests 0 and 1 share blocks 1, 2; request 1 is a chunked prefill (4 new tokens). Every request is longer than the
# window, so a plan without it attends to keys the layer must not see.
BLOCK_TABLE = [[1, 2, 3], [1, 2, 4], [5, 6, 0]]
Q_LENS = [1, 4, 1]
SEQ_LENS = [40, 44, 30]
QO_INDPTR = [0, 1, 5, 6]


def _config(model_dir: str, dtype: str):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=model_dir, dtype=dtype, skip_tokenizer_init=True, max_model_len=256)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))


def _metadata():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor(QO_INDPTR, dtype=torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    slots = [BLOCK_TABLE[r][p // BLOCK] * BLOCK + p % BLOCK
             for r, (q, s) in enumerate(zip(Q_LENS, SEQ_LENS)) for p in range(s - q, s)]
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_lens,
        num_reqs=len(Q_LENS), num_actual_tokens=sum(Q_LENS), max_query_len=max(Q_LENS), max_seq_len=max(SEQ_LENS),
        block_table_tensor=torch.tensor(BLOCK_TABLE, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64))


def _forward_matches_reference(builder, impl, dtype: torch.dtype, *, window_left: int = -1, seed: int = 0):
    """One step through the builder and the impl, K/V written first; the output equals prefixattn's reference."""
    import prefixattn

    from prefixattn.integrations.vllm.backend import split_kv_cache

    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(NUM_BLOCKS, HKV, BLOCK, 2 * D, generator=g).to(dtype)
    n = sum(Q_LENS)
    query, key, value = (torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    meta = builder.build(0, _metadata())
    assert meta.plan.window_left == window_left
    output = torch.empty(n, HQ, D, dtype=dtype)
    impl.forward(None, query, key, value, kv_cache, meta, output)
    k_cache, v_cache = split_kv_cache(kv_cache, D)
    ref = prefixattn.reference_attention(query, k_cache, v_cache, torch.tensor(QO_INDPTR), torch.tensor(SEQ_LENS),
                                         torch.tensor(BLOCK_TABLE), window_left=window_left)
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(output.float(), ref.float(), atol=atol, rtol=rtol)


def _window_spec(kind: str):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    # FullAttentionSpec records a windowed layer's window too (vLLM's hybrid KV cache allocator off); vLLM's test
    # harness builds that one from the model config.
    spec_cls = SlidingWindowSpec if kind == "sliding_window" else FullAttentionSpec
    return spec_cls(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32, sliding_window=WINDOW)


@pytest.mark.parametrize("spec_kind", ["sliding_window", "full_attention"])
def test_a_builder_without_layers_plans_with_its_cache_specs_window(tiny_llama, spec_kind):
    # The plan carries the spec's window, so a windowed layer's forward runs (it used to refuse the plan after
    # writing K/V: "plan: expected window_left=23 ... got -1").
    from tests.vllm.layers import config_with_layers

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, PrefixAttnMetadataBuilder

    config = _config(tiny_llama, "float32")
    spec = _window_spec(spec_kind)
    assert PrefixAttnMetadataBuilder(spec, [], config, torch.device("cpu")).window_left == WINDOW - 1
    builder = PrefixAttnMetadataBuilder(spec, ["placeholder"], config, torch.device("cpu"))
    assert builder.window_left == WINDOW - 1
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV, sliding_window=WINDOW)
    _forward_matches_reference(builder, impl, torch.float32, window_left=WINDOW - 1)
    # The spec is only the fallback: registered layers set the group's window (none here), whatever the spec says.
    layer = "model.layers.0.self_attn.attn"
    with_layers = config_with_layers(tiny_llama, {layer: HQ}, block_size=BLOCK)
    assert PrefixAttnMetadataBuilder(spec, [layer], with_layers, torch.device("cpu")).window_left == -1


def test_the_impl_reads_the_model_dtype_from_vllms_config(tiny_llama):
    # An fp16 model with an explicit fp16 cache, torch's default dtype left at fp32: the impl is not refused, and the
    # step runs end to end in fp16.
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, PrefixAttnMetadataBuilder

    assert torch.get_default_dtype() == torch.float32
    config = _config(tiny_llama, "float16")
    assert config.model_config.dtype == torch.float16
    with set_current_vllm_config(config):
        impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV, kv_cache_dtype="float16")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float16)
    builder = PrefixAttnMetadataBuilder(spec, ["placeholder"], config, torch.device("cpu"))
    _forward_matches_reference(builder, impl, torch.float16, seed=1)


def test_without_a_config_the_forward_checks_the_cache_dtype():
    # No config, no model dtype: torch's default dtype is not the model's outside vLLM's model loader, so the impl
    # does not refuse an explicit 16-bit cache on it; the forward still refuses a cache that is not q's dtype.
    import prefixattn

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, PrefixAttnMetadata

    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=0.125, num_kv_heads=HKV, kv_cache_dtype="bfloat16")
    p = prefixattn.plan(torch.tensor([0, 1]), torch.tensor([9]), torch.tensor([[0, 1, 2]]), block_size=4,
                        num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, q_dtype=torch.float32)
    meta = PrefixAttnMetadata(plan=p, num_query_tokens=1, slot_mapping=torch.tensor([8]))
    kv_cache = torch.zeros(4, HKV, 4, 2 * D, dtype=torch.bfloat16)
    q = torch.randn(1, HQ, D)
    with pytest.raises(ValueError, match="k_cache: expected the dtype of q"):
        impl.forward(None, q, None, None, kv_cache, meta, torch.empty_like(q))
