"""Exact fp32 (or fp64) torch reference for ragged paged attention: the ground truth every kernel is tested against."""

from __future__ import annotations

import math

import torch

from prefixattn.validation import check_metadata, check_qkv


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
):
    """Ragged paged attention computed exactly in ``compute_dtype`` (fp32 by default) with plain torch ops (slow;
    for tests and checks).

    Parameters
    ----------
    q : Tensor, ``[num_tokens, num_qo_heads, head_dim]``, fp16/bf16/fp32
        Query rows; request ``r`` owns rows ``qo_indptr[r]:qo_indptr[r+1]``.
    k_cache, v_cache : Tensor, ``[num_blocks, block_size, num_kv_heads, head_dim]``, dtype of ``q``
        Paged KV cache, any strides (engine layouts can be passed as views). ``block_size == 1`` is a token pool.
    qo_indptr : Tensor, ``[num_requests + 1]``, int32/int64
        Row offsets of each request's queries; starts at 0, non-decreasing.
    kv_lens : Tensor, ``[num_requests]``, int32/int64
        KV length of each request *including* its new query tokens (``kv_lens[r] >= q_len[r]``).
    block_table : Tensor, ``[num_requests, max_blocks]``, int32/int64
        ``block_table[r, j]`` is the physical block holding KV positions ``j*block_size .. (j+1)*block_size-1``.
    causal : bool
        The query tokens are the last ``q_len`` KV positions; query ``i`` of request ``r`` sees KV positions
        ``[0, kv_len - q_len + i]``. When False every query sees all ``kv_len`` positions.
    sm_scale : float, optional
        Logit scale; defaults to ``1 / sqrt(head_dim)``.
    return_lse : bool
        Also return the natural-log log-sum-exp of the scaled logits.
    compute_dtype : torch.float32 or torch.float64
        Arithmetic and output dtype; fp64 is the ground truth the GPU check compares every dtype against.

    Returns
    -------
    out : Tensor, ``[num_tokens, num_qo_heads, head_dim]``, ``compute_dtype``
        A row with no visible KV is 0.
    lse : Tensor, ``[num_tokens, num_qo_heads]``, ``compute_dtype`` (only with ``return_lse``)
        ``-inf`` for a row with no visible KV.

    Examples
    --------
    >>> q = torch.randn(3, 4, 64); kc = torch.randn(2, 16, 2, 64); vc = torch.randn_like(kc)
    >>> out = reference_attention(q, kc, vc, torch.tensor([0, 1, 3]), torch.tensor([5, 20]),
    ...                           torch.tensor([[0, 0], [0, 1]]))
    >>> out.shape
    torch.Size([3, 4, 64])
    """
    num_qo_heads, num_kv_heads, head_dim, block_size = check_qkv(q, k_cache, v_cache)
    indptr, lens, table = check_metadata(
        qo_indptr, kv_lens, block_table, block_size=block_size, num_blocks=k_cache.shape[0], num_tokens=q.shape[0]
    )
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    group = num_qo_heads // num_kv_heads
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}")
    acc = compute_dtype
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=acc, device=q.device)
    for r in range(lens.shape[0]):
        q_start, q_end, kv_len = int(indptr[r]), int(indptr[r + 1]), int(lens[r])
        q_len = q_end - q_start
        if q_len == 0 or kv_len == 0:
            continue
        pos = torch.arange(kv_len, device=q.device)
        block_ids = table[r].to(q.device)[pos // block_size]
        k = k_cache[block_ids, pos % block_size].to(acc).repeat_interleave(group, dim=1)  # [kv_len, qo_heads, d]
        v = v_cache[block_ids, pos % block_size].to(acc).repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[q_start:q_end].to(acc), k) * scale
        if causal:
            last_visible = kv_len - q_len + torch.arange(q_len, device=q.device)  # [q_len]
            hidden = pos.unsqueeze(0) > last_visible.unsqueeze(1)
            logits = logits.masked_fill(hidden.unsqueeze(0), -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)  # [h, q]
        visible = torch.isfinite(row_lse)
        probs = torch.where(visible.unsqueeze(-1), torch.exp(logits - row_lse.unsqueeze(-1)), 0.0)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
        lse[q_start:q_end] = row_lse.transpose(0, 1)
    return (out, lse) if return_lse else out
