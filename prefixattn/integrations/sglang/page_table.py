"""The CUDA graphs' static page table, refilled from SGLang's ``req_to_token`` before each captured forward.

Every replay of a graph must see the batch's current pages at the same addresses, so a decode graph copies them
itself (a prefill graph's replay has them copied just before it): for each request slot ``r`` of the (padded) batch,
its used pages ``ceil(seq_lens[r] / page_size)`` from ``req_to_token[req_pool_indices[r]]`` (the first slot of each
page divided by ``page_size``). One program per request slot copies only that request's used length, as SGLang's
FlashInfer backend builds its indices: a torch gather of whole rows (batch x max context, int32) made ~128 MB of
temporaries and ~0.25 GB of traffic per step at batch 256 and a 131k context. Entries past a request's used pages
keep whatever an earlier replay left there: no plan reads them. The launch depends only on the captured batch size
(grid) and the tensors' addresses: graph-safe.

:class:`GraphState` holds that table and the graph wrappers (one per layer geometry) that plan into it;
:func:`make_wrapper` makes a geometry's wrapper (MHA or MLA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import prefixattn
from prefixattn.integrations.switches import overlap_enabled

#: Pages each loop iteration of a program copies: 512 bytes of int32 page ids, so a decode row of a 4k context at
#: page size 1 is 8 iterations; any power of two is correct.
PAGES_PER_ITERATION = 128


@triton.jit
def _fill_page_table_kernel(
    table_ptr,  # [>= batch, max_pages] int32: the static page table (written)
    req_to_token_ptr,  # [num_rows, max_context] int32: SGLang's slot ids per request row
    req_pool_indices_ptr,  # [>= batch] int32/int64: each request slot's row of req_to_token
    seq_lens_ptr,  # [>= batch] int32/int64: each request slot's KV length
    max_pages,  # table columns: pages past it are not copied
    stride_table_row,
    stride_req_row,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row = tl.load(req_pool_indices_ptr + r).to(tl.int64)
    kv_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    num_pages = tl.minimum((kv_len + PAGE_SIZE - 1) // PAGE_SIZE, max_pages)
    src = req_to_token_ptr + row * stride_req_row
    dst = table_ptr + r.to(tl.int64) * stride_table_row
    for start in range(0, num_pages, BLOCK):
        pages = start + tl.arange(0, BLOCK)
        used = pages < num_pages
        first_slot = tl.load(src + pages.to(tl.int64) * PAGE_SIZE, mask=used, other=0)
        tl.store(dst + pages, first_slot // PAGE_SIZE, mask=used)


def fill_page_table(table: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor, batch_size: int, page_size: int) -> None:
    """Copy each of the first ``batch_size`` request slots' used pages into ``table`` rows ``0..batch_size-1``.

    Parameters
    ----------
    table : Tensor, ``[>= batch_size, max_pages]``, int32, unit column stride
    req_to_token : Tensor, ``[num_rows, max_context]``, int32, unit column stride
    req_pool_indices, seq_lens : Tensor, ``[>= batch_size]``, int32/int64
    batch_size, page_size : int
    """
    for name, t, dtypes in (("table", table, (torch.int32,)), ("req_to_token", req_to_token, (torch.int32,)),
                            ("req_pool_indices", req_pool_indices, (torch.int32, torch.int64)),
                            ("seq_lens", seq_lens, (torch.int32, torch.int64))):
        if t.dtype not in dtypes:
            raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if table.dim() != 2 or table.stride(1) != 1 or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(f"table, req_to_token: expected 2-D tensors with unit column stride, got strides "
                         f"{table.stride()} and {req_to_token.stride()}")
    if not 0 <= batch_size <= min(table.shape[0], req_pool_indices.shape[0], seq_lens.shape[0]):
        raise ValueError(f"batch_size: expected at most the rows of table, req_pool_indices and seq_lens "
                         f"({table.shape[0]}, {req_pool_indices.shape[0]}, {seq_lens.shape[0]}), got {batch_size}")
    if batch_size == 0:
        return
    _fill_page_table_kernel[(batch_size,)](
        table, req_to_token, req_pool_indices, seq_lens, table.shape[1], table.stride(0), req_to_token.stride(0),
        PAGE_SIZE=page_size, BLOCK=PAGES_PER_ITERATION)


#: First item of an MLA layer's geometry key (:func:`mla_key`); an MHA layer's key starts with its head count.
MLA_KEY = "mla"


def mla_key(num_heads: int, kv_lora_rank: int, rope_dim: int, q_dtype: torch.dtype, sm_scale: float) -> tuple:
    """An MLA layer's plan geometry: ``("mla", heads, kv_lora_rank, rope_dim, q dtype, scale)``."""
    return (MLA_KEY, num_heads, kv_lora_rank, rope_dim, q_dtype, float(sm_scale))


def geometry_options(key: tuple, *, block_size: int, sharing: str, kv_dtype) -> dict:
    """The plan / wrapper options of a layer geometry ``key``, one mapping for the eager and the graph wrappers and
    the per-step plan: an MHA key (``_plan_for``'s: heads, head size, q dtype, scale, causal, soft cap, window) gives
    :func:`prefixattn.plan`'s, an MLA key (:func:`mla_key`) :func:`prefixattn.plan_mla`'s."""
    if key[0] == MLA_KEY:
        _, num_heads, kv_lora_rank, rope_dim, q_dtype, sm_scale = key
        return dict(block_size=block_size, num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                    sm_scale=sm_scale, q_dtype=q_dtype, sharing=sharing, kv_dtype=kv_dtype)
    num_qo_heads, num_kv_heads, head_dim, q_dtype, sm_scale, causal, soft_cap, window = key
    return dict(block_size=block_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                causal=causal, sm_scale=sm_scale, q_dtype=q_dtype, sharing=sharing, logits_soft_cap=soft_cap,
                window_left=window, kv_dtype=kv_dtype, overlap=overlap_enabled())


def make_wrapper(key: tuple, *, block_size: int, sharing: str, kv_dtype, **capacity):
    """The capacity-sized wrapper of a layer geometry: :class:`prefixattn.MLAPrefixSharedAttention` for an MLA key,
    :class:`prefixattn.PrefixSharedAttention` for any other; ``capacity``: the wrapper's own keywords."""
    cls = prefixattn.MLAPrefixSharedAttention if key[0] == MLA_KEY else prefixattn.PrefixSharedAttention
    return cls(**geometry_options(key, block_size=block_size, sharing=sharing, kv_dtype=kv_dtype), **capacity)


def free_plan(key: tuple, qo_indptr, kv_lens, block_table, *, block_size: int, sharing: str, kv_dtype, **options):
    """A per-step plan of a layer geometry without a workspace (:func:`prefixattn.plan` or
    :func:`prefixattn.plan_mla`): for a step beyond a wrapper's capacity."""
    plan = prefixattn.plan_mla if key[0] == MLA_KEY else prefixattn.plan
    return plan(qo_indptr, kv_lens, block_table,
                **geometry_options(key, block_size=block_size, sharing=sharing, kv_dtype=kv_dtype), **options)


class GraphState:
    """One kind of graph's shared state (decode graphs, or SGLang's "full" prefill graphs): one capacity-fixed
    :class:`prefixattn.PrefixSharedAttention` per layer geometry (``use_cuda_graph=True``) and the static device
    block table they read.

    The table is ``[max_bs, max_pages]`` int32 and refilled from ``req_to_token`` before each captured forward, each
    request's used pages only (:func:`fill_page_table`: the same address at every step): inside a decode graph,
    before a prefill graph's replay (SGLang's prefill runner has no in-graph hook). The planner reads the step's host
    page labels (:mod:`prefixattn.integrations.sglang.host_pages`). ``max_q_len``: the query length the wrappers'
    fixed tiles are chosen for (1 for decode graphs; a prefill graph's largest token count).
    """

    def __init__(self, *, max_bs: int, max_num_tokens: int, max_pages: int, page_size: int, sharing: str,
                 device, kv_dtype: torch.dtype | None = None, max_q_len: int = 1) -> None:
        self.max_bs, self.max_num_tokens, self.page_size, self.sharing = max_bs, max_num_tokens, page_size, sharing
        self.max_q_len = max_q_len
        self.kv_dtype = kv_dtype  # the pool's fp8 dtype (prices the cost rule), None: q's dtype
        self.table = torch.zeros((max_bs, max_pages), dtype=torch.int32, device=device)
        self.wrappers: dict = {}  # plan key (geometry_options') -> its graph wrapper

    def fill_table(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                   bs: int) -> None:
        fill_page_table(self.table, req_to_token, req_pool_indices, seq_lens, bs, self.page_size)

    def _plan(self, attn, meta):
        bs = meta.block_table.shape[0]  # the padded batch's request slots
        return attn.plan(meta.qo_indptr, meta.kv_lens, meta.block_table, device_block_table=self.table[:bs],
                         graph_num_tokens=meta.graph_num_tokens)

    def plan_all(self, meta) -> None:
        for key, attn in self.wrappers.items():
            meta.plans[key] = self._plan(attn, meta)

    def plan_new_geometry(self, key, meta, *, device):
        """A layer geometry first seen in a graph step (the first capture's warm-up run): its wrapper and plan."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"layer geometry {key}: expected it to be seen in the warm-up run before the graph "
                             "capture (a workspace cannot be allocated inside a capture), got it first while capturing")
        self.wrappers[key] = make_wrapper(
            key, block_size=self.page_size, sharing=self.sharing, kv_dtype=self.kv_dtype,
            max_tokens=self.max_num_tokens, max_requests=self.max_bs, max_blocks_per_request=0, device=device,
            use_cuda_graph=True, max_q_len=self.max_q_len)
        meta.plans[key] = p = self._plan(self.wrappers[key], meta)
        return p

    def wrapper_of(self, p):
        """The graph wrapper whose latest plan is ``p``: its ``run`` is the capacity-fixed launch a graph captures."""
        attn = next((a for a in self.wrappers.values() if a.current_plan is p), None)
        if attn is None:
            raise ValueError("plan: expected the graph wrapper's latest plan for this step, got an older one (a "
                             "later init_forward_metadata_out_graph overwrote its tables)")
        return attn

    def run(self, p, q, k_cache, v_cache, *, out, sinks=None, k_scale=None, v_scale=None) -> None:
        self.wrapper_of(p).run(q, k_cache, v_cache, out=out, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
