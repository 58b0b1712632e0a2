"""Input checks shared by every public entry point.

Every check raises ``ValueError`` whose message names the argument, what was expected and what arrived. Messages
never print tensor contents (they can be huge and may be sensitive): only shapes, dtypes, devices and the first
offending index/value.

Checks on *metadata values* (``qo_indptr``, ``kv_lens``, ``block_table``) read those tensors on the host; they are
meant for ``plan()`` and the reference, which run on the host anyway. ``attention()`` only checks shapes, dtypes,
devices and the plan's largest block id (a host int) against the cache's ``shape[0]``, so it never synchronizes with
the device.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import numpy as np
import torch

#: Dtypes the attention kernels accept for q / k_cache / v_cache (accumulation is always fp32).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Head sizes the fused kernels run: every multiple of ``HEAD_DIM_MULTIPLE`` from ``MIN_HEAD_DIM`` to ``MAX_HEAD_DIM``.
#: Tiles are padded to the next power of two (``BLOCK_D``) and masked with ``offs_d < head_dim``. 32 is the smallest
#: size vLLM's Triton backend runs; 256 bounds the accumulator (a 128 x 256 fp32 tile) and the register budget;
#: multiples of 8 keep every row of q, K and V 16-byte aligned in fp16/bf16 (vectorized loads).
MIN_HEAD_DIM = 32
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
SUPPORTED_HEAD_DIMS = tuple(range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))
#: fp8 KV-cache dtypes (the engines' ``fp8``/``fp8_e4m3`` and ``fp8_e5m2``): dequantized on load with per-tensor
#: scales, fp32 accumulation. q stays fp16/bf16/fp32.
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: MLA's latent width (``kv_lora_rank``) and rotary key width (``rope_dim``) the MLA kernel runs, both multiples of
#: ``HEAD_DIM_MULTIPLE``: DeepSeek-V2/V3/R1 and Kimi-K2 use 512 + 64. The latent bound keeps the accumulator of a
#: 16-lane decode tile (16 x 512 fp32) within a 4-warp program's registers; the rotary lanes pad to at least 16 (the
#: smallest dot).
MLA_MAX_KV_LORA_RANK = 512
MLA_MAX_ROPE_DIM = 128
#: Dtypes a KV cache may have: the dtype of q, or fp8 (:data:`FP8_KV_DTYPES`).
KV_CACHE_DTYPES = SUPPORTED_DTYPES + FP8_KV_DTYPES
_INDEX_DTYPES = (torch.int32, torch.int64)
#: Largest query row / KV length the planner accepts: the work items the kernel reads are int32
#: (:mod:`prefixattn.kernels.layout`), so a larger value would wrap silently instead of failing.
INT32_MAX = int(np.iinfo(np.int32).max)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: a dtype as error messages and reports spell it."""
    return str(dtype).replace("torch.", "")


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(torch_dtype_name(d) for d in dtypes)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None) -> None:
    """Check that ``t`` is a tensor of rank ``ndim`` with a dtype in ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {t.dim()}-D with shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {torch_dtype_name(t.dtype)}")


CPU_DEVICE = torch.device("cpu")


def canonical_device(name: str, device) -> torch.device:
    """The device ``device`` names, spelled one way: ``cpu:0`` is ``cpu``, ``cuda`` is ``cuda:<current device>``.

    Tensors report ``cpu`` and ``cuda:N``; users write ``cpu:0``, ``cuda`` or ``torch.device("cuda")``. Comparing
    canonical devices compares what they are, not how they were spelled. Raises ``ValueError`` for a string that
    is no device, a meta device (no data to attend over) and a CUDA device on a host without one.
    """
    if device is CPU_DEVICE:  # the common case first: plan() asks every step
        return CPU_DEVICE
    if isinstance(device, torch.device):
        if device.type == "cpu":
            return CPU_DEVICE  # one object: plan() asks every step, and a new torch.device costs ~0.5 us
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"{name}: expected a device such as 'cuda', 'cuda:0' or 'cpu', got {device!r}") from None
    else:
        raise ValueError(f"{name}: expected a torch.device or a device string, got {type(device).__name__}")
    if dev.type == "cpu":
        return CPU_DEVICE
    if dev.type == "meta":
        raise ValueError(f"{name}: expected a device that holds data (cuda or cpu), got {str(dev)!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: expected an available device, got {str(dev)!r} (torch.cuda.is_available() is "
                             "False on this host)")
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: expected an available device, got {str(dev)!r} "
                             f"({torch.cuda.device_count()} CUDA devices on this host)")
    return dev


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same device, whatever their spelling (see :func:`canonical_device`)."""
    if a == b:  # the per-call fast path: a tensor's device against a plan's canonical one
        return True
    try:
        return canonical_device("device", a) == canonical_device("device", b)
    except ValueError:
        return False


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all tensors live on one device and return it."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if not same_device(t.device, first.device):
            raise ValueError(f"{name}: expected device {first.device} (the device of {first_name}), got {t.device}")
    return first.device


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """Triton kernels run on CUDA/ROCm devices, or on CPU tensors only under the interpreter."""
    from prefixattn.runtime import check_interpreter_runtime, interpreter_enabled

    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (CUDA/ROCm, or CPU under the interpreter), got a meta "
                         "tensor")
    if interpreter_enabled():
        check_interpreter_runtime()
    elif t.device.type == "cpu":
        raise ValueError(
            f"{name}: expected a CUDA/ROCm tensor, got a CPU tensor; CPU tensors run only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing prefixattn)"
        )


def check_head_dim(name: str, head_dim: int) -> None:
    if isinstance(head_dim, bool) or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}: expected a head_dim that is a multiple of {HEAD_DIM_MULTIPLE} in "
                         f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim!r}")


def check_mla_dims(kv_lora_rank, rope_dim) -> None:
    """Check the latent and rotary widths of an MLA cache against what the MLA kernel runs.

    Parameters
    ----------
    kv_lora_rank : int
        Latent width (DeepSeek-V3: 512): a multiple of 8, at most :data:`MLA_MAX_KV_LORA_RANK`.
    rope_dim : int
        Rotary key width (DeepSeek-V3: 64): a multiple of 8, at most :data:`MLA_MAX_ROPE_DIM`.

    Raises
    ------
    ValueError
        Naming the width, what was expected and what arrived.
    """
    for name, value, most in (("kv_lora_rank", kv_lora_rank, MLA_MAX_KV_LORA_RANK),
                              ("rope_dim", rope_dim, MLA_MAX_ROPE_DIM)):
        if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 < value <= most
                or value % HEAD_DIM_MULTIPLE):
            raise ValueError(f"{name}: expected a multiple of {HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {most}], "
                             f"got {value!r}")


def check_heads(num_qo_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads <= 0:
        raise ValueError(f"num_kv_heads: expected a positive head count, got {num_kv_heads}")
    if num_qo_heads <= 0 or num_qo_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_qo_heads: expected a positive multiple of num_kv_heads={num_kv_heads} (GQA/MQA), got {num_qo_heads}"
        )


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Shapes/dtypes of q and the paged caches (v_cache may have its own head size: ``v_cache.shape[3]``). Returns
    (num_qo_heads, num_kv_heads, head_dim, block_size)."""
    check_tensor("q", q, ndim=3, dtypes=SUPPORTED_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"v_cache: expected the blocks, block size and KV heads of k_cache {tuple(k_cache.shape[:3])} "
                         f"in dims 0-2, got {tuple(v_cache.shape[:3])}")
    # fp8 caches are dequantized in the kernel; any other cache dtype must be q's (an fp16 cache read as bf16, or
    # an fp32 one as fp16, would be rounded or overflow silently in the kernel's dots).
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype and t.dtype not in FP8_KV_DTYPES:
            raise ValueError(
                f"{name}: expected the dtype of q ({torch_dtype_name(q.dtype)}) or an fp8 dtype "
                f"({_dtype_names(FP8_KV_DTYPES)}), got {torch_dtype_name(t.dtype)}"
            )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected the dtype of k_cache ({_dtype_names([k_cache.dtype])}), got "
                         f"{_dtype_names([v_cache.dtype])}")
    _, num_qo_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"k_cache: expected head_dim {head_dim} (from q) in dim 3, got {kv_head_dim}")
    if block_size <= 0:
        raise ValueError(f"k_cache: expected block_size >= 1 in dim 1, got {block_size}")
    check_heads(num_qo_heads, num_kv_heads)
    return num_qo_heads, num_kv_heads, head_dim, block_size


def check_metadata(
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_blocks: int | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check ragged/paged metadata values on the host.

    Returns CPU int64 copies ``(qo_indptr, kv_lens, block_table)``. ``num_blocks``/``num_tokens``, when given, bound
    the block ids and the last ``qo_indptr`` entry.
    """
    indptr, lens, table, _ = check_host_metadata(qo_indptr, kv_lens, block_table, block_size=block_size,
                                                 num_blocks=num_blocks, num_tokens=num_tokens)
    return torch.from_numpy(indptr), torch.from_numpy(lens), torch.from_numpy(table)


def check_host_metadata(
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_blocks: int | None = None,
    num_tokens: int | None = None,
    table_as_is: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:func:`check_metadata` for the planner: numpy int64 copies and the largest block id the batch reads.

    Returns ``(qo_indptr, kv_lens, block_table, max_block_id)``; ``max_block_id`` is the largest id among the used
    entries (``block_table[r, j]`` with ``j * block_size < kv_lens[r]``), ``-1`` when no entry is used. A cache
    with more than ``max_block_id`` blocks holds every block the batch reads, whatever ``num_blocks`` said.
    ``table_as_is``: return ``block_table`` in its own dtype (int32 or int64), a view of a CPU tensor, read-only
    by contract (the planner: a 263 x 2056 table costs ~80 us per int64 copy on the 2-core host).
    """
    indptr, lens, table = host_metadata_arrays(qo_indptr, kv_lens, block_table, block_size=block_size,
                                               num_blocks=num_blocks, table_as_is=table_as_is)
    num_reqs = lens.shape[0]
    _check_ranges(indptr, lens, num_tokens)
    blocks_needed = (lens + block_size - 1) // block_size
    max_blocks = int(blocks_needed.max()) if num_reqs else 0
    if max_blocks > table.shape[1]:
        r = int(np.argmax(blocks_needed))
        raise ValueError(
            f"block_table: expected at least {max_blocks} columns (kv_lens[{r}]={lens[r]} with "
            f"block_size={block_size}), got {table.shape[1]}"
        )
    max_block_id = -1
    if num_reqs and max_blocks:
        max_block_id = _used_id_bounds(table[:, :max_blocks], blocks_needed, num_blocks)
    return indptr, lens, table, max_block_id


def host_metadata_arrays(qo_indptr, kv_lens, block_table, *, block_size, num_blocks, table_as_is: bool,
                         index_as_is: bool = False):
    """The structural half of :func:`check_host_metadata` (types, ranks, dtypes, shapes, ``block_size``,
    ``num_blocks``): ``(qo_indptr, kv_lens)`` as int64 numpy arrays and the table (its own dtype with
    ``table_as_is``); copies, except with ``table_as_is`` (the planner's read-only use: views of CPU tensors). The
    compiled planner checks the values itself and calls :func:`check_host_metadata` for the message when they are
    wrong; it takes ``index_as_is``: ``(qo_indptr, kv_lens)`` as they are when both are C-ordered and of one dtype
    (int32 or int64: vLLM's are int32, whose two int64 copies cost ~1.4 us a step), else as int64."""
    # numpy views first: a CPU index tensor passes with numpy's attribute reads (~50 ns each, torch's ~0.5 us);
    # anything else takes the checked path, which raises the message or copies a device tensor to the host.
    indptr = _cpu_index_view(qo_indptr, 1)
    lens = _cpu_index_view(kv_lens, 1)
    table = _cpu_index_view(block_table, 2)
    if indptr is None or lens is None or table is None:
        check_tensor("qo_indptr", qo_indptr, ndim=1, dtypes=_INDEX_DTYPES)
        check_tensor("kv_lens", kv_lens, ndim=1, dtypes=_INDEX_DTYPES)
        check_tensor("block_table", block_table, ndim=2, dtypes=_INDEX_DTYPES)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if num_blocks is not None and (not isinstance(num_blocks, (int, np.integer)) or isinstance(num_blocks, bool)
                                   or num_blocks < 0):
        raise ValueError(f"num_blocks: expected a non-negative int or None, got {num_blocks!r}")
    # Shapes from the numpy views when there are (a torch size read is ~10x a numpy one).
    num_reqs = (kv_lens if lens is None else lens).shape[0]
    num_indptr = (qo_indptr if indptr is None else indptr).shape[0]
    if num_indptr != num_reqs + 1:
        raise ValueError(
            f"qo_indptr: expected length num_requests + 1 = {num_reqs + 1} (num_requests from kv_lens), "
            f"got {num_indptr}"
        )
    num_rows = (block_table if table is None else table).shape[0]
    if num_rows != num_reqs:
        raise ValueError(f"block_table: expected {num_reqs} rows (one per request, from kv_lens), got {num_rows}")
    # The value checks run in numpy: plan() calls this once per engine step, and numpy's per-call overhead is a few
    # times lower than torch's on small CPU arrays (~20 us instead of ~60 us for 256 requests). The planner
    # (table_as_is) only reads them: no copy of int64 inputs there.
    indptr = _host_array("qo_indptr", qo_indptr) if indptr is None else indptr
    lens = _host_array("kv_lens", kv_lens) if lens is None else lens
    if table is None:
        table = _host_array("block_table", block_table)
    if table_as_is:  # the planner's read-only use: int64 C-order views pass as they are (astype's no-op ~0.3 us)
        if index_as_is and indptr.dtype == lens.dtype and indptr.flags.c_contiguous and lens.flags.c_contiguous:
            return indptr, lens, table
        return _int64_c(indptr), _int64_c(lens), table
    # C order: a strided view would be another compiled variant of the compiled planner
    return (indptr.astype(np.int64, order="C"), lens.astype(np.int64, order="C"), table.astype(np.int64))


_INT64 = np.dtype(np.int64)


def _int64_c(a: np.ndarray) -> np.ndarray:
    """``a`` as int64 in C order: ``a`` itself when it is already."""
    return a if a.dtype is _INT64 and a.flags.c_contiguous else a.astype(np.int64, order="C")


_NP_INDEX_DTYPES = frozenset((np.dtype(np.int32), np.dtype(np.int64)))


def _cpu_index_view(t, ndim: int) -> np.ndarray | None:
    """``t.numpy()`` when ``t`` is a CPU int32/int64 tensor of rank ``ndim`` (no grad: index dtypes have none), else
    None (the caller's checks raise or copy)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        a = t.numpy()
    except (TypeError, RuntimeError, NotImplementedError):  # a device or meta tensor
        return None
    return a if a.ndim == ndim and a.dtype in _NP_INDEX_DTYPES else None


#: Per index itemsize: the unsigned dtype of the same width and the end of the signed range (2^(bits-1)).
_UNSIGNED = {4: (np.dtype(np.uint32), 2 ** 31), 8: (np.dtype(np.uint64), 2 ** 63)}


def _used_id_bounds(table: np.ndarray, blocks_needed: np.ndarray, num_blocks: int | None) -> int:
    """Check the used entries of ``table`` (``[num_requests, max_blocks]``) and return the largest used id.

    Fast path (no mask): when every entry, used or not, is in range and the table's largest entry sits in a used
    column (engines pad rows with 0 or with ids of the same cache), that entry is the answer: three reductions.
    Otherwise unused entries are masked to 0 (always in range) and the bounds are taken again.
    """
    upper = num_blocks if num_blocks is not None else np.iinfo(np.int64).max
    # One pass: as unsigned, a negative id is above every valid one, so the unsigned maximum below
    # min(upper, 2^(bits-1)) proves every entry is in [0, upper) (same argmax as the signed one when it holds).
    unsigned_dtype, signed_end = _UNSIGNED[table.dtype.itemsize]
    unsigned = table.view(unsigned_dtype)
    flat_max = int(unsigned.argmax())
    r, j = divmod(flat_max, table.shape[1])
    if int(unsigned[r, j]) < min(upper, signed_end) and j < blocks_needed[r]:
        return int(table[r, j])
    used = np.arange(table.shape[1])[None, :] < blocks_needed[:, None]
    masked = np.where(used, table, 0)
    low, high = int(masked.min()), int(masked.max())
    if low < 0 or high >= upper:
        r, j = (int(x) for x in np.argwhere(used & ((masked < 0) | (masked >= upper)))[0])
        expected = f"[0, {num_blocks})" if num_blocks is not None else ">= 0"
        raise ValueError(f"block_table: expected block ids in {expected} for the used entries, got "
                         f"block_table[{r}, {j}]={table[r, j]}")
    return high


def _check_ranges(indptr: np.ndarray, lens: np.ndarray, num_tokens: int | None) -> None:
    """qo_indptr and kv_lens values: monotone, consistent, and inside the int32 work items."""
    num_reqs = lens.shape[0]
    if indptr[0] != 0:
        raise ValueError(f"qo_indptr: expected qo_indptr[0] == 0, got {indptr[0]}")
    q_lens = indptr[1:] - indptr[:-1]
    if num_reqs and (q_lens < 0).any():
        r = int(np.flatnonzero(q_lens < 0)[0])
        raise ValueError(
            f"qo_indptr: expected a non-decreasing sequence, got qo_indptr[{r + 1}]={indptr[r + 1]} < "
            f"qo_indptr[{r}]={indptr[r]}"
        )
    if indptr[-1] > INT32_MAX:
        raise ValueError(f"qo_indptr: expected values <= {INT32_MAX} (int32 work items), got "
                         f"qo_indptr[-1]={indptr[-1]}")
    if num_tokens is not None and indptr[-1] != num_tokens:
        raise ValueError(
            f"qo_indptr: expected qo_indptr[-1] == number of query tokens ({num_tokens}), got {indptr[-1]}"
        )
    if num_reqs and not 0 <= lens.min() <= lens.max() <= INT32_MAX:
        r = int(np.flatnonzero((lens < 0) | (lens > INT32_MAX))[0])
        expected = ">= 0" if lens[r] < 0 else f"<= {INT32_MAX} (int32 work items)"
        raise ValueError(f"kv_lens: expected values {expected}, got kv_lens[{r}]={lens[r]}")
    if num_reqs and (lens < q_lens).any():
        r = int(np.flatnonzero(lens < q_lens)[0])
        raise ValueError(
            f"kv_lens: expected kv_lens[r] >= q_len[r] (the KV includes the new query tokens), got "
            f"kv_lens[{r}]={lens[r]} < q_len[{r}]={q_lens[r]}"
        )


def _host_array(name: str, t: torch.Tensor) -> np.ndarray:
    """A host numpy view (CPU tensors) or copy (device tensors) of an index tensor, in its own dtype."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (cpu or cuda), got a meta tensor")
    if t.device.type == "cpu":
        return t.numpy()  # index dtypes never carry autograd: no detach (each torch call is ~1 us)
    return t.detach().to("cpu").numpy()


# ---------------------------------------------------------------------------------------------------------------
# Feature options: soft-capping, sliding window, sinks, KV scales. Shared by plan(), attention() and the
# reference, so the three accept and refuse exactly the same values.
# ---------------------------------------------------------------------------------------------------------------

def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_soft_cap(logits_soft_cap) -> float:
    """``logits_soft_cap``: None or 0 = off (returns 0.0), else a finite positive float ``c`` (each scaled logit
    ``s`` becomes ``c * tanh(s / c)``, FlashInfer's and vLLM's convention)."""
    if logits_soft_cap is None:
        return 0.0
    if not _is_real(logits_soft_cap) or not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap: expected None, 0 (off) or a finite positive float, got {logits_soft_cap!r}")
    return float(logits_soft_cap)


def check_window_left(window_left, causal: bool) -> int:
    """``window_left``: None or -1 = off (returns -1), else an int ``W >= 0``: the query at KV position ``p`` sees
    keys ``p - W .. p`` (FlashInfer's convention; vLLM's ``sliding_window=S`` is ``W = S - 1``). Causal only."""
    if window_left is None or (_is_real(window_left) and window_left == -1):
        return -1
    if not isinstance(window_left, (int, np.integer)) or isinstance(window_left, bool) or window_left < 0:
        raise ValueError(f"window_left: expected None, -1 (off) or an int >= 0, got {window_left!r}")
    if window_left > INT32_MAX:
        raise ValueError(f"window_left: expected a value <= {INT32_MAX} (int32 kernel argument), got {window_left}")
    if not causal:
        raise ValueError(f"window_left: expected -1 (off) with causal=False (sliding windows are causal), got "
                         f"{window_left}")
    return int(window_left)


#: Dtypes of attention-sink logits (models keep them in their own dtype; the kernel upcasts them to fp32).
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sinks(sinks, num_qo_heads: int, device) -> None:
    """``sinks``: None, or one logit per query head ``[num_qo_heads]`` (fp32/bf16/fp16) on the device of q."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, ndim=1, dtypes=SINK_DTYPES)
    if sinks.shape[0] != num_qo_heads:
        raise ValueError(f"sinks: expected shape ({num_qo_heads},) (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if sinks.stride(0) != 1 and num_qo_heads > 1:
        raise ValueError(f"sinks: expected a contiguous tensor, got stride {sinks.stride(0)}")
    if not same_device(sinks.device, device):
        raise ValueError(f"sinks: expected device {device} (the device of q), got {sinks.device}")


def check_kv_dtype(kv_dtype, q_dtype: torch.dtype) -> torch.dtype:
    """``kv_dtype`` of :func:`prefixattn.plan`: None (the dtype of q) or what :func:`prefixattn.attention` reads, q's
    dtype or fp8 (:data:`FP8_KV_DTYPES`). Returns the dtype."""
    if kv_dtype is None:
        return q_dtype
    if not isinstance(kv_dtype, torch.dtype) or (kv_dtype != q_dtype and kv_dtype not in FP8_KV_DTYPES):
        raise ValueError(f"kv_dtype: expected None, the q_dtype ({_dtype_names([q_dtype])}) or an fp8 dtype "
                         f"({_dtype_names(FP8_KV_DTYPES)}), got {kv_dtype!r}")
    return kv_dtype


#: Triton compiles fp8 e4m3 (``float8_e4m3fn``) loads and stores for NVIDIA GPUs from compute capability 8.9 on.
FP8_E4M3_MIN_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def check_fp8_support(name: str, cache: torch.Tensor) -> None:
    """An e4m3 cache on an NVIDIA GPU older than sm_89 is refused (Triton cannot compile its loads or stores there)."""
    if cache.dtype != torch.float8_e4m3fn or cache.device.type != "cuda" or torch.version.hip is not None:
        return
    cap = _capability(cache.device.index if cache.device.index is not None else torch.cuda.current_device())
    if cap < FP8_E4M3_MIN_CAPABILITY:
        raise ValueError(f"{name}: expected float8_e5m2 on this GPU (compute capability {cap[0]}.{cap[1]}; Triton "
                         f"compiles float8_e4m3fn loads and stores from 8.9 on), got float8_e4m3fn")


def check_kv_scale(name: str, scale, device, *, device_of: str = "q"):
    """A per-tensor KV (de)quantization scale: None (1.0), a finite positive float, or a 1-element fp32 tensor on
    ``device`` (the device of ``device_of``; read by pointer in the kernel: CUDA-graph safe, never synchronized).
    Returns a float or the tensor."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        check_tensor(name, scale, dtypes=(torch.float32,))
        if scale.numel() != 1:
            raise ValueError(f"{name}: expected a 1-element tensor (a per-tensor scale), got shape {tuple(scale.shape)}")
        if not same_device(scale.device, device):
            raise ValueError(f"{name}: expected device {device} (the device of {device_of}), got {scale.device}")
        return scale
    if not _is_real(scale) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}: expected None, a finite positive float or a 1-element fp32 tensor, got {scale!r}")
    return float(scale)
