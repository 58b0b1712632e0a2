"""SGLang attention backend for MLA models (DeepSeek-V2/V3/R1, Kimi-K2): prefixattn's MLA kernel over SGLang's latent
pool, with the shared prefixes SGLang's radix cache gives.

SGLang's DeepSeek attention (``DeepseekV2AttentionMLA``) calls the backend's ``attn_mqa`` layer in the absorbed
form: ``q`` ``[T, H, kv_lora_rank + rope_dim]`` (the absorbed query, then the rotary query), ``k`` ``[T, 1, kv_lora_rank
+ rope_dim]`` (the new tokens' latent and rotary key) and ``v`` (their latent), and expects ``[T, H * kv_lora_rank]``
back (it applies ``W_UV`` itself). :class:`PrefixAttnMLABackend` writes ``k`` into the pool with the pool's own
``set_kv_buffer``, then runs :func:`prefixattn.mla_attention` on the pool's buffer viewed as ``[num_pages, page_size,
kv_lora_rank + rope_dim]`` (no copy), planned once per step like the MHA backend (same host page labels, eager and
CUDA-graph wrappers, one per layer geometry).

Every batch takes the absorbed form: for a backend it does not know, SGLang's DeepSeek code picks the up-projected
(MHA) form for an extend batch without a cached prefix, whose K/V never reach the latent pool the kernel reads; the
plugin registers a dispatch rule that picks the absorbed form for ``prefixattn`` (:func:`force_absorbed_mla`).

fp8 latent pools (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): SGLang's latent pool stores what it is given, so
the backend writes ``k / layer.k_scale`` (as SGLang's Triton backend does) and the kernel reads the latent back times
``layer.k_scale_float``. Refused when the backend is built: an MLA pool other than SGLang's plain
``MLATokenToKVPool`` (DeepSeek-V3.2's sparse pools, DCP-replicated pools) and latent or rotary widths the kernel does
not take (:func:`prefixattn.check_mla_dims`).
"""

from __future__ import annotations

from prefixattn.integrations.sglang.version import check_sglang_version

check_sglang_version()  # before touching SGLang's classes: a clear error instead of an AttributeError

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MLATokenToKVPool  # noqa: E402

import prefixattn  # noqa: E402
from prefixattn.integrations.sglang.backend import PrefixAttnBackend  # noqa: E402
from prefixattn.integrations.sglang.page_table import mla_key  # noqa: E402
from prefixattn.integrations.sglang.startup import warm_up_mla_kernels  # noqa: E402


def force_absorbed_mla(backend_name: str) -> None:
    """Make SGLang's DeepSeek attention take the absorbed (MLA) form for every batch of the attention backend
    ``backend_name`` (SGLang's ``AttentionBackendRegistry`` of DeepSeek forward methods; idempotent)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    AttentionBackendRegistry.register(backend_name, _absorbed)


def _absorbed(attn, forward_batch):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MLA


class PrefixAttnMLABackend(PrefixAttnBackend):
    """``--attention-backend prefixattn`` for an MLA model: decode, extend and mixed batches over SGLang's
    ``MLATokenToKVPool``, each step planned once (:func:`prefixattn.plan_mla`) and each layer one
    :func:`prefixattn.mla_attention`; CUDA graphs as in
    :class:`~prefixattn.integrations.sglang.backend.PrefixAttnBackend`.

    Examples
    --------
    >>> backend = PrefixAttnMLABackend(model_runner)
    >>> backend.init_forward_metadata(forward_batch)          # once per step: one plan per layer geometry
    >>> o = backend.forward(q, k, v, layer, forward_batch)     # per layer: o [T, H * kv_lora_rank]
    """

    POOL_CLASS = MLATokenToKVPool

    @staticmethod
    def _pool_kind() -> str:
        return "the MLA latent cache, [num_slots, 1, kv_lora_rank + rope_dim] buffers"

    def _check_pool(self, pool) -> None:
        super()._check_pool(pool)
        prefixattn.check_mla_dims(int(pool.kv_lora_rank), int(pool.qk_rope_head_dim))

    def _warm_up(self, model_runner, pool) -> list:
        return warm_up_mla_kernels(model_runner, pool, self._model_layers(model_runner))

    def _model_layers(self, model_runner) -> list:
        # DeepSeek layers hold two RadixAttention modules: attn_mqa (the absorbed form, one latent KV head: this
        # backend's) and attn_mha (the up-projected form, never called once force_absorbed_mla is registered).
        return [layer for layer in super()._model_layers(model_runner) if layer.tp_k_head_num == 1]

    def _layer_key(self, layer, q_dtype: torch.dtype) -> tuple:
        if layer.is_cross_attention or layer.tp_k_head_num != 1 or layer.qk_head_dim <= layer.v_head_dim:
            raise ValueError(
                f"layer {layer.layer_id}: expected SGLang's absorbed MLA attention (one latent KV head, qk_head_dim "
                f"= kv_lora_rank + rope_dim > v_head_dim = kv_lora_rank), got {layer.tp_k_head_num} KV heads, "
                f"qk_head_dim {layer.qk_head_dim}, v_head_dim {layer.v_head_dim} (an up-projected MHA call: "
                "register prefixattn's dispatch rule, force_absorbed_mla)")
        if layer.logit_cap or (layer.sliding_window_size is not None and layer.sliding_window_size > -1):
            raise ValueError(f"layer {layer.layer_id}: MLA with a soft cap or a sliding window is not supported by "
                             "prefixattn")
        return mla_key(layer.tp_q_head_num, layer.v_head_dim, layer.qk_head_dim - layer.v_head_dim, q_dtype,
                       layer.scaling)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, sinks=None):
        key = self._layer_key(layer, q.dtype)
        if sinks is not None:
            raise ValueError(f"layer {layer.layer_id}: attention sinks are not supported by prefixattn's MLA backend")
        scale = None  # the latent's dequantization scale (an fp8 pool with a checkpoint scale)
        if self.kv_dtype is not None and layer.k_scale is not None:
            scale = float(layer.k_scale_float)
            if save_kv_cache and k is not None:
                k = k / layer.k_scale  # a new tensor: the caller's k stays intact
        if save_kv_cache and k is not None:
            # The pool stores k (latent + rotary key), cast to its dtype, and ignores v, which is k's latent part.
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v)
        num_heads, width, rank = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, num_heads, width)
        o = q.new_empty((q3.shape[0], num_heads * rank))
        cache = self._paged(self.token_to_kv_pool.get_key_buffer(layer.layer_id), "key")[:, :, 0]
        p = self._plan_for(key, q3, num_blocks=cache.shape[0])
        out = o.view(-1, num_heads, rank)
        if self.forward_metadata.graph:
            # The wrapper's capacity-fixed launch over all padded rows: what the graph captures.
            self.forward_metadata.graph_state.wrapper_of(p).run(q3, cache, out=out, kv_scale=scale)
        else:
            prefixattn.mla_attention(q3, cache, p, out=out, kv_scale=scale)
        return o
