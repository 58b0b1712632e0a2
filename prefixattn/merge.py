"""Merging partial attention states by log-sum-exp: checked launchers for :mod:`prefixattn.kernels.merge_states`."""

from __future__ import annotations

import torch
import triton

from prefixattn.autotune.config_space import block_d
from prefixattn.autotune.lookup import heuristic_merge_config
from prefixattn.kernels.merge_states import merge_state_pair_kernel, merge_states_kernel
from prefixattn.validation import SUPPORTED_DTYPES, check_kernel_device, check_same_device, check_tensor

def _merge_tiles(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_D, num_warps)`` of the merge kernels: the tuning chain's merge rule
    (:func:`prefixattn.autotune.lookup.heuristic_merge_config`, which compile-check compiles), the padded head
    dimension of the fused kernel."""
    cfg = heuristic_merge_config(head_dim, num_heads)
    return cfg.block_h, block_d(head_dim), cfg.num_warps


def _check_state(v_name: str, v: torch.Tensor, s_name: str, s: torch.Tensor, v_ndim: int) -> None:
    check_tensor(v_name, v, ndim=v_ndim, dtypes=SUPPORTED_DTYPES)
    check_tensor(s_name, s, ndim=v_ndim - 1, dtypes=(torch.float32,))
    if tuple(s.shape) != tuple(v.shape[:-1]):
        raise ValueError(f"{s_name}: expected shape {tuple(v.shape[:-1])} (the shape of {v_name} without head_dim), "
                         f"got {tuple(s.shape)}")
    if v.shape[-1] < 1:
        raise ValueError(f"{v_name}: expected head_dim >= 1 in the last dim, got {v.shape[-1]}")
    check_kernel_device(v_name, v)


def _prepare_out(out, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v_shape, s_shape = like.shape, like.shape[:-1]
    if out is None:
        return (torch.empty(v_shape, dtype=like.dtype, device=like.device),
                torch.empty(s_shape, dtype=torch.float32, device=like.device))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"out: expected a (v_out, s_out) pair of tensors, got {type(out).__name__}")
    v_out, s_out = out
    check_tensor("out[0]", v_out, dtypes=(like.dtype,))
    check_tensor("out[1]", s_out, dtypes=(torch.float32,))
    if tuple(v_out.shape) != tuple(v_shape):
        raise ValueError(f"out[0]: expected shape {tuple(v_shape)}, got {tuple(v_out.shape)}")
    if tuple(s_out.shape) != tuple(s_shape):
        raise ValueError(f"out[1]: expected shape {tuple(s_shape)}, got {tuple(s_out.shape)}")
    check_same_device(v=like, **{"out[0]": v_out, "out[1]": s_out})
    return v_out, s_out


def merge_states(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, *, out=None):
    """Merge two partial attention states over disjoint KV sets into the state over their union.

    ``m = max(s_a, s_b); w = exp(s - m); v = (w_a v_a + w_b v_b) / (w_a + w_b); s = m + log(w_a + w_b)``.

    The LSE is the **natural-log** log-sum-exp of the scaled logits (FlashInfer's ``merge_state`` uses base 2:
    multiply its LSE by ``ln 2`` before passing it here). An empty state has LSE ``-inf`` and weighs nothing; two
    empty states merge to ``(0, -inf)``, never NaN.

    Parameters
    ----------
    v_a, v_b : Tensor, ``[num_tokens, num_heads, head_dim]``, fp16/bf16/fp32, any strides
    s_a, s_b : Tensor, ``[num_tokens, num_heads]``, fp32, any strides
    out : (Tensor, Tensor), optional
        Preallocated ``(v_out, s_out)`` with the shapes above (``v_out`` in the dtype of ``v_a``).

    Returns
    -------
    (v, s) : ``[num_tokens, num_heads, head_dim]`` in the dtype of ``v_a``, and ``[num_tokens, num_heads]`` fp32.

    Examples
    --------
    >>> v, s = merge_states(v_prefix, lse_prefix, v_suffix, lse_suffix)
    """
    _check_state("v_a", v_a, "s_a", s_a, 3)
    _check_state("v_b", v_b, "s_b", s_b, 3)
    if v_b.shape != v_a.shape:
        raise ValueError(f"v_b: expected the shape of v_a {tuple(v_a.shape)}, got {tuple(v_b.shape)}")
    if v_b.dtype != v_a.dtype:
        raise ValueError(f"v_b: expected the dtype of v_a ({v_a.dtype}), got {v_b.dtype}")
    check_same_device(v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)
    v_out, s_out = _prepare_out(out, v_a)
    num_tokens, num_heads, head_dim = v_a.shape
    if num_tokens == 0 or num_heads == 0:
        return v_out, s_out
    block_h, tile_d, num_warps = _merge_tiles(num_heads, head_dim)
    merge_state_pair_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        v_out_ptr=v_out, s_out_ptr=s_out, v_a_ptr=v_a, s_a_ptr=s_a, v_b_ptr=v_b, s_b_ptr=s_b,
        num_heads=num_heads, head_dim=head_dim,
        stride_vo_t=v_out.stride(0), stride_vo_h=v_out.stride(1), stride_vo_d=v_out.stride(2),
        stride_so_t=s_out.stride(0), stride_so_h=s_out.stride(1),
        stride_va_t=v_a.stride(0), stride_va_h=v_a.stride(1), stride_va_d=v_a.stride(2),
        stride_sa_t=s_a.stride(0), stride_sa_h=s_a.stride(1),
        stride_vb_t=v_b.stride(0), stride_vb_h=v_b.stride(1), stride_vb_d=v_b.stride(2),
        stride_sb_t=s_b.stride(0), stride_sb_h=s_b.stride(1),
        BLOCK_H=block_h, BLOCK_D=tile_d, num_warps=num_warps,
    )
    return v_out, s_out


def merge_states_n(v: torch.Tensor, s: torch.Tensor, *, out=None):
    """Merge ``num_states`` partial attention states per (token, head) in one pass (natural-log LSE).

    Parameters
    ----------
    v : Tensor, ``[num_tokens, num_states, num_heads, head_dim]``, fp16/bf16/fp32, any strides
    s : Tensor, ``[num_tokens, num_states, num_heads]``, fp32, any strides
    out : (Tensor, Tensor), optional
        Preallocated ``(v_out [num_tokens, num_heads, head_dim], s_out [num_tokens, num_heads])``.

    Returns
    -------
    (v, s) : merged ``[num_tokens, num_heads, head_dim]`` in the dtype of ``v``, and ``[num_tokens, num_heads]``
    fp32. With ``num_states == 0`` or only empty states a row is ``(0, -inf)``.

    Examples
    --------
    >>> v_merged, s_merged = merge_states_n(torch.stack([v0, v1, v2], 1), torch.stack([s0, s1, s2], 1))
    """
    _check_state("v", v, "s", s, 4)
    check_same_device(v=v, s=s)
    num_tokens, num_states, num_heads, head_dim = v.shape
    like = v.select(1, 0) if num_states else v.new_empty((num_tokens, num_heads, head_dim))
    v_out, s_out = _prepare_out(out, like)
    if num_tokens == 0 or num_heads == 0:
        return v_out, s_out
    block_h, tile_d, num_warps = _merge_tiles(num_heads, head_dim)
    merge_states_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        v_out_ptr=v_out, s_out_ptr=s_out, v_ptr=v, s_ptr=s,
        num_states=num_states, num_heads=num_heads, head_dim=head_dim,
        stride_vo_t=v_out.stride(0), stride_vo_h=v_out.stride(1), stride_vo_d=v_out.stride(2),
        stride_so_t=s_out.stride(0), stride_so_h=s_out.stride(1),
        stride_v_t=v.stride(0), stride_v_n=v.stride(1), stride_v_h=v.stride(2), stride_v_d=v.stride(3),
        stride_s_t=s.stride(0), stride_s_n=s.stride(1), stride_s_h=s.stride(2),
        BLOCK_H=block_h, BLOCK_D=tile_d, num_warps=num_warps,
    )
    return v_out, s_out
