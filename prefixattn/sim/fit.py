"""The simulator's GPU cost model calibrated against measured model steps, and judged on steps it was not fitted to.

The GPU check's model step (bench/gpu_check/model_step.py) times real Llama-3.1-8B-shaped steps per attention provider
and writes them, with each step's shape, to ``<gpu>-<commit>-model-steps.json``. :func:`fit` chooses the constants of
:mod:`prefixattn.sim.calibration` listed in :data:`FIT_CONSTANTS`, each inside its physical bounds (:func:`bounds`),
that make :class:`CostModel` reproduce those step times and their attention times (least squares on log ratios, bounded
golden-section coordinate search), and reports the error before and after and which constants sit at a bound.
:func:`held_out` judges the model the way it is used, on steps it has not seen: leave one step out, fit on the other
steps' records, predict every provider of the left-out step, and check the step-time error and whether the model names
the faster provider of each pair in :data:`PAIRS` wherever the measured margin exceeds its ``MARGIN``
(:mod:`prefixattn.sim.held_out`). :func:`table1` re-runs BatchLLM Table 1 case 1 with the default and the fitted
constants, beside the paper's ratios. The constants are fractions of the spec-sheet peaks, so a fit on one GPU carries
to another only as an assumption (Table 1 is an A100 run); the report says so.

Command: ``python -m prefixattn.sim.fit STEPS.json [--table1-requests N]`` (markdown on stdout). Modeled numbers are
labelled modeled; measured ones name their device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass

import numpy as np

from prefixattn.sim.calibration import Calibration
from prefixattn.sim.held_out import PAIRS, HeldOut, held_out_markdown, judge  # noqa: F401 (PAIRS: re-exported)
from prefixattn.sim.presets import MODELS, get_hardware
from prefixattn.sim.step_cost import CostModel, SharedRun, StepShape

#: The constants fitted, each with its bounds and why: efficiencies are fractions of a peak (<= 1, above a floor no
#: production kernel falls under); Triton's attention is not faster than FlashAttention's CUDA kernels, so its factor
#: is <= 1; the L2 rate lies between HBM's peak and the preset's L2 ceiling (the 0.0 here is a placeholder:
#: :func:`bounds` sets that lower bound per GPU, ``hbm_bandwidth / l2_bandwidth``); the cascade factor is its
#: backend's byte rate relative to the paged kernels'.
FIT_CONSTANTS = {"gemm_efficiency": (0.2, 1.0), "hbm_efficiency": (0.2, 1.0),
                 "attn_decode_bw_efficiency": (0.1, 1.0), "attn_prefill_efficiency": (0.05, 1.0),
                 "triton_attention_factor": (0.2, 1.0), "l2_bw_efficiency": (0.0, 1.0),
                 "cascade_attention_factor": (0.02, 1.0)}
#: Coordinate-search sweeps (at most) and golden-section steps per constant per sweep; the search stops early once a
#: sweep lowers the loss by less than TOLERANCE of it (correlated constants, GEMM and elementwise rates, take ~10).
SWEEPS, GOLDEN_STEPS, TOLERANCE = 12, 24, 1e-3
#: A fitted value within this fraction of its bounds' log-width of a bound is reported as sitting at it.
AT_BOUND = 0.01
#: The GPU check's device names -> simulator presets.
DEVICE_PRESETS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("MI300X", "mi300x"))
#: Table 1 case 1's policies (BatchLLM's rows and this library's).
TABLE1_POLICIES = ("vllm-plain", "vllm-nocp", "vllm-nopc", "vllm", "batchllm", "prefixattn")
_RECORD_KEYS = ("step", "kind", "provider", "kernel", "split_k", "step_s", "attention_s", "q_lens", "kv_lens",
                "num_sampled", "shared_lens", "shared_runs", "model", "device")


@dataclass
class MeasuredStep:
    """One measured step of one provider: its shape for the cost model, its kernel kind, seconds measured on the
    records' device; ``step`` names the step in its run (workload, kind, index: every provider of one step ran the same
    batch), ``hbm_bytes_per_s`` the run's measured HBM floor rate where recorded."""

    label: str
    shape: StepShape
    kernel: str
    split_k: bool
    step_s: float
    attention_s: float
    step: str = ""
    provider: str = ""
    workload: str = ""
    hbm_bytes_per_s: float | None = None


def _runs(pairs, name: str, i: int) -> list:
    try:
        return [SharedRun(kv_len=int(t), num_queries=int(q)) for t, q in pairs]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"records[{i}].{name}: expected [(kv tokens, query rows)], got {pairs!r}") from exc


def load_steps(records: list) -> tuple[list, object, str]:
    """(MeasuredStep list, hardware, model preset) from the GPU check's ``-model-steps.json`` records.

    Records of either format load: ``group_lens`` / ``group_runs`` (the step's prefix groups, whatever the provider
    shares) come from the record where it has them, else from a record of the same ``step`` that shares something
    (its ``shared_runs`` is non-empty: every provider of a step ran the same batch), else none. ``hardware`` is the
    preset name of the records' device, or that preset with the records' ``l2_bytes`` where they carry one that
    differs; ``hbm_bytes_per_s`` (the run's measured HBM floor rate) is kept on each step for the report.

    Parameters
    ----------
    records : list of dict
        The JSON file's records (keys in :data:`_RECORD_KEYS`; optionally ``group_lens``, ``group_runs``,
        ``workload``, ``l2_bytes``, ``hbm_bytes_per_s``).

    Returns
    -------
    (list of MeasuredStep, str or HardwarePreset, str)
    """
    if not isinstance(records, list):
        raise ValueError(f"records: expected a list of dicts, got {type(records).__name__}")
    for i, r in enumerate(records):
        missing = [k for k in _RECORD_KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise ValueError(f"records[{i}]: expected keys {list(_RECORD_KEYS)}, missing {missing}")
    key = lambda r: (r.get("workload", ""), r["step"])  # noqa: E731
    sharing = {}
    for r in records:
        if r["shared_runs"] and key(r) not in sharing:
            sharing[key(r)] = r
    steps = []
    for i, r in enumerate(records):
        n = len(r["q_lens"])
        for name in ("kv_lens", "shared_lens"):
            if len(r[name]) != n:
                raise ValueError(f"records[{i}].{name}: expected {n} entries like q_lens, got {len(r[name])}")
        src = r if "group_lens" in r else sharing.get(key(r))
        group_lens = np.asarray(src["group_lens"] if "group_lens" in src else src["shared_lens"], dtype=np.int64) \
            if src is not None else None
        group_runs = _runs(src.get("group_runs", src["shared_runs"]), "group_runs", i) if src is not None else []
        if group_lens is not None and group_lens.shape[0] != n:
            raise ValueError(f"records[{i}].group_lens: expected {n} entries like q_lens, got {group_lens.shape[0]}")
        shape = StepShape(q_lens=np.asarray(r["q_lens"], dtype=np.int64),
                          kv_lens=np.asarray(r["kv_lens"], dtype=np.int64), num_sampled=int(r["num_sampled"]),
                          shared_lens=np.asarray(r["shared_lens"], dtype=np.int64),
                          shared_nodes=_runs(r["shared_runs"], "shared_runs", i),
                          group_lens=group_lens, group_runs=group_runs)
        workload = str(r.get("workload", ""))
        step_id = f"{workload + ' ' if workload else ''}{r['kind']} step {r['step']}"
        rate = r.get("hbm_bytes_per_s")
        steps.append(MeasuredStep(f"{step_id} {r['provider']}", shape, r["kernel"], bool(r["split_k"]),
                                  float(r["step_s"]), float(r["attention_s"]), step_id, str(r["provider"]), workload,
                                  float(rate) if rate else None))
    device = records[0]["device"] if records else ""
    hardware = next((p for name, p in DEVICE_PRESETS if name in device), "h100")
    l2 = next((int(r["l2_bytes"]) for r in records if r.get("l2_bytes")), None)
    if l2 is not None and l2 != get_hardware(hardware).l2_bytes:
        hardware = dataclasses.replace(get_hardware(hardware), l2_bytes=l2)
    model = records[0]["model"] if records else "llama-3.1-8b"
    if model not in MODELS:  # the dry run's tiny model: its steps exercise the code, the preset is a stand-in
        model = "llama-3.1-8b"
    return steps, hardware, model


def _hw_name(hardware) -> str:
    return hardware if isinstance(hardware, str) else hardware.name


def bounds(hardware) -> dict:
    """:data:`FIT_CONSTANTS` with the L2 efficiency's lower bound set for ``hardware``: the HBM peak over the
    preset's L2 ceiling (an L2 slower than HBM could not serve HBM's reads)."""
    hw = get_hardware(hardware)
    out = dict(FIT_CONSTANTS)
    out["l2_bw_efficiency"] = (hw.hbm_bandwidth / hw.l2_bandwidth, FIT_CONSTANTS["l2_bw_efficiency"][1])
    return out


def modeled(cost: CostModel, m: MeasuredStep) -> tuple[float, float]:
    """(GPU step seconds, attention seconds) the cost model gives (no host time: the measurement has none)."""
    c = cost.step_cost(m.shape, kernel=m.kernel, split_k=m.split_k)
    return c.gpu, c.attention


def errors(steps: list, hardware, model: str, overrides: dict) -> np.ndarray:
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
    hardware: object
    model: str
    bounds: dict = dataclasses.field(default_factory=dict)  # name -> (low, high) the search kept to
    at_bound: list = dataclasses.field(default_factory=list)  # names whose fitted value sits at a bound
    hbm_bytes_per_s: float | None = None  # the run's measured HBM floor rate, where its records carry one


def _rms(log_err: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.expm1(np.abs(log_err)) ** 2))) if log_err.size else 0.0


def _search(steps: list, hardware, model: str, box: dict, sweeps: int, golden_steps: int) -> dict:
    """Bounded golden-section coordinate search (in log space) from the default table's values clipped into ``box``."""
    base = Calibration()
    current = {name: min(max(getattr(base, name), lo), hi) for name, (lo, hi) in box.items()}
    loss = lambda ov: float((errors(steps, hardware, model, ov) ** 2).sum())  # noqa: E731
    ratio = (math.sqrt(5) - 1) / 2
    previous = loss(current)
    for _ in range(sweeps):
        for name, (lo, hi) in box.items():
            a, b = math.log(lo), math.log(hi)
            f = lambda x: loss({**current, name: math.exp(x)})  # noqa: E731
            c, d = b - ratio * (b - a), a + ratio * (b - a)
            fc, fd = f(c), f(d)
            for _ in range(golden_steps):
                if fc < fd:
                    b, d, fd = d, c, fc
                    c = b - ratio * (b - a)
                    fc = f(c)
                else:
                    a, c, fc = c, d, fd
                    d = a + ratio * (b - a)
                    fd = f(d)
            # the interval's ends too: an optimum on a bound is then reached exactly, not approached
            best = min((math.exp((a + b) / 2), math.exp(a), math.exp(b)), key=lambda v: loss({**current, name: v}))
            if loss({**current, name: best}) < loss(current):
                current[name] = best
        now = loss(current)
        if previous - now < TOLERANCE * previous:
            break
        previous = now
    return current


def _at_bound(values: dict, box: dict) -> list:
    out = []
    for name, v in values.items():
        lo, hi = box[name]
        width = math.log(hi / lo)
        if math.log(v / lo) <= AT_BOUND * width or math.log(hi / v) <= AT_BOUND * width:
            out.append(name)
    return out


def fit(steps: list, hardware, model: str, *, sweeps: int = SWEEPS, golden_steps: int = GOLDEN_STEPS) -> FitResult:
    """Fit :data:`FIT_CONSTANTS` to ``steps`` inside :func:`bounds` (bounded golden-section coordinate search on the
    summed squared log errors of step and attention times); the default table's values are the start.

    Parameters
    ----------
    steps : list of MeasuredStep
    hardware : str or HardwarePreset
    model : str
    sweeps, golden_steps : int
        Search effort (>= 1 each): coordinate sweeps, and golden-section steps per constant per sweep.

    Returns
    -------
    FitResult
        ``overrides`` the fitted values (each inside ``bounds``), ``at_bound`` the names sitting at a bound.
    """
    if not steps:
        raise ValueError("steps: expected at least one MeasuredStep, got none")
    for name, value in (("sweeps", sweeps), ("golden_steps", golden_steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    box = bounds(hardware)
    current = _search(steps, hardware, model, box, sweeps, golden_steps)
    before = CostModel(hardware, model, Calibration())
    after = CostModel(hardware, model, Calibration(current))
    rows = []
    for m in steps:
        (b_step, b_attn), (a_step, a_attn) = modeled(before, m), modeled(after, m)
        rows.append(dict(label=m.label, measured_s=m.step_s, before_s=b_step, after_s=a_step,
                         measured_attention_s=m.attention_s, before_attention_s=b_attn, after_attention_s=a_attn))
    measured = next((m.hbm_bytes_per_s for m in steps if m.hbm_bytes_per_s), None)
    return FitResult(current, _rms(errors(steps, hardware, model, {})), _rms(errors(steps, hardware, model, current)),
                     rows, hardware, model, box, _at_bound(current, box), measured)


def held_out(steps: list, hardware, model: str, *, sweeps: int | None = None,
             golden_steps: int | None = None) -> HeldOut:
    """Leave-one-step-out judgement of :func:`fit` (:func:`prefixattn.sim.held_out.judge`): ``steps`` from
    :func:`load_steps`, at least two distinct steps; ``sweeps``, ``golden_steps``: the fit's search effort (default
    :data:`SWEEPS` / :data:`GOLDEN_STEPS`)."""
    effort = dict(sweeps=sweeps or SWEEPS, golden_steps=golden_steps or GOLDEN_STEPS)

    def fit_fold(train: list):
        result = fit(train, hardware, model, **effort)
        cost = CostModel(hardware, model, Calibration(result.overrides))
        return result.overrides, result.at_bound, lambda m: modeled(cost, m)

    return judge(steps, fit_fold)


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


def markdown(result: FitResult, table1_rows: list | None, *, device: str = "", held: HeldOut | None = None) -> str:
    """The fit (constants with bounds, error before/after, per step), the held-out judgement when ``held`` is given,
    and Table 1 side by side (modeled)."""
    base = Calibration()
    dry = "interpreter" in device
    where = device or "device unknown"
    out = [f"### Simulator calibrated against measured model steps ({where}; preset "
           f"`{_hw_name(result.hardware)}`, model `{result.model}`)", ""]
    if dry:
        out += ["**DRY RUN: the steps are interpreter wall-clock times of a tiny model, so this is no calibration; it "
                "only exercises the code.**", ""]
    out += [f"Fit error, in sample (RMS of modeled/measured - 1 over step and attention times, measured on {where}): "
            f"**{result.rms_before:.1%} with the default constants, {result.rms_after:.1%} calibrated**.", "",
            "| constant | default | bounds | calibrated (fit) | at a bound |", "|---|---|---|---|---|"]
    box = result.bounds or bounds(result.hardware)
    for n, v in result.overrides.items():
        lo, hi = box[n]
        out.append(f"| `{n}` | {getattr(base, n):.3g} | [{lo:.3g}, {hi:.3g}] | {v:.3g} | "
                   f"{'**yes**' if n in result.at_bound else 'no'} |")
    if result.at_bound:
        out += ["", f"At a bound: {', '.join(f'`{n}`' for n in result.at_bound)}: the fit would move them past "
                "their physical range if it could (at an upper rate bound: that rate does not limit these steps; "
                "otherwise the model misses something there)."]
    rates = _rates(result)
    if rates:
        out += ["", rates]
    out += ["", f"| step, provider | measured ms ({where}) | modeled ms (default) | modeled ms (calibrated) | "
            "attention measured / modeled (calibrated) ms |", "|---|---|---|---|---|"]
    out += [f"| {r['label']} | {r['measured_s'] * 1e3:.2f} | {r['before_s'] * 1e3:.2f} | {r['after_s'] * 1e3:.2f} | "
            f"{r['measured_attention_s'] * 1e3:.2f} / {r['after_attention_s'] * 1e3:.2f} |" for r in result.rows]
    if held is not None:
        out += ["", held_out_markdown(held, device=where)]
    if table1_rows:
        out += ["", "BatchLLM Table 1 case 1 (Mistral-7B on an A100 in the paper; modeled here, the fitted "
                "efficiencies carried to the A100 preset as an assumption), throughput over vLLM:", "",
                "| setting | paper | modeled, default constants | modeled, calibrated |", "|---|---|---|---|"]
        out += [f"| {r['setting']} (`{r['policy']}`) | "
                f"{'-' if r['paper_ratio'] is None else format(r['paper_ratio'], '.2f')} | {r['before_ratio']:.2f} | "
                f"{r['calibrated_ratio']:.2f} |" for r in table1_rows]
    return "\n".join(out) + "\n"


def _rates(result: FitResult) -> str:
    """The fitted rates in physical units (modeled), beside the run's measured HBM floor rate where recorded."""
    hw = get_hardware(result.hardware)
    ov = result.overrides
    parts = []
    if "attn_decode_bw_efficiency" in ov:
        parts.append(f"attention HBM {hw.hbm_bandwidth * ov['attn_decode_bw_efficiency'] / 1e12:.2f} TB/s")
    if "l2_bw_efficiency" in ov:
        parts.append(f"L2 {hw.l2_bandwidth * ov['l2_bw_efficiency'] / 1e12:.2f} TB/s (ceiling "
                     f"{hw.l2_bandwidth / 1e12:.1f}, L2 {hw.l2_bytes / 2 ** 20:.0f} MiB)")
    if "gemm_efficiency" in ov:
        parts.append(f"GEMM {hw.peak_flops * ov['gemm_efficiency'] / 1e12:.0f} TFLOP/s")
    if not parts:
        return ""
    floor = "" if result.hbm_bytes_per_s is None else \
        f", the run's measured HBM floor rate {result.hbm_bytes_per_s / 1e12:.2f} TB/s"
    return f"Fitted rates (modeled): {', '.join(parts)}; HBM peak {hw.hbm_bandwidth / 1e12:.2f} TB/s{floor}."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixattn.sim.fit", description=__doc__.splitlines()[0])
    ap.add_argument("steps", help="the GPU check's <gpu>-<commit>-model-steps.json")
    ap.add_argument("--table1-requests", type=int, default=3000, help="Table 1's workload size (0: skip it)")
    ap.add_argument("--no-held-out", action="store_true", help="skip the leave-one-step-out judgement")
    args = ap.parse_args(argv)
    records = json.loads(open(args.steps).read())
    if not records:
        print("no measured steps in the file", file=sys.stderr)
        return 2
    steps, hardware, model = load_steps(records)
    result = fit(steps, hardware, model)
    held = None if args.no_held_out else held_out(steps, hardware, model)
    rows = table1(result.overrides, args.table1_requests) if args.table1_requests else None
    print(markdown(result, rows, device=records[0]["device"], held=held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
