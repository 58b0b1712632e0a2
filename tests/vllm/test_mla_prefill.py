"""The MLA backend's prefill context (CPU): a step's prefills over their cached latent contexts, each distinct block
gathered and up-projected once, against the up-projected attention computed directly; and the planning alone
(pieces, distinct blocks, the fall-backs to vLLM's own path)."""

import math

import numpy as np
import pytest
import torch

from prefixattn.integrations.vllm.mla_prefill import context_path_pays_off, plan_prefill_context
from tests.vllm.test_cudagraph import BLOCK, _common
from tests.vllm import test_mla_cudagraph as mla_graphs
from tests.vllm.test_mla_cudagraph import HEADS, KV_LORA_RANK, NUM_BLOCKS, ROPE_DIM, SCALE

#: The MLA builder and impl of a tiny DeepSeek-V3's vLLM config: the graph tests' fixtures.
vllm_config, parts = mla_graphs.vllm_config, mla_graphs.parts

pytestmark = pytest.mark.vllm

NOPE, V = 32, 32  # the fixture layer's qk_nope_head_dim and v_head_dim
WIDTH = NOPE + ROPE_DIM


class CountingProjection(torch.nn.Module):
    """``kv_b_proj`` as vLLM's linear layers return it, ``(out, bias)``; counts the latent rows it up-projects."""

    def __init__(self, generator):
        super().__init__()
        self.weight = torch.randn(KV_LORA_RANK, HEADS * (NOPE + V), generator=generator) / math.sqrt(KV_LORA_RANK)
        self.rows = []

    def forward(self, kv_c):
        self.rows.append(kv_c.shape[0])
        return kv_c @ self.weight, None


def _direct(q, cache, table, query_lens, context_lens, proj):
    """Each prefill token against its own context, up-projected per request: vLLM's arithmetic, in fp64."""
    outs, lses = [], []
    start = 0
    for r, (n, c) in enumerate(zip(query_lens, context_lens)):
        rows = q[start:start + n].double()
        start += n
        if c == 0:
            outs.append(torch.zeros(n, HEADS, V, dtype=torch.float64))
            lses.append(torch.full((HEADS, n), float("-inf"), dtype=torch.float64))
            continue
        latent = torch.cat([cache[b] for b in table[r][:-(-c // BLOCK)]])[:c].double()
        kv = (latent[:, :KV_LORA_RANK] @ proj.weight.double()).view(c, HEADS, NOPE + V)
        k = torch.cat([kv[..., :NOPE], latent[:, None, KV_LORA_RANK:].expand(-1, HEADS, -1)], dim=-1)
        s = torch.einsum("thd,khd->htk", rows, k) * SCALE
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.einsum("htk,khd->thd", torch.softmax(s, dim=-1), kv[..., NOPE:]))
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("query_lens, context_lens, suffix_width", [
    ([5, 7, 3], [40, 40, 33], WIDTH),  # three prefills over one cached prompt (2 full blocks shared by all)
    ([40, 2, 6, 3], [16, 0, 16, 16], V),  # more new tokens than cached ones (pieces), a prefill without a context
])
def test_prefills_over_a_shared_cached_prompt_up_project_it_once(parts, query_lens, context_lens, suffix_width):
    builder, impl = parts
    g = torch.Generator().manual_seed(0)
    impl.kv_b_proj = proj = CountingProjection(g)
    # Blocks 1 and 2 hold the common prompt; each prefill's context continues in a block of its own.
    table = [[1, 2, 3 + r, 9 + r] for r in range(len(query_lens))]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    meta = builder.build(0, _common(query_lens, seq_lens, table))
    assert meta.num_prefills == len(query_lens) and meta.prefill_context is not None
    ctx = meta.prefill_context
    blocks = sorted({b for row, c in zip(table, context_lens) for b in row[:-(-c // BLOCK)]})
    assert ctx.blocks.tolist() == blocks and ctx.distinct_tokens == len(blocks) * BLOCK
    assert ctx.context_tokens == sum(context_lens)
    cache = torch.randn(NUM_BLOCKS, BLOCK, KV_LORA_RANK + ROPE_DIM, generator=g)
    q = torch.randn(sum(query_lens), HEADS, WIDTH, generator=g)
    # vLLM runs the new tokens first; the context output takes their head stride (vLLM's CPU backend: V, FlashAttention
    # with padded values: the keys' width), which vLLM's merge asks for.
    backend = meta.prefill.prefill_backend
    backend._backend.run_prefill_new_tokens = lambda **kw: torch.zeros(sum(query_lens), HEADS, suffix_width)
    backend.run_prefill_new_tokens(q=None)
    out, lse = impl._compute_prefill_context(q, cache, meta, torch.ones(1))
    assert proj.rows == [len(blocks) * BLOCK]  # one up-projection of the distinct blocks
    want, want_lse = _direct(q, cache, table, query_lens, context_lens, proj)
    assert out.shape == (sum(query_lens), HEADS, suffix_width) and lse.shape == (HEADS, sum(query_lens))
    torch.testing.assert_close(out[..., :V].double(), want, atol=2e-5, rtol=2e-5)
    assert (out[..., V:] == 0).all()  # the values' padding lanes, which vLLM cuts
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)


#: DeepSeek-V3's widths: sharing the context pays below ~400 (query, context key) pairs per up-projection saved.
DEEPSEEK = dict(head_dim=192, kv_lora_rank=512, rope_dim=64, v_head_dim=128)


def test_planning_pieces_and_fall_backs():
    common = dict(block_size=16, num_heads=2, sm_scale=0.1, q_dtype=torch.float32, device="cpu", **DEEPSEEK)
    table = np.array([[4, 5, 6], [4, 5, 7]])
    # 20 new tokens over a 16-token context: 2 pieces of at most 16 rows, both over block 4.
    ctx = plan_prefill_context(np.array([20, 3]), np.array([16, 35]), table, max_tokens=1024, **common)
    assert ctx.plan.num_requests == 3 and ctx.plan.num_tokens == 23 and ctx.rows is None
    assert ctx.blocks.tolist() == [4, 5, 7] and ctx.distinct_tokens == 48
    assert ctx.plan.causal is False
    # 70 new tokens save the same 3 up-projections but attend 70 x 16 more pairs: vLLM's path is faster (modeled;
    # 40 would still pay: 745 pairs against the 1,199 that 3 saved rows buy).
    assert plan_prefill_context(np.array([70, 3]), np.array([16, 35]), table, max_tokens=1024, **common) is None
    assert plan_prefill_context(np.array([40, 3]), np.array([16, 35]), table, max_tokens=1024, **common) is not None
    # No context: nothing to plan; contexts without a common block: nothing to save; more distinct context than the
    # workspace holds: vLLM's chunked path.
    assert plan_prefill_context(np.array([5, 3]), np.array([0, 0]), table, max_tokens=1024, **common) is None
    assert plan_prefill_context(np.array([5, 3]), np.array([16, 35]), np.array([[4, 5, 6], [8, 5, 7]]),
                                max_tokens=1024, **common) is None
    assert plan_prefill_context(np.array([5, 3]), np.array([16, 35]), table, max_tokens=32, **common) is None


def test_the_context_path_pays_below_about_400_pairs_per_saved_up_projection():
    # Per query head: kv_b_proj of one latent row, 2 x 512 x 256 FLOPs at FA3's 577 TFLOP/s, against a (query, key)
    # pair's 2 x (256 + 128) FLOPs at 342 TFLOP/s (prefixattn's 256-lane keys, 128-lane values) instead of
    # 2 x (192 + 128) at 577: 399.7 pairs per saved row.
    assert context_path_pays_off(saved_tokens=1000, pairs=399_000, **DEEPSEEK)
    assert not context_path_pays_off(saved_tokens=1000, pairs=400_500, **DEEPSEEK)
    assert not context_path_pays_off(saved_tokens=0, pairs=1, **DEEPSEEK)


def test_an_fp8_latent_cache_is_dequantized_by_its_scale():
    # vLLM's fp8 MLA cache (written by concat_and_cache_mla with the layer's k_scale): the gathered blocks are read
    # back times the scale before the up-projection; prefill_context_attention alone (vLLM-CPU has no fp8 MLA cache).
    from prefixattn.integrations.vllm.mla_prefill import prefill_context_attention

    g = torch.Generator().manual_seed(1)
    proj = CountingProjection(g)
    query_lens, context_lens = [3, 2], [32, 40]
    table = np.array([[1, 2, 5], [1, 2, 6]])
    ctx = plan_prefill_context(np.array(query_lens), np.array(context_lens), table, block_size=BLOCK,
                               num_heads=HEADS, head_dim=WIDTH, sm_scale=SCALE, q_dtype=torch.float32, device="cpu",
                               max_tokens=1024, kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM, v_head_dim=V)
    assert ctx is not None
    cache = (torch.randn(NUM_BLOCKS, BLOCK, KV_LORA_RANK + ROPE_DIM, generator=g) * 4).to(torch.float8_e5m2)
    q = torch.randn(sum(query_lens), HEADS, WIDTH, generator=g)
    out, lse = prefill_context_attention(ctx, q, cache, lambda c: proj(c)[0], kv_lora_rank=KV_LORA_RANK,
                                         qk_nope_head_dim=NOPE, v_head_dim=V, scale=torch.tensor([0.25]))
    want, want_lse = _direct(q, cache.float() * 0.25, table.tolist(), query_lens, context_lens, proj)
    torch.testing.assert_close(out[..., :V].double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)
