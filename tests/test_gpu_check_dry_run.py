"""scripts/gpu_check.sh --dry-run: every step of the GPU check at tiny sizes in the interpreter, so the script that
runs on the short-lived GPU machine cannot rot between GPU sessions."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_runs_every_step(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    [csv_path] = tmp_path.glob("cpu-interpreter-*.csv")
    rows = list(csv.DictReader(csv_path.open()))
    assert list(rows[0]) == ["benchmark", "provider", "shape", "device", "metric", "value", "unit", "commit",
                             "versions"], "the bench CSV schema (bench/conftest.py)"
    by = lambda bench, metric: [r for r in rows if r["benchmark"] == bench and r["metric"] == metric]  # noqa: E731
    passed = by("gpu_check_correctness", "passed")
    # Every scenario, dtype, head size, GQA group and page size of the matrix ran, and passed.
    names = " ".join(r["shape"] for r in passed)
    for part in ("decode/", "chunked_prefill/", "mixed/", "split_k/", "multi_level/", "float16", "bfloat16",
                 "float32", "/d64/", "/d128/", "/d256/", "gqa1", "gqa4", "gqa8", "page1", "page16"):
        assert part in names, part
    assert all(float(r["value"]) == 1.0 for r in passed + by("gpu_check_correctness", "bit_identical"))
    assert {r["provider"] for r in by("gpu_ceiling", "read_gbps") + by("gpu_ceiling", "attention_tflops")} == {
        "triton", "prefixattn"}
    # The sanitizer's eight kernel classes ran (and passed) in the interpreter; the tool itself needs a GPU.
    cases = by("gpu_check_sanitizer_cases", "passed")
    assert len(cases) == 8 and all(float(r["value"]) == 1.0 for r in cases)
    assert all(float(r["value"]) == 1.0 for r in by("gpu_check_plan_ahead", "passed")) and \
        len(by("gpu_check_plan_ahead", "passed")) == 2
    # Every timed provider has all three policies' min and median; both floors per shape.
    timed = {(r["provider"], r["shape"]) for r in by("attention_gpu_time", "graph_flushed_us_median")}
    assert {p for p, _ in timed} == {"prefixattn", "prefixattn-nosharing", "torch-sdpa"}
    assert len({s for _, s in timed}) == 2
    for metric in ("graph_warm_us_min", "eager_flushed_us_median", "over_floor_serial"):
        assert len(by("attention_gpu_time", metric)) == len(timed), metric
    assert len(by("attention_gpu_time", "floor_overlapped_us")) == len(by("attention_gpu_time", "floor_serial_us")) \
        == 2
    # The graph step planned every batch on one use_cuda_graph wrapper (run eagerly: no capture on CPU) and matched.
    graphs = by("gpu_check_graphs", "passed")
    assert len(graphs) == 5 and all(float(r["value"]) == 1.0 for r in graphs)
    assert "[graphs] SKIPPED: dry run: no CUDA graph capture" in out
    # The model step ran prefixattn with and without sharing on a decode and a mixed TokenBatcher step, checked.
    steps = {(r["provider"], r["shape"].split()[0]) for r in by("model_step", "step_us_median")}
    assert steps == {(p, k) for p in ("prefixattn", "prefixattn-nosharing") for k in ("decode", "mixed")}
    assert all(float(r["value"]) == 1.0 for r in by("model_step", "correct"))
    assert csv_path.with_name(csv_path.stem + "-model-steps.json").exists()
    # The CUDA-only steps are skipped with their reasons, not silently.
    assert "[sanitizer] SKIPPED: dry run: compute-sanitizer" in out
    assert "FlashInfer columns: dry run: FlashInfer's kernels are CUDA-only" in out
    md = csv_path.with_suffix(".md").read_text()
    assert f"{len(passed)}/{len(passed)} passed" in md and "DRY RUN" in md and "Where prefixattn loses" in md
    assert proc.stdout.rstrip().endswith("gpu check: all checks passed")


def test_tile_sweep_dry_run_times_every_candidate_on_every_shape(tmp_path):
    """bench/gpu_tile_sweep.py (the evidence behind configs/sm90.measured.json): both suites, tiny shapes in the
    interpreter; every (shape, candidate) row is checked against the reference, and each family gets a ranking."""
    for suite, per_shape in (("shared", 16), ("plain", 10)):
        proc = subprocess.run([sys.executable, "bench/gpu_tile_sweep.py", "--dry-run", "--suite", suite, "--out",
                               str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        [csv_path] = tmp_path.glob(f"cpu-interpreter-*-tiles{'' if suite == 'shared' else '-plain'}.csv")
        rows = list(csv.DictReader(csv_path.open()))
        shapes = {r["shape"] for r in rows}
        assert len(rows) == per_shape * len(shapes) and len({r["config"] for r in rows}) == per_shape
        assert all(r["correct"] == "1" and float(r["median_us"]) > 0 for r in rows), rows
        for family in {r["family"] for r in rows}:
            assert f"\n{family}: " in out
        csv_path.unlink()
