"""GPU evidence in one call (``bash scripts/gpu_check.sh`` from the repository root; ``--dry-run`` on a CPU machine).

Steps, in order of value, each with a time budget (:mod:`gpu_check.clock`) that skips the rest of it with the
reason; FlashInfer's JIT compiles in a background process started first (:mod:`gpu_check.flashinfer_jit`):

1. correctness (:mod:`gpu_check.correctness`): the sanitizer's cases (:mod:`gpu_check.sanitizer`) and every kernel
   variant (decode, chunked prefill, mixed, split-k, multi-level sharing; MHA, GQA 4/8; head_dim 64/128/256; page
   1/16; fp16/bf16/fp32) against the fp64 reference, NaN-poisoned outputs, 3 runs bit-identical;
2. ceilings (:mod:`gpu_check.floors`): the HBM floor's rate (the best of a read-only kernel's sweep and the copy), the
   card's spec peak and L2 size, a bf16 matmul rate;
3. CUDA graphs (:mod:`gpu_check.graphs`): one ``use_cuda_graph`` wrapper captured once, replayed after re-planning;
   then the smallest decode steps run eagerly, layer after layer (:mod:`gpu_check.eager_small`): the prepared direct
   launch against Triton's JIT dispatch;
4. plan ahead (:mod:`gpu_check.plan_ahead`): step N+1 planned while step N is queued behind a spin kernel, both
   checked, the overlap measured;
5. compute-sanitizer racecheck, memcheck and synccheck on one small batch of each kernel class
   (:mod:`gpu_check.sanitizer`);
6. timings (:mod:`gpu_check.timing`): prefixattn (and each of its work classes alone), prefixattn ``sharing="never"``,
   every FlashInfer configuration (both cascades, fa2 and FlashInfer's own) and torch SDPA, graph-replayed and
   eager, L2 flushed and warm, 3 repetitions, against the memory and attention-rate floors (the attention rate is
   measured first, with FlashInfer's prefill when its JIT is ready), the best rate of the floor's bytes, providers
   reading from L2 flagged, SM clock and temperature per shape;
7. Llama-3.1-8B-shaped model steps (:mod:`gpu_check.model_step`) on batches from prefixattn's TokenBatcher over
   three workloads (long documents, BatchLLM case 1, one long prompt), each with its bound;
8. class rates (:mod:`gpu_check.class_rates`): prefixattn's causal rate on a dense prefill and on prefill chunks over
   a shuffled paged cache, each beside FlashInfer's prefill on fa3 and fa2;
9. MLA (:mod:`gpu_check.mla`): DeepSeek-V3-shaped decode steps under shared prompts, prefixattn against
   FlashInfer's MLA wrapper, with the memory floor; then prefills over a cached prompt (:mod:`gpu_check.mla_prefill`);
10. HBM bytes (:mod:`gpu_check.hbm_bytes`): Nsight Compute's DRAM counters per kernel on a subset of the shapes;
11. whole batches to completion (:mod:`gpu_check.whole_batch`) under prefixattn's scheduler and an engine's default;
12. ``bench/results/gpu/<gpu>-<commit>.csv`` (the bench CSV schema, bench/conftest.py), ``.md`` (the tables of
   :mod:`render.gpu`) and ``-model-steps.json`` (the measured steps the simulator is calibrated against).

``--steps`` runs a subset (a second call on the same machine for what the first skipped for time) and ``--tag``
names its files apart (``<gpu>-<commit>-<tag>.csv``). The exit status is 1 when any correctness case, sanitizer run
or output check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
#: How child processes run the driver (the sanitized cases, FlashInfer's warm-up, the HBM-bytes child), a hidden flag
#: appended: they inherit the working directory and PYTHONPATH that found this package.
DRIVER = (sys.executable, "-m", "gpu_check")


def _results_class():
    # bench/conftest.py holds the CSV schema and row format; loaded by path (tests/conftest.py has the same name).
    spec = importlib.util.spec_from_file_location("bench_conftest", BENCH / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Results


def device_slug(device: str) -> str:
    """The device's name as result files start with it: ``nvidia-h100-80gb-hbm3``, ``cpu-interpreter``."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def write_outputs(results, out_dir: Path, skips, seconds: float, steps_json: list | None = None,
                  tag: str = "") -> tuple[Path, Path]:
    """The CSV (every row), the summary markdown (:func:`render.gpu.summary`) and the measured model steps; rewritten
    after every step so a cut-off run keeps its rows. ``tag``: appended to the names (``<gpu>-<commit>-<tag>.csv``)."""
    import json

    from render.gpu import summary

    csv_path = out_dir / f"{device_slug(results.device)}-{results.commit}{'-' + tag if tag else ''}.csv"
    results.write(csv_path)
    if steps_json:
        csv_path.with_name(csv_path.stem + "-model-steps.json").write_text(json.dumps(steps_json))
    text = summary(results.rows, device=results.device, commit=results.commit, versions=results.versions,
                   seconds=seconds, skips=skips)
    md_path = csv_path.with_suffix(".md")
    md_path.write_text(text)
    return csv_path, md_path


def which(name: str) -> str | None:
    """A CUDA tool (``compute-sanitizer``, ``ncu``) on PATH or in /usr/local/cuda/bin, else None."""
    import shutil

    return shutil.which(name) or next((str(p) for p in [Path("/usr/local/cuda/bin") / name] if p.exists()), None)


def _failed(results) -> list[str]:
    bad = []
    for r in results.rows:
        if r["metric"] in ("passed", "correct", "graph_correct") and float(r["value"]) != 1.0:
            bad.append(f"{r['benchmark']}:{r['provider']}:{r['shape']}")
        if r["metric"].endswith(("_errors", "_exit_code")) and float(r["value"]) != 0.0:
            bad.append(f"{r['benchmark']}:{r['metric']}")
    return bad


def _step_list(text: str | None) -> tuple:
    """``--steps``: comma-separated names of :data:`gpu_check.clock.STEPS`, run in that table's order."""
    from gpu_check.clock import STEPS

    if text is None:
        return STEPS
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in STEPS]
    if bad or not names:
        raise SystemExit(f"--steps: expected names from {', '.join(STEPS)}, got {text!r}")
    return tuple(n for n in STEPS if n in names)


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every step at tiny sizes in the Triton interpreter (CPU)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/gpu; bench/results/dry-run "
                                                "with --dry-run)")
    ap.add_argument("--steps", default=None, help="run only these steps (comma-separated, from: "
                                                  "correctness, ceilings, graphs, eager_small, plan_ahead, sanitizer, "
                                                  "timing, model_step, mla, hbm_bytes, whole_batch), e.g. a second "
                                                  "call on "
                                                  "the same machine for what the first skipped for time")
    ap.add_argument("--tag", default="", help="appended to the result files' names (a second call's files beside the "
                                              "first's: <gpu>-<commit>-<tag>.csv)")
    ap.add_argument("--sanitize-cases", action="store_true", help=argparse.SUPPRESS)  # child of compute-sanitizer
    ap.add_argument("--flashinfer-warmup", action="store_true", help=argparse.SUPPRESS)  # background JIT child
    ap.add_argument("--hbm-bytes-child", default=None, help=argparse.SUPPRESS)  # child of ncu (hbm_bytes.py)
    ap.add_argument("--hopper-cases", default=None, help=argparse.SUPPRESS)  # child of the correctness step
    args = ap.parse_args(argv)
    if args.tag and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", args.tag):
        raise SystemExit(f"--tag: expected lower-case letters, digits and dashes, got {args.tag!r}")
    args.steps = _step_list(args.steps)
    # Before anything imports triton: the interpreter is chosen when a kernel module is imported.
    os.environ["TRITON_INTERPRET"] = "1" if args.dry_run else "0"
    sys.path[1:1] = [str(ROOT)]  # prefixattn and tests.* from this checkout, wherever the caller started
    from gpu_check import flashinfer_jit, sanitizer

    if args.sanitize_cases:
        return 0 if sanitizer.run_all("cuda", True) else 1
    if args.flashinfer_warmup:
        return flashinfer_jit.warmup()
    if args.hopper_cases:
        from gpu_check import correctness

        return correctness.hopper_child(int(args.hopper_cases))
    if args.hbm_bytes_child:
        from gpu_check import hbm_bytes

        return hbm_bytes.child(args.hbm_bytes_child)
    from tests.memcheck import checked

    with checked():  # interpreted (dry-run) launches are bounds-checked as in the tests
        if args.dry_run:
            _fake_flashinfer()
        return _check(args)


def _fake_flashinfer() -> None:
    """The dry run's FlashInfer: the signature-faithful stand-in of the tests (tests/bench_support/fake_flashinfer.py),
    so the peers' code paths, "FlashInfer best" and the cascades run too; its numbers are the interpreter's."""
    from tests.bench_support import fake_flashinfer

    sys.modules["flashinfer"] = fake_flashinfer.module()


def _check(args) -> int:
    import torch

    from gpu_check import clock, flashinfer_jit, sanitizer
    from gpu_check.class_rates import step_class_rates
    from gpu_check.correctness import step_correctness
    from gpu_check.eager_small import step_eager_small
    from gpu_check.floors import attention_ceiling, step_ceilings
    from gpu_check.graphs import step_graphs
    from gpu_check.hbm_bytes import step_hbm_bytes
    from gpu_check.mla import step_mla
    from gpu_check.model_step import step_model
    from gpu_check.plan_ahead import step_plan_ahead
    from gpu_check.timing import step_timing
    from gpu_check.whole_batch import step_whole_batch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu check: no CUDA device here; on a CPU machine run `bash scripts/gpu_check.sh --dry-run`",
              file=sys.stderr)
        return 2
    start = time.monotonic()
    clock.DEADLINE = start + clock.TOTAL_S
    device = "cpu" if args.dry_run else "cuda"
    run = set(args.steps)
    needs_flashinfer = bool(run & {"timing", "model_step", "class_rates", "mla", "hbm_bytes", "whole_batch"})
    fi_handle = flashinfer_jit.start(DRIVER, args.dry_run) if needs_flashinfer else None
    results, skips = _results_class()(), []
    out_dir = Path(args.out) if args.out else BENCH / "results" / ("dry-run" if args.dry_run else "gpu")
    print(f"gpu check: {results.device}; {results.versions}; commit {results.commit}; steps {', '.join(args.steps)}",
          flush=True)
    write = lambda steps_json=None: write_outputs(results, out_dir, skips, time.monotonic() - start,  # noqa: E731
                                                  steps_json, tag=args.tag)
    if "correctness" in run:
        step_correctness(args, results, skips, device)
        write()
    ceil = step_ceilings(args, results, skips, device) if run & clock.NEED_CEILINGS else None
    if "graphs" in run:
        step_graphs(args, results, skips, device)
    if "eager_small" in run:
        step_eager_small(args, results, skips, device)
    if "plan_ahead" in run:
        step_plan_ahead(args, results, skips, device)
    write()
    if "sanitizer" in run:
        sanitizer.step_sanitizer(args, results, skips, DRIVER, which)
        write()
    measured_steps = None
    if needs_flashinfer:
        fi_ready = flashinfer_jit.ready(fi_handle, start, results, dry_run=args.dry_run)
        if run & clock.NEED_ATTENTION_RATE:
            attention_ceiling(args, results, device, ceil, fi_ready)
        if "timing" in run:
            step_timing(args, results, skips, device, ceil, fi_ready)
            write()
        if "model_step" in run:
            measured_steps = step_model(args, results, skips, device, fi_ready, ceil)
            write(measured_steps)
        if "class_rates" in run:
            step_class_rates(args, results, skips, device, fi_ready)
            write(measured_steps)
        if "mla" in run:
            step_mla(args, results, skips, device, fi_ready, ceil)
            write(measured_steps)
        if "hbm_bytes" in run:
            step_hbm_bytes(args, results, skips, DRIVER, which, fi_ready)
            write(measured_steps)
        if "whole_batch" in run:
            step_whole_batch(args, results, skips, device, fi_ready)
    csv_path, md_path = write(measured_steps)
    bad = _failed(results)
    print(f"\ngpu check: {time.monotonic() - start:.0f} s; results {csv_path}; summary {md_path}")
    print(md_path.read_text())
    print(f"gpu check: {'FAILED: ' + ', '.join(bad) if bad else 'all checks passed'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
