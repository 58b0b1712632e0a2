"""The GPU check's CUDA-graph step (issue 16; driver: bench/gpu_check.py): one ``use_cuda_graph=True``
:class:`prefixattn.PrefixSharedAttention` in the engines' pattern (capacities, the engine's persistent device block
table read in place, ``graph_num_tokens``), its ``run()`` captured once, then re-planned and replayed for batches of
other sizes and sharing shapes, each against the fp64 reference, with no device allocation by ``plan()`` or the replay.

What only a GPU shows, and this step records: that the captured launch replays correctly for every later plan
(``passed``), that planning and replaying allocate no device memory (``device_bytes_allocated``), the replay's time
against an eager ``run()`` (the launch overhead the graph removes) and ``plan()``'s host time on the GPU machine. The
dry run (CPU, interpreter) runs the same steps with an eager ``run()`` in place of the capture and the replays.
"""

from __future__ import annotations

import statistics
import time

#: Graph-step batches: (name, requests, sharing levels, decode fraction) planned in this order on one wrapper; the
#: first is the one captured. Decode-shaped like an engine's graph steps, plus one mixed batch (the graph's decode
#: tiles are only a worse fit there, never wrong) and the first batch again (replay after other plans).
GRAPH_BATCHES = (("decode-shared", 24, 1, 1.0), ("decode-2-levels", 40, 2, 1.0), ("decode-unshared", 16, 0, 1.0),
                 ("mixed", 12, 1, 0.5), ("decode-shared-again", 24, 1, 1.0))
#: Replays (and eager runs) per timing: the median of this many CUDA-event windows.
TIMED_REPLAYS = 30
#: Host plan() calls timed on the GPU machine (the step's last batch).
TIMED_PLANS = 30


def _batches(scale: int, dtype, heads: dict) -> list:
    """The batches of GRAPH_BATCHES with their block ids offset onto one cache (as an engine's steps share its
    cache), and that cache: ``([(name, batch), ...], k_cache, v_cache)``."""
    import torch

    from tests.prefix_batches import random_batch

    out, k, v, offset = [], [], [], 0
    for seed, (name, requests, levels, decode) in enumerate(GRAPH_BATCHES):
        seed = seed if name != "decode-shared-again" else 0  # the first batch's requests, on its own blocks
        b = random_batch(seed, num_requests=max(2, requests * scale // 8), levels=levels, dtype=dtype,
                         decode_fraction=decode, max_q_len=4 * scale, max_level_blocks=2 * scale,
                         max_extra=8 * scale, **heads)
        b.block_table = b.block_table + offset
        offset += b.k_cache.shape[0]
        k.append(b.k_cache)
        v.append(b.v_cache)
        out.append((name, b))
    return out, torch.cat(k), torch.cat(v)


def step_graphs(args, results, skips, device: str) -> None:
    """Capture once, re-plan and replay every batch (dry run: an eager run each), check, time; rows
    ``gpu_check_graphs``."""
    import torch

    import prefixattn
    from gpu_check_steps import Clock

    clock = Clock("graphs", skips)
    scale = 1 if args.dry_run else 8
    dtype = torch.float32 if args.dry_run else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    heads = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16) if args.dry_run else \
        dict(num_qo_heads=32, num_kv_heads=4, head_dim=128, block_size=16)
    batches, k_cache, v_cache = _batches(scale, dtype, heads)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    rows = max(int(b.qo_indptr[-1]) for _, b in batches)  # the graph's size: every step is padded to it
    requests = max(b.kv_lens.shape[0] for _, b in batches)
    attn = prefixattn.PrefixSharedAttention(**heads, q_dtype=dtype, device=device, max_tokens=rows,
                                            max_requests=requests, max_blocks_per_request=0, use_cuda_graph=True)
    # The engine's persistent block table: written before each step, read in place by the captured launch.
    table = torch.zeros((requests, max(b.block_table.shape[1] for _, b in batches)), dtype=torch.int32,
                        device=device)
    q_static = torch.empty((rows, heads["num_qo_heads"], heads["head_dim"]), dtype=dtype, device=device)
    out_static = torch.empty_like(q_static)
    graph = None

    def plan(b):
        n_req = b.kv_lens.shape[0]
        table.zero_()
        table[:n_req, :b.block_table.shape[1]].copy_(b.block_table)
        return attn.plan(*b.metadata, device_block_table=table[:n_req], graph_num_tokens=rows)

    for i, (name, b) in enumerate(batches):
        if clock.expired([n for n, _ in batches[i:]]):
            return
        start = time.monotonic()
        try:
            graph, r = _step(b, graph=graph, plan=plan, attn=attn, q=q_static, out=out_static, k_cache=k_cache,
                             v_cache=v_cache, device=device, dry_run=args.dry_run)
        except Exception as exc:  # a failed capture or replay is a failed row with its reason, not the end of the run
            print(f"[graphs] FAIL {name:22s} {type(exc).__name__}: {exc}"[:400], flush=True)
            results.add("gpu_check_graphs", "prefixattn-graph", name, "passed", 0.0, "bool")
            return
        print(f"[graphs] {'ok  ' if r['passed'] else 'FAIL'} {name:22s} tokens={r['tokens']} "
              f"requests={b.kv_lens.shape[0]} items={r['items']}/{r['grid_items']} shared_nodes={r['shared_nodes']} "
              f"err={r['max_abs_err']:.2e} device_bytes_allocated={r['device_bytes_allocated']}"
              f"{' (eager run: dry run, no capture)' if args.dry_run else ''} ({time.monotonic() - start:.1f} s)",
              flush=True)
        for metric, unit in (("passed", "bool"), ("max_abs_err", "abs"), ("device_bytes_allocated", "bytes")):
            results.add("gpu_check_graphs", "prefixattn-graph", name, metric, float(r[metric]), unit)
    if args.dry_run:
        clock.skip("dry run: no CUDA graph capture or replay on CPU (each step ran run() eagerly instead)")
        return
    try:
        _time_graph(graph, attn, q_static, k_cache, v_cache, out_static, batches[-1], plan, results)
    except Exception as exc:  # timings are reports: say why they are missing, keep the run going
        clock.skip(f"timing failed: {type(exc).__name__}: {exc}"[:300])


def _step(b, *, graph, plan, attn, q, out, k_cache, v_cache, device: str, dry_run: bool):
    """Plan ``b``, then capture (first step) or replay (dry run: run eagerly), then check against the fp64
    reference: ``(graph, row)``. NaN in q's padding rows and in out must not reach a valid row."""
    import torch

    import prefixattn
    from tests.tolerances import ATTENTION_TOL

    n = int(b.qo_indptr[-1])
    q.fill_(float("nan"))
    q[:n].copy_(b.q)
    out.fill_(float("nan"))
    allocated = torch.cuda.memory_allocated() if graph is not None else 0
    p = plan(b)
    if dry_run:
        attn.run(q, k_cache, v_cache, out=out)
    elif graph is None:  # the first step: compile on a side stream, then capture once
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            attn.run(q, k_cache, v_cache, out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn.run(q, k_cache, v_cache, out=out)
        out.fill_(float("nan"))
        allocated = torch.cuda.memory_allocated()
        graph.replay()
    else:
        graph.replay()
    if not dry_run:
        torch.cuda.synchronize()
    grew = torch.cuda.memory_allocated() - allocated if graph is not None else 0
    want = prefixattn.reference_attention(b.q.to(device), k_cache, v_cache, *(t.to(device) for t in b.metadata),
                                          compute_dtype=torch.float64)
    atol, rtol = ATTENTION_TOL[q.dtype]
    err = (out[:n].double() - want).abs()
    ok = bool(torch.isfinite(out[:n]).all() and (err <= atol + rtol * want.abs()).all()) and grew == 0
    return graph, dict(passed=ok, max_abs_err=float(err.max()), device_bytes_allocated=grew, tokens=n,
                       items=p.num_items, grid_items=p.stats["grid_items"], shared_nodes=len(p.shared_nodes))


def _time_graph(graph, attn, q, k_cache, v_cache, out, last, plan, results) -> None:
    """Replay vs eager ``run()`` (CUDA events, median of TIMED_REPLAYS) and ``plan()``'s host time."""
    import torch

    def median_us(fn) -> float:
        times = []
        for _ in range(TIMED_REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    name, b = last
    replay = median_us(graph.replay)
    eager = median_us(lambda: attn.run(q, k_cache, v_cache, out=out))
    host = []
    for _ in range(TIMED_PLANS):
        t0 = time.perf_counter()
        plan(b)
        host.append((time.perf_counter() - t0) * 1e6)
    plan_us = statistics.median(host)
    print(f"[graphs] {name}: replay {replay:.1f} us, eager run() {eager:.1f} us, plan() {plan_us:.1f} us on the host "
          f"(table write + plan)", flush=True)
    for metric, value in (("replay_us", replay), ("eager_run_us", eager), ("plan_host_us", plan_us)):
        results.add("gpu_check_graphs", "prefixattn-graph", name, metric, value, "us")
