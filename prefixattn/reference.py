"""Exact fp32 (or fp64) torch reference for ragged paged attention: the ground truth every kernel is tested against."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from prefixattn.validation import (check_kv_scale, check_metadata, check_qkv, check_sinks, check_soft_cap,
                                   check_tensor, check_window_left)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                        kv_lens: torch.Tensor, block_table: torch.Tensor, *, causal: bool = True,
                        sm_scale: float | None = None, return_lse: bool = False,
                        compute_dtype: torch.dtype = torch.float32, logits_soft_cap: float | None = None,
                        window_left: int | None = None, sinks: torch.Tensor | None = None, k_scale=None, v_scale=None):
    """Ragged paged attention computed exactly in ``compute_dtype`` (fp32 by default) with plain torch ops (slow;
    for tests and checks).

    Parameters
    ----------
    q : Tensor, ``[num_tokens, num_qo_heads, head_dim]``, fp16/bf16/fp32
        Query rows; request ``r`` owns rows ``qo_indptr[r]:qo_indptr[r+1]``.
    k_cache, v_cache : Tensor, ``[num_blocks, block_size, num_kv_heads, head_dim]``, dtype of ``q`` or fp8
        Paged KV cache, any strides (engine layouts can be passed as views). ``block_size == 1`` is a token pool.
        ``v_cache`` may have a head size of its own (``[..., v_head_dim]``), which the output takes.
        fp8 (e4m3fn/e5m2) caches are dequantized as ``k_cache * k_scale``, ``v_cache * v_scale``.
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
    logits_soft_cap : float, optional
        ``c > 0``: each scaled logit ``s`` becomes ``c * tanh(s / c)`` (None or 0: off).
    window_left : int, optional
        ``W >= 0`` (causal only): the query at KV position ``p`` sees keys ``p - W .. p`` (None or -1: off).
    sinks : Tensor, ``[num_qo_heads]``, fp32/bf16/fp16, optional
        One logit per query head that joins every row's softmax denominator once (no value: it adds weight, not
        output). The returned LSE includes it, so a row with no visible KV returns ``(0, sink)``.
    k_scale, v_scale : float or 1-element fp32 Tensor, optional
        Per-tensor dequantization scales of the caches (default 1).

    Returns
    -------
    out : Tensor, ``[num_tokens, num_qo_heads, v_head_dim]`` (V's head size), ``compute_dtype``
        A row with no visible KV is 0. NaN in, NaN out: NaN in a query row, or in a K/V row it sees, gives NaN
        (a causally hidden position never reaches a row, NaN or not).
    lse : Tensor, ``[num_tokens, num_qo_heads]``, ``compute_dtype`` (only with ``return_lse``)
        ``-inf`` for a row with no visible KV; NaN where a query or visible K row holds NaN.

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
    opts = _check_options(sm_scale=sm_scale, head_dim=head_dim, logits_soft_cap=logits_soft_cap,
                          window_left=window_left, causal=causal, sinks=sinks, num_qo_heads=num_qo_heads,
                          k_scale=k_scale, v_scale=v_scale, compute_dtype=compute_dtype, device=q.device)
    acc = opts.dtype
    sink_logits = None if sinks is None else sinks.to(acc)
    out = torch.zeros((*q.shape[:2], v_cache.shape[3]), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=acc, device=q.device)
    if sink_logits is not None:  # rows that see nothing still have the sink: (0, sink)
        lse[:] = sink_logits
    for r in range(lens.shape[0]):
        q_start, q_end, kv_len = int(indptr[r]), int(indptr[r + 1]), int(lens[r])
        if q_end == q_start or kv_len == 0:  # no rows, or rows that see nothing: (0, -inf or the sink) as set
            continue
        out[q_start:q_end], lse[q_start:q_end] = _request_attention(
            q[q_start:q_end].to(acc), k_cache, v_cache, block_ids=table[r], kv_len=kv_len,
            group=num_qo_heads // num_kv_heads, causal=causal, sink_logits=sink_logits, opts=opts)
    return (out, lse) if return_lse else out


class _Options(NamedTuple):
    """The checked scalar options of :func:`reference_attention`."""

    scale: float  # logit scale (sm_scale or 1 / sqrt(head_dim))
    soft_cap: float  # 0: off
    window: int  # -1: off
    k_mult: float  # k_scale and v_scale, the dequantization scales of fp8 caches (1 when not given)
    v_mult: float
    dtype: torch.dtype  # compute_dtype: arithmetic and output


def _check_options(*, sm_scale, head_dim: int, logits_soft_cap, window_left, causal: bool, sinks, num_qo_heads: int,
                   k_scale, v_scale, compute_dtype, device) -> _Options:
    """Check the options of :func:`reference_attention` (in this order, which fixes the error a call with several
    bad options gets); returns them as floats, ints and the dtype."""
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating))
                                 or not math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale: expected a finite float or None, got {sm_scale!r}")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    soft_cap = check_soft_cap(logits_soft_cap)
    window = check_window_left(window_left, causal)
    check_sinks(sinks, num_qo_heads, device)
    k_mult, v_mult = (float(check_kv_scale(n, x, device)) for n, x in (("k_scale", k_scale), ("v_scale", v_scale)))
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}")
    return _Options(scale=scale, soft_cap=soft_cap, window=window, k_mult=k_mult, v_mult=v_mult,
                    dtype=compute_dtype)


def _request_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, block_ids: torch.Tensor,
                       kv_len: int, group: int, causal: bool, sink_logits: torch.Tensor | None,
                       opts: _Options) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: its query rows ``q`` (``[q_len, h, d]`` in ``opts.dtype``) against its ``kv_len`` KV positions.
    Returns ``out`` ``[q_len, h, d]`` and ``lse`` ``[q_len, h]``."""
    k, v = _dequantized_kv(k_cache, v_cache, block_ids=block_ids, kv_len=kv_len, group=group, opts=opts)
    logits = _masked_logits(q, k, kv_len=kv_len, causal=causal, opts=opts)
    probs, lse = _softmax(logits, sink_logits)
    return _weighted_values(probs, v), lse.transpose(0, 1)


def _dequantized_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, *, block_ids: torch.Tensor, kv_len: int,
                    group: int, opts: _Options) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K and V, ``[kv_len, num_qo_heads, head_dim]`` (V: its own head size): position ``p`` read from
    block ``block_ids[p // block_size]``, row ``p % block_size``, each KV head repeated for its ``group`` query
    heads, times ``k_scale`` / ``v_scale`` (fp8 dequantization; 1 when not given), in ``opts.dtype``."""
    block_size = k_cache.shape[1]
    pos = torch.arange(kv_len, device=k_cache.device)
    blocks = block_ids.to(k_cache.device)[pos // block_size]
    k = k_cache[blocks, pos % block_size].to(opts.dtype).repeat_interleave(group, dim=1) * opts.k_mult
    v = v_cache[blocks, pos % block_size].to(opts.dtype).repeat_interleave(group, dim=1) * opts.v_mult
    return k, v


def _masked_logits(q: torch.Tensor, k: torch.Tensor, *, kv_len: int, causal: bool, opts: _Options) -> torch.Tensor:
    """``[h, q_len, kv_len]`` logits of one request: ``s = scale * q.k``, soft-capped to ``c * tanh(s / c)``, and
    ``-inf`` where the key is hidden from the query (see :func:`_hidden`)."""
    logits = torch.einsum("qhd,khd->hqk", q, k) * opts.scale
    if opts.soft_cap:
        logits = opts.soft_cap * torch.tanh(logits / opts.soft_cap)
    if causal:
        hidden = _hidden(q_len=q.shape[0], kv_len=kv_len, window=opts.window, device=q.device)
        logits = logits.masked_fill(hidden.unsqueeze(0), -math.inf)
    return logits


def _hidden(*, q_len: int, kv_len: int, window: int, device) -> torch.Tensor:
    """``[q_len, kv_len]`` bool, causal: query ``i`` sits at KV position ``p = kv_len - q_len + i`` and sees keys
    ``p - window .. p`` (``0 .. p`` when ``window`` is -1); every other key is hidden."""
    pos = torch.arange(kv_len, device=device)
    last_visible = kv_len - q_len + torch.arange(q_len, device=device)  # [q_len]
    hidden = pos.unsqueeze(0) > last_visible.unsqueeze(1)
    if window >= 0:
        hidden |= pos.unsqueeze(0) < (last_visible - window).unsqueeze(1)
    return hidden


def _softmax(logits: torch.Tensor, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax and natural-log LSE over the last dim of ``[h, q, k]`` logits (-inf = hidden).

    A row is empty iff its weights sum to 0 (every logit -inf): probabilities 0, LSE -inf. NaN is not -inf: a NaN
    logit makes the row's maximum, weights and sum NaN, so NaN in q or in a visible K row reaches out and LSE.
    ``sinks`` (``[h]``): one more logit per head in every row's denominator, with no value; the LSE includes it.
    """
    if sinks is not None:
        sink_col = sinks.view(-1, 1, 1).expand(logits.shape[0], logits.shape[1], 1)
        probs, lse = _softmax(torch.cat([logits, sink_col], dim=-1))
        return probs[..., :-1], lse
    row_max = logits.amax(dim=-1, keepdim=True)  # amax propagates NaN
    weights = torch.exp(logits - torch.where(row_max == -math.inf, 0.0, row_max))
    weight_sum = weights.sum(dim=-1)  # [h, q]
    empty = weight_sum == 0
    probs = weights / torch.where(empty, 1.0, weight_sum).unsqueeze(-1)
    lse = torch.where(empty, -math.inf, row_max.squeeze(-1) + torch.log(torch.where(empty, 1.0, weight_sum)))
    return probs, lse


def _weighted_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``sum_k probs[h, q, k] * v[k, h, :]`` -> ``[q, h, d]``, where a hidden position (weight 0) contributes
    nothing even when its V is NaN/inf (a matmul would give 0 * NaN = NaN), while a visible one propagates it."""
    bad = ~torch.isfinite(v)
    if not bad.any():
        return torch.einsum("hqk,khd->qhd", probs, v)
    # Rare (non-finite V only): the product per position, hidden ones dropped before the sum.
    terms = probs.unsqueeze(-1) * v.permute(1, 0, 2).unsqueeze(1)  # [h, q, k, d]
    terms = torch.where((probs != 0).unsqueeze(-1), terms, 0.0)  # NaN != 0: NaN weights stay
    return terms.sum(dim=2).transpose(0, 1)


def reference_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, qo_indptr: torch.Tensor, kv_lens: torch.Tensor,
                            block_table: torch.Tensor, *, kv_lora_rank: int, sm_scale: float, causal: bool = True,
                            return_lse: bool = False, compute_dtype: torch.dtype = torch.float32, kv_scale=None):
    """Multi-head latent attention in the absorbed form (:func:`prefixattn.mla_attention`'s conventions), exactly in
    ``compute_dtype``: multi-query attention of ``q`` against one KV head whose keys are the cache rows and whose
    values are their first ``kv_lora_rank`` columns (the latent).

    Parameters
    ----------
    q : Tensor, ``[num_tokens, num_heads, kv_lora_rank + rope_dim]``, fp16/bf16/fp32
    kv_cache : Tensor, ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, dtype of q or fp8
    qo_indptr, kv_lens, block_table, causal, return_lse, compute_dtype
        As :func:`reference_attention`.
    kv_lora_rank : int
        The latent width: the output's last dimension.
    sm_scale : float
        The model's logit scale.
    kv_scale : float or 1-element fp32 Tensor, optional
        Dequantization scale of an fp8 cache (keys and values alike).

    Returns
    -------
    out : Tensor, ``[num_tokens, num_heads, kv_lora_rank]``, ``compute_dtype`` (and ``lse`` ``[num_tokens,
    num_heads]`` with ``return_lse``)
    """
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        check_tensor(name, t, ndim=3)
    if not 0 < kv_lora_rank < kv_cache.shape[-1]:
        raise ValueError(f"kv_lora_rank: expected a width in [1, {kv_cache.shape[-1] - 1}] (kv_cache dim 2 holds the "
                         f"latent and the rotary key), got {kv_lora_rank!r}")
    k_cache = kv_cache.unsqueeze(2)
    v_cache = k_cache.clone()
    v_cache[..., kv_lora_rank:] = 0  # the value is the latent alone: the rotary columns' output is cut below
    got = reference_attention(q, k_cache, v_cache, qo_indptr, kv_lens, block_table, causal=causal, sm_scale=sm_scale,
                              return_lse=True, compute_dtype=compute_dtype, k_scale=kv_scale, v_scale=kv_scale)
    out = got[0][..., :kv_lora_rank]
    return (out, got[1]) if return_lse else out
