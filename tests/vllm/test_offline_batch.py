"""The offline-batch measurement on the real vLLM-CPU engine (:mod:`bench.vllm_offline_batch`): stock vLLM's
scheduler against PrefixGroupScheduler without and with memory-centric admission, on prefix-shared requests with mixed
output lengths and a deliberately small KV cache.

Asserted: every configuration generates the same greedy tokens, each exactly its ``max_tokens`` long (scheduling
changes when work runs, never what it computes). Reported, never asserted: preemptions, recomputed tokens,
prefix-cache hits, tokens per step, steps; the table is printed and written to ``$PREFIXATTN_VLLM_BATCH_RESULTS``
(else ``bench/results/`` for the full run, pytest's temporary folder for the small one).

Cost: the full batch (240 requests, 12 groups, 64 blocks, five engine processes) took 2 min 8 s on the 2-core machine
with little else running and 4.6 min under load, so it is ``slow``; the default run checks the same property on 96
requests in 6 groups under 32 blocks (still memory-bound: about 4 requests fit at their end) with two
configurations, stock and prefix-group with memory admission (each engine process ~35 s on 2 cores; prefix-group
without admission runs in the full batch).
"""

import json
import os

import pytest

from bench.vllm_offline_batch import DEFAULT_BLOCKS, DEFAULT_GROUPS, DEFAULT_REQUESTS, format_table, offline_batch, \
    run_all

pytestmark = pytest.mark.vllm

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                           "results")
FULL = dict(num_requests=DEFAULT_REQUESTS, num_groups=DEFAULT_GROUPS, num_blocks=DEFAULT_BLOCKS)
SMALL = dict(num_requests=96, num_groups=6, num_blocks=32)
SMALL_CONFIGS = ("vllm (max_num_seqs default)", "prefix-group + memory admission")


def _check_and_report(result, size, tag, results_dir=RESULTS_DIR):
    _, max_tokens = offline_batch(size["num_requests"], size["num_groups"])
    runs = result["runs"]
    reference_name = next(iter(runs))
    reference = runs[reference_name]["tokens"]
    assert [len(t) for t in reference] == max_tokens
    for name, run in runs.items():
        assert run["tokens"] == reference, f"{name!r} generated other tokens than {reference_name!r}"
    table = format_table(result) + "\n\nmin top-2 logprob gap over every greedy choice: " + \
        ", ".join(f"{run['min_top2_gap']:.2g}" for run in runs.values())
    print("\n" + table)
    path = os.environ.get("PREFIXATTN_VLLM_BATCH_RESULTS") or os.path.join(results_dir, f"vllm_offline_batch_{tag}")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".md", "w") as f:
        f.write(table + "\n")
    with open(path + ".json", "w") as f:
        json.dump(result, f)


def test_same_greedy_tokens_stock_and_prefix_group_with_admission_on_a_small_batch(tiny_llama, tmp_path):
    _check_and_report(run_all(tiny_llama, **SMALL, configs=SMALL_CONFIGS), SMALL, "small", str(tmp_path))


@pytest.mark.slow
def test_same_greedy_tokens_in_every_configuration(tiny_llama):
    _check_and_report(run_all(tiny_llama, **FULL), FULL, "full")
