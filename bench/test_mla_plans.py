"""MLA plans at the GPU check's DeepSeek-V3 shapes (gpu_check.mla.SHAPES), on the host: how much latent each plan's
work items read against the distinct latent, how many shared nodes and launches it has, the plan time, and the
step time the planner's cost model predicts (MODELED: ``Plan.stats["modeled_step_us"]`` on the sm90 target, the
program-cost model fitted to H100 measurements, scaled to a latent row's bytes), with sharing and without.

What this shows without a GPU: whether sharing pays at 16 and at 128 heads in the plan's own model, and how often a
shared prefix is read (at 16 heads a 32-lane shared tile holds two requests' heads, so a prefix is read once per
two requests; at 128 heads each request's heads fill several tiles). The GPU check's ``mla`` step measures the same
shapes.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch

import prefixattn
from prefixattn.autotune.lookup import planning_target

from gpu_check.mla import NOPE, PAGE, RANK, ROPE, SHAPES, SM_SCALE, VALUE
from prefixattn.integrations.vllm.mla_prefill import plan_prefill_context

BENCHMARK = "mla_plans"
#: The tuning target whose tiles and program costs price the plans (what an H100/H200 runs).
PLAN_TARGET = "sm90"
#: Timed plan() calls per shape (after one untimed): enough for a stable median of a ~1-10 ms call.
TIMED_RUNS = 5


def _metadata(requests: int, shared: int, own: int):
    """One decode row per request: ``shared`` tokens on pages every request's table starts with, ``own`` on its own."""
    shared_pages, own_pages = -(-shared // PAGE), -(-own // PAGE)
    ids = np.random.default_rng(requests).permutation(shared_pages + requests * own_pages).astype(np.int32)
    table = np.concatenate([np.broadcast_to(ids[:shared_pages], (requests, shared_pages)),
                            ids[shared_pages:].reshape(requests, own_pages)], axis=1)
    return (torch.arange(requests + 1, dtype=torch.int32), torch.full((requests,), shared + own, dtype=torch.int32),
            torch.from_numpy(np.ascontiguousarray(table)))


@pytest.mark.parametrize("sharing", ["auto", "never"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_mla_plan(results, shape, sharing):
    name, heads, requests, shared, own = shape
    metadata = _metadata(requests, shared, own)
    kwargs = dict(block_size=PAGE, num_heads=heads, kv_lora_rank=RANK, rope_dim=ROPE, sm_scale=SM_SCALE,
                  q_dtype=torch.bfloat16, sharing=sharing)
    with planning_target(PLAN_TARGET):
        prefixattn.plan_mla(*metadata, **kwargs)
        times = []
        for _ in range(TIMED_RUNS):
            start = time.perf_counter()
            p = prefixattn.plan_mla(*metadata, **kwargs)
            times.append(time.perf_counter() - start)
    provider = "prefixattn" if sharing == "auto" else "prefixattn-nosharing"
    unique = (shared + requests * own) * (RANK + ROPE) * 2
    rows = (("plan_us_median", statistics.median(times) * 1e6, "us", "host-cpu"),
            ("latent_bytes_read", p.kv_bytes_read(), "bytes", "host-cpu"),
            ("unique_latent_bytes", unique, "bytes", "host-cpu"),
            ("read_over_unique", p.kv_bytes_read() / unique, "ratio", "host-cpu"),
            ("shared_nodes", len(p.shared_nodes), "count", "host-cpu"),
            ("launches", p.num_launches, "count", "host-cpu"),
            ("modeled_step_us", p.stats["modeled_step_us"], "us (modeled)", f"{PLAN_TARGET} (modeled)"))
    for metric, value, unit, device in rows:
        results.add(BENCHMARK, provider, name, metric, float(value), unit, device=device)
    assert p.kv_bytes_read() >= unique, "the plan reads less latent than the batch holds"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_mla_naive_plan(results, shape):
    """plan_mla_naive(form="auto") at the decode shapes: the form its rule picks, the prefix it up-projects, the plan
    time, and the matrix FLOPs of the step's attention at the kernels' lanes (exact counts of the plan's rows and
    tokens; the rates that would turn them into time are the rule's, modeled): the absorbed form over every token
    against the naive form over the shared prefix plus its up-projection and the absorbed form over the rest."""
    name, heads, requests, shared, own = shape
    metadata = _metadata(requests, shared, own)
    kwargs = dict(block_size=PAGE, num_heads=heads, kv_lora_rank=RANK, rope_dim=ROPE, qk_nope_head_dim=NOPE,
                  v_head_dim=VALUE, sm_scale=SM_SCALE, q_dtype=torch.bfloat16, form="auto", device="cpu")
    with planning_target(PLAN_TARGET):
        prefixattn.plan_mla_naive(*metadata, **kwargs)
        start = time.perf_counter()
        p = prefixattn.plan_mla_naive(*metadata, **kwargs)
        seconds = time.perf_counter() - start
    absorbed_flop, naive_flop = 2 * (RANK + ROPE) + 2 * RANK, 2 * 256 + 2 * VALUE  # per (row, head, key): lanes
    prefix = p.stats["naive_prefix_tokens"]
    all_absorbed = requests * heads * (shared + own) * absorbed_flop
    split = (requests * heads * (prefix * naive_flop + (shared + own - prefix) * absorbed_flop)
             + heads * prefix * 2 * RANK * (NOPE + VALUE))
    for metric, value, unit in (("naive_prefix_tokens", prefix, "tokens"), ("naive_groups", p.stats["naive_groups"],
                                                                            "count"),
                                ("plan_us", seconds * 1e6, "us"), ("attention_gflop", split / 1e9, "GFLOP"),
                                ("absorbed_attention_gflop", all_absorbed / 1e9, "GFLOP")):
        results.add(BENCHMARK, "prefixattn-naive", name, metric, float(value), unit, device="host-cpu")
    # The rule: a group of one decode row per request takes the naive form from 190 requests (16-bit).
    assert p.stats["mla_form"] == ("naive" if shared and requests >= 190 else "absorbed")
    assert prefix == (shared if p.stats["mla_form"] == "naive" else 0)


#: Prefill steps over one cached prompt (the shared 8K of the decode shapes): ``(name, heads, prefills, cached, new)``,
#: within vLLM's default 8K-token step budget: short questions (the backend's path) and long ones (vLLM's: the saved
#: up-projections do not pay for the slower attention, modeled).
PREFILL_SHAPES = (("mla-prefill-h16-p32-c8192-n64", 16, 32, 8192, 64),
                  ("mla-prefill-h128-p32-c8192-n64", 128, 32, 8192, 64),
                  ("mla-prefill-h128-p8-c8192-n512", 128, 8, 8192, 512))


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: s[0])
def test_mla_prefill_context(results, shape):
    name, heads, prefills, cached, new = shape
    cached_pages, new_pages = cached // PAGE, -(-new // PAGE)
    table = np.concatenate([np.broadcast_to(np.arange(cached_pages), (prefills, cached_pages)),
                            cached_pages + np.arange(prefills * new_pages).reshape(prefills, new_pages)], axis=1)
    args = (np.full(prefills, new), np.full(prefills, cached), table)
    kwargs = dict(block_size=PAGE, num_heads=heads, head_dim=NOPE + ROPE, sm_scale=SM_SCALE, q_dtype=torch.bfloat16,
                  device="cpu", max_tokens=1 << 20, kv_lora_rank=RANK, rope_dim=ROPE, v_head_dim=VALUE)
    with planning_target(PLAN_TARGET):
        plan_prefill_context(*args, **kwargs)
        times = []
        for _ in range(TIMED_RUNS):
            start = time.perf_counter()
            ctx = plan_prefill_context(*args, **kwargs)
            times.append(time.perf_counter() - start)
    flops_per_token = 2 * RANK * heads * (NOPE + VALUE)  # kv_b_proj of one latent row
    # The backend's path (None: vLLM's own, every prefill's context up-projected)
    ours = ctx.distinct_tokens if ctx is not None else prefills * cached
    for provider, tokens in (("vllm-per-request", prefills * cached), ("prefixattn", ours)):
        results.add(BENCHMARK, provider, name, "context_tokens_up_projected", float(tokens), "tokens",
                    device="host-cpu")
        results.add(BENCHMARK, provider, name, "up_projection_gflop", tokens * flops_per_token / 1e9, "GFLOP",
                    device="host-cpu")
    results.add(BENCHMARK, "prefixattn", name, "context_plan_us_median", statistics.median(times) * 1e6, "us",
                device="host-cpu")
    assert (ctx is None) == (new > 400), "the modeled rule: about 400 (query, key) pairs per saved up-projection"
    assert ctx is None or (ctx.distinct_tokens == cached and ctx.context_tokens == prefills * cached)
