"""Whole batches run to completion (GPU check step ``whole_batch``): the scheduler's share and the kernel's share of
the gain, apart.

Each workload of :data:`BATCHES` (prefixattn.sim.workloads; outputs divided by :data:`OUTPUT_DIVISOR` to fit the
step's budget) runs every step until every request has finished, through the model step's Llama-3.1-8B-shaped
decoder (model_step.py), under three policies (:data:`POLICIES`):

1. ``prefixattn``: prefixattn's scheduler (TokenBatcher: prefix groups, BatchLLM's order; model_layout.py)
   and prefixattn's attention;
2. ``prefixattn-scheduler+flashinfer``: the same steps, FlashInfer's best configuration without sharing;
3. ``arrival+flashinfer``: what an engine does by default (arrival_order.py: arrival order, chunked prefill,
   an LRU prefix cache), FlashInfer's best configuration without sharing.

2 over 1 is the kernel's share, 3 over 2 the scheduler's. FlashInfer's configuration per step kind is the one the
model step found fastest in this run (else :data:`FLASHINFER_FALLBACK`, the first that takes the step). Steps run
eagerly, one after the other, each planned on the host first (both libraries' plans read host metadata): the wall
time includes the host's planning, not the scheduling (all steps are laid out before the clock starts). Rows
(benchmark ``whole_batch``, shape = workload): ``wall_s``, ``steps``, ``tokens_per_s`` (prompt + output tokens),
``output_tokens_per_s``, ``correct`` (layer 0's attention of the first decode and first mixed step against the
reference) per policy; ``kernel_share`` and ``scheduler_share`` (provider ``ratio``). The dry run: a tiny model, a
few requests of each workload, the stand-in FlashInfer.
"""

from __future__ import annotations

import time

from gpu_check.clock import Clock, failure

BENCHMARK = "whole_batch"
#: Workload -> requests on a GPU (prefixattn.sim.workloads): four documents with their questions, 256 case-1
#: requests, 128 requests under the one prompt.
BATCHES = {"docs-qa-8k": 192, "batchllm-case1": 256, "shared-prompt-4k": 128}
#: Outputs / this: ~25-token answers keep the three workloads' steps (two schedules, three policies: ~600 step
#: forwards, counted with arrival_order.py and the TokenBatcher on the host) within the step's two minutes at
#: 20-60 ms a step; the prompts, and so the sharing, are whole.
OUTPUT_DIVISOR = 8
#: The dry run: requests, length scale, token budget, KV blocks (the model step's dry sizes, fewer requests).
DRY_BATCH = (6, 32, 64, 200)
POLICIES = ("prefixattn", "prefixattn-scheduler+flashinfer", "arrival+flashinfer")
#: FlashInfer configurations per step kind, tried in order where the model step named no best for the kind or its
#: best does not take a step (POD and the split need both decodes and prefills).
FLASHINFER_FALLBACK = {"decode": ("flashinfer-decode-tc-fa2", "flashinfer-decode"),
                       "mixed": ("flashinfer-pod", "flashinfer-batch-attention", "flashinfer-prefill-fa2")}


def _flashinfer_choice(results, fi_ok: set) -> dict:
    """Per step kind, FlashInfer's configurations in the order to try: the model step's most frequent best first."""
    from collections import Counter

    best = {kind: Counter() for kind in FLASHINFER_FALLBACK}
    for r in results.rows:
        if r["benchmark"] == "model_step" and r["metric"] == "is_flashinfer_best":
            kind = "decode" if " decode step " in r["shape"] else "mixed"
            best[kind][r["provider"]] += 1
    return {kind: [p for p in dict.fromkeys([*(p for p, _ in best[kind].most_common()), *FLASHINFER_FALLBACK[kind]])
                   if p in fi_ok] for kind in FLASHINFER_FALLBACK}


def _attend(provider: str, lay, model, device: str, choices: dict):
    """(attend, the configuration used) for one step: prefixattn, or FlashInfer's first configuration that takes
    the step."""
    from gpu_check import model_step
    from peers.flashinfer import Unavailable

    if provider == "prefixattn":
        return model_step.make_attend("prefixattn", model_step._meta(lay, model, device), model, False), provider
    meta = model_step._meta(lay, model, device)
    for name in choices[lay.kind]:
        try:
            return model_step.make_attend(name, meta, model, False), name
        except Unavailable:
            continue
    raise RuntimeError(f"no FlashInfer configuration takes a {lay.kind} step (tried {choices[lay.kind]})")


def run_batch(layouts: list, provider: str, model, device: str, choices: dict) -> dict:
    """Every step of ``layouts`` through ``provider``'s attention: wall seconds (plans and forwards, synchronized
    at the end), the configurations used, and whether layer 0's attention of the first step of each kind matched
    the reference."""
    import torch

    from gpu_check import model_step

    ios = [model_step._io(lay, model, device) for lay in layouts]  # on the device before the clock starts
    checked, correct, used = set(), True, set()
    for lay, io in zip(layouts, ios):  # the checks, untimed: the first step of each kind
        if lay.kind not in checked:
            attend, _ = _attend(provider, lay, model, device, choices)
            correct &= model_step._check(attend, io, model_step._meta(lay, model, device), model)[0]
            checked.add(lay.kind)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for lay, io in zip(layouts, ios):
        attend, name = _attend(provider, lay, model, device, choices)
        used.add(name)
        model.forward(io, attend)
    if device == "cuda":
        torch.cuda.synchronize()
    return dict(wall_s=time.perf_counter() - start, used=sorted(used), correct=correct)


def step_whole_batch(args, results, skips, device: str, fi_ready: dict) -> None:
    """Each workload's batch under each policy, to completion; rows ``whole_batch``."""
    import torch

    from gpu_check import arrival_order, model_layout, model_step

    clock = Clock("whole_batch", skips)
    dry = args.dry_run
    shape = model_step.DRY_MODEL if dry else model_step.LLAMA_31_8B
    _, _, budget, blocks, _ = model_step.WORKLOADS["batchllm-case1"]
    choices = _flashinfer_choice(results, {p for p, ok in fi_ready.items() if ok is True})
    try:
        model = model_step.Model(shape, torch.float32 if dry else torch.bfloat16, device,
                                 DRY_BATCH[3] if dry else blocks)
    except torch.cuda.OutOfMemoryError as exc:
        return clock.skip(f"out of memory building the {shape.name} weights and caches: {str(exc)[:200]}")
    for i, name in enumerate(BATCHES):
        if clock.expired([f"{w}" for w in list(BATCHES)[i:]]):
            break
        n, scale = (DRY_BATCH[0], DRY_BATCH[1]) if dry else (BATCHES[name], 1)
        step_budget, kv_blocks = (DRY_BATCH[2], DRY_BATCH[3]) if dry else (budget, blocks)
        prompts, outputs = model_layout.workload(name, n, scale)
        outputs = [max(1, o // OUTPUT_DIVISOR) for o in outputs]
        start = time.monotonic()
        batcher, steps = model_layout.run_batcher(prompts, outputs, token_budget=step_budget, kv_blocks=kv_blocks,
                                                  block_size=model_step.BLOCK_SIZE)
        ours = [model_layout.layout(b, batcher, prompts, model_step.BLOCK_SIZE) for b in steps]
        arrival = arrival_order.schedule(prompts, outputs, token_budget=step_budget, num_blocks=kv_blocks,
                                         block_size=model_step.BLOCK_SIZE)
        tokens = sum(len(p) for p in prompts) + sum(outputs)
        print(f"[whole_batch] {name}: {n} requests, {tokens:,} tokens; {len(ours)} TokenBatcher steps, "
              f"{len(arrival)} arrival-order steps ({time.monotonic() - start:.1f} s host)", flush=True)
        walls = {}
        for policy in POLICIES:
            if clock.left() <= 0:
                clock.skip(f"{name}: {policy} and the rest of the policies")
                break
            layouts = arrival if policy.startswith("arrival") else ours
            provider = "prefixattn" if policy == "prefixattn" else "flashinfer"
            try:
                r = run_batch(layouts, provider, model, device, choices)
            except Exception as exc:  # noqa: BLE001 - one policy failing leaves the others
                print(f"[whole_batch]   {policy:34s} FAILED: {failure(exc)}", flush=True)
                results.add(BENCHMARK, policy, name, "correct" if provider == "prefixattn" else "ran", 0.0, "bool")
                continue
            walls[policy] = r["wall_s"]
            for metric, value, unit in (("wall_s", r["wall_s"], "s"), ("steps", len(layouts), "count"),
                                        ("tokens_per_s", tokens / r["wall_s"], "tokens/s"),
                                        ("output_tokens_per_s", sum(outputs) / r["wall_s"], "tokens/s"),
                                        ("correct", float(r["correct"]), "bool")):
                results.add(BENCHMARK, policy, name, metric, value, unit)
            print(f"[whole_batch]   {policy:34s} {r['wall_s']:8.2f} s, {tokens / r['wall_s']:,.0f} tokens/s "
                  f"({', '.join(r['used'])}){'' if r['correct'] else ' WRONG attention'}", flush=True)
        _shares(results, name, walls)
    if dry:
        clock.skip("dry run: interpreter steps, times are not GPU times")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def _shares(results, name: str, walls: dict) -> None:
    """The kernel's share (FlashInfer over prefixattn on prefixattn's steps) and the scheduler's (arrival order over
    prefixattn's order, both on FlashInfer): each above 1 where prefixattn's part gains."""
    ours, fi, arrival = (walls.get(p) for p in POLICIES)
    if ours and fi:
        results.add(BENCHMARK, "ratio", name, "kernel_share", fi / ours, "x")
    if fi and arrival:
        results.add(BENCHMARK, "ratio", name, "scheduler_share", arrival / fi, "x")
    if ours and arrival:
        results.add(BENCHMARK, "ratio", name, "total", arrival / ours, "x")
