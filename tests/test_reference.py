"""reference_attention against a naive dense softmax built straight from the definition."""

import math

import pytest
import torch

from prefixattn import reference_attention


def _naive(q, k_cache, v_cache, qo_indptr, kv_lens, block_table, causal, sm_scale):
    """Per (request, head, query row) loop, dense logits, float64: as literal as possible."""
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
            for h in range(num_qo_heads):
                if visible == 0:
                    continue
                logits = keys[:visible, h // group].double() @ q[q_start + i, h].double() * sm_scale
                lse[q_start + i, h] = torch.logsumexp(logits, 0)
                out[q_start + i, h] = torch.softmax(logits, 0) @ vals[:visible, h // group].double()
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
