"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi-K2) with shared prefixes: :func:`plan_mla` once per
step, :func:`mla_attention` once per layer.

The absorbed form over a paged latent cache (:mod:`prefixattn.kernels.mla_attention_kernel`): every query head
attends the one latent KV head, the score is latent . latent-query + rope . rope-query, the value is the latent, and
the layer applies ``W_UV`` to the ``[kv_lora_rank]`` output. The plan is :func:`prefixattn.plan`'s pipeline: a
prefix that several requests' block tables share (a shared node) is read once per shared tile, a matrix product over
the (request, head) rows the tile packs, instead of once per request; long ranges are split across the device and
merged in the kernel, prefill chunks and decode rows run as their own classes. Each program packs one head block
(16 query heads, or all of fewer: :func:`~prefixattn.planner.cost_rule.mla_heads_per_program`) of its rows.

This plans the absorbed form (``Plan.stats["mla_form"]``); :mod:`prefixattn.mla_naive` attends shared prefixes in
the naive form over a latent up-projected once per group (TyphoonMLA's choice), on top of this and
:func:`prefixattn.plan`.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch

from prefixattn.kernels.layout import CLASS_SHARED, page_size_constexpr
from prefixattn.kernels.mla_attention_kernel import mla_attention_kernel
from prefixattn.launcher import PreparedLaunch, call_key, own_l2_fences, prepared, remember_launch
from prefixattn.planner.options import MIN_SPLIT_TOKENS, _positive_int, checked_options
from prefixattn.planner.plans import OPTION_DEFAULTS, Plan, plan_with_options
from prefixattn.planner.cost_rule import mla_heads_per_program
from prefixattn.planner.tiles import mla_tiles
from prefixattn.prefix_attention import PrefixSharedAttention, check_plan_current
from prefixattn.runtime import device_one
from prefixattn.validation import (FP8_KV_DTYPES, KV_CACHE_DTYPES, SUPPORTED_DTYPES, check_fp8_support,
                                   check_kernel_device, check_kv_scale, check_mla_dims, check_tensor, same_device,
                                   torch_dtype_name)

_LOG2E = 1.0 / math.log(2.0)
#: The parameters of the MLA kernel a call patches, in the order :class:`~prefixattn.launcher.PreparedLaunch` takes
#: their values.
MLA_PER_CALL = ("out_ptr", "lse_ptr", "q_ptr", "kv_cache_ptr", "kv_scale_ptr", "qk_scale", "kv_scale")
#: Smallest rotary tile: ``tl.dot`` needs K >= 16.
_MIN_ROPE_LANES = 16


def plan_mla(qo_indptr: torch.Tensor, kv_lens: torch.Tensor, block_table: torch.Tensor, *, block_size: int,
             num_heads: int, sm_scale: float, kv_lora_rank: int = 512, rope_dim: int = 64, causal: bool = True,
             q_dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None, device=None,
             num_sms: int | None = None, min_split_tokens: int = MIN_SPLIT_TOKENS, sharing: str = "auto",
             num_blocks: int | None = None) -> Plan:
    """Plan one engine step of MLA over a paged latent cache (host; reuse the plan for every layer).

    Parameters
    ----------
    qo_indptr, kv_lens, block_table, block_size, causal, q_dtype, kv_dtype, device, num_sms, min_split_tokens, \
sharing, num_blocks
        As :func:`prefixattn.plan` (``kv_dtype``: the latent cache's, q's or fp8).
    num_heads : int
        Query heads of the layer on this device (DeepSeek-V3: 128, or 16 per GPU under tensor parallelism 8).
    sm_scale : float
        The model's logit scale, ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (times its YaRN factor):
        required, the latent does not carry it.
    kv_lora_rank, rope_dim : int
        Widths of a cache row's latent and rotary key (DeepSeek-V3, Kimi-K2: 512 and 64); multiples of 8, at most
        512 and 128.

    Returns
    -------
    Plan
        With ``rope_dim > 0``; ``num_kv_heads`` counts its head blocks (:attr:`Plan.heads_per_program` heads each).

    Examples
    --------
    >>> p = prefixattn.plan_mla(qo_indptr, kv_lens, block_table, block_size=64, num_heads=16,
    ...                         sm_scale=192 ** -0.5, q_dtype=torch.bfloat16)
    >>> for layer in layers:
    ...     o = prefixattn.mla_attention(q[layer], kv_cache[layer], p)  # q: [T, 16, 576] -> o: [T, 16, 512]
    """
    options = _mla_options(num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, sm_scale=sm_scale,
                           causal=causal, sharing=sharing, q_dtype=q_dtype, kv_dtype=kv_dtype, block_size=block_size,
                           min_split_tokens=min_split_tokens, num_sms=num_sms)
    return plan_with_options(options, qo_indptr, kv_lens, block_table, device=device, num_blocks=num_blocks)


def _mla_options(*, num_heads, kv_lora_rank, rope_dim, **options):
    """The checked plan options of an MLA layer: its heads in head blocks (:func:`mla_heads_per_program`), the
    latent as the head size."""
    num_heads = _positive_int("num_heads", num_heads)
    check_mla_dims(kv_lora_rank, rope_dim)
    group = mla_heads_per_program(num_heads)
    shape = dict(num_qo_heads=num_heads, num_kv_heads=num_heads // group, head_dim=int(kv_lora_rank))
    return checked_options(**{**OPTION_DEFAULTS, **options, **shape}, rope_dim=int(rope_dim))


def _check_mla_call(q, kv_cache, p: Plan, out, return_lse) -> None:
    """Shapes, dtypes and devices against the plan (no value read: no host synchronization)."""
    if not isinstance(p, Plan) or not p.rope_dim:
        got = type(p).__name__ if not isinstance(p, Plan) else "a plan of prefixattn.plan"
        raise ValueError(f"plan: expected an MLA plan (from prefixattn.plan_mla), got {got}")
    check_plan_current(p)
    width = p.head_dim + p.rope_dim
    check_tensor("q", q, ndim=3, dtypes=SUPPORTED_DTYPES)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=KV_CACHE_DTYPES)
    check_kernel_device("q", q)
    if q.dtype != p.q_dtype:
        raise ValueError(f"q: expected dtype {torch_dtype_name(p.q_dtype)} (the plan's q_dtype), got "
                         f"{torch_dtype_name(q.dtype)}")
    if kv_cache.dtype != q.dtype and kv_cache.dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache: expected the dtype of q ({torch_dtype_name(q.dtype)}) or an fp8 dtype, got "
                         f"{torch_dtype_name(kv_cache.dtype)}")
    for name, t, want, what in (("q", q, (p.num_qo_heads, width), "num_heads"),
                                ("kv_cache", kv_cache, (p.block_size, width), "block_size")):
        if tuple(t.shape[1:]) != want:
            raise ValueError(f"{name}: expected shape [*, {want[0]}, {want[1]}] (the plan's {what} and kv_lora_rank + "
                             f"rope_dim), got {tuple(t.shape)}")
    if q.shape[0] < p.num_tokens:
        raise ValueError(f"q: expected at least {p.num_tokens} rows (qo_indptr[-1] of the plan), got {q.shape[0]}")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if not same_device(t.device, p.device):
            raise ValueError(f"{name}: expected device {p.device} (the plan's device), got {t.device}")
    if kv_cache.shape[0] <= p.max_block_id:
        raise ValueError(f"kv_cache: expected more than {p.max_block_id} blocks in dim 0 (the plan reads block id "
                         f"{p.max_block_id}), got {kv_cache.shape[0]}")
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,))
        want = (q.shape[0], p.num_qo_heads, p.head_dim)
        if tuple(out.shape) != want:
            raise ValueError(f"out: expected shape {want} (q's rows and heads, kv_lora_rank), got {tuple(out.shape)}")
        if not same_device(out.device, q.device):
            raise ValueError(f"out: expected device {q.device}, got {out.device}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    check_fp8_support("kv_cache", kv_cache)


def mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: Plan, *, out: torch.Tensor | None = None,
                  return_lse: bool = False, kv_scale: float | torch.Tensor | None = None):
    """Absorbed MLA for one layer with an MLA plan: one kernel launch per work class, no host synchronization.

    Parameters
    ----------
    q : Tensor, ``[num_tokens, num_heads, kv_lora_rank + rope_dim]``, fp16/bf16/fp32, any strides
        Per head the absorbed query (``q_nope @ W_UK``) then the rotary query (vLLM's and FlashMLA's layout);
        ``num_tokens >= qo_indptr[-1]``, rows past it are neither read nor written.
    kv_cache : Tensor, ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, any strides
        Per token the latent ``kv_c`` then the rotary key ``k_pe`` (vLLM's MLA cache; a cache with a head dimension
        of 1 passes as ``cache.squeeze(2)``); dtype of q or fp8 (dequantized with ``kv_scale``).
    plan : Plan
        From :func:`plan_mla` for this step.
    out : Tensor, optional, ``[num_tokens, num_heads, kv_lora_rank]``, dtype of q, any strides
        Written in place (only its valid rows).
    return_lse : bool
        Also return the fp32 natural-log LSE ``[num_tokens, num_heads]``.
    kv_scale : float or Tensor ``[1]`` fp32, optional
        Dequantization scale of an fp8 latent cache (keys and values alike); a tensor is read by pointer.

    Returns
    -------
    out : Tensor, ``[num_tokens, num_heads, kv_lora_rank]`` in q's dtype (and ``lse`` with ``return_lse``).
    """
    return _mla_call(q, kv_cache, plan, out=out, return_lse=return_lse, kv_scale=kv_scale)


def _mla_call(q, kv_cache, plan: Plan, *, out, return_lse, kv_scale, graph: "_GraphLaunch | None" = None):
    """:func:`mla_attention`, or with ``graph`` the launches fixed by a wrapper's capacity (its classes, grids and
    whole workspace buffers, :meth:`MLAPrefixSharedAttention.run`)."""
    # kv_scale in the key's v_scale place: whether a float scale is 1 picks HAS_KV_SCALE.
    key = call_key(q, kv_cache, kv_cache, out, return_lse, None, None, kv_scale, graph=graph is not None)
    key = None if key is None else ("mla",) + key  # never the key of an attention() call
    launch = prepared(plan, key)
    if launch is None:
        _check_mla_call(q, kv_cache, plan, out, return_lse)
        if graph is not None and graph.num_tokens is not None and q.shape[0] != graph.num_tokens:
            raise ValueError(f"q: expected {graph.num_tokens} rows (the graph_num_tokens this step was planned for), "
                             f"got {q.shape[0]}")
    scale = check_kv_scale("kv_scale", kv_scale, q.device) if kv_scale is not None else 1.0
    tensor_scale = isinstance(scale, torch.Tensor)
    has_kv_scale = tensor_scale or scale != 1.0
    scale_ptr = scale if tensor_scale else (device_one(q.device) if has_kv_scale else plan.ws_lse)
    float_scale = 1.0 if tensor_scale else scale
    qk_scale = plan.sm_scale * _LOG2E * float_scale
    if out is None:
        out = q.new_empty((q.shape[0], plan.num_qo_heads, plan.head_dim))
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else plan.ws_lse
    counters = plan.counters if graph is None else graph.tables["counters"]
    if launch is None:
        launch = _prepare_mla(plan, out=out, lse=lse, q=q, kv_cache=kv_cache, scale_ptr=scale_ptr,
                              qk_scale=qk_scale, float_scale=float_scale, has_lse=return_lse,
                              has_kv_scale=has_kv_scale, graph=graph)
        remember_launch(plan, key, launch)
    try:
        launch(mla_attention_kernel, out, lse, q, kv_cache, scale_ptr, qk_scale, float_scale)
    except BaseException:
        if plan.num_merge_rows or graph is not None:  # an earlier class was queued: the counters start from 0
            try:
                counters.zero_()
            except Exception:  # a faulted device cannot run it either; the launch's own error is the news
                pass
        raise
    return (out, lse) if return_lse else out


class _GraphLaunch(NamedTuple):
    """What a CUDA-graph wrapper fixes of a call's launches: its classes in order, each class's grid of items, the
    workspace's whole buffers (a live view with no rows has data_ptr 0, which a capture would keep), and the rows of
    the graph the step was planned for (None: any)."""

    classes: tuple
    grid_items: tuple
    tables: dict
    num_tokens: int | None


def _prepare_mla(p: Plan, *, out, lse, q, kv_cache, scale_ptr, qk_scale: float, float_scale: float, has_lse: bool,
                 has_kv_scale: bool, graph: _GraphLaunch | None) -> PreparedLaunch:
    """The class launches of the MLA kernel for one call shape: the plan's classes over its live tables, or a
    graph's (``graph``)."""
    t = p.tiles
    if graph is None:
        tb = dict(ranges=p.ranges, items=p.items, gather=p.gather, mrows=p.mrows, counters=p.counters)
        classes = p.work_classes
        grid_items = tuple(end - first for first, end in (p.work.class_range(c) for c in classes))
    else:
        tb, classes, grid_items = graph.tables, graph.classes, graph.grid_items
    so, sl, sw, swl, sq, sc = (x.stride() for x in (out, lse, p.ws_o, p.ws_lse, q, kv_cache))
    named = dict(
        out_ptr=out, lse_ptr=lse, ws_o_ptr=p.ws_o, ws_lse_ptr=p.ws_lse, counters_ptr=tb["counters"], q_ptr=q,
        kv_cache_ptr=kv_cache, kv_scale_ptr=scale_ptr, items_ptr=tb["items"], gather_ptr=tb["gather"],
        mrows_ptr=tb["mrows"],
        block_table_ptr=p.block_table, num_head_blocks=p.num_kv_heads, group=p.heads_per_program,
        kv_lora_rank=p.head_dim, rope_dim=p.rope_dim, block_size=p.block_size, qk_scale=qk_scale,
        kv_scale=float_scale,
        stride_o_t=so[0], stride_o_h=so[1], stride_o_d=so[2], stride_lse_t=sl[0], stride_lse_h=sl[1],
        stride_ws_t=sw[0], stride_ws_h=sw[1], stride_ws_d=sw[2], stride_wl_t=swl[0], stride_wl_h=swl[1],
        stride_q_t=sq[0], stride_q_h=sq[1], stride_q_d=sq[2],
        stride_kv_blk=sc[0], stride_kv_tok=sc[1], stride_kv_d=sc[2], stride_bt_r=p.block_table.stride(0),
        HAS_LSE=has_lse, HAS_KV_SCALE=has_kv_scale, USE_FP32_DOT=p.use_fp32_dot, IS_HIP=t.is_hip,
        USE_L2_FENCES=t.is_hip and q.is_cuda and own_l2_fences(q.device),
        PAGE_SIZE=page_size_constexpr(p.block_size), BLOCK_C=t.block_d,
        BLOCK_R=max(_MIN_ROPE_LANES, 1 << (p.rope_dim - 1).bit_length()),
    )
    per_class = []
    for work_class, items in zip(classes, grid_items):
        ct = t.of(work_class)
        lo = ct.launch
        options = {"num_warps": lo.num_warps, "num_stages": lo.num_stages}
        if t.is_hip:
            options.update(waves_per_eu=lo.waves_per_eu, matrix_instr_nonkdim=lo.matrix_instr_nonkdim, kpack=lo.kpack)
        class_args = dict(item_range_ptr=tb["ranges"][work_class], IS_SHARED=work_class == CLASS_SHARED,
                          BLOCK_M=ct.block_m, BLOCK_N=ct.block_n)
        per_class.append(((items * p.num_kv_heads,), class_args, options))
    return PreparedLaunch(mla_attention_kernel, named, per_class, per_call=MLA_PER_CALL)


#: The plan options an MLA wrapper passes on (MLA plans have no soft cap, window or NaN guard).
_WRAPPER_OPTIONS = ("sharing", "num_sms", "min_split_tokens", "num_blocks")


class MLAPrefixSharedAttention(PrefixSharedAttention):
    """:class:`~prefixattn.PrefixSharedAttention` for MLA: ``plan()`` once per engine step (as :func:`plan_mla`),
    ``run(q, kv_cache)`` once per layer (as :func:`mla_attention`); with capacities a workspace sized once, and with
    ``use_cuda_graph`` launches fixed by the capacity that a CUDA graph captures once and replays after any later
    ``plan()``.

    Parameters
    ----------
    num_heads, block_size, sm_scale, kv_lora_rank, rope_dim, causal, q_dtype, kv_dtype
        As :func:`plan_mla`.
    max_tokens, max_requests, max_blocks_per_request, device, use_cuda_graph, max_q_len, max_shared_levels, \
max_items, max_gather_rows, max_merge_rows, max_ws_rows
        As :class:`~prefixattn.PrefixSharedAttention`.
    **plan_options
        ``sharing``, ``num_sms``, ``min_split_tokens``, ``num_blocks``.

    Examples
    --------
    >>> attn = MLAPrefixSharedAttention(num_heads=16, block_size=64, sm_scale=192 ** -0.5, max_tokens=256,
    ...                                 max_requests=256, max_blocks_per_request=512, use_cuda_graph=True)
    >>> attn.plan(qo_indptr, kv_lens, block_table)
    >>> out = attn.run(q, kv_cache, out=out)  # q [T, 16, 576], kv_cache [blocks, 64, 576], out [T, 16, 512]
    """

    def __init__(self, *, num_heads: int, block_size: int, sm_scale: float, kv_lora_rank: int = 512,
                 rope_dim: int = 64, causal: bool = True, q_dtype: torch.dtype = torch.bfloat16,
                 kv_dtype: torch.dtype | None = None, **wrapper_options) -> None:
        plan_options = {k: wrapper_options.pop(k) for k in _WRAPPER_OPTIONS if k in wrapper_options}
        # v_head_dim: the latent is the value (kv_lora_rank wide).
        unknown = sorted(set(wrapper_options) - set(inspect.signature(PrefixSharedAttention).parameters)
                         | {"v_head_dim"} & set(wrapper_options))
        if unknown:
            raise ValueError(f"{unknown[0]}: expected an option of MLAPrefixSharedAttention (the wrapper's, or "
                             f"{', '.join(_WRAPPER_OPTIONS)}), got {unknown[0]}={wrapper_options[unknown[0]]!r}")
        # Checked now, so that a bad option fails here and not at the first step.
        options = _mla_options(num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, sm_scale=sm_scale,
                               causal=causal, q_dtype=q_dtype, kv_dtype=kv_dtype, block_size=block_size,
                               **{k: v for k, v in plan_options.items() if k != "num_blocks"})
        super().__init__(num_qo_heads=options.num_qo_heads, num_kv_heads=options.num_kv_heads,
                         head_dim=options.head_dim, block_size=block_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                         causal=causal, sm_scale=sm_scale, rope_dim=options.rope_dim, **plan_options,
                         **wrapper_options)

    def _check_head_dims(self) -> None:
        check_mla_dims(self._config["head_dim"], self._config["rope_dim"])

    def _tiles_for(self, max_q_len: int):
        cfg = self._config
        kv_dtype = cfg["kv_dtype"] or cfg["q_dtype"]
        return mla_tiles(kv_lora_rank=cfg["head_dim"], dtype=cfg["q_dtype"], kv_fp8=kv_dtype.itemsize == 1)

    def _free_plan(self, qo_indptr, kv_lens, block_table, cfg: dict) -> Plan:
        cfg = dict(cfg)
        mapped = dict(num_heads=cfg.pop("num_qo_heads"), kv_lora_rank=cfg.pop("head_dim"),
                      rope_dim=cfg.pop("rope_dim"))
        cfg.pop("num_kv_heads")
        return plan_mla(qo_indptr, kv_lens, block_table, **mapped, **cfg)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, out: torch.Tensor | None = None,
            return_lse: bool = False, kv_scale: float | torch.Tensor | None = None):
        """MLA for one layer with the current plan (see :func:`mla_attention`). With ``use_cuda_graph`` the launch
        depends only on the capacity: capture it once with the engine's static ``q``/``out``/cache and replay it
        after any later ``plan()``."""
        if self._plan is None:
            raise ValueError("plan: expected plan() to be called before run() (no plan for this step yet)")
        if not self.use_cuda_graph:
            return _mla_call(q, kv_cache, self._plan, out=out, return_lse=return_lse, kv_scale=kv_scale)
        p, ws = self._plan, self._workspace
        stats = p.counts
        grid = stats.get("grid_items") or self.graph_grid_items(ws.capacity.max_tokens)
        tables = dict(ranges=ws.ranges, items=ws.items, gather=ws.gather, mrows=ws.mrows, counters=ws.counters)
        graph = _GraphLaunch(classes=self._graph_classes, grid_items=grid, tables=tables,
                             num_tokens=stats.get("graph_num_tokens"))
        return _mla_call(q, kv_cache, p, out=out, return_lse=return_lse, kv_scale=kv_scale, graph=graph)
