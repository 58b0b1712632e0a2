"""The naive form's prefixes kept across steps (prefixattn.mla_naive_cache.NaivePrefixCache): the value equals the
uncached one and the absorbed-form reference, each block is up-projected once per layer while the cache holds it,
least recently used blocks make room, and stale plans, missing layers and forgotten blocks are handled."""

from __future__ import annotations

import pytest
import torch

from prefixattn import NaivePrefixCache, mla_naive_attention, plan_mla_naive
from prefixattn.mla_naive import naive_form_pays_off
from tests.test_mla_naive import BLOCK, CASE, NOPE, RANK, ROPE, VALUE, _batch, _layer, _want

HEADS, LAYERS = 2, 2
#: One block's keys and values over every layer (fp32): the budget unit.
BLOCK_BYTES = LAYERS * BLOCK * HEADS * (NOPE + ROPE + VALUE) * 4


def _cache(blocks: int, device) -> NaivePrefixCache:
    return NaivePrefixCache(num_layers=LAYERS, max_bytes=blocks * BLOCK_BYTES, num_heads=HEADS, block_size=BLOCK,
                            qk_nope_head_dim=NOPE, rope_dim=ROPE, v_head_dim=VALUE, dtype=torch.float32,
                            device=device)


def _plan(batch, device, cache=None):
    _, _, _, qo, lens, table = batch
    return plan_mla_naive(qo, lens, table, block_size=BLOCK, num_heads=HEADS, sm_scale=0.2, kv_lora_rank=RANK,
                          rope_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE, form="naive",
                          q_dtype=torch.float32, num_sms=4, device=device, cache=cache)


def _step(batch, p, layers, device):
    """Every layer's value (each its own weights) of one step, and the reference's."""
    q_nope, q_pe, kv, qo, lens, table = batch
    got, want = [], []
    for layer, (w_uk, w_uv) in enumerate(layers):
        got.append(mla_naive_attention(*(t.to(device) for t in (q_nope, q_pe, kv)), p, w_uk.to(device),
                                       w_uv.to(device), layer=layer if p.cache is not None else None).cpu())
        want.append(_want(q_nope, q_pe, kv, qo, lens, table, w_uk, w_uv, 0.2))
    return got, want


def _check(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5)


def test_a_kept_prefix_is_up_projected_once_per_layer(device):
    batch = _batch(**CASE, num_heads=HEADS)
    layers = [_layer(HEADS, 10 + i) for i in range(LAYERS)]
    cache = _cache(8, device)
    first = _plan(batch, device, cache)
    assert first.in_cache and first.stats["naive_cached_blocks"] == 0
    assert first.stats["naive_upprojected_blocks"] == 3  # blocks 1, 2 (group 1) and 5 (group 2)
    _check(*_step(batch, first, layers, device))
    again = _plan(batch, device, cache)  # the next step: the same prefixes
    assert again.stats["naive_cached_blocks"] == 3 and again.stats["naive_upprojected_blocks"] == 0
    assert again.upproject_blocks is None
    got, want = _step(batch, again, layers, device)
    _check(got, want)
    # The same value as without a cache, layer by layer.
    uncached, _ = _step(batch, _plan(batch, device), layers, device)
    for g, u in zip(got, uncached):
        torch.testing.assert_close(g, u, atol=1e-5, rtol=1e-5)


def test_prefixes_past_the_budget_are_up_projected_as_without_a_cache(device):
    batch = _batch(**CASE, num_heads=HEADS)
    cache = _cache(2, device)  # 3 prefix blocks do not fit
    p = _plan(batch, device, cache)
    assert not p.in_cache and p.stats["naive_upprojected_blocks"] == 3 and p.stats["naive_cached_blocks"] == 0
    _check(*_step(batch, p, [_layer(HEADS, 20 + i) for i in range(LAYERS)], device))


def test_the_least_recently_used_blocks_make_room(device):
    # Two steps of different groups (blocks 1-2, then 5-6), each fitting the cache alone, then the first again.
    one = _batch([1, 1], [9, 10], [[1, 2, 3], [1, 2, 4]], num_heads=HEADS)
    two = _batch([1, 1], [9, 11], [[5, 6, 7], [5, 6, 8]], num_heads=HEADS, seed=3)
    layers = [_layer(HEADS, 30 + i) for i in range(LAYERS)]
    cache = _cache(3, device)
    # Two's blocks take the free slot and block 1's (least recently used); one's block 2 stays and is found again.
    for batch, cached in ((one, 0), (two, 0), (one, 1)):
        p = _plan(batch, device, cache)
        assert p.stats["naive_cached_blocks"] == cached, p.stats
        _check(*_step(batch, p, layers, device))


def test_stale_plans_missing_layers_and_forgotten_blocks(device):
    batch = _batch(**CASE, num_heads=HEADS)
    layers = [_layer(HEADS, 40 + i) for i in range(LAYERS)]
    cache = _cache(8, device)
    stale = _plan(batch, device, cache)
    p = _plan(batch, device, cache)  # the cache's latest: the first may no longer run
    with pytest.raises(ValueError, match="plan: made with this NaivePrefixCache before its latest plan"):
        _step(batch, stale, layers, device)
    q_nope, q_pe, kv, *_ = batch
    w_uk, w_uv = layers[0]
    for layer in (None, LAYERS, -1, True):
        with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 2\)"):
            mla_naive_attention(q_nope, q_pe, kv, p, w_uk, w_uv, layer=layer)
    # Only layer 0 runs: layer 1's keys and values were never written, so the next step up-projects the blocks again.
    mla_naive_attention(q_nope.to(device), q_pe.to(device), kv.to(device), p, w_uk.to(device), w_uv.to(device),
                        layer=0)
    p = _plan(batch, device, cache)
    assert p.stats["naive_upprojected_blocks"] == 3
    _check(*_step(batch, p, layers, device))
    # The engine rewrote block 5 (freed, then reused): forgotten, it is up-projected from its new content.
    kv[5] = torch.randn(kv.shape[1:], generator=torch.Generator().manual_seed(9))
    cache.forget([5])
    p = _plan(batch, device, cache)
    assert p.stats["naive_upprojected_blocks"] == 1 and p.stats["naive_cached_blocks"] == 2
    _check(*_step(batch, p, layers, device))


def test_bad_caches_name_the_argument(device):
    with pytest.raises(ValueError, match="max_bytes: expected at least one block's keys and values"):
        _cache(0, device)
    with pytest.raises(ValueError, match="dtype: expected the queries' dtype"):
        NaivePrefixCache(num_layers=1, max_bytes=1 << 20, num_heads=HEADS, block_size=BLOCK, dtype=torch.int8)
    batch = _batch(**CASE, num_heads=HEADS)
    bf16 = NaivePrefixCache(num_layers=LAYERS, max_bytes=1 << 20, num_heads=HEADS, block_size=BLOCK,
                            qk_nope_head_dim=NOPE, rope_dim=ROPE, v_head_dim=VALUE, dtype=torch.bfloat16,
                            device=device)
    with pytest.raises(ValueError, match="cache: expected a NaivePrefixCache of the plan's"):
        _plan(batch, device, bf16)
    with pytest.raises(ValueError, match="cache: expected a NaivePrefixCache, got dict"):
        _plan(batch, device, {})
    q_nope, q_pe, kv, *_ = batch
    w_uk, w_uv = _layer(HEADS, 50)
    with pytest.raises(ValueError, match="layer: the plan keeps no cache"):
        mla_naive_attention(q_nope, q_pe, kv, _plan(batch, device), w_uk, w_uv, layer=0)


def test_a_kept_prefix_pays_from_fewer_rows():
    deepseek = dict(kv_lora_rank=512, rope_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    # Only the keys' and values' read is left to pay for: no up-projection, nothing written.
    assert not naive_form_pays_off(rows=39, num_heads=16, cached=True, **deepseek)
    assert naive_form_pays_off(rows=40, num_heads=16, cached=True, **deepseek)
