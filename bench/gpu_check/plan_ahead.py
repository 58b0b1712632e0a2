"""Planning ahead (GPU check step ``plan_ahead``): engines with async scheduling plan step N+1 on the host while
step N's table copy and kernel are still queued on the GPU. Here a spin kernel holds the stream; step N is planned
and launched behind it, then step N+1 is planned and launched while N is still queued (recorded: ``queued``, the
stream was busy when N+1's plan returned), and both outputs are checked against the fp64 reference: a plan that
reuses host staging memory a queued copy has not read yet would corrupt step N. Through the free ``plan()`` and
through a ``PrefixSharedAttention`` with capacities (one workspace for every step, its two pinned staging buffers in
turn). After each phase (plan N, launch N, plan N+1, launch N+1) the stream is asked whether it still holds the spin:
the first phase that finds it idle is the one that waited for the GPU. The overlap is the GPU time still queued when
step N+1 had been planned and launched. The dry run (CPU) runs the same sequence without a queue.
"""

from __future__ import annotations

#: Spin before step N: ~6 ms at ~1.7 GHz, far longer than two plans (the slowest plan() seen on a GPU host: 220 us).
SPIN_CYCLES = 10_000_000
APIS = ("free", "wrapper")
BENCHMARK = "gpu_check_plan_ahead"


def _check(out, b, k, v, device) -> tuple[bool, float]:
    import torch

    import prefixattn
    from tests.tolerances import ATTENTION_TOL

    n = int(b.qo_indptr[-1])
    want = prefixattn.reference_attention(b.q.to(device), k, v, *(t.to(device) for t in b.metadata),
                                          compute_dtype=torch.float64)
    atol, rtol = ATTENTION_TOL[b.q.dtype]
    err = (out[:n].double() - want).abs()
    return bool(torch.isfinite(out[:n]).all() and (err <= atol + rtol * want.abs()).all()), float(err.max())


#: The phases of the two steps, in order; after each the stream is asked whether the spin still holds it.
PHASES = ("plan N", "launch N", "plan N+1", "launch N+1")


def run(api: str, dry_run: bool, device: str) -> dict:
    """Steps N and N+1 through ``api`` behind a spin kernel: ``{"passed", "queued", "busy_after", "host_us",
    "overlap_us", "err_n", "err_n1"}``. ``busy_after[phase]``: the stream still held queued work when that phase
    returned (the first phase that found it idle is the one that waited); ``host_us``: host time of step N+1's plan
    and launch; ``overlap_us``: GPU time still queued when step N+1 had been planned and launched (what planning
    ahead hid)."""
    import time

    import torch

    import prefixattn
    from gpu_check.graphs import _batches

    dtype = torch.float32 if dry_run else torch.bfloat16
    heads = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16) if dry_run else \
        dict(num_qo_heads=32, num_kv_heads=4, head_dim=128, block_size=16)
    batches, k, v = _batches(1 if dry_run else 8, dtype, heads)
    (_, b0), (_, b1) = batches[0], batches[1]
    k, v = k.to(device), v.to(device)
    # On the device before the spin: a copy from pageable host memory waits for the stream, so a q copied inside a
    # step waited for the spin to end (the H200 run at 74e5177 saw nothing queued).
    qs = {id(b): b.q.to(device) for b in (b0, b1)}
    if api == "wrapper":
        attn = prefixattn.PrefixSharedAttention(
            **heads, q_dtype=dtype, device=device, max_tokens=max(int(b.qo_indptr[-1]) for b in (b0, b1)),
            max_requests=max(b.kv_lens.shape[0] for b in (b0, b1)),
            max_blocks_per_request=max(b.block_table.shape[1] for b in (b0, b1)))

        def plan(b):
            attn.plan(*b.metadata)

        def launch(b, _):
            return attn.run(qs[id(b)], k, v)
    else:
        def plan(b):
            return prefixattn.plan(*b.metadata, **heads, q_dtype=dtype, device=device)

        def launch(b, p):
            return prefixattn.attention(qs[id(b)], k, v, p)

    for b in (b0, b1):  # unobserved: first allocations may synchronize, an engine's later steps reuse them
        launch(b, plan(b))
    gpu = not dry_run
    busy = lambda: bool(gpu and not torch.cuda.current_stream().query())  # noqa: E731
    if gpu:
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
    busy_after = {}
    p0 = plan(b0)
    busy_after[PHASES[0]] = busy()
    out0 = launch(b0, p0)
    busy_after[PHASES[1]] = busy()
    start = time.perf_counter()
    p1 = plan(b1)
    busy_after[PHASES[2]] = busy()
    out1 = launch(b1, p1)
    queued = busy_after[PHASES[3]] = busy()
    host_s = time.perf_counter() - start
    if gpu:
        torch.cuda.synchronize()
    overlap_s = time.perf_counter() - start - host_s if queued else 0.0
    ok0, e0 = _check(out0, b0, k, v, device)
    ok1, e1 = _check(out1, b1, k, v, device)
    return dict(passed=ok0 and ok1, queued=queued, busy_after=busy_after, host_us=host_s * 1e6,
                overlap_us=overlap_s * 1e6, err_n=e0, err_n1=e1)


def step_plan_ahead(args, results, skips, device: str) -> None:
    from gpu_check.clock import Clock, guarded

    clock = Clock("plan_ahead", skips)
    for api in APIS:
        if clock.expired([api]):
            return
        r = guarded(run, api, args.dry_run, device)[0]
        r.setdefault("queued", False)  # a failed run's row says it showed no queue
        waited = next((phase for phase, busy in r.get("busy_after", {}).items() if not busy), None)
        detail = r.get("error") or (
            f"err N {r['err_n']:.2e}, N+1 {r['err_n1']:.2e}; N+1 planned and launched in {r['host_us']:.0f} us "
            + ("(dry run: no queue)" if args.dry_run else
               f"while N was still queued, {r['overlap_us']:.0f} us of GPU work ahead of it" if r["queued"] else
               f"but N was NOT queued any more (no overlap shown; the stream was idle after '{waited}')"))
        print(f"[plan_ahead] {'ok  ' if r['passed'] else 'FAIL'} {api}: {detail}", flush=True)
        provider, shape = f"prefixattn-{api}-plan", "step N+1 planned behind step N"
        results.add(BENCHMARK, provider, shape, "passed", float(r["passed"]), "bool")
        results.add(BENCHMARK, provider, shape, "queued", float(r["queued"]), "bool")
        for phase, busy in r.get("busy_after", {}).items():
            results.add(BENCHMARK, provider, shape, f"queued_after_{phase.replace(' ', '_')}", float(busy), "bool")
        for metric in ("host_us", "overlap_us"):
            if metric in r:
                results.add(BENCHMARK, provider, shape, metric, r[metric], "us")
    if args.dry_run:
        clock.skip("dry run: no GPU queue (both steps ran and were checked, one after the other)")
