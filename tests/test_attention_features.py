"""Issue 19's kernel features against the reference: any head size (multiple of 8, 32..256), logit soft-capping,
attention sinks, fp8 KV caches with per-tensor scales and sliding windows, each next to shared prefixes and split-k
merges (interpreter on CPU: small grids)."""

from __future__ import annotations

import math

import pytest
import torch

from prefixattn import attention, plan, reference_attention
from tests.prefix_batches import make_batch, random_batch
from tests.tolerances import ATTENTION_TOL, LSE_TOL


def _to(batch, device):
    for name in ("q", "k_cache", "v_cache", "qo_indptr", "kv_lens", "block_table"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def _compare(got, want, dtype):
    (o, lse), (o_ref, lse_ref) = got, want
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(o.float(), o_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_ref, atol=LSE_TOL[0], rtol=LSE_TOL[1])


def _shared_batch(device, *, head_dim=64, dtype=torch.float32, seed=0, **kw):
    # Two requests under a 2-block shared prefix (one decode, one 5-row prefill chunk), one alone with 3 rows.
    args = dict(q_lens=[1, 5, 3], extra_lens=[3, 9, 6], paths=[("a",), ("a",), ()], level_blocks={"a": 2},
                block_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    args.update(kw)
    return _to(make_batch(seed, **args), device)


@pytest.mark.parametrize("head_dim, dtype", [(32, torch.float32), (40, torch.float16), (112, torch.float32),
                                             (192, torch.bfloat16)])
def test_any_head_size_multiple_of_8(device, head_dim, dtype):
    # Padded tiles (BLOCK_D 32, 64, 128, 256) masked at head_dim; shared node, suffixes and a split-k merge.
    b = _shared_batch(device, head_dim=head_dim, dtype=dtype)
    p = plan(*b.metadata, **b.heads, q_dtype=dtype, sharing="always", num_sms=4, min_split_tokens=4)
    assert p.shared_nodes and p.work.num_ws_rows > 0
    got = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True)
    _compare(got, want, dtype)
