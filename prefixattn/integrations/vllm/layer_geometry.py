"""The geometry a metadata builder plans with, taken from the layers of its KV cache group.

vLLM makes one metadata builder per attention group (a KV cache group's layers split by backend, layer spec and
query-head count) and micro-batch, so builders differ in more than the cache spec: a speculative-decoding draft
model's layers share the target's KV cache group but get builders of their own, with their own head count. So every
value a plan depends on is read from the builder's own layers (as FlashInfer's builder does), never from the
model-wide config: query heads from the layers' impls, KV heads
and head size from the group's cache spec (and checked against the layers), softmax scale, left window and soft cap
from the layers (all of a group's layers must agree: one plan serves them all). Attention sinks are per layer and
passed by each layer's impl at its forward: no group value. A builder without registered layers (vLLM's unit-test
style construction) falls back to the model config for the query heads and to its cache spec for the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixattn.integrations.vllm.refusals import refusal


@dataclass(frozen=True)
class GroupGeometry:
    """One KV cache group's plan geometry."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    #: None: prefixattn's default ``1 / sqrt(head_dim)`` (a group without layers)
    sm_scale: float | None
    #: prefixattn's left window (vLLM's ``sliding_window=S`` is ``S - 1``), -1: off
    window_left: int
    logits_soft_cap: float


def vllm_window_left(sliding_window: int | None) -> int:
    """prefixattn's left window for vLLM's ``sliding_window``.

    Parameters
    ----------
    sliding_window : int or None
        vLLM's window: a query attends to the last ``sliding_window`` keys, its own included. None: no window.

    Returns
    -------
    int
        ``sliding_window - 1`` (the keys to the query's left), or -1 (off) for None.
    """
    return -1 if sliding_window is None else int(sliding_window) - 1


def group_layers(vllm_config, layer_names: list[str]) -> dict:
    """The group's attention layers (``name -> vLLM Attention``), from vLLM's static forward context."""
    if not layer_names:
        return {}
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(vllm_config, Attention, layer_names)


def _one_value(layers: dict, name: str, read, default):
    """The value ``read(impl)`` all of the group's layers share (``default`` without layers)."""
    values = {read(layer.impl) for layer in layers.values()}
    if len(values) > 1:
        raise refusal([f"layers sharing a KV cache group use different {name} values {sorted(values)}"])
    return values.pop() if values else default


def group_geometry(kv_cache_spec, vllm_config, layer_names: list[str]) -> GroupGeometry:
    """The plan geometry of the KV cache group ``layer_names`` with cache spec ``kv_cache_spec``.

    Raises ``ValueError`` (vLLM's refusal wording) when the group's layers disagree on a value one plan must share,
    or disagree with the group's cache spec.
    """
    layers = group_layers(vllm_config, layer_names)
    num_kv_heads = int(kv_cache_spec.num_kv_heads)
    head_dim = int(kv_cache_spec.head_size)
    if int(getattr(kv_cache_spec, "head_size_v", head_dim)) != head_dim:
        raise refusal(["different K and V head sizes not supported"])
    for what, spec_value in (("num_kv_heads", num_kv_heads), ("head_size", head_dim)):
        layer_value = _one_value(layers, what, lambda impl, a=what: int(getattr(impl, a)), spec_value)
        if layer_value != spec_value:
            raise refusal([f"the group's layers have {what}={layer_value}, its KV cache spec {spec_value}"])
    model_heads, spec_window = None, -1
    if not layers:
        model_heads = int(vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config))
        # SlidingWindowSpec carries the window, as does a FullAttentionSpec of a windowed layer (vLLM's hybrid
        # allocator off); a plan without it is refused by the windowed layers' forward.
        spec_window = vllm_window_left(getattr(kv_cache_spec, "sliding_window", None))
    num_qo_heads = _one_value(layers, "num_heads", lambda impl: int(impl.num_heads), model_heads)
    return GroupGeometry(
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        sm_scale=_one_value(layers, "softmax scale", lambda impl: float(impl.scale), None),
        window_left=_one_value(layers, "window_left", lambda impl: int(getattr(impl, "window_left", -1)),
                               spec_window),
        logits_soft_cap=_one_value(layers, "logits_soft_cap",
                                   lambda impl: float(getattr(impl, "logits_soft_cap", 0.0)), 0.0))


def group_kv_dtype(kv_cache_spec, cache_dtype: str | None, q_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the group's K/V cache holds: vLLM allocates fp8 caches as uint8 memory (the spec's dtype),
    whose fp8 flavour is the configured ``cache_dtype``; any other cache is read in q's dtype."""
    import prefixattn
    from prefixattn.integrations.vllm.refusals import fp8_cache_dtype

    if getattr(kv_cache_spec, "dtype", None) == torch.uint8:
        fp8 = fp8_cache_dtype(cache_dtype)
        if fp8 in prefixattn.FP8_KV_DTYPES:  # anything else (ROCm's e4m3fnuz) is refused at configuration
            return fp8
    return q_dtype
