"""MLA with the shared prefixes in the naive form (prefixattn.mla_naive): the groups and forms a plan picks, and the
layer's value against the absorbed-form reference times W_UV (interpreter on CPU: small widths)."""

from __future__ import annotations

import pytest
import torch

from prefixattn import mla_naive_attention, plan_mla_naive, reference_mla_attention
from prefixattn.kernels import layout as K
from prefixattn.mla_naive import naive_form_pays_off

#: Small widths for the interpreter: latent, rotary key, no-rope query/key and value per head.
RANK, ROPE, NOPE, VALUE = 32, 16, 24, 40
BLOCK = 4


def _layer(num_heads: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w_uk = torch.randn(num_heads, NOPE, RANK, generator=g) / RANK ** 0.5
    w_uv = torch.randn(num_heads, RANK, VALUE, generator=g) / RANK ** 0.5
    return w_uk.to(dtype), w_uv.to(dtype)


def _batch(q_lens, kv_lens, tables, num_heads, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 100)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    n = int(qo[-1])
    q_nope = torch.randn(n, num_heads, NOPE, generator=g).to(dtype)
    q_pe = torch.randn(n, num_heads, ROPE, generator=g).to(dtype)
    cache = torch.randn(int(table.max()) + 2, BLOCK, RANK + ROPE, generator=g).to(dtype)
    return q_nope, q_pe, cache, qo, torch.tensor(kv_lens, dtype=torch.int32), table


def _want(q_nope, q_pe, cache, qo, lens, table, w_uk, w_uv, sm_scale):
    """The absorbed-form reference (fp64 arithmetic) of the absorbed query (rounded to fp32: the reference's widest
    input), its latent output times W_UV."""
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope.double(), w_uk.double()), q_pe.double()], dim=-1)
    latent = reference_mla_attention(q_abs.float(), cache.float(), qo, lens, table, kv_lora_rank=RANK,
                                     sm_scale=sm_scale, compute_dtype=torch.float64)
    return torch.einsum("thr,hrv->thv", latent, w_uv.double())


#: Two groups (blocks 1-2 and 5) of decodes and short chunks, a chunk longer than its group's prefix, and a request
#: of its own.
CASE = dict(q_lens=[1, 1, 3, 1, 9, 1, 2, 1],
            kv_lens=[13, 10, 16, 11, 17, 7, 9, 6],
            tables=[[1, 2, 3, 4], [1, 2, 6], [1, 2, 7, 8], [1, 2, 9], [1, 2, 10, 11, 12], [5, 13], [5, 14, 15],
                    [16, 17]])


@pytest.mark.parametrize("num_heads", [4, 2])
def test_naive_prefixes_give_the_absorbed_value(device, num_heads):
    q_nope, q_pe, cache, qo, lens, table = _batch(**CASE, num_heads=num_heads)
    w_uk, w_uv = _layer(num_heads, 1)
    p = plan_mla_naive(qo, lens, table, block_size=BLOCK, num_heads=num_heads, sm_scale=0.2, kv_lora_rank=RANK,
                       rope_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE, form="naive", q_dtype=torch.float32,
                       num_sms=4, device=device)
    # Group 1: its prefix is the 2 blocks every member shares before its first query (request 4's 9 rows pass its
    # 8 tokens: absorbed). Group 2: 1 block. Request 7 shares nothing.
    assert p.stats == dict(mla_form="naive", naive_requests=6, declined_groups=0, naive_groups=2,
                           naive_prefix_tokens=3 * BLOCK)
    assert p.prefix_blocks.tolist() == [1, 2, 5] and p.naive.num_requests == 6
    assert p.naive.has_shared and K.CLASS_SHARED in p.naive.work_classes
    assert p.naive_rows.tolist() == [0, 1, 2, 3, 4, 5, 15, 16, 17]
    got = mla_naive_attention(*(t.to(device) for t in (q_nope, q_pe, cache)), p, w_uk.to(device), w_uv.to(device))
    want = _want(q_nope, q_pe, cache, qo, lens, table, w_uk, w_uv, 0.2)
    assert got.shape == (int(qo[-1]), num_heads, VALUE)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=2e-5)


def test_every_request_in_one_group_and_bf16(device):
    q_nope, q_pe, cache, qo, lens, table = _batch([1, 1, 1], [9, 11, 12], [[3, 4, 0], [3, 4, 1], [3, 4, 2]],
                                                  num_heads=2, dtype=torch.bfloat16)
    w_uk, w_uv = _layer(2, 2, torch.bfloat16)
    p = plan_mla_naive(qo, lens, table, block_size=BLOCK, num_heads=2, sm_scale=0.3, kv_lora_rank=RANK,
                       rope_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE, form="naive", q_dtype=torch.bfloat16,
                       device=device)
    assert p.naive_rows is None and p.stats["naive_requests"] == 3
    got = mla_naive_attention(*(t.to(device) for t in (q_nope, q_pe, cache)), p, w_uk.to(device), w_uv.to(device))
    want = _want(q_nope, q_pe, cache, qo, lens, table, w_uk, w_uv, 0.3)
    # bf16: the queries, the up-projected keys and values and both partial outputs are rounded to bf16 (8 bits of
    # mantissa) before the merge, where the reference keeps fp64 throughout.
    torch.testing.assert_close(got.double().cpu(), want, atol=3e-2, rtol=3e-2)


def test_an_fp8_latent_is_dequantized_before_the_up_projection(device):
    q_nope, q_pe, cache, qo, lens, table = _batch(**CASE, num_heads=2, seed=5)
    cache8 = (cache * 4).to(torch.float8_e5m2)
    scale = torch.tensor([0.25])
    w_uk, w_uv = _layer(2, 5)
    p = plan_mla_naive(qo, lens, table, block_size=BLOCK, num_heads=2, sm_scale=0.2, kv_lora_rank=RANK,
                       rope_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE, form="naive", q_dtype=torch.float32,
                       kv_dtype=torch.float8_e5m2, device=device)
    assert p.naive is not None
    got = mla_naive_attention(q_nope.to(device), q_pe.to(device), cache8.to(device), p, w_uk.to(device),
                              w_uv.to(device), kv_scale=scale.to(device))
    want = _want(q_nope, q_pe, cache8.float() * scale, qo, lens, table, w_uk, w_uv, 0.2)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=2e-5)


def test_auto_takes_the_naive_form_where_the_rule_says_it_pays(device):
    q_nope, q_pe, cache, qo, lens, table = _batch(**CASE, num_heads=2)
    common = dict(block_size=BLOCK, num_heads=2, sm_scale=0.2, kv_lora_rank=RANK, rope_dim=ROPE,
                  qk_nope_head_dim=NOPE, v_head_dim=VALUE, q_dtype=torch.float32, device=device)
    # A handful of rows over a short prefix: the up-projection costs more than the naive form saves (modeled).
    p = plan_mla_naive(qo, lens, table, form="auto", **common)
    assert p.naive is None and p.stats["mla_form"] == "absorbed" and p.stats["declined_groups"] == 2
    absorbed = plan_mla_naive(qo, lens, table, form="absorbed", **common)
    assert absorbed.naive is None and absorbed.stats["declined_groups"] == 0
    w_uk, w_uv = _layer(2, 3)
    got = mla_naive_attention(q_nope.to(device), q_pe.to(device), cache.to(device), p, w_uk.to(device),
                              w_uv.to(device))
    torch.testing.assert_close(got.double().cpu(), _want(q_nope, q_pe, cache, qo, lens, table, w_uk, w_uv, 0.2),
                               atol=2e-5, rtol=2e-5)


def test_the_rule_pays_from_about_190_rows_at_deepseek_widths():
    deepseek = dict(kv_lora_rank=512, rope_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    for heads in (16, 128):  # every term is per head: the break-even is the same
        assert not naive_form_pays_off(rows=189, num_heads=heads, **deepseek)
        assert naive_form_pays_off(rows=190, num_heads=heads, **deepseek)
    # fp32 queries: 4-byte up-projected keys and values through HBM.
    assert not naive_form_pays_off(rows=269, num_heads=16, elt_bytes=4, **deepseek)
    assert naive_form_pays_off(rows=270, num_heads=16, elt_bytes=4, **deepseek)


def test_bad_input_names_the_argument():
    q_nope, q_pe, cache, qo, lens, table = _batch(**CASE, num_heads=2)
    common = dict(block_size=BLOCK, num_heads=2, sm_scale=0.2, kv_lora_rank=RANK, rope_dim=ROPE,
                  q_dtype=torch.float32)
    with pytest.raises(ValueError, match="form: expected one of"):
        plan_mla_naive(qo, lens, table, form="fast", qk_nope_head_dim=NOPE, v_head_dim=VALUE, **common)
    with pytest.raises(ValueError, match="num_heads: expected a positive int, got '2'"):
        plan_mla_naive(qo, lens, table, qk_nope_head_dim=NOPE, v_head_dim=VALUE, **{**common, "num_heads": "2"})
    with pytest.raises(ValueError, match=r"qk_nope_head_dim \+ rope_dim: expected a head_dim"):
        plan_mla_naive(qo, lens, table, qk_nope_head_dim=20, v_head_dim=VALUE, **common)
    p = plan_mla_naive(qo, lens, table, form="naive", qk_nope_head_dim=NOPE, v_head_dim=VALUE, **common)
    w_uk, w_uv = _layer(2, 4)
    with pytest.raises(ValueError, match=r"w_uv: expected shape \(2, 32, 40\)"):
        mla_naive_attention(q_nope, q_pe, cache, p, w_uk, w_uv[:, :, :8])
    with pytest.raises(ValueError, match=r"q_nope: expected shape \[\*, 2, 24\]"):
        mla_naive_attention(q_pe, q_pe, cache, p, w_uk, w_uv)
    with pytest.raises(ValueError, match="plan: expected a NaiveMLAPlan"):
        mla_naive_attention(q_nope, q_pe, cache, p.absorbed, w_uk, w_uv)
