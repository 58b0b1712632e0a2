"""Hostile input in vLLM: a KV cache dtype other than the model's is refused at configuration (it used to pass and crash
at the first forward with ``k_cache: expected the dtype of q``), and the engine path's block ids are checked
against the layer's cache."""

import pytest
import torch

pytestmark = pytest.mark.vllm


def _validate(**overrides) -> list[str]:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from prefixattn.integrations.vllm.backend import PrefixAttnBackend

    cfg = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    cfg.update(overrides)
    return PrefixAttnBackend.validate_configuration(device_capability=DeviceCapability(9, 0),
                                                    **AttentionSelectorConfig(**cfg)._asdict())


@pytest.mark.parametrize("dtype, kv_cache_dtype", [
    (torch.bfloat16, "float16"), (torch.float16, "bfloat16"), (torch.float32, "float16"), (torch.float32, "bfloat16"),
])
def test_kv_cache_dtype_other_than_the_model_dtype_is_refused_by_the_selector(dtype, kv_cache_dtype):
    want = str(dtype).replace("torch.", "")
    assert f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {want}" in " ".join(
        _validate(dtype=dtype, kv_cache_dtype=kv_cache_dtype))


@pytest.mark.parametrize("dtype, kv_cache_dtype", [
    (torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.bfloat16, "auto"), (torch.float32, "auto"),
])
def test_kv_cache_dtype_equal_to_the_model_dtype_passes(dtype, kv_cache_dtype):
    assert _validate(dtype=dtype, kv_cache_dtype=kv_cache_dtype) == []


def test_impl_refuses_a_kv_cache_dtype_other_than_the_model_dtype(tiny_llama):
    # Platforms whose selector does not validate (CPU) reach the impl: vLLM builds it under its config, whose
    # model dtype it reads (torch's default dtype, fp32 here, is not the model's).
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from prefixattn.integrations.vllm.backend import PrefixAttnImpl

    model = ModelConfig(model=tiny_llama, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256)
    with set_current_vllm_config(VllmConfig(model_config=model)):
        with pytest.raises(ValueError, match="Selected backend PREFIXATTN is not valid for this configuration") as e:
            PrefixAttnImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, kv_cache_dtype="float16")
        assert "kv_cache_dtype float16 differs from the model dtype bfloat16" in str(e.value)
        PrefixAttnImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, kv_cache_dtype="bfloat16")


def test_forward_checks_block_ids_against_the_layer_cache():
    # The engine path runs prefixattn.attention(), which compares the plan's largest block id with the layer
    # cache's block count on the host: a metadata bug in the engine becomes a ValueError, not a wild read.
    import prefixattn
    from prefixattn.integrations.vllm.backend import PrefixAttnImpl, PrefixAttnMetadata

    impl = PrefixAttnImpl(num_heads=2, head_size=64, scale=0.125, num_kv_heads=1)
    p = prefixattn.plan(torch.tensor([0, 1]), torch.tensor([9]), torch.tensor([[0, 1, 5]]), block_size=4,
                        num_qo_heads=2, num_kv_heads=1, head_dim=64, q_dtype=torch.float32)
    meta = PrefixAttnMetadata(plan=p, num_query_tokens=1, slot_mapping=torch.tensor([8]))
    kv_cache = torch.zeros(4, 1, 4, 128)  # vLLM's logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
    q, kv = torch.randn(1, 2, 64), torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match=r"k_cache: expected more than 5 blocks in dim 0 \(the plan reads block id "
                                         r"5\), got 4"):
        impl.forward(None, q, kv, kv, kv_cache, meta, torch.empty_like(q))


def test_engine_refuses_a_kv_cache_dtype_other_than_the_model_dtype_before_running(tmp_path, tiny_llama):
    from tests.vllm.engine import run_engine

    with pytest.raises(AssertionError, match="differs from the model dtype") as info:
        run_engine(tmp_path, "kvdtype", backend="prefixattn", model=tiny_llama, prompts=[[1, 2, 3]], max_tokens=1,
                   llm=dict(dtype="bfloat16", kv_cache_dtype="float16", block_size=32, max_model_len=256))
    assert "Selected backend PREFIXATTN is not valid" in str(info.value)
    assert "failed at stage 'construct LLM'" in str(info.value)
