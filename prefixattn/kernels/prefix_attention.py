"""Horizontally-fused prefix-shared paged attention: shared-prefix tiles, per-request suffix tiles and their merge in
ONE launch (BatchLLM section 4.4; the math of FlashInfer cascade / Hydragen, without their extra launches).

One program = (work item, KV head). A work item (built by :func:`prefixattn.plan`) is either
* SHARED: every query row of every request under a shared prefix node (gathered rows, x GQA group in M) against ONE
  copy of the node's KV range - a matrix-matrix product on tensor cores; or
* SUFFIX: a tile of one request's contiguous query rows (x GQA group in M, decode-shaped as vLLM's unified attention)
  against that request's own KV range, causal where the range reaches its query positions.
Both kinds run the same inner loop (:func:`_attend_range`) with their own tile sizes. An item either writes straight
to ``out`` (a request whose rows have a single state: plain paged attention) or writes an fp32 partial state
``(o, lse)`` to the workspace and reports to its merge units; the last item to report merges (see
:func:`_report_and_merge`).

All arithmetic is fp32 right after each load (the interpreter computes bf16 on raw bits); ``tl.dot`` gets the input
dtype on GPUs (tensor cores) unless ``USE_FP32_DOT``. Softmax runs in base 2 (``exp2``, scores pre-scaled by
``sm_scale * log2(e)``); LSEs are stored in natural log.
"""

import triton
import triton.language as tl

from prefixattn.kernels.merge_states import _weight

# Work-item kinds.
KIND_SHARED: tl.constexpr = tl.constexpr(0)
KIND_SUFFIX: tl.constexpr = tl.constexpr(1)

# Columns of the int32 work-item table ``items[num_items, ITEM_FIELDS]``.
ITEM_KIND: tl.constexpr = tl.constexpr(0)
ITEM_REQ: tl.constexpr = tl.constexpr(1)  # block-table row whose blocks hold the item's KV range
ITEM_KV_START: tl.constexpr = tl.constexpr(2)
ITEM_KV_END: tl.constexpr = tl.constexpr(3)
ITEM_ROW_START: tl.constexpr = tl.constexpr(4)  # SHARED: offset into `gather`; SUFFIX: first token index
ITEM_NUM_ROWS: tl.constexpr = tl.constexpr(5)
ITEM_Q_POS: tl.constexpr = tl.constexpr(6)  # row j of the item sees KV positions <= q_pos + j
ITEM_DEST: tl.constexpr = tl.constexpr(7)  # SUFFIX: workspace row of its first row, or -1 = straight to `out`
ITEM_UNITS_START: tl.constexpr = tl.constexpr(8)  # slice of `item_units`: merge units this item reports to
ITEM_UNITS_END: tl.constexpr = tl.constexpr(9)
ITEM_FIELDS: tl.constexpr = tl.constexpr(10)

# Columns of ``gather[num_gather, GATHER_FIELDS]`` (packed rows of SHARED items).
GATHER_TOKEN: tl.constexpr = tl.constexpr(0)
GATHER_WS_ROW: tl.constexpr = tl.constexpr(1)
GATHER_FIELDS: tl.constexpr = tl.constexpr(2)

# Columns of ``units[num_units, UNIT_FIELDS]``: a merge unit is a run of one request's rows (at most one suffix tile)
# whose states live at ws rows ``ws_base + state * num_rows + row``.
UNIT_TOKEN_START: tl.constexpr = tl.constexpr(0)
UNIT_NUM_ROWS: tl.constexpr = tl.constexpr(1)
UNIT_WS_BASE: tl.constexpr = tl.constexpr(2)
UNIT_NUM_STATES: tl.constexpr = tl.constexpr(3)
UNIT_EXPECTED: tl.constexpr = tl.constexpr(4)  # reports (items x units) that must arrive before the merge
UNIT_FIELDS: tl.constexpr = tl.constexpr(5)

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend_range(
    acc, m_i, l_i,  # running state: [BLOCK_M, BLOCK_D] fp32, [BLOCK_M] fp32 (log2 units), [BLOCK_M] fp32
    q,  # [BLOCK_M, BLOCK_D] query tile in the dot dtype (scores are scaled after the dot: one rounding less)
    q_pos,  # [BLOCK_M] last visible KV position of each lane (used only when APPLY_CAUSAL)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_row_ptr,  # [max_blocks] the block-table row of the item's representative request
    kv_head, kv_lo, kv_hi, block_size, head_dim, qk_scale,
    stride_k_blk, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_blk, stride_v_tok, stride_v_head, stride_v_d,
    APPLY_CAUSAL: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Online softmax over KV positions [kv_lo, kv_hi), fp32 accumulation; the only copy of the attention math."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    k_head = kv_head.to(tl.int64) * stride_k_head
    v_head = kv_head.to(tl.int64) * stride_v_head
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n
        in_range = pos < kv_hi
        # 64-bit: block id x block stride passes 2^31 elements on large caches (vllm#47671, sglang#20389).
        blk = tl.load(block_row_ptr + pos // block_size, mask=in_range, other=0).to(tl.int64)
        slot = (pos % block_size).to(tl.int64)
        k_off = blk * stride_k_blk + slot * stride_k_tok + k_head
        v_off = blk * stride_v_blk + slot * stride_v_tok + v_head
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_k_d,
                    mask=in_range[None, :] & mask_d[:, None], other=0.0).to(tl.float32)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_v_d,
                    mask=in_range[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        if USE_FP32_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        s = s * qk_scale
        visible = in_range[None, :]
        if APPLY_CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A lane that has seen nothing yet keeps m = -inf; shift by 0 there so exp2 gives 0, never NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge_unit(
    out_ptr, lse_ptr, ws_o_ptr, ws_lse_ptr, units_ptr,
    unit, kv_head, group,
    head_dim,
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    HAS_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Online log-sum-exp merge of all states of one unit (<= BLOCK_M // group rows) into ``out`` / ``lse``."""
    u = units_ptr + unit * UNIT_FIELDS
    token_start = tl.load(u + UNIT_TOKEN_START).to(tl.int64)
    num_rows = tl.load(u + UNIT_NUM_ROWS)
    ws_base = tl.load(u + UNIT_WS_BASE).to(tl.int64)
    num_states = tl.load(u + UNIT_NUM_STATES)
    offs_m = tl.arange(0, BLOCK_M)
    row = offs_m // group
    head = kv_head * group + offs_m % group
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (row < num_rows) & (offs_m < (BLOCK_M // group) * group)
    mask_md = mask_m[:, None] & (offs_d[None, :] < head_dim)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for state in range(num_states):
        ws_row = ws_base + state * num_rows + row
        # volatile: the states were written by other programs; read them from L2, not a stale L1 line.
        s = tl.load(ws_lse_ptr + ws_row * stride_wl_t + head * stride_wl_h, mask=mask_m, other=float("-inf"),
                    volatile=True)
        v = tl.load(ws_o_ptr + ws_row[:, None] * stride_ws_t + head[:, None] * stride_ws_h
                    + offs_d[None, :] * stride_ws_d, mask=mask_md, other=0.0, volatile=True)
        m_new = tl.maximum(m, s)
        rescale = _weight(s=m, m=m_new)
        w = _weight(s=s, m=m_new)
        acc = acc * rescale[:, None] + w[:, None] * v
        w_sum = w_sum * rescale + w
        m = m_new
    nonempty = w_sum > 0.0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, w_sum, 1.0)[:, None], 0.0)
    tok = token_start + row
    tl.store(out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
             o.to(out_ptr.dtype.element_ty), mask=mask_md)
    if HAS_LSE:
        lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, w_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_lse_t + head * stride_lse_h, lse, mask=mask_m)


@triton.jit
def _run_item(
    out_ptr, lse_ptr, ws_o_ptr, ws_lse_ptr, counters_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr,
    items_ptr, gather_ptr, item_units_ptr, units_ptr, block_table_ptr,
    item, kv_head, num_kv_heads, group, head_dim, block_size, qk_scale,
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_blk, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_blk, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_r,
    IS_SHARED: tl.constexpr, HAS_LSE: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MERGE_BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    it = items_ptr + item * ITEM_FIELDS
    req = tl.load(it + ITEM_REQ).to(tl.int64)
    kv_start = tl.load(it + ITEM_KV_START)
    kv_end = tl.load(it + ITEM_KV_END)
    row_start = tl.load(it + ITEM_ROW_START).to(tl.int64)
    num_rows = tl.load(it + ITEM_NUM_ROWS)
    q_pos0 = tl.load(it + ITEM_Q_POS)
    dest = tl.load(it + ITEM_DEST).to(tl.int64)
    units_start = tl.load(it + ITEM_UNITS_START)
    units_end = tl.load(it + ITEM_UNITS_END)

    # M packs (query row x GQA head): lane m is row m // group, head kv_head * group + m % group.
    offs_m = tl.arange(0, BLOCK_M)
    row = offs_m // group
    head = kv_head * group + offs_m % group
    mask_m = (row < num_rows) & (offs_m < (BLOCK_M // group) * group)
    offs_d = tl.arange(0, BLOCK_D)
    mask_md = mask_m[:, None] & (offs_d[None, :] < head_dim)
    if IS_SHARED:
        g = gather_ptr + (row_start + row) * GATHER_FIELDS
        tok = tl.load(g + GATHER_TOKEN, mask=mask_m, other=0).to(tl.int64)
        ws_row = tl.load(g + GATHER_WS_ROW, mask=mask_m, other=0).to(tl.int64)
    else:
        tok = row_start + row
        ws_row = dest + row

    q = tl.load(q_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=mask_md, other=0.0).to(tl.float32)
    if not USE_FP32_DOT:
        q = q.to(q_ptr.dtype.element_ty)
    q_pos = q_pos0 + row

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    block_row_ptr = block_table_ptr + req * stride_bt_r
    if IS_SHARED:
        # A shared node ends at or before its requests' first query position: no row is masked.
        kv_mid = kv_end
    else:
        # Positions < q_pos0 + 1 are visible to every row of the tile: full tiles there skip the causal mask.
        kv_mid = tl.minimum(tl.maximum(q_pos0 + 1, kv_start), kv_end)
        kv_mid = kv_start + ((kv_mid - kv_start) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _attend_range(
        acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, k_cache_ptr=k_cache_ptr, v_cache_ptr=v_cache_ptr,
        block_row_ptr=block_row_ptr, kv_head=kv_head, kv_lo=kv_start, kv_hi=kv_mid, block_size=block_size,
        head_dim=head_dim, qk_scale=qk_scale,
        stride_k_blk=stride_k_blk, stride_k_tok=stride_k_tok, stride_k_head=stride_k_head, stride_k_d=stride_k_d,
        stride_v_blk=stride_v_blk, stride_v_tok=stride_v_tok, stride_v_head=stride_v_head, stride_v_d=stride_v_d,
        APPLY_CAUSAL=False, USE_FP32_DOT=USE_FP32_DOT, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )
    if not IS_SHARED:
        acc, m_i, l_i = _attend_range(
            acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, k_cache_ptr=k_cache_ptr, v_cache_ptr=v_cache_ptr,
            block_row_ptr=block_row_ptr, kv_head=kv_head, kv_lo=kv_mid, kv_hi=kv_end, block_size=block_size,
            head_dim=head_dim, qk_scale=qk_scale,
            stride_k_blk=stride_k_blk, stride_k_tok=stride_k_tok, stride_k_head=stride_k_head,
            stride_k_d=stride_k_d,
            stride_v_blk=stride_v_blk, stride_v_tok=stride_v_tok, stride_v_head=stride_v_head,
            stride_v_d=stride_v_d,
            APPLY_CAUSAL=True, USE_FP32_DOT=USE_FP32_DOT, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )

    # The state of this item's rows; a row that saw no KV (possible in a causal split chunk) is (0, -inf).
    nonempty = l_i > 0.0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, (m_i + tl.math.log2(tl.where(nonempty, l_i, 1.0))) * LN2, float("-inf"))
    if IS_SHARED:
        _store_state_and_report(
            out_ptr=out_ptr, lse_ptr=lse_ptr, ws_o_ptr=ws_o_ptr, ws_lse_ptr=ws_lse_ptr, counters_ptr=counters_ptr,
            item_units_ptr=item_units_ptr, units_ptr=units_ptr, units_start=units_start, units_end=units_end,
            o=o, lse=lse, ws_row=ws_row, head=head, offs_d=offs_d, mask_m=mask_m, mask_md=mask_md,
            kv_head=kv_head, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
            stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_o_d=stride_o_d,
            stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
            stride_ws_t=stride_ws_t, stride_ws_h=stride_ws_h, stride_ws_d=stride_ws_d,
            stride_wl_t=stride_wl_t, stride_wl_h=stride_wl_h,
            HAS_LSE=HAS_LSE, MERGE_BLOCK_M=MERGE_BLOCK_M, BLOCK_D=BLOCK_D,
        )
    elif dest < 0:
        # The request's rows have this single state: plain paged attention, straight to the output.
        tl.store(out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
                 o.to(out_ptr.dtype.element_ty), mask=mask_md)
        if HAS_LSE:
            tl.store(lse_ptr + tok * stride_lse_t + head * stride_lse_h, lse, mask=mask_m)
    else:
        _store_state_and_report(
            out_ptr=out_ptr, lse_ptr=lse_ptr, ws_o_ptr=ws_o_ptr, ws_lse_ptr=ws_lse_ptr, counters_ptr=counters_ptr,
            item_units_ptr=item_units_ptr, units_ptr=units_ptr, units_start=units_start, units_end=units_end,
            o=o, lse=lse, ws_row=ws_row, head=head, offs_d=offs_d, mask_m=mask_m, mask_md=mask_md,
            kv_head=kv_head, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
            stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_o_d=stride_o_d,
            stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
            stride_ws_t=stride_ws_t, stride_ws_h=stride_ws_h, stride_ws_d=stride_ws_d,
            stride_wl_t=stride_wl_t, stride_wl_h=stride_wl_h,
            HAS_LSE=HAS_LSE, MERGE_BLOCK_M=MERGE_BLOCK_M, BLOCK_D=BLOCK_D,
        )


@triton.jit
def _store_state_and_report(
    out_ptr, lse_ptr, ws_o_ptr, ws_lse_ptr, counters_ptr, item_units_ptr, units_ptr, units_start, units_end,
    o, lse, ws_row, head, offs_d, mask_m, mask_md,
    kv_head, num_kv_heads, group, head_dim,
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    HAS_LSE: tl.constexpr, MERGE_BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Write a partial state to the fp32 workspace, then report it (and merge if this program arrives last)."""
    tl.store(ws_o_ptr + ws_row[:, None] * stride_ws_t + head[:, None] * stride_ws_h + offs_d[None, :] * stride_ws_d,
             o, mask=mask_md)
    tl.store(ws_lse_ptr + ws_row * stride_wl_t + head * stride_wl_h, lse, mask=mask_m)
    _report_and_merge(
        out_ptr=out_ptr, lse_ptr=lse_ptr, ws_o_ptr=ws_o_ptr, ws_lse_ptr=ws_lse_ptr, counters_ptr=counters_ptr,
        item_units_ptr=item_units_ptr, units_ptr=units_ptr, units_start=units_start, units_end=units_end,
        kv_head=kv_head, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
        stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_o_d=stride_o_d,
        stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
        stride_ws_t=stride_ws_t, stride_ws_h=stride_ws_h, stride_ws_d=stride_ws_d,
        stride_wl_t=stride_wl_t, stride_wl_h=stride_wl_h,
        HAS_LSE=HAS_LSE, MERGE_BLOCK_M=MERGE_BLOCK_M, BLOCK_D=BLOCK_D,
    )


@triton.jit
def _report_and_merge(
    out_ptr, lse_ptr, ws_o_ptr, ws_lse_ptr, counters_ptr, item_units_ptr, units_ptr, units_start, units_end,
    kv_head, num_kv_heads, group, head_dim,
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    HAS_LSE: tl.constexpr, MERGE_BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Last-arriver merge: report to each merge unit; the program that completes a unit merges it.

    Why this is correct on a GPU with no waiting: every producer stores its state, then (after a CTA barrier, so all
    of its threads' stores precede the atomic in causality order) increments the unit's counter with an acq_rel
    atomic at GPU scope. Exactly one program sees ``expected - 1``; its acquire synchronizes with every earlier
    release, so all states are visible to it, and it reads them with volatile (L1-bypassing) loads. No program ever
    waits on another, so the order in which the hardware schedules programs cannot deadlock it, and the sequential
    interpreter (which runs programs one by one) takes the same path deterministically. The winner resets the counter
    to 0 with an atomic, so the next launch (next layer) starts from zero with no memset (CUDA-graph friendly).
    """
    for k in range(units_start, units_end):
        unit = tl.load(item_units_ptr + k)
        counter = counters_ptr + unit.to(tl.int64) * num_kv_heads + kv_head
        expected = tl.load(units_ptr + unit * UNIT_FIELDS + UNIT_EXPECTED)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == expected - 1:
            _merge_unit(
                out_ptr=out_ptr, lse_ptr=lse_ptr, ws_o_ptr=ws_o_ptr, ws_lse_ptr=ws_lse_ptr, units_ptr=units_ptr,
                unit=unit, kv_head=kv_head, group=group, head_dim=head_dim,
                stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_o_d=stride_o_d,
                stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
                stride_ws_t=stride_ws_t, stride_ws_h=stride_ws_h, stride_ws_d=stride_ws_d,
                stride_wl_t=stride_wl_t, stride_wl_h=stride_wl_h,
                HAS_LSE=HAS_LSE, BLOCK_M=MERGE_BLOCK_M, BLOCK_D=BLOCK_D,
            )
            tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def prefix_attention_kernel(
    out_ptr,  # [num_tokens, num_qo_heads, head_dim], dtype of q
    lse_ptr,  # [num_tokens, num_qo_heads] fp32 (written only when HAS_LSE)
    ws_o_ptr,  # [num_ws_rows, num_qo_heads, head_dim] fp32 partial outputs
    ws_lse_ptr,  # [num_ws_rows, num_qo_heads] fp32 partial LSEs (natural log)
    counters_ptr,  # [num_units, num_kv_heads] int32 arrivals; 0 before and after every launch
    q_ptr,  # [num_tokens, num_qo_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    items_ptr,  # [num_items, ITEM_FIELDS] int32 work items, longest first
    gather_ptr,  # [num_gather, GATHER_FIELDS] int32 (token, ws row) of the packed rows of SHARED items
    item_units_ptr,  # [num_reports] int32 merge-unit ids, sliced per item
    units_ptr,  # [num_units, UNIT_FIELDS] int32 merge units
    block_table_ptr,  # [num_requests, max_blocks] int32/int64
    num_kv_heads,
    group,
    head_dim,
    block_size,
    qk_scale,  # sm_scale * log2(e)
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_blk, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_blk, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_r,
    HAS_LSE: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    USE_FP32_DOT: tl.constexpr,
    BLOCK_M_SHARED: tl.constexpr,
    BLOCK_N_SHARED: tl.constexpr,
    BLOCK_M_SUFFIX: tl.constexpr,
    BLOCK_N_SUFFIX: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(num_items * num_kv_heads,)``: the KV heads of one item are adjacent so the longest-first order of the
    work list is the order in which programs start."""
    pid = tl.program_id(0)
    item = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    # Without shared items (HAS_SHARED=False: plain paged attention, or suffixes + split-k only) the shared branch is
    # compiled out, so its large tiles do not set the register budget and occupancy of decode-shaped programs.
    is_shared = False
    if HAS_SHARED:
        is_shared = tl.load(items_ptr + item * ITEM_FIELDS + ITEM_KIND) == KIND_SHARED
    if is_shared:
        _run_item(
            out_ptr=out_ptr, lse_ptr=lse_ptr, ws_o_ptr=ws_o_ptr, ws_lse_ptr=ws_lse_ptr, counters_ptr=counters_ptr,
            q_ptr=q_ptr, k_cache_ptr=k_cache_ptr, v_cache_ptr=v_cache_ptr,
            items_ptr=items_ptr, gather_ptr=gather_ptr, item_units_ptr=item_units_ptr, units_ptr=units_ptr,
            block_table_ptr=block_table_ptr,
            item=item, kv_head=kv_head, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
            block_size=block_size, qk_scale=qk_scale,
            stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_o_d=stride_o_d,
            stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
            stride_ws_t=stride_ws_t, stride_ws_h=stride_ws_h, stride_ws_d=stride_ws_d,
            stride_wl_t=stride_wl_t, stride_wl_h=stride_wl_h,
            stride_q_t=stride_q_t, stride_q_h=stride_q_h, stride_q_d=stride_q_d,
            stride_k_blk=stride_k_blk, stride_k_tok=stride_k_tok, stride_k_head=stride_k_head,
            stride_k_d=stride_k_d,
            stride_v_blk=stride_v_blk, stride_v_tok=stride_v_tok, stride_v_head=stride_v_head,
            stride_v_d=stride_v_d,
            stride_bt_r=stride_bt_r,
            IS_SHARED=True, HAS_LSE=HAS_LSE, USE_FP32_DOT=USE_FP32_DOT,
            BLOCK_M=BLOCK_M_SHARED, BLOCK_N=BLOCK_N_SHARED, MERGE_BLOCK_M=BLOCK_M_SUFFIX, BLOCK_D=BLOCK_D,
        )
    else:
        _run_item(
            out_ptr=out_ptr, lse_ptr=lse_ptr, ws_o_ptr=ws_o_ptr, ws_lse_ptr=ws_lse_ptr, counters_ptr=counters_ptr,
            q_ptr=q_ptr, k_cache_ptr=k_cache_ptr, v_cache_ptr=v_cache_ptr,
            items_ptr=items_ptr, gather_ptr=gather_ptr, item_units_ptr=item_units_ptr, units_ptr=units_ptr,
            block_table_ptr=block_table_ptr,
            item=item, kv_head=kv_head, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
            block_size=block_size, qk_scale=qk_scale,
            stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_o_d=stride_o_d,
            stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
            stride_ws_t=stride_ws_t, stride_ws_h=stride_ws_h, stride_ws_d=stride_ws_d,
            stride_wl_t=stride_wl_t, stride_wl_h=stride_wl_h,
            stride_q_t=stride_q_t, stride_q_h=stride_q_h, stride_q_d=stride_q_d,
            stride_k_blk=stride_k_blk, stride_k_tok=stride_k_tok, stride_k_head=stride_k_head,
            stride_k_d=stride_k_d,
            stride_v_blk=stride_v_blk, stride_v_tok=stride_v_tok, stride_v_head=stride_v_head,
            stride_v_d=stride_v_d,
            stride_bt_r=stride_bt_r,
            IS_SHARED=False, HAS_LSE=HAS_LSE, USE_FP32_DOT=USE_FP32_DOT,
            BLOCK_M=BLOCK_M_SUFFIX, BLOCK_N=BLOCK_N_SUFFIX, MERGE_BLOCK_M=BLOCK_M_SUFFIX, BLOCK_D=BLOCK_D,
        )
