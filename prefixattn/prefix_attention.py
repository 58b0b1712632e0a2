"""attention(): run a :class:`~prefixattn.planner.Plan` - one launch of the fused prefix-shared attention kernel."""

from __future__ import annotations

import functools
import math

import torch

from prefixattn.kernels.layout import page_size_constexpr
from prefixattn.kernels.prefix_attention import prefix_attention_kernel
from prefixattn.planner import Plan, plan
from prefixattn.validation import (check_kernel_device, check_kv_scale, check_qkv, check_sinks, check_tensor,
                                   same_device)

_LOG2E = 1.0 / math.log(2.0)
#: A 1.0 per device, the pointer a float scale's launch passes next to a tensor one (allocated once per device, on
#: the first launch that mixes them; never per call).
_ONES: dict = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


#: Triton compiles fp8 e4m3 (``float8_e4m3fn``) loads for NVIDIA GPUs from compute capability 8.9 on.
_FP8_E4M3_MIN_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _check_fp8_support(k_cache: torch.Tensor) -> None:
    """An e4m3 cache on an NVIDIA GPU older than sm_89 is refused here (Triton cannot compile its loads there)."""
    if k_cache.dtype != torch.float8_e4m3fn or k_cache.device.type != "cuda" or torch.version.hip is not None:
        return
    cap = _capability(k_cache.device.index if k_cache.device.index is not None else torch.cuda.current_device())
    if cap < _FP8_E4M3_MIN_CAPABILITY:
        raise ValueError(f"k_cache: expected float8_e5m2 on this GPU (compute capability {cap[0]}.{cap[1]}; Triton "
                         f"compiles float8_e4m3fn loads from 8.9 on), got float8_e4m3fn")


def _feature_args(p: Plan, q: torch.Tensor, sinks, k_scale, v_scale) -> dict:
    """Kernel arguments of the issue-19 features for one launch: scalars, pointers and their constexpr switches.

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
        k_scale_ptr=k_scale if k_tensor else (_one(q.device) if has_kv_scale else placeholder),
        v_scale_ptr=v_scale if v_tensor else (_one(q.device) if has_kv_scale else placeholder),
        qk_scale=qk_scale, soft_cap_log2=cap * _LOG2E, window_left=p.window_left,
        v_scale=1.0 if v_tensor else v_scale,
        HAS_SOFT_CAP=cap > 0, HAS_WINDOW=p.window_left >= 0, HAS_SINKS=sinks is not None, HAS_KV_SCALE=has_kv_scale,
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_against_plan(q, k_cache, v_cache, p: Plan, out, return_lse) -> None:
    """Shapes, dtypes and devices only: no value of any tensor is read (no host synchronization).

    The block ids were checked by plan() on the host; here the largest one the plan reads (an int the plan keeps)
    is compared with the cache's ``shape[0]``: a cache too small for the plan is refused before the launch instead
    of being read out of bounds. Cost: two int comparisons per call (v_cache's shape equals k_cache's).
    """
    if not isinstance(p, Plan):
        raise ValueError(f"plan: expected a prefixattn Plan (from prefixattn.plan), got {type(p).__name__}")
    num_qo_heads, num_kv_heads, head_dim, block_size = check_qkv(q, k_cache, v_cache)
    check_kernel_device("q", q)
    for name, got, want in (("num_qo_heads (q dim 1)", num_qo_heads, p.num_qo_heads),
                            ("num_kv_heads (k_cache dim 2)", num_kv_heads, p.num_kv_heads),
                            ("head_dim (q dim 2)", head_dim, p.head_dim),
                            ("block_size (k_cache dim 1)", block_size, p.block_size)):
        if got != want:
            raise ValueError(f"{name}: expected {want} (from the plan), got {got}")
    if q.dtype != p.q_dtype:
        raise ValueError(f"q: expected dtype {_dtype_name(p.q_dtype)} (the plan's q_dtype), got {_dtype_name(q.dtype)}")
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
        if tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"out: expected shape {tuple(q.shape)} (the shape of q), got {tuple(out.shape)}")
        if not same_device(out.device, q.device):
            raise ValueError(f"out: expected device {q.device}, got {out.device}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {type(return_lse).__name__}")


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Plan, *,
              out: torch.Tensor | None = None, return_lse: bool = False, sinks: torch.Tensor | None = None,
              k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None):
    """Prefix-shared paged attention for one layer: exactly one kernel launch, no host synchronization.

    Same conventions as :func:`prefixattn.reference_attention`; the metadata (``qo_indptr``, ``kv_lens``,
    ``block_table``, ``causal``, ``sm_scale``, ``logits_soft_cap``, ``window_left``) come from ``plan``.

    Parameters
    ----------
    q : Tensor, ``[num_tokens, num_qo_heads, head_dim]``, fp16/bf16/fp32, any strides
        ``num_tokens >= qo_indptr[-1]``; rows past ``qo_indptr[-1]`` (CUDA-graph padding) are neither read nor
        written.
    k_cache, v_cache : Tensor, ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides
        dtype of q, or fp8 (``float8_e4m3fn``/``float8_e5m2``, both caches the same): upcast on load, dequantized
        with ``k_scale``/``v_scale``, fp32 accumulation.
    plan : Plan
        From :func:`prefixattn.plan` for this step; one plan serves every layer, one launch at a time (the plan owns
        the workspace and merge counters).
    out : Tensor, optional, shape and dtype of q, any strides
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
    out : Tensor, ``[num_tokens, num_qo_heads, head_dim]`` in q's dtype (and ``lse`` with ``return_lse``).

    Examples
    --------
    >>> p = prefixattn.plan(qo_indptr, kv_lens, block_table, block_size=16, num_qo_heads=32, num_kv_heads=8,
    ...                     head_dim=128, q_dtype=torch.bfloat16)
    >>> for layer in layers:
    ...     o = prefixattn.attention(q[layer], k_caches[layer], v_caches[layer], p)
    """
    _check_against_plan(q, k_cache, v_cache, plan, out, return_lse)
    _check_fp8_support(k_cache)
    features = _feature_args(plan, q, sinks, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else plan.ws_lse
    p, t = plan, plan.tiles
    has_shared = p.has_shared
    if p.num_items:
        # Merge counters start at 0 in every launch (a memset of num_merge_rows x num_qo_heads int32, stream
        # ordered and CUDA-graph capturable): an interrupted launch cannot leak arrivals into the next one.
        if p.num_merge_rows:
            p.counters.zero_()
        prefix_attention_kernel[(p.num_items * p.num_kv_heads,)](
            out_ptr=out, lse_ptr=lse, ws_o_ptr=p.ws_o, ws_lse_ptr=p.ws_lse, counters_ptr=p.counters,
            q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, sinks_ptr=features["sinks_ptr"],
            k_scale_ptr=features["k_scale_ptr"], v_scale_ptr=features["v_scale_ptr"],
            num_items_ptr=p.num_items_dev, items_ptr=p.items, gather_ptr=p.gather, mrows_ptr=p.mrows,
            block_table_ptr=p.block_table,
            num_kv_heads=p.num_kv_heads, group=p.num_qo_heads // p.num_kv_heads, head_dim=p.head_dim,
            block_size=p.block_size, qk_scale=features["qk_scale"], soft_cap_log2=features["soft_cap_log2"],
            window_left=features["window_left"], v_scale=features["v_scale"],
            stride_o_t=out.stride(0), stride_o_h=out.stride(1), stride_o_d=out.stride(2),
            stride_lse_t=lse.stride(0), stride_lse_h=lse.stride(1),
            stride_ws_t=p.ws_o.stride(0), stride_ws_h=p.ws_o.stride(1), stride_ws_d=p.ws_o.stride(2),
            stride_wl_t=p.ws_lse.stride(0), stride_wl_h=p.ws_lse.stride(1),
            stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_q_d=q.stride(2),
            stride_k_blk=k_cache.stride(0), stride_k_tok=k_cache.stride(1), stride_k_head=k_cache.stride(2),
            stride_k_d=k_cache.stride(3),
            stride_v_blk=v_cache.stride(0), stride_v_tok=v_cache.stride(1), stride_v_head=v_cache.stride(2),
            stride_v_d=v_cache.stride(3),
            stride_bt_r=p.block_table.stride(0),
            HAS_LSE=return_lse, HAS_SHARED=has_shared, HAS_SOFT_CAP=features["HAS_SOFT_CAP"],
            HAS_WINDOW=features["HAS_WINDOW"], HAS_SINKS=features["HAS_SINKS"],
            HAS_KV_SCALE=features["HAS_KV_SCALE"], USE_NAN_GUARD=p.nan_guard, USE_FP32_DOT=p.use_fp32_dot,
            IS_HIP=t.is_hip,
            PAGE_SIZE=page_size_constexpr(p.block_size),
            BLOCK_M_SHARED=t.block_m_shared, BLOCK_N_SHARED=t.block_n_shared,
            BLOCK_M_SUFFIX=t.block_m_suffix, BLOCK_N_SUFFIX=t.block_n_suffix, BLOCK_D=t.block_d,
            **t.launch_options(has_shared),
        )
    return (out, lse) if return_lse else out


class PrefixSharedAttention:
    """FlashInfer-style wrapper: ``plan()`` once per engine step, ``run()`` once per layer.

    Examples
    --------
    >>> attn = PrefixSharedAttention(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
    ...                              q_dtype=torch.float16)
    >>> attn.plan(qo_indptr, kv_lens, block_table)
    >>> out = attn.run(q, k_cache, v_cache)
    """

    def __init__(self, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 q_dtype: torch.dtype = torch.float16, causal: bool = True, sm_scale: float | None = None,
                 **plan_options) -> None:
        self._config = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            block_size=block_size, q_dtype=q_dtype, causal=causal, sm_scale=sm_scale,
                            **plan_options)
        self._plan: Plan | None = None

    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    def plan(self, qo_indptr: torch.Tensor, kv_lens: torch.Tensor, block_table: torch.Tensor, **overrides) -> Plan:
        """Plan this step (see :func:`prefixattn.plan`); keyword overrides replace the constructor's options."""
        self._plan = plan(qo_indptr, kv_lens, block_table, **{**self._config, **overrides})
        return self._plan

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, out=None,
            return_lse: bool = False, sinks=None, k_scale=None, v_scale=None):
        """Attention for one layer with the current plan (see :func:`prefixattn.attention`)."""
        if self._plan is None:
            raise ValueError("plan: expected plan() to be called before run() (no plan for this step yet)")
        return attention(q, k_cache, v_cache, self._plan, out=out, return_lse=return_lse, sinks=sinks,
                         k_scale=k_scale, v_scale=v_scale)
