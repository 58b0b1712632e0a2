"""The GPU check's steps (driver: bench/gpu_check.py): correctness against the fp64 reference, compute-sanitizer,
the card's ceilings, FlashInfer's JIT warm-up. Torch, Triton and prefixattn are imported inside the functions: the
driver sets ``TRITON_INTERPRET`` (``--dry-run``) before anything imports them. Public prefixattn API only.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

#: The driver: child processes (sanitized case, FlashInfer warm-up) run it with a flag.
DRIVER = Path(__file__).with_name("gpu_check.py")
#: Seconds per step on the GPU; the driver also clips every step to its overall deadline (bench/gpu_check.py).
BUDGET_S = {"correctness": 170, "sanitizer": 90, "ceilings": 15, "graphs": 45, "timing": 400}
#: Each compute-sanitizer tool's share of the sanitizer step (racecheck instruments shared memory: the slower one).
SANITIZER_TOOLS = {"racecheck": 0.55, "memcheck": 0.45}
#: FlashInfer JIT-compiles its cascade kernels in a background process started first; past this the timing step
#: runs without it and says why. The compile runs while the correctness and sanitizer steps use the GPU.
FLASHINFER_JIT_LIMIT_S = 270
REPEATS = 3  # runs of each correctness case whose outputs must be bit-identical
#: do_bench warm-up / measurement windows (ms): short, so ~50 shapes x 4 providers fit the timing budget.
BENCH_WARMUP_MS, BENCH_REP_MS = 10, 40
QUANTILES = (0.5, 0.2, 0.8)  # median, p20, p80


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
        self.seconds = max(0.0, min(BUDGET_S[step], DEADLINE - RESERVE_S - time.monotonic()))
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

    import gpu_cases
    import prefixattn
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
    import gpu_cases

    clock = Clock("correctness", skips)
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


def sanitize_case(device: str) -> int:
    """Run by compute-sanitizer in a child process: the sanitizer batch once, checked; exit status 0 when correct."""
    import gpu_cases

    r = check_case(gpu_cases.sanitizer_case(), gpu_cases.GPU_SCALE, device, seed=99)
    print(f"sanitize case: passed={r['passed']} items={r['work_items']} err={r['max_abs_err']:.2e}", flush=True)
    return 0 if r["passed"] else 1


def step_sanitizer(args, results, skips) -> None:
    clock = Clock("sanitizer", skips)
    if args.dry_run:
        return clock.skip("dry run: compute-sanitizer instruments CUDA kernels (no GPU here)")
    exe = _which("compute-sanitizer")
    if exe is None:
        return clock.skip("compute-sanitizer not found on PATH or in /usr/local/cuda/bin")
    for tool, share in SANITIZER_TOOLS.items():
        limit = max(1.0, min(clock.left(), clock.seconds * share))
        # Only the fused kernel is instrumented (kns = kernel-name substring): torch's own kernels are not ours.
        cmd = [exe, "--tool", tool, "--kernel-name", "kns=prefix_attention", "--print-limit", "20",
               sys.executable, str(DRIVER), "--sanitize-case"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired:
            clock.skip(f"{tool}: did not finish within {limit:.0f} s")
            continue
        summary = [ln for ln in text.splitlines() if "SUMMARY" in ln or "sanitize case" in ln]
        m = re.search(r"ERROR SUMMARY: (\d+) error", text) or re.search(r"(\d+) hazards? displayed", text)
        errors = int(m.group(1)) if m else -1  # -1: no summary line (the tool itself failed: see the output)
        print(f"[sanitizer] {tool}: exit {code}, errors={errors} ({time.monotonic() - start:.0f} s): "
              + " | ".join(summary), flush=True)
        if errors != 0 or code != 0:
            print("\n".join(text.splitlines()[-40:]), flush=True)
        results.add("gpu_check_sanitizer", "prefixattn", "split_k/bf16/d128/gqa8/page16", f"{tool}_errors", errors,
                    "count")
        results.add("gpu_check_sanitizer", "prefixattn", "split_k/bf16/d128/gqa8/page16", f"{tool}_exit_code", code,
                    "code")


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name) or next((str(p) for p in [Path("/usr/local/cuda/bin") / name] if p.exists()), None)


def _timer(fn, dry_run: bool):
    """(median, p20, p80) ms: ``triton.testing.do_bench`` on a GPU; one wall-clock run in the dry run."""
    if dry_run:
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return ms, ms, ms
    import triton.testing

    return triton.testing.do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, quantiles=list(QUANTILES))


def step_ceilings(args, results, skips, device: str) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second) and bf16 matmul rate (FLOP/s)."""
    import torch

    clock = Clock("ceilings", skips)
    # 1 GiB copies (far past the 50 MB L2) and 8192^3 bf16 matmuls; tiny in the dry run.
    nbytes, n = (1 << 20, 128) if args.dry_run else (1 << 30, 8192)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _timer(lambda: dst.copy_(src), args.dry_run)[0]
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    bm = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_ms = _timer(lambda: a @ bm, args.dry_run)[0]
    ceil = dict(copy_bytes_per_s=2 * nbytes / (copy_ms * 1e-3), matmul_flops_per_s=2 * n ** 3 / (mm_ms * 1e-3))
    print(f"[ceilings] copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s (read+write), bf16 matmul "
          f"{ceil['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({clock.seconds - clock.left():.1f} s)", flush=True)
    results.add("gpu_ceiling", "torch", f"copy {nbytes >> 20} MiB", "copy_gbps", ceil["copy_bytes_per_s"] / 1e9,
                "GB/s")
    results.add("gpu_ceiling", "torch", f"bf16 matmul {n}^3", "matmul_tflops", ceil["matmul_flops_per_s"] / 1e12,
                "TFLOP/s")
    return ceil


def start_flashinfer_jit(args):
    """Background process that JIT-compiles FlashInfer's cascade kernels (cached on disk for this process)."""
    if args.dry_run:
        return None
    cmd = [sys.executable, str(DRIVER), "--flashinfer-warmup"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), time.monotonic()


def flashinfer_warmup() -> int:
    """Child process: a small 2-level cascade at the timing shapes' dtype and head size (MHA and GQA), timed."""
    import torch

    from peers.gpu import prepare_flashinfer_cascade
    from shapes import Shape, build_batch

    start = time.monotonic()
    for kv_heads in (32, 8):
        shape = Shape(scenario="mixed", num_decode=4, num_prefill=1, shared=64, distinct=32, per_group=0,
                      num_qo_heads=32, num_kv_heads=kv_heads, head_dim=128, paper="flashinfer-warmup")
        prepare_flashinfer_cascade(build_batch(shape, device="cuda"), 2).run()
    torch.cuda.synchronize()
    print(json.dumps({"jit_seconds": time.monotonic() - start}), flush=True)
    return 0


def flashinfer_status(handle) -> str | None:
    """None when FlashInfer is ready (its JIT finished in time), else why it cannot run here."""
    if handle is None:
        return "dry run: FlashInfer's kernels are CUDA-only"
    proc, started = handle
    try:
        text, _ = proc.communicate(timeout=max(1.0, FLASHINFER_JIT_LIMIT_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        proc.kill()
        return f"its JIT compile did not finish within {FLASHINFER_JIT_LIMIT_S} s"
    lines = text.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return "its warm-up failed: " + " | ".join(lines[-6:])[-600:]
    print(f"[timing] FlashInfer JIT compile: {json.loads(lines[-1])['jit_seconds']:.0f} s", flush=True)
    return None

