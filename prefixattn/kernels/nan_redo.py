"""The NaN guard's redos (``USE_NAN_GUARD``, ``plan(nan_guard=True)``): the lanes (query row x head) of an item whose
tiled result came out non-finite, recomputed key by key, so that a non-finite V at a key a row does not see (the
causal diagonal or window edge of a tile, where the P @ V dot gives ``0 * NaN = NaN``) cannot reach that row. Rows
that see it, and NaN in q or K, stay NaN. Slow (no dot), and run only for items whose result is non-finite anyway.
"""

import triton
import triton.language as tl

from prefixattn.kernels import layout as L
from prefixattn.kernels.operands import _first_key_in_window, _kv_rows_at, _tanh, _vec_ptrs

#: Suffix tiles of at least this many (lane x padded head dim) elements redo the NaN guard's bad lanes one at a time
#: (:func:`_redo_lane_by_lane`), smaller tiles all at once (:func:`_redo_bad_rows`). All at once keeps a query and
#: a product tile beside the accumulator: Triton 3.6's ptxas spilled sm_80's chunk class at head_dim 256 (64 x 16
#: tiles, 8 warps, every model switch, e5m2 cache: 255 registers, 108 bytes bf16 / 140 fp16; none with the redo
#: removed); lane by lane, none (Triton 3.6 and 3.9). Smaller tiles keep the all-at-once redo: lane by lane, ptxas
#: held decode binaries at 64-80 registers and spilled 12-56 bytes (sm_80 16 x 32 and 16 x 16 at head_dim 64,
#: sm_90 fp32 16 x 32 at head_dim 80-128 and an e5m2 16 x 64 at head_dim 64; compile-check, Triton 3.6 / 3.9).
NAN_REDO_BY_LANE_TILE: tl.constexpr = tl.constexpr(64 * 256)


@triton.jit
def _redo_bad_rows(
    acc,  # [BLOCK_M, BLOCK_DV] fp32 tiled result (un-normalized)
    bad,  # [BLOCK_M] rows whose tiled result came out non-finite
    queries, tok, head,  # RowsHeadsDim of q; each lane's row and head
    q_pos,  # [BLOCK_M] KV position of each lane's query
    m_i,  # [BLOCK_M] final running maximum (log2 units): V never changes it
    kv,  # PagedKV
    block_row_ptr,  # [max_blocks]
    kv_head, kv_lo, kv_hi,
    score,  # ScoreRule
    HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """``acc`` with the ``bad`` lanes (query row x head) redone over [kv_lo, kv_hi) one key at a time, each key's
    value added only to the lanes that weigh it: the reference's per-key sum. A non-finite V at a key hidden from a
    row (causal diagonal or window edge of a tile, where the dot gives 0 * NaN = NaN) so cannot reach that row; rows
    that see it, and NaN in q or K, stay NaN. The other lanes keep their tiled result. Slow (no dot), and only for
    items whose result is non-finite anyway.

    The redo adds into ``acc`` itself and reads each bad lane's query again per key (fp32 products, exact for
    16-bit inputs), so no second accumulator, query tile or fp32 copy of it is live across the tiled loops: with
    those, sm_90 at head_dim 256 (bf16, LSE, every model switch) spilled 388 bytes in the decode class (32 x 32 tiles,
    4 warps) and 216 in the chunk class (64 x 32, 8 warps); now none (Triton 3.9)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < kv.head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < kv.v_head_dim
    m_shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    acc = tl.where(bad[:, None], 0.0, acc)
    for key in range(kv_lo, kv_hi):
        k, v = _kv_rows_at(kv=kv, block_row_ptr=block_row_ptr, key=key, kv_head=kv_head, offs_d=offs_d, mask_d=mask_d,
                           offs_dv=offs_dv, mask_dv=mask_dv, PAGE_SIZE=PAGE_SIZE)
        # The bad rows' queries, read again for each key from addresses that name the key (always true here), so
        # neither the load nor its addresses are hoisted: no query tile or pointer tile is live across the loops.
        live = tl.where(key < kv_hi, bad, False)  # (bad & scalar: a mask the interpreter cannot read)
        q = tl.load(_vec_ptrs(t=queries, rows=tl.where(live, tok, 0), heads=head, offs_d=offs_d),
                    mask=live[:, None] & mask_d[None, :], other=0.0)
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * score.qk_scale
        if HAS_SOFT_CAP:
            s = _tanh(x=s) * score.soft_cap_log2
        visible = bad & (key <= q_pos)
        if HAS_WINDOW:
            visible = visible & (key >= q_pos - score.window_left)
        p = tl.where(visible, tl.math.exp2(s - m_shift), 0.0)
        # p != 0 is true for NaN: a NaN weight still reaches its row; a zero weight never multiplies V.
        acc += tl.where((p != 0.0)[:, None], p[:, None] * v.to(tl.float32)[None, :], 0.0)
    return acc


@triton.jit
def _redo_lane_by_lane(
    acc,  # [BLOCK_M, BLOCK_DV] fp32 tiled result (un-normalized)
    bad,  # [BLOCK_M] rows whose tiled result came out non-finite
    m_i,  # [BLOCK_M] final running maximum (log2 units): V never changes it
    queries,  # RowsHeadsDim of q
    kv,  # PagedKV
    it,  # [ITEM_FIELDS] the work item
    kv_head, group,
    score,  # ScoreRule
    HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """:func:`_redo_bad_rows` for tiles of :data:`NAN_REDO_BY_LANE_TILE` elements or more: one bad lane at a time, key
    by key, so that beside ``acc`` only head vectors are live (the lane's query, one K and V row, its sum),
    never a ``BLOCK_M x BLOCK_D`` query or product tile; the item's fields are read again here, so nothing the redo
    needs is held across the KV loops. Its cost: a pass over the item's keys per bad lane."""
    # The item read again, volatile (a plain load merges with the one before the KV loops): nothing the redo needs
    # is held across them.
    row_start = tl.load(it + L.ITEM_ROW_START, volatile=True)
    q_pos0 = tl.load(it + L.ITEM_Q_POS, volatile=True)
    kv_lo = tl.load(it + L.ITEM_KV_START, volatile=True)
    kv_hi = tl.load(it + L.ITEM_KV_END, volatile=True)
    block_row_ptr = kv.block_table_ptr + tl.load(it + L.ITEM_REQ, volatile=True).to(tl.int64) * kv.stride_bt_r
    if HAS_WINDOW:
        kv_lo = _first_key_in_window(kv_start=kv_lo, kv_end=kv_hi, q_pos0=q_pos0, window_left=score.window_left)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < kv.head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < kv.v_head_dim
    m_shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    for lane in range(0, BLOCK_M):
        this = offs_m == lane
        if tl.sum((this & bad).to(tl.int32), 0) > 0:
            # The lane's row, head and maximum (the last picked out of the tile's vector: a sum over one lane).
            lane_tok = (row_start + lane // group).to(tl.int64)
            lane_head = (kv_head * group + lane % group).to(tl.int64)
            lane_pos = q_pos0 + lane // group
            lane_m = tl.sum(tl.where(this, m_shift, 0.0), 0)
            q = tl.load(queries.ptr + lane_tok * queries.stride_t + lane_head * queries.stride_h
                        + offs_d * queries.stride_d, mask=mask_d, other=0.0).to(tl.float32)
            row = tl.zeros([BLOCK_DV], tl.float32)
            for key in range(kv_lo, kv_hi):
                k, v = _kv_rows_at(kv=kv, block_row_ptr=block_row_ptr, key=key, kv_head=kv_head, offs_d=offs_d,
                                   mask_d=mask_d, offs_dv=offs_dv, mask_dv=mask_dv, PAGE_SIZE=PAGE_SIZE)
                # fp32 products: exact for 16-bit and fp8 inputs.
                s = tl.sum(k.to(tl.float32) * q, 0) * score.qk_scale
                if HAS_SOFT_CAP:
                    s = _tanh(x=s) * score.soft_cap_log2
                visible = key <= lane_pos
                if HAS_WINDOW:
                    visible = visible & (key >= lane_pos - score.window_left)
                p = tl.where(visible, tl.math.exp2(s - lane_m), 0.0)
                # p != 0 is true for NaN: a NaN weight still reaches the row; a zero weight never multiplies V.
                if p != 0.0:
                    row += p * v.to(tl.float32)
            acc = tl.where(this[:, None], row[None, :], acc)
    return acc
