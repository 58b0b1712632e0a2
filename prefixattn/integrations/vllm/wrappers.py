"""The vLLM metadata builder's two :class:`prefixattn.PrefixSharedAttention` wrappers, one per KV cache group (and
micro-batch: vLLM gives each its own builder), each with a workspace allocated once at capacity:

* :func:`graph_wrapper` (``use_cuda_graph=True``): uniform decode steps vLLM captures or replays as full CUDA graphs;
* :func:`eager_wrapper`: every other step (prefill chunks, mixed batches, decode without graphs), planned into a
  workspace sized by vLLM's scheduler limits, so no step allocates plan tables, counters or partial-state memory.

Both read vLLM's persistent device block table in place (``max_blocks_per_request=0``). A wrapper's tables belong to
its latest plan: vLLM builds one metadata per group and step (its drafter builds with builders of its own), and a
plan used after a later one is a ``ValueError`` (``Plan.is_current``), never a read of overwritten tables.
"""

from __future__ import annotations

import torch

import prefixattn
from prefixattn.integrations.switches import overlap_enabled


def _wrapper_options(*, num_qo_heads, num_kv_heads, head_dim, block_size, q_dtype, sm_scale, device,
                     window_left: int = -1, logits_soft_cap: float = 0.0, kv_dtype=None) -> dict:
    # window and soft cap: one value per KV cache group (the builder checks its layers agree)
    return dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                q_dtype=q_dtype, kv_dtype=kv_dtype, causal=True, sm_scale=sm_scale, max_blocks_per_request=0,
                device=device, window_left=window_left, logits_soft_cap=logits_soft_cap, overlap=overlap_enabled())


def _wrapper(capacity: dict | None, options: dict) -> "prefixattn.PrefixSharedAttention | None":
    return None if capacity is None else prefixattn.PrefixSharedAttention(**_wrapper_options(**options), **capacity)


def graph_wrapper(vllm_config, **options) -> "prefixattn.PrefixSharedAttention | None":
    """The builder's CUDA-graph wrapper, or None when vLLM captures no full graphs. ``options``: the KV cache group's
    geometry (``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``block_size``, ``q_dtype``, ``sm_scale``,
    ``device``; ``window_left``, ``logits_soft_cap``, ``kv_dtype`` optional).

    Capacities from vLLM's graph settings: ``max_tokens`` = the largest capture size (vLLM pads a replayed batch to
    a capture size), as many requests (a padded request has >= 0 query rows). Tiles for the uniform decode query
    length ``1 + num_speculative_tokens`` when vLLM captures full graphs of uniform decode batches only
    (``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``); for the largest capture size when it captures mixed batches too
    (``FULL``): the graphs then launch the prefill-chunk class as well. No block-table section: every graph-safe
    step passes vLLM's persistent device table (``max_blocks_per_request=0``).
    """
    return _wrapper(graph_capacity(vllm_config), options)


def graph_capacity(vllm_config, *, mixed_graphs: bool = True) -> dict | None:
    """A CUDA-graph wrapper's capacity (``max_tokens``, ``max_requests``, ``max_q_len``, ``use_cuda_graph``) from
    vLLM's graph settings (:func:`graph_wrapper`), or None when vLLM captures no full graphs. ``mixed_graphs``: the
    backend lets vLLM's ``FULL`` mode capture mixed batches (the MLA backend does not: decode graphs only)."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    max_size = getattr(cc, "max_cudagraph_capture_size", None)
    if mode is None or not mode.has_full_cudagraphs() or not max_size:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    decode_len = 1 + int(getattr(spec, "num_speculative_tokens", None) or 0)
    if mixed_graphs and mode.mixed_mode() == type(mode).FULL:  # mixed batches replay these graphs too
        decode_len = max(decode_len, int(max_size))
    return dict(max_tokens=int(max_size), max_requests=int(max_size), max_q_len=decode_len, use_cuda_graph=True)


def eager_wrapper(vllm_config, **options) -> "prefixattn.PrefixSharedAttention | None":
    """The builder's wrapper for steps that run without a full graph, or None without scheduler limits; ``options``
    as :func:`graph_wrapper`'s.

    Capacities from vLLM's scheduler: ``max_tokens`` = ``max_num_batched_tokens`` (the most query tokens one step
    schedules), ``max_requests`` = ``max_num_seqs``; tiles follow each batch. A step beyond them (a config that lets
    vLLM schedule more) is planned with :func:`prefixattn.plan` instead (the builder counts it).

    Device memory: the partial-state workspace dominates, about ``max_tokens x (shared levels + 1) x num_qo_heads x
    head_dim x 4`` bytes (``PlanWorkspace.device_bytes``; 8192 tokens, 32 heads of 128: ~0.4 GB per KV cache group,
    FlashInfer's backends hold a fixed workspace of the same order).
    """
    return _wrapper(eager_capacity(vllm_config), options)


def eager_capacity(vllm_config) -> dict | None:
    """An eager wrapper's capacity (``max_tokens``, ``max_requests``, ``use_cuda_graph=False``) from vLLM's scheduler
    limits (:func:`eager_wrapper`), or None without them."""
    sched = getattr(vllm_config, "scheduler_config", None)
    max_tokens = getattr(sched, "max_num_batched_tokens", None)
    max_seqs = getattr(sched, "max_num_seqs", None)
    if not max_tokens or not max_seqs:
        return None
    return dict(max_tokens=int(max_tokens), max_requests=int(max_seqs), use_cuda_graph=False)


def builder_wrappers(vllm_config, geometry, *, block_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                     device) -> tuple:
    """``(graph_attn, eager_attn)`` of one metadata builder of a group with ``geometry``
    (:class:`~prefixattn.integrations.vllm.layer_geometry.GroupGeometry`); either is None when vLLM's config has no use
    for it."""
    options = dict(num_qo_heads=geometry.num_qo_heads, num_kv_heads=geometry.num_kv_heads,
                   head_dim=geometry.head_dim, block_size=block_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                   sm_scale=geometry.sm_scale, device=device, window_left=geometry.window_left,
                   logits_soft_cap=geometry.logits_soft_cap)
    return graph_wrapper(vllm_config, **options), eager_wrapper(vllm_config, **options)


def wrappers_device_bytes(wrappers: tuple) -> int:
    """Device memory the wrappers' workspaces hold."""
    return sum(w.workspace.device_bytes for w in wrappers if w is not None and w.workspace is not None)
