"""Store new K/V rows into a paged cache at flat slots, in one launch (the engines' ``reshape_and_cache``).

One program = a tile of ``BLOCK_T`` tokens x ``BLOCK_H`` KV heads x ``BLOCK_D`` dims. Slot ``s`` is position
``s % block_size`` of block ``s // block_size``; a negative slot is padding (vLLM's ``PAD_SLOT_ID`` is -1) and a slot
at or past ``num_slots`` would lie outside the cache: neither is written. K and V are converted to the cache's dtype
in the store; nothing else is computed, so NaN rows are copied as they are.

* ``IS_FP8``: the cache is fp8 with per-tensor scales (vLLM's convention: stored = fp8(x / scale)). K/V are upcast
  to fp32, divided by ``k_scale * *k_scale_ptr`` (``v_scale * *v_scale_ptr``) with IEEE rounding, saturated to
  ``+-FP8_MAX`` (vLLM's CUDA write converts with ``__NV_SATFINITE``: out-of-range values and infinities become the
  largest finite value, NaN stays NaN) and rounded to nearest even by Triton's float-to-fp8 cast on a GPU
  (``cvt.rn.satfinite`` on sm_89+: one instruction per two values).
* ``USE_SOFT_FP8_CAST`` (set under the interpreter only): the fp8 bytes are computed with integer ops
  (:func:`_fp8_bits`, ~25 ALU ops per value) instead, because the Triton interpreter's cast (3.9) rounds half up
  without carrying into the exponent (e.g. e5m2 500.0 -> 256.0, not 512.0) and turns NaN into 384.0 for e4m3, so
  the engines' CPU runs would store wrong values. GPUs do not pay for it: at ~25 integer ops per value a prefill
  chunk's write would be ALU-bound on H100 (~64 int32 ops/clk/SM against 1 fp8 byte stored).
"""

import triton
import triton.language as tl

#: IEEE fp32 layout: 23 mantissa bits, exponent bias 127, 8 exponent bits (mask 0xFF).
_FP32_MANT_BITS = tl.constexpr(23)
_FP32_EXP_BIAS = tl.constexpr(127)
_FP32_EXP_MASK = tl.constexpr(0xFF)
#: 1.5 * 2^23: adding (and subtracting) it times a power of two s rounds |x| < 2^22 s to a multiple of s, in fp32's
#: own round-to-nearest-even (the sum's ulp is s).
_ROUNDING_MAGIC = tl.constexpr(12582912.0)
#: S.1111.111: a NaN in e4m3fn (its only NaN) and in e5m2.
_FP8_NAN = tl.constexpr(0x7F)


@triton.jit
def _fp8_bits(x, scale, FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr, FP8_EXP_BIAS: tl.constexpr):
    """The fp8 byte (uint8) of ``x / scale``: IEEE division in fp32 (CUDA's ``/`` in vLLM's op; Triton's ``/`` is
    approximate on NVIDIA), saturated to ``FP8_MAX``, rounded to nearest even; NaN -> ``0x7F`` with x's sign."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1  # fp32 bit 31
    a = tl.abs(y)
    is_nan = a != a
    # Saturate (inf too); NaN lanes round a 0 (no overflow, no NaN-to-int cast) and are encoded at the end.
    a = tl.where(is_nan, 0.0, tl.where(a > FP8_MAX, FP8_MAX, a))
    # Round a to the fp8 grid: its spacing is 2^(e - M) in binade e, at least the subnormal spacing 2^(1 - B - M);
    # FP8_MAX is on the grid, so the result stays <= FP8_MAX.
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> _FP32_MANT_BITS) & _FP32_EXP_MASK) - _FP32_EXP_BIAS,
                   1 - FP8_EXP_BIAS)
    spacing = ((e - FP8_MANT_BITS + _FP32_EXP_BIAS) << _FP32_MANT_BITS).to(tl.float32, bitcast=True)
    magic = spacing * _ROUNDING_MAGIC
    r = (a + magic) - magic
    # Encode r (exactly representable): normal numbers from its fp32 exponent and top mantissa bits, subnormals
    # (and zero) as the integer r / 2^(1 - B - M).
    rb = r.to(tl.int32, bitcast=True)
    r_exp = (rb >> _FP32_MANT_BITS) - _FP32_EXP_BIAS
    mantissa = (rb >> (_FP32_MANT_BITS - FP8_MANT_BITS)) & ((1 << FP8_MANT_BITS) - 1)
    normal = ((r_exp + FP8_EXP_BIAS) << FP8_MANT_BITS) | mantissa
    is_normal = r_exp >= 1 - FP8_EXP_BIAS
    unit_bits = (FP8_EXP_BIAS + FP8_MANT_BITS - 1 + _FP32_EXP_BIAS) << _FP32_MANT_BITS  # 2^(B + M - 1)
    unit = tl.full((1,), unit_bits, tl.int32).to(tl.float32, bitcast=True)
    subnormal = (tl.where(is_normal, 0.0, r) * unit).to(tl.int32)  # normal lanes zeroed: no int32 overflow
    code = tl.where(is_normal, normal, subnormal)
    code = tl.where(is_nan, _FP8_NAN, code)
    return (code | (sign << 7)).to(tl.uint8)  # bit 7: the sign


@triton.jit
def _quantize_fp8(x, scale, cache_ptr, FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr,
                  FP8_EXP_BIAS: tl.constexpr, USE_SOFT_FP8_CAST: tl.constexpr):
    """``x / scale`` in ``cache_ptr``'s fp8 dtype: IEEE division in fp32, saturated to ``FP8_MAX`` (NaN stays NaN),
    rounded to nearest even; by the hardware cast, or by :func:`_fp8_bits` under the interpreter."""
    if USE_SOFT_FP8_CAST:
        q = _fp8_bits(x=x, scale=scale, FP8_MAX=FP8_MAX, FP8_MANT_BITS=FP8_MANT_BITS,
                      FP8_EXP_BIAS=FP8_EXP_BIAS).to(cache_ptr.dtype.element_ty, bitcast=True)
    else:
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        q = y.to(cache_ptr.dtype.element_ty)
    return q


# num_tokens changes every engine step: specialized, 1 / multiples of 16 / the rest would be three binaries.
@triton.jit(do_not_specialize=["num_tokens"])
def kv_write_kernel(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    slot_mapping_ptr,  # [num_tokens] int32/int64: block * block_size + offset; < 0 = padding, not written
    k_scale_ptr,  # [1] fp32 K quantization scale (read only when IS_FP8)
    v_scale_ptr,  # [1] fp32 V quantization scale (read only when IS_FP8)
    num_tokens, num_slots, num_kv_heads, head_dim, block_size,
    k_scale, v_scale,  # float scales, times *k_scale_ptr / *v_scale_ptr (used only when IS_FP8)
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_kc_blk, stride_kc_tok, stride_kc_head, stride_kc_d,
    stride_vc_blk, stride_vc_tok, stride_vc_head, stride_vc_d,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr, FP8_EXP_BIAS: tl.constexpr,
    USE_SOFT_FP8_CAST: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    in_batch = offs_t < num_tokens
    # 64-bit: block id x block stride passes 2^31 elements on large caches (as in the attention kernel).
    slot = tl.load(slot_mapping_ptr + offs_t, mask=in_batch, other=-1).to(tl.int64)
    valid = in_batch & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    tok = slot % block_size
    hd = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    mask = valid[:, None, None] & hd[None, :, :]  # [BLOCK_T, BLOCK_H, BLOCK_D]
    t64 = offs_t.to(tl.int64)[:, None, None]
    h3 = offs_h[None, :, None]
    d3 = offs_d[None, None, :]
    k = tl.load(key_ptr + t64 * stride_k_t + h3 * stride_k_h + d3 * stride_k_d, mask=mask)
    v = tl.load(value_ptr + t64 * stride_v_t + h3 * stride_v_h + d3 * stride_v_d, mask=mask)
    if IS_FP8:
        k = _quantize_fp8(x=k, scale=k_scale * tl.load(k_scale_ptr), cache_ptr=k_cache_ptr, FP8_MAX=FP8_MAX,
                          FP8_MANT_BITS=FP8_MANT_BITS, FP8_EXP_BIAS=FP8_EXP_BIAS, USE_SOFT_FP8_CAST=USE_SOFT_FP8_CAST)
        v = _quantize_fp8(x=v, scale=v_scale * tl.load(v_scale_ptr), cache_ptr=v_cache_ptr, FP8_MAX=FP8_MAX,
                          FP8_MANT_BITS=FP8_MANT_BITS, FP8_EXP_BIAS=FP8_EXP_BIAS, USE_SOFT_FP8_CAST=USE_SOFT_FP8_CAST)
    blk3 = blk[:, None, None]
    tok3 = tok[:, None, None]
    tl.store(k_cache_ptr + blk3 * stride_kc_blk + tok3 * stride_kc_tok + h3 * stride_kc_head + d3 * stride_kc_d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk3 * stride_vc_blk + tok3 * stride_vc_tok + h3 * stride_vc_head + d3 * stride_vc_d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
