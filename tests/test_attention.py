"""attention(): the fused prefix-shared kernel against reference_attention (interpreter on CPU, or a GPU)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import prefixattn
from prefixattn import PrefixSharedAttention, attention, plan, reference_attention
from prefixattn import prefix_attention
from prefixattn.kernels import layout as K
from tests.launch_count import launch_arguments
from tests.prefix_batches import make_batch, random_batch
from tests.tolerances import ATTENTION_TOL, LSE_TOL


def _to(batch, device):
    for name in ("q", "k_cache", "v_cache", "qo_indptr", "kv_lens", "block_table"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def _check(batch, p, *, out=None, causal=True, check_lse=True):
    got = attention(batch.q, batch.k_cache, batch.v_cache, p, out=out, return_lse=check_lse)
    want = reference_attention(batch.q[:p.num_tokens], batch.k_cache, batch.v_cache, *batch.metadata,
                               causal=causal, sm_scale=p.sm_scale, return_lse=check_lse)
    got_out, want_out = (got[0], want[0]) if check_lse else (got, want)
    atol, rtol = ATTENTION_TOL[batch.q.dtype]
    n = p.num_tokens
    assert got_out.dtype == batch.q.dtype
    torch.testing.assert_close(got_out[:n].float(), want_out[:n], atol=atol, rtol=rtol)
    if check_lse:
        torch.testing.assert_close(got[1][:n], want[1][:n], atol=LSE_TOL[0], rtol=LSE_TOL[1])
    return got


class CountingKernel:
    """Stands in for the @triton.jit kernel and counts launches (``kernel[grid](...)``)."""

    def __init__(self, kernel, run=True):
        self.kernel, self.run, self.launches, self.grids, self.kwargs = kernel, run, 0, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            self.grids.append(grid)
            self.kwargs.append(launch_arguments(args, kwargs))
            if self.run:
                return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def count_launches(monkeypatch):
    counter = CountingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", counter)
    return counter


class RandomCase(NamedTuple):
    """One random batch of :func:`test_random_batches` (``levels``: depth of prefix sharing)."""

    seed: int
    requests: int
    levels: int
    block_size: int
    qo_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    sharing: str

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{self.seed}-r{self.requests}-lv{self.levels}-bs{self.block_size}-h{self.qo_heads}:{self.kv_heads}-"
                f"d{self.head_dim}-{dtype}-{'causal' if self.causal else 'full'}-{self.sharing}")


RANDOM_CASES = [
    RandomCase(seed=0, requests=1, levels=0, block_size=16, qo_heads=4, kv_heads=4, head_dim=64,
               dtype=torch.float32, causal=True, sharing="auto"),
    RandomCase(seed=1, requests=5, levels=1, block_size=16, qo_heads=8, kv_heads=2, head_dim=64,
               dtype=torch.float16, causal=True, sharing="always"),
    RandomCase(seed=2, requests=9, levels=2, block_size=5, qo_heads=4, kv_heads=1, head_dim=64,
               dtype=torch.bfloat16, causal=True, sharing="always"),
    RandomCase(seed=3, requests=16, levels=3, block_size=1, qo_heads=8, kv_heads=1, head_dim=64,
               dtype=torch.float32, causal=True, sharing="always"),
    RandomCase(seed=4, requests=12, levels=1, block_size=5, qo_heads=8, kv_heads=8, head_dim=64,
               dtype=torch.float16, causal=False, sharing="always"),
    RandomCase(seed=5, requests=20, levels=2, block_size=16, qo_heads=8, kv_heads=1, head_dim=128,
               dtype=torch.float16, causal=True, sharing="auto"),
    RandomCase(seed=6, requests=7, levels=3, block_size=16, qo_heads=2, kv_heads=2, head_dim=128,
               dtype=torch.float32, causal=False, sharing="always"),
    RandomCase(seed=7, requests=33, levels=1, block_size=1, qo_heads=4, kv_heads=1, head_dim=64,
               dtype=torch.bfloat16, causal=True, sharing="auto"),
    RandomCase(seed=8, requests=10, levels=2, block_size=16, qo_heads=8, kv_heads=2, head_dim=80,
               dtype=torch.float16, causal=True, sharing="always"),
    RandomCase(seed=9, requests=64, levels=2, block_size=16, qo_heads=4, kv_heads=1, head_dim=64,
               dtype=torch.float32, causal=True, sharing="always"),
    RandomCase(seed=10, requests=6, levels=1, block_size=5, qo_heads=16, kv_heads=1, head_dim=64,
               dtype=torch.bfloat16, causal=True, sharing="always"),
    RandomCase(seed=11, requests=8, levels=3, block_size=5, qo_heads=4, kv_heads=4, head_dim=64,
               dtype=torch.float32, causal=True, sharing="auto"),
    RandomCase(seed=12, requests=4, levels=1, block_size=16, qo_heads=8, kv_heads=2, head_dim=256,
               dtype=torch.float16, causal=True, sharing="always"),
    RandomCase(seed=13, requests=24, levels=2, block_size=1, qo_heads=8, kv_heads=2, head_dim=128,
               dtype=torch.bfloat16, causal=False, sharing="auto"),
]


@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: c.name)
def test_random_batches(device, case):
    # Large batches are decode-heavy (as in practice), which also keeps the interpreter's grid small.
    c = case
    b = _to(random_batch(c.seed, num_requests=c.requests, levels=c.levels, block_size=c.block_size,
                         num_qo_heads=c.qo_heads, num_kv_heads=c.kv_heads, head_dim=c.head_dim, dtype=c.dtype,
                         decode_fraction=0.9 if c.requests >= 32 else 0.5), device)
    p = plan(*b.metadata, **b.heads, causal=c.causal, q_dtype=c.dtype, sharing=c.sharing)
    if c.sharing == "always" and c.levels and c.requests > 1:
        assert p.shared_nodes, "the batch was built with shared prefixes"
    _check(b, p, causal=c.causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_split_k_long_shared_prefix_and_long_suffix(device, dtype, count_launches):
    # 3 decode requests under a 12-block shared prefix (few rows, long KV), plus one long lone request: with 32 SMs
    # and 16-token chunks both get split-k; a row's shared states come from the shared class's launch, its own from
    # a later one, and the last arriver merges.
    b = _to(make_batch(0, q_lens=[1, 1, 3, 1], extra_lens=[1, 6, 5, 150], paths=[("a", "b"), ("a", "b"), ("a",), ()],
                       level_blocks={"a": 8, "b": 4}, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                       dtype=dtype), device)
    p = plan(*b.metadata, **b.heads, q_dtype=dtype, sharing="always", num_sms=32, min_split_tokens=16)
    kinds = p.work.items[:, K.ITEM_KIND]
    assert len(p.shared_nodes) == 2 and (kinds == K.KIND_SHARED).sum() > 2 and (kinds == K.KIND_SUFFIX).sum() > 4
    _check(b, p)
    per_class = [p.work.class_range(c) for c in p.work_classes]
    assert count_launches.launches == p.num_launches == len(per_class) >= 2
    assert count_launches.grids == [((end - first) * 2,) for first, end in per_class]
    # Every layer leaves the merge counters at zero (the program that merges a row resets them; no memset runs per
    # layer), so the next layer on the plan gets the same answer.
    assert p.num_merge_rows and (p.counters == 0).all()
    _check(b, p)
    assert (p.counters == 0).all() and count_launches.launches == 2 * p.num_launches


def test_mixed_chunked_prefill_and_decode_with_split(device):
    # A 40-row prefill chunk (several suffix tiles, causal inside) next to decodes, sharing a document.
    b = _to(make_batch(3, q_lens=[40, 1, 1, 17], extra_lens=[45, 9, 1, 17], paths=[("d",)] * 4,
                       level_blocks={"d": 6}, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                       dtype=torch.float16), device)
    for num_sms in (132, 8):
        p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="always", num_sms=num_sms,
                 min_split_tokens=16)
        assert p.shared_nodes
        _check(b, p)


def test_nan_prefilled_output_does_not_leak(device):
    b = _to(random_batch(21, num_requests=6, levels=2, block_size=5, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         dtype=torch.float16), device)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="always", num_sms=8, min_split_tokens=8)
    # CUDA-graph padding: q and out have 3 rows past qo_indptr[-1], which attention() must neither read nor write.
    pad = torch.full((3, *b.q.shape[1:]), float("nan"), dtype=b.q.dtype, device=device)
    b.q = torch.cat([b.q, pad])
    out = torch.full_like(b.q, float("nan"))
    got, lse = _check(b, p, out=out)
    assert got is out and torch.isfinite(out[:p.num_tokens]).all() and torch.isfinite(lse[:p.num_tokens]).all()
    assert torch.isnan(out[p.num_tokens:]).all(), "padding rows are left alone"


def test_non_contiguous_q_caches_and_out(device):
    b = _to(random_batch(5, num_requests=7, levels=2, block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                         dtype=torch.float32), device)
    num_tokens, hq, d = b.q.shape
    # q as a slice of a fused qkv projection; caches in an engine layout [2, num_blocks, num_kv_heads, block, d]
    # seen through a permuted view; out a strided slice.
    qkv = torch.randn(num_tokens, hq + 4, d, device=device)
    qkv[:, :hq] = b.q
    b.q = qkv[:, :hq]
    kv = torch.stack([b.k_cache, b.v_cache]).permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    b.k_cache, b.v_cache = kv[0], kv[1]
    assert not (b.q.is_contiguous() or b.k_cache.is_contiguous())
    out = torch.empty(num_tokens, hq, 2 * d, device=device)[:, :, ::2]
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32, sharing="always")
    got = _check(b, p, out=out, check_lse=False)
    assert got is out


@pytest.mark.parametrize("causal", [True, False])
def test_all_requests_identical(device, causal):
    n = 6
    b = _to(make_batch(7, q_lens=[2] * n, extra_lens=[5] * n, paths=[("p",)] * n, level_blocks={"p": 3},
                       block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32), device)
    # Identical requests: one table row, one KV, different queries.
    b.block_table[:] = b.block_table[0]
    p = plan(*b.metadata, **b.heads, causal=causal, q_dtype=torch.float32, sharing="always")
    shared_end = 3 * 16 + 5 - (2 if causal else 0)
    assert [(s.kv_start, s.kv_end, s.requests.tolist()) for s in p.shared_nodes] == [(0, shared_end, list(range(n)))]
    if not causal:
        assert (p.work.items[:, K.ITEM_KIND] == K.KIND_SHARED).all(), "nothing is left for suffixes"
    _check(b, p, causal=causal)


def test_one_request(device):
    b = _to(make_batch(8, q_lens=[13], extra_lens=[29], paths=[()], level_blocks={}, block_size=5, num_qo_heads=4,
                       num_kv_heads=2, head_dim=128, dtype=torch.bfloat16), device)
    _check(b, plan(*b.metadata, **b.heads, q_dtype=torch.bfloat16))


def test_empty_segments(device):
    # kv_len == q_len (pure prefill, no history), shared length 0 for some, suffix exactly the queries, requests with
    # no queries between others, and a shared node that reaches the first query position exactly.
    b = _to(make_batch(9, q_lens=[4, 0, 1, 3, 0, 1], extra_lens=[4, 0, 1, 3, 2, 1],
                       paths=[(), ("s",), ("s",), ("s",), (), ()], level_blocks={"s": 2}, block_size=5,
                       num_qo_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float16), device)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="always", num_sms=64, min_split_tokens=2)
    assert [(s.kv_start, s.kv_end, s.requests.tolist()) for s in p.shared_nodes] == [(0, 10, [2, 3])]
    out, lse = _check(b, p)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_no_query_rows_is_no_launch(device, count_launches):
    b = _to(make_batch(10, q_lens=[0, 0], extra_lens=[3, 4], paths=[(), ()], level_blocks={}, block_size=4,
                       num_qo_heads=2, num_kv_heads=1, head_dim=64), device)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32)
    out = attention(b.q, b.k_cache, b.v_cache, p)
    assert out.shape == (0, 2, 64) and count_launches.launches == p.num_launches == 0


def test_thousand_tiny_requests(device):
    # 1,000 decode requests, tiny heads: 4 groups of 10 share a prefix (merges), the rest are plain paged attention.
    # Kept cheap for the interpreter (~1,000 programs); the plan's scale is covered in test_plan.py.
    n = 1000
    paths = [(f"g{r % 4}",) if r < 40 else () for r in range(n)]
    rng = np.random.default_rng(1)
    b = _to(make_batch(11, q_lens=[1] * n, extra_lens=rng.integers(1, 3, n).tolist(), paths=paths,
                       level_blocks={f"g{g}": 1 for g in range(4)}, block_size=16, num_qo_heads=1, num_kv_heads=1,
                       head_dim=64, dtype=torch.float16), device)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16, sharing="always")
    assert len(p.shared_nodes) == 4 and p.work.num_units == 40
    _check(b, p)


def test_attention_does_no_other_device_work(device, monkeypatch):
    """Between the checks and the launch, attention() allocates out (and lse) and does nothing else: no memset of
    the merge counters (the kernels leave them at zero), no copies, no syncs (the plan owns every other buffer)."""
    b = _to(random_batch(12, num_requests=5, levels=1, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64),
            device)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32, sharing="always", num_sms=64, min_split_tokens=8)
    stub = CountingKernel(None, run=False)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", stub)

    class RecordOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with RecordOps() as rec:
        attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    assert stub.launches == p.num_launches == len(p.work_classes) >= 2 and p.num_merge_rows
    assert set(rec.ops) <= {"empty", "empty_like", "empty_strided"}, rec.ops


def test_one_binary_per_work_class(device, monkeypatch):
    """Each work class is its own launch with its own binary (IS_SHARED, its tiles) and warps: a plan without shared
    items launches the decode class alone, with the suffix warp count; with shared items the shared class goes first
    under the shared launch's warps."""
    from prefixattn.autotune.lookup import HEURISTIC_LAUNCH, HEURISTIC_SUFFIX_LAUNCH

    NUM_WARPS_SHARED, NUM_WARPS_SUFFIX = HEURISTIC_LAUNCH.num_warps, HEURISTIC_SUFFIX_LAUNCH.num_warps

    b = _to(random_batch(15, num_requests=4, levels=1, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         decode_fraction=1.0), device)
    stub = CountingKernel(None, run=False)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", stub)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32, sharing="never")
    attention(b.q, b.k_cache, b.v_cache, p)
    assert p.work_classes == (K.CLASS_DECODE,) and stub.launches == 1
    assert stub.kwargs[-1]["IS_SHARED"] is False and stub.kwargs[-1]["num_warps"] == NUM_WARPS_SUFFIX
    assert stub.kwargs[-1]["BLOCK_M"] == p.tiles.decode.block_m
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32, sharing="always")
    attention(b.q, b.k_cache, b.v_cache, p)
    assert p.work_classes == (K.CLASS_SHARED, K.CLASS_DECODE) and stub.launches == 3
    shared, decode = stub.kwargs[-2:]
    assert shared["IS_SHARED"] is True and shared["num_warps"] == NUM_WARPS_SHARED
    assert (shared["BLOCK_M"], shared["BLOCK_N"]) == (p.tiles.shared.block_m, p.tiles.shared.block_n)
    assert decode["IS_SHARED"] is False and decode["num_warps"] == NUM_WARPS_SUFFIX


def test_wrapper_plan_run(device):
    b = _to(random_batch(13, num_requests=4, levels=1, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         dtype=torch.float16), device)
    attn = PrefixSharedAttention(**b.heads, q_dtype=torch.float16)
    with pytest.raises(ValueError, match="plan: expected plan\\(\\) to be called before run\\(\\)"):
        attn.run(b.q, b.k_cache, b.v_cache)
    p = attn.plan(*b.metadata, sharing="always")
    assert attn.current_plan is p
    want = attention(b.q, b.k_cache, b.v_cache, p)
    torch.testing.assert_close(attn.run(b.q, b.k_cache, b.v_cache), want, atol=0, rtol=0)


def test_attention_rejects_mismatches(device):
    b = _to(random_batch(14, num_requests=3, levels=1, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                         dtype=torch.float16), device)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16)
    cases = [
        (dict(q=b.q.float(), k_cache=b.k_cache.float(), v_cache=b.v_cache.float()),
         "q: expected dtype float16 \\(the plan's q_dtype\\), got float32"),
        (dict(q=b.q[:, :2]), "num_qo_heads \\(q dim 1\\): expected 4 \\(from the plan\\), got 2"),
        (dict(q=b.q[:-1]), "q: expected at least"),
        (dict(k_cache=b.k_cache[:, :8], v_cache=b.v_cache[:, :8]), "block_size \\(k_cache dim 1\\): expected 16"),
        (dict(out=torch.empty(1, 4, 64, dtype=torch.float16, device=device)), "out: expected shape"),
        (dict(p="plan"), "plan: expected a prefixattn Plan"),
    ]
    for overrides, match in cases:
        args = dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, p=p, out=None) | overrides
        with pytest.raises(ValueError, match=match):
            attention(args["q"], args["k_cache"], args["v_cache"], args["p"], out=args["out"])


def test_public_exports():
    assert prefixattn.plan is plan and prefixattn.attention is attention
    assert {"plan", "attention", "Plan", "PrefixSharedAttention"} <= set(prefixattn.__all__)
