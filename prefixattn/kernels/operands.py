"""What the attention kernel's parts pass around, and the arithmetic they all share: its operands packed into named
tuples (pointers and strides), head-vector pointers, the paged cache's addressing, the soft cap's tanh and the window's
start. Used by :mod:`prefixattn.kernels.prefix_attention_kernel` and the NaN guard's redos
(:mod:`prefixattn.kernels.nan_redo`).

The kernel packs its pointers and strides into the tuples once, and its helpers take one group where they took a
dozen arguments. A tuple exists only in the frontend (it is its elements): the TTGIR holds the same ops as with the
elements passed one by one, and the PTX / AMDGCN the same instructions once debug info is set aside (sm90 and
gfx942, fp16 and fp32, every compile-check variant, Triton 3.6 and 3.9). Named tuples as jit-function arguments
compile and interpret alike on Triton 3.6-3.9.
"""

from typing import NamedTuple

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


class RowsHeadsDim(NamedTuple):
    """A ``[rows, heads, head_dim]`` tensor (q, out, the workspace's partial outputs)."""

    ptr: tl.tensor
    stride_t: tl.tensor
    stride_h: tl.tensor
    stride_d: tl.tensor


class RowsHeads(NamedTuple):
    """A ``[rows, heads]`` fp32 tensor (the LSEs, the workspace's partial LSEs)."""

    ptr: tl.tensor
    stride_t: tl.tensor
    stride_h: tl.tensor


class PagedKV(NamedTuple):
    """The paged K/V cache: K ``[num_blocks, block_size, num_kv_heads, head_dim]`` and V ``[..., v_head_dim]`` (dtype
    of q or fp8) and the block table ``[num_requests, max_blocks]`` that maps a request's KV positions to blocks."""

    k_ptr: tl.tensor
    v_ptr: tl.tensor
    block_table_ptr: tl.tensor
    stride_bt_r: tl.tensor
    block_size: tl.tensor
    head_dim: tl.tensor
    v_head_dim: tl.tensor  # V's head size (and the output's)
    stride_k_blk: tl.tensor
    stride_k_tok: tl.tensor
    stride_k_head: tl.tensor
    stride_k_d: tl.tensor
    stride_v_blk: tl.tensor
    stride_v_tok: tl.tensor
    stride_v_head: tl.tensor
    stride_v_d: tl.tensor


class ScoreRule(NamedTuple):
    """How a q.k dot becomes a base-2 logit, and which keys a query sees."""

    qk_scale: tl.tensor  # sm_scale * log2(e); with a soft cap sm_scale / c (x the K scale)
    soft_cap_log2: tl.tensor  # c * log2(e) (used only when HAS_SOFT_CAP)
    window_left: tl.tensor  # W: the query at position p sees keys p - W .. p (used only when HAS_WINDOW)


class WorkTables(NamedTuple):
    """The plan's int32 tables (layout: :mod:`prefixattn.kernels.layout`) and its merge counters."""

    items_ptr: tl.tensor  # [num_items, ITEM_FIELDS] work items, class by class
    gather_ptr: tl.tensor  # [num_gather, GATHER_FIELDS] packed rows of SHARED items
    mrows_ptr: tl.tensor  # [num_mrows, MROW_FIELDS] merge rows
    counters_ptr: tl.tensor  # [num_mrows, num_qo_heads] arrivals; 0 before and after every layer


@triton.jit
def _vec_ptrs(t, rows, heads, offs_d):
    """``[len(rows), BLOCK_D]`` pointers to the head vectors ``t[rows[i], heads[i], :]`` of a RowsHeadsDim."""
    return t.ptr + rows[:, None] * t.stride_t + heads[:, None] * t.stride_h + offs_d[None, :] * t.stride_d


@triton.jit
def _lse_ptrs(t, rows, heads):
    """Pointers to ``t[rows[i], heads[i]]`` of a RowsHeads."""
    return t.ptr + rows * t.stride_t + heads * t.stride_h


@triton.jit
def _page_and_slot(pos, block_size, PAGE_SIZE: tl.constexpr):
    """Block-table column and slot of KV positions ``pos`` (int32, never negative). ``PAGE_SIZE`` > 0 is the block
    size as a compile-time constant (a shift and a mask for the sizes engines use); 0 reads the run-time
    ``block_size``. Unsigned: a signed division rounds toward zero and costs a fix-up of the sign per position
    (sm_90 SASS: SHF + LEA.HI + SHF for the column, + LOP3 + IADD for the slot, on every K/V address of a tile)."""
    upos = tl.cast(pos, tl.uint32)
    if PAGE_SIZE > 0:
        return (upos // PAGE_SIZE).to(tl.int32), (upos % PAGE_SIZE).to(tl.int32)
    else:
        size = tl.cast(block_size, tl.uint32)
        return (upos // size).to(tl.int32), (upos % size).to(tl.int32)


@triton.jit
def _load_block_ids(block_row_ptr, pos, kv_hi, block_size, PAGE_SIZE: tl.constexpr):
    """Physical block ids of KV positions ``pos`` (0 past ``kv_hi``: never dereferenced unmasked)."""
    page, _ = _page_and_slot(pos=pos, block_size=block_size, PAGE_SIZE=PAGE_SIZE)
    return tl.load(block_row_ptr + page, mask=pos < kv_hi, other=0)


@triton.jit
def _tanh(x):
    """tanh from exp2 (portable across Triton versions and backends): +-1 at the extremes, NaN stays NaN."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _first_key_in_window(kv_start, kv_end, q_pos0, window_left):
    """Where the window of an item's first row starts, clipped to [kv_start, kv_end]: every later row's window starts
    later, so no row of the item sees a key left of it."""
    return tl.minimum(tl.maximum(kv_start, q_pos0 - window_left), kv_end)


@triton.jit
def _kv_rows_at(
    kv,  # PagedKV
    block_row_ptr,  # [max_blocks]
    key, kv_head,
    offs_d, mask_d,  # [BLOCK_D] K's dims and the live ones
    offs_dv, mask_dv,  # [BLOCK_DV] V's dims and the live ones
    PAGE_SIZE: tl.constexpr,
):
    """The K row ``[BLOCK_D]`` and V row ``[BLOCK_DV]`` (cache dtype) of one KV position: the NaN guard's redos read one
    key at a time."""
    page, slot = _page_and_slot(pos=key, block_size=kv.block_size, PAGE_SIZE=PAGE_SIZE)
    blk = tl.load(block_row_ptr + page).to(tl.int64)
    slot = slot.to(tl.int64)
    kv_head = kv_head.to(tl.int64)
    k = tl.load(kv.k_ptr + blk * kv.stride_k_blk + slot * kv.stride_k_tok + kv_head * kv.stride_k_head
                + offs_d * kv.stride_k_d, mask=mask_d, other=0.0)
    v = tl.load(kv.v_ptr + blk * kv.stride_v_blk + slot * kv.stride_v_tok + kv_head * kv.stride_v_head
                + offs_dv * kv.stride_v_d, mask=mask_dv, other=0.0)
    return k, v
