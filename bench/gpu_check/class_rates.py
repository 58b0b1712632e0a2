"""The matrix classes' causal rate beside FlashAttention-3 and -2 in the same run (GPU check step ``class_rates``).

What the Hopper rebuild of the chunk and shared classes is measured by: prefixattn's causal attention rate (FLOP/s)
on two shapes, each beside FlashInfer's batch prefill on fa3 and on fa2 (fa3 needs sm90: elsewhere its row says why
it did not run), every output checked against the reference first (:func:`gpu_check.floors.attention_rates`):

- ``dense``: one 16K-token causal prefill, its pages in order (the ceilings step's attention-rate batch);
- ``paged``: two 4,096-token prefill chunks, each over 32,768 cached tokens of its own, every 16-token page in a
  shuffled order (:func:`gpu_check.floors.paged_chunk_batch`): how an engine's cache holds a long prompt's later
  chunks, where a KV tile gathers several pages from anywhere.

And prefixattn with the matrix classes' Hopper build (``prefixattn-hopper``, last: the rate the Hopper rebuild is
for), once its correctness cases passed in this process (the correctness step's, or run here in their child process
in a call without that step).

Rows ``class_rate``: ``attention_tflops`` and ``us`` per provider that ran, ``not_run`` (with the reason) per one that
did not. The per-class times of the other shapes are the timing step's (``class_<name>_us``).
"""

from __future__ import annotations

BENCH = "class_rate"
#: FlashInfer's prefill backends every shape is run on, beside prefixattn.
BACKENDS = ("fa3", "fa2")


def _shapes(dry_run: bool, device: str) -> list:
    """``[(label, batch)]``: the dense and the paged batch (labels with their sizes)."""
    from gpu_check.floors import (DRY_PAGED_CHUNKS, DRY_RATE_TOKENS, PAGED_CHUNKS, RATE_TOKENS, attention_rate_batch,
                                  paged_chunk_batch)

    tokens = DRY_RATE_TOKENS if dry_run else RATE_TOKENS
    n, new, cached = DRY_PAGED_CHUNKS if dry_run else PAGED_CHUNKS
    return [(f"dense causal {tokens} tokens, pages in order", lambda: attention_rate_batch(dry_run, device)),
            (f"paged {n} x {new}-token chunks over {cached} cached, pages shuffled",
             lambda: paged_chunk_batch(dry_run, device))]


def step_class_rates(args, results, skips, device: str, fi_ready: dict) -> None:
    from gpu_check.clock import Clock
    from gpu_check.correctness import hopper_verdict
    from gpu_check.floors import attention_rates
    from gpu_check.measure import Timer, record_state

    clock = Clock("class_rates", skips)
    timer = Timer(args.dry_run, device)
    ready = {p for p, ok in fi_ready.items() if ok is True}
    providers = ["prefixattn"] + [f"flashinfer-prefill-{b}" for b in BACKENDS] + ["prefixattn-hopper"]
    hopper_ok, hopper_why = hopper_verdict(args, results, clock)
    shapes = _shapes(args.dry_run, device)
    for i, (label, build) in enumerate(shapes):
        if clock.expired([s[0] for s in shapes[i:]]):
            return
        failures = {} if hopper_ok else {"prefixattn-hopper": f"its correctness cases did not pass: {hopper_why}"}
        rates = attention_rates(timer, device, ready, batch=build(), backends=BACKENDS, failures=failures,
                                hopper=hopper_ok)
        for provider in providers:
            if provider in rates:
                rate, us = rates[provider]
                results.add(BENCH, provider, label, "attention_tflops", rate / 1e12, "TFLOP/s")
                results.add(BENCH, provider, label, "us", us, "us")
            else:
                why = failures.get(provider, "its FlashInfer JIT is not ready")
                results.add(BENCH, provider, label, "not_run", 1.0, f"reason: {why}"[:200])
        print(f"[class_rates] {label}: " + ", ".join(f"{p} {r / 1e12:.1f} TFLOP/s" for p, (r, _) in rates.items()),
              flush=True)
        if not args.dry_run:
            record_state(results, BENCH, label)
