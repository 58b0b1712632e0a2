"""Merge partial attention states ``(v, lse)`` by log-sum-exp (BatchLLM Eq. 1, natural log).

A state with LSE ``-inf`` is empty and carries no weight; a ``+inf`` LSE dominates every finite one; a NaN LSE makes
the merged state NaN (it is never mistaken for an empty one). All arithmetic is
fp32 right after the loads (also keeps bf16 right under the Triton interpreter, which computes on raw bf16 bits).
"""

import triton
import triton.language as tl


@triton.jit
def _weight(s, m):
    # exp(s - m), defined where the subtraction is not: an empty state (-inf) weighs 0, the maximum itself weighs 1
    # (both operands are zeroed there, so +inf - +inf is never even computed).
    is_max = s == m
    w = tl.exp(tl.where(is_max, 0.0, s) - tl.where(is_max, 0.0, m))
    return tl.where(s == float("-inf"), 0.0, w)


@triton.jit
def _head_tile(num_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (token, head tile): the head and dim offsets with their masks.
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < num_heads
    mask_hd = mask_h[:, None] & (offs_d[None, :] < head_dim)
    return offs_h, offs_d, mask_h, mask_hd


@triton.jit
def _load_state(v_ptr, s_ptr, offs_h, offs_d, mask_h, mask_hd, stride_v_h, stride_v_d, stride_s_h):
    # One state of one token (pointers already at it), upcast to fp32; masked heads load as empty states.
    s = tl.load(s_ptr + offs_h * stride_s_h, mask=mask_h, other=float("-inf")).to(tl.float32)
    v = tl.load(v_ptr + offs_h[:, None] * stride_v_h + offs_d[None, :] * stride_v_d, mask=mask_hd,
                other=0.0).to(tl.float32)
    return v, s


@triton.jit
def _store_merged(v_out_ptr, s_out_ptr, acc, w_sum, m, offs_h, offs_d, mask_h, mask_hd,
                  stride_vo_h, stride_vo_d, stride_so_h):
    # Empty only when no state carried weight (w_sum exactly 0): a NaN LSE makes w_sum NaN, and NaN stays NaN.
    empty = w_sum == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, w_sum)[:, None])
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, w_sum)))
    tl.store(v_out_ptr + offs_h[:, None] * stride_vo_h + offs_d[None, :] * stride_vo_d,
             out.to(v_out_ptr.dtype.element_ty), mask=mask_hd)
    tl.store(s_out_ptr + offs_h * stride_so_h, lse, mask=mask_h)


@triton.jit
def merge_states_kernel(
    v_out_ptr,  # [num_tokens, num_heads, head_dim]
    s_out_ptr,  # [num_tokens, num_heads] fp32
    v_ptr,  # [num_tokens, num_states, num_heads, head_dim]
    s_ptr,  # [num_tokens, num_states, num_heads] fp32
    num_states,
    num_heads,
    head_dim,
    stride_vo_t, stride_vo_h, stride_vo_d,
    stride_so_t, stride_so_h,
    stride_v_t, stride_v_n, stride_v_h, stride_v_d,
    stride_s_t, stride_s_n, stride_s_h,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """n-way merge; one program per (token, head tile), one online pass over the states."""
    token = tl.program_id(0).to(tl.int64)
    offs_h, offs_d, mask_h, mask_hd = _head_tile(num_heads=num_heads, head_dim=head_dim, BLOCK_H=BLOCK_H,
                                                 BLOCK_D=BLOCK_D)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n in range(num_states):
        v, s = _load_state(v_ptr=v_ptr + token * stride_v_t + n * stride_v_n,
                           s_ptr=s_ptr + token * stride_s_t + n * stride_s_n, offs_h=offs_h, offs_d=offs_d,
                           mask_h=mask_h, mask_hd=mask_hd, stride_v_h=stride_v_h, stride_v_d=stride_v_d,
                           stride_s_h=stride_s_h)
        m_new = tl.maximum(m, s)
        rescale = _weight(m, m_new)
        w = _weight(s, m_new)
        acc = acc * rescale[:, None] + w[:, None] * v
        w_sum = w_sum * rescale + w
        m = m_new
    _store_merged(v_out_ptr=v_out_ptr + token * stride_vo_t, s_out_ptr=s_out_ptr + token * stride_so_t, acc=acc,
                  w_sum=w_sum, m=m, offs_h=offs_h, offs_d=offs_d, mask_h=mask_h, mask_hd=mask_hd,
                  stride_vo_h=stride_vo_h, stride_vo_d=stride_vo_d, stride_so_h=stride_so_h)


@triton.jit
def merge_state_pair_kernel(
    v_out_ptr,  # [num_tokens, num_heads, head_dim]
    s_out_ptr,  # [num_tokens, num_heads] fp32
    v_a_ptr,  # [num_tokens, num_heads, head_dim]
    s_a_ptr,  # [num_tokens, num_heads] fp32
    v_b_ptr,  # [num_tokens, num_heads, head_dim]
    s_b_ptr,  # [num_tokens, num_heads] fp32
    num_heads,
    head_dim,
    stride_vo_t, stride_vo_h, stride_vo_d,
    stride_so_t, stride_so_h,
    stride_va_t, stride_va_h, stride_va_d,
    stride_sa_t, stride_sa_h,
    stride_vb_t, stride_vb_h, stride_vb_d,
    stride_sb_t, stride_sb_h,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Two-way merge (the cascade/split-k epilogue); one program per (token, head tile)."""
    token = tl.program_id(0).to(tl.int64)
    offs_h, offs_d, mask_h, mask_hd = _head_tile(num_heads=num_heads, head_dim=head_dim, BLOCK_H=BLOCK_H,
                                                 BLOCK_D=BLOCK_D)

    v_a, s_a = _load_state(v_ptr=v_a_ptr + token * stride_va_t, s_ptr=s_a_ptr + token * stride_sa_t, offs_h=offs_h,
                           offs_d=offs_d, mask_h=mask_h, mask_hd=mask_hd, stride_v_h=stride_va_h,
                           stride_v_d=stride_va_d, stride_s_h=stride_sa_h)
    v_b, s_b = _load_state(v_ptr=v_b_ptr + token * stride_vb_t, s_ptr=s_b_ptr + token * stride_sb_t, offs_h=offs_h,
                           offs_d=offs_d, mask_h=mask_h, mask_hd=mask_hd, stride_v_h=stride_vb_h,
                           stride_v_d=stride_vb_d, stride_s_h=stride_sb_h)
    m = tl.maximum(s_a, s_b)
    w_a = _weight(s_a, m)
    w_b = _weight(s_b, m)
    _store_merged(v_out_ptr=v_out_ptr + token * stride_vo_t, s_out_ptr=s_out_ptr + token * stride_so_t,
                  acc=w_a[:, None] * v_a + w_b[:, None] * v_b, w_sum=w_a + w_b, m=m, offs_h=offs_h, offs_d=offs_d,
                  mask_h=mask_h, mask_hd=mask_hd, stride_vo_h=stride_vo_h, stride_vo_d=stride_vo_d,
                  stride_so_h=stride_so_h)
