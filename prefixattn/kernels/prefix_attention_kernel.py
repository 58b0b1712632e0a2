"""Horizontally-fused prefix-shared paged attention: shared-prefix tiles, per-request suffix tiles and their merge,
with no merge launch (BatchLLM section 4.4; the math of FlashInfer cascade / Hydragen, without their extra launches).

One program = (work item, KV head). A work item (built by :func:`prefixattn.plan`, table layout in
:mod:`prefixattn.kernels.layout`) is either
* SHARED: every query row of every request under a shared prefix node (gathered rows, x GQA group in M) against ONE
  copy of the node's KV range - a matrix-matrix product on tensor cores; or
* SUFFIX: a tile of one request's contiguous query rows (x GQA group in M, decode-shaped as vLLM's unified attention)
  against that request's own KV range, causal where the range reaches its query positions.
Items come in work classes (shared nodes, prefill-chunk tiles, decode tiles), and each class is its own launch of
this kernel, compiled for that class alone (``IS_SHARED``, ``BLOCK_M``, ``BLOCK_N``, its warps and stages): a one-row
decode tile never pays the registers, shared memory and occupancy of a 128-row tile. The launches of one step share
the merge counters, so the partial states of a row may come from several launches.
Both kinds run the same inner loop (:func:`_attend_range`). An item either writes straight
to ``out`` (a request whose rows have a single state: plain paged attention) or writes an fp32 partial state
``(o, lse)`` to the workspace and reports it; the report that completes a (row, head) merges it
(:func:`_report_and_merge`).

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

The kernel packs its pointers and strides into named tuples once (:mod:`prefixattn.kernels.operands`: the tuples
and the address and score arithmetic every part shares).
"""

import triton
import triton.language as tl

from prefixattn.kernels import layout as L
from prefixattn.kernels.merge_states import _weight
from prefixattn.kernels.nan_redo import NAN_REDO_BY_LANE_TILE, _redo_bad_rows, _redo_lane_by_lane
from prefixattn.kernels.operands import (PagedKV, RowsHeads, RowsHeadsDim, ScoreRule, WorkTables, _first_key_in_window,
                                         _load_block_ids, _lse_ptrs, _page_and_slot, _tanh, _vec_ptrs)

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _past_gap(start, gap_lo, gap, HAS_GAP: tl.constexpr):
    """KV position of the loop's tile ``start`` when the loop skips ``gap`` positions from ``gap_lo``."""
    if HAS_GAP:
        return tl.where(start >= gap_lo, start + gap, start)
    return start


@triton.jit
def _attend_range(
    acc, m_i, l_i,  # running state: [BLOCK_M, BLOCK_D] fp32, [BLOCK_M] fp32 (log2 units), [BLOCK_M] fp32
    q,  # [BLOCK_M, BLOCK_D] query tile in the dot dtype (scores are scaled after the dot: one rounding less)
    q_pos,  # [BLOCK_M] KV position of each lane's query: its last visible key (APPLY_CAUSAL), window from it
    kv,  # PagedKV
    block_row_ptr,  # [max_blocks] the block-table row of the item's representative request
    kv_head, kv_lo, kv_hi,
    gap_lo, gap_hi,  # KV positions [gap_lo, gap_hi) inside the range to skip (used only when HAS_GAP)
    score,  # ScoreRule (qk_scale >= 0 or NaN)
    HAS_MASKED_KEYS: tl.constexpr, APPLY_CAUSAL: tl.constexpr, APPLY_WINDOW: tl.constexpr, HAS_GAP: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, USE_FP32_DOT: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Online softmax over KV positions [kv_lo, kv_hi), fp32 accumulation; the only copy of the attention math.
    ``HAS_MASKED_KEYS`` False: the range is whole ``BLOCK_N`` tiles every row sees (no key masked, no load masked
    by position). Else the last tile may pass ``kv_hi``, ``APPLY_CAUSAL`` hides keys after each lane's query,
    ``APPLY_WINDOW`` keys before ``q_pos - window_left``, and ``HAS_GAP`` skips [gap_lo, gap_hi) (both
    ``BLOCK_N``-aligned from ``kv_lo``): one masked loop for the two ends of an item's range."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < kv.head_dim
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
    if HAS_SOFT_CAP or HAS_MASKED_KEYS:
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
            kv_mask = in_range[:, None] & mask_d[None, :]
        else:
            kv_mask = mask_d[None, :]
        k = tl.load(kv.k_ptr + k_off[:, None] + offs_d[None, :] * kv.stride_k_d, mask=kv_mask,
                    other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(kv.v_ptr + v_off[:, None] + offs_d[None, :] * kv.stride_v_d, mask=kv_mask,
                    other=0.0)  # [BLOCK_N, BLOCK_D]
        if USE_FP32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if HAS_SOFT_CAP:
            # qk_scale = sm_scale / c here: the cap acts before the base-2 scaling, which follows the tanh.
            s = _tanh(x=s * score.qk_scale) * score.soft_cap_log2
        elif HAS_MASKED_KEYS:
            s = s * score.qk_scale
        if HAS_MASKED_KEYS:
            visible = in_range[None, :]
            if APPLY_CAUSAL:
                visible = visible & (pos[None, :] <= q_pos[:, None])
            if APPLY_WINDOW:
                visible = visible & (pos[None, :] >= q_pos[:, None] - score.window_left)
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
    block_row_ptr, kv_head, kv_start, kv_end,
    score,  # ScoreRule
    IS_SHARED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
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
            kv_lo=kv_lo, kv_hi=kv_full, gap_lo=kv_full, gap_hi=kv_full, score=score, HAS_MASKED_KEYS=False,
            APPLY_CAUSAL=False, APPLY_WINDOW=False, HAS_GAP=False, HAS_SOFT_CAP=HAS_SOFT_CAP,
            USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )
        acc, m_i, l_i = _attend_range(
            acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head,
            kv_lo=kv_full, kv_hi=kv_end, gap_lo=kv_end, gap_hi=kv_end, score=score, HAS_MASKED_KEYS=True,
            APPLY_CAUSAL=False, APPLY_WINDOW=False, HAS_GAP=False, HAS_SOFT_CAP=HAS_SOFT_CAP,
            USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
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
            kv_lo=mid_lo, kv_hi=kv_mid, gap_lo=kv_mid, gap_hi=kv_mid, score=score, HAS_MASKED_KEYS=False,
            APPLY_CAUSAL=False, APPLY_WINDOW=False, HAS_GAP=False, HAS_SOFT_CAP=HAS_SOFT_CAP,
            USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )
        # Without a window the edge is empty: the masked loop starts at the diagonal.
        acc, m_i, l_i = _attend_range(
            acc=acc, m_i=m_i, l_i=l_i, q=q, q_pos=q_pos, kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head,
            kv_lo=kv_lo if HAS_WINDOW else kv_mid, kv_hi=kv_end, gap_lo=mid_lo, gap_hi=kv_mid, score=score,
            HAS_MASKED_KEYS=True, APPLY_CAUSAL=True, APPLY_WINDOW=HAS_WINDOW, HAS_GAP=HAS_WINDOW,
            HAS_SOFT_CAP=HAS_SOFT_CAP, USE_FP32_DOT=USE_FP32_DOT, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
        )
    return acc, m_i, l_i, kv_first


@triton.jit
def _report_and_merge(
    out,  # RowsHeadsDim [num_tokens, num_qo_heads, head_dim]
    lse,  # RowsHeads [num_tokens, num_qo_heads] fp32
    ws_o,  # RowsHeadsDim [num_ws_rows, num_qo_heads, head_dim] fp32
    ws_lse,  # RowsHeads [num_ws_rows, num_qo_heads] fp32
    work,  # WorkTables (its merge rows and counters)
    sinks_ptr,  # [num_qo_heads] fp32/bf16/fp16 (read only when HAS_SINKS)
    tok,  # [BLOCK_M] int64 token of each lane
    head,  # [BLOCK_M] query head of each lane
    mrow,  # [BLOCK_M] merge row of each lane
    mask_m,  # [BLOCK_M] live lanes
    num_qo_heads, head_dim,
    HAS_LSE: tl.constexpr, HAS_SINKS: tl.constexpr, IS_HIP: tl.constexpr, USE_L2_FENCES: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Report this program's states (already stored) on their (merge row, head) counters, all lanes at once, and
    merge every (row, head) whose count this report completes, in one masked pass.

    Why this is correct on a GPU with no waiting: every producer stores its state, then (after a CTA barrier, so all
    of its threads' stores precede the reports in causality order) increments one counter per lane with a release
    atomic at GPU scope. Each (row, head) has exactly one state per producer, so exactly one report sees
    ``num_states - 1``; that lane re-reads its counter with an acquire atomic, which synchronizes with every earlier
    release on it (atomic read-modify-writes continue a release sequence), and a second CTA barrier extends that to
    the threads that load the states, with volatile (L1-bypassing) loads. Programs that merge nothing never pay the
    acquire (on AMD an L2 invalidate). No program ever waits on another, so the order in which the hardware
    schedules programs cannot deadlock it, and the sequential interpreter takes the same path deterministically.
    On AMD a CTA barrier orders LDS only and a release atomic waits for the issuing wave's own stores only, so every
    wave first waits for its own workspace stores (``IS_HIP``: ``s_waitcnt vmcnt(0)``, which on CDNA counts stores
    too); the releasing wave's L2 write-back then publishes all of them, and the acquire's L2 invalidate makes the
    merging program read them. Triton before 3.9 misplaces the fences of gfx942/gfx950's buffer atomics; there
    ``USE_L2_FENCES`` writes both by hand.
    The counters leave themselves at zero: the merging lane's acquire is an AND with 0 (an RMW, so it still reads
    the end of the release sequence). The class launches of
    one layer count into the same counters (a row whose states come from several launches merges in the last of
    them), and each (row, head) gets exactly ``num_states`` reports a layer, so the reset comes after its last one.
    ``plan()`` zeroes the counters a step uses once (a step that was interrupted, or counters overwritten by anyone,
    cannot make a later plan merge early).
    """
    mrow = mrow.to(tl.int64)
    num_states = tl.load(work.mrows_ptr + mrow * L.MROW_FIELDS + L.MROW_NUM_STATES, mask=mask_m, other=0)
    counter = work.counters_ptr + mrow * num_qo_heads + head
    if IS_HIP:
        # Executed by every thread (the mask tensor is replicated over the whole CTA): each wave's stores complete.
        tl.inline_asm_elementwise("s_waitcnt vmcnt(0)", "=v,v", [mask_m.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.debug_barrier()
    if USE_L2_FENCES:
        # The release by hand (autotune.targets.writes_own_l2_fences): the XCD's L2 written back before the report.
        tl.inline_asm_elementwise("buffer_wbl2 sc1\n\ts_waitcnt vmcnt(0)", "=v,v", [mask_m.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    arrived = tl.atomic_add(counter, 1, mask=mask_m, sem="release", scope="gpu")
    done = mask_m & (arrived == num_states - 1)
    num_done = tl.sum(done.to(tl.int32), 0)
    if num_done > 0:
        # The acquire that makes the states visible also leaves the counter at 0 for the next layer: every state of
        # this (row, head) has arrived, so no program of this layer touches it again, and the next layer's launches
        # are stream-ordered after this one. No memset runs per layer. An AND with 0, masked to the merging lanes:
        # one native atomic on every target (sm_80/90 atom.and, gfx90a global_atomic_swap, gfx942 buffer_atomic_and;
        # Triton 3.6 and 3.9). Not an exchange: Triton 3.6 lowers one to a gfx942 buffer atomic LLVM has no intrinsic
        # for (llvm.amdgcn.raw.ptr.buffer.atomic.exch: "failed to translate module to LLVM IR"); not an add of
        # -num_states: a compare-and-swap loop on gfx90a (Triton 3.9); not a compare-and-swap: it has no mask, and a
        # dead lane's counter may lie past the table (a suffix item's rows past its last), where a swap zeroes any
        # word that holds the comparand (tests/memcheck.py caught it).
        tl.atomic_and(counter, 0, mask=done, sem="acquire", scope="gpu")
        if USE_L2_FENCES:
            # The acquire by hand: once the reset has returned (vmcnt counts it), the XCD's L2 invalidated. An asm
            # with side effects stays after the atomic; its value as the input would have waited for Triton's
            # broadcast of it to the CTA (a barrier on Triton 3.8).
            tl.inline_asm_elementwise("s_waitcnt vmcnt(0)\n\tbuffer_inv sc1", "=v,v", [done.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        ws_first = tl.load(work.mrows_ptr + mrow * L.MROW_FIELDS + L.MROW_WS_FIRST, mask=done, other=0).to(tl.int64)
        ws_stride = tl.load(work.mrows_ptr + mrow * L.MROW_FIELDS + L.MROW_WS_STRIDE, mask=done, other=0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        m = tl.full(done.shape, float("-inf"), tl.float32)
        w_sum = tl.zeros(done.shape, tl.float32)
        acc = tl.zeros([done.shape[0], BLOCK_D], tl.float32)
        max_states = tl.max(tl.where(done, num_states, 0), 0)
        for state in range(max_states):
            live = done & (state < num_states)
            ws_row = ws_first + state * ws_stride
            # volatile: the states were written by other programs; read them from L2, not a stale L1 line.
            s = tl.load(_lse_ptrs(t=ws_lse, rows=ws_row, heads=head), mask=live, other=float("-inf"), volatile=True)
            v = tl.load(_vec_ptrs(t=ws_o, rows=ws_row, heads=head, offs_d=offs_d), mask=live[:, None] & mask_d[None, :],
                        other=0.0, volatile=True)
            m_new = tl.maximum(m, s)
            rescale = _weight(s=m, m=m_new)
            w = _weight(s=s, m=m_new)
            acc = acc * rescale[:, None] + w[:, None] * v
            w_sum = w_sum * rescale + w
            m = m_new
        if HAS_SINKS:
            # The sink joins the merged denominator once, as one more state with no value.
            sink = tl.load(sinks_ptr + head, mask=done, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, sink)
            rescale = _weight(s=m, m=m_new)
            acc = acc * rescale[:, None]
            w_sum = w_sum * rescale + _weight(s=sink, m=m_new)
            m = m_new
        # Empty only when no state carried weight (w_sum exactly 0); a NaN state keeps the row NaN.
        empty = w_sum == 0.0
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, w_sum)[:, None])
        tl.store(_vec_ptrs(t=out, rows=tok, heads=head, offs_d=offs_d), o.to(out.ptr.dtype.element_ty),
                 mask=done[:, None] & mask_d[None, :])
        if HAS_LSE:
            lse_row = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, w_sum)))
            tl.store(_lse_ptrs(t=lse, rows=tok, heads=head), lse_row, mask=done)


@triton.jit
def _with_sink(o, lse, sink):
    """A row's final state ``(o, lse)`` (natural log) with the sink logit added to its denominator: ``(0, sink)``
    for a row that saw nothing, unchanged for a -inf sink, NaN for a NaN state or sink."""
    m = tl.maximum(lse, sink)
    w_state = _weight(s=lse, m=m)
    total = w_state + _weight(s=sink, m=m)
    empty = total == 0.0
    o = o * tl.where(empty, 0.0, w_state / tl.where(empty, 1.0, total))[:, None]
    return o, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))


@triton.jit
def _run_item(
    out, lse, ws_o, ws_lse,  # RowsHeadsDim / RowsHeads: the outputs and the workspace's partial states
    queries,  # RowsHeadsDim [num_tokens, num_qo_heads, head_dim]
    kv,  # PagedKV
    work,  # WorkTables
    score,  # ScoreRule (qk_scale without the K scale)
    sinks_ptr, k_scale_ptr, v_scale_ptr,  # as in prefix_attention_kernel
    item, kv_head, num_qo_heads, group, v_scale,
    IS_SHARED: tl.constexpr, HAS_LSE: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_KV_SCALE: tl.constexpr, USE_NAN_GUARD: tl.constexpr, USE_FP32_DOT: tl.constexpr,
    IS_HIP: tl.constexpr, USE_L2_FENCES: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One work item for one KV head: its rows' state over its KV range, stored to ``out`` or to the workspace and
    reported (the report that completes a row merges it)."""
    it, req, kv_start, kv_end, num_rows, q_pos0, row, head, mask_m, g, tok = _item_lanes(
        work=work, item=item, head_block=kv_head, group=group, IS_SHARED=IS_SHARED, BLOCK_M=BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_md = mask_m[:, None] & (offs_d[None, :] < kv.head_dim)

    q = tl.load(_vec_ptrs(t=queries, rows=tok, heads=head, offs_d=offs_d), mask=mask_md, other=0.0)
    if USE_FP32_DOT:
        q = q.to(tl.float32)
    q_pos = q_pos0 + row

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
        block_row_ptr=block_row_ptr, kv_head=kv_head, kv_start=kv_start, kv_end=kv_end, score=score,
        IS_SHARED=IS_SHARED, HAS_WINDOW=HAS_WINDOW, HAS_SOFT_CAP=HAS_SOFT_CAP, USE_FP32_DOT=USE_FP32_DOT,
        PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
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
                                         PAGE_SIZE=PAGE_SIZE, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D)
        elif tl.sum(bad.to(tl.int32), 0) > 0:
            acc = _redo_bad_rows(acc=acc, bad=bad, queries=queries, tok=tok, head=head, q_pos=q_pos, m_i=m_i,
                                 kv=kv, block_row_ptr=block_row_ptr, kv_head=kv_head, kv_lo=kv_first, kv_hi=kv_end,
                                 score=score, HAS_SOFT_CAP=HAS_SOFT_CAP, HAS_WINDOW=HAS_WINDOW, PAGE_SIZE=PAGE_SIZE,
                                 BLOCK_D=BLOCK_D)

    o, lse_row = _normalized_state(acc=acc, m_i=m_i, l_i=l_i)
    if HAS_KV_SCALE:
        o = o * (v_scale * tl.load(v_scale_ptr))  # linear: partial states merge the same either way
    _store_state(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=sinks_ptr, it=it, g=g, o=o,
                 lse_row=lse_row, tok=tok, head=head, row=row, mask_m=mask_m, mask_md=mask_md, offs_d=offs_d,
                 num_qo_heads=num_qo_heads, head_dim=kv.head_dim, IS_SHARED=IS_SHARED, HAS_LSE=HAS_LSE,
                 HAS_SINKS=HAS_SINKS, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES, BLOCK_D=BLOCK_D)


@triton.jit
def _item_lanes(
    work,  # WorkTables: items_ptr [num_items, ITEM_FIELDS], gather_ptr [num_gather, GATHER_FIELDS] int32
    item, head_block, group,
    IS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """A work item's fields and its lanes: the one prologue of every attention kernel (the MLA kernel's too), as
    :func:`_store_state` is their one epilogue. M packs (query row x head): lane ``m`` is row ``m // group`` and head
    ``head_block * group + m % group`` (``head_block``: the fused kernel's KV head, the MLA kernel's head block).

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

    offs_m = tl.arange(0, BLOCK_M)
    row = offs_m // group
    head = head_block * group + offs_m % group
    mask_m = (row < num_rows) & (offs_m < (BLOCK_M // group) * group)
    if IS_SHARED:
        g = work.gather_ptr + (row_start + row) * L.GATHER_FIELDS
        tok = tl.load(g + L.GATHER_TOKEN, mask=mask_m, other=0).to(tl.int64)
    else:
        g = it  # no gather rows: _store_state reads it only for SHARED items
        tok = row_start + row
    return it, req, kv_start, kv_end, num_rows, q_pos0, row, head, mask_m, g, tok


@triton.jit
def _normalized_state(acc, m_i, l_i):
    """The ``(o, lse)`` (natural log) of an online-softmax state (:func:`_attend_range`'s). A row is empty (no
    visible KV, possible in a causal split chunk) only when its denominator is exactly 0: NaN scores make it NaN, and
    NaN must reach the output."""
    empty = l_i == 0.0
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    return o, tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)


@triton.jit
def _store_state(
    out, lse, ws_o, ws_lse,  # RowsHeadsDim / RowsHeads: the outputs and the workspace's partial states
    work,  # WorkTables
    sinks_ptr,  # [num_qo_heads] (read only when HAS_SINKS)
    it,  # the item's row of the items table
    g,  # [BLOCK_M] the lanes' rows of the gather table (SHARED items; unread otherwise)
    o,  # [BLOCK_M, BLOCK_D] fp32 the item's normalized state of its lanes
    lse_row,  # [BLOCK_M] fp32 its LSE (natural log)
    tok, head, row, mask_m,  # [BLOCK_M] each lane's token, query head, row in the item, and the live lanes
    mask_md,  # [BLOCK_M, BLOCK_D] the live lanes' live dims
    offs_d,  # [BLOCK_D]
    num_qo_heads, head_dim,
    IS_SHARED: tl.constexpr, HAS_LSE: tl.constexpr, HAS_SINKS: tl.constexpr, IS_HIP: tl.constexpr,
    USE_L2_FENCES: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """An item's state of its rows, after its KV loops: to the workspace and reported (the report that completes a
    row merges it, :func:`_report_and_merge`), or, for a request whose rows have this single state, straight to
    ``out`` (plain paged attention). The one epilogue of every attention kernel (the MLA kernel's too)."""
    if IS_SHARED:
        to_workspace = True
    else:
        # Loaded after the KV loops, as the merge row is: held across them, Triton 3.9 spilled sm_80's e5m2 chunk
        # class at head_dim 256 with the model switches (8 bytes; 64 x 16 tiles, 8 warps).
        dest = tl.load(it + L.ITEM_DEST)
        to_workspace = dest >= 0
    if to_workspace:
        if IS_SHARED:
            ws_row = tl.load(g + L.GATHER_WS_ROW, mask=mask_m, other=0).to(tl.int64)
            mrow = tl.load(g + L.GATHER_MROW, mask=mask_m, other=0)
        else:
            ws_row = dest.to(tl.int64) + row
            mrow = tl.load(it + L.ITEM_MROW) + row
        tl.store(_vec_ptrs(t=ws_o, rows=ws_row, heads=head, offs_d=offs_d), o, mask=mask_md)
        tl.store(_lse_ptrs(t=ws_lse, rows=ws_row, heads=head), lse_row, mask=mask_m)
        _report_and_merge(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=sinks_ptr, tok=tok,
                          head=head, mrow=mrow, mask_m=mask_m, num_qo_heads=num_qo_heads, head_dim=head_dim,
                          HAS_LSE=HAS_LSE, HAS_SINKS=HAS_SINKS, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES,
                          BLOCK_D=BLOCK_D)
    else:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=mask_m, other=float("-inf")).to(tl.float32)
            o, lse_row = _with_sink(o=o, lse=lse_row, sink=sink)
        tl.store(_vec_ptrs(t=out, rows=tok, heads=head, offs_d=offs_d), o.to(out.ptr.dtype.element_ty), mask=mask_md)
        if HAS_LSE:
            tl.store(_lse_ptrs(t=lse, rows=tok, heads=head), lse_row, mask=mask_m)


#: Integer arguments Triton must not specialize on their value (``== 1``, ``% 16 == 0``): the block table's row
#: length is the step's widest request in blocks under the free plan(), so specializing on it made steps of another
#: width compile another binary mid-run (compile-check compiles it unspecialized too: MAX_BLOCKS = 129).
UNSPECIALIZED_ARGS = ("stride_bt_r",)


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS)
def prefix_attention_kernel(
    out_ptr,  # [num_tokens, num_qo_heads, head_dim], dtype of q
    lse_ptr,  # [num_tokens, num_qo_heads] fp32 (written only when HAS_LSE)
    ws_o_ptr,  # [num_ws_rows, num_qo_heads, head_dim] fp32 partial outputs
    ws_lse_ptr,  # [num_ws_rows, num_qo_heads] fp32 partial LSEs (natural log)
    counters_ptr,  # [num_mrows, num_qo_heads] int32 arrivals; 0 on entry, left at 0 (the merging lane resets it)
    q_ptr,  # [num_tokens, num_qo_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], dtype of q or fp8
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], dtype of k_cache
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
    IS_SHARED: tl.constexpr,  # the launch's class: SHARED items (else SUFFIX items)
    HAS_LSE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr,
    USE_NAN_GUARD: tl.constexpr,  # non-finite V at keys a row does not see never reaches it (plan(nan_guard=True))
    USE_FP32_DOT: tl.constexpr,
    IS_HIP: tl.constexpr,  # AMD: every wave waits for its own workspace stores before reporting
    USE_L2_FENCES: tl.constexpr,  # the merge's fences by hand (autotune.targets.writes_own_l2_fences)
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # (query row x GQA head) lanes of one item
    BLOCK_N: tl.constexpr,  # KV positions per step
    BLOCK_D: tl.constexpr,
):
    """Grid ``(capacity_items * num_kv_heads,)`` for one work class: the KV heads of one item are adjacent so the
    longest-first order of the class's items is the order in which programs start."""
    pid = tl.program_id(0)
    item = tl.load(item_range_ptr + L.RANGE_FIRST) + pid // num_kv_heads
    kv_head = pid % num_kv_heads
    if item >= tl.load(item_range_ptr + L.RANGE_END):
        return
    num_qo_heads = num_kv_heads * group
    out = RowsHeadsDim(ptr=out_ptr, stride_t=stride_o_t, stride_h=stride_o_h, stride_d=stride_o_d)
    lse = RowsHeads(ptr=lse_ptr, stride_t=stride_lse_t, stride_h=stride_lse_h)
    ws_o = RowsHeadsDim(ptr=ws_o_ptr, stride_t=stride_ws_t, stride_h=stride_ws_h, stride_d=stride_ws_d)
    ws_lse = RowsHeads(ptr=ws_lse_ptr, stride_t=stride_wl_t, stride_h=stride_wl_h)
    queries = RowsHeadsDim(ptr=q_ptr, stride_t=stride_q_t, stride_h=stride_q_h, stride_d=stride_q_d)
    kv = PagedKV(k_ptr=k_cache_ptr, v_ptr=v_cache_ptr, block_table_ptr=block_table_ptr, stride_bt_r=stride_bt_r,
                 block_size=block_size, head_dim=head_dim,
                 stride_k_blk=stride_k_blk, stride_k_tok=stride_k_tok, stride_k_head=stride_k_head,
                 stride_k_d=stride_k_d,
                 stride_v_blk=stride_v_blk, stride_v_tok=stride_v_tok, stride_v_head=stride_v_head,
                 stride_v_d=stride_v_d)
    work = WorkTables(items_ptr=items_ptr, gather_ptr=gather_ptr, mrows_ptr=mrows_ptr, counters_ptr=counters_ptr)
    score = ScoreRule(qk_scale=qk_scale, soft_cap_log2=soft_cap_log2, window_left=window_left)
    _run_item(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, queries=queries, kv=kv, work=work, score=score,
              sinks_ptr=sinks_ptr, k_scale_ptr=k_scale_ptr, v_scale_ptr=v_scale_ptr, item=item, kv_head=kv_head,
              num_qo_heads=num_qo_heads, group=group, v_scale=v_scale,
              IS_SHARED=IS_SHARED, HAS_LSE=HAS_LSE, HAS_SOFT_CAP=HAS_SOFT_CAP, HAS_WINDOW=HAS_WINDOW,
              HAS_SINKS=HAS_SINKS, HAS_KV_SCALE=HAS_KV_SCALE, USE_NAN_GUARD=USE_NAN_GUARD,
              USE_FP32_DOT=USE_FP32_DOT, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES,
              PAGE_SIZE=PAGE_SIZE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
