"""The GPU check's CUDA-graph step (driver: driver.py): one ``use_cuda_graph=True``
:class:`prefixattn.PrefixSharedAttention` in the engines' pattern (capacities, the engine's persistent device block
table read in place, ``graph_num_tokens``), its ``run()`` captured once on the first batch, then re-planned and
replayed for four other batches (other sizes and sharing shapes) and the first batch's requests again, each against
the fp64 reference.

What only a GPU shows, and this step records: that the captured launch replays correctly after every later plan
(``passed``), that ``plan()`` and the replay make no device allocation (``device_allocations``: the caching
allocator's allocation count around each, so an allocation freed again is counted too), the replay's time against an
eager ``run()`` (the launch overhead the graph removes), ``plan()``'s host time on the GPU machine, and whether the
wrapper's and the free ``plan()`` wait for GPU work queued before them (``waits_for_stream``: they should not). The
dry run (CPU, interpreter) runs the same steps with an eager ``run()`` in place of the capture and the replays.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import host_reference
from gpu_check.clock import Clock, failure

#: Graph-step batches: (name, requests, sharing levels, decode fraction) planned in this order on one wrapper; the
#: first is the one captured. Decode-shaped like an engine's graph steps, plus one mixed batch (the graph's decode
#: tiles are only a worse fit there, never wrong) and the first batch's requests again, on their own blocks.
GRAPH_BATCHES = (("decode-shared", 24, 1, 1.0), ("decode-2-levels", 40, 2, 1.0), ("decode-unshared", 16, 0, 1.0),
                 ("mixed", 12, 1, 0.5), ("decode-shared-again", 24, 1, 1.0))
#: Replays (and eager runs) per timing: the median of this many CUDA-event windows.
TIMED_REPLAYS = 30
#: Host plan() calls timed on the GPU machine (the step's last batch).
TIMED_PLANS = 30


#: Functions listed per plan() profile, by their own time.
PROFILE_TOP = 15


def profile_lines(fn, *, runs: int, top: int = PROFILE_TOP) -> list[str]:
    """Where ``fn``'s host time goes: cProfile over ``runs`` calls, the ``top`` functions by their own time, one line
    each (``own us per call, calls per call, function``). Profiling inflates small functions; read it for shares."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(runs):
        fn()
    profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [f"{own / runs * 1e6:7.1f} us {calls / runs:5.1f}x {Path(file).name}:{line}({name})"
            for (file, line, name), (_, calls, own, _, _) in ranked]


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


class _Setup:
    """The wrapper, the static graph buffers and the engine-style persistent block table of the graph step."""

    def __init__(self, dry_run: bool, device: str):
        import torch

        import prefixattn

        self.device, self.dry_run = device, dry_run
        scale = 1 if dry_run else 8
        self.dtype = torch.float32 if dry_run else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
        heads = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16) if dry_run else \
            dict(num_qo_heads=32, num_kv_heads=4, head_dim=128, block_size=16)
        self.heads = heads
        self.batches, k_cache, v_cache = _batches(scale, self.dtype, heads)
        self.k_cache, self.v_cache = k_cache.to(device), v_cache.to(device)
        self.rows = max(int(b.qo_indptr[-1]) for _, b in self.batches)  # the graph's size: steps are padded to it
        requests = max(b.kv_lens.shape[0] for _, b in self.batches)
        self.attn = prefixattn.PrefixSharedAttention(**heads, q_dtype=self.dtype, device=device, max_tokens=self.rows,
                                                     max_requests=requests, max_blocks_per_request=0,
                                                     use_cuda_graph=True)
        # The engine's persistent block table: written before each step, read in place by the captured launch.
        self.table = torch.zeros((requests, max(b.block_table.shape[1] for _, b in self.batches)),
                                 dtype=torch.int32, device=device)
        self.q = torch.empty((self.rows, heads["num_qo_heads"], heads["head_dim"]), dtype=self.dtype, device=device)
        self.out = torch.empty_like(self.q)
        self.graph = None

    def write_table(self, b) -> None:
        """The batch's ids as whole rows of the persistent table (one contiguous host-to-device copy, no temporary
        device buffer), as an engine writes its table before a step."""
        import torch

        rows = torch.zeros((b.kv_lens.shape[0], self.table.shape[1]), dtype=torch.int32)
        rows[:, :b.block_table.shape[1]] = b.block_table
        self.table[:rows.shape[0]].copy_(rows)

    def plan(self, b):
        return self.attn.plan(*b.metadata, device_block_table=self.table[:b.kv_lens.shape[0]],
                              graph_num_tokens=self.rows)

    def free_plan(self, b):
        """The free ``prefixattn.plan()`` of ``b`` onto the device: new tables, as a library user plans."""
        import prefixattn

        return prefixattn.plan(*b.metadata, **self.heads, q_dtype=self.dtype, device=self.device)


def _allocations() -> int:
    """Device allocations the caching allocator made so far in this process (0 on the CPU)."""
    import torch

    return torch.cuda.memory_stats().get("allocation.all.allocated", 0) if torch.cuda.is_available() else 0


def step_graphs(args, results, skips, device: str) -> None:
    """Capture once, re-plan and replay every batch (dry run: an eager run each), check, time; rows
    ``gpu_check_graphs``. A failure is a failed row with its reason; what it leaves undone is skipped with it."""
    clock = Clock("graphs", skips)
    try:
        s = _Setup(args.dry_run, device)
    except Exception as exc:
        print(f"[graphs] FAIL setup: {failure(exc)}", flush=True)
        results.add("gpu_check_graphs", "prefixattn-graph", "setup", "passed", 0.0, "bool")
        return
    for i, (name, b) in enumerate(s.batches):
        if clock.expired([n for n, _ in s.batches[i:]]):
            return
        start = time.monotonic()
        try:
            r = _step(s, b)
        except Exception as exc:  # a failed capture or replay: the later replays and timings cannot run
            print(f"[graphs] FAIL {name:22s} {failure(exc)}", flush=True)
            results.add("gpu_check_graphs", "prefixattn-graph", name, "passed", 0.0, "bool")
            clock.skip(f"after the failure of {name}: not run: {[n for n, _ in s.batches[i + 1:]] or '-'} and the "
                       f"timings")
            return
        print(f"[graphs] {'ok  ' if r['passed'] else 'FAIL'} {name:22s} tokens={r['tokens']} "
              f"requests={b.kv_lens.shape[0]} items={r['items']}/{r['grid_items']} shared_nodes={r['shared_nodes']} "
              f"err={r['max_abs_err']:.2e} device_allocations={r['device_allocations']}"
              f"{' (eager run: dry run, no capture)' if args.dry_run else ''} ({time.monotonic() - start:.1f} s)",
              flush=True)
        for metric, unit in (("passed", "bool"), ("max_abs_err", "abs"), ("device_allocations", "count")):
            results.add("gpu_check_graphs", "prefixattn-graph", name, metric, float(r[metric]), unit)
    if args.dry_run:
        clock.skip("dry run: no CUDA graph capture or replay on CPU (each step ran run() eagerly instead)")
        return
    try:
        _time_graph(s, results)
    except Exception as exc:  # timings are reports: say why they are missing, keep the run going
        clock.skip(f"timing failed: {failure(exc)}")


def _step(s: _Setup, b) -> dict:
    """Plan ``b``, then capture (first step) or replay (dry run: run eagerly), then check against the fp64
    reference. NaN in q's padding rows and in out must not reach a valid row; device allocations are counted around
    ``plan()`` and around the replay (not the capture, whose graph pool allocates by design)."""
    import torch

    import prefixattn
    from tests.tolerances import ATTENTION_TOL

    n = int(b.qo_indptr[-1])
    s.q.fill_(float("nan"))
    s.q[:n].copy_(b.q)
    s.out.fill_(float("nan"))
    s.write_table(b)
    before = _allocations()
    p = s.plan(b)
    allocations = _allocations() - before
    if s.dry_run:
        s.attn.run(s.q, s.k_cache, s.v_cache, out=s.out)
    else:
        if s.graph is None:  # the first step: compile on a side stream, then capture once
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                s.attn.run(s.q, s.k_cache, s.v_cache, out=s.out)
            torch.cuda.current_stream().wait_stream(side)
            s.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(s.graph):
                s.attn.run(s.q, s.k_cache, s.v_cache, out=s.out)
            s.out.fill_(float("nan"))
        before = _allocations()
        s.graph.replay()
        torch.cuda.synchronize()
        allocations += _allocations() - before
    want = prefixattn.reference_attention(b.q.to(s.device), s.k_cache, s.v_cache,
                                          *(t.to(s.device) for t in b.metadata), compute_dtype=torch.float64)
    atol, rtol = ATTENTION_TOL[s.dtype]
    err = (s.out[:n].double() - want).abs()
    ok = bool(torch.isfinite(s.out[:n]).all() and (err <= atol + rtol * want.abs()).all()) and allocations == 0
    return dict(passed=ok, max_abs_err=float(err.max()), device_allocations=allocations, tokens=n,
                items=p.num_items, grid_items=p.stats["grid_items"], shared_nodes=len(p.shared_nodes))


def _time_graph(s: _Setup, results) -> None:
    """Replay vs eager ``run()`` (CUDA events, median of TIMED_REPLAYS) and ``plan()``'s host time alone (the table
    written once before)."""
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

    name, b = s.batches[-1]
    replay = median_us(s.graph.replay)
    eager = median_us(lambda: s.attn.run(s.q, s.k_cache, s.v_cache, out=s.out))
    host = []
    for _ in range(TIMED_PLANS):
        t0 = time.perf_counter()
        s.plan(b)
        host.append((time.perf_counter() - t0) * 1e6)
    plan_us = statistics.median(host)
    for line in profile_lines(lambda: s.plan(b), runs=TIMED_PLANS):
        print(f"[graphs] plan() profile: {line}", flush=True)
    # Which planner planned (numba is optional, and a failed compile falls back to numpy): the host time depends on it.
    from prefixattn.planner.backend import planner_name

    compiled = planner_name() == "numba"
    print(f"[graphs] {name}: replay {replay:.1f} us, eager run() {eager:.1f} us, plan() {plan_us:.1f} us on the host "
          f"({'compiled' if compiled else 'numpy'} planner)", flush=True)
    for metric, value in (("replay_us", replay), ("eager_run_us", eager), ("plan_host_us", plan_us)):
        results.add("gpu_check_graphs", "prefixattn-graph", name, metric, value, "us")
    # This host's speed beside its plan time: the first GPU host's plan() of these 24 requests took 115-220 us, the
    # 2-core CPU host's of 256 requests 56-80 us.
    host_reference.record(results, "gpu_check_graphs")
    results.add("gpu_check_graphs", "prefixattn-graph", name, "compiled_planner", float(compiled), "bool")
    for api, plan in (("wrapper", lambda: s.plan(b)), ("free", lambda: s.free_plan(b))):
        waited = plan_waits_for_stream(plan)
        print(f"[graphs] {api} plan() behind queued GPU work: {'WAITED for it' if waited else 'did not wait'}",
              flush=True)
        results.add("gpu_check_graphs", f"prefixattn-{api}-plan", name, "waits_for_stream", float(waited), "bool")


#: GPU clock cycles the spin kernel queued before a plan() runs: ~6 ms at the H100's ~1.7 GHz, 30x the slowest
#: plan() the GPU host has shown (220 us).
SPIN_CYCLES = 10_000_000


def plan_waits_for_stream(plan) -> bool:
    """Whether ``plan()`` waits for the work queued on the current stream (a copy from pageable memory does: the
    host then cannot plan the next step while the GPU runs this one): a spin kernel is queued, and the stream must
    still be busy when ``plan()`` returns. One plan first, unobserved: a first allocation of a size may call
    ``cudaMalloc``/``cudaHostAlloc``, which synchronize, where an engine's later steps reuse the cached blocks."""
    import torch

    plan()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    plan()
    waited = torch.cuda.current_stream().query()  # True: nothing left running, so plan() waited for the spin
    torch.cuda.synchronize()
    return bool(waited)
