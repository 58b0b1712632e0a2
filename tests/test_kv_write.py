"""prefixattn.write_kv against a per-token reference: odd shapes, engine cache views, padding and stray slots."""

import pytest
import torch

import prefixattn
import prefixattn.kv_write as kvw

NUM_BLOCKS, BLOCK, HKV, D = 5, 7, 3, 80  # odd block size, head count and head size (80: BLOCK_D pads to 128)


def reference_write(key, value, k_cache, v_cache, slots) -> None:
    """One token at a time, in float64 on a copy (the kernel's conversion to the cache dtype is a plain cast)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for t, s in enumerate(slots.tolist()[: key.shape[0]]):
        if 0 <= s < num_slots:
            k_cache[s // k_cache.shape[1], s % k_cache.shape[1]] = key[t].to(k_cache.dtype)
            v_cache[s // v_cache.shape[1], s % v_cache.shape[1]] = value[t].to(v_cache.dtype)


def vllm_style_cache(dtype, g):
    """vLLM's logical [B, Hkv, N, 2D] layer cache and its [B, N, Hkv, D] K/V views (strided, not contiguous)."""
    kv = torch.randn(NUM_BLOCKS, HKV, BLOCK, 2 * D, generator=g).to(dtype)
    by_token = kv.transpose(1, 2)
    return kv, by_token[..., :D], by_token[..., D:]


def qkv_style_rows(n, dtype, g):
    """K/V as slices of a fused qkv projection (row stride > Hkv * D), as engines hand them over."""
    qkv = torch.randn(n, (4 + 2 * HKV) * D, generator=g).to(dtype)
    return qkv[:, 4 * D:(4 + HKV) * D].view(n, HKV, D), qkv[:, (4 + HKV) * D:].view(n, HKV, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_matches_reference_on_engine_views(dtype, slot_dtype):
    g = torch.Generator().manual_seed(0)
    kv, k_cache, v_cache = vllm_style_cache(dtype, g)
    key, value = qkv_style_rows(8, dtype, g)
    # -1: vLLM's padding slot; 35 = NUM_BLOCKS * BLOCK: one past the cache (skipped, never written out of bounds).
    slots = torch.tensor([0, 34, -1, 3, 7, 35, 12, 20], dtype=slot_dtype)
    expected = kv.clone()
    by_token = expected.transpose(1, 2)
    reference_write(key, value, by_token[..., :D], by_token[..., D:], slots)
    prefixattn.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(kv, expected)  # bit-exact: a copy; nothing outside the written slots changed


def test_converts_to_the_cache_dtype_and_copies_nan():
    g = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK, HKV, D, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, HKV, D, generator=g)
    value = torch.randn(3, HKV, D, generator=g)
    key[1, 2, 5] = float("nan")
    slots = torch.tensor([4, 9, 30])
    prefixattn.write_kv(key, value, k_cache, v_cache, slots)
    exp_k, exp_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference_write(key, value, exp_k, exp_v, slots)
    assert torch.equal(k_cache.isnan(), exp_k.isnan()) and k_cache.isnan().sum() == 1
    torch.testing.assert_close(k_cache, exp_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, exp_v, atol=0, rtol=0)


@pytest.mark.parametrize("budget, tiles", [
    (2 * 128, (1, 2, 128)),  # a head grid: HKV=3 in head tiles of 2 (the second one half masked), 1 token each
    (2 * 4 * 128, (2, 4, 128)),  # token tiles of 2 over 7 tokens: the last one half masked
])
def test_many_programs_and_partial_tiles(monkeypatch, budget, tiles):
    # Under the interpreter one program takes the whole batch; a tiny tile budget exercises the grid.
    monkeypatch.setattr(kvw, "_INTERPRETER_TILE_ELEMS", budget)
    assert kvw.kv_write_tiles(num_kv_heads=HKV, head_dim=D) == tiles
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, HKV, D, generator=g)
    key, value = qkv_style_rows(7, torch.float32, g)
    slots = torch.tensor([33, 1, 2, -1, 15, 16, 8, 99])  # one entry more than rows: not read
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    reference_write(key, value, exp_k, exp_v, slots)
    prefixattn.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)


def test_no_tokens_is_a_no_op():
    k_cache = torch.zeros(2, 4, 1, 64)
    prefixattn.write_kv(torch.empty(0, 1, 64), torch.empty(0, 1, 64), k_cache, k_cache.clone(),
                        torch.empty(0, dtype=torch.int64))
    assert not k_cache.any()


@pytest.mark.parametrize("change, message", [
    (dict(value=torch.zeros(3, 2, 64)), "value: expected the shape of key"),
    (dict(k_cache=torch.zeros(2, 4, 1, 32), v_cache=torch.zeros(2, 4, 1, 32)),
     r"k_cache: expected \[num_blocks, block_size, num_kv_heads, head_dim\]"),
    (dict(v_cache=torch.zeros(3, 4, 1, 64)), "v_cache: expected the shape of k_cache"),
    (dict(slot_mapping=torch.zeros(2, dtype=torch.int64)), "slot_mapping: expected at least 3 entries"),
    (dict(slot_mapping=torch.zeros(3)), "slot_mapping: expected dtype int32/int64"),
    (dict(key=torch.zeros(3, 64)), "key: expected a 3-D tensor"),
    (dict(k_cache=torch.zeros(2, 4, 1, 64, dtype=torch.int8), v_cache=torch.zeros(2, 4, 1, 64, dtype=torch.int8)),
     "k_cache: expected dtype"),
])
def test_bad_input_names_the_argument(change, message):
    args = dict(key=torch.zeros(3, 1, 64), value=torch.zeros(3, 1, 64), k_cache=torch.zeros(2, 4, 1, 64),
                v_cache=torch.zeros(2, 4, 1, 64), slot_mapping=torch.zeros(3, dtype=torch.int64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        prefixattn.write_kv(**args)


# ---------------------------------------------------------------------------------------------------------------
# fp8 caches: quantized in the kernel as vLLM's reshape_and_cache_flash does (fp8(x / scale), saturated)
# ---------------------------------------------------------------------------------------------------------------
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def reference_fp8(x, scale, fp8):
    """vLLM's convention in torch: divide in fp32, saturate to the largest finite value (CUDA's __NV_SATFINITE; NaN
    stays NaN), round to nearest even (torch's cast)."""
    big = torch.finfo(fp8).max
    return (x.float() / scale).clamp(-big, big).to(fp8)


def assert_same_fp8(got, want):
    """Bit-exact fp8 bytes, NaN positions equal (NaN payloads are the implementation's: compared as NaN)."""
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def reference_fp8_write(key, value, k_cache, v_cache, slots, k_scale, v_scale) -> None:
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    n = k_cache.shape[1]
    for t, s in enumerate(slots.tolist()[: key.shape[0]]):
        if 0 <= s < num_slots:
            k_cache[s // n, s % n] = reference_fp8(key[t], k_scale, k_cache.dtype)
            v_cache[s // n, s % n] = reference_fp8(value[t], v_scale, v_cache.dtype)


def special_values(key):
    """Out-of-range values, infinities, NaN, a signed zero and values that round to fp8 subnormals or to zero."""
    key[0, 0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 6e4, -6e4, -0.0, 1e-6, -3e-7])


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tensor_scales", [True, False])
def test_fp8_matches_the_torch_quantization_on_engine_views(fp8, dtype, tensor_scales):
    g = torch.Generator().manual_seed(3)
    kv, k_cache, v_cache = vllm_style_cache(torch.float32, g)
    kv = kv.to(fp8)  # vLLM's fp8 cache (uint8 memory viewed as fp8), K and V interleaved in the last dim
    by_token = kv.transpose(1, 2)
    k_cache, v_cache = by_token[..., :D], by_token[..., D:]
    key, value = qkv_style_rows(8, torch.float32, g)
    key, value = (key * 200).to(dtype), (value * 3).to(dtype)  # some K beyond e4m3's 448 at k_scale 0.37
    special_values(key)
    k_scale, v_scale = 0.37, 0.0135
    scales = (torch.tensor([k_scale]), torch.tensor([v_scale])) if tensor_scales else (k_scale, v_scale)
    slots = torch.tensor([0, 34, -1, 3, 7, 35, 12, 20])  # -1: padding; 35: one past the cache (both skipped)
    expected = kv.clone()
    exp_by_token = expected.transpose(1, 2)
    reference_fp8_write(key, value, exp_by_token[..., :D], exp_by_token[..., D:], slots,
                        torch.tensor(k_scale), torch.tensor(v_scale))
    prefixattn.write_kv(key, value, k_cache, v_cache, slots, k_scale=scales[0], v_scale=scales[1])
    assert_same_fp8(kv, expected)  # written rows quantized exactly; nothing else changed


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_fp8_rounding_on_every_grid_point_and_midpoint(fp8):
    # Every finite fp8 value, every midpoint between neighbours (ties: to even) and the fp32 values just above and
    # below each midpoint; plus the overflow side of the largest value. Odd head dim 40 (BLOCK_D 64, masked).
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[~grid.isnan()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mid, mid.nextafter(torch.tensor(float("inf"))), mid.nextafter(torch.tensor(-float("inf"))),
                   grid[-1:] * 1.0625, grid[-1:] * 1.125])
    d = 40
    n = -(-x.numel() // d)
    rows = torch.cat([x, torch.zeros(n * d - x.numel())]).view(n, 1, d)
    k_cache = torch.zeros(n, 1, 1, d, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    prefixattn.write_kv(rows, -rows, k_cache, v_cache, torch.arange(n), k_scale=torch.ones(()), v_scale=1.0)
    assert_same_fp8(k_cache.view(n, 1, d), reference_fp8(rows, 1.0, fp8))
    assert_same_fp8(v_cache.view(n, 1, d), reference_fp8(-rows, 1.0, fp8))


def test_fp8_write_then_attention_reads_back_the_dequantized_rows():
    # write_kv's scales are attention()'s: what attention reads is key / k_scale, upcast, times k_scale.
    g = torch.Generator().manual_seed(4)
    fp8, bs, hkv, d = torch.float8_e4m3fn, 5, 2, 40
    key, value = torch.randn(9, hkv, d, generator=g), torch.randn(9, hkv, d, generator=g)
    k_cache = torch.zeros(2, bs, hkv, d, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.5])
    prefixattn.write_kv(key, value, k_cache, v_cache, torch.arange(9), k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(1, 2 * hkv, d, generator=g)
    p = prefixattn.plan(torch.tensor([0, 1]), torch.tensor([9]), torch.tensor([[0, 1]]), block_size=bs,
                        num_qo_heads=2 * hkv, num_kv_heads=hkv, head_dim=d, q_dtype=torch.float32, device="cpu")
    out = prefixattn.attention(q, k_cache, v_cache, p, k_scale=k_scale, v_scale=v_scale)
    ref = prefixattn.reference_attention(q, k_cache.float() * k_scale, v_cache.float() * v_scale,
                                         torch.tensor([0, 1]), torch.tensor([9]), torch.tensor([[0, 1]]))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(k_scale=torch.ones(1)), r"k_scale: expected None for a float32 cache \(scales quantize fp8 caches"),
    (dict(v_scale=0.5), "v_scale: expected None for a float32 cache"),
    (dict(fp8=True, k_scale=torch.ones(2)), r"k_scale: expected a 1-element tensor \(a per-tensor scale\), got shape"),
    (dict(fp8=True, v_scale=torch.ones(1, dtype=torch.float16)), "v_scale: expected dtype float32, got float16"),
    (dict(fp8=True, k_scale=-1.0), "k_scale: expected None, a finite positive float or a 1-element fp32 tensor"),
    (dict(fp8=True, v_scale=float("nan")), "v_scale: expected None, a finite positive float"),
    (dict(fp8=True, v_cache=torch.zeros(2, 4, 1, 64)),
     r"v_cache: expected the dtype of k_cache \(float8_e4m3fn\) when either cache is fp8, got float32"),
    (dict(fp8=True, v_cache=torch.zeros(2, 4, 1, 64, dtype=torch.float8_e5m2)),
     "v_cache: expected the dtype of k_cache"),
])
def test_fp8_bad_input_names_the_argument(change, message):
    fp8 = change.pop("fp8", False)
    cache = torch.zeros(2, 4, 1, 64, dtype=torch.float8_e4m3fn if fp8 else torch.float32)
    args = dict(key=torch.zeros(3, 1, 64), value=torch.zeros(3, 1, 64), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.zeros(3, dtype=torch.int64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        prefixattn.write_kv(**args)
