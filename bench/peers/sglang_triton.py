"""SGLang's own Triton attention kernels (``sglang.kernels.ops.attention``), called as its Triton backend calls them,
and a FlashInfer-style cascade composed from SGLang's extend kernel plus a merge.

Nothing is copied from SGLang: the kernels are imported from the installed package (they import plain ``triton``,
so they run in the interpreter as they are).

* ``sglang-triton``: a pure-decode batch goes through ``decode_attention_fwd`` (split-KV stage 1 + reduce, 2 launches;
  splits from SGLang's own ``get_num_kv_splits_triton`` for an H100's 132 SMs, host-side metadata not measured); a
  batch with prefill rows goes through ``extend_attention_fwd`` over every request (SGLang's mixed-chunk path: decodes
  are extends of length 1). The pool is SGLang's default token pool (page size 1): a flat view of the same cache.
  The extend kernel reads the new tokens' K/V from ``k_extend``/``v_extend`` (a copy the engine keeps beside the pool),
  labelled ``k_new``/``v_new`` and counted as KV.
* ``cascade-sglang``: FlashInfer's two-level cascade (``MultiLevelCascadeAttentionWrapper``) rebuilt from the same
  kernel: level 1, every group's query rows as one non-causal sequence against the group's shared KV (one launch);
  level 2, every request against its own KV (one launch); then one merge of the two states
  (:func:`prefixattn.merge_states`, the same math as FlashInfer's ``merge_state``). Without sharing only level 2 runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from peers.base import Prepared

#: SGLang's default ``--triton-attention-num-kv-splits``.
MAX_KV_SPLITS = 8
#: SMs SGLang's split heuristic is given on CPU: an H100 SXM (on CPU it has no device to ask and would use the
#: maximum); on a GPU, the device's own count.
DEVICE_CORE_COUNT = 132
#: ``get_num_kv_splits_triton`` schedules at least 256 sequences per launch (as the backend passes it).
MIN_SCHEDULE_SEQ = 256


def _kernels():
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    return decode_attention_fwd, extend_attention_fwd, get_num_kv_splits_triton


def _token_pool(batch):
    s = batch.shape
    return (batch.k_cache.view(-1, s.num_kv_heads, s.head_dim), batch.v_cache.view(-1, s.num_kv_heads, s.head_dim))


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32, device=device)


def _extend_args(batch, kv_ranges, q_lens, k_buf, v_buf):
    """Metadata of one ``extend_attention_fwd`` call: per request the prefix slots (from the pool) and, when
    ``q_lens`` has new tokens, a copy of their K/V (``k_extend``/``v_extend``)."""
    device = k_buf.device
    slots = [batch.kv_slots(r)[lo:hi] for r, (lo, hi) in enumerate(kv_ranges)]
    kv_indptr = _i32(np.r_[0, np.cumsum([len(x) for x in slots])], device)
    kv_indices = torch.from_numpy(np.concatenate(slots) if slots else np.zeros(0, np.int64)).to(device)
    kv_lens = batch.kv_lens.cpu()
    new = [batch.kv_slots(r)[int(kv_lens[r]) - q:int(kv_lens[r])] for r, q in enumerate(q_lens)]
    new_slots = torch.from_numpy(np.concatenate(new) if new else np.zeros(0, np.int64)).to(device)
    return kv_indptr, kv_indices, k_buf[new_slots].contiguous(), v_buf[new_slots].contiguous()


def _prepare_sglang(batch) -> Prepared:
    decode_fwd, extend_fwd, num_kv_splits_kernel = _kernels()
    s = batch.shape
    k_buf, v_buf = _token_pool(batch)
    sm_scale = 1.0 / math.sqrt(s.head_dim)
    q_lens = batch.q_lens
    n = len(q_lens)
    out = torch.empty_like(batch.q)
    device = batch.q.device
    if s.num_prefill == 0 and (q_lens == 1).all():
        kv_indptr = _i32(np.r_[0, np.cumsum(batch.kv_lens.cpu().numpy())], device)
        kv_indices = torch.from_numpy(np.concatenate([batch.kv_slots(r) for r in range(n)])).to(device)
        logits = torch.empty(n, s.num_qo_heads, MAX_KV_SPLITS, s.head_dim, dtype=torch.float32, device=device)
        lse = torch.empty(n, s.num_qo_heads, MAX_KV_SPLITS, dtype=torch.float32, device=device)
        splits = torch.empty(n, dtype=torch.int32, device=device)
        cores = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                 else DEVICE_CORE_COUNT)
        num_kv_splits_kernel[(1,)](splits, batch.kv_lens, n, 1, s.num_qo_heads, s.num_kv_heads, MAX_KV_SPLITS,
                                   cores, MAX_NUM_SEQ=max(MIN_SCHEDULE_SEQ, 1 << (n - 1).bit_length()))

        def run():
            decode_fwd(batch.q, k_buf, v_buf, out, kv_indptr, kv_indices, logits, lse, splits, MAX_KV_SPLITS,
                       sm_scale, 1.0, 1.0)
            return out

        return Prepared(run=run, labels=dict(out=out, partial_o=logits, partial_lse=lse, kv_indices=kv_indices),
                        notes=f"decode;splits={splits.tolist()[:4]}")

    kv_lens = batch.kv_lens.cpu().numpy()
    kv_indptr, kv_indices, k_new, v_new = _extend_args(
        batch, [(0, int(kv_lens[r]) - int(q_lens[r])) for r in range(n)], q_lens, k_buf, v_buf)

    def run():
        extend_fwd(batch.q, k_new, v_new, out, k_buf, v_buf, batch.qo_indptr, kv_indptr, kv_indices, None, True,
                   None, int(q_lens.max()), 1.0, 1.0, sm_scale=sm_scale)
        return out

    return Prepared(run=run, labels=dict(out=out, k_new=k_new, v_new=v_new, kv_indices=kv_indices), notes="extend")


def _prepare_cascade(batch) -> Prepared:
    from prefixattn import merge_states

    _, extend_fwd, _ = _kernels()
    s = batch.shape
    k_buf, v_buf = _token_pool(batch)
    sm_scale = 1.0 / math.sqrt(s.head_dim)
    q_lens, kv_lens = batch.q_lens, batch.kv_lens.cpu().numpy()
    n = len(q_lens)
    indptr = batch.qo_indptr.cpu().numpy()
    device = batch.q.device
    shared = s.shared
    # Level 2: each request against its own KV after the shared prefix (causal over its new tokens).
    kv_indptr2, kv_indices2, k_new, v_new = _extend_args(
        batch, [(shared, int(kv_lens[r]) - int(q_lens[r])) for r in range(n)], q_lens, k_buf, v_buf)
    out2 = torch.empty_like(batch.q)
    lse2 = torch.empty(batch.q.shape[:2], dtype=torch.float32, device=device)
    labels = dict(out=out2, k_new=k_new, v_new=v_new, kv_indices=kv_indices2, partial_lse=lse2)
    if shared == 0:
        def run_unique_only():
            extend_fwd(batch.q, k_new, v_new, out2, k_buf, v_buf, batch.qo_indptr, kv_indptr2, kv_indices2, None,
                       True, None, int(q_lens.max()), 1.0, 1.0, sm_scale=sm_scale, lse_extend=lse2)
            return out2

        return Prepared(run=run_unique_only, labels=labels, notes="levels=1")

    # Level 1: each group's rows (contiguous: groups are runs of requests) as one sequence against the shared KV.
    members = [m for m, _ in batch.groups]
    qo_indptr1 = _i32([indptr[m[0]] for m in members] + [indptr[members[-1][-1] + 1]], device)
    slots1 = [batch.kv_slots(m[0])[:shared] for m in members]
    kv_indptr1 = _i32(np.r_[0, np.cumsum([len(x) for x in slots1])], device)
    kv_indices1 = torch.from_numpy(np.concatenate(slots1)).to(device)
    max_rows1 = int(np.diff(qo_indptr1.cpu().numpy()).max())
    no_new = k_new[:0]
    out1 = torch.empty_like(batch.q)
    lse1 = torch.empty(batch.q.shape[:2], dtype=torch.float32, device=device)
    labels.update(partial_o=out1, kv_indices_shared=kv_indices1, partial_lse_shared=lse1)

    def run():
        extend_fwd(batch.q, no_new, no_new, out1, k_buf, v_buf, qo_indptr1, kv_indptr1, kv_indices1, None, False,
                   None, max_rows1, 1.0, 1.0, sm_scale=sm_scale, lse_extend=lse1, skip_extend=True)
        extend_fwd(batch.q, k_new, v_new, out2, k_buf, v_buf, batch.qo_indptr, kv_indptr2, kv_indices2, None, True,
                   None, int(q_lens.max()), 1.0, 1.0, sm_scale=sm_scale, lse_extend=lse2)
        v, _ = merge_states(out1, lse1, out2, lse2)
        return v

    return Prepared(run=run, labels=labels, notes=f"levels=2;groups={len(members)}")


def prepare(batch, provider: str) -> Prepared:
    if provider == "sglang-triton":
        return _prepare_sglang(batch)
    if provider == "cascade-sglang":
        return _prepare_cascade(batch)
    raise ValueError(f"provider: expected 'sglang-triton' or 'cascade-sglang', got {provider!r}")
