"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi-K2) in the absorbed form over a paged latent cache,
with shared prefixes: the fused kernel's work items, tables, split-k and in-kernel merge
(:mod:`prefixattn.kernels.prefix_attention_kernel`), with an MLA program.

In the absorbed form every query head attends one KV head, the latent: a token's cache row is ``[kv_lora_rank]``
latent values then ``[rope_dim]`` rotary key values (576 = 512 + 64 for DeepSeek-V3). The query is the head's
``q_nope @ W_UK`` (``[kv_lora_rank]``) then its rotary part (``[rope_dim]``); the score is the sum of two dots,
latent and rope, and the value is the latent itself: each KV tile is loaded once and serves both the score and the
value dot. The output is ``[kv_lora_rank]`` per head (the layer applies ``W_UV``).

One program = (work item, head block): ``HEADS_PER_PROGRAM`` query heads (the host's ``group``) of the item's rows
packed into M, lane ``m`` is row ``m // group`` and head ``head_block * group + m % group``: the planner sees the
head blocks as KV heads (it counts programs by them; the cache has one head, which every head block reads). A
SHARED item is one GEMM over (request, head) rows against one copy of the node's latent; a SUFFIX item is a tile of
one request's rows, causal where its range reaches them.

No soft cap, window, sinks or NaN guard (no MLA model uses them). ``HAS_KV_SCALE``: one per-tensor scale of an fp8
latent cache, read by pointer, on the score and on the output (linear, so no per-tile cost).
"""

import triton
import triton.language as tl

from prefixattn.kernels import layout as L
from prefixattn.kernels.operands import PagedKV, RowsHeads, RowsHeadsDim, WorkTables, _load_block_ids, _page_and_slot
from prefixattn.kernels.epilogue import _normalized_state, _store_state
from prefixattn.kernels.prefix_attention_kernel import UNSPECIALIZED_ARGS, _item_lanes


@triton.jit
def _e5m2_to_fp16(x):
    """e5m2 values as fp16, exactly: an e5m2 byte is the high byte of the fp16 of the same value. By hand because
    Triton 3.6 converts e5m2 on sm_80 with instructions sm_80 lacks (ptxas: ``mul.bf16x2`` "requires .target sm_90"
    to bf16, ``cvt`` ".e5m2x2 requires .target sm_89" to fp16; every MLA class, compile-check with a fresh cache)."""
    return (x.to(tl.uint8, bitcast=True).to(tl.uint16) << 8).to(tl.float16, bitcast=True)


@triton.jit
def _mla_range(
    acc, m_i, l_i,  # running state: [BLOCK_M, BLOCK_C] fp32, [BLOCK_M] fp32 (log2 units), [BLOCK_M] fp32
    q_c,  # [BLOCK_M, BLOCK_C] the absorbed query's latent part, in the dot dtype
    q_r,  # [BLOCK_M, BLOCK_R] its rotary part
    q_pos,  # [BLOCK_M] KV position of each lane's query (its last visible key when APPLY_CAUSAL)
    kv,  # PagedKV over the latent cache (k_ptr = v_ptr; head_dim = kv_lora_rank)
    rope_ptr,  # kv.k_ptr + kv_lora_rank * stride_d: where each token's rotary key starts
    rope_dim, block_row_ptr, kv_lo, kv_hi, qk_scale,
    HAS_MASKED_KEYS: tl.constexpr, APPLY_CAUSAL: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Online softmax over KV positions [kv_lo, kv_hi) as :func:`~prefixattn.kernels.prefix_attention_kernel.
    _attend_range` (its masking contract, its raw-score exponent for whole tiles, its block ids one tile ahead), with
    the score as two dots and the latent tile as the value."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_c = offs_c < kv.head_dim
    mask_r = offs_r < rope_dim
    blk_next = _load_block_ids(block_row_ptr=block_row_ptr, pos=kv_lo + offs_n, kv_hi=kv_hi,
                               block_size=kv.block_size, PAGE_SIZE=PAGE_SIZE)
    if HAS_MASKED_KEYS:
        raw_scale = 1.0  # the scores are scaled (and masked) before the exponent
    else:
        raw_scale = qk_scale
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n
        blk = blk_next.to(tl.int64)  # 64-bit: block id x block stride passes 2^31 elements on large caches
        blk_next = _load_block_ids(block_row_ptr=block_row_ptr, pos=pos + BLOCK_N, kv_hi=kv_hi,
                                   block_size=kv.block_size, PAGE_SIZE=PAGE_SIZE)
        _, slot = _page_and_slot(pos=pos, block_size=kv.block_size, PAGE_SIZE=PAGE_SIZE)
        off = blk * kv.stride_k_blk + slot.to(tl.int64) * kv.stride_k_tok
        if HAS_MASKED_KEYS:
            in_range = pos < kv_hi
            c_mask = in_range[:, None] & mask_c[None, :]
            r_mask = in_range[:, None] & mask_r[None, :]
        else:
            c_mask = mask_c[None, :]
            r_mask = mask_r[None, :]
        c = tl.load(kv.k_ptr + off[:, None] + offs_c[None, :] * kv.stride_k_d, mask=c_mask,
                    other=0.0)  # [BLOCK_N, BLOCK_C]: the score's latent keys and the values
        r = tl.load(rope_ptr + off[:, None] + offs_r[None, :] * kv.stride_k_d, mask=r_mask,
                    other=0.0)  # [BLOCK_N, BLOCK_R]
        if USE_FP32_DOT:
            c = c.to(tl.float32)
            s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
            s = tl.dot(q_r, tl.trans(r.to(tl.float32)), acc=s, input_precision="ieee")
        else:
            if c.dtype == tl.float8e5:
                c = _e5m2_to_fp16(c)
                r = _e5m2_to_fp16(r)
            c = c.to(q_c.dtype)
            s = tl.dot(q_c, tl.trans(c))
            s = tl.dot(q_r, tl.trans(r.to(q_c.dtype)), acc=s)
        if HAS_MASKED_KEYS:
            s = s * qk_scale
            visible = in_range[None, :]
            if APPLY_CAUSAL:
                visible = visible & (pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * raw_scale)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that saw nothing: exp2 gives 0, not NaN
        p = tl.math.exp2(s * raw_scale - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS)
def mla_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, kv_lora_rank], dtype of q
    lse_ptr,  # [num_tokens, num_heads] fp32 (written only when HAS_LSE)
    ws_o_ptr,  # [num_ws_rows, num_heads, kv_lora_rank] fp32 partial outputs
    ws_lse_ptr,  # [num_ws_rows, num_heads] fp32 partial LSEs (natural log)
    counters_ptr,  # [num_mrows, num_heads] int32 arrivals; 0 on entry, left at 0
    q_ptr,  # [num_tokens, num_heads, kv_lora_rank + rope_dim] absorbed query (q_nope @ W_UK) then rotary query
    kv_cache_ptr,  # [num_blocks, block_size, kv_lora_rank + rope_dim] latent then rotary key; dtype of q or fp8
    kv_scale_ptr,  # [1] fp32 dequantization scale of an fp8 latent (read only when HAS_KV_SCALE)
    item_range_ptr,  # [RANGE_FIELDS] int32: this launch's class, items [first, end); programs past it exit
    items_ptr,  # [num_items, ITEM_FIELDS] int32 work items
    gather_ptr,  # [num_gather, GATHER_FIELDS] int32 packed rows of SHARED items
    mrows_ptr,  # [num_mrows, MROW_FIELDS] int32 merge rows
    block_table_ptr,  # [num_requests, max_blocks] int32/int64
    num_head_blocks,  # programs per item: num_heads // group
    group,  # query heads per program
    kv_lora_rank,
    rope_dim,
    block_size,
    qk_scale,  # sm_scale * log2(e) (x a float kv_scale)
    kv_scale,  # float latent scale, times *kv_scale_ptr (used only when HAS_KV_SCALE)
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    stride_q_t, stride_q_h, stride_q_d,
    stride_kv_blk, stride_kv_tok, stride_kv_d,
    stride_bt_r,
    IS_SHARED: tl.constexpr,  # the launch's class: SHARED items (else SUFFIX items)
    HAS_LSE: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr,
    USE_FP32_DOT: tl.constexpr,
    IS_HIP: tl.constexpr,  # as in prefix_attention_kernel
    USE_L2_FENCES: tl.constexpr,  # as in prefix_attention_kernel
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # (query row x head of the block) lanes of one item
    BLOCK_N: tl.constexpr,  # KV positions per step
    BLOCK_C: tl.constexpr,  # latent lanes (kv_lora_rank, padded to a power of two)
    BLOCK_R: tl.constexpr,  # rotary lanes (rope_dim, padded to a power of two, at least 16)
):
    """Grid ``(capacity_items * num_head_blocks,)`` for one work class: the head blocks of one item are adjacent (they
    read the same latent tiles, from L2 after the first)."""
    pid = tl.program_id(0)
    item = tl.load(item_range_ptr + L.RANGE_FIRST) + pid // num_head_blocks
    head_block = pid % num_head_blocks
    if item >= tl.load(item_range_ptr + L.RANGE_END):
        return
    out = RowsHeadsDim(ptr=out_ptr, stride_t=stride_o_t, stride_h=stride_o_h, stride_d=stride_o_d)
    lse = RowsHeads(ptr=lse_ptr, stride_t=stride_lse_t, stride_h=stride_lse_h)
    ws_o = RowsHeadsDim(ptr=ws_o_ptr, stride_t=stride_ws_t, stride_h=stride_ws_h, stride_d=stride_ws_d)
    ws_lse = RowsHeads(ptr=ws_lse_ptr, stride_t=stride_wl_t, stride_h=stride_wl_h)
    kv = PagedKV(k_ptr=kv_cache_ptr, v_ptr=kv_cache_ptr, block_table_ptr=block_table_ptr, stride_bt_r=stride_bt_r,
                 block_size=block_size, head_dim=kv_lora_rank, v_head_dim=kv_lora_rank,
                 stride_k_blk=stride_kv_blk, stride_k_tok=stride_kv_tok, stride_k_head=0, stride_k_d=stride_kv_d,
                 stride_v_blk=stride_kv_blk, stride_v_tok=stride_kv_tok, stride_v_head=0, stride_v_d=stride_kv_d)
    work = WorkTables(items_ptr=items_ptr, gather_ptr=gather_ptr, mrows_ptr=mrows_ptr, counters_ptr=counters_ptr)

    it, req, kv_start, kv_end, _, q_pos0, row, head, mask_m, g, tok = _item_lanes(
        work=work, item=item, head_block=head_block, group=group, IS_SHARED=IS_SHARED, BLOCK_M=BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h  # [BLOCK_M, 1]
    mask_mc = mask_m[:, None] & (offs_c[None, :] < kv_lora_rank)
    q_c = tl.load(q_row + offs_c[None, :] * stride_q_d, mask=mask_mc, other=0.0)
    q_r = tl.load(q_row + (kv_lora_rank + offs_r[None, :]) * stride_q_d,
                  mask=mask_m[:, None] & (offs_r[None, :] < rope_dim), other=0.0)
    if USE_FP32_DOT:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)
    q_pos = q_pos0 + row
    if HAS_KV_SCALE:
        # A negative scale, which no host check can see without a synchronization, makes the output NaN (the KV
        # loops need qk_scale >= 0).
        scale_t = tl.load(kv_scale_ptr)
        qk_scale = tl.where(scale_t < 0, float("nan"), qk_scale * scale_t)
        kv_scale = kv_scale * scale_t

    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    block_row_ptr = block_table_ptr + req * stride_bt_r
    rope_ptr = kv_cache_ptr + kv_lora_rank * stride_kv_d
    if IS_SHARED:
        # A shared node ends at or before its requests' first query position: only the last tile's keys past the
        # node's end are masked.
        kv_mid = kv_start + ((kv_end - kv_start) // BLOCK_N) * BLOCK_N
    else:
        # Positions < q_pos0 + 1 are visible to every row of the tile: whole tiles there skip the causal mask.
        kv_mid = tl.minimum(tl.maximum(q_pos0 + 1, kv_start), kv_end)
        kv_mid = kv_start + ((kv_mid - kv_start) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _mla_range(
        acc=acc, m_i=m_i, l_i=l_i, q_c=q_c, q_r=q_r, q_pos=q_pos, kv=kv, rope_ptr=rope_ptr, rope_dim=rope_dim,
        block_row_ptr=block_row_ptr, kv_lo=kv_start, kv_hi=kv_mid, qk_scale=qk_scale, HAS_MASKED_KEYS=False,
        APPLY_CAUSAL=False, USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
        BLOCK_R=BLOCK_R)
    acc, m_i, l_i = _mla_range(
        acc=acc, m_i=m_i, l_i=l_i, q_c=q_c, q_r=q_r, q_pos=q_pos, kv=kv, rope_ptr=rope_ptr, rope_dim=rope_dim,
        block_row_ptr=block_row_ptr, kv_lo=kv_mid, kv_hi=kv_end, qk_scale=qk_scale, HAS_MASKED_KEYS=True,
        APPLY_CAUSAL=not IS_SHARED, USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
        BLOCK_R=BLOCK_R)

    o, lse_row = _normalized_state(acc=acc, m_i=m_i, l_i=l_i)
    if HAS_KV_SCALE:
        o = o * kv_scale  # the latent is the value too: linear, partial states merge the same either way
    _store_state(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=lse_ptr, it=it, g=g, o=o,
                 lse_row=lse_row, tok=tok, head=head, row=row, mask_m=mask_m, mask_md=mask_mc,
                 offs_d=offs_c,
                 num_qo_heads=num_head_blocks * group, head_dim=kv_lora_rank, IS_SHARED=IS_SHARED, HAS_LSE=HAS_LSE,
                 HAS_SINKS=False, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES)
