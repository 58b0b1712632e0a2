"""GPU evidence in one call (``bash scripts/gpu_check.sh`` from the repository root; ``--dry-run`` on a CPU machine).

1. correctness: every kernel variant (decode, chunked prefill, mixed, split-k, multi-level sharing; MHA, GQA 4/8;
   head_dim 64/128/256; page 1/16; fp16/bf16/fp32) against the fp64 reference, NaN-poisoned outputs, 3 runs
   bit-identical;
2. compute-sanitizer racecheck and memcheck on a small split-k batch with many merge units;
3. the card's ceilings: device-to-device copy bandwidth, bf16 matmul rate;
4. CUDA graphs (bench/gpu_graph_check.py): a ``use_cuda_graph`` wrapper's ``run()`` captured once and replayed after
   re-planning batches of other sizes and sharing shapes, each against the fp64 reference, with no device allocation
   by ``plan()`` or the replay; replay vs eager time, ``plan()``'s host time;
5. timings (``triton.testing.do_bench`` medians, CUDA-graph replay where the plan allows) of prefixattn, prefixattn
   ``sharing="never"``, FlashInfer's ``MultiLevelCascadeAttentionWrapper`` (JIT-compiled in a background process
   started first) and torch SDPA on gathered KV, on the Fig. 8 shapes and part of FlashInfer's grid, each against
   its floor (unique KV bytes at the copy bandwidth, or FLOPs at the matmul rate);
6. ``bench/results/gpu/<gpu>-<commit>.csv`` (the bench CSV schema, bench/conftest.py) and ``.md`` next to it, then a
   short table.

Every step has a time budget (bench/gpu_check_steps.py); a step that runs out skips the rest with the reason. The
exit status is 1 when any correctness case, sanitizer run or timed provider's output check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROVIDERS = ("prefixattn", "prefixattn-nosharing", "flashinfer-cascade2", "torch-sdpa")
TIMING = "attention_gpu_time"  # the benchmark name bench/test_attention_gpu.py reports under


def _results_class():
    # bench/conftest.py holds the CSV schema and row format; loaded by path (tests/conftest.py has the same name).
    spec = importlib.util.spec_from_file_location("bench_conftest", BENCH / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Results


def _graph_ms(fn, provider: str, dry_run: bool):
    """CUDA-graph replay median (ms), or the reason there is none."""
    if dry_run:
        return None, "dry run: no CUDA graphs on CPU"
    if provider.startswith("flashinfer"):
        return None, "the cascade wrapper is planned without use_cuda_graph buffers (bench/peers/gpu.py)"
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"), ""
    except Exception as exc:  # capture can fail (host sync in a peer): report why, keep the eager time
        return None, f"capture failed: {type(exc).__name__}: {exc}"[:200]


def _time_provider(provider, batch, want, label, floor_s, args, results) -> float | None:
    """Check one provider's output against the reference, then time it; the median in us, or None."""
    import torch

    import gpu_check_steps as steps
    import peers.ours
    from peers.gpu import GPU_ONLY, Unavailable
    from tests.tolerances import ATTENTION_TOL

    try:
        prepared = (peers.ours.prepare(batch, provider) if provider.startswith("prefixattn")
                    else GPU_ONLY[provider](batch))
        out = prepared.run()
        if batch.q.is_cuda:
            torch.cuda.synchronize()
    except Unavailable as exc:
        print(f"[timing]   {provider:22s} skipped: {exc}", flush=True)
        return None
    except Exception as exc:  # one provider failing (OOM, a peer's error) does not end the step
        print(f"[timing]   {provider:22s} FAILED to run: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        results.add(TIMING, provider, label, "correct", 0.0, "bool")
        return None
    atol, rtol = ATTENTION_TOL[batch.q.dtype]
    err = (out.float() - want).abs()
    correct = bool(torch.isfinite(out.float()).all() and (err <= atol + rtol * want.abs()).all())
    results.add(TIMING, provider, label, "max_abs_err", float(err.max()), "abs")
    results.add(TIMING, provider, label, "correct", float(correct), "bool")
    if not correct:
        print(f"[timing]   {provider:22s} WRONG output (max abs err {float(err.max()):.2e}): not timed", flush=True)
        return None
    median, p20, p80 = steps._timer(prepared.run, args.dry_run)
    for metric, value in (("time_us_median", median), ("time_us_p20", p20), ("time_us_p80", p80)):
        results.add(TIMING, provider, label, metric, value * 1e3, "us")  # do_bench gives ms
    results.add(TIMING, provider, label, "time_over_floor", median * 1e-3 / floor_s, "x")
    results.add(TIMING, provider, label, "unique_kv_gbps", batch.unique_kv_bytes() / (median * 1e-3) / 1e9, "GB/s")
    graph, why = _graph_ms(prepared.run, provider, args.dry_run)
    if graph is not None:
        results.add(TIMING, provider, label, "time_us_cudagraph", graph * 1e3, "us")
    print(f"[timing]   {provider:22s} {median * 1e3:10.1f} us  {median * 1e-3 / floor_s:6.2f}x floor  "
          f"graph {'-' if graph is None else f'{graph * 1e3:.1f} us'}{'' if graph is not None else f' ({why})'}",
          flush=True)
    return median * 1e3


def step_timing(args, results, skips, device, ceil, fi_handle, table) -> None:
    import torch

    import gpu_cases
    import gpu_check_steps as steps
    from prefixattn import reference_attention
    from shapes import build_batch

    fi_reason = steps.flashinfer_status(fi_handle)
    clock = steps.Clock("timing", skips)
    if fi_reason:
        clock.skip(f"flashinfer-cascade2 column: {fi_reason}")
    shapes = gpu_cases.timing_shapes(args.dry_run)
    for i, shape in enumerate(shapes):
        if clock.expired([s.paper for s in shapes[i:]]):
            return
        label = f"{shape.paper} [{shape.name}]"
        try:
            batch = build_batch(shape, device=device)
            want = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr, batch.kv_lens,
                                       batch.block_table)
        except torch.cuda.OutOfMemoryError as exc:
            clock.skip(f"{label}: out of memory building the batch or its reference ({str(exc)[:120]})")
            continue
        floor_s, bound = gpu_cases.floor_seconds(batch, ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"])
        results.add(TIMING, "floor", label, "floor_us", floor_s * 1e6, "us")
        print(f"[timing] {label}: floor {floor_s * 1e6:.1f} us ({bound})", flush=True)
        row = dict(shape=shape.paper + ("" if shape.num_qo_heads == shape.num_kv_heads
                                        else f" h{shape.num_qo_heads}:{shape.num_kv_heads}"),
                   floor=floor_s * 1e6)
        for provider in PROVIDERS:
            if provider == "flashinfer-cascade2" and fi_reason:
                continue
            if clock.left() <= 0:
                break
            row[provider] = _time_provider(provider, batch, want, label, floor_s, args, results)
        table.append(row)
        del batch, want
        if device == "cuda":
            torch.cuda.empty_cache()


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 1e4 else f"{v:,.0f}")


def short_table(table) -> list[str]:
    lines = ["| shape | prefixattn us | never-share us | flashinfer us | sdpa us | floor us | ours/floor |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        ours = r.get("prefixattn")
        ratio = "-" if ours is None or not r["floor"] else f"{ours / r['floor']:.2f}x"
        lines.append(f"| {r['shape']} | {_fmt(ours)} | {_fmt(r.get('prefixattn-nosharing'))} | "
                     f"{_fmt(r.get('flashinfer-cascade2'))} | {_fmt(r.get('torch-sdpa'))} | {_fmt(r['floor'])} | "
                     f"{ratio} |")
    return lines


def device_slug(device: str) -> str:
    """The device's name as result files start with it: ``nvidia-h100-80gb-hbm3``, ``cpu-interpreter``."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def write_outputs(results, out_dir: Path, table, skips, seconds: float) -> tuple[Path, Path]:
    """The CSV (every row) and the summary markdown; rewritten after every step so a cut-off run keeps its rows."""
    csv_path = out_dir / f"{device_slug(results.device)}-{results.commit}.csv"
    results.write(csv_path)
    rows = results.rows
    corr = [r for r in rows if r["benchmark"] == "gpu_check_correctness" and r["metric"] == "passed"]
    failed = [r["shape"] for r in corr if float(r["value"]) != 1.0]
    lines = [f"# GPU check: {results.device}", "", f"commit {results.commit}; {results.versions}; "
             f"{seconds:.0f} s", "",
             f"- correctness: {len(corr) - len(failed)}/{len(corr)} cases passed (fp64 reference, NaN-poisoned "
             f"outputs, 3 runs bit-identical)" + (f"; FAILED: {', '.join(failed)}" if failed else "")]
    graphs = [r for r in rows if r["benchmark"] == "gpu_check_graphs" and r["metric"] == "passed"]
    if graphs:
        bad = [r["shape"] for r in graphs if float(r["value"]) != 1.0]
        how = ("eager runs of the graph wrapper, dry run: no capture" if results.device == "cpu-interpreter" else
               "one capture, then a replay after each plan, with no device allocation by plan() or the replay")
        lines.append(f"- CUDA graphs: {len(graphs) - len(bad)}/{len(graphs)} batches planned on one wrapper matched "
                     f"({how})" + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    for r in rows:
        if r["benchmark"] == "gpu_check_graphs" and r["unit"] == "us":
            lines.append(f"- {r['benchmark']}: {r['shape']} {r['metric']} = {float(r['value']):.1f} us")
        if r["benchmark"] in ("gpu_check_sanitizer", "gpu_ceiling"):
            lines.append(f"- {r['benchmark']}: {r['shape']} {r['metric']} = {float(r['value']):.4g} {r['unit']}")
    if skips:
        lines += ["", "## Skipped", ""] + [f"- {step}: {reason}" for step, reason in skips]
    kind = ("DRY RUN, CPU interpreter: one interpreted run's wall clock, not kernel times"
            if results.device == "cpu-interpreter" else "median of triton.testing.do_bench")
    lines += ["", f"## Timings ({kind})", ""] + short_table(table)
    md_path = csv_path.with_suffix(".md")
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _failed(results) -> list[str]:
    bad = []
    for r in results.rows:
        if r["metric"] in ("passed", "correct") and float(r["value"]) != 1.0:
            bad.append(f"{r['benchmark']}:{r['provider']}:{r['shape']}")
        if r["metric"].endswith(("_errors", "_exit_code")) and float(r["value"]) != 0.0:
            bad.append(f"{r['benchmark']}:{r['metric']}")
    return bad


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny sizes in the Triton interpreter (CPU)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/gpu; bench/results/dry-run "
                                                "with --dry-run)")
    ap.add_argument("--sanitize-case", action="store_true", help=argparse.SUPPRESS)  # child of compute-sanitizer
    ap.add_argument("--flashinfer-warmup", action="store_true", help=argparse.SUPPRESS)  # background JIT child
    args = ap.parse_args(argv)
    # Before anything imports triton: the interpreter is chosen when a kernel module is imported.
    os.environ["TRITON_INTERPRET"] = "1" if args.dry_run else "0"
    sys.path[1:1] = [str(ROOT)]  # prefixattn and tests.* from this checkout (bench/ is sys.path[0])
    import gpu_check_steps as steps
    from gpu_graph_check import step_graphs

    if args.sanitize_case:
        return steps.sanitize_case("cuda")
    if args.flashinfer_warmup:
        return steps.flashinfer_warmup()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu check: no CUDA device here; on a CPU machine run `bash scripts/gpu_check.sh --dry-run`",
              file=sys.stderr)
        return 2
    start = time.monotonic()
    steps.DEADLINE = start + steps.TOTAL_S
    device = "cpu" if args.dry_run else "cuda"
    fi_handle = steps.start_flashinfer_jit(args)
    results, skips, table = _results_class()(), [], []
    out_dir = Path(args.out) if args.out else BENCH / "results" / ("dry-run" if args.dry_run else "gpu")
    print(f"gpu check: {results.device}; {results.versions}; commit {results.commit}", flush=True)
    steps.step_correctness(args, results, skips, device)
    write_outputs(results, out_dir, table, skips, time.monotonic() - start)
    steps.step_sanitizer(args, results, skips)
    ceil = steps.step_ceilings(args, results, skips, device)
    step_graphs(args, results, skips, device)
    write_outputs(results, out_dir, table, skips, time.monotonic() - start)
    step_timing(args, results, skips, device, ceil, fi_handle, table)
    csv_path, md_path = write_outputs(results, out_dir, table, skips, time.monotonic() - start)
    bad = _failed(results)
    print(f"\ngpu check: {time.monotonic() - start:.0f} s; results {csv_path}; summary {md_path}")
    print(md_path.read_text())
    print(f"gpu check: {'FAILED: ' + ', '.join(bad) if bad else 'all checks passed'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
