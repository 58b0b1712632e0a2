"""The GPU check's eager small-shape step (driver: driver.py): the smallest decode steps, where a layer is
host-bound when it runs eagerly (not inside a CUDA graph), timed per layer as an engine's eager loop runs them.

For each shape, ``LAYERS`` layers of ``attention()`` (free plan) and of ``PrefixSharedAttention.run()`` (an eager
wrapper with capacities) run back to back between two CUDA events (``eager_us_per_layer``: device time of the loop
per layer, which host time bounds from below when the layer is host-bound), and each call's host time alone
(``host_us_per_call``). Both with the prepared direct launch (provider ``prefixattn``) and with every launch through
Triton's JIT function (``prefixattn-jit``, ``prefixattn.launcher.ALLOW_DIRECT = False``): the dispatch the direct
launch replaces, on the same build. The dry run (CPU, interpreter) runs each call once against the reference and
records nothing timed.
"""

from __future__ import annotations

import statistics
import time

#: (name, requests, shared prefix tokens, own KV tokens per request): one request, a small batch, a small batch under
#: a shared prefix (two launches a layer). GQA 4, head_dim 128, bf16, pages of 16.
SHAPES = (("decode-1", 1, 0, 512), ("decode-8", 8, 0, 512), ("decode-8-shared", 8, 1024, 64))
HEADS = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
#: Layers per timed loop (a Llama-3.1-8B step) and loops per timing (the median is reported).
LAYERS, LOOPS = 32, 20


def _batch(requests: int, shared: int, own: int, device: str):
    """``(qo_indptr, kv_lens, block_table)`` of one decode row per request, the first ``shared`` tokens on shared
    blocks, and one layer's caches and q."""
    import torch

    bs = HEADS["block_size"]
    shared_blocks, own_blocks = shared // bs, -(-own // bs)
    table = torch.empty((requests, shared_blocks + own_blocks), dtype=torch.int32)
    table[:, :shared_blocks] = torch.arange(shared_blocks, dtype=torch.int32)
    table[:, shared_blocks:] = shared_blocks + torch.arange(requests * own_blocks, dtype=torch.int32).view(requests,
                                                                                                          own_blocks)
    num_blocks = shared_blocks + requests * own_blocks
    g = torch.Generator().manual_seed(requests)
    cache = lambda: torch.randn((num_blocks, bs, HEADS["num_kv_heads"], HEADS["head_dim"]), generator=g,  # noqa: E731
                                dtype=torch.bfloat16).to(device)
    q = torch.randn((requests, HEADS["num_qo_heads"], HEADS["head_dim"]), generator=g, dtype=torch.bfloat16).to(device)
    meta = (torch.arange(requests + 1, dtype=torch.int32), torch.full((requests,), shared + own, dtype=torch.int32),
            table)
    return meta, q, cache(), cache()


def _loop_us(call, layers: int) -> tuple[float, float]:
    """``(device us per layer, host us per call)``: medians over LOOPS loops of ``layers`` calls."""
    import torch

    device_us, host_us = [], []
    for _ in range(LOOPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(layers):
            call()
        host_us.append((time.perf_counter() - t0) * 1e6 / layers)
        end.record()
        end.synchronize()
        device_us.append(start.elapsed_time(end) * 1e3 / layers)
    return statistics.median(device_us), statistics.median(host_us)


def step_eager_small(args, results, skips, device: str) -> None:
    import torch

    import prefixattn
    from gpu_check.clock import Clock
    from prefixattn import launcher

    clock = Clock("eager_small", skips)
    for i, (name, requests, shared, own) in enumerate(SHAPES):
        if clock.expired([s[0] for s in SHAPES[i:]]):
            return
        meta, q, k, v = _batch(requests, shared, own, device)
        dev_meta = tuple(t.to(device) for t in meta)
        p = prefixattn.plan(*dev_meta, **HEADS, q_dtype=torch.bfloat16)
        attn = prefixattn.PrefixSharedAttention(**HEADS, q_dtype=torch.bfloat16, max_tokens=64, max_requests=64,
                                                max_blocks_per_request=256, device=device)
        attn.plan(*dev_meta)
        out = torch.empty_like(q)
        calls = {"attention": lambda: prefixattn.attention(q, k, v, p, out=out),
                 "run": lambda: attn.run(q, k, v, out=out)}
        want = prefixattn.reference_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), *meta)
        for entry, call in calls.items():
            call()
            ok = torch.allclose(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
            results.add("gpu_check_eager_small", "prefixattn", f"{name} {entry}", "correct", float(ok), "bool")
            if args.dry_run:
                continue
            for provider, direct in (("prefixattn", True), ("prefixattn-jit", False)):
                launcher.ALLOW_DIRECT = direct
                try:
                    call()  # the first launch of each binary (either path) goes through the JIT function
                    device_us, host_us = _loop_us(call, LAYERS)
                finally:
                    launcher.ALLOW_DIRECT = True
                print(f"[eager_small] {name} {entry} {provider}: {device_us:.1f} us per layer on the device, "
                      f"{host_us:.1f} us host per call", flush=True)
                results.add("gpu_check_eager_small", provider, f"{name} {entry}", "eager_us_per_layer", device_us,
                            "us")
                results.add("gpu_check_eager_small", provider, f"{name} {entry}", "host_us_per_call", host_us, "us")
    if args.dry_run:
        clock.skip("dry run: no CUDA events (each call checked once against the reference)")
