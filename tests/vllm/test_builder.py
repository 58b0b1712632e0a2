"""Metadata builder and impl on real vLLM objects: CommonAttentionMetadata -> plan, cache views, K/V writes."""

import pytest
import torch

from tests.tolerances import ATTENTION_TOL

pytestmark = pytest.mark.vllm

BLOCK = 16
NUM_BLOCKS = 24
HQ, HKV, D = 4, 2, 64
# Requests 0-2 share blocks 10, 11 (32 tokens of a common prefix); 3 has its own. Request 2 is a chunked prefill
# (5 new tokens after 40 cached ones), the others decode one token.
BLOCK_TABLE = [[10, 11, 2, 0], [10, 11, 3, 0], [10, 11, 4, 0], [7, 8, 0, 0]]
Q_LENS = [1, 1, 5, 1]
SEQ_LENS = [40, 37, 45, 20]
PAD_TOKENS = 3  # vLLM may pad the token dimension past the real rows


@pytest.fixture(scope="module")
def vllm_config(tiny_llama):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))


@pytest.fixture
def builder(vllm_config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    return PrefixAttnMetadataBuilder(spec, [], vllm_config, torch.device("cpu"))


def common_metadata(*, upper_bound=True, seq_lens_upper=None):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens = torch.tensor(Q_LENS)
    qsl = torch.zeros(len(Q_LENS) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    table = torch.tensor(BLOCK_TABLE, dtype=torch.int32)
    slots = []
    for r, (q, s) in enumerate(zip(Q_LENS, SEQ_LENS)):
        slots += [BLOCK_TABLE[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    slot_mapping = torch.tensor(slots + [-1] * PAD_TOKENS, dtype=torch.int64)
    bound = seq_lens_upper if seq_lens_upper is not None else seq_lens.clone()
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(Q_LENS),
        num_actual_tokens=int(qsl[-1]) + PAD_TOKENS, max_query_len=max(Q_LENS), max_seq_len=max(SEQ_LENS),
        block_table_tensor=table, slot_mapping=slot_mapping,
        seq_lens_cpu_upper_bound=bound if upper_bound else None)


@pytest.mark.parametrize("cache_dtype, want", [("auto", torch.float32), ("fp8", torch.float8_e4m3fn),
                                               ("fp8_e5m2", torch.float8_e5m2)])
def test_builder_plans_price_the_cache_dtype(tiny_llama, cache_dtype, want):
    # vLLM's fp8 caches are uint8 memory (the spec's dtype); the plan's cost rule prices KV at the fp8 size.
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    model = ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D,
                             dtype=torch.float32 if cache_dtype == "auto" else torch.uint8)
    builder = PrefixAttnMetadataBuilder(spec, [], config, torch.device("cpu"))
    assert builder.kv_dtype == want
    assert builder.build(0, common_metadata()).plan.kv_dtype == want


def test_plan_inputs_from_common_metadata():
    from prefixattn.integrations.vllm.backend import plan_inputs

    inputs = plan_inputs(common_metadata(), block_size=BLOCK)
    assert inputs.qo_indptr.tolist() == [0, 1, 2, 7, 8]
    assert inputs.kv_lens.tolist() == SEQ_LENS
    assert inputs.block_table.tolist() == BLOCK_TABLE
    # A CPU table no runner holds: the planner reads it in place (no copy).
    assert inputs.route == "cpu"
    assert inputs.host_block_table.data_ptr() == inputs.block_table.data_ptr()
    # Without a host copy of seq_lens the device tensor is read; with asynchronous speculative decoding the upper
    # bound is not exact, so it is not used.
    assert plan_inputs(common_metadata(upper_bound=False), block_size=BLOCK).kv_lens.tolist() == SEQ_LENS
    inflated = torch.tensor(SEQ_LENS) + 2
    assert plan_inputs(common_metadata(seq_lens_upper=inflated), block_size=BLOCK).kv_lens.tolist() == \
        inflated.tolist()
    assert plan_inputs(common_metadata(seq_lens_upper=inflated), block_size=BLOCK,
                       exact_seq_lens_on_host=False).kv_lens.tolist() == SEQ_LENS


def test_plan_inputs_copy_only_the_used_columns_of_an_unknown_device_table():
    """vLLM's device block table is max_model_len / block_size wide; where no runner's host data holds it, the
    planner's copy is only the columns the longest request uses (counted: it synchronizes)."""
    from dataclasses import replace

    from prefixattn.integrations.vllm.host_tables import HostBlockTables, plan_inputs

    wide = torch.zeros((len(SEQ_LENS) + 3, 512), dtype=torch.int32, device="meta")  # vLLM's rows past num_reqs
    copies = []

    class Recording(HostBlockTables):
        def rows(self, common, n, cols):
            copies.append((n, cols))
            return torch.zeros((n, cols), dtype=torch.int32), "device_copy"

    inputs = plan_inputs(replace(common_metadata(), block_table_tensor=wide), block_size=BLOCK,
                         host_tables=Recording())
    assert inputs.block_table.shape == (len(SEQ_LENS), 512)  # the kernel's: whole rows, read in place
    assert copies == [(len(SEQ_LENS), -(-max(SEQ_LENS) // BLOCK))]
    assert inputs.host_block_table.shape == (len(SEQ_LENS), -(-max(SEQ_LENS) // BLOCK))


def test_build_finds_the_shared_prefix(builder):
    meta = builder.build(0, common_metadata())
    assert meta.num_query_tokens == sum(Q_LENS)
    assert meta.slot_mapping.shape[0] == sum(Q_LENS) and (meta.slot_mapping >= 0).all()
    p = meta.plan
    assert (p.num_requests, p.num_qo_heads, p.num_kv_heads, p.head_dim, p.block_size) == (4, HQ, HKV, D, BLOCK)
    assert [(n.kv_start, n.kv_end, n.requests.tolist()) for n in p.shared_nodes] == [(0, 2 * BLOCK, [0, 1, 2])]
    assert p.q_dtype == torch.float32 and p.causal


def test_build_refuses_non_causal(builder):
    meta = common_metadata()
    meta.causal = False
    with pytest.raises(ValueError, match="non-causal attention not supported"):
        builder.build(0, meta)


def _cache_in_layout(layout_name: str, g: torch.Generator) -> torch.Tensor:
    """A layer cache as vLLM hands it over: logical [B, Hkv, N, 2D] view over memory in ``layout``'s order."""
    from vllm.v1.kv_cache_interface import KVCacheLayout

    order = KVCacheLayout[layout_name].layer_view_order  # physical order of the logical axes
    logical_shape = (NUM_BLOCKS, HKV, BLOCK, 2 * D)
    physical = torch.randn([logical_shape[i] for i in order], generator=g)
    inverse = sorted(range(4), key=lambda i: order[i])
    view = physical.permute(*inverse)
    assert tuple(view.shape) == logical_shape
    return view


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BHLNC"])
def test_impl_forward_on_vllm_cache_views(builder, layout):
    import prefixattn

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, split_kv_cache

    g = torch.Generator().manual_seed(0)
    kv_cache = _cache_in_layout(layout, g)
    storage_before = kv_cache.untyped_storage().data_ptr()
    meta = builder.build(0, common_metadata())
    n, t = sum(Q_LENS), sum(Q_LENS) + PAD_TOKENS
    query = torch.randn(t, HQ, D, generator=g)
    key = torch.randn(t, HKV, D, generator=g)
    value = torch.randn(t, HKV, D, generator=g)
    output = torch.full((t, HQ, D), float("nan"))
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV)
    impl.forward(None, query, key, value, kv_cache, meta, output)

    k_cache, v_cache = split_kv_cache(kv_cache, D)
    assert k_cache.untyped_storage().data_ptr() == storage_before  # views of vLLM's cache, not copies
    slots = meta.slot_mapping
    torch.testing.assert_close(k_cache[slots // BLOCK, slots % BLOCK], key[:n], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[slots // BLOCK, slots % BLOCK], value[:n], atol=0, rtol=0)
    qo = torch.tensor([0, 1, 2, 7, 8])
    ref = prefixattn.reference_attention(query[:n], k_cache, v_cache, qo, torch.tensor(SEQ_LENS),
                                         torch.tensor(BLOCK_TABLE))
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output[:n], ref, atol=atol, rtol=rtol)
    assert torch.isnan(output[n:]).all()  # padding rows are neither read nor written


def test_impl_forward_with_window_soft_cap_and_sinks(builder):
    # A group of Gemma-2/gpt-oss-like layers: vLLM's sliding_window=S is prefixattn's window_left = S - 1; the
    # builder's plan carries the group's window and soft cap, the impl passes its sinks.
    import prefixattn

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, split_kv_cache

    g = torch.Generator().manual_seed(2)
    kv_cache = _cache_in_layout("LBNHC", g)
    builder.window_left, builder.logits_soft_cap = 20 - 1, 2.0
    meta = builder.build(0, common_metadata())
    n = sum(Q_LENS)
    query = torch.randn(n, HQ, D, generator=g) * 4
    sinks = torch.tensor([0.5, -1.0, 3.0, -2.0])
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV, sliding_window=20,
                          logits_soft_cap=2.0, sinks=sinks)
    output = torch.empty(n, HQ, D)
    impl.forward(None, query, None, None, kv_cache, meta, output)
    k_cache, v_cache = split_kv_cache(kv_cache, D)
    ref = prefixattn.reference_attention(query, k_cache, v_cache, torch.tensor([0, 1, 2, 7, 8]),
                                         torch.tensor(SEQ_LENS), torch.tensor(BLOCK_TABLE), window_left=19,
                                         logits_soft_cap=2.0, sinks=sinks)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output, ref, atol=atol, rtol=rtol)
    # A layer whose window is not its group's plan's is refused, never run with the wrong mask.
    other = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV)
    with pytest.raises(ValueError, match="plan: expected window_left=-1"):
        other.forward(None, query, None, None, kv_cache, meta, output)


@pytest.mark.parametrize("kv_cache_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_impl_forward_on_an_fp8_cache(builder, kv_cache_dtype, fp8):
    # vLLM's fp8 cache is uint8 memory; K/V are written as x / scale (vLLM's reshape_and_cache convention) and read
    # back dequantized with the layer's per-tensor scales.
    from types import SimpleNamespace

    import prefixattn

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, split_kv_cache

    g = torch.Generator().manual_seed(3)
    kv_cache = (torch.randn(NUM_BLOCKS, HKV, BLOCK, 2 * D, generator=g) * 2).to(fp8).view(torch.uint8)
    meta = builder.build(0, common_metadata())
    n = sum(Q_LENS)
    query, key, value = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    layer = SimpleNamespace(_k_scale=torch.tensor(0.5), _v_scale=torch.tensor(2.0))
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV, kv_cache_dtype=kv_cache_dtype)
    output = torch.empty(n, HQ, D)
    impl.forward(layer, query, key, value, kv_cache, meta, output)
    k_cache, v_cache = split_kv_cache(kv_cache.view(fp8), D)
    slots = meta.slot_mapping
    assert torch.equal(k_cache[slots // BLOCK, slots % BLOCK].float(), (key / 0.5).to(fp8).float())
    assert torch.equal(v_cache[slots // BLOCK, slots % BLOCK].float(), (value / 2.0).to(fp8).float())
    ref = prefixattn.reference_attention(query, k_cache, v_cache, torch.tensor([0, 1, 2, 7, 8]),
                                         torch.tensor(SEQ_LENS), torch.tensor(BLOCK_TABLE), k_scale=0.5, v_scale=2.0)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output, ref, atol=atol, rtol=rtol)


def test_profiling_run_without_metadata_is_a_no_op():
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl

    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=0.125, num_kv_heads=HKV)
    out = torch.zeros(3, HQ, D)
    assert impl.forward(None, torch.ones(3, HQ, D), None, None, torch.empty(0), None, out) is out
    assert (out == 0).all()


def test_kv_sharing_layer_does_not_write_the_cache(builder):
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl

    g = torch.Generator().manual_seed(1)
    kv_cache = _cache_in_layout("LBNHC", g)
    before = kv_cache.clone()
    meta = builder.build(0, common_metadata())
    t = sum(Q_LENS) + PAD_TOKENS
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=0.125, num_kv_heads=HKV,
                          kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    impl.forward(None, torch.randn(t, HQ, D, generator=g), torch.randn(t, HKV, D, generator=g),
                 torch.randn(t, HKV, D, generator=g), kv_cache, meta, torch.empty(t, HQ, D))
    assert torch.equal(kv_cache, before)


def test_fused_output_quantization_is_refused(builder):
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl

    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=0.125, num_kv_heads=HKV)
    with pytest.raises(NotImplementedError, match="output quantization"):
        impl.forward(None, torch.empty(1, HQ, D), None, None, torch.empty(0), None, torch.empty(1, HQ, D),
                     output_scale=torch.ones(1))
