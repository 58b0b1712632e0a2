"""The matrix classes (shared prefixes, prefill chunks) for Hopper (sm_90), in Gluon: K/V by TMA, a loading warp apart
from the computing warps.

The same contract as the portable kernel's SHARED and chunk launches (:func:`prefixattn.kernels.
prefix_attention_kernel.prefix_attention_kernel`): the same parameters, the plan's tables, the same prologue
(:func:`~prefixattn.kernels.prefix_attention_kernel._item_lanes`: an item's rows x GQA heads in M) and the same epilogue
(:func:`~prefixattn.kernels.epilogue._store_state`: the state straight to the output, or to the workspace and reported
on the merge counters, the last report merging): both builds read one plan and merge through one set of counters.
What differs is how K/V reach the tensor cores:

* TMA, one box per page: the cache is described to the copy engine as ``[blocks, block_size, kv_heads x head_dim]``
  (a token's heads side by side, as vLLM's and SGLang's caches store them), and a ``BLOCK_N``-key tile is
  ``BLOCK_N / PAGE_SIZE`` boxes ``[1, PAGE_SIZE, head_dim]`` at ``(block id, 0, kv_head x head_dim)``, each landing in
  its slice of the tile's shared memory (FlashInfer's open TMA work loads a paged cache the same way). No K/V address
  is computed in the computing warps. Tiles start at a page: keys of a tile's pages outside the item's range are
  masked, never skipped, so a chunk item's last page is read whole (its slots past the request's last key reach
  the P @ V product with weight 0: the NaN guard keeps the chunk class portable).
* Warp specialization: one loading warp (:func:`_load_kv`, 24 registers) reads the block ids and issues the copies
  ``STAGES`` tiles ahead; the kernel's own warps (a warpgroup per 64 rows of the tile) run the QK and PV warpgroup
  MMAs and the online softmax (:func:`_attend_tiles`), with the registers the loading warp gave up (``setmaxnreg``),
  a tile's softmax under the previous tile's P @ V product (FlashAttention-3's overlap within a warpgroup).
  A tile that every row sees whole skips the mask (a chunk item's tiles before the causal diagonal and inside
  every row's window; a shared node's but its first and last page).

Served: fp16/bf16 q and K/V, head_dim 64 and 128 (no padded lanes: ``BLOCK_D == head_dim``), block sizes 16/32/64,
caches whose heads of a token are contiguous (``stride_k_head == head_dim``, unit ``stride_k_d``), one KV head per
program; sinks, LSE, windows and soft caps; anything else stays the portable kernel's. Which build a class's launch
takes is decided in one place, :mod:`prefixattn.autotune.builds` (only where asked for: ``PREFIXATTN_BUILD=hopper``),
and its launch is assembled by :func:`prefixattn.launcher.with_hopper`. Gluon has no interpreter: this build is
checked by compiling it (``prefixattn compile-check``: TMA, warpgroup MMAs, ``setmaxnreg``, no spills; Triton 3.6,
3.8 and 3.9) and runs on a GPU only, where the GPU check times it (``prefixattn-hopper``) after checking its output
against the reference.

The TMA descriptors are made by each program (:func:`tma.make_tensor_descriptor`, 128 bytes of global scratch each,
which the launch lends: :class:`prefixattn.launcher.ScratchBuffer`), so the parameters stay the portable kernel's.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from prefixattn.kernels import layout as L
from prefixattn.kernels.epilogue import _normalized_state, _store_state
from prefixattn.kernels.operands import RowsHeads, RowsHeadsDim, WorkTables, _first_key_in_window, _tanh, _vec_ptrs
from prefixattn.kernels.prefix_attention_kernel import UNSPECIALIZED_ARGS, _item_lanes

# Triton 3.6 (the GPU image's) names the TMA load async_copy_global_to_shared, 3.9 async_load: same arguments.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

#: The copy engine's bound on block ids (a descriptor's dims are int32). Block ids are checked against the cache on
#: the host (``Plan.max_block_id``), so no box passes the cache; the bound only has to admit every id.
MAX_DESCRIPTOR_BLOCKS: gl.constexpr = gl.constexpr(2**31 - 1)
#: Registers of the loading warp: it holds a few scalars (the tile's first page, a block id, the stage).
LOADER_REGISTERS: gl.constexpr = gl.constexpr(24)


@gluon.jit
def _load_kv(
    k_desc, v_desc,  # TMA descriptors [blocks, PAGE_SIZE, kv_heads x head_dim]
    k_bufs, v_bufs,  # shared [STAGES, TILE_PAGES, PAGE_SIZE, BLOCK_D]: the tiles in flight
    ready, empty,  # mbarriers [STAGES]: a tile's copies landed / its stage is free again
    block_row_ptr,  # [max_blocks] the item's block-table row
    first_key, kv_hi, head_col,
    PAGE_SIZE: gl.constexpr, TILE_PAGES: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
):
    """The loading warp: for every tile, wait for its stage to be free, then copy its pages' K and V boxes. Pages past
    the range's last one reload the last (their keys are masked): every stage always receives its full byte count."""
    last_page = (kv_hi - 1) // PAGE_SIZE
    for t in range(gl.cdiv(kv_hi - first_key, BLOCK_N)):
        stage = t % STAGES
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)  # the first pass finds every stage free
        mbarrier.expect(ready.index(stage), 2 * TILE_PAGES * k_desc.block_type.nbytes)
        page = (first_key + t * BLOCK_N) // PAGE_SIZE
        for j in gl.static_range(TILE_PAGES):
            blk = gl.load(block_row_ptr + gl.minimum(page + j, last_page)).to(gl.int32)  # a box coordinate
            _tma_load(k_desc, [blk, 0, head_col], ready.index(stage), k_bufs.index(stage).slice(j, 1))
            _tma_load(v_desc, [blk, 0, head_col], ready.index(stage), v_bufs.index(stage).slice(j, 1))


@gluon.jit
def _softmax_tile(
    s,  # [BLOCK_M, BLOCK_N] fp32 raw scores of tile t (q . k)
    m_i, l_i,  # [BLOCK_M] fp32 the running maximum (log2 units) and denominator
    t, first_key, kv_lo, kv_hi, full_lo, full_hi, q_pos, qk_scale, soft_cap_log2, window_left,  # as in _attend_tiles
    IS_SHARED: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFT_CAP: gl.constexpr, BLOCK_N: gl.constexpr,
):
    """Tile ``t``'s online-softmax step (base 2): returns its probabilities ``p`` (fp32), the factor ``alpha`` the
    accumulator is rescaled by, and the new ``(m_i, l_i)``. The only copy of the build's softmax."""
    if HAS_SOFT_CAP:
        s = _tanh(x=s * qk_scale) * soft_cap_log2  # qk_scale = sm_scale / c here, as in the portable loop
    else:
        s = s * qk_scale
    start = first_key + t * BLOCK_N
    # One uniform branch per tile: the tiles wholly inside [full_lo, full_hi) skip the mask, as the portable kernel's
    # unmasked loop (a range's first page below kv_lo, the window's edge and the causal diagonal mask).
    if (start < full_lo) | (start + BLOCK_N > full_hi):
        pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        visible = ((pos >= kv_lo) & (pos < kv_hi))[None, :]
        if not IS_SHARED:
            visible = visible & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:  # a shared node is in every row's window (planner.window): no mask there
                visible = visible & (pos[None, :] >= q_pos[:, None] - window_left)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that has seen nothing: exp2 gives 0
    p = gl.exp2(s - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _attend_tiles(
    q_smem,  # shared [BLOCK_M, BLOCK_D] the item's query lanes
    k_bufs, v_bufs, ready, empty,  # as in _load_kv
    first_key, kv_lo, kv_hi,  # tiles from first_key (kv_lo's page start); keys outside [kv_lo, kv_hi) masked
    full_lo, full_hi,  # keys [full_lo, full_hi) are seen by every row: a tile wholly inside skips the mask
    q_pos0, group, qk_scale, soft_cap_log2, window_left,
    IS_SHARED: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SOFT_CAP: gl.constexpr, STAGES: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_WARPS: gl.constexpr,
):
    """The computing warps: online softmax over keys [kv_lo, kv_hi) in base 2; a chunk item's lane ``m`` (row
    ``m // group``, query position ``q_pos0 + m // group``) sees keys up to its position, and with ``HAS_WINDOW``
    none before ``position - window_left``. Returns ``(acc, m_i, l_i)`` as the portable loop's (fp32).

    Tile ``t``'s softmax runs while tile ``t - 1``'s P @ V product is in flight (FlashAttention-3's overlap within a
    warpgroup): each step issues tile ``t``'s Q @ K^T and tile ``t - 1``'s P @ V, waits for the first only
    (``wgmma.wait_group 1``), computes tile ``t``'s probabilities, then waits for the product, frees its K/V stage
    and rescales the accumulator. The first tile's softmax and the last tile's product are peeled off the loop."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    p = gl.zeros([BLOCK_M, BLOCK_N], q_smem.dtype, layout=p_layout)  # the last softmaxed tile's, for its P @ V
    no_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    q_pos = q_pos0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) // group
    num_tiles = gl.cdiv(kv_hi - first_key, BLOCK_N)
    if num_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_bufs.index(0).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), no_scores,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        p32, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, 0, first_key, kv_lo, kv_hi, full_lo, full_hi, q_pos,
                                             qk_scale, soft_cap_log2, window_left, IS_SHARED, HAS_WINDOW,
                                             HAS_SOFT_CAP, BLOCK_N)
        p = gl.convert_layout(p32.to(q_smem.dtype), p_layout)
    for t in range(1, num_tiles):
        stage = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), no_scores,
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_bufs.index(prev).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s])  # the scores; the product stays in flight under the softmax
        p32, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, t, first_key, kv_lo, kv_hi, full_lo, full_hi, q_pos,
                                             qk_scale, soft_cap_log2, window_left, IS_SHARED, HAS_WINDOW,
                                             HAS_SOFT_CAP, BLOCK_N)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])
        mbarrier.arrive(empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = gl.convert_layout(p32.to(q_smem.dtype), p_layout)
    if num_tiles > 0:
        last = (num_tiles - 1) % STAGES
        acc = warpgroup_mma(p, v_bufs.index(last).reshape([BLOCK_N, BLOCK_D]), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit(do_not_specialize=UNSPECIALIZED_ARGS)
def hopper_attention_kernel(
    out_ptr, lse_ptr, ws_o_ptr, ws_lse_ptr, counters_ptr,  # as prefix_attention_kernel's
    q_ptr, k_cache_ptr, v_cache_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    item_range_ptr, items_ptr, gather_ptr, mrows_ptr, block_table_ptr,
    num_kv_heads, group, head_dim, block_size, qk_scale, soft_cap_log2, window_left, v_scale,
    stride_o_t, stride_o_h, stride_o_d,
    stride_lse_t, stride_lse_h,
    stride_ws_t, stride_ws_h, stride_ws_d,
    stride_wl_t, stride_wl_h,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_blk, stride_k_tok, stride_k_head, stride_k_d,
    stride_v_blk, stride_v_tok, stride_v_head, stride_v_d,
    stride_bt_r,
    v_head_dim,
    IS_SHARED: gl.constexpr, HAS_LSE: gl.constexpr, HAS_SOFT_CAP: gl.constexpr, HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr, HAS_KV_SCALE: gl.constexpr, HAS_V_HEAD_DIM: gl.constexpr, USE_NAN_GUARD: gl.constexpr,
    USE_FP32_DOT: gl.constexpr, IS_HIP: gl.constexpr, USE_L2_FENCES: gl.constexpr, USE_PDL: gl.constexpr,
    PAGE_SIZE: gl.constexpr, KV_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr,  # STAGES: K/V tiles in flight
):
    """prefix_attention_kernel's launch of a matrix class (same parameters and grid), built for sm_90 (module
    docstring): the shared class (``IS_SHARED``) or the chunk class. ``USE_NAN_GUARD`` changes nothing for shared
    items (they mask no key); the chunk class is not served with it (``autotune.builds``)."""
    gl.static_assert(KV_HEADS == 1 and not IS_HIP and not USE_FP32_DOT and not USE_PDL)  # PDL: autotune.pdl
    gl.static_assert(IS_SHARED or not USE_NAN_GUARD)
    gl.static_assert(not HAS_KV_SCALE and not HAS_V_HEAD_DIM and BLOCK_DV == BLOCK_D)
    gl.static_assert(PAGE_SIZE > 0 and BLOCK_N % PAGE_SIZE == 0)
    TILE_PAGES: gl.constexpr = BLOCK_N // PAGE_SIZE
    NUM_WARPS: gl.constexpr = gl.num_warps()
    gl.static_assert(NUM_WARPS * 16 == BLOCK_M)  # a warpgroup per 64 rows (autotune.builds.hopper_num_warps)
    pid = gl.program_id(0)
    item = gl.load(item_range_ptr + L.RANGE_FIRST) + pid // num_kv_heads
    kv_head = pid % num_kv_heads
    if item >= gl.load(item_range_ptr + L.RANGE_END):
        return
    # The query gather's and the epilogue's layout: a quarter of a head per thread, so each thread holds few rows (2
    # of 128 at 8 warps) and the merge's per-row values (token, head, workspace rows, weights) take few registers.
    # With 16-byte vectors (8 of 128 rows a thread) the merge spilled 16 bytes at the 240 registers the computing
    # warps get (sm_90, bf16, d128, Triton 3.9).
    rows_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_D // 4], [8, 4], [NUM_WARPS, 1], [1, 0])
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, rows_layout))
    work = WorkTables(items_ptr=items_ptr, gather_ptr=gather_ptr, mrows_ptr=mrows_ptr, counters_ptr=counters_ptr)
    it, req, kv_lo, kv_hi, num_rows, q_pos0, row, head, mask_m, g, tok = _item_lanes(
        work=work, item=item, head_block=kv_head, group=group, offs_m=offs_m, IS_SHARED=IS_SHARED, BLOCK_M=BLOCK_M)
    mask_md = mask_m[:, None] & (offs_d[None, :] < head_dim)
    queries = RowsHeadsDim(ptr=q_ptr, stride_t=stride_q_t, stride_h=stride_q_h, stride_d=stride_q_d)
    q = gl.load(_vec_ptrs(t=queries, rows=tok, heads=head, offs_d=offs_d), mask=mask_md, other=0.0)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype), q)
    fence_async_shared()  # the query's ordinary stores before the tensor cores read it
    box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, PAGE_SIZE, BLOCK_D], dtype)
    k_desc = tma.make_tensor_descriptor(k_cache_ptr, shape=[MAX_DESCRIPTOR_BLOCKS, PAGE_SIZE, num_kv_heads * BLOCK_D],
                                        strides=[stride_k_blk, stride_k_tok, 1], block_shape=[1, PAGE_SIZE, BLOCK_D],
                                        layout=box)
    v_desc = tma.make_tensor_descriptor(v_cache_ptr, shape=[MAX_DESCRIPTOR_BLOCKS, PAGE_SIZE, num_kv_heads * BLOCK_D],
                                        strides=[stride_v_blk, stride_v_tok, 1], block_shape=[1, PAGE_SIZE, BLOCK_D],
                                        layout=box)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, TILE_PAGES, PAGE_SIZE, BLOCK_D], box)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, TILE_PAGES, PAGE_SIZE, BLOCK_D], box)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # Keys every row sees: a shared node's whole range (the planner shares only KV every row sees); a chunk item's
    # up to its first row's position (causal), from its last row's window start (keys left of the first row's
    # window are skipped: no row sees them). Tiles reaching outside are masked, as the portable kernel's.
    full_lo = kv_lo
    full_hi = kv_hi
    if not IS_SHARED:
        full_hi = gl.minimum(kv_hi, q_pos0 + 1)
        if HAS_WINDOW:
            kv_lo = _first_key_in_window(kv_start=kv_lo, kv_end=kv_hi, q_pos0=q_pos0, window_left=window_left)
            full_lo = gl.maximum(kv_lo, q_pos0 + num_rows - 1 - window_left)
    first_key = kv_lo - kv_lo % PAGE_SIZE  # boxes start at pages; keys before kv_lo are masked
    block_row_ptr = block_table_ptr + req * stride_bt_r
    acc, m_i, l_i = gl.warp_specialize(
        [(_attend_tiles, (q_smem, k_bufs, v_bufs, ready, empty, first_key, kv_lo, kv_hi, full_lo, full_hi, q_pos0,
                          group, qk_scale, soft_cap_log2, window_left, IS_SHARED, HAS_WINDOW, HAS_SOFT_CAP, STAGES,
                          BLOCK_M, BLOCK_N, BLOCK_D, NUM_WARPS)),
         (_load_kv, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, block_row_ptr, first_key, kv_hi,
                     kv_head * BLOCK_D, PAGE_SIZE, TILE_PAGES, STAGES, BLOCK_N))],
        [1], [LOADER_REGISTERS])

    o_slice: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    o, lse_row = _normalized_state(acc=acc, m_i=gl.convert_layout(m_i, o_slice), l_i=gl.convert_layout(l_i, o_slice))
    out = RowsHeadsDim(ptr=out_ptr, stride_t=stride_o_t, stride_h=stride_o_h, stride_d=stride_o_d)
    lse = RowsHeads(ptr=lse_ptr, stride_t=stride_lse_t, stride_h=stride_lse_h)
    ws_o = RowsHeadsDim(ptr=ws_o_ptr, stride_t=stride_ws_t, stride_h=stride_ws_h, stride_d=stride_ws_d)
    ws_lse = RowsHeads(ptr=ws_lse_ptr, stride_t=stride_wl_t, stride_h=stride_wl_h)
    _store_state(out=out, lse=lse, ws_o=ws_o, ws_lse=ws_lse, work=work, sinks_ptr=sinks_ptr, it=it, g=g,
                 o=gl.convert_layout(o, rows_layout),
                 lse_row=gl.convert_layout(lse_row, gl.SliceLayout(1, rows_layout)),
                 tok=tok, head=head, row=row, mask_m=mask_m, mask_md=mask_md, offs_d=offs_d,
                 num_qo_heads=num_kv_heads * group, head_dim=head_dim, IS_SHARED=IS_SHARED, HAS_LSE=HAS_LSE,
                 HAS_SINKS=HAS_SINKS, IS_HIP=False, USE_L2_FENCES=False)
