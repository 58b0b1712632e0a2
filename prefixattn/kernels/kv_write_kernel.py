"""Store new K/V rows into a paged cache at flat slots, in one launch (the engines' ``reshape_and_cache``).

One program = a tile of ``BLOCK_T`` tokens x ``BLOCK_H`` KV heads x ``BLOCK_D`` dims. Slot ``s`` is position
``s % block_size`` of block ``s // block_size``; a negative slot is padding (vLLM's ``PAD_SLOT_ID`` is -1) and a slot
at or past ``num_slots`` would lie outside the cache: neither is written. K and V are converted to the cache's dtype
in the store; nothing else is computed, so NaN rows are copied as they are.
"""

import triton
import triton.language as tl


# num_tokens changes every engine step: specialized, 1 / multiples of 16 / the rest would be three binaries.
@triton.jit(do_not_specialize=["num_tokens"])
def kv_write_kernel(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    slot_mapping_ptr,  # [num_tokens] int32/int64: block * block_size + offset; < 0 = padding, not written
    num_tokens, num_slots, num_kv_heads, head_dim, block_size,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_kc_blk, stride_kc_tok, stride_kc_head, stride_kc_d,
    stride_vc_blk, stride_vc_tok, stride_vc_head, stride_vc_d,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    in_batch = offs_t < num_tokens
    # 64-bit: block id x block stride passes 2^31 elements on large caches (as in the attention kernel).
    slot = tl.load(slot_mapping_ptr + offs_t, mask=in_batch, other=-1).to(tl.int64)
    valid = in_batch & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    tok = slot % block_size
    hd = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    mask = valid[:, None, None] & hd[None, :, :]  # [BLOCK_T, BLOCK_H, BLOCK_D]
    t64 = offs_t.to(tl.int64)[:, None, None]
    h3 = offs_h[None, :, None]
    d3 = offs_d[None, None, :]
    k = tl.load(key_ptr + t64 * stride_k_t + h3 * stride_k_h + d3 * stride_k_d, mask=mask)
    v = tl.load(value_ptr + t64 * stride_v_t + h3 * stride_v_h + d3 * stride_v_d, mask=mask)
    blk3 = blk[:, None, None]
    tok3 = tok[:, None, None]
    tl.store(k_cache_ptr + blk3 * stride_kc_blk + tok3 * stride_kc_tok + h3 * stride_kc_head + d3 * stride_kc_d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk3 * stride_vc_blk + tok3 * stride_vc_tok + h3 * stride_vc_head + d3 * stride_vc_d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
