"""SGLang attention backend running prefixattn's fused prefix-shared attention over SGLang's own KV pool.

SGLang's radix cache gives requests that share a prompt prefix the *same* KV slot ids, so the leading entries of
their ``req_to_token`` rows are identical. Those rows are exactly a block table: with ``page_size`` 1 every slot is
a block of one token, with a paged pool the first slot of each page divided by ``page_size`` is the page id. Once
per forward batch (:meth:`PrefixAttnBackend.init_forward_metadata`) the backend gathers those rows on the device
(the kernels read them there; a graph step refills its graph's own table) and builds one plan per layer geometry
(into that geometry's capacity-sized wrapper: :meth:`PrefixAttnBackend._plan_eager`, or a graph wrapper for captured
steps), which finds the shared prefixes; every layer then runs :func:`prefixattn.attention` with that plan against
the pool's buffers viewed as ``[num_blocks, page_size, num_kv_heads, head_dim]`` (no copy), after writing the
layer's new K/V with the pool's own ``set_kv_buffer``.

No step synchronizes with the device: the planner reads host page labels, not the page ids. SGLang 0.5.23 keeps no
host copy of ``req_to_token`` (slot ids come from its device-side allocator), but its scheduler knows which prefix of
each row is the radix cache's and through which tree nodes; :mod:`.host_pages` labels those pages by tree node (equal
labels = equal slots) and every other page on its own, from the requests recorded when ``ForwardBatch.init_new``
built the batch, so the plan never shares pages two requests no longer share, whatever was added, finished,
preempted or reordered. A batch without that record (one SGLang's ``init_new`` did not build) has its rows copied
from the device (``backend.host_table_copies`` counts them), as have ``seq_lens``/``extend_seq_lens`` when SGLang
gives no CPU mirror of them.

Bad metadata: the page ids are read on the device only, so their range is not checked on the host (SGLang's own
allocator writes them); the labels are within the pool's page count (each plan is built with ``num_blocks``), and
every layer's :func:`prefixattn.attention` compares the plan's largest label with the pool view's page count. An
fp8 pool (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``:
SGLang stores the bytes as uint8 and ``get_key_buffer`` returns the fp8 view) is read by the kernel directly, upcast on
load, with SGLang's per-tensor scale convention (``layer.k_scale``: the pool holds ``k / k_scale``, written by
``set_kv_buffer``; the kernel multiplies by ``layer.k_scale_float``). Any other quantized pool (FP4 and the pools
with a ``quant_method``) or a float pool whose dtype is not the model's is refused when the backend is built, as is
any subclass of the plain pool (the unified-memory pool's virtual slot ids, other layouts).

This module imports sglang at import time (it subclasses SGLang's ``AttentionBackend``); the plugin imports it only
when SGLang asks for the ``prefixattn`` backend.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from prefixattn.integrations.sglang.version import check_sglang_version

check_sglang_version()  # before touching SGLang's classes: a clear error instead of an AttributeError

import torch  # noqa: E402
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool  # noqa: E402

import prefixattn  # noqa: E402
from prefixattn.integrations.sglang.host_pages import HostPages  # noqa: E402
from prefixattn.integrations.sglang.page_table import GraphState, free_plan, make_wrapper  # noqa: E402
from prefixattn.integrations.sglang.startup import (attention_layers, eager_capacity, kv_scales,  # noqa: E402
                                                     warm_up_kernels)

logger = logging.getLogger(__name__)

#: Environment variable that forces the planner's sharing mode ("auto" applies prefixattn's cost rule, "always"
#: shares every prefix two requests have in common, "never" runs plain paged attention); for experiments.
SHARING_ENV = "PREFIXATTN_SGLANG_SHARING"

#: Breakable prefill graphs with captured attention metadata (SGLang's opt-in
#: ``use_captured_forward_metadata_for_breakable_cuda_graph``, off here as in its own FlashInfer/Triton backends)
#: would call hooks this backend does not implement; its breakable graphs run attention eagerly without them.
_NO_CAPTURED_BREAKABLE_METADATA = (
    "the prefixattn backend does not keep captured attention metadata across breakable prefill graph segments; "
    "attention runs eagerly between them (SGLang's default), or is captured whole under "
    "--cuda-graph-backend-prefill full"
)
#: Padded requests of a replayed decode graph get this seq_len (SGLang fills its padded ``seq_lens`` with it); the
#: backend plans them with no query rows, so it only has to be a valid KV length.
CUDA_GRAPH_SEQ_LEN_FILL = 1


@dataclass
class StepMetadata:
    """Host-side metadata of one forward batch, and the plans built from it (one per layer geometry).

    Attributes
    ----------
    qo_indptr : Tensor, ``[batch_size + 1]``, int64, CPU
    kv_lens : Tensor, ``[batch_size]``, int64, CPU
        SGLang's ``seq_lens``: cached prefix + this step's new tokens.
    block_table : Tensor, ``[batch_size, max_blocks]``, CPU, int32
        What the planner reads: page labels, equal where two requests share a page through the radix cache
        (:mod:`.host_pages`), or a copy of the page ids in ``req_to_token``. The kernels never read it.
    plans : dict
        Layer geometry (:func:`plan_key`, or :func:`~prefixattn.integrations.sglang.page_table.mla_key`) ->
        ``prefixattn.Plan``. A model whose layers all have one geometry (every dense model) plans once per step.
    """

    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    plans: dict = field(default_factory=dict)
    #: ``[batch_size, >= max_blocks]`` int32 on the pool's device: the page ids, gathered from ``req_to_token`` on the
    #: device; the eager wrappers' kernels read it in place (None in a graph step: the graph's own table).
    device_block_table: torch.Tensor | None = None
    #: A step SGLang captures or replays as a CUDA graph (``init_forward_metadata_out_graph``): the graph kind's state
    #: (decode: :meth:`PrefixAttnBackend.init_cuda_graph_state`; "full" prefill graphs: made at their first capture)
    #: whose wrappers its plans go into. None: an eager step.
    graph_state: GraphState | None = None
    #: Rows of the ``q`` a graph step's forward gets: its captured size (padded request slots in a decode graph, the
    #: token bucket in a prefill graph).
    graph_num_tokens: int | None = None
    #: Where ``block_table`` came from: "radix_cache" (:mod:`.host_pages`' labels) or "device_copy".
    route: str = "device_copy"

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def graph(self) -> bool:
        return self.graph_state is not None


class PrefixAttnBackend(AttentionBackend):
    """``--attention-backend prefixattn``: decode, extend (chunked prefill) and mixed batches on SGLang's MHA pool.

    Parameters
    ----------
    model_runner : sglang ModelRunner (or any object with ``device``, ``req_to_token_pool``, ``token_to_kv_pool``)
    sharing : {"auto", "always", "never"}, optional
        Passed to :func:`prefixattn.plan`; default from ``$PREFIXATTN_SGLANG_SHARING``, else "auto".

    CUDA graphs: decode graphs are captured and replayed (:meth:`init_cuda_graph_state`,
    :meth:`init_forward_metadata_out_graph`, :meth:`init_forward_metadata_in_graph`), and so are extend and mixed
    batches under SGLang's "full" prefill graphs (``--cuda-graph-backend-prefill full``:
    :meth:`init_forward_metadata_out_graph` alone); under its default "breakable" prefill graphs attention runs
    eagerly between the captured segments.

    Not supported (each raises ``ValueError`` or ``NotImplementedError`` naming the feature): the breakable graphs'
    captured attention metadata (an opt-in SGLang's FlashInfer and Triton backends do not take either), speculative
    decoding (target verify / draft extend), encoder-decoder and cross attention, chunked attention, hybrid/SWA
    pools (MLA models: :class:`~prefixattn.integrations.sglang.mla_backend.PrefixAttnMLABackend`), quantized KV
    pools other than fp8 e4m3/e5m2 (FP4, ROCm's e4m3fnuz), ``qk_head_dim != v_head_dim``. fp8 e4m3/e5m2 pools with
    per-tensor scales (``layer.k_scale``/``v_scale``), sliding windows (``layer.sliding_window_size``, FlashInfer's
    ``window_left``) on the standard pool (``--disable-hybrid-swa-memory``), logit soft-capping (``layer.logit_cap``)
    and attention sinks (the ``sinks`` keyword of the forward calls) run in the kernel.

    Examples
    --------
    >>> backend = PrefixAttnBackend(model_runner)
    >>> backend.init_forward_metadata(forward_batch)            # once per step: one prefixattn.plan
    >>> o = backend.forward(q, k, v, layer, forward_batch)       # per layer: one fused kernel launch
    """

    def __init__(self, model_runner, *, sharing: str | None = None):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        self._check_pool(pool)
        _check_pool_dtype(pool, getattr(model_runner, "dtype", None))
        # An fp8 pool's KV is 1 byte per element: the planner's cost rule prices it at that size (None: q's dtype).
        self.kv_dtype = pool.dtype if pool.dtype in prefixattn.FP8_KV_DTYPES else None
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout != "nhd":
            raise ValueError(f"token_to_kv_pool: expected the token-major 'nhd' KV layout, got {layout!r} "
                             "(unset SGLANG_USE_HND_KVCACHE)")
        # Sliding windows run per layer (layer.sliding_window_size is FlashInfer's window_left, as SGLang's own
        # backends read it); chunked attention (Llama 4), which SGLang also reports as a window size, does not.
        chunk = getattr(getattr(model_runner, "model_config", None), "attention_chunk_size", None)
        if chunk is not None:
            raise ValueError(f"attention_chunk_size: expected None (prefixattn has no chunked attention), got {chunk}")
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = pool
        self.page_size = int(pool.page_size)
        self.num_pages = (int(pool.size) + self.page_size) // self.page_size  # the buffers' rows: size + page_size
        self.sharing = sharing if sharing is not None else os.environ.get(SHARING_ENV, "auto")
        self.forward_metadata: StepMetadata | None = None
        self.warmup_report = self._warm_up(model_runner, pool)
        self._graph: GraphState | None = None  # init_cuda_graph_state
        self._prefill_graph: GraphState | None = None  # the first "full" prefill graph capture
        #: Eager steps (extend, mixed, decode without a graph) plan into one capacity-sized wrapper per layer geometry:
        #: ``max_tokens``/``max_requests`` from the runner (:func:`eager_capacity`). Allocated here, at start-up, for
        #: the model's layers (a geometry first seen at a step gets its wrapper then).
        self.eager_capacity = eager_capacity(model_runner, pool)
        self.eager_wrappers: dict = {}
        self._allocate_eager_wrappers(model_runner)
        #: Eager steps beyond that capacity, planned with a per-step prefixattn.plan() instead.
        self.capacity_fallbacks = 0
        self.host_pages = HostPages()
        #: Steps whose host table was copied from the device (no radix-cache record of the batch: a synchronization).
        self.host_table_copies = 0

    #: The pool class the backend reads (exactly it: its subclasses change what req_to_token holds or the layout).
    POOL_CLASS = MHATokenToKVPool

    def _check_pool(self, pool) -> None:
        if not isinstance(pool, self.POOL_CLASS):
            raise ValueError(
                f"token_to_kv_pool: expected SGLang's {self.POOL_CLASS.__name__} ({self._pool_kind()}), got "
                f"{type(pool).__name__}; hybrid and sliding-window pools are not supported by prefixattn"
            )
        if type(pool) is not self.POOL_CLASS:
            # The unified-memory pool (--enable-unified-memory) stores virtual slot ids that SGLang's own backends
            # translate (mem_cache/kv_index_translator.py) before reading, which prefixattn would read as pages.
            raise ValueError(
                f"token_to_kv_pool: expected SGLang's plain {self.POOL_CLASS.__name__} (physical slot ids in "
                f"req_to_token, {self._pool_kind()}), got its subclass {type(pool).__name__}; prefixattn does not "
                "translate virtual slot ids or other layouts (start SGLang without --enable-unified-memory, or with "
                "another attention backend)"
            )

    @staticmethod
    def _pool_kind() -> str:
        return "standard multi-head KV cache, [num_slots, num_kv_heads, head_dim] buffers"

    def _warm_up(self, model_runner, pool) -> list:
        return warm_up_kernels(model_runner, pool)

    def _model_layers(self, model_runner) -> list:
        """The model's layers this backend runs (their geometries get eager wrappers at start-up)."""
        return attention_layers(model_runner)

    def _layer_key(self, layer, q_dtype: torch.dtype) -> tuple:
        """A layer's plan geometry, after refusing what it has that the kernel does not run."""
        return plan_key(layer, q_dtype, _check_layer(layer))

    def _allocate_eager_wrappers(self, model_runner) -> None:
        """The eager wrappers of the model's layer geometries, now: an out-of-memory is a start-up error naming the
        capacity (with ``--chunked-prefill-size -1`` it is the context length), not one at the first request."""
        if self.eager_capacity is None:
            return
        q_dtype = getattr(model_runner, "dtype", None)
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # q's device, as steps key it
        for layer in self._model_layers(model_runner) if q_dtype is not None else []:
            key = self._layer_key(layer, q_dtype)
            if key in self.eager_wrappers:
                continue
            try:
                self.eager_wrappers[key] = self._eager_wrapper(key, device)
            except torch.OutOfMemoryError as err:
                raise RuntimeError(
                    f"prefixattn: the eager attention workspace for {self.eager_capacity['max_tokens']} tokens (layer "
                    f"geometry {key[:3]}) does not fit in the memory SGLang left after its KV pool; lower "
                    "--chunked-prefill-size (or set it, when it is -1) or raise the memory left outside "
                    "--mem-fraction-static") from err

    def _eager_wrapper(self, key, device) -> "prefixattn.PrefixSharedAttention":
        return make_wrapper(key, block_size=self.page_size, sharing=self.sharing, kv_dtype=self.kv_dtype,
                            **self.eager_capacity, max_blocks_per_request=0, device=device)

    # ------------------------------------------------------------------------------------------------------------
    # Per step (host)
    # ------------------------------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        """Build this batch's host metadata (qo_indptr, kv_lens, page labels); plans are made from it per geometry.

        No device->host copy when SGLang built the batch (``seq_lens_cpu``, ``extend_seq_lens_cpu`` and the radix
        cache's page labels are host data); without those mirrors or that record it copies them from the device.
        """
        self._init_metadata(forward_batch)

    def _init_metadata(self, forward_batch, *, graph_state: GraphState | None = None, capture: bool = False,
                       graph_num_tokens: int | None = None) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        _check_batch_kind(forward_batch)
        bs = int(forward_batch.batch_size)
        kv_lens = _host_int64(forward_batch.seq_lens_cpu, forward_batch.seq_lens)[:bs]
        if mode.is_decode():
            q_lens = torch.ones(bs, dtype=torch.int64)
        elif mode.is_extend():
            q_lens = _host_int64(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)[:bs]
        else:
            raise NotImplementedError(f"forward_mode: {mode.name} is not supported by the prefixattn backend")
        live = None  # requests before the padding slots: bs - num_padding (host_pages)
        if graph_state is not None and q_lens.shape[0] < bs:
            # A prefill graph's slot-padded view: SGLang's host mirror lists the live requests only, the sentinel
            # slots after them compute nothing (their seq_lens are 0).
            live = q_lens.shape[0]
            q_lens = torch.cat([q_lens, q_lens.new_zeros(bs - live)])
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        torch.cumsum(q_lens, dim=0, out=qo_indptr[1:])
        meta = self._step_metadata(forward_batch, bs, qo_indptr, kv_lens, graph=graph_state is not None,
                                   capture=capture, live=live)
        meta.graph_state, meta.graph_num_tokens = graph_state, graph_num_tokens
        self.forward_metadata = meta

    def _step_metadata(self, forward_batch, bs: int, qo_indptr, kv_lens, *, graph: bool, capture: bool,
                       live: int | None = None) -> StepMetadata:
        """The step's tables: host page labels from the radix cache (:mod:`.host_pages`), else a copy of the device
        rows; the device rows gathered for an eager step (a graph step refills its own table). A graph capture plans
        its placeholder batch with nothing shared (every replay plans its own batch)."""
        width = -(-int(kv_lens.max()) // self.page_size) if bs else 0
        labels = self.host_pages.labels(forward_batch, bs=bs, kv_lens=kv_lens.numpy(), page_size=self.page_size,
                                        width=max(width, 1), num_pages=self.num_pages, unshared=capture, live=live)
        device_table = None
        if labels is None or not graph:
            # Slot ids of the first token of each page; page id = slot // page_size (page_size 1: the slot itself).
            rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices[:bs], :max(width, 1)
                                                       * self.page_size]
            device_table = rows  # a gather: a new contiguous tensor
            if self.page_size > 1:
                device_table = torch.div(rows[:, :: self.page_size], self.page_size, rounding_mode="floor")
        if labels is not None:
            host_table, route = torch.from_numpy(labels), "radix_cache"
        else:
            self.host_table_copies += 1
            if self.host_table_copies == 1:
                logger.warning("prefixattn: no radix-cache record of this batch's requests (a batch SGLang's "
                               "ForwardBatch.init_new did not build, or a cache without a tree): copying its "
                               "req_to_token rows from the device, which waits for the work queued before it "
                               "(backend.host_table_copies counts them)")
            # its own dtype: the planner reads int32 (on a CPU pool the table itself, no copy)
            host_table, route = device_table.to("cpu"), "device_copy"
        return StepMetadata(qo_indptr=qo_indptr, kv_lens=kv_lens, block_table=host_table,
                            device_block_table=device_table, route=route)

    def _plan_for(self, key: tuple, q: torch.Tensor, num_blocks: int):
        """The step's plan for the layer geometry ``key`` (:meth:`_layer_key`), made at its first layer."""
        meta = self.forward_metadata
        if meta is None:
            raise ValueError("forward_batch: expected init_forward_metadata() to run before the layers of this batch, "
                             "got no metadata (or an IDLE batch)")
        p = meta.plans.get(key)
        if p is None and meta.graph:
            p = meta.graph_state.plan_new_geometry(key, meta, device=q.device)
        if p is None:
            p = meta.plans[key] = self._plan_eager(key, meta, q.device, num_blocks)
        return p

    def _plan_eager(self, key, meta: StepMetadata, device, num_blocks: int):
        """An eager step's plan for one layer geometry: into that geometry's capacity-sized wrapper (no device
        allocation; the step's device block table read in place), or a per-step plan() beyond its capacity."""
        # q's own device: the runner's "cuda" has no index, the plan must match q's "cuda:N".
        if self.eager_capacity is not None:
            attn = self.eager_wrappers.get(key)
            if attn is None:  # a geometry the model's layers did not show at start-up: at its first eager step
                attn = self.eager_wrappers[key] = self._eager_wrapper(key, device)
            try:
                return attn.plan(meta.qo_indptr, meta.kv_lens, meta.block_table,
                                 device_block_table=meta.device_block_table, num_blocks=num_blocks)
            except prefixattn.CapacityError as err:
                self.capacity_fallbacks += 1
                if self.capacity_fallbacks == 1:  # once: a server that exceeds it does so often
                    logger.warning("prefixattn: a step beyond the eager workspace (%s) is planned with a per-step "
                                   "prefixattn.plan() (backend.capacity_fallbacks counts them)", err)
        return free_plan(key, meta.qo_indptr, meta.kv_lens, meta.block_table, block_size=self.page_size,
                         sharing=self.sharing, kv_dtype=self.kv_dtype, device=device, num_blocks=num_blocks)

    # ------------------------------------------------------------------------------------------------------------
    # Per layer (device, no host synchronization)
    # ------------------------------------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, sinks=kwargs.get("sinks"))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, sinks=kwargs.get("sinks"))

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, sinks=None):
        key = self._layer_key(layer, q.dtype)
        scales = kv_scales(layer, self.token_to_kv_pool)
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc.for_batch(forward_batch)
            if scales:
                # The pool quantizes as x / scale in place (set_kv_buffer's div_): clones keep the caller's k, v
                # intact, as SGLang's Triton backend does.
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k.clone(), v.clone(), layer.k_scale, layer.v_scale)
            else:
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        num_heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, num_heads, head_dim)
        o = q.new_empty((q3.shape[0], num_heads * layer.v_head_dim))
        k_cache = self._paged(self.token_to_kv_pool.get_key_buffer(layer.layer_id), "key")
        v_cache = self._paged(self.token_to_kv_pool.get_value_buffer(layer.layer_id), "value")
        p = self._plan_for(key, q3, num_blocks=k_cache.shape[0])
        if self.forward_metadata.graph:
            # The wrapper's capacity-fixed launch over all padded rows: what the graph captures.
            self.forward_metadata.graph_state.run(p, q3, k_cache, v_cache, out=o.view(-1, num_heads, head_dim),
                                                  sinks=sinks, **scales)
            return o
        prefixattn.attention(q3, k_cache, v_cache, p, out=o.view(-1, num_heads, head_dim), sinks=sinks, **scales)
        return o

    def _paged(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """``[num_slots, num_kv_heads, head_dim]`` pool buffer -> ``[num_pages, page_size, ...]`` view (no copy)."""
        if buf.dim() != 3 or buf.shape[0] % self.page_size:
            raise ValueError(
                f"token_to_kv_pool {name} buffer: expected [num_slots, num_kv_heads, head_dim] with num_slots a "
                f"multiple of page_size={self.page_size}, got shape {tuple(buf.shape)}"
            )
        return buf.unflatten(0, (-1, self.page_size))

    # ------------------------------------------------------------------------------------------------------------
    # CUDA graphs: decode (SGLang's out-graph / in-graph protocol) and "full" prefill graphs (out-graph only)
    # ------------------------------------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Capacities of every graph SGLang will capture (largest batch and token count) and the static device block
        table that :meth:`init_forward_metadata_in_graph` refills inside the graph."""
        self._graph = self._graph_state(int(max_bs), int(max_num_tokens))

    def _graph_state(self, max_bs: int, max_num_tokens: int, max_q_len: int = 1) -> GraphState:
        """A graph kind's state at these capacities, its page table as wide as a ``req_to_token`` row."""
        pages = -(-int(self.req_to_token_pool.req_to_token.shape[1]) // self.page_size)
        return GraphState(max_bs=max_bs, max_num_tokens=max_num_tokens, max_pages=pages, page_size=self.page_size,
                          sharing=self.sharing, device=self.device, kv_dtype=self.kv_dtype, max_q_len=max_q_len)

    def get_cuda_graph_seq_len_fill_value(self):
        return CUDA_GRAPH_SEQ_LEN_FILL

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Host side of a captured / replayed step, before ``graph.capture()`` or ``graph.replay()``: the batch's host
        metadata planned into every graph wrapper of its kind (one per layer geometry; the first capture's warm-up
        run creates them). Decode: padded requests (SGLang's ``num_padding``) get no query rows. Extend / mixed
        (SGLang's "full" prefill graphs): :meth:`_prefill_graph_step`."""
        if not forward_batch.forward_mode.is_decode():
            self._prefill_graph_step(forward_batch, in_capture)
            return
        if self._graph is None:
            raise ValueError("init_cuda_graph_state: expected it to run before a CUDA-graph step (SGLang's graph "
                             "runner calls it first), got no graph state")
        bs = int(forward_batch.batch_size)
        self._init_metadata(forward_batch, graph_state=self._graph, capture=in_capture, graph_num_tokens=bs)
        meta = self.forward_metadata
        num_padding = int(getattr(forward_batch, "num_padding", 0) or 0)
        if num_padding:
            q_lens = torch.ones(meta.kv_lens.shape[0], dtype=torch.int64)
            q_lens[q_lens.shape[0] - num_padding:] = 0
            meta.qo_indptr = torch.zeros_like(meta.qo_indptr)
            torch.cumsum(q_lens, dim=0, out=meta.qo_indptr[1:])
        self._graph.plan_all(meta)

    def _prefill_graph_step(self, forward_batch, in_capture: bool) -> None:
        """An extend or mixed step of SGLang's "full" prefill graphs (its ``PrefillCudaGraphRunner``).

        The runner captures each token bucket (largest first) as a batch of ``batch_size`` request slots: live
        requests, then zero-length sentinels; a replay hands a slot-padded view of the live batch whose ``input_ids``
        is the bucket, and calls no in-graph hook. So the first capture sizes this kind's wrappers (its bucket and
        slots: the largest; tiles for a query that long), and the static page table is refilled here, outside the
        graph, on the stream the replay follows. Sharing is planned per replay as in a decode graph; a step beyond
        the captured grids is re-planned without sharing (:meth:`prefixattn.PrefixSharedAttention.plan`).
        """
        _check_batch_kind(forward_batch)  # before the first capture sizes anything
        if forward_batch.input_ids is None:
            raise ValueError("forward_batch.input_ids: expected the prefill graph's token bucket (its length is the "
                             "captured q's rows), got None")
        num_tokens, bs = int(forward_batch.input_ids.shape[0]), int(forward_batch.batch_size)
        state = self._prefill_graph
        if state is None:
            if not in_capture:
                raise ValueError("init_forward_metadata_out_graph: expected a prefill graph's capture "
                                 "(in_capture=True) before its replays, got a replay with no prefill graph captured")
            state = self._prefill_graph = self._graph_state(bs, num_tokens, max_q_len=num_tokens)
        if num_tokens > state.max_num_tokens or bs > state.max_bs:
            raise ValueError(f"forward_batch: expected a prefill graph of at most {state.max_num_tokens} tokens and "
                             f"{state.max_bs} request slots (the first capture's: SGLang captures the largest bucket "
                             f"first), got {num_tokens} tokens and {bs} slots")
        self._init_metadata(forward_batch, graph_state=state, capture=in_capture, graph_num_tokens=num_tokens)
        state.fill_table(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                         bs)
        state.plan_all(self.forward_metadata)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Inside the graph: refill the static block table from ``req_to_token`` for the batch's (padded) request
        slots, each its used pages - one launch fixed by the batch size, no host work, so the replay refreshes it."""
        if self._graph is not None and forward_batch.forward_mode.is_decode():
            self._graph.fill_table(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                   forward_batch.seq_lens, int(forward_batch.batch_size))

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch):
        raise NotImplementedError(_NO_CAPTURED_BREAKABLE_METADATA)

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, capture_metadata, forward_batch, *,
                                                                 static_forward_batch=None):
        raise NotImplementedError(_NO_CAPTURED_BREAKABLE_METADATA)


def plan_key(layer, q_dtype: torch.dtype, causal: bool) -> tuple:
    """A layer's plan geometry: ``(heads, KV heads, head size, q dtype, scale, causal, soft cap, window)``; layers
    with one key share one plan per step."""
    window = layer.sliding_window_size if layer.sliding_window_size is not None else -1
    return (layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, q_dtype, float(layer.scaling), causal,
            float(layer.logit_cap or 0.0), window)


def _check_pool_dtype(pool, model_dtype: torch.dtype | None) -> None:
    """Refuse, when the backend is built, a KV pool the kernel cannot read: K/V in the dtype of q, or fp8 e4m3/e5m2
    (upcast on load)."""
    pool_dtype = pool.dtype
    if getattr(pool, "is_quantized_kv_cache", False):
        # SGLang's FP4 pools (a quant_method with its own scale buffers and dequantizing reads).
        raise ValueError(f"token_to_kv_pool: expected a float16/bfloat16/float32 or fp8 e4m3/e5m2 KV cache "
                         f"(prefixattn has no block-scaled KV), got a quantized {_dtype_name(pool_dtype)} pool")
    if pool_dtype in prefixattn.FP8_KV_DTYPES:
        return
    if pool_dtype not in prefixattn.SUPPORTED_DTYPES:
        raise ValueError(f"token_to_kv_pool: expected a float16/bfloat16/float32 or fp8 (float8_e4m3fn/float8_e5m2) "
                         f"KV cache, got {_dtype_name(pool_dtype)}")
    if model_dtype is not None and pool_dtype != model_dtype:
        raise ValueError(f"kv_cache_dtype: expected the model dtype {_dtype_name(model_dtype)} or fp8 (prefixattn "
                         f"reads a float K/V cache in the dtype of q; use --kv-cache-dtype auto, fp8_e4m3 or "
                         f"fp8_e5m2), got {_dtype_name(pool_dtype)}")


def _check_batch_kind(forward_batch) -> None:
    """Refuse batches of a kind the backend does not run (speculative decoding, dLLM, encoder-decoder)."""
    mode = forward_batch.forward_mode
    if mode.is_target_verify() or mode.is_draft_extend_v2() or mode.is_dllm_extend() \
            or forward_batch.spec_info is not None:
        raise NotImplementedError(
            f"forward_mode: the prefixattn backend supports DECODE, EXTEND and MIXED batches, got {mode.name} "
            "(speculative decoding and dLLM are not supported)"
        )
    if forward_batch.encoder_lens is not None:
        raise NotImplementedError("encoder_lens: encoder-decoder models are not supported by the prefixattn "
                                  "backend")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _host_int64(cpu_mirror, device_tensor) -> torch.Tensor:
    """SGLang's CPU mirror of a length tensor when it has one (no device sync), else a copy of the device tensor."""
    src = cpu_mirror if cpu_mirror is not None else device_tensor
    return torch.as_tensor(src).to("cpu", torch.int64)


def _check_layer(layer) -> bool:
    """Refuse layer features prefixattn does not implement; returns ``causal`` for the layer."""
    if layer.is_cross_attention:
        raise NotImplementedError(f"layer {layer.layer_id}: cross attention is not supported by the prefixattn backend")
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    window = layer.sliding_window_size
    if window is not None and window > -1 and not causal:
        raise ValueError(f"layer {layer.layer_id} sliding_window_size: expected -1 or None for a non-causal layer "
                         f"(prefixattn's windows are causal), got {window}")
    if layer.qk_head_dim != layer.v_head_dim:
        raise ValueError(f"layer {layer.layer_id} v_head_dim: expected qk_head_dim={layer.qk_head_dim}, "
                         f"got {layer.v_head_dim}")
    return causal

