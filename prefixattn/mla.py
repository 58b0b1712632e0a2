"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi-K2) with shared prefixes: :func:`plan_mla` once per
step, :func:`mla_attention` once per layer.

The absorbed form over a paged latent cache (:mod:`prefixattn.kernels.mla_attention_kernel`): every query head
attends the one latent KV head, the score is latent . latent-query + rope . rope-query, the value is the latent, and
the layer applies ``W_UV`` to the ``[kv_lora_rank]`` output. The plan is :func:`prefixattn.plan`'s pipeline: a
prefix that several requests' block tables share is read once per step as one matrix product over all their
(request, head) rows (a shared node), long ranges are split across the device and merged in the kernel, prefill
chunks and decode rows run as their own classes. Each program packs one head block (16 query heads, or all of
fewer: :func:`~prefixattn.planner.tiles.mla_heads_per_program`) of its rows.

Only the absorbed form is planned (``Plan.stats["mla_form"]``): the naive form over a prefix up-projected once per
group (TyphoonMLA's choice for a shared prefix at many heads) is not built yet.
"""

from __future__ import annotations

import math

import torch

from prefixattn.kernels.layout import CLASS_SHARED, page_size_constexpr
from prefixattn.kernels.mla_attention_kernel import mla_attention_kernel
from prefixattn.launcher import PreparedLaunch
from prefixattn.planner.options import MIN_SPLIT_TOKENS, _positive_int, checked_options
from prefixattn.planner.plans import Plan, plan_with_options
from prefixattn.planner.tiles import mla_heads_per_program
from prefixattn.prefix_attention import _call_key, _own_l2_fences, _prepared, check_plan_current, remember_launch
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
#: The form every MLA plan attends in (``Plan.stats["mla_form"]``).
ABSORBED = "absorbed"


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
    num_heads = _positive_int("num_heads", num_heads)
    check_mla_dims(kv_lora_rank, rope_dim)
    group = mla_heads_per_program(num_heads)
    options = checked_options(
        causal=causal, sm_scale=sm_scale, logits_soft_cap=None, window_left=None, alibi_slopes=None, sharing=sharing,
        q_dtype=q_dtype, kv_dtype=kv_dtype, nan_guard=False, block_size=block_size, num_qo_heads=num_heads,
        num_kv_heads=num_heads // group, head_dim=int(kv_lora_rank), min_split_tokens=min_split_tokens,
        num_sms=num_sms, rope_dim=int(rope_dim))
    p = plan_with_options(options, qo_indptr, kv_lens, block_table, device=device, num_blocks=num_blocks)
    p.counts["mla_form"] = ABSORBED
    return p


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
    key = _call_key(q, kv_cache, kv_cache, out, return_lse, None, kv_scale, None, graph=False)
    key = None if key is None else ("mla",) + key  # never the key of an attention() call
    launch = _prepared(plan, key)
    if launch is None:
        _check_mla_call(q, kv_cache, plan, out, return_lse)
    scale = check_kv_scale("kv_scale", kv_scale, q.device) if kv_scale is not None else 1.0
    tensor_scale = isinstance(scale, torch.Tensor)
    has_kv_scale = tensor_scale or scale != 1.0
    scale_ptr = scale if tensor_scale else (device_one(q.device) if has_kv_scale else plan.ws_lse)
    float_scale = 1.0 if tensor_scale else scale
    qk_scale = plan.sm_scale * _LOG2E * float_scale
    if out is None:
        out = q.new_empty((q.shape[0], plan.num_qo_heads, plan.head_dim))
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else plan.ws_lse
    if launch is None:
        launch = _prepare_mla(plan, out=out, lse=lse, q=q, kv_cache=kv_cache, scale_ptr=scale_ptr,
                              qk_scale=qk_scale, float_scale=float_scale, has_lse=return_lse,
                              has_kv_scale=has_kv_scale)
        remember_launch(plan, key, launch)
    try:
        launch(mla_attention_kernel, out, lse, q, kv_cache, scale_ptr, qk_scale, float_scale)
    except BaseException:
        if plan.num_merge_rows:  # a launch refused after an earlier class was queued: the counters start from 0
            try:
                plan.counters.zero_()
            except Exception:  # a faulted device cannot run it either; the launch's own error is the news
                pass
        raise
    return (out, lse) if return_lse else out


def _prepare_mla(p: Plan, *, out, lse, q, kv_cache, scale_ptr, qk_scale: float, float_scale: float, has_lse: bool,
                 has_kv_scale: bool) -> PreparedLaunch:
    """The plan's class launches of the MLA kernel for one call shape."""
    t = p.tiles
    so, sl, sw, swl, sq, sc = (x.stride() for x in (out, lse, p.ws_o, p.ws_lse, q, kv_cache))
    named = dict(
        out_ptr=out, lse_ptr=lse, ws_o_ptr=p.ws_o, ws_lse_ptr=p.ws_lse, counters_ptr=p.counters, q_ptr=q,
        kv_cache_ptr=kv_cache, kv_scale_ptr=scale_ptr, items_ptr=p.items, gather_ptr=p.gather, mrows_ptr=p.mrows,
        block_table_ptr=p.block_table, num_head_blocks=p.num_kv_heads, group=p.heads_per_program,
        kv_lora_rank=p.head_dim, rope_dim=p.rope_dim, block_size=p.block_size, qk_scale=qk_scale,
        kv_scale=float_scale,
        stride_o_t=so[0], stride_o_h=so[1], stride_o_d=so[2], stride_lse_t=sl[0], stride_lse_h=sl[1],
        stride_ws_t=sw[0], stride_ws_h=sw[1], stride_ws_d=sw[2], stride_wl_t=swl[0], stride_wl_h=swl[1],
        stride_q_t=sq[0], stride_q_h=sq[1], stride_q_d=sq[2],
        stride_kv_blk=sc[0], stride_kv_tok=sc[1], stride_kv_d=sc[2], stride_bt_r=p.block_table.stride(0),
        HAS_LSE=has_lse, HAS_KV_SCALE=has_kv_scale, USE_FP32_DOT=p.use_fp32_dot, IS_HIP=t.is_hip,
        USE_L2_FENCES=t.is_hip and q.is_cuda and _own_l2_fences(q.device),
        PAGE_SIZE=page_size_constexpr(p.block_size), BLOCK_C=t.block_d,
        BLOCK_R=max(_MIN_ROPE_LANES, 1 << (p.rope_dim - 1).bit_length()),
    )
    per_class = []
    for work_class in p.work_classes:
        first, end = p.work.class_range(work_class)
        ct = t.of(work_class)
        lo = ct.launch
        options = {"num_warps": lo.num_warps, "num_stages": lo.num_stages}
        if t.is_hip:
            options.update(waves_per_eu=lo.waves_per_eu, matrix_instr_nonkdim=lo.matrix_instr_nonkdim, kpack=lo.kpack)
        class_args = dict(item_range_ptr=p.ranges[work_class], IS_SHARED=work_class == CLASS_SHARED,
                          BLOCK_M=ct.block_m, BLOCK_N=ct.block_n)
        per_class.append((((end - first) * p.num_kv_heads,), class_args, options))
    return PreparedLaunch(mla_attention_kernel, named, per_class, per_call=MLA_PER_CALL)
