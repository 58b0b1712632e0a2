"""A stand-in for the parts of ``flashinfer`` (0.6.0, the version scripts/gpu_wheels.sh pins) that bench/peers/
flashinfer.py calls, so the adapters run on a CPU: every constructor, ``plan`` and ``run`` has the parameter names,
order and defaults of the real one (flashinfer/decode.py, prefill.py, cascade.py, attention.py, pod.py, mla.py at tag
v0.6.0), repeats its argument checks (cuda-graph buffers, fixed batch size, ``out`` shape), keeps the metadata where
the real wrapper keeps it (copied into the graph buffers in cuda-graph mode) and computes attention from the paged
lists exactly as FlashInfer defines them (pages ``indices[indptr[i]:indptr[i+1]]``, the last holding
``last_page_len[i]`` tokens; causal masks aligned to the end of the KV). A wrong keyword, a missing buffer or wrong
paged lists fail here as they would there; speed, kernels and numerics beyond fp32 are not modeled.
"""

from __future__ import annotations

import math
import types

import torch


def _kv(paged_kv_cache, kv_layout):
    if kv_layout != "NHD":
        raise ValueError(f"fake flashinfer: only NHD, got {kv_layout}")
    if isinstance(paged_kv_cache, tuple):
        return paged_kv_cache
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1]


def _attend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_lens, *, causal, sm_scale):
    """out, lse over requests: request i's rows qo_indptr[i]:qo_indptr[i+1] against its first kv_lens[i] tokens of
    pages kv_indices[kv_indptr[i]:kv_indptr[i+1]]."""
    hq, d = q.shape[1], q.shape[2]
    hkv, ps = k_cache.shape[2], k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    qo, ip, ix, lens = (t.cpu().tolist() for t in (qo_indptr, kv_indptr, kv_indices, kv_lens))
    for i in range(len(qo) - 1):
        rows, n = slice(qo[i], qo[i + 1]), int(lens[i])
        pages = ix[ip[i]:ip[i + 1]]
        if len(pages) * ps < n or (pages and (len(pages) - 1) * ps >= n):
            raise ValueError(f"fake flashinfer: request {i}: {len(pages)} pages for {n} tokens")
        if n == 0 or qo[i + 1] == qo[i]:
            continue
        k = k_cache[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)
        v = v_cache[pages].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale
        m = qo[i + 1] - qo[i]
        if causal:
            visible = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
            logits = logits.masked_fill(~visible.to(q.device), float("-inf"))
        lse[rows] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)
    return out.to(q.dtype), lse


#: BatchPrefillWithPagedKVCacheWrapper's backends (prefill.py at v0.6.0).
PREFILL_BACKENDS = ("auto", "fa2", "fa3", "cudnn", "trtllm-gen")


def _lens(indptr, last_page_len, page_size):
    # flashinfer.page.get_seq_lens
    return torch.clamp(indptr[1:] - indptr[:-1] - 1, min=0) * page_size + last_page_len


def _check_int32(name, t):
    if not torch.is_tensor(t) or t.dtype != torch.int32:
        raise TypeError(f"fake flashinfer: {name} must be an int32 tensor")


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        if backend not in PREFILL_BACKENDS:
            raise ValueError(f"fake flashinfer: backend {backend!r} is not one of {PREFILL_BACKENDS}")
        self._kv_layout, self._backend, self._use_cuda_graph = kv_layout, backend, use_cuda_graph
        if use_cuda_graph:
            for name, buf in (("qo_indptr_buf", qo_indptr_buf), ("paged_kv_indptr_buf", paged_kv_indptr_buf),
                              ("paged_kv_indices_buf", paged_kv_indices_buf),
                              ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)):
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in CUDA graph mode")
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            if len(paged_kv_indptr_buf) != self._fixed_batch_size + 1:
                raise ValueError("The length of paged_kv_indptr_buf should be batch_size + 1.")
            if len(paged_kv_last_page_len_buf) != self._fixed_batch_size:
                raise ValueError("The length of paged_kv_last_page_len_buf should be batch_size.")
        self._bufs = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        for name, t in (("qo_indptr", qo_indptr), ("paged_kv_indptr", paged_kv_indptr),
                        ("paged_kv_indices", paged_kv_indices), ("paged_kv_last_page_len", paged_kv_last_page_len)):
            _check_int32(name, t)
        if self._use_cuda_graph:
            if len(qo_indptr) - 1 != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed during the lifecycle of the wrapper in cuda graph "
                                 "mode")
            if len(paged_kv_indices) > len(self._bufs[2]):
                raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
            self._bufs[0].copy_(qo_indptr)
            self._bufs[1].copy_(paged_kv_indptr)
            self._bufs[3].copy_(paged_kv_last_page_len)
            self._bufs[2][:len(paged_kv_indices)].copy_(paged_kv_indices)
            self._meta = self._bufs
        else:
            self._meta = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        self._causal, self._sm_scale, self._page_size = causal, sm_scale, page_size
        self._heads = (num_qo_heads, num_kv_heads, head_dim_qk)
        self._dtypes = (q_data_type, kv_data_type or q_data_type)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None):
        k_cache, v_cache = _kv(paged_kv_cache, self._kv_layout)
        if q.dtype != self._dtypes[0] or k_cache.dtype != self._dtypes[1]:
            raise ValueError("fake flashinfer: q/kv dtype differs from the planned one")
        if tuple(q.shape[1:]) != (self._heads[0], self._heads[2]) or k_cache.shape[2] != self._heads[1]:
            raise ValueError("fake flashinfer: q/kv heads differ from the planned ones")
        qo, ip, ix, last = self._meta
        if q.shape[0] < int(qo[-1]):
            raise ValueError("fake flashinfer: fewer query rows than qo_indptr[-1]")
        o, s = _attend(q, k_cache, v_cache, qo, ip, ix, _lens(ip, last, self._page_size), causal=self._causal,
                       sm_scale=self._sm_scale)
        if out is not None:
            if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
                raise ValueError("fake flashinfer: out has the wrong shape or dtype")
            out.copy_(o)
            o = out
        if return_lse and lse is not None:  # flashinfer's check_shape_dtype_device on a given lse
            if tuple(lse.shape) != tuple(q.shape[:2]) or lse.dtype != torch.float32:
                raise ValueError("fake flashinfer: lse has the wrong shape or dtype")
            lse.copy_(s)
            s = lse
        return (o, s) if return_lse else o


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        self._kv_layout, self._use_cuda_graph = kv_layout, use_cuda_graph
        self.use_tensor_cores, self._backend = use_tensor_cores, backend
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                              ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                              ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self._bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, non_blocking=True,
             block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False):
        for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            _check_int32(name, t)
        batch_size = len(last_page_len)
        if self._use_cuda_graph:
            if batch_size != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self._bufs[1]):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._bufs[0].copy_(indptr)
            self._bufs[2].copy_(last_page_len)
            self._bufs[1][:len(indices)].copy_(indices)
            self._meta = self._bufs
        else:
            self._meta = (indptr, indices, last_page_len)
        self._batch_size, self._sm_scale, self._page_size = batch_size, sm_scale, page_size
        self._heads = (num_qo_heads, num_kv_heads, head_dim)
        self._dtypes = (q_data_type, kv_data_type or q_data_type)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=1):
        k_cache, v_cache = _kv(paged_kv_cache, self._kv_layout)
        if q.dtype != self._dtypes[0] or k_cache.dtype != self._dtypes[1]:
            raise ValueError("fake flashinfer: q/kv dtype differs from the planned one")
        if q.shape[0] != self._batch_size:
            raise ValueError("fake flashinfer: decode takes one query row per planned request")
        ip, ix, last = self._meta
        qo = torch.arange(self._batch_size + 1, dtype=torch.int32)
        o, s = _attend(q, k_cache, v_cache, qo, ip, ix, _lens(ip, last, self._page_size), causal=False,
                       sm_scale=self._sm_scale)
        if out is not None:
            if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
                raise ValueError("fake flashinfer: out has the wrong shape or dtype")
            out.copy_(o)
            o = out
        return (o, s) if return_lse else o


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    m = torch.maximum(s, s_other)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w, w_other = torch.exp(s - m), torch.exp(s_other - m)
    total = w + w_other
    v.copy_(((v.float() * w[..., None] + v_other.float() * w_other[..., None]) / total[..., None]).to(v.dtype))
    s.copy_(torch.log(total) + m)


def merge_state(v_a, s_a, v_b, s_b):
    """cascade.py: the merged ``(v, s)`` of two states (new tensors)."""
    v, s = v_a.clone(), s_a.clone()
    merge_state_in_place(v, s, v_b, s_b)
    return v, s


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                                 use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
                                 rope_scale=None, rope_theta=None, backend="auto", return_lse=False):
    """prefill.py: one request's rows ``q [qo_len, H, D_qk]`` against ``k [kv_len, Hkv, D_qk]``, ``v [kv_len, Hkv,
    D_vo]`` (NHD); the head dims of keys and values may differ."""
    if kv_layout != "NHD" or backend not in PREFILL_BACKENDS:
        raise ValueError(f"fake flashinfer: kv_layout {kv_layout}, backend {backend}")
    if q.shape[-1] != k.shape[-1] or k.shape[:2] != v.shape[:2] or q.shape[1] % k.shape[1]:
        raise ValueError("fake flashinfer: q/k/v shapes do not agree")
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, dim=1)) * scale
    if causal:
        m, n = q.shape[0], k.shape[0]
        visible = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
        logits = logits.masked_fill(~visible.to(q.device), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v.float().repeat_interleave(group, dim=1))
    out = out.to(o_dtype or q.dtype)
    return (out, torch.logsumexp(logits, dim=-1).transpose(0, 1).contiguous()) if return_lse else out


class MultiLevelCascadeAttentionWrapper:
    def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None):
        if use_cuda_graph:
            self._batch_prefill_wrappers = [
                BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, use_cuda_graph=True,
                                                    qo_indptr_buf=a, paged_kv_indptr_buf=b, paged_kv_indices_buf=c,
                                                    paged_kv_last_page_len_buf=d)
                for a, b, c, d in zip(qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr,
                                      paged_kv_last_page_len_buf_arr, strict=True)]
        else:
            self._batch_prefill_wrappers = [BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
                                            for _ in range(num_levels)]
        self._num_levels = num_levels

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None):
        for i, (wrapper, qo, ip, ix, last) in enumerate(zip(self._batch_prefill_wrappers, qo_indptr_arr,
                                                              paged_kv_indptr_arr, paged_kv_indices_arr,
                                                              paged_kv_last_page_len, strict=True)):
            wrapper.plan(qo, ip, ix, last, num_qo_heads, num_kv_heads, head_dim, page_size,
                         causal=causal if i == self._num_levels - 1 else False, sm_scale=sm_scale,
                         q_data_type=q_data_type, kv_data_type=kv_data_type)

    def run(self, q, paged_kv_cache):
        out, lse = self._batch_prefill_wrappers[-1].run(q, paged_kv_cache, return_lse=True)
        for wrapper in self._batch_prefill_wrappers[:-1]:
            out_i, lse_i = wrapper.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, out_i, lse_i)
        return out


class BatchAttention:
    def __init__(self, kv_layout="NHD", device="cuda"):
        self._kv_layout = kv_layout
        self._device = torch.device(device)
        self.float_workspace_buffer = torch.empty(0, dtype=torch.uint8)  # FlashInfer's: 384 MiB; plan() reads it

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_qo_heads, num_kv_heads, head_dim_qk,
             head_dim_vo, page_size, causal=False, sm_scale=None, logits_soft_cap=None, q_data_type=torch.bfloat16,
             kv_data_type=torch.bfloat16, use_profiler=False):
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_len_arr", kv_len_arr)):
            _check_int32(name, t)
        self._meta = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self._causal, self._sm_scale, self._dtypes = causal, sm_scale, (q_data_type, kv_data_type)

    def run(self, q, kv_cache, out=None, lse=None, k_scale=None, v_scale=None, logits_soft_cap=0.0,
            profiler_buffer=None):
        k_cache, v_cache = _kv(kv_cache, self._kv_layout)
        if q.dtype != self._dtypes[0] or k_cache.dtype != self._dtypes[1]:
            raise ValueError("fake flashinfer: q/kv dtype differs from the planned one")
        o, s = _attend(q, k_cache, v_cache, *self._meta, causal=self._causal, sm_scale=self._sm_scale)
        if out is None:
            out = torch.empty_like(q)
        out.copy_(o)
        return out, s


class BatchPODWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD"):
        self._kv_layout = kv_layout

    def plan(self, qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, qo_indptr_d, kv_indptr_d, kv_indices_d,
             last_page_len_d, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode="NONE",
             window_left=-1, q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking=True):
        self._p = (qo_indptr_p, kv_indptr_p, kv_indices_p, _lens(kv_indptr_p, last_page_len_p, page_size))
        self._d = (qo_indptr_d, kv_indptr_d, kv_indices_d, _lens(kv_indptr_d, last_page_len_d, page_size))
        if int(qo_indptr_d[-1]) != len(last_page_len_d):
            raise ValueError("fake flashinfer: POD's decode part takes one query row per request")
        self._sm_scale = sm_scale

    def run(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p=None, packed_custom_mask_p=None,
            causal_p=False, q_scale=None, k_scale=None, v_scale=None, return_lse=False, use_fp16_qk_reduction=False,
            enable_pdl=None):
        out_p, lse_p = _attend(q_p, *_kv(paged_kv_cache_p, self._kv_layout), *self._p, causal=causal_p,
                               sm_scale=self._sm_scale)
        out_d, lse_d = _attend(q_d, *_kv(paged_kv_cache_d, self._kv_layout), *self._d, causal=False,
                               sm_scale=self._sm_scale)
        return ((out_p, out_d), (lse_p, lse_d)) if return_lse else (out_p, out_d)


class BatchMLAPagedAttentionWrapper:
    """mla.py at v0.6.0 (the fa2/fa3 path): the absorbed form, keys ``[ckv | kpe]``, values ``ckv``."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        if use_cuda_graph and any(b is None for b in (qo_indptr, kv_indptr, kv_indices, kv_len_arr)):
            raise ValueError("fake flashinfer: use_cuda_graph needs qo_indptr, kv_indptr, kv_indices, kv_len_arr")
        self._use_cuda_graph = use_cuda_graph
        self._bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        lists = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        if self._use_cuda_graph:
            for buf, t in zip(self._bufs, lists):
                buf[:len(t)].copy_(t)
            lists = tuple(buf[:len(t)] for buf, t in zip(self._bufs, lists))
        self._lists, self._num_heads, self._dims = lists, num_heads, (head_dim_ckv, head_dim_kpe)
        self._page_size, self._causal, self._sm_scale = page_size, causal, sm_scale

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None, return_lse_base_on_e=False):
        if q_nope.shape[1:] != (self._num_heads, self._dims[0]) or kpe_cache.shape[-1] != self._dims[1]:
            raise ValueError("fake flashinfer: q_nope/kpe_cache do not match the plan's heads and head dims")
        keys = torch.cat([ckv_cache, kpe_cache], dim=-1)[:, :, None]
        values = torch.cat([ckv_cache, torch.zeros_like(kpe_cache)], dim=-1)[:, :, None]
        qo, ip, ix, lens = self._lists
        o, s = _attend(torch.cat([q_nope, q_pe], dim=-1), keys, values, qo, ip, ix, lens, causal=self._causal,
                       sm_scale=self._sm_scale)
        o = o[..., :self._dims[0]]
        if out is not None:
            out.copy_(o)
            o = out
        return (o, s) if return_lse else o


def module() -> types.ModuleType:
    """A fresh ``flashinfer`` module object holding the fakes (install it in ``sys.modules``)."""
    mod = types.ModuleType("flashinfer")
    mod.__version__ = "0.6.0+fake"
    for obj in (BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper,
                MultiLevelCascadeAttentionWrapper, BatchAttention, BatchPODWithPagedKVCacheWrapper,
                BatchMLAPagedAttentionWrapper, merge_state_in_place, merge_state, single_prefill_with_kv_cache):
        setattr(mod, obj.__name__, obj)
    return mod
