"""SGLang's own ``SchedulePolicy.calc_priority`` on a real waiting queue of ``Req`` objects: what the prefix-group
policies do with output lengths, measured on CPU. Run in the SGLang venv::

    PYTHONPATH=. .venv-sglang/bin/python -m bench.sglang_policy [--requests 1000,10000]

Per policy: the time of ``calc_priority`` on the whole queue (first call: the policy groups it; host CPU), how many
runs of consecutive same-document requests the queue has (one per document is ideal), and the share of the batch's
decode tokens (``max_new_tokens``) in the first quarter of the queue: BatchLLM Eq. 3 puts decode-heavy groups
first so their decodes mix with later prefills, which it can only do when it sees the lengths.

How far SGLang runs here: the schedule policy, the radix cache and the request objects run on CPU; SGLang's
scheduler loop cannot, because its model runner needs ``sgl_kernel``'s CPU ops (``torch.ops.sgl_kernel.rmsnorm_cpu``
and others; no CPU wheel of sgl-kernel for this torch), so steps, retractions and throughput under SGLang are not
measured.
"""

from __future__ import annotations

import argparse
import array
import os
import random
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("fcfs", "lpm", "prefixattn-batchllm", "prefixattn-batchllm (no lengths)", "prefixattn-blendserve",
            "prefixattn-blendserve (no lengths)")
#: Output-length classes of the documents (tokens): most short, a few long (BlendServe's traces mix both).
OUTPUT_CLASSES = (8, 32, 128, 1024)
QUESTIONS_PER_DOC = 24


def workload(num_requests: int, seed: int = 0):
    """Shuffled ``Req`` objects: documents of 200-1,000 tokens asked 24 questions each, one output class per
    document; returns ``(reqs, doc_of, decode_of)``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    rng = random.Random(seed)
    system = list(range(1, 65))
    rows = []
    for d in range(num_requests // QUESTIONS_PER_DOC + 1):
        doc = [rng.randrange(1000, 30000) for _ in range(rng.randint(200, 1000))]
        out = OUTPUT_CLASSES[rng.randrange(len(OUTPUT_CLASSES))]
        for q in range(QUESTIONS_PER_DOC):
            rows.append((system + doc + [rng.randrange(30000, 32000) for _ in range(rng.randint(8, 64))], d, out))
    rows = rows[:num_requests]
    rng.shuffle(rows)
    reqs = [Req(f"r{i}", "", array.array("q", p), SamplingParams(max_new_tokens=out)) for i, (p, _, out) in
            enumerate(rows)]
    return reqs, {r.rid: d for r, (_, d, _) in zip(reqs, rows)}, {r.rid: out for r, (_, _, out) in zip(reqs, rows)}


def _policy(name: str):
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from prefixattn.integrations.sglang.schedule_policy import prefix_group_order

    base, _, variant = name.partition(" ")
    tree_cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                            page_size=1))
    policy = SchedulePolicy(base, tree_cache, False, False, False)
    if variant:  # the policy as it was before it passed output lengths: the same call without them
        policy.prefixattn_order.order_fn = lambda prompts, ordering, **_: prefix_group_order(prompts, ordering)
    return policy


def measure(num_requests: int) -> list[dict]:
    reqs, doc_of, decode_of = workload(num_requests)
    total = sum(decode_of.values())
    rows = []
    for name in POLICIES:
        policy = _policy(name)
        queue = list(reqs)
        t0 = time.perf_counter()
        policy.calc_priority(queue)
        seconds = time.perf_counter() - t0
        docs = [doc_of[r.rid] for r in queue]
        quarter = queue[:len(queue) // 4]
        rows.append(dict(policy=name, requests=num_requests, calc_priority_ms=1e3 * seconds,
                         doc_runs=1 + sum(a != b for a, b in zip(docs, docs[1:])), documents=len(set(docs)),
                         decode_share_first_quarter=sum(decode_of[r.rid] for r in quarter) / total))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["MEASURED on this CPU (SGLang 0.5.23 SchedulePolicy, real Req objects and RadixCache)", "",
             "| requests | policy | calc_priority ms | document runs (documents) | decode tokens in first quarter |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['requests']} | {r['policy']} | {r['calc_priority_ms']:.0f} | {r['doc_runs']} "
                     f"({r['documents']}) | {100 * r['decode_share_first_quarter']:.0f}% |")
    return "\n".join(lines)


def _sglang_context():
    """SGLang's process config for a tiny local model (SchedulePolicy reads it)."""
    sys.path.insert(0, REPO)
    from tests.sglang import torchvision_stub

    torchvision_stub.install()
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    from prefixattn.integrations.sglang import plugin

    model_dir = tempfile.mkdtemp(prefix="tiny-llama")
    LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    plugin.enable()
    args = ServerArgs(model_path=model_dir, device="cpu", skip_tokenizer_init=True)
    return runtime_context.use_context(runtime_context.create_context(args, role="scheduler"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1000,10000", help="comma-separated queue sizes")
    args = parser.parse_args(argv)
    with _sglang_context():
        rows = [row for n in args.requests.split(",") for row in measure(int(n))]
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
