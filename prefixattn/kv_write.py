"""write_kv(): store a step's new K/V rows into a paged cache, one launch of
:mod:`prefixattn.kernels.kv_write_kernel`."""

from __future__ import annotations

import torch
import triton

from prefixattn.kernels.kv_write_kernel import kv_write_kernel
from prefixattn.runtime import interpreter_enabled
from prefixattn.validation import SUPPORTED_DTYPES, check_kernel_device, check_same_device, check_tensor

_SLOT_DTYPES = (torch.int32, torch.int64)
#: Elements of K (and as many of V) one program moves on a GPU: 4096 over 4 warps is 32 values per thread for each
#: of K and V, so a whole 8-head x 128 token row and a few tokens fit per program without spilling.
_TILE_ELEMS = 4096
#: Under the interpreter a program costs milliseconds whatever its size (numpy does the lanes): take big tiles so a
#: test-sized batch is one or two programs.
_INTERPRETER_TILE_ELEMS = 1 << 16


def kv_write_tiles(*, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D)`` of the write kernel for this head geometry (fixed per model: one binary)."""
    budget = _INTERPRETER_TILE_ELEMS if interpreter_enabled() else _TILE_ELEMS
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_kv_heads), budget // block_d))
    block_t = max(1, budget // (block_h * block_d))
    return block_t, block_h, block_d


def _check(key, value, k_cache, v_cache, slot_mapping) -> int:
    check_tensor("key", key, ndim=3, dtypes=SUPPORTED_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=SUPPORTED_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=SUPPORTED_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=SUPPORTED_DTYPES)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_SLOT_DTYPES)
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value: expected the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_dim] with (num_kv_heads, "
                         f"head_dim) = {tuple(key.shape[1:])} (from key), got shape {tuple(k_cache.shape)}")
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping: expected at least {num_tokens} entries (one per row of key), got "
                         f"{slot_mapping.shape[0]}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_kernel_device("key", key)
    return num_tokens


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` row ``t`` at flat slot ``slot_mapping[t]`` of the paged caches, in place.

    One kernel launch, no host synchronization, no allocation. Slot ``s`` is token ``s % block_size`` of block
    ``s // block_size``. A negative slot is padding (vLLM's ``PAD_SLOT_ID`` = -1, CUDA-graph padding rows) and is
    skipped. Slots are not checked on the host (that would read them back: a device sync); a slot at or past
    ``num_blocks * block_size`` is skipped by the kernel instead of being written outside the cache.

    Parameters
    ----------
    key, value : Tensor, ``[num_tokens, num_kv_heads, head_dim]``, fp16/bf16/fp32, any strides
    k_cache, v_cache : Tensor, ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp16/bf16/fp32, any strides
        Written in place; K/V are converted to the caches' dtype.
    slot_mapping : Tensor, ``[>= num_tokens]``, int32/int64
        Only the first ``num_tokens`` entries are read.

    Examples
    --------
    >>> prefixattn.write_kv(k_new, v_new, k_cache, v_cache, slot_mapping)   # then prefixattn.attention(...)
    """
    num_tokens = _check(key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    block_t, block_h, block_d = kv_write_tiles(num_kv_heads=num_kv_heads, head_dim=head_dim)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_kv_heads, block_h))
    kv_write_kernel[grid](
        k_cache_ptr=k_cache, v_cache_ptr=v_cache, key_ptr=key, value_ptr=value, slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens, num_slots=num_blocks * block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size,
        stride_k_t=key.stride(0), stride_k_h=key.stride(1), stride_k_d=key.stride(2),
        stride_v_t=value.stride(0), stride_v_h=value.stride(1), stride_v_d=value.stride(2),
        stride_kc_blk=k_cache.stride(0), stride_kc_tok=k_cache.stride(1), stride_kc_head=k_cache.stride(2),
        stride_kc_d=k_cache.stride(3),
        stride_vc_blk=v_cache.stride(0), stride_vc_tok=v_cache.stride(1), stride_vc_head=v_cache.stride(2),
        stride_vc_d=v_cache.stride(3),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
    )
