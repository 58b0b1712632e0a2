"""The GPU check's common steps (driver: :mod:`gpu_check.driver`): the step clock, correctness against the fp64
reference, the card's ceilings. Torch, Triton and prefixattn are imported inside the functions: the driver sets
``TRITON_INTERPRET`` (``--dry-run``) before anything imports them. Public prefixattn API only.
"""

from __future__ import annotations

import time

#: The steps, in the order the driver runs them: by value, the mandatory evidence first (correctness; the ceilings
#: and floors; the timing shapes with the fa2 cascade and per-class times; the model steps), the prefixattn-only steps
#: before the timing so FlashInfer's JIT compiles meanwhile, then what a second call on the same machine may run
#: (``--steps``) when the first had no time left: Nsight Compute's HBM bytes and whole batches run to completion.
STEPS = ("correctness", "ceilings", "graphs", "eager_small", "plan_ahead", "sanitizer", "timing", "model_step",
         "hbm_bytes", "whole_batch")
#: Steps that need the ceilings (the HBM and attention rates their floors use) and the attention rate.
NEED_CEILINGS = frozenset({"ceilings", "timing", "model_step"})
NEED_ATTENTION_RATE = frozenset({"timing", "model_step"})
#: Seconds per step on the GPU, in the order the driver runs them. The driver clips every step to its overall
#: deadline too. H200 run at 74e5177 (345 s in all): correctness ~140 s (55 of it the first compile), ceilings 2 s,
#: graphs 5 s, sanitizer ~40 s, timing 106 s for 52 shapes (~2 s each with 11 providers), model step ~50 s for 4
#: steps. Estimated on top since: the read-kernel sweep (+~15 s: 5 compiles, 25 timed configs), the fa2 cascade and
#: the per-class graphs (+~1 s a shape), two more model-step workloads (+~50 s). What does not fit is skipped with
#: its reason, for a second call (``--steps``).
BUDGET_S = {"correctness": 170, "ceilings": 30, "graphs": 20, "eager_small": 15, "plan_ahead": 10, "sanitizer": 60,
            "timing": 170, "model_step": 110, "hbm_bytes": 90, "whole_batch": 120}
#: Seconds a step leaves for the steps after it that the run must still reach: the timing step stops in time for
#: the model step (its shapes are cut from the tail), whatever the FlashInfer JIT wait before it took.
KEEP_FOR_LATER_S = {"timing": BUDGET_S["model_step"]}
REPEATS = 3  # runs of each correctness case whose outputs must be bit-identical
#: Seconds the whole driver may run (scripts/gpu_check.sh has 540 s: ~25 s go to the wheel install and start-up) and
#: the part of it kept for writing the results.
TOTAL_S, RESERVE_S = 505, 10
#: Set by the driver at start: ``time.monotonic() + TOTAL_S``.
DEADLINE = float("inf")


class Clock:
    """One step's deadline: its own budget, clipped to the run's; ``expired(items)`` prints and records why the rest
    of the step is skipped."""

    def __init__(self, step: str, skips: list):
        self.step, self.skips = step, skips
        left = DEADLINE - RESERVE_S - KEEP_FOR_LATER_S.get(step, 0) - time.monotonic()
        self.seconds = max(0.0, min(BUDGET_S[step], left))
        self.deadline = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self, remaining: list) -> bool:
        if self.left() > 0:
            return False
        self.skip(f"budget of {self.seconds:.0f} s spent; not run: {len(remaining)} item(s), first "
                  f"{remaining[0] if remaining else '-'}")
        return True

    def skip(self, reason: str) -> None:
        print(f"[{self.step}] SKIPPED: {reason}", flush=True)
        self.skips.append((self.step, reason))


def _bits(t):
    import torch

    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_case(case, scale: int, device: str, seed: int) -> dict:
    """One correctness case: NaN-poisoned out and q padding, REPEATS runs bit-identical, fp64 reference."""
    import torch

    import prefixattn
    from gpu_check import cases as gpu_cases
    from tests.tolerances import ATTENTION_TOL, LSE_TOL

    b, options = gpu_cases.build_case(case, scale, seed)
    q, k, v = (t.to(device) for t in (b.q, b.k_cache, b.v_cache))
    meta = tuple(t.to(device) for t in b.metadata)
    p = prefixattn.plan(*meta, **b.heads, q_dtype=case.dtype, **options)
    n = p.num_tokens
    q = torch.cat([q, torch.full((gpu_cases.PAD_ROWS, *q.shape[1:]), float("nan"), dtype=q.dtype, device=device)])
    outs = []
    for _ in range(REPEATS):
        out = torch.full_like(q, float("nan"))
        got, lse = prefixattn.attention(q, k, v, p, out=out, return_lse=True)
        outs.append((got.clone(), lse.clone()))
    want, want_lse = prefixattn.reference_attention(q[:n], k, v, *meta, return_lse=True, compute_dtype=torch.float64)
    got, lse = outs[0]
    atol, rtol = ATTENTION_TOL[case.dtype]
    err = (got[:n].double() - want).abs()
    lse_err = (lse[:n].double() - want_lse).abs().nan_to_num(0.0)  # -inf == -inf rows (no visible KV) give NaN
    ok_out = bool(torch.isfinite(got[:n]).all() and (err <= atol + rtol * want.abs()).all())
    ok_lse = bool((lse_err <= LSE_TOL[0] + LSE_TOL[1] * want_lse.abs().nan_to_num(0.0)).all()
                  and torch.equal(torch.isinf(lse[:n]), torch.isinf(want_lse)))
    pad_ok = bool(torch.isnan(got[n:]).all())
    # Valid rows only: lse rows past num_tokens are never written (attention() allocates lse uninitialized).
    same = all(torch.equal(_bits(o[:n]), _bits(got[:n])) and torch.equal(_bits(s[:n]), _bits(lse[:n]))
               for o, s in outs[1:])
    return dict(passed=ok_out and ok_lse and pad_ok and same, max_abs_err=float(err.max()) if n else 0.0,
                lse_max_abs_err=float(lse_err.max()) if n else 0.0, padding_untouched=pad_ok, bit_identical=same,
                shared_nodes=len(p.shared_nodes), work_items=p.num_items, tokens=n)


def step_correctness(args, results, skips, device: str) -> None:
    from gpu_check import cases as gpu_cases
    from gpu_check import sanitizer as gpu_sanitize

    clock = Clock("correctness", skips)
    # The sanitizer's cases first: checked here, and compiled before the sanitized processes load them.
    gpu_sanitize.run_all(device, not args.dry_run, results, prefix="[correctness] sanitizer case")
    cases = gpu_cases.correctness_cases()
    scale = 1 if args.dry_run else gpu_cases.GPU_SCALE
    for i, case in enumerate(cases):
        if clock.expired([c.name for c in cases[i:]]):
            return
        start = time.monotonic()
        try:
            r = check_case(case, scale, device, seed=i)
        except Exception as exc:  # a crash is a failed case with its reason, not the end of the run
            r = dict(passed=False, error=f"{type(exc).__name__}: {exc}"[:300])
        seconds = time.monotonic() - start
        status = "ok  " if r["passed"] else "FAIL"
        detail = r.get("error") or (f"err={r['max_abs_err']:.2e} lse_err={r['lse_max_abs_err']:.2e} "
                                    f"bit_identical={r['bit_identical']} padding_untouched={r['padding_untouched']} "
                                    f"items={r['work_items']} shared_nodes={r['shared_nodes']}")
        print(f"[correctness] {status} {case.name:42s} {detail} ({seconds:.1f} s)", flush=True)
        for metric in ("passed", "bit_identical", "padding_untouched", "max_abs_err", "lse_max_abs_err"):
            if metric in r:
                results.add("gpu_check_correctness", "prefixattn", case.name, metric, float(r[metric]),
                            "bool" if metric in ("passed", "bit_identical", "padding_untouched") else "abs")


def step_ceilings(args, results, skips, device: str) -> dict:
    """The HBM floor's rate: the best of the read-only kernel's sweep and the device-to-device copy's bytes moved (read
    + written) per second, with the card's spec peak beside it; the L2 size; a bf16 matmul rate (for comparison: no
    floor)."""
    import torch

    from gpu_check.floors import read_sweep, spec_hbm_bytes_per_s
    from gpu_check.measure import Timer

    clock = Clock("ceilings", skips)
    timer = Timer(args.dry_run, device)
    # 1 GiB copies (far past the L2) and 8192^3 bf16 matmuls; tiny in the dry run.
    nbytes, n = (1 << 20, 128) if args.dry_run else (1 << 30, 8192)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = timer.repeat(lambda: dst.copy_(src), 3, flush=False)["median"]
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    bm = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_us = timer.repeat(lambda: a @ bm, 3, flush=False)["median"]
    read = read_sweep(timer, device)
    ceil = dict(copy_bytes_per_s=2 * nbytes / (copy_us * 1e-6), matmul_flops_per_s=2 * n ** 3 / (mm_us * 1e-6),
                read_bytes_per_s=read["bytes_per_s"])
    ceil["hbm_bytes_per_s"] = max(ceil["read_bytes_per_s"], ceil["copy_bytes_per_s"])
    ceil["l2_bytes"] = l2_bytes(device)
    spec = spec_hbm_bytes_per_s(results.device)
    lanes, unroll, warps, per_sm = read["config"]
    print(f"[ceilings] HBM floor {ceil['hbm_bytes_per_s'] / 1e9:.0f} GB/s (best of: read-only stream "
          f"{ceil['read_bytes_per_s'] / 1e9:.0f} GB/s, {read['tried']} configs, best {lanes} lanes x {unroll} loads, "
          f"{warps} warps, {per_sm} programs/SM; copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s read+write); spec "
          f"peak {'-' if spec is None else f'{spec / 1e9:.0f} GB/s'}; L2 {ceil['l2_bytes'] / 2**20:.0f} MiB; bf16 "
          f"matmul {ceil['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({clock.seconds - clock.left():.1f} s)", flush=True)
    results.add("gpu_ceiling", "triton", "read-only stream", "read_gbps", ceil["read_bytes_per_s"] / 1e9, "GB/s")
    results.add("gpu_ceiling", "triton", "read-only stream", "read_configs_tried", read["tried"], "count")
    results.add("gpu_ceiling", "torch", f"copy {nbytes >> 20} MiB", "copy_gbps", ceil["copy_bytes_per_s"] / 1e9,
                "GB/s")
    results.add("gpu_ceiling", "floor", "HBM (best of read-only and copy)", "hbm_gbps", ceil["hbm_bytes_per_s"] / 1e9,
                "GB/s")
    if spec is not None:
        results.add("gpu_ceiling", "spec", "HBM (datasheet)", "spec_gbps", spec / 1e9, "GB/s")
    results.add("gpu_ceiling", "device", "L2 cache", "l2_mib", ceil["l2_bytes"] / 2 ** 20, "MiB")
    results.add("gpu_ceiling", "torch", f"bf16 matmul {n}^3", "matmul_tflops", ceil["matmul_flops_per_s"] / 1e12,
                "TFLOP/s")
    return ceil


#: L2 bytes where the device does not say (the dry run's CPU): an H100's 50 MiB, so the dry run's rows are in range.
DEFAULT_L2_BYTES = 50 * 2 ** 20


def l2_bytes(device: str) -> int:
    """The device's L2 cache in bytes (``torch.cuda.get_device_properties().L2_cache_size``), else
    :data:`DEFAULT_L2_BYTES`."""
    import torch

    if device == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return DEFAULT_L2_BYTES


def attention_ceiling(args, results, device: str, ceil: dict, fi_ready: dict) -> None:
    """The attention compute rate (after FlashInfer's JIT, so its prefill can set it): the fastest correct causal
    prefill of floors.attention_rate_batch; adds ``attention_flops_per_s`` to ``ceil``."""
    from gpu_check.floors import attention_rates
    from gpu_check.measure import Timer

    ready = {p for p, ok in fi_ready.items() if ok is True}
    rates = attention_rates(Timer(args.dry_run, device), device, ready)
    for provider, rate in rates.items():
        results.add("gpu_ceiling", provider, "causal prefill (attention rate)", "attention_tflops", rate / 1e12,
                    "TFLOP/s")
    ceil["attention_flops_per_s"] = max(rates.values()) if rates else ceil["matmul_flops_per_s"]
    print(f"[ceilings] attention rate {ceil['attention_flops_per_s'] / 1e12:.1f} TFLOP/s ("
          + (", ".join(f"{p} {r / 1e12:.1f}" for p, r in rates.items()) if rates else
             "none measured: the bf16 matmul rate stands in, a lower compute floor") + ")", flush=True)
