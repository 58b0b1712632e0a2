"""MLA with each shared prefix attended in the naive form (TyphoonMLA's split, arXiv 2509.21081):
:func:`plan_mla_naive` once per step, :func:`mla_naive_attention` once per layer.

The absorbed form (:func:`prefixattn.mla_attention`) costs ``2 x (kv_lora_rank + rope_dim) + 2 x kv_lora_rank``
FLOPs per (query head, KV token): 2,176 at DeepSeek-V3's widths. The naive form attends keys ``[W_UK c | k_pe]``
(``qk_nope_head_dim + rope_dim`` per head) and values ``W_UV c`` (``v_head_dim``): ``2 x (192 + 128) = 640`` FLOPs,
768 at the kernel's padded lanes, after up-projecting the latent ``c`` of each key (``2 x kv_lora_rank x
(qk_nope_head_dim + v_head_dim)`` FLOPs per head and token). For a request's own tokens that up-projection costs more
than it saves; for a prefix that many requests share it is paid once per step for all of them. So, per group of
requests under one shared prefix, where :func:`naive_form_pays_off` says so (modeled): the prefix's distinct latent
blocks are gathered and up-projected once, every member's query rows attend them in the naive form with
:func:`prefixattn.attention` (a shared node: one matrix product over the group's rows per head, values of their own
head size), the rest of each request's KV is attended in the absorbed form (:func:`prefixattn.mla_attention`), its
latent output up-projected by ``W_UV``, and the two partial states are merged (:func:`prefixattn.merge_states`).
The output is the value ``[tokens, num_heads, v_head_dim]``: the layer's ``W_UV`` is applied here.

A group is the requests whose block tables share their first block, its prefix the leading blocks all of them share,
up to the first query position of each; a member whose query rows outnumber the prefix's tokens keeps the absorbed
form (the non-causal naive plan holds a request's rows within its KV). The prefix is up-projected in every step and
layer, or, with a :class:`~prefixattn.mla_naive_cache.NaivePrefixCache` (a memory budget the user sets), once per
layer for all the steps that hold it, as TyphoonMLA keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from prefixattn.autotune.config_space import block_d
from prefixattn.merge import merge_states
from prefixattn.mla import mla_attention, plan_mla
from prefixattn.mla_naive_cache import NaivePrefixCache
from prefixattn.planner.options import _positive_int
from prefixattn.planner.plans import Plan, plan
from prefixattn.prefix_attention import attention
from prefixattn.validation import check_head_dim, check_host_metadata, check_mla_dims, check_tensor

#: Rates that price the choice of form (:func:`naive_form_pays_off`, modeled), measured on the H200 at 74e5177
#: (``bench/results/gpu/nvidia-h200-74e5177.md``): prefixattn's causal-prefill rate (both forms' attention runs on its
#: kernels), FlashAttention-3's (standing for the up-projection's dense GEMM: no GEMM was measured), and the swept
#: read kernel's HBM rate.
ATTENTION_TFLOPS = 342.2
GEMM_TFLOPS = 577.4
HBM_GBPS = 3913.0
#: The values of ``form``.
FORMS = ("auto", "naive", "absorbed")


def naive_form_pays_off(*, rows: int, num_heads: int, kv_lora_rank: int, rope_dim: int, qk_nope_head_dim: int,
                        v_head_dim: int, elt_bytes: int = 2, cached: bool = False) -> bool:
    """Whether ``rows`` query rows (of one group's requests) attend their shared prefix faster in the naive form
    (modeled, per prefix token): the absorbed form's FLOPs at the kernels' lanes against the naive form's, plus the
    prefix's up-projection (a GEMM) and its keys and values written and read once (``elt_bytes`` each: q's dtype), at
    :data:`ATTENTION_TFLOPS`, :data:`GEMM_TFLOPS` and :data:`HBM_GBPS`; ``cached``: the keys and values are in a
    :class:`~prefixattn.mla_naive_cache.NaivePrefixCache` already, only read. Not priced: the latent read both forms
    share, and the absorbed form's re-reads of a shared latent per tile (L2 hits mostly), which favours the absorbed
    form. At DeepSeek-V3's widths the naive form pays from 190 rows (16-bit; 270 in fp32; cached from 40), at any head
    count: every term is per head."""
    absorbed = 2 * (block_d(kv_lora_rank) + block_d(rope_dim)) + 2 * block_d(kv_lora_rank)
    naive = 2 * block_d(qk_nope_head_dim + rope_dim) + 2 * block_d(v_head_dim)
    saved_us = rows * num_heads * (absorbed - naive) / (ATTENTION_TFLOPS * 1e6)
    gemm_us = 0.0 if cached else num_heads * 2 * kv_lora_rank * (qk_nope_head_dim + v_head_dim) / (GEMM_TFLOPS * 1e6)
    passes = 1 if cached else 2  # read; or written, then read
    bytes_us = num_heads * passes * (qk_nope_head_dim + rope_dim + v_head_dim) * elt_bytes / (HBM_GBPS * 1e3)
    return saved_us > gemm_us + bytes_us


@dataclass(eq=False)
class NaiveMLAPlan:
    """One step of :func:`mla_naive_attention`: the absorbed plan, the naive plan over the up-projected prefixes, and
    what a layer gathers for it."""

    #: :func:`prefixattn.plan_mla` over each request's KV past its naive-form prefix (all of it for the others).
    absorbed: Plan
    #: :func:`prefixattn.plan` over the gathered prefix blocks (one KV head per query head, keys of
    #: ``qk_nope_head_dim + rope_dim``, values of ``v_head_dim``, non-causal); None when no group takes the form.
    naive: Plan | None
    #: ``[num_prefix_blocks]`` int64 on the device: the latent blocks the naive plan's block ids index, in order.
    prefix_blocks: torch.Tensor | None
    #: ``[naive rows]`` int64 on the device: the query rows of the naive plan's requests (None: every row, in order).
    naive_rows: torch.Tensor | None
    kv_lora_rank: int
    rope_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    #: ``mla_form`` ("naive" where a group takes it, else "absorbed"), ``naive_groups``, ``naive_requests``,
    #: ``naive_prefix_tokens`` (each group's prefix once), ``declined_groups`` (groups the rule kept absorbed); with
    #: a cache ``naive_cached_blocks`` (found there) and ``naive_upprojected_blocks`` (up-projected by this step's
    #: layers; every prefix block where they did not fit).
    stats: dict = field(default_factory=dict)
    #: The cache the plan was made with (None: none) and the cache's step then
    #: (:meth:`~prefixattn.mla_naive_cache.NaivePrefixCache.check_plan`); ``in_cache``: the naive plan's block ids
    #: index the cache's slots (else ``prefix_blocks``: the step's blocks did not fit).
    cache: NaivePrefixCache | None = None
    cache_step: int = -1
    in_cache: bool = False
    #: With a cache: the latent blocks this step's layers up-project (device, int64) and their slots (device and
    #: host); None where none.
    upproject_blocks: torch.Tensor | None = None
    upproject_slots: torch.Tensor | None = None
    upproject_slots_host: np.ndarray | None = None


def _prefix_groups(indptr: np.ndarray, lens: np.ndarray, table: np.ndarray, block_size: int) -> list:
    """``(members, prefix_blocks)`` of each group: requests (two or more) whose first blocks are one block, and the
    leading blocks all of them share, within each member's KV before its first query row."""
    q_lens = np.diff(indptr)
    before = (lens - q_lens) // block_size  # whole blocks before each request's first query row
    eligible = np.flatnonzero(before > 0)
    groups = []
    for first in np.unique(table[eligible, 0]):
        members = eligible[table[eligible, 0] == first]
        if members.size < 2:
            continue
        limit = int(before[members].min())
        rows = table[members, :limit]
        same = np.all(rows == rows[0], axis=0)
        blocks = limit if same.all() else int(np.argmin(same))
        groups.append((members, blocks))
    return groups


def plan_mla_naive(qo_indptr: torch.Tensor, kv_lens: torch.Tensor, block_table: torch.Tensor, *, block_size: int,
                   num_heads: int, sm_scale: float, kv_lora_rank: int = 512, rope_dim: int = 64,
                   qk_nope_head_dim: int = 128, v_head_dim: int = 128, form: str = "auto",
                   q_dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None, device=None,
                   num_sms: int | None = None, num_blocks: int | None = None,
                   cache: NaivePrefixCache | None = None) -> NaiveMLAPlan:
    """Plan one step of :func:`mla_naive_attention` (host; reuse the plan for every layer).

    Parameters
    ----------
    qo_indptr, kv_lens, block_table : Tensor
        As :func:`prefixattn.plan_mla`, on the host (a device tensor is copied: a synchronization).
    block_size, num_heads, sm_scale, kv_lora_rank, rope_dim, q_dtype, kv_dtype, device, num_sms, num_blocks
        As :func:`prefixattn.plan_mla` (``sm_scale``: the model's, ``1 / sqrt(qk_nope_head_dim + rope_dim)``).
    qk_nope_head_dim, v_head_dim : int
        The naive form's per-head widths (DeepSeek-V3, Kimi-K2: 128 and 128); ``qk_nope_head_dim + rope_dim`` and
        ``v_head_dim`` must be supported head sizes (multiples of 8, 32-256).
    form : {"auto", "naive", "absorbed"}
        ``"auto"``: each group takes the naive form where :func:`naive_form_pays_off` says so (modeled);
        ``"naive"``: every group; ``"absorbed"``: none (:func:`prefixattn.plan_mla`'s plan alone).
    cache : NaivePrefixCache, optional
        Keep the up-projected prefix blocks across steps (its widths, heads, block size and dtype the plan's): this
        step's layers up-project only the blocks it does not hold, and the plan runs only until the next plan or
        ``forget()`` on the cache. Where the step's prefix blocks do not fit, it up-projects them as without one.

    Returns
    -------
    NaiveMLAPlan
    """
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    num_heads = _positive_int("num_heads", num_heads)
    check_mla_dims(kv_lora_rank, rope_dim)
    check_head_dim("qk_nope_head_dim + rope_dim", qk_nope_head_dim + rope_dim)
    check_head_dim("v_head_dim", v_head_dim)
    indptr, lens, table, _ = check_host_metadata(qo_indptr, kv_lens, block_table, block_size=block_size,
                                                 num_blocks=num_blocks)
    _check_cache(cache, num_heads=num_heads, block_size=block_size, key_dim=qk_nope_head_dim + rope_dim,
                 v_head_dim=v_head_dim, q_dtype=q_dtype)
    device = device if device is not None else getattr(block_table, "device", None)
    elt = q_dtype.itemsize  # the up-projected keys and values are q's dtype, whatever the latent cache's
    q_lens = np.diff(indptr)
    common = dict(sm_scale=sm_scale, q_dtype=q_dtype, device=device, num_sms=num_sms)
    chosen, declined = [], 0
    for members, blocks in (_prefix_groups(indptr, lens, table, block_size) if form != "absorbed" else []):
        members = members[q_lens[members] <= blocks * block_size]  # rows within the non-causal naive plan's KV
        if members.size < 2:
            continue
        if form == "auto" and not naive_form_pays_off(
                rows=int(q_lens[members].sum()), num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, elt_bytes=elt,
                cached=cache is not None and cache.holds(table[members[0], :blocks])):
            declined += 1
            continue
        chosen.append((members, blocks))
    # The absorbed plan: each request's KV past its naive prefix (its block row shifted by the prefix's blocks).
    naive_of = np.zeros(lens.shape[0], dtype=np.int64)  # each request's naive-form prefix, in blocks
    shifted = table.copy()
    for members, blocks in chosen:
        naive_of[members] = blocks
        shifted[members, :table.shape[1] - blocks] = table[members, blocks:]
    absorbed = plan_mla(torch.from_numpy(indptr), torch.from_numpy(lens - naive_of * block_size),
                        torch.from_numpy(shifted), num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                        rope_dim=rope_dim, kv_dtype=kv_dtype, num_blocks=num_blocks, block_size=block_size, **common)
    widths = dict(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, qk_nope_head_dim=qk_nope_head_dim,
                  v_head_dim=v_head_dim)
    stats = dict(mla_form="naive" if chosen else "absorbed", declined_groups=declined, naive_groups=len(chosen))
    if not chosen:
        stats.update(naive_requests=0, naive_prefix_tokens=0)
        if cache is not None:
            stats.update(naive_cached_blocks=0, naive_upprojected_blocks=0)
        return NaiveMLAPlan(absorbed=absorbed, naive=None, prefix_blocks=None, naive_rows=None, **widths, stats=stats,
                            cache=cache, cache_step=cache.step if cache is not None else -1)
    ids = np.unique(np.concatenate([table[members[0], :blocks] for members, blocks in chosen]))
    kept = cache.assign(ids) if cache is not None else None
    naive, rows = _naive_plan(chosen, indptr, q_lens, table, ids, kept[0] if kept else None,
                              cache.capacity if kept else ids.size, num_heads=num_heads,
                              head_dim=qk_nope_head_dim + rope_dim, v_head_dim=v_head_dim, block_size=block_size,
                              **common)
    stats.update(naive_requests=naive.num_requests, naive_prefix_tokens=int(ids.size) * block_size)
    on = naive.device
    made = NaiveMLAPlan(absorbed=absorbed, naive=naive, prefix_blocks=torch.from_numpy(ids).to(on), naive_rows=rows,
                        **widths, stats=stats, cache=cache, cache_step=cache.step if cache is not None else -1)
    if cache is not None and kept is None:  # the step's blocks do not fit: up-projected as without a cache
        stats.update(naive_cached_blocks=0, naive_upprojected_blocks=int(ids.size))
    elif kept is not None:
        slots, missing = kept
        stats.update(naive_cached_blocks=int((~missing).sum()), naive_upprojected_blocks=int(missing.sum()))
        made.in_cache = True
        if missing.any():
            made.upproject_blocks = torch.from_numpy(ids[missing]).to(on)
            made.upproject_slots = torch.from_numpy(slots[missing]).to(on)
            made.upproject_slots_host = slots[missing]
    return made


def _naive_plan(chosen: list, indptr: np.ndarray, q_lens: np.ndarray, table: np.ndarray, ids: np.ndarray,
                slots: np.ndarray | None, num_blocks: int, *, num_heads: int, head_dim: int, v_head_dim: int,
                block_size: int, **common) -> tuple:
    """The naive plan of the ``chosen`` groups (``(members, prefix blocks)``): each group's prefix blocks up-projected
    once (``ids``: the distinct latent blocks, sorted), its members' rows over them, shared (every block of a member's
    naive KV is its group's: one matrix product over the group's rows per head and tile). Its block ids index
    ``ids``'s order, or with a cache the blocks' ``slots`` (of ``num_blocks``). Returns ``(plan, rows)``: ``rows``
    the members' query rows on the plan's device (None: every row, in order)."""
    index = np.searchsorted(ids, np.concatenate([table[members[0], :blocks] for members, blocks in chosen]))
    if slots is not None:
        index = slots[index]
    reqs = np.concatenate([members for members, _ in chosen])
    order = np.argsort(reqs, kind="stable")  # requests in the batch's order: the rows gathered stay sorted
    naive_table = np.zeros((reqs.size, max(blocks for _, blocks in chosen)), dtype=np.int64)
    kv_lens = np.zeros(reqs.size, dtype=np.int64)
    start, first = 0, 0
    for members, blocks in chosen:
        naive_table[first:first + members.size, :blocks] = index[start:start + blocks]
        kv_lens[first:first + members.size] = blocks * block_size
        start, first = start + blocks, first + members.size
    reqs, naive_table, kv_lens = reqs[order], naive_table[order], kv_lens[order]
    naive = plan(torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens[reqs])])), torch.from_numpy(kv_lens),
                 torch.from_numpy(naive_table), num_qo_heads=num_heads, num_kv_heads=num_heads, head_dim=head_dim,
                 v_head_dim=v_head_dim, causal=False, num_blocks=int(num_blocks), sharing="always",
                 block_size=block_size, **common)
    rows = None
    if reqs.size < q_lens.size:
        rows = torch.from_numpy(np.concatenate([np.arange(indptr[r], indptr[r + 1]) for r in reqs]))
        rows = rows.to(naive.device)
    return naive, rows


def mla_naive_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, plan: NaiveMLAPlan,
                        w_uk: torch.Tensor, w_uv: torch.Tensor, *, kv_scale: float | torch.Tensor | None = None,
                        layer: int | None = None) -> torch.Tensor:
    """MLA for one layer with the shared prefixes of :func:`plan_mla_naive`'s groups in the naive form.

    Parameters
    ----------
    q_nope : Tensor, ``[num_tokens, num_heads, qk_nope_head_dim]``, fp16/bf16/fp32
        The queries before absorption (the naive form's, without the rotary part).
    q_pe : Tensor, ``[num_tokens, num_heads, rope_dim]``, dtype of ``q_nope``
        The rotary queries.
    kv_cache : Tensor, ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
        As :func:`prefixattn.mla_attention`'s (fp8: dequantized with ``kv_scale``).
    plan : NaiveMLAPlan
    w_uk : Tensor, ``[num_heads, qk_nope_head_dim, kv_lora_rank]``, dtype of ``q_nope``
        The key up-projection: a head's no-rope key is ``w_uk[h] @ c`` (DeepSeek's ``kv_b_proj``, key rows).
    w_uv : Tensor, ``[num_heads, kv_lora_rank, v_head_dim]``, dtype of ``q_nope``
        The value up-projection: a head's value is ``c @ w_uv[h]``.
    kv_scale : float or Tensor ``[1]`` fp32, optional
        As :func:`prefixattn.mla_attention`'s.
    layer : int, optional
        The layer's index in the plan's cache (``plan_mla_naive(cache=...)``; required there): its keys and values
        are that layer's.

    Returns
    -------
    Tensor, ``[num_tokens, num_heads, v_head_dim]`` in q's dtype: the attention's value, ``W_UV`` applied.
    """
    _check_call(q_nope, q_pe, w_uk, w_uv, plan)
    if plan.cache is not None:
        plan.cache.check_plan(plan.cache_step, layer)
    elif layer is not None:
        raise ValueError("layer: the plan keeps no cache (plan_mla_naive(cache=...)); got a layer")
    rank = plan.kv_lora_rank
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
    latent_out, lse = mla_attention(q_abs, kv_cache, plan.absorbed, return_lse=True, kv_scale=kv_scale)
    out = torch.einsum("thr,hrv->thv", latent_out, w_uv)
    if plan.naive is None:
        return out
    if not plan.in_cache:
        k, v = _up_project(kv_cache, plan.prefix_blocks, w_uk, w_uv, rank=rank, kv_scale=kv_scale)
    else:  # this layer's keys and values in the cache's slots, the blocks it did not hold up-projected first
        k, v = plan.cache.k[layer], plan.cache.v[layer]
        if plan.upproject_blocks is not None:
            new_k, new_v = _up_project(kv_cache, plan.upproject_blocks, w_uk, w_uv, rank=rank, kv_scale=kv_scale)
            k.index_copy_(0, plan.upproject_slots, new_k)
            v.index_copy_(0, plan.upproject_slots, new_v)
            plan.cache.written(layer, plan.upproject_slots_host)
    q_naive = torch.cat([q_nope, q_pe], dim=-1)
    rows = plan.naive_rows
    if rows is not None:
        q_naive = q_naive.index_select(0, rows)
    o, lse_naive = attention(q_naive, k, v, plan.naive, return_lse=True)
    if rows is None:
        merged, _ = merge_states(out, lse, o, lse_naive)
        return merged
    merged, _ = merge_states(out.index_select(0, rows), lse.index_select(0, rows), o, lse_naive)
    return out.index_copy_(0, rows, merged)


def _up_project(kv_cache: torch.Tensor, blocks: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, *, rank: int,
                kv_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive form's keys ``[n, block_size, heads, qk_nope_head_dim + rope_dim]`` and values ``[n, block_size,
    heads, v_head_dim]`` (``w_uk``'s dtype) of the latent ``blocks`` (``[n]`` int64) of ``kv_cache``."""
    latent = kv_cache.index_select(0, blocks)
    if latent.dtype != w_uk.dtype:  # an fp8 cache: dequantize the gathered blocks only
        latent = latent.to(w_uk.dtype) * (kv_scale.to(w_uk.dtype) if torch.is_tensor(kv_scale)
                                          else (1.0 if kv_scale is None else kv_scale))
    n, bs, _ = latent.shape
    c, k_pe = latent[..., :rank].reshape(n * bs, rank), latent[..., rank:].reshape(n * bs, 1, -1)
    heads = w_uk.shape[0]
    k = torch.cat([torch.einsum("pr,hnr->phn", c, w_uk), k_pe.expand(-1, heads, -1)], dim=-1)
    v = torch.einsum("pr,hrv->phv", c, w_uv)
    return k.view(n, bs, heads, -1), v.view(n, bs, heads, -1)


def _check_cache(cache, *, num_heads: int, block_size: int, key_dim: int, v_head_dim: int, q_dtype) -> None:
    """The cache a plan keeps its prefixes in holds the plan's widths, heads, block size and dtype."""
    if cache is None:
        return
    if not isinstance(cache, NaivePrefixCache):
        raise ValueError(f"cache: expected a NaivePrefixCache, got {type(cache).__name__}")
    want = dict(num_heads=num_heads, block_size=block_size, key_dim=key_dim, v_head_dim=v_head_dim, dtype=q_dtype)
    got = {name: getattr(cache, name) for name in want}
    if got != want:
        raise ValueError(f"cache: expected a NaivePrefixCache of the plan's {want}, got {got}")


def _check_call(q_nope, q_pe, w_uk, w_uv, p: NaiveMLAPlan) -> None:
    """Shapes and dtypes of the per-layer inputs against the plan (the caches and q's rows: the plans' own calls)."""
    if not isinstance(p, NaiveMLAPlan):
        raise ValueError(f"plan: expected a NaiveMLAPlan (from prefixattn.plan_mla_naive), got {type(p).__name__}")
    heads = p.absorbed.num_qo_heads
    for name, t, want in (("q_nope", q_nope, (heads, p.qk_nope_head_dim)), ("q_pe", q_pe, (heads, p.rope_dim))):
        check_tensor(name, t, ndim=3)
        if tuple(t.shape[1:]) != want:
            raise ValueError(f"{name}: expected shape [*, {want[0]}, {want[1]}] (the plan's heads and widths), got "
                             f"{tuple(t.shape)}")
    if q_pe.shape[0] != q_nope.shape[0]:
        raise ValueError(f"q_pe: expected {q_nope.shape[0]} rows (q_nope's), got {q_pe.shape[0]}")
    for name, t, want in (("w_uk", w_uk, (heads, p.qk_nope_head_dim, p.kv_lora_rank)),
                          ("w_uv", w_uv, (heads, p.kv_lora_rank, p.v_head_dim))):
        check_tensor(name, t, ndim=3, dtypes=(q_nope.dtype,))
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} (the plan's heads and widths), got {tuple(t.shape)}")
    check_tensor("q_pe", q_pe, dtypes=(q_nope.dtype,))
