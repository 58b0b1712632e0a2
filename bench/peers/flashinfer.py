"""FlashInfer's attention configurations as peers: every one a user choosing a backend would try, each planned on the
host once and launched by ``launch(q, k_cache, v_cache)``, with ``use_cuda_graph=True`` and its fixed buffers where
FlashInfer's wrapper has that mode, so every peer can be captured and replayed like prefixattn.

Written against flashinfer-python 0.6.0, the version scripts/gpu_wheels.sh pins (its Python sources were read for
every call below: argument names, order and the cuda-graph buffers). Nothing here runs without a GPU except through
the signature-faithful fake in tests/bench_support/fake_flashinfer.py.

Peers (FlashInfer API; batches it takes; prefix groups):

- ``flashinfer-cascade2``: ``MultiLevelCascadeAttentionWrapper``, 2 levels (each group's shared whole blocks, then
  each request's rest); any batch; **oracle** groups: handed the batch's groups. Its inner wrappers take backend
  "auto" (fa3 on sm90: no KV split).
- ``flashinfer-cascade2-fa2``: the same two levels on fa2 batch prefill wrappers (KV split), merged as the wrapper
  merges them: the cascade on its fastest path; oracle groups.
- ``flashinfer-decode``: ``BatchDecodeWithPagedKVCacheWrapper`` on CUDA cores; decode batches only.
- ``flashinfer-decode-tc-fa2`` / ``-fa3``: the same with ``use_tensor_cores=True`` (FlashInfer's choice for GQA),
  backend fa2 / fa3 (fa3: sm90 only); decode batches only.
- ``flashinfer-prefill-fa2`` / ``-fa3``: ``BatchPrefillWithPagedKVCacheWrapper`` (fa3 on sm90 is what vLLM's
  FlashInfer backend runs on Hopper); any batch.
- ``flashinfer-batch-attention``: ``BatchAttention``, persistent, one launch for mixed batches; any batch.
- ``flashinfer-pod``: ``BatchPODWithPagedKVCacheWrapper``, fused prefill + decode; batches with both.
- ``flashinfer-split``: vLLM's FlashInfer backend on a mixed batch: the decode wrapper (tensor cores) on the decode
  rows, the prefill wrapper on the rest; batches with both.

None of them is handed groups except the two cascades.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (FlashInfer's "NHD"), passed as ``(k_cache, v_cache)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from peers.base import Prepared, Unavailable

#: FlashInfer's float workspace: the size its own examples allocate (128 MiB).
WORKSPACE_BYTES = 128 * 1024 * 1024
#: The float workspace of the wrappers that keep fp32 partial outputs of split KV there: batch prefill asked for up to
#: 2,348 MiB (``batch_prefill_tmp_v``, a mixed MHA shape) and ``BatchAttention`` for 1,188 MiB
#: (``holistic_partial_o``, MHA decode) on the GPU check's shapes, and failed to run with 128 MiB and its own 384
#: (bench/results/gpu/nvidia-h200-74e5177.log): 4 GiB leaves room for both and for longer shapes.
SPLIT_WORKSPACE_BYTES = 4 * 1024**3
#: The backends FlashInfer's wrappers take by name; fa3 is FlashInfer's Hopper (sm90) kernel family.
FA3_MAJOR = 9


def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as exc:
        raise Unavailable(f"FlashInfer: flashinfer not importable ({exc})") from exc
    return flashinfer


@dataclass
class PagedMeta:
    """One step's paged metadata as every peer reads it.

    ``qo_indptr [R + 1]``, ``kv_lens [R]``, ``block_table [R, W]`` (int32, on the device); ``groups``: the oracle
    prefix groups, ``[(request ids, consecutive), shared tokens)]`` or None where the batch has none to give.
    """

    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    groups: list | None = None

    @property
    def device(self) -> torch.device:
        return self.qo_indptr.device

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr.cpu().numpy().astype(np.int64))

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def meta_of(batch) -> PagedMeta:
    """A :class:`batches.shapes.Batch`'s metadata (its groups are the oracle prefix groups)."""
    s = batch.shape
    return PagedMeta(qo_indptr=batch.qo_indptr.to(torch.int32), kv_lens=batch.kv_lens.to(torch.int32),
                     block_table=batch.block_table.to(torch.int32), block_size=s.block_size,
                     num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                     dtype=batch.q.dtype, groups=batch.groups)


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32, device=device)


def paged_lists(meta: PagedMeta, requests, first_blocks=None, last_blocks=None):
    """FlashInfer's paged lists for ``requests``: request ``r``'s blocks ``first_blocks[r]`` (default 0) up to
    ``last_blocks[r]`` (default: the last block holding its KV) -> (indptr ``[n + 1]``, indices, last_page_len
    ``[n]``, KV tokens ``[n]``), int32 on the device. A range ending before the request's KV ends is whole blocks."""
    bs = meta.block_size
    table = meta.block_table.cpu().numpy()
    kv_lens = meta.kv_lens.cpu().numpy().astype(np.int64)
    indices, indptr, last, tokens = [], [0], [], []
    for i, r in enumerate(requests):
        end = -(-int(kv_lens[r]) // bs)
        lo = 0 if first_blocks is None else int(first_blocks[i])
        hi = end if last_blocks is None else int(last_blocks[i])
        indices.extend(table[r, lo:hi].tolist())
        indptr.append(len(indices))
        tail = int(kv_lens[r]) - (end - 1) * bs if hi == end else bs
        last.append(tail if hi > lo else 0)
        tokens.append((hi - lo - 1) * bs + tail if hi > lo else 0)
    dev = meta.device
    return _i32(indptr, dev), _i32(indices, dev), _i32(last, dev), _i32(tokens, dev)


def _graph_buffers(*tensors):
    """Fixed-address copies' storage for a ``use_cuda_graph=True`` wrapper: one empty buffer per metadata tensor, of
    its size (each shape gets its own wrapper, so the sizes are exact)."""
    return [torch.empty_like(t) for t in tensors]


def device_major(device: torch.device) -> int:
    """The CUDA compute capability's major number (0 off CUDA)."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0


def _need_fa3(meta: PagedMeta, backend: str) -> None:
    if backend == "fa3" and device_major(meta.device) != FA3_MAJOR:
        raise Unavailable("FlashInfer's fa3 backend runs on sm90 (Hopper) only")


def _row_split(meta: PagedMeta):
    """(decode request ids, prefill request ids, decode rows first) for a batch whose decodes (one query row) and
    prefills form two contiguous runs of requests; Unavailable otherwise."""
    is_decode = meta.q_lens == 1
    dec, pre = np.flatnonzero(is_decode), np.flatnonzero(~is_decode)
    if not len(dec) or not len(pre):
        raise Unavailable("needs both decode and prefill requests in the batch")
    if dec.max() < pre.min():
        return dec, pre, True
    if pre.max() < dec.min():
        return dec, pre, False
    raise Unavailable("needs the decode and the prefill requests each in one contiguous run")


class Peer:
    """A planned FlashInfer configuration: ``launch`` is what is timed (what an engine runs per layer), ``output``
    turns its result into ``out [num_tokens, num_qo_heads, head_dim]``."""

    oracle_groups = False
    graph_mode = True  #: the wrapper was built with use_cuda_graph=True and its buffers (where it has that mode)

    def launch(self, q, k_cache, v_cache):
        raise NotImplementedError

    def output(self, result):
        return result


def cascade_levels(meta: PagedMeta) -> list:
    """The 2-level cascade's paged lists, one ``(qo_indptr, kv_indptr, kv_indices, last_page_len)`` per level, as
    FlashInfer's cascade layout wants them: level 0 is each group's shared whole blocks (every row of the group against
    them, non-causal), level 1 each request's remaining KV (causal). One level (a plain causal batch prefill) when no
    group shares a block. Groups are the batch's own (oracle); Unavailable where the layout cannot express them."""
    if not meta.groups:
        raise Unavailable("the cascade needs the batch's prefix groups (none given)")
    bs = meta.block_size
    indptr = meta.qo_indptr.cpu().numpy()
    q_lens, kv_lens = meta.q_lens, meta.kv_lens.cpu().numpy()
    # A group sharing nothing is its requests alone; each such request's level 0 is its own whole blocks that all of
    # its rows see (the same bytes, read through the cascade's first level).
    groups = [(list(m), int(t)) for m, t in meta.groups if t] + \
        [([r], 0) for m, t in meta.groups if not t for r in m]
    groups.sort(key=lambda g: g[0][0])
    members = [m for m, _ in groups]
    if [r for m in members for r in m] != list(range(len(q_lens))):
        raise Unavailable("the cascade needs each group's requests consecutive, in request order")
    seen = [min(int(kv_lens[r]) - int(q_lens[r]) for r in m) // bs for m in members]
    shared = [t // bs if t else seen[i] for i, (_, t) in enumerate(groups)]
    # Level 0 is non-causal: every row of the group must see all of its shared blocks.
    if any(b > v for b, v in zip(shared, seen)):
        raise Unavailable("a group's query rows start inside its shared prefix")
    levels = []
    if any(t for _, t in groups):
        if not all(shared):
            raise Unavailable("a request whose rows all start in its first block (a zero-length cascade level is not "
                              "used here)")
        a, b, c, _ = paged_lists(meta, [m[0] for m in members], last_blocks=shared)
        levels.append((_i32([int(indptr[m[0]]) for m in members] + [int(indptr[-1])], meta.device), a, b, c))
    else:
        shared = [0] * len(members)
    first = np.repeat(shared, [len(m) for m in members])
    a, b, c, _ = paged_lists(meta, range(len(q_lens)), first_blocks=first)
    levels.append((meta.qo_indptr, a, b, c))
    return levels


def _prefill_wrapper(fi, meta: PagedMeta, workspace, lists, *, graph: bool, backend: str, causal: bool):
    """A planned ``BatchPrefillWithPagedKVCacheWrapper`` over paged ``lists`` (qo_indptr, kv_indptr, kv_indices,
    last_page_len), with its cuda-graph buffers when ``graph``."""
    buffers = {}
    if graph:
        q_buf, i_buf, x_buf, l_buf = _graph_buffers(*lists)
        buffers = dict(use_cuda_graph=True, qo_indptr_buf=q_buf, paged_kv_indptr_buf=i_buf, paged_kv_indices_buf=x_buf,
                       paged_kv_last_page_len_buf=l_buf)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend, **buffers)
    wrapper.plan(*lists, meta.num_qo_heads, meta.num_kv_heads, meta.head_dim, meta.block_size, causal=causal,
                 sm_scale=meta.sm_scale, q_data_type=meta.dtype, kv_data_type=meta.dtype)
    return wrapper


class Cascade(Peer):
    """The 2-level cascade of :func:`cascade_levels` (groups handed to it: oracle).

    ``backend="auto"``: FlashInfer's own ``MultiLevelCascadeAttentionWrapper``, which builds its inner prefill wrappers
    with backend "auto" (fa3 on sm90, whose plan does not split KV: 1.1-17x slower than fa2 on the H200 run's
    shapes, bench/results/gpu/nvidia-h200-74e5177.log). ``backend="fa2"``: the same levels as two
    ``BatchPrefillWithPagedKVCacheWrapper(backend="fa2")`` (KV split across CTAs) over one float workspace, merged by
    ``merge_state_in_place`` exactly as the wrapper's ``run`` merges them (last level first, then each earlier one),
    into output and LSE buffers allocated once (the wrapper allocates and zero-fills them per call)."""

    oracle_groups = True

    def __init__(self, meta: PagedMeta, *, graph: bool, backend: str = "auto"):
        fi = _import_flashinfer()
        levels = cascade_levels(meta)
        self.fi, self.wrappers, self.partials = fi, None, None
        self.notes = f"levels={len(levels)};backend={backend};oracle prefix groups"
        workspace = torch.empty(SPLIT_WORKSPACE_BYTES, dtype=torch.uint8, device=meta.device)
        if backend == "auto":
            buffers = {}
            if graph:
                qo, ip, ix, last = zip(*levels)
                buffers = dict(use_cuda_graph=True, qo_indptr_buf_arr=_graph_buffers(*qo),
                               paged_kv_indptr_buf_arr=_graph_buffers(*ip),
                               paged_kv_indices_buf_arr=_graph_buffers(*ix),
                               paged_kv_last_page_len_buf_arr=_graph_buffers(*last))
            self.wrapper = fi.MultiLevelCascadeAttentionWrapper(len(levels), workspace, "NHD", **buffers)
            self.wrapper.plan(*(list(x) for x in zip(*levels)), meta.num_qo_heads, meta.num_kv_heads, meta.head_dim,
                              meta.block_size, causal=True, sm_scale=meta.sm_scale, q_data_type=meta.dtype,
                              kv_data_type=meta.dtype)
            return
        _need_fa3(meta, backend)
        # Causal on the last level only, as the wrapper plans them.
        self.wrappers = [_prefill_wrapper(fi, meta, workspace, lists, graph=graph, backend=backend,
                                          causal=i == len(levels) - 1) for i, lists in enumerate(levels)]
        rows = int(meta.qo_indptr[-1])
        self.partials = [(torch.empty(rows, meta.num_qo_heads, meta.head_dim, dtype=meta.dtype, device=meta.device),
                          torch.empty(rows, meta.num_qo_heads, dtype=torch.float32, device=meta.device))
                         for _ in levels]

    def launch(self, q, k_cache, v_cache):
        if self.wrappers is None:
            return self.wrapper.run(q, (k_cache, v_cache))
        (out, lse), kv = self.partials[-1], (k_cache, v_cache)
        self.wrappers[-1].run(q, kv, out=out, lse=lse, return_lse=True)
        for wrapper, (out_i, lse_i) in zip(self.wrappers[:-1], self.partials[:-1]):
            wrapper.run(q, kv, out=out_i, lse=lse_i, return_lse=True)
            self.fi.merge_state_in_place(out, lse, out_i, lse_i)
        return out


class Decode(Peer):
    """``BatchDecodeWithPagedKVCacheWrapper`` (decode batches only): CUDA cores, or tensor cores (FlashInfer's
    prefill kernels run as decode; what it recommends for GQA) with backend fa2 or fa3."""

    def __init__(self, meta: PagedMeta, *, graph: bool, tensor_cores: bool, backend: str = "auto",
                 requests=None):
        fi = _import_flashinfer()
        requests = np.arange(len(meta.q_lens)) if requests is None else requests
        if (meta.q_lens[requests] != 1).any():
            raise Unavailable("the decode wrapper takes decode batches only (one query row per request)")
        _need_fa3(meta, backend)
        indptr, indices, last, _ = paged_lists(meta, requests)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=meta.device)
        buffers = {}
        if graph:
            i_buf, x_buf, l_buf = _graph_buffers(indptr, indices, last)
            buffers = dict(use_cuda_graph=True, paged_kv_indptr_buffer=i_buf, paged_kv_indices_buffer=x_buf,
                           paged_kv_last_page_len_buffer=l_buf)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores,
                                                             backend=backend, **buffers)
        self.wrapper.plan(indptr, indices, last, meta.num_qo_heads, meta.num_kv_heads, meta.head_dim,
                          meta.block_size, sm_scale=meta.sm_scale, q_data_type=meta.dtype, kv_data_type=meta.dtype)
        self.notes = f"tensor_cores={tensor_cores};backend={backend}"

    def launch(self, q, k_cache, v_cache, out=None):
        return self.wrapper.run(q, (k_cache, v_cache), out=out)


class Prefill(Peer):
    """``BatchPrefillWithPagedKVCacheWrapper`` (causal, decode rows as one-row prefills), backend fa2 or fa3."""

    def __init__(self, meta: PagedMeta, *, graph: bool, backend: str, requests=None):
        fi = _import_flashinfer()
        _need_fa3(meta, backend)
        requests = np.arange(len(meta.q_lens)) if requests is None else requests
        indptr, indices, last, _ = paged_lists(meta, requests)
        qo = meta.qo_indptr[int(requests[0]):int(requests[-1]) + 2]
        qo = qo - qo[:1]
        workspace = torch.empty(SPLIT_WORKSPACE_BYTES, dtype=torch.uint8, device=meta.device)
        self.wrapper = _prefill_wrapper(fi, meta, workspace, (qo, indptr, indices, last), graph=graph,
                                        backend=backend, causal=True)
        self.notes = f"backend={backend}"

    def launch(self, q, k_cache, v_cache, out=None):
        return self.wrapper.run(q, (k_cache, v_cache), out=out)


class BatchAttention(Peer):
    """``BatchAttention``: FlashInfer's persistent kernel, one launch for decode and prefill rows alike. It has no
    cuda-graph mode of its own; its ``run()`` reads fixed buffers planned once, so it is captured like the rest."""

    graph_mode = False

    def __init__(self, meta: PagedMeta, *, graph: bool):
        fi = _import_flashinfer()
        indptr, indices, _, tokens = paged_lists(meta, range(len(meta.q_lens)))
        self.wrapper = fi.BatchAttention("NHD", device=str(meta.device))
        # Its own 384 MiB float workspace is too small for MHA batches (SPLIT_WORKSPACE_BYTES); plan() reads this one.
        self.wrapper.float_workspace_buffer = torch.empty(SPLIT_WORKSPACE_BYTES, dtype=torch.uint8,
                                                          device=meta.device)
        self.wrapper.plan(meta.qo_indptr, indptr, indices, tokens, meta.num_qo_heads, meta.num_kv_heads,
                          meta.head_dim, meta.head_dim, meta.block_size, causal=True, sm_scale=meta.sm_scale,
                          q_data_type=meta.dtype, kv_data_type=meta.dtype)
        self.out = None
        self.notes = "persistent"

    def launch(self, q, k_cache, v_cache):
        if self.out is None or self.out.shape != q.shape:
            self.out = torch.empty_like(q)
        return self.wrapper.run(q, (k_cache, v_cache), out=self.out)

    def output(self, result):
        return result[0]


class Pod(Peer):
    """``BatchPODWithPagedKVCacheWrapper``: prefill (causal) and decode rows in one fused launch. It has no
    cuda-graph mode of its own and allocates its two outputs per run (captured like BatchAttention)."""

    graph_mode = False

    def __init__(self, meta: PagedMeta, *, graph: bool):
        fi = _import_flashinfer()
        dec, pre, self.decode_first = _row_split(meta)
        indptr = meta.qo_indptr.cpu().numpy().astype(np.int64)
        self.split = int(indptr[dec[-1] + 1] if self.decode_first else indptr[pre[-1] + 1])
        ip, xp, lp, _ = paged_lists(meta, pre)
        idd, xd, ld, _ = paged_lists(meta, dec)
        qo_p = _i32(indptr[pre[0]:pre[-1] + 2] - indptr[pre[0]], meta.device)
        qo_d = _i32(np.arange(len(dec) + 1), meta.device)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=meta.device)
        self.wrapper = fi.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
        self.wrapper.plan(qo_p, ip, xp, lp, qo_d, idd, xd, ld, num_qo_heads=meta.num_qo_heads,
                          num_kv_heads=meta.num_kv_heads, head_dim=meta.head_dim, page_size=meta.block_size,
                          q_data_type=meta.dtype, kv_data_type=meta.dtype, sm_scale=meta.sm_scale)
        self.notes = f"prefill_requests={len(pre)};decode_requests={len(dec)}"

    def launch(self, q, k_cache, v_cache):
        q_d, q_p = (q[:self.split], q[self.split:]) if self.decode_first else (q[self.split:], q[:self.split])
        return self.wrapper.run(q_p, (k_cache, v_cache), q_d, (k_cache, v_cache), causal_p=True)

    def output(self, result):
        out_p, out_d = result
        return torch.cat([out_d, out_p] if self.decode_first else [out_p, out_d])


class Split(Peer):
    """vLLM's FlashInfer backend on a mixed batch: the decode wrapper with tensor cores on the decode requests and the
    prefill wrapper on the prefill requests (backend "auto": fa3 on sm90), each writing its rows of one output."""

    def __init__(self, meta: PagedMeta, *, graph: bool):
        dec, pre, decode_first = _row_split(meta)
        indptr = meta.qo_indptr.cpu().numpy().astype(np.int64)
        self.decode = Decode(meta, graph=graph, tensor_cores=True, requests=dec)
        self.prefill = Prefill(meta, graph=graph, backend="auto", requests=pre)
        self.rows_d = slice(int(indptr[dec[0]]), int(indptr[dec[-1] + 1]))
        self.rows_p = slice(int(indptr[pre[0]]), int(indptr[pre[-1] + 1]))
        self.out = None
        self.notes = f"decode_requests={len(dec)};prefill_requests={len(pre)};decode_first={decode_first}"

    def launch(self, q, k_cache, v_cache):
        if self.out is None or self.out.shape != q.shape:
            self.out = torch.empty_like(q)
        self.decode.launch(q[self.rows_d], k_cache, v_cache, out=self.out[self.rows_d])
        self.prefill.launch(q[self.rows_p], k_cache, v_cache, out=self.out[self.rows_p])
        return self.out


#: Peer name -> constructor ``(meta, graph=...)``.
PEERS = {
    "flashinfer-cascade2": Cascade,
    "flashinfer-cascade2-fa2": lambda m, graph: Cascade(m, graph=graph, backend="fa2"),
    "flashinfer-decode": lambda m, graph: Decode(m, graph=graph, tensor_cores=False),
    "flashinfer-decode-tc-fa2": lambda m, graph: Decode(m, graph=graph, tensor_cores=True, backend="fa2"),
    "flashinfer-decode-tc-fa3": lambda m, graph: Decode(m, graph=graph, tensor_cores=True, backend="fa3"),
    "flashinfer-prefill-fa2": lambda m, graph: Prefill(m, graph=graph, backend="fa2"),
    "flashinfer-prefill-fa3": lambda m, graph: Prefill(m, graph=graph, backend="fa3"),
    "flashinfer-batch-attention": BatchAttention,
    "flashinfer-pod": Pod,
    "flashinfer-split": Split,
}
#: The peers handed the batch's prefix groups (oracle).
CASCADES = ("flashinfer-cascade2", "flashinfer-cascade2-fa2")
#: Peers whose wrapper shares nothing between requests: the candidates for "FlashInfer best, no sharing".
NO_SHARING = tuple(p for p in PEERS if p not in CASCADES)


def plan_peer(name: str, meta: PagedMeta, *, graph: bool = True) -> Peer:
    """Build and plan peer ``name`` for ``meta`` (host work, before anything is timed)."""
    if name not in PEERS:
        raise ValueError(f"name: expected one of {sorted(PEERS)}, got {name!r}")
    return PEERS[name](meta, graph=graph)


def prepare(batch, name: str, *, graph: bool = True) -> Prepared:
    """The bench's provider interface for a :class:`batches.shapes.Batch`: ``run()`` launches the peer on the batch's
    q and caches; ``output`` turns its result into ``out``."""
    peer = plan_peer(name, meta_of(batch), graph=graph)

    def run():
        return peer.launch(batch.q, batch.k_cache, batch.v_cache)

    return Prepared(run=run, notes=peer.notes, output=peer.output,
                    extra=dict(oracle_groups=float(peer.oracle_groups), graph_mode=float(peer.graph_mode)))
