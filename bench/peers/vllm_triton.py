"""vLLM's Triton ``unified_attention`` (its TRITON_ATTN backend's kernel), imported from the installed package.

vLLM's CPU build decides at import that Triton has no CPU backend and hands its kernel modules a placeholder
(``vllm.triton_utils.triton``). For this benchmark only, :func:`_unified_attention` gives ``vllm.triton_utils`` the
real ``triton`` *before* the kernel module is imported, so the unmodified kernel runs in the interpreter. Nothing in
vLLM is patched on disk and nothing leaves this process.

Called as the backend calls it for a batch of ``[num_blocks, block_size, num_kv_heads, head_dim]`` caches (the same
layout as ours: the very same tensors). The backend's 3-D split path (segments + a reduce launch, for decode batches
of at most ``128 // num_kv_heads`` sequences) is not used: it reads the same KV bytes, so the KV comparison is
unaffected, but vLLM's launch count is one lower than its backend's on those batches.
"""

from __future__ import annotations

import math

import torch

from peers.base import Prepared


def _unified_attention():
    import triton
    import triton.language as tl

    import vllm.triton_utils as triton_utils

    if not triton_utils.HAS_TRITON:
        triton_utils.triton, triton_utils.tl = triton, tl
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    return unified_attention


def prepare(batch, provider: str = "vllm-triton") -> Prepared:
    unified_attention = _unified_attention()
    s = batch.shape
    q_lens, kv_lens = batch.q_lens, batch.kv_lens
    out = torch.empty_like(batch.q)
    max_q, max_k = int(q_lens.max()), int(kv_lens.max())

    def run():
        unified_attention(q=batch.q, k=batch.k_cache, v=batch.v_cache, out=out, cu_seqlens_q=batch.qo_indptr,
                          max_seqlen_q=max_q, seqused_k=kv_lens, max_seqlen_k=max_k,
                          softmax_scale=1.0 / math.sqrt(s.head_dim), causal=True, window_size=(-1, -1),
                          block_table=batch.block_table, softcap=0, q_descale=None, k_descale=None, v_descale=None)
        return out

    return Prepared(run=run, labels=dict(out=out), notes="2d")
