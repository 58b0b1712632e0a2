"""Global prefix scheduler speed (CPU): prefix identification + grouping vs SGLang's RadixCache insertion, a
BlendServe-scale batch grouped and ordered, and one token-batching step with 1,024 running requests.

* ``scheduler_grouping``: ``group_prompts`` on BatchLLM case-1-shaped batches (3,000 and 30,000 requests of ~1,560
  tokens: a 64-token system prompt, ~1,100-token documents shared by ~7 queries of ~400 tokens), from numpy int32
  rows and from Python lists, against SGLang building its keys from the lists and inserting the prompts one by one
  into its ``RadixCache`` (page size 1), all measured in one process (``sglang_radix.compare``): in this
  interpreter when sglang imports here, else in the SGLang venv (``.venv-sglang`` at the repository root or
  ``PREFIXATTN_BENCH_SGLANG_PYTHON``, as the traffic peers find theirs). Without either, our rows are recorded here
  and the peer is skipped with the reason. Ratio rows are SGLang time / ours.
  ``python-int-read-floor`` is ``sum`` over the lists (each Python int read once): the least any exact method
  from lists pays, so SGLang's time over it bounds the speedup reachable from lists.
* ``scheduler_scale``: 400,000 requests (BlendServe's scale) in a fresh process: grouping, then ordering with
  ``batchllm`` and ``blendserve``; peak memory beyond the prompts. Two batches: BatchLLM case-1-shaped prompts
  (~1,560 tokens each, ~625M tokens, 2.5 GB, generated as one int32 array and passed as ``PackedSequences``) and a
  BlendServe-like chat / MMLU / video mix (~600 tokens, a list of row arrays).
* ``scheduler_step``: ``TokenBatcher.step()`` with 1,024 running requests (pure decode, and decode plus a waiting
  queue that keeps prefill chunks in every step).

Wall and CPU (process) time are both recorded: this machine is shared, and CPU time is less disturbed by other
work. Benchmarks report; nothing here asserts a speed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from batches.prompts import batchllm_case1

from prefixattn.scheduling import PrefixGroup, TokenBatcher, group_prompts, optimal_saving_ratio, saving_ratio

HERE = Path(__file__).parent
#: Repetitions of our grouping per batch (median reported); SGLang's insertion is slower, so fewer there.
OUR_REPEATS = 5
PEER_REPEATS = {3000: 3, 30000: 1}
#: Steps timed per token-batching case (median and p90 reported).
STEP_REPEATS = 300


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _sglang_compare(num_requests: int) -> tuple[dict | None, str]:
    """``sglang_radix.compare`` here if sglang imports, else in the SGLang venv; (result or None, why)."""
    import sglang_radix
    from peers.remote import REPO_ROOT, engine_python

    repeats = PEER_REPEATS[num_requests]
    if sglang_radix.unavailable_reason() is None:
        return sglang_radix.compare(num_requests, repeats), "in process"
    python, why = engine_python("sglang")
    if python is None:
        return None, why
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(HERE)]))
    proc = subprocess.run([python, str(HERE / "sglang_radix.py"), str(num_requests), str(repeats)],
                          capture_output=True, text=True, timeout=1800, env=env, cwd=HERE)
    if proc.returncode != 0:
        return None, f"sglang_radix.py failed in {python}: {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), why


@pytest.mark.parametrize("num_requests", [3000, 30000])
def test_grouping_vs_sglang_radix_cache(results, num_requests):
    prompts = batchllm_case1(num_requests)
    mean_len = sum(len(p) for p in prompts) / len(prompts)
    shape = f"batchllm-case1 N={num_requests} mean={mean_len:.0f}tok share~7"
    group_prompts(prompts[:50])  # warm imports and caches
    runs = [_timed(lambda: group_prompts(prompts)) for _ in range(OUR_REPEATS)]
    groups = runs[-1][0]
    ours = statistics.median(r[1] for r in runs)
    results.add("scheduler_grouping", "prefixattn", shape, "wall_s", ours, "s")
    results.add("scheduler_grouping", "prefixattn", shape, "cpu_s", statistics.median(r[2] for r in runs), "s")
    results.add("scheduler_grouping", "prefixattn", shape, "groups", len(groups), "count")
    if num_requests == 3000:
        ratio, optimal = saving_ratio(prompts, groups), optimal_saving_ratio(prompts)
        results.add("scheduler_grouping", "prefixattn", shape, "saving_ratio_levels1", ratio, "fraction")
        results.add("scheduler_grouping", "prefixattn", shape, "optimal_saving_ratio", optimal, "fraction")
        results.add("scheduler_grouping", "prefixattn", shape, "saving_vs_optimal", ratio / optimal, "fraction")
    print(f"\n{shape}: prefixattn group_prompts {ours:.3f} s (cpu {statistics.median(r[2] for r in runs):.3f}), "
          f"{len(groups)} groups")

    out, where = _sglang_compare(num_requests)
    if out is None:
        pytest.skip(f"sglang-radix peer skipped: {where}")
    for form in ("arrays", "lists"):
        for clock in ("wall", "cpu"):
            results.add("scheduler_grouping", f"prefixattn-{form}-same-process", shape, f"{clock}_s",
                        out[f"ours_{form}_{clock}_s"], "s")
    for clock in ("wall", "cpu"):
        results.add("scheduler_grouping", "sglang-radix-keys+insert", shape, f"{clock}_s",
                    out[f"sglang_keys_insert_{clock}_s"], "s")
        results.add("scheduler_grouping", "sglang-radix-keys", shape, f"{clock}_s", out[f"sglang_keys_{clock}_s"], "s")
        for form in ("arrays", "lists"):
            results.add("scheduler_grouping", f"prefixattn-{form}-vs-sglang-radix", shape, f"speedup_{clock}",
                        out[f"sglang_keys_insert_{clock}_s"] / out[f"ours_{form}_{clock}_s"], "x")
        # Reading every Python int once (sum over the lists): no exact method from lists can beat this bound.
        results.add("scheduler_grouping", "python-int-read-floor", shape, f"{clock}_s", out[f"read_floor_{clock}_s"],
                    "s")
        results.add("scheduler_grouping", "read-floor-vs-sglang-radix", shape, f"speedup_bound_{clock}",
                    out[f"sglang_keys_insert_{clock}_s"] / out[f"read_floor_{clock}_s"], "x")
    print(f"{shape} ({where}): sglang keys+insert {out['sglang_keys_insert_cpu_s']:.3f} s cpu; ours from arrays "
          f"{out['ours_arrays_cpu_s']:.3f} s cpu ({out['sglang_keys_insert_cpu_s'] / out['ours_arrays_cpu_s']:.1f}x), "
          f"from lists {out['ours_lists_cpu_s']:.3f} s cpu "
          f"({out['sglang_keys_insert_cpu_s'] / out['ours_lists_cpu_s']:.1f}x); reading the lists once "
          f"{out['read_floor_cpu_s']:.3f} s cpu "
          f"(bound {out['sglang_keys_insert_cpu_s'] / out['read_floor_cpu_s']:.1f}x)")


@pytest.mark.parametrize("workload", ["case1", "blendserve"])
def test_blendserve_scale_group_and_order(results, workload):
    proc = subprocess.run([sys.executable, str(HERE / "scheduler_scale_worker.py"), "400000", workload],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"scheduler_scale_worker failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    mean = out["tokens"] / out["num_requests"]
    what = "case-1-shaped, share~7" if workload == "case1" else "chat/MMLU/video mix"
    shape = f"{workload} N={out['num_requests']} mean={mean:.0f}tok ({out['tokens'] / 1e6:.0f}M tokens; {what})"
    total_wall = out["group_wall_s"] + out["order_batchllm_wall_s"]
    total_cpu = out["group_cpu_s"] + out["order_batchllm_cpu_s"]
    for metric in ("group_wall_s", "group_cpu_s", "order_batchllm_wall_s", "order_batchllm_cpu_s",
                   "order_blendserve_wall_s", "order_blendserve_cpu_s"):
        results.add("scheduler_scale", "prefixattn", shape, metric, out[metric], "s")
    results.add("scheduler_scale", "prefixattn", shape, "group_and_order_batchllm_wall_s", total_wall, "s")
    results.add("scheduler_scale", "prefixattn", shape, "group_and_order_batchllm_cpu_s", total_cpu, "s")
    results.add("scheduler_scale", "prefixattn", shape, "peak_extra_memory_gb", out["peak_extra_bytes"] / 2**30, "GB")
    results.add("scheduler_scale", "prefixattn", shape, "prompt_memory_gb", out["prompt_bytes"] / 2**30, "GB")
    results.add("scheduler_scale", "prefixattn", shape, "groups", out["groups"], "count")
    print(f"\n{shape}: group {out['group_wall_s']:.2f} s (cpu {out['group_cpu_s']:.2f}), order batchllm "
          f"{out['order_batchllm_wall_s']:.2f} s, blendserve {out['order_blendserve_wall_s']:.2f} s; "
          f"peak beyond prompts {out['peak_extra_bytes'] / 2**30:.2f} GB")


def _running_batcher(num_running: int, *, waiting: int) -> TokenBatcher:
    """A batcher whose first ``num_running`` requests (groups of 8, ~1.5k-token prompts) are all decoding, with
    ``waiting`` more single-request groups queued behind them (output estimates of 256 tokens: reservations on)."""
    rng = np.random.default_rng(0)
    groups, rid = [], 0
    for _ in range(num_running // 8):
        lens = (1100 + rng.integers(300, 500, 8)).tolist()
        groups.append(PrefixGroup(1100, list(range(rid, rid + 8)), lens))
        rid += 8
    for _ in range(waiting):
        groups.append(PrefixGroup(0, [rid], [int(rng.integers(200, 2000))]))
        rid += 1
    batcher = TokenBatcher(token_budget=2048, kv_blocks=1 << 22, block_size=16, output_lens=256)
    batcher.add_groups(groups)
    for _ in range(10_000):
        batcher.step()
        if all(batcher.request_state(r) == "decode" for r in range(num_running)):
            return batcher
    raise RuntimeError("running set never formed")


@pytest.mark.parametrize("waiting", [0, 100_000])
def test_token_batching_step(results, waiting):
    running = 1024
    batcher = _running_batcher(running, waiting=waiting)
    times, decodes = [], []
    for _ in range(STEP_REPEATS):
        start = time.perf_counter()
        plan = batcher.step()
        times.append(time.perf_counter() - start)
        decoding = plan.request_ids[plan.kinds == 0]
        decodes.append(decoding.size)
        for r in decoding[running:].tolist():  # keep the running set at 1,024: the newest finish (untimed)
            batcher.finish(r)
    shape = f"running={running} waiting={waiting} token_budget=2048"
    median = statistics.median(times) * 1e3
    results.add("scheduler_step", "prefixattn", shape, "median_ms", median, "ms")
    results.add("scheduler_step", "prefixattn", shape, "p90_ms", float(np.percentile(times, 90)) * 1e3, "ms")
    results.add("scheduler_step", "prefixattn", shape, "decodes_per_step", statistics.median(decodes), "count")
    print(f"\n{shape}: step median {median:.3f} ms, p90 {np.percentile(times, 90) * 1e3:.3f} ms, "
          f"{statistics.median(decodes):.0f} decodes per step, {plan.total_tokens} tokens in the last plan")
