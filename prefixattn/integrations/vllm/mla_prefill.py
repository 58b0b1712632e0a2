"""The cached context of a step's MLA prefills, up-projected once per step instead of once per request.

vLLM's MLA prefill attends the new tokens in the up-projected form: each prefill's cached context (the latent of its
prefix-cache hit) is gathered and multiplied by ``kv_b_proj`` request by request (``_compute_prefill_context``), so
N prefills over one cached prompt up-project it N times. Here, in a step where prefills' contexts share blocks and the
saved up-projections pay for a slower attention (:func:`context_path_pays_off`, modeled), the prefills read the
distinct latent blocks of their contexts once: gathered once, up-projected once (keys ``[k_nope,
k_pe]`` and values per head), then attended by :func:`prefixattn.attention` over a paged cache of those blocks, where
the prefills that share blocks share them as any prefixattn plan does (a shared node's keys read once per tile of
all its rows).

The attention is non-causal: every new token sees its whole context. prefixattn's planner takes a request's KV to
hold at least its query rows (``kv_len >= q_len``), so a prefill with more new tokens than cached ones is planned as
pieces of at most its context length, each over the same blocks (the planner shares them). Prefills without a
context get a zero output and an LSE of ``-inf`` (no weight in vLLM's merge with the new tokens' attention), as
vLLM's own path gives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import prefixattn


#: Attention rates of the H200 run at 74e5177 (``bench/results/gpu/nvidia-h200-74e5177.md``, causal prefill,
#: TFLOP/s): FlashAttention-3's (vLLM's prefill kernels; its up-projection GEMM is priced at the same rate) and
#: prefixattn's Triton kernel's. They price :func:`context_path_pays_off` (modeled: this path has not run on a GPU).
FA3_TFLOPS = 577.4
PREFIXATTN_TFLOPS = 342.2


def context_path_pays_off(*, saved_tokens: int, pairs: int, kv_lora_rank: int, head_dim: int,
                          v_head_dim: int, rope_dim: int) -> bool:
    """Whether up-projecting the distinct context once and attending it with prefixattn beats vLLM's path (modeled,
    per query head): the up-projections saved (``saved_tokens`` latent rows through ``kv_b_proj``: ``2 x
    kv_lora_rank x (qk_nope + v)`` FLOPs each, at FA3's rate) against the attention's extra time over the
    ``pairs`` (query, context key) pairs: prefixattn's kernel runs QK at the keys' width and PV at the values',
    each padded to a power of two, at its rate, where vLLM's kernel runs ``2 x (qk + v)`` FLOPs a pair at FA3's.
    With DeepSeek-V3's widths (QK 256 lanes, PV 128) sharing pays below ~400 pairs per saved row: short new tokens
    over a long shared prompt."""
    k_lanes, v_lanes = (1 << (d - 1).bit_length() for d in (head_dim, v_head_dim))  # the kernel's head tiles
    saved = saved_tokens * 2 * kv_lora_rank * (head_dim - rope_dim + v_head_dim) / FA3_TFLOPS
    extra = pairs * (2 * (k_lanes + v_lanes) / PREFIXATTN_TFLOPS - 2 * (head_dim + v_head_dim) / FA3_TFLOPS)
    return saved > extra


@dataclass
class PrefillContext:
    """One step's prefill-context attention: its plan and what it gathers."""

    #: The attention's plan: pieces of the prefills' query rows (non-causal) over the gathered blocks.
    plan: "prefixattn.Plan"
    #: ``[num_distinct]`` int64 on the device: the latent cache's blocks the contexts read, each once, in the order
    #: the plan's block ids index.
    blocks: torch.Tensor
    #: ``[planned rows]`` int64 on the device: the prefill tokens that have a context (None: every one of them).
    rows: torch.Tensor | None
    #: The step's prefill tokens: the rows of the attention's output.
    num_tokens: int
    #: Context tokens up-projected here (distinct blocks x block size) and by vLLM's own path (each prefill's).
    distinct_tokens: int
    context_tokens: int


def plan_prefill_context(query_lens: np.ndarray, context_lens: np.ndarray, block_table: np.ndarray, *,
                         block_size: int, num_heads: int, head_dim: int, sm_scale: float, q_dtype: torch.dtype,
                         device, max_tokens: int, kv_lora_rank: int, rope_dim: int, v_head_dim: int,
                         priced: bool = True) -> PrefillContext | None:
    """Plan the attention of a step's prefills over their cached contexts (host, no device synchronization).

    Parameters
    ----------
    query_lens, context_lens : ndarray ``[num_prefills]`` int
        New tokens and cached (context) tokens of each prefill, in vLLM's order of the prefill tokens.
    block_table : ndarray ``[num_prefills, width]`` int
        The prefills' block ids (host copy), at least their contexts' blocks.
    block_size, num_heads, sm_scale, q_dtype, device
        The latent cache's block size; the layer's heads, softmax scale and query dtype; where the plan's tables go.
    head_dim : int
        The up-projected key width (``qk_nope_head_dim + qk_rope_head_dim``; the values have ``v_head_dim``).
    max_tokens : int
        The most distinct context tokens to up-project at once (vLLM's context workspace); beyond it, None.
    kv_lora_rank, rope_dim, v_head_dim : int
        The latent, rotary key and value widths (:func:`context_path_pays_off`).
    priced : bool
        False: plan wherever contexts share a block, whatever :func:`context_path_pays_off` says (the GPU check
        times this path where the rule declines it).

    Returns
    -------
    PrefillContext, or None where vLLM's own path runs: no two prefills' contexts share a block (nothing to save), the
    saved up-projections do not pay for this path's slower attention (:func:`context_path_pays_off`), or the
    distinct contexts exceed ``max_tokens``.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    has = np.flatnonzero(context_lens > 0)
    if has.size == 0:
        return None
    blocks_of = -(-context_lens[has] // block_size)
    used = np.concatenate([block_table[r, :n] for r, n in zip(has, blocks_of)])
    ids, index = np.unique(used, return_inverse=True)
    if ids.size == used.size or ids.size * block_size > max_tokens:
        return None
    if priced and not context_path_pays_off(saved_tokens=int(context_lens.sum()) - ids.size * block_size,
                                            pairs=int((query_lens * context_lens).sum()),
                                            kv_lora_rank=kv_lora_rank, head_dim=head_dim, v_head_dim=v_head_dim,
                                            rope_dim=rope_dim):
        return None
    # Each prefill's rows in pieces of at most its context length (kv_len >= q_len), every piece over its blocks.
    pieces = -(-query_lens[has] // context_lens[has])
    owner = np.repeat(np.arange(has.size), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(owner.size) - first[owner]  # a piece's index within its prefill
    q_of = query_lens[has][owner]
    sizes = q_of // pieces[owner] + (k < q_of % pieces[owner])
    table = np.zeros((has.size, int(blocks_of.max())), dtype=np.int32)
    starts = np.cumsum(blocks_of) - blocks_of
    for i, (s, n) in enumerate(zip(starts, blocks_of)):
        table[i, :n] = index[s:s + n]
    qo_indptr = np.concatenate([[0], np.cumsum(sizes)])
    p = prefixattn.plan(torch.from_numpy(qo_indptr), torch.from_numpy(context_lens[has][owner]),
                        torch.from_numpy(table[owner]), block_size=block_size, num_qo_heads=num_heads,
                        num_kv_heads=num_heads, head_dim=head_dim, v_head_dim=v_head_dim, causal=False,
                        sm_scale=sm_scale, q_dtype=q_dtype,
                        device=device, num_blocks=int(ids.size))
    rows = None
    if has.size < context_lens.size:
        token_starts = np.cumsum(query_lens) - query_lens
        rows = torch.from_numpy(np.concatenate([np.arange(token_starts[r], token_starts[r] + query_lens[r])
                                                for r in has])).to(device)
    return PrefillContext(plan=p, blocks=torch.from_numpy(ids.astype(np.int64)).to(device), rows=rows,
                          num_tokens=int(query_lens.sum()), distinct_tokens=int(ids.size * block_size),
                          context_tokens=int(context_lens.sum()))


class SuffixLayout:
    """vLLM's prefill backend, remembering the head stride of its new-tokens output (its other attributes pass
    through): vLLM merges the context output with that output and requires both to have one head stride, which
    depends on the backend (values padded to the keys' width or not), and it runs the new tokens first."""

    def __init__(self, backend) -> None:
        self._backend = backend
        #: ``stride(1)`` of the latest new-tokens output (None: none yet).
        self.head_stride: int | None = None

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def run_prefill_new_tokens(self, *args, **kwargs):
        result = self._backend.run_prefill_new_tokens(*args, **kwargs)
        self.head_stride = (result[0] if isinstance(result, tuple) else result).stride(1)
        return result


def prefill_context_attention(ctx: PrefillContext, q: torch.Tensor, latent_cache: torch.Tensor, up_project, *,
                              kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int, out_width: int | None = None,
                              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefills' attention over their cached contexts, each distinct latent block up-projected once.

    Parameters
    ----------
    ctx : PrefillContext
        From :func:`plan_prefill_context` for this step.
    q : Tensor ``[num_prefill_tokens, num_heads, qk_nope_head_dim + rope_dim]``
        The prefill queries (``[q_nope, q_pe]`` per head), in the plan's ``q_dtype``.
    latent_cache : Tensor ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
        vLLM's MLA cache (an fp8 one read as its dtype and dequantized with ``scale``).
    up_project : callable
        ``kv_c [tokens, kv_lora_rank] -> [tokens, num_heads * (qk_nope_head_dim + v_head_dim)]`` (``kv_b_proj``).
    out_width : int, optional
        Head width of the output, at least ``v_head_dim`` (default: q's): the head stride vLLM's merge asks for.

    Returns
    -------
    out : Tensor ``[num_prefill_tokens, num_heads, out_width]``, q's dtype; lanes past ``v_head_dim`` are zero (vLLM
        keeps the first ``v_head_dim``).
    lse : Tensor ``[num_heads, num_prefill_tokens]`` fp32, natural log (vLLM's layout); ``-inf`` without a context.
    """
    num_heads, width = q.shape[1], q.shape[2]
    latent = latent_cache.index_select(0, ctx.blocks)
    if latent.dtype != q.dtype:  # an fp8 cache: dequantize the gathered blocks only
        latent = latent.to(q.dtype) * (scale.to(q.dtype) if scale is not None else 1)
    n, bs, _ = latent.shape
    flat = latent.reshape(n * bs, -1)
    kv = up_project(flat[:, :kv_lora_rank]).to(q.dtype).view(n * bs, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k = torch.cat([k_nope, flat[:, None, kv_lora_rank:].expand(-1, num_heads, -1)], dim=-1)
    k, v = k.view(n, bs, num_heads, width), v.view(n, bs, num_heads, v_head_dim)  # v: a view of the projection
    out_width = width if out_width is None else out_width
    if ctx.rows is None:  # the kernel writes the first v_head_dim lanes of vLLM's head stride in place
        out = q.new_empty((ctx.num_tokens, num_heads, out_width))
        out[..., v_head_dim:].zero_()
        _, lse = prefixattn.attention(q, k, v, ctx.plan, out=out[..., :v_head_dim], return_lse=True)
        return out, lse.t().contiguous()
    o, lse = prefixattn.attention(q.index_select(0, ctx.rows), k, v, ctx.plan, return_lse=True)
    out = q.new_zeros((ctx.num_tokens, num_heads, out_width))
    full_lse = torch.full((num_heads, ctx.num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    out[ctx.rows, :, :v_head_dim] = o
    full_lse[:, ctx.rows] = lse.t()
    return out, full_lse
