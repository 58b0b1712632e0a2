"""A vLLM config whose static forward context holds real ``Attention`` layers on prefixattn's backend, as vLLM's
model construction leaves it (what metadata builders and the memory-profile reservation read)."""

from __future__ import annotations

import torch

D, HKV = 64, 2  # the tiny Llama's head size and KV heads (tests/vllm/tiny_model.py)


def config_with_layers(model_dir: str, layers: dict[str, int], *, block_size: int = 32, max_num_batched_tokens=64,
                       max_num_seqs=8, compilation_config=None):
    """``layers``: layer name -> query heads (each with the tiny Llama's KV heads and head size)."""
    from vllm.config import (CacheConfig, CompilationConfig, ModelConfig, SchedulerConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.model_executor.layers.attention import Attention

    from prefixattn.integrations.vllm.backend import PrefixAttnBackend
    from prefixattn.integrations.vllm.plugin import register

    register()  # as vLLM's plugin loader does: the layers look their backend up by name
    model = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    cfg = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                                      max_num_seqs=max_num_seqs, max_model_len=256,
                                                      is_encoder_decoder=False),
                     compilation_config=compilation_config or CompilationConfig())
    with set_current_vllm_config(cfg):
        for name, heads in layers.items():
            Attention(num_heads=heads, head_size=D, scale=D ** -0.5, num_kv_heads=HKV, cache_config=cfg.cache_config,
                      prefix=name, attn_backend=PrefixAttnBackend)
    return cfg


def full_attention_spec(block_size: int = 32):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
