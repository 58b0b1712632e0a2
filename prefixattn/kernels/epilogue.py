"""The one epilogue of every attention kernel (the fused kernel's, the MLA kernel's, the Hopper build's): an item's
online-softmax state normalized (:func:`_normalized_state`), then stored straight to the output (a row with this
single state) or to the workspace and reported on the merge counters, the report that completes a (row, head)
merging it (:func:`_store_state`, :func:`_report_and_merge`), with the sink logit joining each row's final state
once (:func:`_with_sink`). The merge's correctness argument is :func:`_report_and_merge`'s docstring.

The matrix classes' Hopper build (:mod:`prefixattn.kernels.hopper_attention_kernel`, Gluon) runs this epilogue too: so
nothing here names a layout (no ``tl.arange``/``tl.full``/``tl.zeros``: the lanes' own tensors are passed in or
folded), and Triton 3.6's Gluon needs the atomics' operands as tensors and no branch on a constant.
"""

import triton
import triton.language as tl

from prefixattn.kernels import layout as L
from prefixattn.kernels.merge_states import _weight
from prefixattn.kernels.operands import _lse_ptrs, _vec_ptrs

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


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
    USE_L2_FENCES: tl.constexpr,
):
    """An item's state of its rows, after its KV loops: to the workspace and reported (the report that completes a
    row merges it, :func:`_report_and_merge`), or, for a request whose rows have this single state, straight to
    ``out`` (plain paged attention). The one epilogue of every attention kernel (the MLA kernel's too)."""
    if IS_SHARED:
        # Straight-line, not a branch on a constant: Triton 3.6's Gluon lowering (the Hopper build runs this epilogue
        # too) crashes on that branch (an LLVM assertion in ConvertTritonGPUToLLVM; the tl kernels' code is the same).
        ws_row = tl.load(g + L.GATHER_WS_ROW, mask=mask_m, other=0).to(tl.int64)
        mrow = tl.load(g + L.GATHER_MROW, mask=mask_m, other=0)
        _store_partial(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=sinks_ptr, ws_row=ws_row,
                       mrow=mrow, o=o, lse_row=lse_row, tok=tok, head=head, mask_m=mask_m, mask_md=mask_md,
                       offs_d=offs_d, num_qo_heads=num_qo_heads, head_dim=head_dim, HAS_LSE=HAS_LSE,
                       HAS_SINKS=HAS_SINKS, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES)
    else:
        # Loaded after the KV loops, as the merge row is: held across them, Triton 3.9 spilled sm_80's e5m2 chunk
        # class at head_dim 256 with the model switches (8 bytes; 64 x 16 tiles, 8 warps).
        dest = tl.load(it + L.ITEM_DEST)
        if dest >= 0:
            _store_partial(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=sinks_ptr,
                           ws_row=dest.to(tl.int64) + row, mrow=tl.load(it + L.ITEM_MROW) + row, o=o,
                           lse_row=lse_row, tok=tok, head=head, mask_m=mask_m, mask_md=mask_md, offs_d=offs_d,
                           num_qo_heads=num_qo_heads, head_dim=head_dim, HAS_LSE=HAS_LSE, HAS_SINKS=HAS_SINKS,
                           IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES)
        else:
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + head, mask=mask_m, other=float("-inf")).to(tl.float32)
                o, lse_row = _with_sink(o=o, lse=lse_row, sink=sink)
            tl.store(_vec_ptrs(t=out, rows=tok, heads=head, offs_d=offs_d), o.to(out.ptr.dtype.element_ty),
                     mask=mask_md)
            if HAS_LSE:
                tl.store(_lse_ptrs(t=lse, rows=tok, heads=head), lse_row, mask=mask_m)


@triton.jit
def _store_partial(
    out, lse, ws_o, ws_lse, work, sinks_ptr,  # as in _store_state
    ws_row,  # [BLOCK_M] int64 each lane's workspace row
    mrow,  # [BLOCK_M] its merge row
    o, lse_row, tok, head, mask_m, mask_md, offs_d, num_qo_heads, head_dim,  # as in _store_state
    HAS_LSE: tl.constexpr, HAS_SINKS: tl.constexpr, IS_HIP: tl.constexpr, USE_L2_FENCES: tl.constexpr,
):
    """A partial state to the workspace, reported (:func:`_report_and_merge`)."""
    tl.store(_vec_ptrs(t=ws_o, rows=ws_row, heads=head, offs_d=offs_d), o, mask=mask_md)
    tl.store(_lse_ptrs(t=ws_lse, rows=ws_row, heads=head), lse_row, mask=mask_m)
    _report_and_merge(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=sinks_ptr, tok=tok, head=head,
                      mrow=mrow, mask_m=mask_m, offs_d=offs_d, num_qo_heads=num_qo_heads, head_dim=head_dim,
                      HAS_LSE=HAS_LSE, HAS_SINKS=HAS_SINKS, IS_HIP=IS_HIP, USE_L2_FENCES=USE_L2_FENCES)


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
    offs_d,  # [BLOCK_D] the head's lanes
    num_qo_heads, head_dim,
    HAS_LSE: tl.constexpr, HAS_SINKS: tl.constexpr, IS_HIP: tl.constexpr, USE_L2_FENCES: tl.constexpr,
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
    # The atomics' operands as the lanes' own tensors (where of equal constants, folded away): Triton 3.6's Gluon
    # cannot broadcast a scalar operand of an atomic (the Gluon build runs this epilogue too).
    arrived = tl.atomic_add(counter, tl.where(mask_m, 1, 1), mask=mask_m, sem="release", scope="gpu")
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
        tl.atomic_and(counter, tl.where(done, 0, 0), mask=done, sem="acquire", scope="gpu")
        if USE_L2_FENCES:
            # The acquire by hand: once the reset has returned (vmcnt counts it), the XCD's L2 invalidated. An asm
            # with side effects stays after the atomic; its value as the input would have waited for Triton's
            # broadcast of it to the CTA (a barrier on Triton 3.8).
            tl.inline_asm_elementwise("s_waitcnt vmcnt(0)\n\tbuffer_inv sc1", "=v,v", [done.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        ws_first = tl.load(work.mrows_ptr + mrow * L.MROW_FIELDS + L.MROW_WS_FIRST, mask=done, other=0).to(tl.int64)
        ws_stride = tl.load(work.mrows_ptr + mrow * L.MROW_FIELDS + L.MROW_WS_STRIDE, mask=done, other=0).to(tl.int64)
        mask_d = offs_d < head_dim
        # The merge's state starts from the lanes' own tensors, not tl.full / tl.zeros: no layout is named here, so
        # a Gluon kernel (its own layouts) runs this same merge (the selects of equal constants fold away).
        m = tl.where(done, float("-inf"), float("-inf"))
        w_sum = tl.where(done, 0.0, 0.0)
        acc = tl.where(done[:, None] & mask_d[None, :], 0.0, 0.0)
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
