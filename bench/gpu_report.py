"""The GPU check's report: the summary markdown next to its CSV, and the README's performance section regenerated
from a CSV (``python bench/gpu_report.py bench/results/gpu/<gpu>-<commit>.csv [--steps ...-model-steps.json]``).

The fair columns: prefixattn against FlashInfer's best configuration for the shape, both graph-replayed with the L2
flushed (bench/gpu_measure.py says why that policy); each against both floors (bench/gpu_floors.py); warm-L2 and eager
times beside them; the model step's speedup over FlashInfer without sharing (what vLLM runs). Every shape or step
where prefixattn is slower is listed under "Where prefixattn loses". With ``--steps``, the simulator's calibration
(prefixattn/sim/fit.py) is appended.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

TIMING, MODEL = "attention_gpu_time", "model_step"
HEAD = "graph_flushed_us_median"


def _index(rows) -> dict:
    """{benchmark: {shape: {provider: {metric: float}}}} in first-seen shape order."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in rows:
        try:
            out[r["benchmark"]][r["shape"]][r["provider"]][r["metric"]] = float(r["value"])
        except ValueError:
            continue
    return out


def _f(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}" if abs(v) < 1e5 else f"{v:,.0f}"


def ratio_cell(a, b) -> str:
    """``a / b`` as a table cell (``-`` where either is missing or ``b`` is 0)."""
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def _best_name(per_provider: dict) -> str | None:
    return next((p for p, m in per_provider.items() if m.get("is_flashinfer_best") == 1.0), None)


def kernel_rows(rows) -> list[dict]:
    """Per timing shape: prefixattn's and FlashInfer best's numbers and floors (None where absent)."""
    out = []
    for shape, prov in _index(rows)[TIMING].items():
        ours, best, floor = prov.get("prefixattn", {}), prov.get("flashinfer-best", {}), prov.get("floor", {})
        out.append(dict(shape=shape.split(" [")[0], full=shape, ours=ours.get(HEAD), best=best.get(HEAD),
                        best_name=_best_name(prov), never=prov.get("prefixattn-nosharing", {}).get(HEAD),
                        cascade=prov.get("flashinfer-cascade2", {}).get(HEAD),
                        floor_o=floor.get("floor_overlapped_us"), floor_s=floor.get("floor_serial_us"),
                        ours_warm=ours.get("graph_warm_us_median"), best_warm=best.get("graph_warm_us_median"),
                        ours_eager=ours.get("eager_flushed_us_median"), best_eager=best.get("eager_flushed_us_median"),
                        sm_clock=prov.get("gpu-state", {}).get("sm_clock_mhz"),
                        temp=prov.get("gpu-state", {}).get("temperature_c")))
    return out


def kernel_table(rows) -> list[str]:
    lines = ["| shape | prefixattn us | FlashInfer best us (config) | prefixattn speedup | prefixattn over floor "
             "(overlapped / serial) | best over floor | warm L2 us (ours / best) | eager us (ours / best) | "
             "never-share us | cascade us | SM MHz, C |", "|" + "---|" * 11]
    for r in kernel_rows(rows):
        lines.append(
            f"| {r['shape']} | {_f(r['ours'])} | {_f(r['best'])} ({r['best_name'] or '-'}) | "
            f"{ratio_cell(r['best'], r['ours'])} | "
            f"{ratio_cell(r['ours'], r['floor_o'])} / {ratio_cell(r['ours'], r['floor_s'])} | "
            f"{ratio_cell(r['best'], r['floor_o'])} / {ratio_cell(r['best'], r['floor_s'])} | "
            f"{_f(r['ours_warm'])} / {_f(r['best_warm'])} | {_f(r['ours_eager'])} / {_f(r['best_eager'])} | "
            f"{_f(r['never'])} | {_f(r['cascade'])} | {_f(r['sm_clock'], 0)}, {_f(r['temp'], 0)} |")
    return lines


def model_rows(rows) -> list[dict]:
    out = []
    for shape, prov in _index(rows)[MODEL].items():
        get = lambda p, m: prov.get(p, {}).get(m)  # noqa: E731
        out.append(dict(step=shape, ours=get("prefixattn", "step_us_median"),
                        never=get("prefixattn-nosharing", "step_us_median"),
                        best=get("flashinfer-best", "step_us_median"), best_name=_best_name(prov),
                        cascade=get("flashinfer-cascade2", "step_us_median"),
                        share_ours=get("prefixattn", "attention_share"),
                        share_best=get("flashinfer-best", "attention_share"),
                        tok_ours=get("prefixattn", "tokens_per_s"), tok_best=get("flashinfer-best", "tokens_per_s"),
                        graph=get("prefixattn", "graph")))
    return out


def model_table(rows) -> list[str]:
    lines = ["| step | prefixattn ms | never-share ms | FlashInfer best, no sharing ms (config) | "
             "FlashInfer cascade ms | speedup vs best | attention share (ours / best) | tokens/s (ours / best) |",
             "|" + "---|" * 8]
    ms = lambda v: None if v is None else v / 1e3  # noqa: E731
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    for r in model_rows(rows):
        lines.append(f"| {r['step']}{' (graph)' if r['graph'] else ''} | {_f(ms(r['ours']), 2)} | "
                     f"{_f(ms(r['never']), 2)} | {_f(ms(r['best']), 2)} ({r['best_name'] or '-'}) | "
                     f"{_f(ms(r['cascade']), 2)} | {ratio_cell(r['best'], r['ours'])} | {pct(r['share_ours'])} / "
                     f"{pct(r['share_best'])} | {_f(r['tok_ours'], 0)} / {_f(r['tok_best'], 0)} |")
    return lines


def losses(rows) -> list[str]:
    """Every shape and model step where prefixattn is slower than FlashInfer's best (or has no number)."""
    out = []
    for r in kernel_rows(rows):
        if r["ours"] is None:
            out.append(f"- {r['shape']}: no graph-replayed prefixattn time")
        elif r["best"] is not None and r["ours"] > r["best"]:
            out.append(f"- {r['shape']}: prefixattn {_f(r['ours'])} us vs FlashInfer {r['best_name']} "
                       f"{_f(r['best'])} us ({r['ours'] / r['best']:.2f}x slower)")
    for r in model_rows(rows):
        if r["ours"] is not None and r["best"] is not None and r["ours"] > r["best"]:
            out.append(f"- model {r['step']}: prefixattn {r['ours'] / 1e3:.2f} ms vs FlashInfer {r['best_name']} "
                       f"{r['best'] / 1e3:.2f} ms ({r['ours'] / r['best']:.2f}x slower)")
    return out or ["- nowhere in this run"]


def checks(rows, device: str) -> list[str]:
    """The correctness, graph, plan-ahead and sanitizer lines of the summary."""
    by = lambda bench, metric: [r for r in rows if r["benchmark"] == bench and r["metric"] == metric]  # noqa: E731
    lines = []
    for bench, what in (("gpu_check_correctness", "correctness cases (fp64 reference, NaN-poisoned outputs, 3 runs "
                                                  "bit-identical)"),
                        ("gpu_check_sanitizer_cases", "sanitizer cases checked against the reference"),
                        ("gpu_check_graphs", "CUDA-graph wrapper batches"),
                        ("gpu_check_plan_ahead", "plan-ahead checks (step N+1 planned while N is queued)")):
        passed = by(bench, "passed")
        if passed:
            bad = [f"{r['provider']}:{r['shape']}" for r in passed if float(r["value"]) != 1.0]
            lines.append(f"- {what}: {len(passed) - len(bad)}/{len(passed)} passed"
                         + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    for r in rows:
        if r["benchmark"] in ("gpu_check_sanitizer", "gpu_ceiling", "gpu_check_plan_ahead", "flashinfer_jit") and \
                r["metric"] not in ("passed",):
            lines.append(f"- {r['benchmark']}: {r['provider']} {r['shape']} {r['metric']} = {float(r['value']):.4g} "
                         f"{r['unit']}")
    return lines


def summary(rows, *, device: str, commit: str, versions: str, seconds: float, skips) -> str:
    """The GPU check's .md: checks, skips, the fair kernel table, the model step, the losses."""
    dry = device == "cpu-interpreter"
    lines = [f"# GPU check: {device}", "", f"commit {commit}; {versions}; {seconds:.0f} s", ""] + checks(rows, device)
    if skips:
        lines += ["", "## Skipped", ""] + [f"- {step}: {reason}" for step, reason in skips]
    kind = ("DRY RUN, CPU interpreter: one interpreted run's wall clock stands for every statistic, not kernel "
            "times" if dry else "medians of 3 repetitions; CUDA-graph replay, L2 flushed before each run")
    lines += ["", f"## Attention kernels ({kind})", ""] + kernel_table(rows)
    lines += ["", f"## Model step ({'DRY RUN' if dry else 'Llama-3.1-8B shape, 32 layers'})", ""] + model_table(rows)
    lines += ["", "## Where prefixattn loses", ""] + losses(rows)
    lines += ["", "The simulator's calibration against these model steps (host only, minutes): "
              "`python bench/gpu_report.py <this .csv> --steps <its -model-steps.json>`."]
    return "\n".join(lines) + "\n"


def readme_section(rows, *, source: str, fit_markdown: str = "") -> str:
    """The README's performance section, from one GPU check CSV."""
    r0 = rows[0] if rows else {}
    dry = r0.get("device") == "cpu-interpreter"
    lines = [f"## Performance (measured on {r0.get('device', '?')}, commit {r0.get('commit', '?')}"
             f"{'; DRY RUN: not measurements' if dry else ''})", "",
             f"From `{source}` (`python bench/gpu_report.py` regenerates this section). Attention per call, "
             "CUDA-graph replayed for every provider, L2 flushed before each run, median of 3 repetitions; "
             "\"speedup\" is FlashInfer's best configuration for the shape over prefixattn (above 1: prefixattn is "
             "faster); floors: distinct KV + q + out at the read-only streaming rate, and the attention FLOPs at the "
             "measured causal-prefill rate (overlapped = max, serial = sum). The FlashInfer cascade was handed the "
             "prefix groups (oracle); prefixattn finds them.", ""]
    lines += kernel_table(rows)
    lines += ["", "Model step (Llama-3.1-8B shape, random weights, batches from prefixattn's TokenBatcher on a "
              "BatchLLM case-1-shaped workload; decode steps graph-replayed, mixed steps eager):", ""]
    lines += model_table(rows)
    lines += ["", "Where prefixattn loses:", ""] + losses(rows)
    if fit_markdown:
        lines += ["", fit_markdown]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_report.py", description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="a GPU check CSV (bench/results/gpu/<gpu>-<commit>.csv)")
    ap.add_argument("--steps", help="its -model-steps.json: append the simulator's calibration")
    ap.add_argument("--table1-requests", type=int, default=3000, help="Table 1's workload size with --steps")
    args = ap.parse_args(argv)
    rows = list(csv.DictReader(Path(args.csv).open()))
    fit_md = ""
    if args.steps:
        import json

        from prefixattn.sim import fit

        records = json.loads(Path(args.steps).read_text())
        if records:
            steps, hw, model = fit.load_steps(records)
            result = fit.fit(steps, hw, model)
            table = fit.table1(result.overrides, args.table1_requests) if args.table1_requests else None
            fit_md = fit.markdown(result, table, device=records[0]["device"])
    print(readme_section(rows, source=args.csv, fit_markdown=fit_md), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
