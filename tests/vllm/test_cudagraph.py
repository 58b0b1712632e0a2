"""Full CUDA graphs in vLLM, everything up to the capture (CPU): the builder's support level, the capture metadata,
and a padded replay step that reuses the captured launch (grid, buffer addresses) and matches the reference.

A CPU has no graphs to capture; what these tests pin is the contract a capture relies on: every op of a graph-safe
forward covers the padded rows with the shapes of the capture, and the attention launch of any later step within
the capacity has exactly the captured arguments (so replaying the captured launch runs that step's plan).
"""

import pytest
import torch

from tests.launch_count import RecordingKernel
from tests.tolerances import ATTENTION_TOL

pytestmark = pytest.mark.vllm

BLOCK = 16
NUM_BLOCKS = 24
HQ, HKV, D = 4, 2, 64
CAPTURE_SIZE = 8  # the largest capture size: the graph wrapper's token capacity


def full_graph_config(model_dir: str):
    """vLLM's config of a local model with full CUDA graphs of decode batches up to CAPTURE_SIZE."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    model = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))
    # vLLM turns graphs off on CPU platforms; set what a GPU config would hold (FULL_AND_PIECEWISE is the default
    # there for a backend at UNIFORM_BATCH).
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, CAPTURE_SIZE]
    config.compilation_config.max_cudagraph_capture_size = CAPTURE_SIZE
    return config


@pytest.fixture(scope="module")
def vllm_config(tiny_llama):
    return full_graph_config(tiny_llama)


def _builder(vllm_config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    return PrefixAttnMetadataBuilder(spec, [], vllm_config, torch.device("cpu"))


#: vLLM's persistent device block table (``BlockTable.gpu``): every step's ``block_table_tensor`` is a row slice of
#: it, so its address and row stride never change.
MAX_BLOCKS_PER_REQ = 16
PERSISTENT_TABLE = torch.zeros(CAPTURE_SIZE, MAX_BLOCKS_PER_REQ, dtype=torch.int32)


def _common(q_lens, seq_lens, table, *, num_padded_reqs=0, num_tokens_padded=None):
    """vLLM's CommonAttentionMetadata as its model runner pads it for a full graph: padding requests have no query
    rows, seq_len 0 and the null block; padding token slots are -1."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens = list(q_lens) + [0] * num_padded_reqs
    seq_lens = list(seq_lens) + [0] * num_padded_reqs
    table = [list(r) for r in table] + [[0] * len(table[0])] * num_padded_reqs
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        slots += [table[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    num_tokens = num_tokens_padded or int(qsl[-1])
    slots += [-1] * (num_tokens - len(slots))
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(q_lens),
        num_actual_tokens=num_tokens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=_persistent_rows(table), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone())


def _persistent_rows(table):
    PERSISTENT_TABLE.zero_()
    PERSISTENT_TABLE[:len(table), :len(table[0])] = torch.tensor(table, dtype=torch.int32)
    return PERSISTENT_TABLE[:len(table)]


def test_builder_declares_full_graphs_for_every_batch(vllm_config):
    from vllm.v1.attention.backend import AttentionCGSupport

    from prefixattn.kernels import layout as K

    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    assert PrefixAttnMetadataBuilder.get_cudagraph_support(vllm_config, None) == AttentionCGSupport.ALWAYS
    # FULL_AND_PIECEWISE: full graphs of uniform decode batches only, so no prefill-chunk launch in them.
    attn = _builder(vllm_config).graph_attn
    assert attn is not None and attn.use_cuda_graph and attn.graph_max_q_len == 1
    assert attn.graph_work_classes == (K.CLASS_SHARED, K.CLASS_DECODE)
    assert attn.workspace.capacity.max_tokens == CAPTURE_SIZE


def test_no_full_graphs_no_graph_wrapper(tiny_llama):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    builder = _builder(VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK)))
    assert builder.graph_attn is None
    meta = builder.build(0, _common([1, 1], [20, 33], [[1, 2, 3], [1, 4, 5]]))
    assert meta.graph_attn is None and meta.plan.workspace is builder.eager_attn.workspace


def test_capture_then_padded_replay_reuses_the_launch(vllm_config, monkeypatch):
    """Capture metadata for the full capture size (vLLM's dummy decode batch), then a real step of 5 decodes under
    a shared prefix padded to it: the replayed step launches with the captured arguments, matches the reference on
    its real rows, leaves padding rows alone and writes padding K/V only to the null block."""
    import prefixattn
    from prefixattn import prefix_attention

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, split_kv_cache

    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    builder = _builder(vllm_config)
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV)
    g = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(NUM_BLOCKS, HKV, BLOCK, 2 * D, generator=g)  # vLLM's logical [B, Hkv, N, 2D]
    # Static buffers, as vLLM's graph inputs: the same tensors at capture and at replay.
    query, output = torch.zeros(CAPTURE_SIZE, HQ, D), torch.zeros(CAPTURE_SIZE, HQ, D)
    key, value = torch.zeros(CAPTURE_SIZE, HKV, D), torch.zeros(CAPTURE_SIZE, HKV, D)

    null_table = [[0] * MAX_BLOCKS_PER_REQ] * CAPTURE_SIZE
    dummy = _common([1] * CAPTURE_SIZE, [200] * CAPTURE_SIZE, null_table)
    meta = builder.build_for_cudagraph_capture(dummy)
    assert meta.graph_attn is builder.graph_attn and meta.plan.num_tokens == CAPTURE_SIZE
    assert meta.plan.work.items[:, 3].max() == 1  # KV cut to each dummy request's own token: a short capture run
    impl.forward(None, query, key, value, kv_cache, meta, output)

    # Replay step: 5 real decodes (requests 0-3 share blocks 5, 6, 11, 12: a prefix worth its shared program's
    # fixed cost), padded to the capture size.
    table = [[5, 6, 11, 12, 1, 0], [5, 6, 11, 12, 2, 0], [5, 6, 11, 12, 3, 0], [5, 6, 11, 12, 4, 0],
             [7, 8, 9, 13, 14, 0]]
    seq_lens = [72, 67, 79, 65, 77]
    common = _common([1] * 5, seq_lens, table, num_padded_reqs=3, num_tokens_padded=CAPTURE_SIZE)
    meta = builder.build(0, common)
    assert meta.graph_attn is builder.graph_attn and meta.plan.num_tokens == 5 and meta.plan.has_shared
    query.copy_(torch.randn(CAPTURE_SIZE, HQ, D, generator=g))
    key.copy_(torch.randn(CAPTURE_SIZE, HKV, D, generator=g))
    value.copy_(torch.randn(CAPTURE_SIZE, HKV, D, generator=g))
    output.fill_(float("nan"))
    before = kv_cache.clone()
    impl.forward(None, query, key, value, kv_cache, meta, output)

    captured, replayed = rec.launches[:2], rec.launches[2:]
    assert len(rec.launches) == 4 and captured == replayed  # the captured launches are the replayed step's
    k_cache, v_cache = split_kv_cache(kv_cache, D)
    ref = prefixattn.reference_attention(query[:5], k_cache, v_cache, torch.arange(6), torch.tensor(seq_lens),
                                         torch.tensor(table))
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output[:5], ref, atol=atol, rtol=rtol)
    assert torch.isnan(output[5:]).all()  # padding rows: not written
    slots = common.slot_mapping[:5]
    torch.testing.assert_close(k_cache[slots // BLOCK, slots % BLOCK], key[:5], atol=0, rtol=0)
    changed = (kv_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {0, *(slots // BLOCK).tolist()}  # padding K/V went to the null block only


def test_mixed_batch_is_not_graph_safe(vllm_config):
    """A prefill chunk makes the batch non-uniform: vLLM runs it piecewise, the builder plans it the eager way."""
    builder = _builder(vllm_config)
    meta = builder.build(0, _common([1, 5], [20, 45], [[1, 2, 3], [1, 4, 5]]))
    assert meta.graph_attn is None and meta.plan.workspace is builder.eager_attn.workspace


def test_a_stale_graph_plan_is_refused(vllm_config):
    """Two metadata built ahead of one forward (micro-batching) would share one graph workspace: refused."""
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl

    builder = _builder(vllm_config)
    first = builder.build(0, _common([1, 1], [20, 33], [[1, 2, 3], [1, 4, 5]]))
    builder.build(0, _common([1], [20], [[1, 2, 3]]))
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=0.125, num_kv_heads=HKV)
    t = 2
    with pytest.raises(ValueError, match="attn_metadata: expected the builder's latest plan"):
        impl.forward(None, torch.zeros(t, HQ, D), torch.zeros(t, HKV, D), torch.zeros(t, HKV, D),
                     torch.zeros(NUM_BLOCKS, HKV, BLOCK, 2 * D), first, torch.zeros(t, HQ, D))


def test_a_smaller_graph_launches_a_smaller_grid(vllm_config, monkeypatch):
    """A step padded to capture size 4 plans for that graph's grid (the bound of a 4-token step, not of the largest
    graph) and matches the reference."""
    import prefixattn
    from prefixattn import prefix_attention

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, split_kv_cache

    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    builder = _builder(vllm_config)
    attn = builder.graph_attn
    table, seq_lens = [[5, 6, 1], [5, 6, 2], [7, 8, 3]], [40, 35, 45]
    meta = builder.build(0, _common([1] * 3, seq_lens, table, num_padded_reqs=1, num_tokens_padded=4))
    small, large = attn.graph_grid_items(4), attn.graph_grid_items(CAPTURE_SIZE)
    assert meta.plan.stats["grid_items"] == small and all(a <= b for a, b in zip(small, large)) and small != large
    g = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(NUM_BLOCKS, HKV, BLOCK, 2 * D, generator=g)
    query, key, value = torch.randn(4, HQ, D, generator=g), torch.randn(4, HKV, D, generator=g), torch.randn(
        4, HKV, D, generator=g)
    output = torch.full((4, HQ, D), float("nan"))
    PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV).forward(
        None, query, key, value, kv_cache, meta, output)
    assert [grid for grid, _ in rec.launches] == [(n * HKV,) for n in small]
    k_cache, v_cache = split_kv_cache(kv_cache, D)
    ref = prefixattn.reference_attention(query[:3], k_cache, v_cache, torch.arange(4), torch.tensor(seq_lens),
                                         torch.tensor(table))
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output[:3], ref, atol=atol, rtol=rtol)
    assert torch.isnan(output[3:]).all()


def test_full_mode_captures_mixed_batches(vllm_config, monkeypatch):
    """vLLM's FULL mode replays full graphs for mixed batches too: the graph wrapper then launches the prefill-chunk
    class as well, a mixed step is graph-safe, and it replays the launches captured for a dummy batch, matching the
    reference."""
    import copy

    import prefixattn
    from prefixattn import prefix_attention
    from prefixattn.kernels import layout as K
    from vllm.config.compilation import CUDAGraphMode

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, split_kv_cache

    size = 2 * CAPTURE_SIZE  # past a decode tile's rows (8 on the CPU heuristic at GQA 2): chunk tiles of their own
    config = copy.deepcopy(vllm_config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, CAPTURE_SIZE, size]
    config.compilation_config.max_cudagraph_capture_size = size
    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    builder = _builder(config)
    attn = builder.graph_attn
    assert attn.graph_max_q_len == size
    assert attn.graph_work_classes == (K.CLASS_SHARED, K.CLASS_CHUNK, K.CLASS_DECODE)
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV)
    g = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(NUM_BLOCKS, HKV, BLOCK, 2 * D, generator=g)
    query, output = torch.zeros(size, HQ, D), torch.zeros(size, HQ, D)
    key, value = torch.zeros(size, HKV, D), torch.zeros(size, HKV, D)
    dummy = _common([2] * CAPTURE_SIZE, [200] * CAPTURE_SIZE, [[0] * MAX_BLOCKS_PER_REQ] * CAPTURE_SIZE)
    impl.forward(None, query, key, value, kv_cache, builder.build_for_cudagraph_capture(dummy), output)
    # A 10-row prefill chunk and two decodes under a shared prefix (blocks 5, 6), padded to the capture size.
    table, seq_lens, q_lens = [[5, 6, 1, 0], [5, 6, 2, 0], [5, 6, 3, 10]], [40, 35, 55], [1, 1, 10]
    common = _common(q_lens, seq_lens, table, num_padded_reqs=1, num_tokens_padded=size)
    meta = builder.build(0, common)
    assert meta.graph_attn is attn and K.CLASS_CHUNK in meta.plan.work_classes
    for t in (query, key, value):
        t.copy_(torch.randn(t.shape, generator=g))
    output.fill_(float("nan"))
    impl.forward(None, query, key, value, kv_cache, meta, output)
    captured, replayed = rec.launches[:3], rec.launches[3:]
    assert len(rec.launches) == 6 and captured == replayed
    k_cache, v_cache = split_kv_cache(kv_cache, D)
    ref = prefixattn.reference_attention(query[:12], k_cache, v_cache, torch.tensor([0, 1, 2, 12]),
                                         torch.tensor(seq_lens), torch.tensor(table))
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output[:12], ref, atol=atol, rtol=rtol)
    assert torch.isnan(output[12:]).all()
