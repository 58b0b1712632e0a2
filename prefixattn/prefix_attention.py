"""attention(): run a :class:`~prefixattn.planner.plans.Plan` - one launch of the fused prefix-shared attention kernel
per work class of the step (shared nodes, prefill-chunk tiles, decode tiles), merged in-kernel."""

from __future__ import annotations

import functools
import math

import torch

from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_DECODE, CLASS_SHARED, WORK_CLASSES, page_size_constexpr
from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel
from prefixattn.autotune.builds import HOPPER
from prefixattn.autotune.config_space import MODEL_SWITCHES, block_d
from prefixattn.autotune.lookup import read_fixed_env
from prefixattn.launcher import (PreparedLaunch, call_key, chained_by_pdl, class_launches, own_l2_fences, prepared,
                                 remember_launch, with_hopper)
from prefixattn.planner.backend import backend as planner_backend
from prefixattn.planner.device_tables import CapacityError
from prefixattn.planner.options import _default_num_sms, _positive_int, checked_options
from prefixattn.planner.plans import OPTION_DEFAULTS, Plan, plan, plan_with_options
from prefixattn.planner.tiles import choose_tiles, fit_kv_heads, tile_head_dim
from prefixattn.planner.workspace import DEFAULT_MAX_SHARED_LEVELS, PlanWorkspace, class_grid_items, derive_capacity
from prefixattn.runtime import device_one
from prefixattn.validation import (FP8_KV_DTYPES, canonical_device, check_fp8_support, check_head_dim, check_heads,
                                   check_kernel_device, check_kv_scale, check_qkv, check_sinks, check_tensor,
                                   same_device, torch_dtype_name)

_LOG2E = 1.0 / math.log(2.0)


def _feature_args(p: Plan, q: torch.Tensor, sinks, k_scale, v_scale) -> dict:
    """Kernel arguments of the features (soft cap, window, sinks, KV scales) for one launch: scalars, pointers and
    their constexpr switches.

    Float scales fold into the scalars (``k_scale`` into ``qk_scale``); tensor scales are read by pointer in the
    kernel (CUDA-graph safe, no host synchronization). A soft cap acts on the natural-log logit, so ``qk_scale`` is
    ``sm_scale / c`` and the kernel multiplies ``tanh`` by ``c * log2(e)``.
    """
    check_sinks(sinks, p.num_qo_heads, q.device)
    k_scale = check_kv_scale("k_scale", k_scale, q.device)
    v_scale = check_kv_scale("v_scale", v_scale, q.device)
    k_tensor, v_tensor = isinstance(k_scale, torch.Tensor), isinstance(v_scale, torch.Tensor)
    has_kv_scale = k_tensor or v_tensor or v_scale != 1.0
    cap = p.logits_soft_cap
    qk_scale = (p.sm_scale / cap if cap else p.sm_scale * _LOG2E) * (1.0 if k_tensor else k_scale)
    placeholder = p.ws_lse  # any fp32 tensor: pointers behind a switch that is off are never read
    return dict(
        sinks_ptr=sinks if sinks is not None else placeholder,
        k_scale_ptr=k_scale if k_tensor else (device_one(q.device) if has_kv_scale else placeholder),
        v_scale_ptr=v_scale if v_tensor else (device_one(q.device) if has_kv_scale else placeholder),
        qk_scale=qk_scale, soft_cap_log2=cap * _LOG2E, window_left=p.window_left,
        v_scale=1.0 if v_tensor else v_scale,
        HAS_SOFT_CAP=cap > 0, HAS_WINDOW=p.window_left >= 0, HAS_SINKS=sinks is not None, HAS_KV_SCALE=has_kv_scale,
    )


def check_plan_current(p: Plan) -> None:
    """``p`` is the latest plan of its workspace (a later plan() overwrites the tables it reads)."""
    if not p.is_current():
        raise ValueError(f"plan: expected the latest plan of its workspace (step {p.workspace.step}), got the plan of "
                         f"step {p.workspace_step}: a later plan() overwrote its tables")


def _check_against_plan(q, k_cache, v_cache, p: Plan, out, return_lse) -> None:
    """Shapes, dtypes and devices only: no value of any tensor is read (no host synchronization).

    The block ids were checked by plan() on the host; here the largest one the plan reads (an int the plan keeps)
    is compared with the cache's ``shape[0]``: a cache too small for the plan is refused before the launch instead
    of being read out of bounds. Cost: two int comparisons per call (v_cache's blocks are k_cache's: check_qkv).
    """
    if not isinstance(p, Plan):
        raise ValueError(f"plan: expected a prefixattn Plan (from prefixattn.plan), got {type(p).__name__}")
    check_plan_current(p)
    if p.rope_dim:
        raise ValueError("plan: expected a plan from prefixattn.plan, got an MLA plan (prefixattn.plan_mla): run it "
                         "with prefixattn.mla_attention")
    num_qo_heads, num_kv_heads, head_dim, block_size = check_qkv(q, k_cache, v_cache)
    check_kernel_device("q", q)
    for name, got, want in (("num_qo_heads (q dim 1)", num_qo_heads, p.num_qo_heads),
                            ("num_kv_heads (k_cache dim 2)", num_kv_heads, p.num_kv_heads),
                            ("head_dim (q dim 2)", head_dim, p.head_dim),
                            ("v_head_dim (v_cache dim 3)", v_cache.shape[3], p.v_head_dim),
                            ("block_size (k_cache dim 1)", block_size, p.block_size)):
        if got != want:
            raise ValueError(f"{name}: expected {want} (from the plan), got {got}")
    if q.dtype != p.q_dtype:
        raise ValueError(f"q: expected dtype {torch_dtype_name(p.q_dtype)} (the plan's q_dtype), got "
                         f"{torch_dtype_name(q.dtype)}")
    if q.shape[0] < p.num_tokens:
        raise ValueError(f"q: expected at least {p.num_tokens} rows (qo_indptr[-1] of the plan), got {q.shape[0]}")
    if not same_device(q.device, p.device):
        raise ValueError(f"q: expected device {p.device} (the plan's device), got {q.device}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.shape[0] <= p.max_block_id:
            raise ValueError(f"{name}: expected more than {p.max_block_id} blocks in dim 0 (the plan reads block id "
                             f"{p.max_block_id}), got {cache.shape[0]}")
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,))
        if tuple(out.shape) != _out_shape(q, p):
            raise ValueError(f"out: expected shape {_out_shape(q, p)} (q's, with the plan's v_head_dim), got "
                             f"{tuple(out.shape)}")
        if not same_device(out.device, q.device):
            raise ValueError(f"out: expected device {q.device}, got {out.device}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {type(return_lse).__name__}")


def _out_shape(q: torch.Tensor, p: Plan) -> tuple:
    """The output's shape: q's rows and heads, V's head size."""
    return (q.shape[0], q.shape[1], p.v_head_dim)


def _new_out(q: torch.Tensor, p: Plan) -> torch.Tensor:
    return torch.empty_like(q) if p.v_head_dim == p.head_dim else q.new_empty(_out_shape(q, p))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Plan, *,
              out: torch.Tensor | None = None, return_lse: bool = False, sinks: torch.Tensor | None = None,
              k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None):
    """Prefix-shared paged attention for one layer: one kernel launch per work class of the plan
    (:attr:`~prefixattn.planner.plans.Plan.work_classes`), no host synchronization.

    Same conventions as :func:`prefixattn.reference_attention`; the metadata (``qo_indptr``, ``kv_lens``,
    ``block_table``, ``causal``, ``sm_scale``, ``logits_soft_cap``, ``window_left``) come from ``plan``.

    Parameters
    ----------
    q : Tensor, ``[num_tokens, num_qo_heads, head_dim]``, fp16/bf16/fp32, any strides
        ``num_tokens >= qo_indptr[-1]``; rows past ``qo_indptr[-1]`` (CUDA-graph padding) are neither read nor
        written.
    k_cache, v_cache : Tensor, ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides
        (v_cache ``[..., v_head_dim]`` with a plan's ``v_head_dim``), dtype of q, or fp8
        (``float8_e4m3fn``/``float8_e5m2``, both caches the same): upcast on load, dequantized with
        ``k_scale``/``v_scale``, fp32 accumulation.
    plan : Plan
        From :func:`prefixattn.plan` for this step; one plan serves every layer, one launch at a time (the plan owns
        the workspace and merge counters).
    out : Tensor, optional, ``[num_tokens, num_qo_heads, v_head_dim]``, dtype of q, any strides
        Written in place (only its valid rows are touched; its old contents are never read).
    return_lse : bool
        Also return the fp32 natural-log LSE ``[num_tokens, num_qo_heads]``.
    sinks : Tensor, ``[num_qo_heads]``, fp32/bf16/fp16, contiguous, optional
        Attention sinks (gpt-oss): one logit per query head that joins each row's softmax denominator exactly once
        (at the row's final state, never per partial). The returned LSE includes it (the LSE of the full
        denominator), so a row with no visible KV returns ``(0, sink)``; such an LSE must not be merged with other
        partial states of the same row (the sink would count twice).
    k_scale, v_scale : float or Tensor ``[1]`` fp32, optional
        Per-tensor dequantization scales (vLLM's ``layer._k_scale``/``_v_scale``): keys are ``k_cache * k_scale``,
        values ``v_cache * v_scale``. A tensor is read by pointer in the kernel (CUDA-graph safe). Default 1.

    Returns
    -------
    out : Tensor, ``[num_tokens, num_qo_heads, v_head_dim]`` in q's dtype (``v_head_dim``: the plan's, by default
        ``head_dim``; and ``lse`` with ``return_lse``).

    Examples
    --------
    >>> p = prefixattn.plan(qo_indptr, kv_lens, block_table, block_size=16, num_qo_heads=32, num_kv_heads=8,
    ...                     head_dim=128, q_dtype=torch.bfloat16)
    >>> for layer in layers:
    ...     o = prefixattn.attention(q[layer], k_caches[layer], v_caches[layer], p)
    """
    key = call_key(q, k_cache, v_cache, out, return_lse, sinks, k_scale, v_scale, graph=False)
    launch = prepared(plan, key)
    if launch is None:  # this plan's first call of this shape (or an input the key cannot describe): every check
        _check_against_plan(q, k_cache, v_cache, plan, out, return_lse)
        check_fp8_support("k_cache", k_cache)
    features = _call_features(launch, plan, q, sinks, k_scale, v_scale)
    if out is None:
        out = _new_out(q, plan)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else plan.ws_lse
    if launch is None:
        classes = plan.work_classes
        ranges = [plan.work.class_range(c) for c in classes]
        launch = _prepare(plan, key, out=out, lse=lse, q=q, k_cache=k_cache, v_cache=v_cache, classes=classes,
                          grid_items=tuple(end - first for first, end in ranges), has_lse=return_lse,
                          features=features)
    _launch(launch, plan.counters if plan.num_merge_rows else None, out, lse, q, k_cache, v_cache, features)
    return (out, lse) if return_lse else out


def _call_features(launch, p: Plan, q: torch.Tensor, sinks, k_scale, v_scale) -> dict:
    """:func:`_feature_args` of this call: the prepared launch's when the call passes no sinks and no scales (nothing
    of them can differ from the call that prepared it), else computed (their values change per call)."""
    if launch is not None and sinks is None and k_scale is None and v_scale is None:
        return launch.features
    return _feature_args(p, q, sinks, k_scale, v_scale)


def _prepare(p: Plan, key, *, out, lse, q, k_cache, v_cache, classes: tuple, grid_items: tuple, has_lse: bool,
             features: dict, tables: dict | None = None, overlapped: bool | None = None) -> PreparedLaunch:
    """Assemble the launches of one call shape (``launcher.PreparedLaunch``): one per work class in ``classes``
    (``layout.CLASS_*``, in that order on the current stream), each of ``grid_items[i] x num_kv_heads`` programs with
    its class's tiles and launch options; programs past the class's live items (its ``ranges`` record, read on the
    device) exit at once, so a grid sized by capacity serves any smaller plan. ``features``: :func:`_feature_args`.
    ``tables`` replaces the plan's ``ranges``/``items``/``gather``/``mrows``/``counters`` (the workspace's whole
    buffers). ``overlapped`` replaces ``p.overlapped`` (a graph's launches: the wrapper's choice). Kept for the plan
    under ``key`` (:data:`_prepared_launches`; not kept for a None key)."""
    t = p.tiles
    tb = {**dict(ranges=p.ranges, items=p.items, gather=p.gather, mrows=p.mrows, counters=p.counters),
          **(tables or {})}
    so, sl, sw, swl, sq, sk, sv = (x.stride() for x in (out, lse, p.ws_o, p.ws_lse, q, k_cache, v_cache))
    named = dict(
        out_ptr=out, lse_ptr=lse, ws_o_ptr=p.ws_o, ws_lse_ptr=p.ws_lse, counters_ptr=tb["counters"],
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, sinks_ptr=features["sinks_ptr"],
        k_scale_ptr=features["k_scale_ptr"], v_scale_ptr=features["v_scale_ptr"],
        items_ptr=tb["items"], gather_ptr=tb["gather"], mrows_ptr=tb["mrows"],
        block_table_ptr=p.block_table,
        num_kv_heads=p.num_kv_heads, group=p.num_qo_heads // p.num_kv_heads, head_dim=p.head_dim,
        v_head_dim=p.v_head_dim, block_size=p.block_size, qk_scale=features["qk_scale"],
        soft_cap_log2=features["soft_cap_log2"],
        window_left=features["window_left"], v_scale=features["v_scale"],
        stride_o_t=so[0], stride_o_h=so[1], stride_o_d=so[2],
        stride_lse_t=sl[0], stride_lse_h=sl[1],
        stride_ws_t=sw[0], stride_ws_h=sw[1], stride_ws_d=sw[2],
        stride_wl_t=swl[0], stride_wl_h=swl[1],
        stride_q_t=sq[0], stride_q_h=sq[1], stride_q_d=sq[2],
        stride_k_blk=sk[0], stride_k_tok=sk[1], stride_k_head=sk[2], stride_k_d=sk[3],
        stride_v_blk=sv[0], stride_v_tok=sv[1], stride_v_head=sv[2], stride_v_d=sv[3],
        stride_bt_r=p.block_table.stride(0),
        HAS_LSE=has_lse, HAS_SOFT_CAP=features["HAS_SOFT_CAP"],
        HAS_WINDOW=features["HAS_WINDOW"], HAS_SINKS=features["HAS_SINKS"], HAS_KV_SCALE=features["HAS_KV_SCALE"],
        USE_NAN_GUARD=p.nan_guard, USE_FP32_DOT=p.use_fp32_dot, IS_HIP=t.is_hip,
        USE_L2_FENCES=t.is_hip and q.is_cuda and own_l2_fences(q.device), USE_PDL=p.pdl,
        HAS_V_HEAD_DIM=p.v_head_dim != p.head_dim, PAGE_SIZE=page_size_constexpr(p.block_size),
        BLOCK_D=block_d(p.head_dim), BLOCK_DV=block_d(p.v_head_dim),
    )
    per_class = class_launches(t, classes, grid_items, tb["ranges"], p.num_kv_heads,
                               kv_fp8=k_cache.dtype in FP8_KV_DTYPES, nan_guard=p.nan_guard,
                               q_fp32=q.dtype == torch.float32,
                               model_switches=any(features[f] for f in MODEL_SWITCHES))
    for index, work_class in enumerate(classes):
        if p.build_of(work_class) == HOPPER:
            per_class = with_hopper(per_class, index, q, k_cache, v_cache, features)
    # An overlapped plan's decode launch runs beside its compute launches (a CPU tensor has no streams: the
    # launches run one after another there, as the interpreter runs them anyway).
    overlapped = p.overlapped if overlapped is None else overlapped
    beside = classes.index(CLASS_DECODE) if q.is_cuda and overlapped and CLASS_DECODE in classes[1:] else None
    if p.pdl:
        per_class = chained_by_pdl(per_class, beside)
    launch = PreparedLaunch(prefix_attention_kernel, named, per_class, beside_from=beside)
    launch.features = features
    remember_launch(p, key, launch)
    return launch


def _launch(launch: PreparedLaunch, counters, out, lse, q, k_cache, v_cache, features: dict) -> None:
    """Run the prepared launches with this layer's tensors. Should one of them raise on the host after an earlier
    one of the same layer was queued (a compile error, an out-of-memory launch), the merge counters (``counters``,
    None when no row merges) are zeroed on the stream behind it: the rest of the plan's layers start from zero."""
    try:
        # The module's kernel as it is now (a test may have replaced it since the launch was prepared).
        launch(prefix_attention_kernel, out, lse, q, k_cache, v_cache, features["sinks_ptr"], features["k_scale_ptr"],
               features["v_scale_ptr"], features["qk_scale"], features["v_scale"])
    except BaseException:
        if counters is not None:
            try:
                counters.zero_()
            except Exception:  # a device that faulted cannot run it either; the launch's own error is the news
                pass
        raise


#: Options a CUDA-graph wrapper fixes at construction: the captured launch holds them (constexprs, scalars, tiles).
_GRAPH_FIXED_OPTIONS = ("num_qo_heads", "num_kv_heads", "head_dim", "v_head_dim", "block_size", "q_dtype", "sm_scale",
                        "device", "tiles", "workspace", "logits_soft_cap", "window_left", "nan_guard", "overlap")
#: Override values compared by type and value in :func:`_restated` (any other object: by identity).
_PLAIN_OPTION_TYPES = (bool, int, float, str)
_UNSET = object()


def _restated(overrides: dict, config: dict) -> bool:
    """Whether every override is the constructor's own value for that option (the same type and an equal plain
    value, or the same object): such a step reuses the options checked once (re-checking them cost ~5 us a step of
    vLLM's eager decode loop on the 2-core host)."""
    for name, value in overrides.items():
        have = config.get(name, _UNSET)
        if value is not have and not (type(value) is type(have) and type(value) in _PLAIN_OPTION_TYPES
                                      and value == have):
            return False
    return True


#: Capacities a step may exceed because of how much it shares (not how big it is): such a step is re-planned
#: without sharing, which the derived capacities always admit (prefixattn.planner.workspace).
_SHARING_CAPACITIES = ("max_items", "max_gather_rows", "max_merge_rows", "max_ws_rows")


class PrefixSharedAttention:
    """FlashInfer-style wrapper: ``plan()`` once per engine step, ``run()`` once per layer.

    With capacities (``max_tokens``, ``max_requests``, ``max_blocks_per_request``) the wrapper owns a
    :class:`~prefixattn.planner.workspace.PlanWorkspace` allocated once: ``plan()`` writes each step's tables into
    pinned host memory and moves them with one non-blocking copy, and neither ``plan()`` nor ``run()`` allocates device
    memory (``run()`` with ``out`` given). Without capacities every plan allocates its own tensors (as :func:`plan`).

    Parameters
    ----------
    num_qo_heads, num_kv_heads, head_dim, block_size, q_dtype, kv_dtype, causal, sm_scale, v_head_dim
        As :func:`prefixattn.plan` (``kv_dtype``: the caches' dtype, which prices the cost rule; default q_dtype).
    max_tokens, max_requests, max_blocks_per_request : int, optional
        The largest step: query rows, requests, block-table columns (all three or none). ``max_blocks_per_request=0``:
        no table in the workspace, every ``plan()`` passes ``device_block_table`` (an engine's persistent table).
    device : torch.device or str, optional
        Where the workspace lives; default the current CUDA device, else the CPU.
    use_cuda_graph : bool
        Fix the launch by the capacity so ``run()`` can be captured once and replayed for every later plan within
        it: the grid is ``max_items x num_kv_heads`` programs (or the bound for ``plan(graph_num_tokens=...)``; those
        past the live items exit at once), the tiles are chosen once for ``max_q_len``, the shared branch is always
        compiled in, and every table lives at a fixed address; a captured layer is its launches alone (``plan()``
        zeroes the merge counters, outside the graph). Needs the capacities. With ``overlap=True`` the captured decode
        launch runs beside the compute launches at every replay (``graph_overlapped``).
    max_q_len : int
        With ``use_cuda_graph``: the query length the fixed tiles are chosen for (1: decode; any batch is still
        correct, only its tile fit changes).
    max_shared_levels, max_items, max_gather_rows, max_merge_rows, max_ws_rows
        Override the derived capacities (:func:`prefixattn.planner.workspace.derive_capacity`).
    **plan_options
        Other :func:`prefixattn.plan` options (``sharing``, ``num_sms``, ``min_split_tokens``, ...).

    Examples
    --------
    >>> attn = PrefixSharedAttention(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
    ...                              q_dtype=torch.float16, max_tokens=8192, max_requests=256,
    ...                              max_blocks_per_request=2048, use_cuda_graph=True)
    >>> attn.plan(qo_indptr, kv_lens, block_table)
    >>> out = attn.run(q, k_cache, v_cache, out=out)
    """

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 q_dtype: torch.dtype = torch.float16, kv_dtype: torch.dtype | None = None, causal: bool = True,
                 sm_scale: float | None = None, max_tokens: int | None = None, max_requests: int | None = None,
                 max_blocks_per_request: int | None = None, device=None, use_cuda_graph: bool = False,
                 max_q_len: int = 1, max_shared_levels: int = DEFAULT_MAX_SHARED_LEVELS, max_items: int | None = None,
                 max_gather_rows: int | None = None, max_merge_rows: int | None = None,
                 max_ws_rows: int | None = None, v_head_dim: int | None = None, **plan_options) -> None:
        self._config = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            **({} if v_head_dim is None else {"v_head_dim": v_head_dim}),
                            block_size=block_size, q_dtype=q_dtype, kv_dtype=kv_dtype, causal=causal,
                            sm_scale=sm_scale, **plan_options)
        self._plan: Plan | None = None
        self._workspace: PlanWorkspace | None = None
        self._checked: tuple | None = None  # _step_options() of a step without overrides
        if not isinstance(use_cuda_graph, bool):
            raise ValueError(f"use_cuda_graph: expected a bool, got {type(use_cuda_graph).__name__}")
        self.use_cuda_graph = use_cuda_graph
        self.graph_max_q_len = max_q_len if use_cuda_graph else None
        self.graph_overlapped = False  # set with the graph's classes (_make_workspace)
        caps = (max_tokens, max_requests, max_blocks_per_request)
        if all(c is None for c in caps):
            if use_cuda_graph:
                raise ValueError("max_tokens: expected the capacities (max_tokens, max_requests, "
                                 "max_blocks_per_request) with use_cuda_graph=True, got None")
            return
        self._make_workspace(caps, device=device, max_q_len=max_q_len, max_shared_levels=max_shared_levels,
                             overrides=dict(max_items=max_items, max_gather_rows=max_gather_rows,
                                            max_merge_rows=max_merge_rows, max_ws_rows=max_ws_rows))

    def _make_workspace(self, caps, *, device, max_q_len, max_shared_levels, overrides) -> None:
        """Capacity, fixed tiles (graph mode) and the workspace: the constructor's capacity half."""
        for name, value in zip(("max_tokens", "max_requests", "max_blocks_per_request"), caps):
            if value is None:
                raise ValueError(f"{name}: expected an int with the other capacities (max_tokens, max_requests, "
                                 "max_blocks_per_request), got None")
        cfg = self._config
        check_heads(_positive_int("num_qo_heads", cfg["num_qo_heads"]),
                    _positive_int("num_kv_heads", cfg["num_kv_heads"]))
        self._check_head_dims()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = canonical_device("device", device)
        group = cfg["num_qo_heads"] // cfg["num_kv_heads"]
        num_sms = cfg.get("num_sms") or _default_num_sms(device)
        if self.use_cuda_graph:
            self._tiles = self._tiles_for(_positive_int("max_q_len", max_q_len))
            if max_q_len <= self._tiles.rows_per_decode_tile(group):
                # Steps of decode-tile rows: no chunk launch in the graph; a longer request (any batch is still
                # served) is cut into decode tiles.
                self._tiles = self._tiles.without_chunk_class()
            tile_sets = [self._tiles]
        else:  # tiles follow each batch: bound the rows per tile over decode- and prefill-shaped choices
            tile_sets = [self._tiles_for(q) for q in (1, int(caps[0]))]
        rows = [r for t in tile_sets for r in (t.rows_per_shared_tile(group), t.rows_per_chunk_tile(group),
                                               t.rows_per_decode_tile(group))]
        #: graph_grid_items() per graph size: fixed by the capacity, asked every graph step (the bounds cost ~3.5 us
        #: a step on the 2-core host); one entry per size asked (an engine's capture sizes).
        self._grid_items: dict[int, tuple] = {}
        self._bound = functools.partial(derive_capacity, num_kv_heads=cfg["num_kv_heads"], num_sms=num_sms,
                                        rows_per_tile=(min(rows), max(rows)), max_shared_levels=max_shared_levels)
        capacity = self._bound(max_tokens=caps[0], max_requests=caps[1], max_blocks_per_request=caps[2], **overrides)
        self._workspace = PlanWorkspace(capacity, num_qo_heads=cfg["num_qo_heads"], head_dim=self._out_head_dim(),
                                        device=device)
        if self.use_cuda_graph:
            t = self._tiles
            #: The work classes the captured launches cover, in launch order: shared nodes unless sharing is off,
            #: prefill-chunk tiles when they have a binary of their own (max_q_len passes a decode tile's rows),
            #: decode tiles always.
            self._graph_classes = tuple(
                c for c, on in ((CLASS_SHARED, cfg.get("sharing", "auto") != "never"),
                                (CLASS_CHUNK, t.chunk != t.decode), (CLASS_DECODE, True)) if on)
            #: With ``overlap=True``: the captured decode launch runs beside the compute launches at every replay
            #: (the graph's branches are fixed at capture; a step without one kind leaves its side idle).
            self.graph_overlapped = cfg.get("overlap", False) is True and len(self._graph_classes) > 1
            self._class_bound = functools.partial(
                class_grid_items, rows_per_tile=(t.rows_per_shared_tile(group), t.rows_per_chunk_tile(group),
                                                 t.rows_per_decode_tile(group)), chunk_class=t.chunk != t.decode,
                max_shared_levels=max_shared_levels, num_sms=num_sms, num_kv_heads=cfg["num_kv_heads"],
                max_items=capacity.max_items)

    # What a wrapper of another kernel (prefixattn.mla.MLAPrefixSharedAttention) replaces.
    def _check_head_dims(self) -> None:
        check_head_dim("head_dim", self._config["head_dim"])
        if "v_head_dim" in self._config:
            check_head_dim("v_head_dim", self._config["v_head_dim"])

    def _out_head_dim(self) -> int:
        """The output's head size (V's): the workspace's partial states have it."""
        return self._config.get("v_head_dim", self._config["head_dim"])

    def _tiles_for(self, max_q_len: int):
        """The tiles of a step whose longest query chunk is ``max_q_len`` rows."""
        cfg = self._config
        group = cfg["num_qo_heads"] // cfg["num_kv_heads"]
        tiles = choose_tiles(head_dim=tile_head_dim(cfg["head_dim"], self._out_head_dim()), group=group,
                             max_q_len=max_q_len, dtype=cfg["q_dtype"])
        return fit_kv_heads(tiles, num_kv_heads=cfg["num_kv_heads"], group=group,
                            nan_guard=bool(cfg.get("nan_guard", OPTION_DEFAULTS["nan_guard"])))

    def _free_plan(self, qo_indptr, kv_lens, block_table, cfg: dict) -> Plan:
        """The plan of a wrapper without capacities (``cfg``: its options and the step's)."""
        return plan(qo_indptr, kv_lens, block_table, **cfg)

    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    @property
    def workspace(self) -> PlanWorkspace | None:
        """The capacity-sized buffers (None without capacities)."""
        return self._workspace

    def plan(self, qo_indptr: torch.Tensor, kv_lens: torch.Tensor, block_table: torch.Tensor, *,
             num_blocks: int | None = None, device_block_table: torch.Tensor | None = None,
             graph_num_tokens: int | None = None, **overrides) -> Plan:
        """Plan this step (see :func:`prefixattn.plan`); keyword overrides replace the constructor's options.

        ``num_blocks``: as :func:`prefixattn.plan` (default: the constructor's, if it got one). A step without
        overrides, or whose overrides only restate the constructor's values (same type and value, or the same
        object), reuses the options the wrapper checked at its first such step; with ``use_cuda_graph`` such a
        restated option is accepted, any other per-step value of a launch-fixed option is a ``ValueError``.

        With a workspace the tables go into it (no device allocation); a step beyond a capacity that sharing
        caused is re-planned without sharing (``plan.stats["capacity_fallback"]`` says why), any other overflow is a
        ``ValueError`` naming the capacity. ``device_block_table``: see :func:`prefixattn.plan` (graph mode: pass
        the same tensor at every step).

        ``graph_num_tokens`` (``use_cuda_graph`` only): the rows of the ``q`` that ``run()`` gets, i.e. the size of the
        engine's captured graph this step replays (its padded batch). The launch then covers the bound for a step of
        that size (:meth:`graph_grid_items`) instead of the whole capacity: a graph captured for 8 tokens launches
        for 8 tokens, not for the largest graph. Every plan replayed by that graph must pass the same value.
        """
        if self._workspace is None:
            if device_block_table is not None or graph_num_tokens is not None:
                name = "device_block_table" if device_block_table is not None else "graph_num_tokens"
                raise ValueError(f"{name}: expected a wrapper with capacities (a workspace), got none")
            per_step = {} if num_blocks is None else {"num_blocks": num_blocks}
            self._plan = self._free_plan(qo_indptr, kv_lens, block_table, {**self._config, **overrides, **per_step})
            return self._plan
        if graph_num_tokens is not None and not self.use_cuda_graph:
            raise ValueError(f"graph_num_tokens: expected use_cuda_graph=True, got {graph_num_tokens!r} without it")
        if overrides and _restated(overrides, self._config):
            overrides = {}  # an engine restating its construction's options every step: the kept options apply
        args = (qo_indptr, kv_lens, block_table, num_blocks, device_block_table, overrides)
        p = self._plan_in_workspace(*args)
        if graph_num_tokens is not None:
            p = self._fit_graph_grid(p, _positive_int("graph_num_tokens", graph_num_tokens), args)
        self._plan = p
        return p

    def graph_grid_items(self, num_tokens: int) -> tuple[int, ...]:
        """Work items each captured launch covers for a step of ``num_tokens`` query rows, one per class of
        :attr:`graph_work_classes`: the bound for a step of that size
        (:func:`prefixattn.planner.workspace.class_grid_items`; only requests with query rows make items, so at most
        ``num_tokens`` of them), never more than the workspace's ``max_items``."""
        grid = self._grid_items.get(num_tokens) if type(num_tokens) is int else None
        if grid is None:
            cap = self._workspace.capacity
            per_class = self._class_bound(num_tokens=num_tokens, num_requests=cap.max_requests)
            grid = tuple(per_class[c] for c in self._graph_classes)
            if type(num_tokens) is int:
                self._grid_items[num_tokens] = grid
        return grid

    @property
    def graph_work_classes(self) -> tuple[int, ...]:
        """With ``use_cuda_graph``: the work classes ``run()`` launches (``layout.CLASS_*``, in order), fixed at
        construction."""
        return self._graph_classes

    def _fit_graph_grid(self, p: Plan, num_tokens: int, args) -> Plan:
        """Keep a plan within the grids of the graph that replays it: re-plan without sharing, else refuse."""
        if p.num_tokens > num_tokens:
            raise ValueError(f"graph_num_tokens: expected at least the step's {p.num_tokens} query rows, got "
                             f"{num_tokens}")
        grid = self.graph_grid_items(num_tokens)
        over = self._grid_overflow(p, grid)
        if over is not None and over[0] == CLASS_SHARED:
            qo_indptr, kv_lens, block_table, num_blocks, device_block_table, overrides = args
            if {**self._config, **overrides}.get("sharing", "auto") != "never":
                reason = (f"max_items: expected at most {over[2]} shared items (the graph grid for {num_tokens} "
                          f"tokens), got {over[1]}")
                p = self._plan_in_workspace(qo_indptr, kv_lens, block_table, num_blocks, device_block_table,
                                            {**overrides, "sharing": "never"})
                p.counts["capacity_fallback"] = reason
                over = self._grid_overflow(p, grid)
        if over is not None:
            name = WORK_CLASSES[over[0]]
            if over[2] < 0:
                raise ValueError(f"max_q_len: expected a step without {name} items (the graph launches no {name} "
                                 f"class: its max_q_len fits a decode tile), got {over[1]}")
            raise ValueError(f"graph_num_tokens: expected a step within the graph's grid of {over[2]} {name} items "
                             f"for {num_tokens} tokens, got {over[1]}")
        p.counts.update(graph_num_tokens=num_tokens, grid_items=grid)
        return p

    def _grid_overflow(self, p: Plan, grid: tuple) -> tuple | None:
        """``(class, items, grid)`` of the first class of ``p`` with more items than the graph's grid for it (grid
        -1: the graph has no launch for that class), or None."""
        for c in range(len(WORK_CLASSES)):
            first, end = p.work.class_range(c)
            if end > first:
                cap = grid[self._graph_classes.index(c)] if c in self._graph_classes else -1
                if end - first > cap:
                    return c, end - first, cap
        return None

    def _plan_in_workspace(self, qo_indptr, kv_lens, block_table, num_blocks, device_block_table,
                           overrides) -> Plan:
        if overrides and self.use_cuda_graph:  # an engine's step has none: ~1 us of set work a step less
            fixed = sorted(set(overrides) & set(_GRAPH_FIXED_OPTIONS))
            if fixed:
                raise ValueError(f"{fixed[0]}: expected no per-step override with use_cuda_graph=True (the captured "
                                 f"launch holds it), got {overrides[fixed[0]]!r}")
            if CLASS_SHARED not in self._graph_classes and overrides.get("sharing", "never") != "never":
                raise ValueError(f"sharing: expected 'never' with use_cuda_graph=True and sharing='never' at "
                                 f"construction (the launch has no shared branch), got {overrides['sharing']!r}")
        options, per_call, default_blocks = self._step_options(overrides)
        if overrides:
            self._check_workspace_shape(options)
        if num_blocks is None:
            num_blocks = default_blocks
        try:
            return plan_with_options(options, qo_indptr, kv_lens, block_table, **per_call, num_blocks=num_blocks,
                                     device_block_table=device_block_table)
        except CapacityError as err:
            if err.capacity not in _SHARING_CAPACITIES or options.sharing == "never":
                raise
            unshared = plan_with_options(options._replace(sharing="never"), qo_indptr, kv_lens, block_table,
                                         **per_call, num_blocks=num_blocks, device_block_table=device_block_table)
            unshared.counts["capacity_fallback"] = str(err)
            return unshared

    def _check_workspace_shape(self, options) -> None:
        """A step's query heads and output head size are the workspace's (its partial states and merge counters
        have them): an override of either would make the kernel write past its rows."""
        ws = self._workspace
        for name, got, want in (("num_qo_heads", options.num_qo_heads, ws.num_qo_heads),
                                ("v_head_dim (the output's head size: head_dim unless given)", options.v_head_dim,
                                 ws.ws_o.shape[2])):
            if got != want:
                raise ValueError(f"{name}: expected {want} (the workspace's, fixed at construction), got {got}")

    def _step_options(self, overrides: dict) -> tuple:
        """``(PlanOptions, other plan() arguments, num_blocks of the options or None)`` of a step with ``overrides``.
        Without overrides (an engine's steps) they are checked once and kept, with the process's planner back-end
        and ``PREFIXATTN_TILE_CONFIG`` as it is then: passing ~20 options by keyword and checking them cost ~4 us a
        step on the 2-core host, reading a variable ~0.7 us."""
        if not overrides and self._checked is not None:
            return self._checked
        cfg = {**self._config, **overrides}
        options = checked_options(**{name: cfg.pop(name, default) for name, default in OPTION_DEFAULTS.items()},
                                  rope_dim=cfg.pop("rope_dim", 0))
        default_blocks = cfg.pop("num_blocks", None)  # the step's own num_blocks, when given, replaces it
        # The planner back-end and PREFIXATTN_TILE_CONFIG: asked once per checked options
        per_call = {**cfg, "workspace": self._workspace, "device": self._workspace.device,
                    "planner": planner_backend(), "fixed_env": read_fixed_env()}
        if self.use_cuda_graph:
            per_call["tiles"] = self._tiles
        if not overrides:
            self._checked = (options, per_call, default_blocks)
        return options, per_call, default_blocks

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, out=None,
            return_lse: bool = False, sinks=None, k_scale=None, v_scale=None):
        """Attention for one layer with the current plan (see :func:`prefixattn.attention`).

        With ``use_cuda_graph`` the launch depends only on the capacity (grid, constexprs, buffer addresses): capture
        it once with the engine's static ``q``/``out``/caches and replay it after any later ``plan()``.
        """
        if self._plan is None:
            raise ValueError("plan: expected plan() to be called before run() (no plan for this step yet)")
        if not self.use_cuda_graph:
            return attention(q, k_cache, v_cache, self._plan, out=out, return_lse=return_lse, sinks=sinks,
                             k_scale=k_scale, v_scale=v_scale)
        return self._run_graph_safe(q, k_cache, v_cache, out=out, return_lse=return_lse, sinks=sinks,
                                    k_scale=k_scale, v_scale=v_scale)

    def _run_graph_safe(self, q, k_cache, v_cache, *, out, return_lse, sinks, k_scale, v_scale):
        """One launch per class of :attr:`graph_work_classes`, fixed by the capacity (or the graph's size); nothing
        else on the device (the counters leave themselves at zero, :func:`attention`)."""
        p, ws = self._plan, self._workspace
        key = call_key(q, k_cache, v_cache, out, return_lse, sinks, k_scale, v_scale, graph=True)
        launch = prepared(p, key)
        graph_tokens = p.counts.get("graph_num_tokens")
        if launch is None:
            _check_against_plan(q, k_cache, v_cache, p, out, return_lse)
            check_fp8_support("k_cache", k_cache)
            if graph_tokens is not None and q.shape[0] != graph_tokens:
                raise ValueError(f"q: expected {graph_tokens} rows (the graph_num_tokens this step was planned for), "
                                 f"got {q.shape[0]}")
        # sinks and tensor scales are read by pointer: capture with the tensors every replay passes (the layer's own)
        features = _call_features(launch, p, q, sinks, k_scale, v_scale)
        if out is None:
            out = _new_out(q, p)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else ws.ws_lse
        if launch is None:
            # The workspace's whole buffers, not the plan's live views: a view with no rows has data_ptr 0, which a
            # captured launch would keep for the steps that have rows.
            grid = p.counts.get("grid_items") or self.graph_grid_items(ws.capacity.max_tokens)
            launch = _prepare(p, key, out=out, lse=lse, q=q, k_cache=k_cache, v_cache=v_cache,
                              classes=self._graph_classes, grid_items=grid, has_lse=return_lse, features=features,
                              tables=dict(ranges=ws.ranges, items=ws.items, gather=ws.gather, mrows=ws.mrows,
                                          counters=ws.counters), overlapped=self.graph_overlapped)
        _launch(launch, ws.counters, out, lse, q, k_cache, v_cache, features)
        return (out, lse) if return_lse else out
