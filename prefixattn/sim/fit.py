"""The simulator's GPU cost model calibrated against measured model steps.

The GPU check's model step (bench/gpu_check/model_step.py) times real Llama-3.1-8B-shaped steps per attention provider
and writes them, with each step's shape, to ``<gpu>-<commit>-model-steps.json``. :func:`fit` chooses the efficiency
constants of :mod:`prefixattn.sim.calibration` (:data:`FIT_CONSTANTS`) that make :class:`CostModel` reproduce those
step times and their attention times (least squares on log ratios, bounded coordinate search), and reports the error
before and after. :func:`table1` re-runs BatchLLM Table 1 case 1 with the default and the fitted constants, beside
the paper's ratios. The constants are fractions of the spec-sheet peaks, so a fit on one GPU carries to another only
as an assumption (Table 1 is an A100 run); the report says so.

Command: ``python -m prefixattn.sim.fit STEPS.json [--table1-requests N]`` (markdown on stdout). Modeled numbers are
labelled modeled; measured ones name their device.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

import numpy as np

from prefixattn.sim.calibration import Calibration
from prefixattn.sim.presets import MODELS
from prefixattn.sim.step_cost import CostModel, SharedRun, StepShape

#: The constants fitted, each with its search bounds (fractions of peak; the Triton factor a multiplier).
FIT_CONSTANTS = {"gemm_efficiency": (0.2, 1.0), "hbm_efficiency": (0.2, 1.0),
                 "attn_decode_bw_efficiency": (0.1, 1.0), "attn_prefill_efficiency": (0.05, 1.0),
                 "triton_attention_factor": (0.2, 2.0)}
#: Coordinate-search sweeps and golden-section steps per constant per sweep (the objective is smooth and cheap).
SWEEPS, GOLDEN_STEPS = 6, 24
#: The GPU check's device names -> simulator presets.
DEVICE_PRESETS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("MI300X", "mi300x"))
#: Table 1 case 1's policies (BatchLLM's rows and this library's).
TABLE1_POLICIES = ("vllm-plain", "vllm-nocp", "vllm-nopc", "vllm", "batchllm", "prefixattn")


@dataclass
class MeasuredStep:
    """One measured step: its shape for the cost model, the kernel kind of its provider, seconds measured."""

    label: str
    shape: StepShape
    kernel: str
    split_k: bool
    step_s: float
    attention_s: float


def load_steps(records: list) -> tuple[list, str, str]:
    """(MeasuredStep list, hardware preset, model preset) from the GPU check's ``-model-steps.json`` records."""
    steps = []
    for r in records:
        shape = StepShape(q_lens=np.asarray(r["q_lens"], dtype=np.int64), kv_lens=np.asarray(r["kv_lens"],
                          dtype=np.int64), num_sampled=int(r["num_sampled"]),
                          shared_lens=np.asarray(r["shared_lens"], dtype=np.int64),
                          shared_nodes=[SharedRun(kv_len=int(t), num_queries=int(q)) for t, q in r["shared_runs"]])
        steps.append(MeasuredStep(f"{r['kind']} step {r['step']} {r['provider']}", shape, r["kernel"],
                                  bool(r["split_k"]), float(r["step_s"]), float(r["attention_s"])))
    device = records[0]["device"] if records else ""
    hardware = next((p for key, p in DEVICE_PRESETS if key in device), "h100")
    model = records[0]["model"] if records else "llama-3.1-8b"
    if model not in MODELS:  # the dry run's tiny model: its steps exercise the code, the preset is a stand-in
        model = "llama-3.1-8b"
    return steps, hardware, model


def modeled(cost: CostModel, m: MeasuredStep) -> tuple[float, float]:
    """(GPU step seconds, attention seconds) the cost model gives (no host time: the measurement has none)."""
    c = cost.step_cost(m.shape, kernel=m.kernel, split_k=m.split_k)
    return c.gpu, c.attention


def errors(steps: list, hardware: str, model: str, overrides: dict) -> np.ndarray:
    """log(modeled / measured) of every step time and attention time."""
    cost = CostModel(hardware, model, Calibration(overrides))
    out = []
    for m in steps:
        step, attn = modeled(cost, m)
        out += [math.log(step / m.step_s), math.log(attn / m.attention_s)]
    return np.asarray(out)


@dataclass
class FitResult:
    overrides: dict
    rms_before: float  # root-mean-square relative error (exp of the log error, minus 1) with the default table
    rms_after: float
    rows: list  # per step: label, measured, modeled before, modeled after (seconds)
    hardware: str
    model: str


def _rms(log_err: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.expm1(np.abs(log_err)) ** 2))) if log_err.size else 0.0


def fit(steps: list, hardware: str, model: str) -> FitResult:
    """Fit :data:`FIT_CONSTANTS` to ``steps`` (bounded golden-section coordinate search on the summed squared log
    errors); the default table's values are the start."""
    base = Calibration()
    current = {name: getattr(base, name) for name in FIT_CONSTANTS}
    loss = lambda ov: float((errors(steps, hardware, model, ov) ** 2).sum())  # noqa: E731
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(SWEEPS):
        for name, (lo, hi) in FIT_CONSTANTS.items():
            a, b = math.log(lo), math.log(hi)
            f = lambda x: loss({**current, name: math.exp(x)})  # noqa: E731
            c, d = b - ratio * (b - a), a + ratio * (b - a)
            fc, fd = f(c), f(d)
            for _ in range(GOLDEN_STEPS):
                if fc < fd:
                    b, d, fd = d, c, fc
                    c = b - ratio * (b - a)
                    fc = f(c)
                else:
                    a, c, fc = c, d, fd
                    d = a + ratio * (b - a)
                    fd = f(d)
            best = math.exp((a + b) / 2)
            if loss({**current, name: best}) < loss(current):
                current[name] = best
    before = CostModel(hardware, model, Calibration())
    after = CostModel(hardware, model, Calibration(current))
    rows = [dict(label=m.label, measured_s=m.step_s, before_s=modeled(before, m)[0], after_s=modeled(after, m)[0],
                 measured_attention_s=m.attention_s, before_attention_s=modeled(before, m)[1],
                 after_attention_s=modeled(after, m)[1]) for m in steps]
    return FitResult(current, _rms(errors(steps, hardware, model, {})), _rms(errors(steps, hardware, model, current)),
                     rows, hardware, model)


def table1(overrides: dict, num_requests: int = 3000) -> list:
    """BatchLLM Table 1 case 1 with the default constants and with ``overrides``: rows (setting, paper ratio,
    modeled-before ratio, calibrated ratio), every ratio over vLLM (``vllm-plain``)."""
    from prefixattn.sim.papers import BATCHLLM_TABLE1_CASE1, batchllm_table1
    from prefixattn.sim.simulate import simulate

    runs = {}
    for key, ov in (("before", {}), ("calibrated", overrides)):
        runs[key] = {r["policy"]: r for r in batchllm_table1(simulate(
            "batchllm-case1", list(TABLE1_POLICIES), model="mistral-7b", gpu="a100", num_requests=num_requests,
            calibration=Calibration(ov)))}
    rows = []
    for policy, r in runs["before"].items():
        rows.append(dict(setting=r["setting"], policy=policy, paper_ratio=r["paper_ratio"],
                         before_ratio=r["modeled_ratio"], calibrated_ratio=runs["calibrated"][policy]["modeled_ratio"],
                         in_paper=policy in BATCHLLM_TABLE1_CASE1))
    return rows


def markdown(result: FitResult, table1_rows: list | None, *, device: str = "") -> str:
    """The fit (constants, error before/after, per step) and Table 1 side by side."""
    base = Calibration()
    dry = "interpreter" in device
    out = [f"### Simulator calibrated against measured model steps ({device or 'device unknown'}; preset "
           f"`{result.hardware}`, model `{result.model}`)", ""]
    if dry:
        out += ["**DRY RUN: the steps are interpreter wall-clock times of a tiny model, so this is no calibration; it "
                "only exercises the code.**", ""]
    out += [f"Fit error (RMS of modeled/measured - 1 over step and attention times): **{result.rms_before:.1%} with "
            f"the default constants, {result.rms_after:.1%} calibrated**.", "",
            "| constant | default | calibrated (fit) |", "|---|---|---|"]
    out += [f"| `{n}` | {getattr(base, n):.3g} | {v:.3g} |" for n, v in result.overrides.items()]
    out += ["", "| step, provider | measured ms | modeled ms (default) | modeled ms (calibrated) | "
            "attention measured / calibrated ms |", "|---|---|---|---|---|"]
    out += [f"| {r['label']} | {r['measured_s'] * 1e3:.2f} | {r['before_s'] * 1e3:.2f} | {r['after_s'] * 1e3:.2f} | "
            f"{r['measured_attention_s'] * 1e3:.2f} / {r['after_attention_s'] * 1e3:.2f} |" for r in result.rows]
    if table1_rows:
        out += ["", "BatchLLM Table 1 case 1 (Mistral-7B on an A100 in the paper; modeled here, the fitted "
                "efficiencies carried to the A100 preset as an assumption), throughput over vLLM:", "",
                "| setting | paper | modeled, default constants | modeled, calibrated |", "|---|---|---|---|"]
        out += [f"| {r['setting']} (`{r['policy']}`) | "
                f"{'-' if r['paper_ratio'] is None else format(r['paper_ratio'], '.2f')} | {r['before_ratio']:.2f} | "
                f"{r['calibrated_ratio']:.2f} |" for r in table1_rows]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixattn.sim.fit", description=__doc__.splitlines()[0])
    ap.add_argument("steps", help="the GPU check's <gpu>-<commit>-model-steps.json")
    ap.add_argument("--table1-requests", type=int, default=3000, help="Table 1's workload size (0: skip it)")
    args = ap.parse_args(argv)
    records = json.loads(open(args.steps).read())
    if not records:
        print("no measured steps in the file", file=sys.stderr)
        return 2
    steps, hardware, model = load_steps(records)
    result = fit(steps, hardware, model)
    rows = table1(result.overrides, args.table1_requests) if args.table1_requests else None
    print(markdown(result, rows, device=records[0]["device"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
