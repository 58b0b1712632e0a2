"""Horizontally-fused prefix-shared paged attention: shared-prefix tiles, per-request suffix tiles and their merge,
with no merge launch (BatchLLM section 4.4; the math of FlashInfer cascade / Hydragen, without their extra launches).

One program = (work item, KV head), or (work item, ``KV_HEADS`` KV heads) in a launch that packs several KV heads
into a program's lanes (a decode class whose tile has lanes to spare: one item's block ids and metadata serve them
all, and a step's tile reads the heads of each of its tokens side by side). A work item (built by
:func:`prefixattn.plan`, table layout in :mod:`prefixattn.kernels.layout`) is either
* SHARED: every query row of every request under a shared prefix node (gathered rows, x GQA group in M) against ONE
  copy of the node's KV range - a matrix-matrix product on tensor cores; or
* SUFFIX: a tile of one request's contiguous query rows (x GQA group in M, decode-shaped as vLLM's unified attention)
  against that request's own KV range, causal where the range reaches its query positions.
Items come in work classes (shared nodes, prefill-chunk tiles, decode tiles), and each class is its own launch of
this kernel, compiled for that class alone (``IS_SHARED``, ``BLOCK_M``, ``BLOCK_N``, its warps and stages): a one-row
decode tile never pays the registers, shared memory and occupancy of a 128-row tile. The launches of one step share
the merge counters, so the partial states of a row may come from several launches, which may also run at once: on a
side stream (``plan(overlap=True)``) or chained by programmatic dependent launch (``USE_PDL``:
:mod:`prefixattn.autotune.pdl`).
Both kinds run the same inner loop (:func:`_attend_range`). An item either writes straight
to ``out`` (a request whose rows have a single state: plain paged attention) or writes an fp32 partial state
``(o, lse)`` to the workspace and reports it; the report that completes a (row, head) merges it
(:func:`prefixattn.kernels.epilogue._report_and_merge`).

All arithmetic is fp32 right after each load (the interpreter computes bf16 on raw bits); ``tl.dot`` gets the input
dtype on GPUs (tensor cores) unless ``USE_FP32_DOT``. Softmax runs in base 2 (``exp2``, scores scaled by
``sm_scale * log2(e)``, in the exponent's FMA for tiles with no masked key); LSEs are stored in natural log. NaN
in q or in a visible K/V row gives NaN out: a row is empty (output 0, LSE -inf) only when its softmax denominator is
exactly 0, never when it is NaN. A non-finite V value at a key a row does not see but that a masked tile loads (causal
diagonal, window edge) reaches the row through ``0 * NaN`` in the P @ V dot unless ``USE_NAN_GUARD``
(:mod:`prefixattn.kernels.nan_redo`; ``plan(nan_guard=True)``).

Features, each a constexpr switch that compiles to nothing when off:
* ``HAS_SOFT_CAP``: each scaled logit ``s`` becomes ``c * tanh(s / c)``; the cap acts on the natural-log logit, so
  the host passes ``qk_scale = sm_scale / c`` and ``soft_cap_log2 = c * log2(e)`` and the base-2 conversion follows
  the tanh.
* ``HAS_WINDOW``: the query at KV position ``p`` sees keys ``p - window_left .. p``; suffix items skip KV tiles wholly
  left of every row's window and mask only the tiles at the window's edge. Shared items need no mask: the planner
  shares only KV that every row of every member sees (:mod:`prefixattn.planner.window`).
* ``HAS_SINKS``: one logit per query head joins each row's softmax denominator exactly once, where the row's final
  state is formed (a single-state row's store, or the last-arriver merge), never per partial state. The stored LSE
  includes the sink; a row with no visible KV gives ``(0, sink)``.
* ``HAS_KV_SCALE``: per-tensor K/V scales read by pointer (fp8 caches): ``k_scale`` joins ``qk_scale``, ``v_scale``
  multiplies each item's output state (both linear, so no per-tile cost). fp8 K/V are upcast right after the load.
* ``HAS_V_HEAD_DIM``: V, the accumulator, the partial states and the output have a head size of their own
  (``v_head_dim``, ``BLOCK_DV`` lanes; DeepSeek's up-projected MLA: keys 192, values 128), so the P @ V product and
  the V loads are V's width; off, V's head size is ``head_dim``.

The kernel packs its pointers and strides into named tuples once (:mod:`prefixattn.kernels.operands`: the tuples
and the address and score arithmetic every part shares).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from prefixattn.kernels import layout as L
from prefixattn.kernels.epilogue import _normalized_state, _store_state
from prefixattn.kernels.nan_redo import NAN_REDO_BY_LANE_TILE, _redo_bad_rows, _redo_lane_by_lane
from prefixattn.kernels.operands import (PagedKV, RowsHeads, RowsHeadsDim, ScoreRule, WorkTables, _first_key_in_window,
                                         _load_block_ids, _page_and_slot, _tanh, _vec_ptrs)


@triton.jit
def _past_gap(start, gap_lo, gap, HAS_GAP: tl.constexpr):
    """KV position of the loop's tile ``start`` when the loop skips ``gap`` positions from ``gap_lo``."""
    if HAS_GAP:
        return tl.where(start >= gap_lo, start + gap, start)
    return start


@triton.jit
def _attend_range(
    acc, m_i, l_i,  # running state: [BLOCK_M, BLOCK_DV] fp32, [BLOCK_M] fp32 (log2 units), [BLOCK_M] fp32
    q,  # [BLOCK_M, BLOCK_D] query tile in the dot dtype (scores are scaled after the dot: one rounding less)
    q_pos,  # [BLOCK_M] KV position of each lane's query: its last visible key (APPLY_CAUSAL), window from it
    kv,  # PagedKV
    block_row_ptr,  # [max_blocks] the block-table row of the item's representative request
    kv_head,  # the program's (first) KV head
    lane_kv,  # [BLOCK_M] each lane's KV head after kv_head (used only when KV_HEADS > 1)
    kv_lo, kv_hi,
    gap_lo, gap_hi,  # KV positions [gap_lo, gap_hi) inside the range to skip (used only when HAS_GAP)
    score,  # ScoreRule (qk_scale >= 0 or NaN)
    HAS_MASKED_KEYS: tl.constexpr, APPLY_CAUSAL: tl.constexpr, APPLY_WINDOW: tl.constexpr, HAS_GAP: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, USE_FP32_DOT: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Online softmax over KV positions [kv_lo, kv_hi), fp32 accumulation; the only copy of the attention math.
    ``HAS_MASKED_KEYS`` False: the range is whole ``BLOCK_N`` tiles every row sees (no key masked, no load masked
    by position). Else the last tile may pass ``kv_hi``, ``APPLY_CAUSAL`` hides keys after each lane's query,
    ``APPLY_WINDOW`` keys before ``q_pos - window_left``, and ``HAS_GAP`` skips [gap_lo, gap_hi) (both
    ``BLOCK_N``-aligned from ``kv_lo``): one masked loop for the two ends of an item's range.

    ``KV_HEADS`` > 1: the program attends that many KV heads at once (:func:`_item_lanes`): a step's tile holds
    ``BLOCK_N`` positions x ``KV_HEADS`` heads, column ``c`` position ``c // KV_HEADS`` and head ``c % KV_HEADS``
    (the heads of one token side by side, as the cache stores them), and each lane sees its own head's columns
    only."""
    offs_n = tl.arange(0, BLOCK_N * KV_HEADS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < kv.head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < kv.v_head_dim  # mask_d itself where V has K's head size (the same value: one mask)
    if KV_HEADS > 1:
        col_kv = offs_n % KV_HEADS
        offs_n = offs_n // KV_HEADS  # the columns' positions from the step's first
        k_head = (kv_head + col_kv).to(tl.int64) * kv.stride_k_head
        v_head = (kv_head + col_kv).to(tl.int64) * kv.stride_v_head
    else:
        k_head = kv_head.to(tl.int64) * kv.stride_k_head
        v_head = kv_head.to(tl.int64) * kv.stride_v_head
    # Block ids are loaded one tile ahead and carried by the loop: the K/V addresses of a tile never wait on a load
    # issued in the same iteration, so the software pipeliner keeps two K/V tiles in flight at num_stages=3
    # (sm_90, bf16, head_dim 128: async_wait num=2 in the loop; with the ids loaded in-loop it kept one tile and
    # waited with num=0 at the top of every iteration, a full memory round trip per tile).
    gap = 0
    if HAS_GAP:
        gap = gap_hi - gap_lo
    blk_next = _load_block_ids(block_row_ptr=block_row_ptr,
                               pos=_past_gap(start=kv_lo, gap_lo=gap_lo, gap=gap, HAS_GAP=HAS_GAP) + offs_n,
                               kv_hi=kv_hi, block_size=kv.block_size, PAGE_SIZE=PAGE_SIZE)
    # Whole tiles keep their scores raw (q . k) until the exponent, which scales and shifts them in one FMA: the row
    # maximum of the raw scores times qk_scale is the maximum of the scaled ones (qk_scale >= 0). Masked tiles scale
    # first and then set hidden keys to -inf (a 0 scale must not turn -inf into NaN). With their position masks gone
    # and K loaded as V is (below), a whole tile costs 17-29% fewer instructions: SASS per tile, bf16, head_dim 128,
    # Triton 3.9, before -> after: sm_90 chunk class (128 x 64, 8 warps) 645 -> 458, decode class (16 x 32, 4 warps)
    # 399 -> 301, shared class (128 x 64, 8 warps) 643 -> 456; sm_80 chunk class 303 -> 252, decode 268 -> 215.
    if HAS_SOFT_CAP or HAS_MASKED_KEYS or KV_HEADS > 1:
        raw_scale = 1.0  # the scores are scaled (and masked) before the exponent
    else:
        raw_scale = score.qk_scale
    for start in range(kv_lo, kv_hi - gap, BLOCK_N):
        pos = _past_gap(start=start, gap_lo=gap_lo, gap=gap, HAS_GAP=HAS_GAP) + offs_n
        # 64-bit: block id x block stride passes 2^31 elements on large caches (vllm#47671, sglang#20389).
        blk = blk_next.to(tl.int64)
        blk_next = _load_block_ids(
            block_row_ptr=block_row_ptr,
            pos=_past_gap(start=start + BLOCK_N, gap_lo=gap_lo, gap=gap, HAS_GAP=HAS_GAP) + offs_n, kv_hi=kv_hi,
            block_size=kv.block_size, PAGE_SIZE=PAGE_SIZE)
        _, slot = _page_and_slot(pos=pos, block_size=kv.block_size, PAGE_SIZE=PAGE_SIZE)
        # K is loaded as V is, [BLOCK_N, BLOCK_D] in one layout, and transposed in shared memory for the dot: the
        # tile's block ids and slots are loaded and computed once for both (loaded [BLOCK_D, BLOCK_N], K had its
        # own block-id load and address arithmetic in another layout). The offsets inside a block stay 64-bit:
        # 32-bit ones saved sm_90's chunk class 13 instructions a tile, but ptxas then gave sm_80's decode class 96
        # registers instead of 72 (5 programs per SM instead of 7).
        slot = slot.to(tl.int64)
        k_off = blk * kv.stride_k_blk + slot * kv.stride_k_tok + k_head
        v_off = blk * kv.stride_v_blk + slot * kv.stride_v_tok + v_head
        if HAS_MASKED_KEYS:
            in_range = pos < kv_hi
            k_mask = in_range[:, None] & mask_d[None, :]
            v_mask = in_range[:, None] & mask_dv[None, :]
        else:
            k_mask = mask_d[None, :]
            v_mask = mask_dv[None, :]
        k = tl.load(kv.k_ptr + k_off[:, None] + offs_d[None, :] * kv.stride_k_d, mask=k_mask,
                    other=0.0)  # [BLOCK_N * KV_HEADS, BLOCK_D]
        v = tl.load(kv.v_ptr + v_off[:, None] + offs_dv[None, :] * kv.stride_v_d, mask=v_mask,
                    other=0.0)  # [BLOCK_N * KV_HEADS, BLOCK_DV]
        if USE_FP32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if HAS_SOFT_CAP:
            # qk_scale = sm_scale / c here: the cap acts before the base-2 scaling, which follows the tanh.
            s = _tanh(x=s * score.qk_scale) * score.soft_cap_log2
        elif HAS_MASKED_KEYS or KV_HEADS > 1:
            s = s * score.qk_scale
        if KV_HEADS > 1:
            visible = lane_kv[:, None] == col_kv[None, :]  # a lane's own KV head's columns
            if HAS_MASKED_KEYS:
                visible = visible & in_range[None, :]
        elif HAS_MASKED_KEYS:
            visible = in_range[None, :]
        if HAS_MASKED_KEYS:
            if APPLY_CAUSAL:
                visible = visible & (pos[None, :] <= q_pos[:, None])
            if APPLY_WINDOW:
                visible = visible & (pos[None, :] >= q_pos[:, None] - score.window_left)
        if HAS_MASKED_KEYS or KV_HEADS > 1:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * raw_scale)
        # A lane that has seen nothing yet keeps m = -inf; shift by 0 there so exp2 gives 0, never NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * raw_scale - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_item(
    acc, m_i, l_i,  # running state (as in _attend_range), empty on entry
    q, q_pos,  # as in _attend_range
    q_pos0, num_rows,  # KV position of the item's first row's query; rows in the item
    kv,  # PagedKV
    block_row_ptr, kv_head, lane_kv, kv_start, kv_end,  # kv_head, lane_kv: as in _attend_range
    score,  # ScoreRule
    IS_SHARED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """The item's KV range [kv_start, kv_end) in at most two KV loops, each masked only as much as it must be: the
    keys every row sees (no mask), then the window edge and the causal diagonal (causal and window masks) in one
    loop that skips the middle. One masked loop for both ends, not a loop each: a third KV loop kept more values
    live across the loops, and ptxas spilled (compile-check, Triton 3.6, window over an fp8 cache: sm_80 fp16 chunk
    class 64 x 16 tiles at 8 warps, head_dim 256: 56 bytes at 255 registers; gfx90a fp16 128 x 64 at 4 warps,
    head_dim 128: 21-24 VGPRs; sm_80 fp32 chunk class 32 x 32 at 8 warps, head_dim 80-128, Triton 3.9: 108-176
    bytes). Returns the state and the first KV position any row sees (the NaN guard's start)."""
    kv_lo = kv_start
    if HAS_WINDOW and not IS_SHARED:
        # KV left of the first row's window is seen by no row of the item: skip those tiles.
        kv_lo = _first_key_in_window(kv_start=kv_start, kv_end=kv_end, q_pos0=q_pos0, window_left=score.window_left)
    kv_first = kv_lo
    if IS_SHARED:
        # A shared node ends at or before its requests' first query position: no row is masked, only the keys of
        # the last tile past the node's end.
        kv_full = kv_lo + ((kv_end - kv_lo) // BLOCK_N) * BLOCK_N
        acc, m_i, l_i = _attend_range(
            acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head,
            lane_kv=lane_kv, kv_lo=kv_lo, kv_hi=kv_full, gap_lo=kv_full, gap_hi=kv_full, score=score,
            HAS_MASKED_KEYS=False, APPLY_CAUSAL=False, APPLY_WINDOW=False, HAS_GAP=False, HAS_SOFT_CAP=HAS_SOFT_CAP,
            USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, KV_HEADS=KV_HEADS, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            BLOCK_DV=BLOCK_DV,
        )
        acc, m_i, l_i = _attend_range(
            acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head,
            lane_kv=lane_kv, kv_lo=kv_full, kv_hi=kv_end, gap_lo=kv_end, gap_hi=kv_end, score=score,
            HAS_MASKED_KEYS=True, APPLY_CAUSAL=False, APPLY_WINDOW=False, HAS_GAP=False, HAS_SOFT_CAP=HAS_SOFT_CAP,
            USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, KV_HEADS=KV_HEADS, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            BLOCK_DV=BLOCK_DV,
        )
    else:
        # Positions < q_pos0 + 1 are visible to every row of the tile: full tiles there skip the causal mask.
        kv_mid = tl.minimum(tl.maximum(q_pos0 + 1, kv_lo), kv_end)
        kv_mid = kv_lo + ((kv_mid - kv_lo) // BLOCK_N) * BLOCK_N
        mid_lo = kv_lo
        if HAS_WINDOW:
            # Keys >= the last row's window start are in every row's window: only the tiles before it need the mask.
            win_full = tl.minimum(tl.maximum(q_pos0 + num_rows - 1 - score.window_left, kv_lo), kv_mid)
            mid_lo = tl.minimum(kv_lo + tl.cdiv(win_full - kv_lo, BLOCK_N) * BLOCK_N, kv_mid)
        acc, m_i, l_i = _attend_range(
            acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head,
            lane_kv=lane_kv, kv_lo=mid_lo, kv_hi=kv_mid, gap_lo=kv_mid, gap_hi=kv_mid, score=score,
            HAS_MASKED_KEYS=False, APPLY_CAUSAL=False, APPLY_WINDOW=False, HAS_GAP=False, HAS_SOFT_CAP=HAS_SOFT_CAP,
            USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, KV_HEADS=KV_HEADS, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            BLOCK_DV=BLOCK_DV,
        )
        # Without a window the edge is empty: the masked loop starts at the diagonal.
        acc, m_i, l_i = _attend_range(
            acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head,
            lane_kv=lane_kv, kv_lo=kv_lo if HAS_WINDOW else kv_mid, kv_hi=kv_end, gap_lo=mid_lo, gap_hi=kv_mid,
            score=score, HAS_MASKED_KEYS=True, APPLY_CAUSAL=True, APPLY_WINDOW=HAS_WINDOW, HAS_GAP=HAS_WINDOW,
            HAS_SOFT_CAP=HAS_SOFT_CAP, USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, KV_HEADS=KV_HEADS,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        )
    return acc, m_i, l_i, kv_first


@triton.jit
def _run_item(
    out, lse, ws_o, ws_lse,  # RowsHeadsDim / RowsHeads: the outputs and the workspace's partial states
    queries,  # RowsHeadsDim [num_tokens, num_qo_heads, head_dim]; out and ws_o: [..., v_head_dim]
    kv,  # PagedKV
    work,  # WorkTables
    score,  # ScoreRule (qk_scale without the K scale)
    sinks_ptr, k_scale_ptr, v_scale_ptr,  # as in prefix_attention_kernel
    item, head_block, num_qo_heads, group, v_scale,
    IS_SHARED: tl.constexpr, HAS_LSE: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_KV_SCALE: tl.constexpr, USE_NAN_GUARD: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    IS_HIP: tl.constexpr, USE_L2_FENCES: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One work item for the ``KV_HEADS`` KV heads of ``head_block``: its rows' state over its KV range, stored to
    ``out`` or to the workspace and reported (the report that completes a row merges it)."""
    # The NaN guard's redos read one KV head per program (the planner gives its plans one head per program).
    tl.static_assert(KV_HEADS == 1 or not USE_NAN_GUARD)
    it, req, kv_start, kv_end, num_rows, q_pos0, row, head, mask_m, g, tok = _item_lanes(
        work=work, item=item, head_block=head_block, group=group, IS_SHARED=IS_SHARED, BLOCK_M=BLOCK_M,
        KV_HEADS=KV_HEADS)
    kv_head = head_block * KV_HEADS
    lane_kv = 0
    if KV_HEADS > 1:
        lane_kv = (tl.arange(0, BLOCK_M) // group) % KV_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    mask_md = mask_m[:, None] & (offs_d[None, :] < kv.head_dim)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_mdv = mask_m[:, None] & (offs_dv[None, :] < kv.v_head_dim)  # mask_md where V has K's head size

    q = tl.load(_vec_ptrs(t=queries, rows=tok, heads=head, offs_d=offs_d), mask=mask_md, other=0.0)
    if USE_FP32_DOT:
        q = q.to(tl.float32)
    q_pos = q_pos0 + row

    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    block_row_ptr = kv.block_table_ptr + req * kv.stride_bt_r
    if HAS_KV_SCALE:
        # The KV loops need qk_scale >= 0 (plan() checks sm_scale); a negative K scale, which no host check can
        # see without a synchronization, makes the output NaN instead of wrong.
        k_scale = tl.load(k_scale_ptr)
        score = ScoreRule(qk_scale=tl.where(k_scale < 0, float("nan"), score.qk_scale * k_scale),
                          soft_cap_log2=score.soft_cap_log2, window_left=score.window_left)
    acc, m_i, l_i, kv_first = _attend_item(
        acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, q_pos0=q_pos0, num_rows=num_rows, kv=kv,
        block_row_ptr=block_row_ptr, kv_head=kv_head, lane_kv=lane_kv, kv_start=kv_start, kv_end=kv_end,
        score=score, IS_SHARED=IS_SHARED, HAS_WINDOW=HAS_WINDOW, HAS_SOFT_CAP=HAS_SOFT_CAP,
        USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, KV_HEADS=KV_HEADS, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        BLOCK_DV=BLOCK_DV,
    )

    if USE_NAN_GUARD and not IS_SHARED:
        # Masked tiles (causal diagonal, window edge) load keys hidden from some rows, and the dot gives 0 * NaN =
        # NaN for them: the lanes whose result is non-finite are redone key by key (never, for finite inputs).
        # Shared items mask nothing. A switch because even this check costs registers: sm_90, bf16, d128, decode
        # 16 x 64 tiles at 8 warps: 80 -> 142 registers (compile-check, Triton 3.9).
        bad = mask_m & (tl.sum((~(tl.abs(acc) < float("inf"))).to(tl.int32), 1) > 0)
        if BLOCK_M * BLOCK_D >= NAN_REDO_BY_LANE_TILE:
            # Each lane's token again (volatile, or the load merges with the one before the loops): the 64-bit
            # tokens held across the KV loops spilled (the binary of NAN_REDO_BY_LANE_TILE's note: 100 bytes).
            tok = (tl.load(it + L.ITEM_ROW_START, volatile=True) + row).to(tl.int64)
            if tl.sum(bad.to(tl.int32), 0) > 0:
                acc = _redo_lane_by_lane(acc=acc, bad=bad, m_i=m_i, queries=queries, kv=kv, it=it, kv_head=kv_head,
                                         group=group, score=score, HAS_SOFT_CAP=HAS_SOFT_CAP, HAS_WINDOW=HAS_WINDOW,
                                         PAGE_SIZE=PAGE_SIZE, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV)
        elif tl.sum(bad.to(tl.int32), 0) > 0:
            acc = _redo_bad_rows(acc=acc, bad=bad, queries=queries, tok=tok, head=head, q_pos=q_pos, m_i=m_i,
                                 kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head, kv_lo=kv_first, kv_hi=kv_end,
                                 score=score, HAS_SOFT_CAP=HAS_SOFT_CAP, HAS_WINDOW=HAS_WINDOW, PAGE_SIZE=PAGE_SIZE,
                                 BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV)

    o, lse_row = _normalized_state(acc=acc, m_i=m_i, l_i=l_i)
    if HAS_KV_SCALE:
        o = o * (v_scale * tl.load(v_scale_ptr))  # linear: partial states merge the same either way
    _store_state(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=sinks_ptr, it=it, g=g, o=o,
                 lse_row=lse_row, tok=tok, head=head, row=row, mask_m=mask_m, mask_md=mask_mdv, offs_d=offs_dv,
                 num_qo_heads=num_qo_heads, head_dim=kv.v_head_dim, IS_SHARED=IS_SHARED, HAS_LSE=HAS_LSE,
                 HAS_SINKS=HAS_SINKS, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES)


@triton.jit
def _item_lanes(
    work,  # WorkTables: items_ptr [num_items, ITEM_FIELDS], gather_ptr [num_gather, GATHER_FIELDS] int32
    item, head_block, group,
    IS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr, KV_HEADS: tl.constexpr = 1,
    offs_m=None,  # [BLOCK_M] tl.arange(0, BLOCK_M) in the caller's layout (a Gluon kernel's); None: made here
):
    """A work item's fields and its lanes: the one prologue of every attention kernel (the MLA kernel's too), as
    :func:`~prefixattn.kernels.epilogue._store_state` is their one epilogue. M packs (query row x head): with
    ``per_row = group * KV_HEADS`` query heads a row, lane ``m`` is row ``m // per_row`` and head
    ``head_block * per_row + m % per_row`` (``head_block``: the fused kernel's block of ``KV_HEADS`` KV heads, the MLA
    kernel's head block), so a row's lanes hold its ``group`` query heads of each KV head in turn.

    Returns ``(it, req, kv_start, kv_end, num_rows, q_pos0, row, head, mask_m, g, tok)``: the item's row of the
    items table, its request (int64), KV range, row count and first query position; then ``[BLOCK_M]`` each lane's
    row in the item, query head, liveness, row of the gather table (SHARED items; ``it`` otherwise) and token
    (int64)."""
    it = work.items_ptr + item * L.ITEM_FIELDS
    req = tl.load(it + L.ITEM_REQ).to(tl.int64)
    kv_start = tl.load(it + L.ITEM_KV_START)
    kv_end = tl.load(it + L.ITEM_KV_END)
    row_start = tl.load(it + L.ITEM_ROW_START).to(tl.int64)
    num_rows = tl.load(it + L.ITEM_NUM_ROWS)
    q_pos0 = tl.load(it + L.ITEM_Q_POS)

    if offs_m is None:
        offs_m = tl.arange(0, BLOCK_M)
    per_row = group * KV_HEADS
    row = offs_m // per_row
    head = head_block * per_row + offs_m % per_row
    mask_m = (row < num_rows) & (offs_m < (BLOCK_M // per_row) * per_row)
    if IS_SHARED:
        g = work.gather_ptr + (row_start + row) * L.GATHER_FIELDS
        tok = tl.load(g + L.GATHER_TOKEN, mask=mask_m, other=0).to(tl.int64)
    else:
        g = it  # no gather rows: _store_state reads it only for SHARED items
        tok = row_start + row
    return it, req, kv_start, kv_end, num_rows, q_pos0, row, head, mask_m, g, tok


#: Integer arguments Triton must not specialize on their value (``== 1``, ``% 16 == 0``): the block table's row
#: length is the step's widest request in blocks under the free plan(), so specializing on it made steps of another
#: width compile another binary mid-run (compile-check compiles it unspecialized too: MAX_BLOCKS = 129).
UNSPECIALIZED_ARGS = ("stride_bt_r",)


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS)
def prefix_attention_kernel(
    out_ptr,  # [num_tokens, num_qo_heads, v_head_dim], dtype of q
    lse_ptr,  # [num_tokens, num_qo_heads] fp32 (written only when HAS_LSE)
    ws_o_ptr,  # [num_ws_rows, num_qo_heads, v_head_dim] fp32 partial outputs
    ws_lse_ptr,  # [num_ws_rows, num_qo_heads] fp32 partial LSEs (natural log)
    counters_ptr,  # [num_mrows, num_qo_heads] int32 arrivals; 0 on entry, left at 0 (the merging lane resets it)
    q_ptr,  # [num_tokens, num_qo_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], dtype of q or fp8
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, v_head_dim], dtype of k_cache
    sinks_ptr,  # [num_qo_heads] fp32/bf16/fp16 sink logits (read only when HAS_SINKS)
    k_scale_ptr,  # [1] fp32 K dequantization scale (read only when HAS_KV_SCALE)
    v_scale_ptr,  # [1] fp32 V dequantization scale (read only when HAS_KV_SCALE)
    item_range_ptr,  # [RANGE_FIELDS] int32: this launch's class, items [first, end); programs past it exit
    items_ptr,  # [num_items, ITEM_FIELDS] int32 work items, class by class, longest first within a class
    gather_ptr,  # [num_gather, GATHER_FIELDS] int32 packed rows of SHARED items
    mrows_ptr,  # [num_mrows, MROW_FIELDS] int32 merge rows
    block_table_ptr,  # [num_requests, max_blocks] int32/int64
    num_kv_heads,
    group,
    head_dim,
    block_size,
    qk_scale,  # sm_scale * log2(e); with HAS_SOFT_CAP sm_scale / c (x a float k_scale)
    soft_cap_log2,  # c * log2(e) (used only when HAS_SOFT_CAP)
    window_left,  # W: the query at position p sees keys p - W .. p (used only when HAS_WINDOW)
    v_scale,  # float V scale, times *v_scale_ptr (used only when HAS_KV_SCALE)
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_blk, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_blk, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_r,
    # V's and the output's head size (read only when HAS_V_HEAD_DIM). Last, after the strides: beside head_dim, the
    # one parameter more moved ptxas to 128 registers and 60 spilled bytes on sm_90's d256 fp8-e5m2 decode binary
    # (16 x 64, 8 warps, kv_scale; Triton 3.9: 143, none, with the same PTX but for the parameter list); here the
    # compile-check records (sm_90 and gfx942 bf16 d128, sm_90's d256 decode features) are the kernel's without it.
    v_head_dim,
    IS_SHARED: tl.constexpr,  # the launch's class: SHARED items (else SUFFIX items)
    HAS_LSE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr,
    HAS_V_HEAD_DIM: tl.constexpr,  # V has its own head size (plan(v_head_dim=...)); else head_dim's
    USE_NAN_GUARD: tl.constexpr,  # non-finite V at keys a row does not see never reaches it (plan(nan_guard=True))
    USE_FP32_DOT: tl.constexpr,
    IS_HIP: tl.constexpr,  # AMD: every wave waits for its own workspace stores before reporting
    USE_L2_FENCES: tl.constexpr,  # the merge's fences by hand (autotune.targets.writes_own_l2_fences)
    USE_PDL: tl.constexpr,  # the step's launches chain by programmatic dependent launch (autotune.pdl; sm_90+)
    PAGE_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,  # KV heads one program attends (a divisor of num_kv_heads)
    BLOCK_M: tl.constexpr,  # (query row x KV head x GQA head) lanes of one item
    BLOCK_N: tl.constexpr,  # KV positions per step (the step's tile: BLOCK_N x KV_HEADS K/V rows)
    BLOCK_D: tl.constexpr,  # q's and K's head lanes (head_dim padded to a power of two)
    BLOCK_DV: tl.constexpr,  # V's and the output's (v_head_dim padded; BLOCK_D without HAS_V_HEAD_DIM)
):
    """Grid ``(capacity_items * num_kv_heads // KV_HEADS,)`` for one work class: the head blocks of one item are
    adjacent so the longest-first order of the class's items is the order in which programs start."""
    pid = tl.program_id(0)
    if USE_PDL:
        _pdl_chain(pid)
    head_blocks = num_kv_heads // KV_HEADS
    item = tl.load(item_range_ptr + L.RANGE_FIRST) + pid // head_blocks
    head_block = pid % head_blocks
    if item >= tl.load(item_range_ptr + L.RANGE_END):
        return
    num_qo_heads = num_kv_heads * group
    if not HAS_V_HEAD_DIM:
        # One value for both head sizes: their masks are one mask, and the binary is that of a kernel without V's.
        tl.static_assert(BLOCK_DV == BLOCK_D)
        v_head_dim = head_dim
    out = RowsHeadsDim(ptr=out_ptr, stride_t=stride_o_t, stride_h=stride_o_h, stride_d=stride_o_d)
    lse = RowsHeads(ptr=lse_ptr, stride_t=stride_lse_t, stride_h=stride_lse_h)
    ws_o = RowsHeadsDim(ptr=ws_o_ptr, stride_t=stride_ws_t, stride_h=stride_ws_h, stride_d=stride_ws_d)
    ws_lse = RowsHeads(ptr=ws_lse_ptr, stride_t=stride_wl_t, stride_h=stride_wl_h)
    queries = RowsHeadsDim(ptr=q_ptr, stride_t=stride_q_t, stride_h=stride_q_h, stride_d=stride_q_d)
    kv = PagedKV(k_ptr=k_cache_ptr, v_ptr=v_cache_ptr, block_table_ptr=block_table_ptr, stride_bt_r=stride_bt_r,
                 block_size=block_size, head_dim=head_dim, v_head_dim=v_head_dim,
                 stride_k_blk=stride_k_blk, stride_k_tok=stride_k_tok, stride_k_head=stride_k_head,
                 stride_k_d=stride_k_d,
                 stride_v_blk=stride_v_blk, stride_v_tok=stride_v_tok, stride_v_head=stride_v_head,
                 stride_v_d=stride_v_d)
    work = WorkTables(items_ptr=items_ptr, gather_ptr=gather_ptr, mrows_ptr=mrows_ptr, counters_ptr=counters_ptr)
    score = ScoreRule(qk_scale=qk_scale, soft_cap_log2=soft_cap_log2, window_left=window_left)
    _run_item(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, queries=queries, kv=kv, work=work, score=score,
              sinks_ptr=sinks_ptr, k_scale_ptr=k_scale_ptr, v_scale_ptr=v_scale_ptr, item=item, head_block=head_block,
              num_qo_heads=num_qo_heads, group=group, v_scale=v_scale,
              IS_SHARED=IS_SHARED, HAS_LSE=HAS_LSE, HAS_SOFT_CAP=HAS_SOFT_CAP, HAS_WINDOW=HAS_WINDOW,
              HAS_SINKS=HAS_SINKS, HAS_KV_SCALE=HAS_KV_SCALE, USE_NAN_GUARD=USE_NAN_GUARD,
              USE_FP32_DOT=USE_FP32_DOT, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES,
              PAGE_SIZE=PAGE_SIZE, KV_HEADS=KV_HEADS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
              BLOCK_DV=BLOCK_DV)


@triton.jit
def _pdl_chain(pid):
    """A program's part in a launch chained by PDL (:mod:`prefixattn.autotune.pdl`): the next class's launch may
    start (its programs take the SMs this one leaves); and since what follows the step on the stream waits for the
    step's last launch only, no launch may complete before the one before it: the grid's last program (the last to
    start, with the class's shortest item or none) first waits for the previous launch to complete. Without PDL, or
    in the step's first launch, the wait returns at once."""
    gdc_launch_dependents()
    if pid == tl.num_programs(0) - 1:
        gdc_wait()
