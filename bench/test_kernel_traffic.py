"""Fused prefix-shared attention: launches per call, KV bytes the plan reads vs the unique-KV lower bound, plan() time.

Shapes follow BatchLLM Fig. 8 (shared prefix / distinct length / requests per group, e.g. 256/64/all), in two sizes:
* ``interp``: scaled so the kernel really runs under the interpreter (small heads, 32 requests); launches are counted
  on the real call and the output is checked against the reference.
* ``model``: a Llama-3-8B-like step (32 qo heads, 8 KV heads, head_dim 128, 256 decode requests, fp16), plan only.
Reports rows through the ``results`` fixture; asserts correctness only, never a number against a target.
"""

from __future__ import annotations

import importlib
import statistics
import time

import numpy as np
import pytest
import torch

import prefixattn

BENCH = "kernel_traffic"
#: (shared prefix tokens, distinct tokens per request, requests per group; None = all requests in one group)
FIG8_SHAPES = [(256, 64, None), (1024, 64, 8), (64, 512, 4), (2048, 256, 4)]
BLOCK_SIZE = 16
PLAN_TIMING_RUNS = 200


def _shape_name(shared, distinct, per_group):
    return f"{shared}/{distinct}/{'all' if per_group is None else per_group}"


def _batch(num_requests, shared, distinct, per_group, *, q_len=1, seed=0):
    """Decode batch: groups of ``per_group`` requests list the same ``shared // BLOCK_SIZE`` blocks first, then
    their own blocks for ``distinct`` tokens (the query is the last distinct token)."""
    per_group = per_group or num_requests
    shared_blocks = shared // BLOCK_SIZE
    own_blocks = -(-distinct // BLOCK_SIZE)
    num_groups = -(-num_requests // per_group)
    rows = []
    for r in range(num_requests):
        g = r // per_group
        own_base = num_groups * shared_blocks + r * own_blocks
        shared_ids = list(range(g * shared_blocks, (g + 1) * shared_blocks))
        rows.append(shared_ids + list(range(own_base, own_base + own_blocks)))
    num_blocks = num_groups * shared_blocks + num_requests * own_blocks
    perm = np.random.default_rng(seed).permutation(num_blocks)
    table = torch.tensor(perm[np.array(rows)], dtype=torch.int32)
    kv_lens = torch.full((num_requests,), shared + distinct, dtype=torch.int32)
    qo_indptr = torch.arange(num_requests + 1, dtype=torch.int32) * q_len
    return qo_indptr, kv_lens, table, num_blocks


def _unique_kv_bytes(kv_lens, table, p):
    """Lower bound: every distinct physical KV position any request sees, read once (K and V, all KV heads)."""
    positions = set()
    for r, n in enumerate(kv_lens.tolist()):
        pos = np.arange(n)
        positions.update((table[r, pos // p.block_size].numpy().astype(np.int64) * p.block_size
                          + pos % p.block_size).tolist())
    return len(positions) * p.num_kv_heads * p.head_dim * 2 * p.q_dtype.itemsize


class _CountingKernel:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("shape", FIG8_SHAPES, ids=[_shape_name(*s) for s in FIG8_SHAPES])
def test_traffic_interp(shape, results, monkeypatch):
    """Scaled shapes, kernel run: launches per call and KV bytes read vs unique, shared vs not."""
    shared, distinct, per_group = shape
    # Scaled 8x down in length so the interpreter runs it in seconds.
    shared, distinct = max(shared // 8, BLOCK_SIZE), max(distinct // 8, 1)
    num_requests, heads = 32, dict(num_qo_heads=4, num_kv_heads=1, head_dim=64)
    qo_indptr, kv_lens, table, num_blocks = _batch(num_requests, shared, distinct, per_group)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(num_requests, heads["num_qo_heads"], heads["head_dim"], generator=g).half()
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, heads["num_kv_heads"], heads["head_dim"], generator=g).half()
    v_cache = torch.randn_like(k_cache)
    module = importlib.import_module("prefixattn.attention")
    counter = _CountingKernel(module.prefix_attention_kernel)
    monkeypatch.setattr(module, "prefix_attention_kernel", counter)
    name = f"{_shape_name(*shape)} scaled /8, {num_requests} decode reqs"
    for sharing in ("auto", "never"):
        p = prefixattn.plan(qo_indptr, kv_lens, table, block_size=BLOCK_SIZE, q_dtype=torch.float16,
                            sharing=sharing, **heads)
        before = counter.launches
        t0 = time.perf_counter()
        out = prefixattn.attention(q, k_cache, v_cache, p)
        elapsed = time.perf_counter() - t0
        want = prefixattn.reference_attention(q, k_cache, v_cache, qo_indptr, kv_lens, table)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
        unique = _unique_kv_bytes(kv_lens, table, p)
        provider = f"prefixattn-{sharing}"
        results.add(BENCH, provider, name, "launches_per_call", counter.launches - before, "launches")
        results.add(BENCH, provider, name, "kv_bytes_read", p.kv_bytes_read(), "bytes")
        results.add(BENCH, provider, name, "kv_bytes_unique", unique, "bytes")
        results.add(BENCH, provider, name, "kv_read_over_unique", p.kv_bytes_read() / unique, "x")
        results.add(BENCH, provider, name, "work_items", p.num_items, "items")
        results.add(BENCH, provider, name, "shared_nodes", len(p.shared_nodes), "nodes")
        results.add(BENCH, provider, name, "interpreter_call_time", elapsed * 1e3, "ms")
        print(f"{name} [{sharing}]: launches {counter.launches - before}, KV read/unique "
              f"{p.kv_bytes_read() / unique:.3f}x, items {p.num_items}, shared nodes {len(p.shared_nodes)}")


@pytest.mark.parametrize("shape", FIG8_SHAPES, ids=[_shape_name(*s) for s in FIG8_SHAPES])
def test_traffic_and_plan_time_model(shape, results):
    """Llama-3-8B-like decode step with 256 requests: KV bytes the plan reads vs unique, and plan() time."""
    num_requests = 256
    heads = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    qo_indptr, kv_lens, table, _ = _batch(num_requests, *shape)
    name = f"{_shape_name(*shape)}, {num_requests} decode reqs, llama3-8b heads"
    for sharing in ("auto", "never"):
        kw = dict(block_size=BLOCK_SIZE, q_dtype=torch.float16, sharing=sharing, device="cpu", **heads)
        for _ in range(10):
            p = prefixattn.plan(qo_indptr, kv_lens, table, **kw)
        times = []
        for _ in range(PLAN_TIMING_RUNS):
            t0 = time.perf_counter()
            p = prefixattn.plan(qo_indptr, kv_lens, table, **kw)
            times.append(time.perf_counter() - t0)
        unique = _unique_kv_bytes(kv_lens, table, p)
        provider = f"prefixattn-{sharing}"
        results.add(BENCH, provider, name, "plan_time_median", statistics.median(times) * 1e6, "us", device="host-cpu")
        results.add(BENCH, provider, name, "plan_time_min", min(times) * 1e6, "us", device="host-cpu")
        results.add(BENCH, provider, name, "kv_read_over_unique", p.kv_bytes_read() / unique, "x")
        results.add(BENCH, provider, name, "launches_per_call", p.num_launches, "launches")
        results.add(BENCH, provider, name, "work_items", p.num_items, "items")
        print(f"{name} [{sharing}]: plan median {statistics.median(times) * 1e6:.0f} us (min "
              f"{min(times) * 1e6:.0f} us), KV read/unique {p.kv_bytes_read() / unique:.3f}x, items {p.num_items}")
