"""write_kv(): store a step's new K/V rows into a paged cache, one launch of
:mod:`prefixattn.kernels.kv_write_kernel`."""

from __future__ import annotations

import torch
import triton

from prefixattn.kernels.kv_write_kernel import kv_write_kernel
from prefixattn.runtime import device_one, interpreter_enabled
from prefixattn.validation import (FP8_KV_DTYPES, KV_CACHE_DTYPES, SUPPORTED_DTYPES, check_fp8_support,
                                   check_kernel_device, check_kv_scale, check_same_device, check_tensor,
                                   torch_dtype_name)

_SLOT_DTYPES = (torch.int32, torch.int64)
#: (mantissa bits, exponent bias) of each fp8 cache dtype (OCP formats; their largest finite value is
#: ``torch.finfo(dtype).max``: 448 for e4m3fn, 57344 for e5m2).
_FP8_FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
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
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_CACHE_DTYPES)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_SLOT_DTYPES)
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value: expected the shape of key {tuple(key.shape)}, got {tuple(value.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    # One IS_FP8 switch and one FP8_MAX per launch: an fp8 cache needs its partner in the same fp8 dtype.
    if (k_cache.dtype in FP8_KV_DTYPES or v_cache.dtype in FP8_KV_DTYPES) and v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected the dtype of k_cache ({torch_dtype_name(k_cache.dtype)}) when either "
                         f"cache is fp8, got {torch_dtype_name(v_cache.dtype)}")
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_dim] with (num_kv_heads, "
                         f"head_dim) = {tuple(key.shape[1:])} (from key), got shape {tuple(k_cache.shape)}")
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping: expected at least {num_tokens} entries (one per row of key), got "
                         f"{slot_mapping.shape[0]}")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_kernel_device("key", key)
    check_fp8_support("k_cache", k_cache)
    return num_tokens


def _scale_args(k_cache: torch.Tensor, k_scale, v_scale, device) -> dict:
    """The kernel's scale pointers, float scales and fp8 constexprs. A tensor scale is read by pointer in the kernel
    (no host synchronization, CUDA-graph safe) next to a float 1.0; a float one is passed next to a 1.0 tensor."""
    is_fp8 = k_cache.dtype in FP8_KV_DTYPES
    args = {}
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and not is_fp8:
            raise ValueError(f"{name}: expected None for a {torch_dtype_name(k_cache.dtype)} cache (scales quantize "
                             f"fp8 caches: {'/'.join(torch_dtype_name(d) for d in FP8_KV_DTYPES)}), got "
                             f"{type(scale).__name__}")
        scale = check_kv_scale(name, scale, device, device_of="key")
        tensor = isinstance(scale, torch.Tensor)
        # Not fp8: the pointers are never read (IS_FP8 is off); any tensor of the launch will do.
        args[f"{name}_ptr"] = scale if tensor else (device_one(device) if is_fp8 else k_cache)
        args[name] = 1.0 if tensor else scale
    # The fp8 format as the kernel encodes it; zeros (unused) for 16/32-bit caches, one binary per cache dtype.
    mant_bits, exp_bias = _FP8_FORMATS.get(k_cache.dtype, (0, 0))
    return dict(args, IS_FP8=is_fp8, FP8_MAX=float(torch.finfo(k_cache.dtype).max) if is_fp8 else 0.0,
                FP8_MANT_BITS=mant_bits, FP8_EXP_BIAS=exp_bias)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: float | torch.Tensor | None = None,
             v_scale: float | torch.Tensor | None = None) -> None:
    """Store ``key``/``value`` row ``t`` at flat slot ``slot_mapping[t]`` of the paged caches, in place.

    One kernel launch, no host synchronization, no allocation. Slot ``s`` is token ``s % block_size`` of block
    ``s // block_size``. A negative slot is padding (vLLM's ``PAD_SLOT_ID`` = -1, CUDA-graph padding rows) and is
    skipped. Slots are not checked on the host (that would read them back: a device sync); a slot at or past
    ``num_blocks * block_size`` is skipped by the kernel instead of being written outside the cache.

    Parameters
    ----------
    key, value : Tensor, ``[num_tokens, num_kv_heads, head_dim]``, fp16/bf16/fp32, any strides
    k_cache, v_cache : Tensor, ``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides
        fp16/bf16/fp32 (K/V are converted to the caches' dtype), or fp8 ``float8_e4m3fn``/``float8_e5m2`` (both
        caches the same): quantized as vLLM's ``reshape_and_cache_flash`` does, ``fp8(x / scale)`` in fp32 with
        values beyond the dtype's largest finite value saturated to it (NaN stays NaN). Written in place.
    slot_mapping : Tensor, ``[>= num_tokens]``, int32/int64
        Only the first ``num_tokens`` entries are read.
    k_scale, v_scale : float or Tensor ``[1]`` fp32, optional
        Per-tensor quantization scales of an fp8 cache (vLLM's ``layer._k_scale``/``_v_scale``; default 1): the
        cache holds ``key / k_scale``, read back by :func:`prefixattn.attention` with the same scales. A tensor is
        read by pointer in the kernel (no host synchronization). Must be None for a 16/32-bit cache.

    Examples
    --------
    >>> prefixattn.write_kv(k_new, v_new, k_cache, v_cache, slot_mapping)   # then prefixattn.attention(...)
    """
    num_tokens = _check(key, value, k_cache, v_cache, slot_mapping)
    scales = _scale_args(k_cache, k_scale, v_scale, key.device)
    if num_tokens == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    block_t, block_h, block_d = kv_write_tiles(num_kv_heads=num_kv_heads, head_dim=head_dim)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_kv_heads, block_h))
    kv_write_kernel[grid](
        k_cache_ptr=k_cache, v_cache_ptr=v_cache, key_ptr=key, value_ptr=value, slot_mapping_ptr=slot_mapping,
        k_scale_ptr=scales["k_scale_ptr"], v_scale_ptr=scales["v_scale_ptr"],
        num_tokens=num_tokens, num_slots=num_blocks * block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, k_scale=scales["k_scale"], v_scale=scales["v_scale"],
        stride_k_t=key.stride(0), stride_k_h=key.stride(1), stride_k_d=key.stride(2),
        stride_v_t=value.stride(0), stride_v_h=value.stride(1), stride_v_d=value.stride(2),
        stride_kc_blk=k_cache.stride(0), stride_kc_tok=k_cache.stride(1), stride_kc_head=k_cache.stride(2),
        stride_kc_d=k_cache.stride(3),
        stride_vc_blk=v_cache.stride(0), stride_vc_tok=v_cache.stride(1), stride_vc_head=v_cache.stride(2),
        stride_vc_d=v_cache.stride(3),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, IS_FP8=scales["IS_FP8"], FP8_MAX=scales["FP8_MAX"],
        FP8_MANT_BITS=scales["FP8_MANT_BITS"], FP8_EXP_BIAS=scales["FP8_EXP_BIAS"],
        USE_SOFT_FP8_CAST=scales["IS_FP8"] and interpreter_enabled(),
    )
