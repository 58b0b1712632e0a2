"""reference_attention against a naive dense softmax built straight from the definition."""

import math

import pytest
import torch

from prefixattn import reference_attention


def _naive(q, k_cache, v_cache, qo_indptr, kv_lens, block_table, causal, sm_scale, *, soft_cap=0.0, window=-1,
           sinks=None, k_scale=1.0, v_scale=1.0):
    """Per (request, head, query row) loop, dense logits, float64: as literal as possible. ``window``: the query at
    position p sees keys p - window .. p; ``sinks[h]``: one more logit in the denominator (and in the LSE)."""
    num_tokens, num_qo_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_qo_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((num_tokens, num_qo_heads), -math.inf, dtype=torch.float64)
    for r in range(len(kv_lens)):
        q_start, q_end, kv_len = int(qo_indptr[r]), int(qo_indptr[r + 1]), int(kv_lens[r])
        q_len = q_end - q_start
        keys = torch.stack([k_cache[block_table[r, p // block_size], p % block_size] for p in range(kv_len)]) \
            if kv_len else torch.zeros(0, num_kv_heads, head_dim)
        vals = torch.stack([v_cache[block_table[r, p // block_size], p % block_size] for p in range(kv_len)]) \
            if kv_len else torch.zeros(0, num_kv_heads, head_dim)
        for i in range(q_len):
            visible = kv_len - q_len + i + 1 if causal else kv_len
            first = max(0, visible - 1 - window) if window >= 0 else 0
            for h in range(num_qo_heads):
                if sinks is not None:
                    lse[q_start + i, h] = float(sinks[h])
                if visible == 0:
                    continue
                kk = keys[first:visible, h // group].double() * k_scale
                vv = vals[first:visible, h // group].double() * v_scale
                logits = kk @ q[q_start + i, h].double() * sm_scale
                if soft_cap:
                    logits = soft_cap * torch.tanh(logits / soft_cap)
                if sinks is not None:
                    logits = torch.cat([logits, torch.tensor([float(sinks[h])], dtype=torch.float64)])
                    vv = torch.cat([vv, torch.zeros(1, vv.shape[1], dtype=torch.float64)])
                lse[q_start + i, h] = torch.logsumexp(logits, 0)
                out[q_start + i, h] = torch.softmax(logits, 0) @ vv
    return out, lse


def _random_batch(seed, *, q_lens, kv_lens, block_size, num_qo_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in kv_lens))
    num_blocks = len(kv_lens) * max_blocks + 3
    # Shuffled physical blocks so the table really is an indirection.
    block_table = torch.randperm(num_blocks, generator=g)[: len(kv_lens) * max_blocks].view(len(kv_lens), max_blocks)
    q = torch.randn(sum(q_lens), num_qo_heads, head_dim, generator=g)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    qo_indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return q, k_cache, v_cache, qo_indptr, torch.tensor(kv_lens, dtype=torch.int32), block_table.to(torch.int32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_naive(causal, group, block_size, head_dim):
    num_kv_heads = 2 if group < 8 else 1
    # Request 2 has no KV and no queries, request 3 is a pure prefill (kv_len == q_len), request 4 decodes.
    q_lens, kv_lens = [3, 1, 0, 5, 1], [7, 20, 0, 5, 33]
    batch = _random_batch(0, q_lens=q_lens, kv_lens=kv_lens, block_size=block_size,
                          num_qo_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim)
    scale = 1 / math.sqrt(head_dim)
    out, lse = reference_attention(*batch, causal=causal, return_lse=True)
    want_out, want_lse = _naive(*batch, causal, scale)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_reference_empty_requests_between_others():
    # Requests with kv_len 0 own no rows (kv_len >= q_len), so under the conventions every query row sees at least
    # itself; the empty requests must simply not disturb their neighbours.
    batch = _random_batch(1, q_lens=[0, 2, 0, 0, 1], kv_lens=[0, 6, 0, 0, 1], block_size=4,
                          num_qo_heads=2, num_kv_heads=2, head_dim=64)
    out, lse = reference_attention(*batch, return_lse=True)
    want_out, want_lse = _naive(*batch, True, 1 / 8)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_reference_custom_scale_and_strided_cache():
    q, k, v, indptr, lens, table = _random_batch(2, q_lens=[2, 3], kv_lens=[9, 3], block_size=4,
                                                 num_qo_heads=4, num_kv_heads=2, head_dim=64)
    # A cache whose heads are not contiguous (e.g. a [num_blocks, 2, block_size, heads, d] K/V pair view).
    kv = torch.stack([k, v], dim=1)
    out = reference_attention(q, kv[:, 0], kv[:, 1], indptr, lens, table, sm_scale=0.3)
    want, _ = _naive(q, k, v, indptr, lens, table, True, 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_reference_lse_shape_and_empty_request():
    q, k, v, indptr, lens, table = _random_batch(3, q_lens=[0, 2], kv_lens=[0, 2], block_size=16,
                                                 num_qo_heads=2, num_kv_heads=1, head_dim=64)
    out, lse = reference_attention(q, k, v, indptr, lens, table, return_lse=True)
    assert out.shape == (2, 2, 64) and lse.shape == (2, 2) and lse.dtype == torch.float32


@pytest.mark.parametrize("causal", [True, False])
def test_reference_float64_matches_naive_to_fp64_rounding(causal):
    # compute_dtype=float64: the GPU check's ground truth (scripts/gpu_check.sh); same math, fp64 arithmetic.
    batch = _random_batch(3, q_lens=[3, 1, 0, 5, 1], kv_lens=[7, 20, 0, 5, 33], block_size=16, num_qo_heads=8,
                          num_kv_heads=2, head_dim=64)
    out, lse = reference_attention(*batch, causal=causal, return_lse=True, compute_dtype=torch.float64)
    want_out, want_lse = _naive(*batch, causal, 1 / math.sqrt(64))
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)


def test_reference_rejects_other_compute_dtypes():
    batch = _random_batch(4, q_lens=[1], kv_lens=[3], block_size=16, num_qo_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="compute_dtype: expected torch.float32 or torch.float64, got torch.float16"):
        reference_attention(*batch, compute_dtype=torch.float16)


@pytest.mark.parametrize("window", [-1, 0, 3, 50])
@pytest.mark.parametrize("soft_cap", [0.0, 0.7])
def test_reference_window_soft_cap_sinks_match_naive(window, soft_cap):
    # q is scaled up so the soft cap (0.7) really bends the logits; sinks include a very large and a -inf one.
    q, k, v, indptr, lens, table = _random_batch(5, q_lens=[3, 1, 0, 6, 1], kv_lens=[7, 20, 0, 6, 33], block_size=4,
                                                 num_qo_heads=4, num_kv_heads=2, head_dim=64)
    q = q * 4
    sinks = torch.tensor([0.3, -2.0, 8.0, -math.inf])
    out, lse = reference_attention(q, k, v, indptr, lens, table, return_lse=True, logits_soft_cap=soft_cap,
                                   window_left=window, sinks=sinks)
    want_out, want_lse = _naive(q, k, v, indptr, lens, table, True, 1 / 8, soft_cap=soft_cap, window=window,
                                sinks=sinks)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_reference_sinks_on_rows_without_kv_and_lse_convention():
    # A request with no queries/KV owns no rows; a row of an all-sink head: LSE = logsumexp(logits + sink).
    q, k, v, indptr, lens, table = _random_batch(6, q_lens=[0, 2], kv_lens=[0, 5], block_size=4, num_qo_heads=2,
                                                 num_kv_heads=1, head_dim=64)
    sinks = torch.tensor([1.0, -math.inf])
    out, lse = reference_attention(q, k, v, indptr, lens, table, return_lse=True, sinks=sinks)
    plain_out, plain_lse = reference_attention(q, k, v, indptr, lens, table, return_lse=True)
    torch.testing.assert_close(lse[:, 0], torch.logaddexp(plain_lse[:, 0], torch.tensor(1.0)))
    torch.testing.assert_close(out[:, 0], plain_out[:, 0] * torch.exp(plain_lse[:, 0] - lse[:, 0])[:, None])
    torch.testing.assert_close(lse[:, 1], plain_lse[:, 1])  # a -inf sink changes nothing
    torch.testing.assert_close(out[:, 1], plain_out[:, 1])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reference_fp8_cache_dequantizes_with_scales(kv_dtype):
    q, k, v, indptr, lens, table = _random_batch(7, q_lens=[2, 1], kv_lens=[6, 9], block_size=4, num_qo_heads=2,
                                                 num_kv_heads=1, head_dim=64)
    k8, v8 = k.to(kv_dtype), v.to(kv_dtype)
    out = reference_attention(q, k8, v8, indptr, lens, table, k_scale=0.5, v_scale=torch.tensor([2.0]))
    want, _ = _naive(q, k8.double(), v8.double(), indptr, lens, table, True, 1 / 8, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(logits_soft_cap=-1.0), "logits_soft_cap: expected None, 0 \\(off\\) or a finite positive float"),
    (dict(window_left=-2), "window_left: expected None, -1 \\(off\\) or an int >= 0"),
    (dict(window_left=4, causal=False), "window_left: expected -1 \\(off\\) with causal=False"),
    (dict(sinks=torch.zeros(3)), "sinks: expected shape \\(2,\\)"),
    (dict(sinks=torch.zeros(2, dtype=torch.int32)), "sinks: expected dtype float32/bfloat16/float16"),
    (dict(k_scale=0.0), "k_scale: expected None, a finite positive float"),
    (dict(v_scale=torch.ones(2)), "v_scale: expected a 1-element tensor"),
])
def test_reference_rejects_bad_feature_options(kw, match):
    batch = _random_batch(8, q_lens=[1], kv_lens=[3], block_size=4, num_qo_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match=match):
        reference_attention(*batch, **kw)
