"""What the SGLang backend sizes and compiles when SGLang builds it: the eager wrappers' capacities from the
scheduler's limits (:func:`eager_capacity`) and the warm-up of every kernel variant the model's layers will launch
(:func:`warm_up_kernels`); with the per-layer helpers both read (:func:`attention_layers`, :func:`kv_scales`).
"""

from __future__ import annotations

import logging

import torch

import prefixattn
from prefixattn.warmup import MAX_DISTINCT_Q_LEN, SGLANG_LAYOUT, WarmupReport, warmup_enabled

logger = logging.getLogger(__name__)


def _published_schedule():
    """SGLang's resolved scheduler settings (``runtime_context.get_schedule()``), or None outside a server."""
    try:
        from sglang.srt.runtime_context import get_schedule

        return get_schedule()
    except (ImportError, ValueError):  # ValueError: "config namespace 'schedule' not published"
        return None


def _schedule_value(model_runner, name: str):
    """A scheduler setting: the runner's ``server_args`` when it says (the operator's value), else the value SGLang
    resolved (``--chunked-prefill-size`` left unset is chosen from the GPU's memory at start-up)."""
    value = getattr(getattr(model_runner, "server_args", None), name, None)
    return value if value is not None else getattr(_published_schedule(), name, None)


def eager_capacity(model_runner, pool) -> dict | None:
    """``max_tokens``/``max_requests`` of the eager wrappers: SGLang's scheduler limits.

    A step's new tokens are at most the chunked-prefill size (mixed-chunk decodes count against it too), else
    ``max(--max-prefill-tokens, context length)`` (SGLang admits one request past the prefill budget), else the
    pool's slot count (the bound that always holds: bare runners in tests); a decode step has one per running
    request. Requests: the runner's ``max_running_requests``, else the request pool's size. Device memory: the
    partial-state workspace dominates, about ``max_tokens x 3 x num_qo_heads x head_dim x 4`` bytes per geometry
    (8192 tokens, 32 heads of 128: ~0.4 GB; SGLang's FlashInfer backends hold a 384 MB workspace).
    """
    chunk = _schedule_value(model_runner, "chunked_prefill_size")
    prefill = _schedule_value(model_runner, "max_prefill_tokens")
    context = getattr(getattr(model_runner, "model_config", None), "context_len", None) or 0
    tokens = chunk if chunk is not None and chunk > 0 else max(prefill, context) if prefill else int(pool.size)
    requests = getattr(model_runner, "max_running_requests", None) or getattr(model_runner.req_to_token_pool, "size",
                                                                             None)
    if not requests or not tokens:
        return None
    return dict(max_tokens=max(int(tokens), int(requests)), max_requests=int(requests))


def kv_scales(layer, pool) -> dict:
    """``k_scale``/``v_scale`` keywords of :func:`prefixattn.attention` for an fp8 pool with the layer's per-tensor
    scales (SGLang sets ``layer.k_scale`` from the checkpoint and its float twin ``k_scale_float``); empty when the
    pool is not fp8 or the layer has no scales (SGLang then stores and reads the plain cast: scale 1)."""
    if pool.dtype not in prefixattn.FP8_KV_DTYPES or layer.k_scale is None:
        return {}
    v_scale = layer.v_scale_float if layer.v_scale is not None else None
    return {"k_scale": float(layer.k_scale_float), "v_scale": None if v_scale is None else float(v_scale)}


def attention_layers(model_runner) -> list:
    """The model's RadixAttention layers; empty when the runner has no model (tests on a bare pool)."""
    model = getattr(model_runner, "model", None)
    if model is None or not hasattr(model, "modules"):
        return []
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model.modules() if isinstance(m, RadixAttention)]


def _layer_geometries(model_runner) -> list[tuple[int, int, int]]:
    """``(tp_q_head_num, tp_k_head_num, qk_head_dim)`` of the model's RadixAttention layers (the geometry each
    layer plans with)."""
    return sorted({(m.tp_q_head_num, m.tp_k_head_num, m.qk_head_dim) for m in attention_layers(model_runner)})


def _fp8_scale_switches(model_runner, pool) -> tuple[bool, ...]:
    """The ``HAS_KV_SCALE`` values the layers' fp8 launches will have (:func:`kv_scales`: a float ``k_scale``
    folds into the softmax scale, so only a ``v_scale != 1`` switches the scaled binary on). The checkpoint's
    scales are loaded before SGLang builds the backend."""
    switches = {kv_scales(m, pool).get("v_scale") not in (None, 1.0) for m in attention_layers(model_runner)}
    return tuple(sorted(switches)) or (False,)


def warm_up_kernels(model_runner, pool) -> list[WarmupReport]:
    """Compile every kernel variant the model's layers will launch (:func:`prefixattn.warmup_kernels`).

    The hook: SGLang builds the attention backend after loading the model and allocating the KV pool, before CUDA
    graph capture and the server's warm-up request, so no request waits for a Triton compile. The longest query
    chunk is ``--chunked-prefill-size`` (every length the tile tables tell apart when chunking is off). K/V are
    written by the pool's ``set_kv_buffer`` (SGLang's kernel), so only the attention kernel is warmed; q is a slice of
    the fused qkv projection, K and V separate pool buffers (``SGLANG_LAYOUT``). An fp8 pool warms the fp8-loading
    binaries, with and/or without ``HAS_KV_SCALE`` as the layers' scales ask (:func:`_fp8_scale_switches`). Skipped when
    ``$PREFIXATTN_WARMUP`` is 0; nothing is compiled without a GPU. A variant that fails to compile is a
    RuntimeError here, at start-up.
    """
    fp8 = pool.dtype in prefixattn.FP8_KV_DTYPES
    kv = dict(kv_dtypes=pool.dtype, fp8_kv_scales=_fp8_scale_switches(model_runner, pool)) if fp8 else {}
    return _warm_up(model_runner, pool, prefixattn.warmup_kernels, [
        dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, layout=SGLANG_LAYOUT, **kv)
        for num_qo_heads, num_kv_heads, head_dim in _layer_geometries(model_runner)])


def warm_up_mla_kernels(model_runner, pool, layers: list) -> list[WarmupReport]:
    """:func:`warm_up_kernels` for the MLA backend: the MLA kernel's variants (:func:`prefixattn.warmup_mla_kernels`)
    for the head counts of ``layers`` (its absorbed attention layers) over the latent pool. An fp8 pool is read with
    the layer's float ``k_scale`` (``HAS_KV_SCALE`` where it is not 1)."""
    fp8 = pool.dtype in prefixattn.FP8_KV_DTYPES
    switches = tuple(sorted({m.k_scale is not None and float(m.k_scale_float) != 1.0 for m in layers})) or (False,)
    kv = dict(kv_dtypes=pool.dtype, fp8_kv_scales=switches) if fp8 else {}
    return _warm_up(model_runner, pool, prefixattn.warmup_mla_kernels, [
        dict(num_heads=num_heads, kv_lora_rank=int(pool.kv_lora_rank), rope_dim=int(pool.qk_rope_head_dim), **kv)
        for num_heads in sorted({m.tp_q_head_num for m in layers})])


def _warm_up(model_runner, pool, warm, geometries: list[dict]) -> list[WarmupReport]:
    """``warm(**geometry, block_size, dtypes, max_q_len, device)`` per geometry (the pool's page size, the model's
    dtype, the chunked-prefill size), failures raised; nothing when ``$PREFIXATTN_WARMUP`` is 0."""
    if not warmup_enabled():
        return []
    chunk = _schedule_value(model_runner, "chunked_prefill_size")
    max_q_len = int(chunk) if chunk is not None and chunk > 0 else MAX_DISTINCT_Q_LEN
    device = torch.device(model_runner.device)
    # q is in the model's dtype; an fp8 pool holds K/V in fp8 (its own binaries: fp8 loads, maybe HAS_KV_SCALE).
    q_dtype = pool.dtype if pool.dtype in prefixattn.SUPPORTED_DTYPES else getattr(model_runner, "dtype", None)
    if q_dtype is None:
        return []
    reports = []
    for geometry in geometries:
        report = warm(**geometry, block_size=int(pool.page_size), dtypes=q_dtype, max_q_len=max_q_len,
                      device=device if device.type == "cuda" else None)
        if report.failed:
            raise RuntimeError("\n".join(["prefixattn: kernel warm-up failed"] + report.lines()))
        logger.info("%s", "\n".join(report.lines()))
        reports.append(report)
    return reports
