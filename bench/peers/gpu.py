"""GPU-only peers (CUDA kernels that cannot run in the interpreter): FlashInfer's configurations
(bench/peers/flashinfer.py: cascade, batch decode, batch prefill fa2/fa3, BatchAttention, POD, vLLM's split), the
flash-attn cascade vLLM used to run (prefix pass + suffix pass + merge), and torch SDPA. Each one imports its
package lazily; a missing package raises :class:`Unavailable` (the test skips that column with the reason).

Every adapter takes the same :class:`batches.shapes.Batch` (paged caches ``[num_blocks, block_size, num_kv_heads,
head_dim]``, FlashInfer's "NHD" layout) and does its host-side planning in ``prepare``; ``run()`` is what is timed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from peers.base import Prepared
from peers.flashinfer import PEERS as FLASHINFER_PEERS
from peers.flashinfer import Unavailable
from peers.flashinfer import prepare as prepare_flashinfer

#: torch SDPA runs on pre-gathered KV (a copy per request: 256 requests x a 32k prefix is ~130 GiB at full size);
#: beyond this share of the free memory the column is skipped rather than OOM the run (the rest of the step's
#: tensors and SDPA's own workspace need the remainder).
SDPA_MAX_FREE_FRACTION = 0.5


def _import(module: str, why: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise Unavailable(f"{why}: {module} not importable ({exc})") from exc


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32, device=device)


def _group_bounds(batch):
    """Row boundaries of each prefix group (groups are runs of consecutive requests) and a member of each."""
    indptr = batch.qo_indptr.cpu().numpy()
    members = [m for m, _ in batch.groups]
    return [int(indptr[m[0]]) for m in members] + [int(indptr[members[-1][-1] + 1])], [m[0] for m in members]


def prepare_flash_attn_cascade(batch) -> Prepared:
    """vLLM's former cascade: one varlen flash-attn pass of each group's rows over its shared prefix (non-causal), one
    over each request's suffix (causal), and a merge of the two states. Uses vLLM's flash-attn build (paged KV with
    16-token blocks; upstream flash-attn's paged KV needs blocks of 256)."""
    fa = _import("vllm.vllm_flash_attn", "flash-attn cascade (vLLM's build)")
    from prefixattn import merge_states

    s, device = batch.shape, batch.q.device
    bs, shared = s.block_size, s.shared
    scale = 1.0 / math.sqrt(s.head_dim)
    table = batch.block_table
    kv_lens = batch.kv_lens.cpu().numpy()
    q_lens = batch.q_lens
    bounds, reps = _group_bounds(batch)
    suffix_table = table[:, shared // bs:].contiguous()
    suffix_lens = torch.tensor(kv_lens - shared, dtype=torch.int32, device=device)
    prefix_table = table[reps, :shared // bs].contiguous() if shared else None
    prefix_lens = torch.full((len(reps),), shared, dtype=torch.int32, device=device)
    group_indptr = _i32(bounds, device)
    max_group_rows = int(np.diff(bounds).max())

    def run():
        out_s, lse_s = fa.flash_attn_varlen_func(
            q=batch.q, k=batch.k_cache, v=batch.v_cache, cu_seqlens_q=batch.qo_indptr, max_seqlen_q=int(q_lens.max()),
            seqused_k=suffix_lens, max_seqlen_k=int(suffix_lens.max()), softmax_scale=scale, causal=True,
            block_table=suffix_table, return_softmax_lse=True)
        if not shared:
            return out_s
        out_p, lse_p = fa.flash_attn_varlen_func(
            q=batch.q, k=batch.k_cache, v=batch.v_cache, cu_seqlens_q=group_indptr, max_seqlen_q=max_group_rows,
            seqused_k=prefix_lens, max_seqlen_k=shared, softmax_scale=scale, causal=False, block_table=prefix_table,
            return_softmax_lse=True)
        # flash-attn returns LSE as [num_heads, num_tokens]
        out, _ = merge_states(out_p, lse_p.transpose(0, 1), out_s, lse_s.transpose(0, 1))
        return out

    return Prepared(run=run, notes="levels=2" if shared else "levels=1")


def prepare_sdpa(batch) -> Prepared:
    """torch SDPA has no paged KV: each request's KV is gathered into contiguous tensors beforehand (not timed) and
    requests with equal (q_len, kv_len) run as one batched call with a bottom-right causal mask."""
    s, device = batch.shape, batch.q.device
    F = torch.nn.functional
    kv_lens = batch.kv_lens.cpu().numpy()
    q_lens = batch.q_lens
    gathered = int(kv_lens.sum()) * s.num_kv_heads * s.head_dim * 2 * batch.k_cache.element_size()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if gathered > SDPA_MAX_FREE_FRACTION * free:
            raise Unavailable(f"torch SDPA needs every request's KV gathered ({gathered / 2**30:.1f} GiB), more than "
                              f"{SDPA_MAX_FREE_FRACTION:.0%} of the free GPU memory ({free / 2**30:.1f} GiB)")
    indptr = batch.qo_indptr.cpu().numpy()
    groups: dict = {}
    for r in range(len(q_lens)):
        groups.setdefault((int(q_lens[r]), int(kv_lens[r])), []).append(r)
    calls = []
    for (q_len, kv_len), reqs in groups.items():
        slots = torch.from_numpy(np.stack([batch.kv_slots(r) for r in reqs])).to(device)
        k = batch.k_cache.view(-1, s.num_kv_heads, s.head_dim)[slots].transpose(1, 2)  # [B, Hkv, L, D]
        v = batch.v_cache.view(-1, s.num_kv_heads, s.head_dim)[slots].transpose(1, 2)
        rows = torch.from_numpy(np.stack([np.arange(indptr[r], indptr[r + 1]) for r in reqs])).to(device)
        q = batch.q[rows].transpose(1, 2)  # [B, Hq, q_len, D]
        mask = None
        if q_len > 1:
            mask = (torch.arange(kv_len, device=device)[None, :]
                    <= (kv_len - q_len + torch.arange(q_len, device=device))[:, None])
        calls.append((rows, q, k, v, mask))
    out = torch.empty_like(batch.q)

    def run():
        for rows, q, k, v, mask in calls:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=s.num_qo_heads != s.num_kv_heads)
            out[rows] = o.transpose(1, 2)
        return out

    return Prepared(run=run, notes=f"calls={len(calls)}")


#: GPU-only provider -> how to prepare it.
GPU_ONLY = {
    **{name: (lambda b, name=name: prepare_flashinfer(b, name)) for name in FLASHINFER_PEERS},
    "flash-attn-cascade": prepare_flash_attn_cascade,
    "torch-sdpa": prepare_sdpa,
}
