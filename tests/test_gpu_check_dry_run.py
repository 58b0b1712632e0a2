"""scripts/gpu_check.sh --dry-run: every step of the GPU check at tiny sizes in the interpreter, so the script that
runs on the short-lived GPU machine cannot rot between GPU sessions."""

from __future__ import annotations

import csv
import json
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
    # The matrix classes' Hopper build: no plan takes it in the interpreter (Gluon has none), so no case reran with it.
    assert {r["provider"] for r in passed} == {"prefixattn"}
    assert {r["provider"] for r in by("gpu_ceiling", "read_gbps") + by("gpu_ceiling", "attention_tflops")} == {
        "triton", "prefixattn", "flashinfer-prefill-fa2"}
    # The HBM floor is the best of the read kernel's sweep and the copy.
    [hbm] = by("gpu_ceiling", "hbm_gbps")
    assert float(hbm["value"]) == max(float(r["value"]) for r in by("gpu_ceiling", "read_gbps") +
                                      by("gpu_ceiling", "copy_gbps"))
    assert float(by("gpu_ceiling", "read_configs_tried")[0]["value"]) > 1
    # The class rates: prefixattn and the fa2 prefill on the dense and the shuffled paged shape; fa3 (sm90 only)
    # says why it did not run.
    rates = {(r["provider"], r["shape"].split()[0]) for r in by("class_rate", "attention_tflops")}
    assert rates == {(p, s) for p in ("prefixattn", "flashinfer-prefill-fa2") for s in ("dense", "paged")}
    assert [r["unit"] for r in by("class_rate", "not_run")] == [
        "reason: not planned: Unavailable: FlashInfer's fa3 backend runs on sm90 (Hopper) only",
        "reason: its correctness cases did not pass: dry run: the interpreter has no Gluon"] * 2
    assert "## Causal attention rates (DRY RUN)" in csv_path.with_suffix(".md").read_text()
    assert "## Decode programs with several KV heads (DRY RUN)" in csv_path.with_suffix(".md").read_text()
    # The sanitizer's nine kernel classes (MLA's among them) ran (and passed) in the interpreter; the tool itself
    # needs a GPU.
    cases = by("gpu_check_sanitizer_cases", "passed")
    assert len(cases) == 9 and all(float(r["value"]) == 1.0 for r in cases)
    ahead = by("gpu_check_plan_ahead", "passed")
    assert len(ahead) == 2 and all(float(r["value"]) == 1.0 for r in ahead)
    assert len(by("gpu_check_plan_ahead", "host_us")) == len(by("gpu_check_plan_ahead", "overlap_us")) == 2
    _check_timing(rows, by)
    # The graph step planned every batch on one use_cuda_graph wrapper (run eagerly: no capture on CPU) and matched.
    graphs = by("gpu_check_graphs", "passed")
    assert len(graphs) == 5 and all(float(r["value"]) == 1.0 for r in graphs)
    assert "[graphs] SKIPPED: dry run: no CUDA graph capture" in out
    _check_model_steps_and_batches(by, csv_path)
    # The MLA step: each provider on each shape, checked against the fp64 reference, beside the memory floor.
    mla = {(r["provider"], r["shape"]) for r in by("mla", "correct")}
    # The TyphoonMLA-style split and the naive form with its prefix kept run where a prefix is shared (one of the two
    # dry shapes); prefixattn's naive-form split on both (without a shared prefix its plan is the absorbed one).
    assert {p for p, _ in mla} == {"prefixattn", "prefixattn-nosharing", "flashinfer-mla", "typhoon-mla",
                                   "prefixattn-naive", "prefixattn-naive-kept"}
    assert len(mla) == 10
    for provider in ("typhoon-mla", "prefixattn-naive-kept"):
        assert [r["shape"] for r in by("mla", "not_run") if r["provider"] == provider] == ["mla-dry-h32-b3-s0-o40"]
    assert all(float(r["value"]) == 1.0 for r in by("mla", "correct"))
    assert len(by("mla", "floor_memory_us")) == 2 and "## MLA decode steps (DRY RUN)" in \
        csv_path.with_suffix(".md").read_text()
    # Its prefill contexts: the vLLM backend's path and vLLM's own way, both against the reference; the dry shape's
    # short questions are the path the backend's rule takes.
    context = by("mla_prefill", "correct")
    assert sorted(r["provider"] for r in context) == ["prefixattn-context", "vllm-context"]
    assert all(float(r["value"]) == 1.0 for r in context)
    assert [float(r["value"]) for r in by("mla_prefill", "rule_takes_this_path")] == [1.0]
    assert "## MLA prefill contexts (DRY RUN)" in csv_path.with_suffix(".md").read_text()
    # The CUDA-only steps are skipped with their reasons, not silently.
    assert "[sanitizer] SKIPPED: dry run: compute-sanitizer" in out
    assert "[hbm_bytes] SKIPPED: dry run: no DRAM counters on a CPU" in out
    md = csv_path.with_suffix(".md").read_text()
    assert f"{len(passed)}/{len(passed)} passed" in md and "DRY RUN" in md and "Where prefixattn loses" in md
    assert proc.stdout.rstrip().endswith("gpu check: all checks passed")


def _check_timing(rows, by) -> None:
    # Every timed provider has all three policies' min and median; both floors per shape. The FlashInfer peers run on
    # the stand-in (the cascade on fa2 among them); those a shape does not suit say why, in their not_run row.
    timed = {(r["provider"], r["shape"]) for r in by("attention_gpu_time", "graph_flushed_us_median")}
    providers = {p for p, _ in timed}
    assert {"prefixattn", "prefixattn-nosharing", "torch-sdpa", "flashinfer-cascade2", "flashinfer-cascade2-fa2",
            "flashinfer-prefill-fa2", "flashinfer-best"} <= providers
    shapes = {s for _, s in timed}
    assert len(shapes) == 2
    for metric in ("graph_warm_us_min", "eager_flushed_us_median"):
        assert len(by("attention_gpu_time", metric)) == len(timed), metric
    for metric in ("over_floor_serial", "unique_gbps", "under_hbm_floor"):
        assert len(by("attention_gpu_time", metric)) == len(timed) - len(shapes), metric  # not on flashinfer-best
    # The decode launch beside the compute launches, timed on the mixed step only; decode programs packing the
    # decode step's 2 KV heads, on the decode step only.
    assert [s for p, s in timed if p == "prefixattn-overlap"] == [s for s in shapes if "dry-run:mixed" in s]
    packed = [s for p, s in timed if p == "prefixattn-kv-heads"]
    assert packed == [s for s in shapes if "dry-run:decode" in s]
    assert [(r["shape"], float(r["value"])) for r in by("attention_gpu_time", "kv_heads")
            if r["provider"] == "prefixattn-kv-heads"] == [(packed[0], 2.0)]
    not_run = {(r["provider"], r["unit"]) for r in by("attention_gpu_time", "not_run")}
    assert ("flashinfer-prefill-fa3", "reason: FlashInfer's fa3 backend runs on sm90 (Hopper) only") in not_run
    # The matrix classes' Hopper build is timed only after its correctness cases passed, and Gluon has no interpreter.
    assert not [s for p, s in timed if p == "prefixattn-hopper"]
    assert {u for p, u in not_run if p == "prefixattn-hopper"} == {
        "reason: its correctness cases did not pass: dry run: the interpreter has no Gluon"}
    # So are the launches chained by PDL, which the interpreter does not chain.
    assert not [s for p, s in timed if p == "prefixattn-pdl"]
    assert {u for p, u in not_run if p == "prefixattn-pdl"} == {
        "reason: its correctness cases did not pass: no plan chains its launches by PDL here (sm_90 and newer, "
        "compiled kernels)"}
    for metric in ("floor_memory_us", "floor_compute_us", "floor_overlapped_us", "floor_serial_us",
                   "best_unique_gbps"):
        assert len(by("attention_gpu_time", metric)) == 2, metric
    # Each of prefixattn's work classes timed alone, their sum beside the whole.
    for provider in ("prefixattn", "prefixattn-nosharing"):
        classes = {r["metric"] for r in rows if r["provider"] == provider and r["metric"].startswith("class_")}
        assert "class_decode_us_median" in classes, provider
        assert len([r for r in by("attention_gpu_time", "classes_sum_us") if r["provider"] == provider]) == 2
        # Beside them, the plan's modeled times: the whole step on every shape, the decode class where it runs.
        modeled = [r["shape"] for r in by("attention_gpu_time", "modeled_step_us") if r["provider"] == provider]
        assert sorted(modeled) == sorted(s for p, s in timed if p == provider), provider
        assert "modeled_class_decode_us" in {r["metric"] for r in rows if r["provider"] == provider}, provider


def _check_model_steps_and_batches(by, csv_path) -> None:
    # The model step ran every workload's decode and mixed step for every provider, checked, with its bound, the
    # step's KV traffic against the L2, and prefixattn's classes timed alone on one layer.
    steps = {(r["provider"], r["shape"].split(" step")[0]) for r in by("model_step", "step_us_median")}
    workloads = ("docs-qa-8k", "batchllm-case1", "shared-prompt-4k")
    # prefixattn-overlap on the mixed steps only (each dry mixed step's plan overlaps).
    overlap = {("prefixattn-overlap", f"{w} mixed") for w in workloads}
    assert {(p, f"{w} {k}") for p in ("prefixattn", "prefixattn-nosharing", "flashinfer-best", "flashinfer-cascade2",
                                       "flashinfer-cascade2-fa2") for w in workloads for k in ("decode", "mixed")} \
        | overlap == steps
    assert all(float(r["value"]) == 1.0 for r in by("model_step", "correct"))
    assert len(by("model_step", "bound_us")) == len(by("model_step", "step_us_median"))
    assert len(by("model_step", "l2_reread_fraction")) == len(by("model_step", "attention_floor_us")) == 6
    assert {r["provider"] for r in by("model_step", "class_decode_layer_us")} == {"prefixattn", "prefixattn-nosharing"}
    assert {r["provider"] for r in by("model_step", "modeled_class_decode_us")} == {"prefixattn",
                                                                                    "prefixattn-nosharing"}
    # How together each prefixattn plan issues a group's prefix re-reads, per step.
    assert sorted(r["provider"] for r in by("model_step", "group_item_span")) == \
        ["prefixattn"] * 6 + ["prefixattn-nosharing"] * 6
    records = json.loads(csv_path.with_name(csv_path.stem + "-model-steps.json").read_text())
    assert {r["workload"] for r in records} == set(workloads)
    assert all(len(r["group_lens"]) == len(r["kv_lens"]) and r["l2_bytes"] > 0 for r in records)
    # Every workload's whole batch ran to completion under each policy, checked, with the kernel's and the
    # scheduler's shares.
    wall = {(r["provider"], r["shape"]) for r in by("whole_batch", "wall_s")}
    assert wall == {(p, w) for p in ("prefixattn", "prefixattn-scheduler+flashinfer", "arrival+flashinfer")
                    for w in workloads}
    assert all(float(r["value"]) == 1.0 for r in by("whole_batch", "correct"))
    assert len(by("whole_batch", "kernel_share")) == len(by("whole_batch", "scheduler_share")) == 3


def test_tile_sweep_dry_run_times_every_candidate_on_every_shape(tmp_path):
    """bench/gpu_check/tile_sweep.py (the evidence behind configs/sm90.measured.json): both suites, tiny shapes in the
    interpreter; every (shape, candidate) row is checked against the reference, and each family gets a ranking."""
    path = [str(ROOT / "bench"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))  # the gpu_check package, as scripts/gpu_check.sh sets it
    for suite, per_shape in (("shared", 16), ("plain", 13)):
        proc = subprocess.run([sys.executable, "-m", "gpu_check.tile_sweep", "--dry-run", "--suite", suite, "--out",
                               str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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
