"""Leave-one-step-out judgement of the calibrated cost model: does it name the faster provider on a step it has not
seen, and how far off are its step times there?

For each step of a model-steps run (every provider of one step ran the same batch), :func:`judge` fits the constants on
the other steps' records only (the fit :func:`prefixattn.sim.fit.held_out` hands it), then predicts every provider of
the left-out step. It reports each prediction's step-time error and, for each pair of :data:`PAIRS` present, whether the
modeled times order the pair as the measured ones do, wherever the measured margin exceeds :data:`MARGIN` (a smaller
margin is within what one step's timing can tell apart, and is shown but not judged). The targets: the faster provider
named in every judged pair, and every step-time error within :data:`ERROR_TARGET`. Predictions are modeled; the times
they are judged against are measured on the records' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: The provider pairs judged where a step has both (the GPU check's model-step providers; the cascade on fa2 wrappers
#: where a run has it), and the measured margin (slower / faster - 1) above which the model must name the faster.
PAIRS = (("prefixattn", "flashinfer-best"), ("prefixattn", "flashinfer-cascade2"),
         ("flashinfer-best", "flashinfer-cascade2"), ("prefixattn", "prefixattn-nosharing"),
         ("prefixattn", "flashinfer-cascade2-fa2"), ("flashinfer-best", "flashinfer-cascade2-fa2"))
MARGIN = 0.05
#: The held-out step-time error the calibration aims for (|modeled / measured - 1|).
ERROR_TARGET = 0.15
#: Seconds -> milliseconds, the tables' unit.
_MS = 1e3


@dataclass
class HeldOutStep:
    """One left-out step: the constants fitted without it, and its providers predicted (seconds)."""

    step: str
    overrides: dict
    at_bound: list
    rows: list = field(default_factory=list)  # provider, measured_s, predicted_s, error, attention measured/predicted
    pairs: list = field(default_factory=list)  # a, b, margin, judged, measured_faster, predicted_faster, named


@dataclass
class HeldOut:
    """Every fold of :func:`held_out` and the judgement against the targets."""

    folds: list
    max_error: float  # largest |predicted / measured - 1| of a step time over every fold
    rms_error: float
    judged: int  # pairs with a measured margin over MARGIN
    named: int  # of those, pairs the model orders as measured
    error_met: bool
    winner_met: bool
    verdict: str


def judge(steps: list, fit_fold) -> HeldOut:
    """Leave-one-step-out cross-validation (module docstring) of a fit.

    Parameters
    ----------
    steps : list of MeasuredStep
        From :func:`prefixattn.sim.fit.load_steps`; at least two distinct ``step`` ids.
    fit_fold : callable
        ``fit_fold(train) -> (overrides, at_bound, predict)``: the fit on the ``train`` records, and ``predict(m) ->
        (step_s, attention_s)`` of a record under it (:func:`prefixattn.sim.fit.held_out` passes its fit).

    Returns
    -------
    HeldOut
    """
    ids = list(dict.fromkeys(m.step for m in steps))
    if len(ids) < 2:
        raise ValueError(f"steps: expected records of at least two distinct steps, got {len(ids)} ({ids})")
    folds, errs = [], []
    for sid in ids:
        overrides, at_bound, predict = fit_fold([m for m in steps if m.step != sid])
        fold = HeldOutStep(sid, overrides, at_bound)
        predicted = {}
        for m in (m for m in steps if m.step == sid):
            step_s, attn_s = predict(m)
            err = step_s / m.step_s - 1
            errs.append(err)
            predicted[m.provider] = (m.step_s, step_s)
            fold.rows.append(dict(provider=m.provider, measured_s=m.step_s, predicted_s=step_s, error=err,
                                  measured_attention_s=m.attention_s, predicted_attention_s=attn_s))
        fold.pairs = _pairs(predicted)
        folds.append(fold)
    judged = [p for f in folds for p in f.pairs if p["judged"]]
    named = sum(p["named"] for p in judged)
    max_error = max(abs(e) for e in errs)
    rms = math.sqrt(sum(e * e for e in errs) / len(errs))
    error_met, winner_met = max_error <= ERROR_TARGET, named == len(judged)
    verdict = (f"step-time error max {max_error:.1%}, RMS {rms:.1%} (target <= {ERROR_TARGET:.0%}): "
               f"{'met' if error_met else 'NOT met'}; faster provider named in {named} of {len(judged)} pairs with a "
               f"measured margin over {MARGIN:.0%} (target: all): {'met' if winner_met else 'NOT met'}")
    return HeldOut(folds, max_error, rms, len(judged), named, error_met, winner_met, verdict)


def _pairs(predicted: dict) -> list:
    """The :data:`PAIRS` present in ``predicted`` (provider -> (measured_s, predicted_s)), each judged where the
    measured margin exceeds :data:`MARGIN`."""
    out = []
    for a, b in PAIRS:
        if a in predicted and b in predicted:
            (ma, pa), (mb, pb) = predicted[a], predicted[b]
            measured_faster, predicted_faster = (a if ma < mb else b), (a if pa < pb else b)
            margin = max(ma, mb) / min(ma, mb) - 1
            out.append(dict(a=a, b=b, margin=margin, judged=margin > MARGIN, measured_faster=measured_faster,
                            predicted_faster=predicted_faster, named=measured_faster == predicted_faster))
    return out


def held_out_markdown(held: HeldOut, *, device: str = "") -> str:
    """The held-out tables (per left-out step: providers measured vs predicted, the judged pairs) and the verdict."""
    where = device or "device unknown"
    out = [f"Held out (leave one step out: fit on the other steps' records, predict every provider of the left-out "
           f"step; measured on {where}, predictions modeled):", "",
           "| left-out step | provider | measured ms | predicted ms | error | attention measured / predicted ms |",
           "|---|---|---|---|---|---|"]
    for f in held.folds:
        out += [f"| {f.step} | {r['provider']} | {r['measured_s'] * _MS:.2f} | {r['predicted_s'] * _MS:.2f} | "
                f"{r['error']:+.1%} | {r['measured_attention_s'] * _MS:.2f} / {r['predicted_attention_s'] * _MS:.2f} |"
                for r in f.rows]
    out += ["", f"| left-out step | pair | measured margin | judged (> {MARGIN:.0%}) | measured faster | "
            "predicted faster | named |", "|---|---|---|---|---|---|---|"]
    for f in held.folds:
        out += [f"| {f.step} | {p['a']} vs {p['b']} | {p['margin']:.1%} | {'yes' if p['judged'] else 'no'} | "
                f"{p['measured_faster']} | {p['predicted_faster']} | "
                f"{('yes' if p['named'] else '**NO**') if p['judged'] else '-'} |" for p in f.pairs]
    bound = sorted({n for f in held.folds for n in f.at_bound})
    if bound:
        out += ["", f"Constants at a bound in some fold: {', '.join(f'`{n}`' for n in bound)}."]
    out += ["", f"**Held-out verdict: {held.verdict}.**"]
    return "\n".join(out)
