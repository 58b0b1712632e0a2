"""Modeled step times of every shape of the GPU check, next to the committed measurements (host only, no kernel):
the calibrated program-cost model (prefixattn.autotune.program_cost, fitted by bench/fit_program_cost.py) priced on
today's plans for an H100, the same model's held-out check on the plans the measured H100 commit ran, and the newest
GPU check's fair measurements (``HEADLINE_RUN`` of bench/render/performance.py).

Columns, per shape (microseconds; "modeled" everywhere it is not a measurement):

* ``measured``: prefixattn at the validation commit, a CUDA-graph replay on the H100 (its fused kernel);
* ``modeled then``: the model of that commit's plan (fit error: ``modeled then / measured - 1``; these measurements
  were not in the fit);
* ``modeled now``: today's plan (one launch per work class, the wave-aware split, the calibrated cost rule) and its
  ``sharing="never"`` plan;
* FlashInfer's cascade as measured eagerly then (L2 flushed, host launches inside the window: not the same
  conditions as the graph replays), and the measured floor;
* ``latest``: prefixattn in the newest GPU check (graph replay, L2 flushed), ``mod/latest`` the model's ratio to it
  (a held-out check of the H100 fit: the newest run may be another sm90 card, e.g. an H200, whose memory is faster),
  and FlashInfer's best configuration there under the same conditions.

Nothing here is asserted about speed: benchmarks report, tests assert.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import prefixattn
from batches.shapes import build_batch
from gpu_check.cases import timing_shapes
from prefixattn.autotune.lookup import planning_target
from prefixattn.autotune.program_cost import calibration
from render.performance import HEADLINE_RUN

BENCHMARK = "step_time_modeled"
RESULTS_GPU = Path(__file__).parent / "results" / "gpu"
NUM_SMS = 132


def _measured(validation: dict) -> dict:
    """``{shape label: {provider metric: value}}`` from the validation commit's GPU-check CSV."""
    return _run_rows(validation["source"].split(" ")[0].split("/")[-1])


def _run_rows(name: str) -> dict:
    """``{shape label: {provider metric: value}}`` of the attention timings in one GPU-check CSV."""
    out: dict = {}
    for r in csv.DictReader((RESULTS_GPU / name).open()):
        if r["benchmark"] == "attention_gpu_time":  # labels "<paper> [<shape name>]"
            out.setdefault(r["shape"], {})[f"{r['provider']}:{r['metric']}"] = float(r["value"])
    return out


def _label(s) -> str:
    return s.paper + ("" if s.num_qo_heads == s.num_kv_heads else f" h{s.num_qo_heads}:{s.num_kv_heads}")


def _plan(batch, s, sharing):
    with planning_target("sm90"):
        return prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, block_size=s.block_size,
                               num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                               q_dtype=torch.float16, num_blocks=batch.num_blocks, num_sms=NUM_SMS, sharing=sharing)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


@pytest.mark.slow
def test_step_time_modeled(results):
    cal = calibration("sm90")
    validation = cal["validation"]
    measured = _measured(validation)
    latest = _run_rows(HEADLINE_RUN + ".csv")
    with (RESULTS_GPU / (HEADLINE_RUN + ".csv")).open() as f:
        latest_device = next(csv.DictReader(f))["device"]
    graph_us = validation["graph_launch_us"]
    lines = [f"[{BENCHMARK}] sm90, 132 SMs; model fit {cal['rms_error_median']:.1%} median rms per binary, held-out "
             f"{validation['rms_error']:.1%} rms ({len(validation['shapes'])} shapes); all but 'measured', "
             f"'FI eager' and 'floor' modeled, each with the fitted graph-replay constant ({graph_us:.0f} us)",
             f"{'shape':34s} {'measured':>9s} {'mod.then':>9s} {'err':>6s} {'mod.now':>9s} {'now/then':>8s} "
             f"{'never':>8s} {'FI eager':>9s} {'floor':>8s} {'now/floor':>9s} {'latest':>8s} {'mod/latest':>10s} "
             f"{'FI best':>8s}   (latest: {HEADLINE_RUN})"]
    for s in timing_shapes(False):
        label = _label(s)
        batch = build_batch(s, metadata_only=True)
        now = _plan(batch, s, "auto").stats["modeled_step_us"] + graph_us
        never = _plan(batch, s, "never").stats["modeled_step_us"] + graph_us
        m = measured.get(f"{s.paper} [{s.name}]", {})
        then = validation["shapes"].get(label)
        floor = m.get("floor:floor_us")
        fi = m.get("flashinfer-cascade2:time_us_median")
        rows = (("prefixattn", "modeled_us", now), ("prefixattn-nosharing", "modeled_us", never),
                ("prefixattn-then", "measured_graph_us", then and then["measured_us"]),
                ("prefixattn-then", "modeled_us", then and then["modeled_us"]))
        for provider, metric, value in rows:
            if value is not None:
                results.add(BENCHMARK, provider, label, metric, value, "us", device="modeled-sm90")
        new = latest.get(f"{s.paper} [{s.name}]", {})
        ours_new, best_new = new.get("prefixattn:graph_flushed_us_median"), new.get(
            "flashinfer-best:graph_flushed_us_median")
        if ours_new is not None:
            results.add(BENCHMARK, "prefixattn-latest", label, "measured_graph_flushed_us", ours_new, "us",
                        device=latest_device)
        vs_new = f"{now / ours_new:.2f}x" if ours_new else "-"
        ratio = f"{now / then['measured_us']:.2f}x" if then else "-"
        error = f"{then['error']:+.0%}" if then else "-"
        over_floor = f"{now / floor:.2f}x" if floor else "-"
        lines.append(f"{label:34s} {_fmt(then and then['measured_us']):>9s} {_fmt(then and then['modeled_us']):>9s} "
                     f"{error:>6s} {_fmt(now):>9s} {ratio:>8s} {_fmt(never):>8s} {_fmt(fi):>9s} {_fmt(floor):>8s} "
                     f"{over_floor:>9s} {_fmt(ours_new):>8s} {vs_new:>10s} {_fmt(best_new):>8s}")
    print("\n" + "\n".join(lines))
