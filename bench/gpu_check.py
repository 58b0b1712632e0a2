"""GPU evidence in one call (``bash scripts/gpu_check.sh`` from the repository root; ``--dry-run`` on a CPU machine).

Steps, in order of value, each with a time budget (bench/gpu_check_steps.py) that skips the rest of it with the
reason; FlashInfer's JIT compiles in a background process started first (bench/gpu_jit.py):

1. correctness: the sanitizer's cases (bench/gpu_sanitize.py) and every kernel variant (decode, chunked prefill,
   mixed, split-k, multi-level sharing; MHA, GQA 4/8; head_dim 64/128/256; page 1/16; fp16/bf16/fp32) against the
   fp64 reference, NaN-poisoned outputs, 3 runs bit-identical;
2. ceilings (bench/gpu_floors.py): read-only streaming bandwidth, copy bandwidth, bf16 matmul rate;
3. CUDA graphs (bench/gpu_graph_check.py): one ``use_cuda_graph`` wrapper captured once, replayed after re-planning;
   then the smallest decode steps run eagerly, layer after layer (bench/gpu_eager_small.py): the prepared direct
   launch against Triton's JIT dispatch;
4. plan ahead (bench/gpu_plan_ahead.py): step N+1 planned while step N is queued behind a spin kernel, both checked;
5. compute-sanitizer racecheck, memcheck and synccheck on one small batch of each kernel class (bench/gpu_sanitize.py);
6. timings (bench/gpu_timing.py): prefixattn, prefixattn ``sharing="never"``, every FlashInfer configuration and
   torch SDPA, graph-replayed and eager, L2 flushed and warm, 3 repetitions, against the read and attention-rate
   floors (the attention rate is measured first, with FlashInfer's prefill when its JIT is ready), SM clock and
   temperature per shape;
7. a Llama-3.1-8B-shaped model step (bench/model_step.py) on batches from prefixattn's TokenBatcher;
8. ``bench/results/gpu/<gpu>-<commit>.csv`` (the bench CSV schema, bench/conftest.py), ``.md`` (the fair tables of
   bench/gpu_report.py) and ``-model-steps.json`` (the measured steps the simulator is calibrated against).

The exit status is 1 when any correctness case, sanitizer run or prefixattn output check failed.
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


def _results_class():
    # bench/conftest.py holds the CSV schema and row format; loaded by path (tests/conftest.py has the same name).
    spec = importlib.util.spec_from_file_location("bench_conftest", BENCH / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Results


def device_slug(device: str) -> str:
    """The device's name as result files start with it: ``nvidia-h100-80gb-hbm3``, ``cpu-interpreter``."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def write_outputs(results, out_dir: Path, skips, seconds: float, steps_json: list | None = None) -> tuple[Path, Path]:
    """The CSV (every row), the summary markdown (bench/gpu_report.py) and the measured model steps; rewritten after
    every step so a cut-off run keeps its rows."""
    import json

    import gpu_report

    csv_path = out_dir / f"{device_slug(results.device)}-{results.commit}.csv"
    results.write(csv_path)
    if steps_json:
        csv_path.with_name(csv_path.stem + "-model-steps.json").write_text(json.dumps(steps_json))
    text = gpu_report.summary(results.rows, device=results.device, commit=results.commit,
                              versions=results.versions, seconds=seconds, skips=skips)
    md_path = csv_path.with_suffix(".md")
    md_path.write_text(text)
    return csv_path, md_path


def _failed(results) -> list[str]:
    bad = []
    for r in results.rows:
        if r["metric"] in ("passed", "correct", "graph_correct") and float(r["value"]) != 1.0:
            bad.append(f"{r['benchmark']}:{r['provider']}:{r['shape']}")
        if r["metric"].endswith(("_errors", "_exit_code")) and float(r["value"]) != 0.0:
            bad.append(f"{r['benchmark']}:{r['metric']}")
    return bad


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny sizes in the Triton interpreter (CPU)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/gpu; bench/results/dry-run "
                                                "with --dry-run)")
    ap.add_argument("--sanitize-cases", action="store_true", help=argparse.SUPPRESS)  # child of compute-sanitizer
    ap.add_argument("--flashinfer-warmup", action="store_true", help=argparse.SUPPRESS)  # background JIT child
    args = ap.parse_args(argv)
    # Before anything imports triton: the interpreter is chosen when a kernel module is imported.
    os.environ["TRITON_INTERPRET"] = "1" if args.dry_run else "0"
    sys.path[1:1] = [str(ROOT)]  # prefixattn and tests.* from this checkout (bench/ is sys.path[0])
    import gpu_jit
    import gpu_sanitize

    if args.sanitize_cases:
        return 0 if gpu_sanitize.run_all("cuda", True) else 1
    if args.flashinfer_warmup:
        return gpu_jit.warmup()
    from tests.memcheck import checked

    with checked():  # interpreted (dry-run) launches are bounds-checked as in the tests
        return _check(args)


def _check(args) -> int:
    import gpu_check_steps as steps
    import gpu_jit
    import gpu_sanitize
    import torch

    from gpu_eager_small import step_eager_small
    from gpu_graph_check import step_graphs
    from gpu_plan_ahead import step_plan_ahead
    from gpu_timing import step_timing
    from model_step import step_model

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu check: no CUDA device here; on a CPU machine run `bash scripts/gpu_check.sh --dry-run`",
              file=sys.stderr)
        return 2
    start = time.monotonic()
    steps.DEADLINE = start + steps.TOTAL_S
    device = "cpu" if args.dry_run else "cuda"
    fi_handle = gpu_jit.start(steps.DRIVER, args.dry_run)
    results, skips = _results_class()(), []
    out_dir = Path(args.out) if args.out else BENCH / "results" / ("dry-run" if args.dry_run else "gpu")
    print(f"gpu check: {results.device}; {results.versions}; commit {results.commit}", flush=True)
    write = lambda steps_json=None: write_outputs(results, out_dir, skips, time.monotonic() - start,  # noqa: E731
                                                  steps_json)
    steps.step_correctness(args, results, skips, device)
    write()
    ceil = steps.step_ceilings(args, results, skips, device)
    step_graphs(args, results, skips, device)
    step_eager_small(args, results, skips, device)
    step_plan_ahead(args, results, skips, device)
    write()
    gpu_sanitize.step_sanitizer(args, results, skips, steps.DRIVER, steps._which)
    write()
    fi_ready = gpu_jit.ready(fi_handle, start, results)
    steps.attention_ceiling(args, results, device, ceil, fi_ready)
    step_timing(args, results, skips, device, ceil, fi_ready)
    write()
    measured_steps = step_model(args, results, skips, device, fi_ready)
    csv_path, md_path = write(measured_steps)
    bad = _failed(results)
    print(f"\ngpu check: {time.monotonic() - start:.0f} s; results {csv_path}; summary {md_path}")
    print(md_path.read_text())
    print(f"gpu check: {'FAILED: ' + ', '.join(bad) if bad else 'all checks passed'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
