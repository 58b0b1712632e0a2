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
