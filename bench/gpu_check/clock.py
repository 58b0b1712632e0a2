"""The GPU check's steps, their time budgets and the step clock (driver: :mod:`gpu_check.driver`), and how a step
reports a failure (:func:`failure`) and survives a crashing case (:func:`guarded`).

Every step module takes its :class:`Clock` from here; this module imports none of them (nor torch), so any of them
may import it.
"""

from __future__ import annotations

import time

#: The steps, in the order the driver runs them: by value, the mandatory evidence first (correctness; the ceilings
#: and floors; the timing shapes with the fa2 cascade and per-class times; the model steps), the prefixattn-only steps
#: before the timing so FlashInfer's JIT compiles meanwhile, then what a second call on the same machine may run
#: (``--steps``) when the first had no time left: the class rates, MLA, Nsight Compute's HBM bytes and whole
#: batches run to completion.
STEPS = ("correctness", "ceilings", "graphs", "eager_small", "plan_ahead", "sanitizer", "timing", "model_step",
         "class_rates", "mla", "hbm_bytes", "whole_batch")
#: Steps that need the ceilings (the HBM and attention rates their floors use) and the attention rate.
NEED_CEILINGS = frozenset({"ceilings", "timing", "model_step", "mla"})
NEED_ATTENTION_RATE = frozenset({"timing", "model_step"})
#: Seconds per step on the GPU, in the order the driver runs them. The driver clips every step to its overall
#: deadline too. H200 run at 74e5177 (345 s in all): correctness ~140 s (55 of it the first compile), ceilings 2 s,
#: graphs 5 s, sanitizer ~40 s, timing 106 s for 52 shapes (~2 s each with 11 providers), model step ~50 s for 4
#: steps. Estimated on top since: the read-kernel sweep (+~15 s: 5 compiles, 25 timed configs), the fa2 cascade and
#: the per-class graphs (+~1 s a shape), two more model-step workloads (+~50 s). What does not fit is skipped with
#: its reason, for a second call (``--steps``). MLA (not yet run): ~20 s for its kernel's first compiles, then 5
#: shapes x 3 providers, the slowest FlashInfer runs ~2 ms (1024 requests x 8K tokens of 1,152 latent bytes); then
#: 3 prefill-context shapes x 2 providers (+40 s: the attention kernel's 192-wide compiles, runs of ~5-30 ms); the
#: naive-form provider on the 5 decode shapes (+15 s: its plans, its shared binary of keys 192 and values 128, which
#: the prefill contexts' plans of the same widths may reuse, and ~1-3 s a shape); the same with the prefix kept
#: (+10 s: its first step, untimed, and ~1-2 s a shape: no up-projection in its timed step).
#: Class rates (not yet run): 2 shapes x 3 providers of ~6-7 ms runs (2.2-2.4 TFLOP at ~340-580 TFLOP/s), the fa2
#: prefill's plan, one reference of 256 rows each, and a compile where the paged chunks' tiles are not the dense
#: prefill's (the ceilings step compiled that one): ~30-45 s; with the Hopper build (2 more runs, ~5 s) after its
#: correctness cases, which in a call without the correctness step run here (their child: at most 80 s). The timing
#: step's packed-KV-heads runs (not yet run): 9 decode shapes, ~1-2 s each, and 3 compiles of ~5 s (GQA 32:4, 32:8,
#: MHA): ~30 s more in its budget (the tail's shapes are cut first); its PDL runs (not yet run): 11 shapes, ~1-2 s
#: each, and a compile of ~3-5 s per class binary the correctness step did not compile with PDL. The correctness
#: step's cases on the matrix classes' Hopper build (not yet run): a child process (~5 s to start CUDA), its compiles
#: (~2-3 s a variant: shared and chunk, 2 dtypes, 2 head sizes, features) and ~12 cases: ~50 s more, at most 80. Its
#: production-layout cases again with their launches chained by PDL (not yet run): ~5 compiles of ~3 s and runs:
#: ~25 s more.
BUDGET_S = {"correctness": 245, "ceilings": 30, "graphs": 20, "eager_small": 15, "plan_ahead": 10, "sanitizer": 60,
            "timing": 170, "model_step": 110, "class_rates": 130, "mla": 155, "hbm_bytes": 90, "whole_batch": 120}
#: Seconds a step leaves for the steps after it that the run must still reach: the timing step stops in time for
#: the model step (its shapes are cut from the tail), whatever the FlashInfer JIT wait before it took.
KEEP_FOR_LATER_S = {"timing": BUDGET_S["model_step"]}
#: Seconds the whole driver may run (scripts/gpu_check.sh has 540 s: ~25 s go to the wheel install and start-up) and
#: the part of it kept for writing the results.
TOTAL_S, RESERVE_S = 505, 10
#: Set by the driver at start: ``time.monotonic() + TOTAL_S``.
DEADLINE = float("inf")


class Clock:
    """One step's deadline: its own budget, clipped to the run's; ``expired(items)`` prints and records why the rest
    of the step is skipped."""

    def __init__(self, step: str, skips: list):
        self.step, self.skips = step, skips
        left = DEADLINE - RESERVE_S - KEEP_FOR_LATER_S.get(step, 0) - time.monotonic()
        self.seconds = max(0.0, min(BUDGET_S[step], left))
        self.deadline = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self, remaining: list) -> bool:
        if self.left() > 0:
            return False
        self.skip(f"budget of {self.seconds:.0f} s spent; not run: {len(remaining)} item(s), first "
                  f"{remaining[0] if remaining else '-'}")
        return True

    def skip(self, reason: str) -> None:
        print(f"[{self.step}] SKIPPED: {reason}", flush=True)
        self.skips.append((self.step, reason))


#: Characters of an exception's text a row, a printed line or a skip keeps: its type and first lines, not a
#: compiler's whole log.
FAILURE_CHARS = 300


def failure(exc: BaseException) -> str:
    """``"<type>: <message>"`` of ``exc``, cut to :data:`FAILURE_CHARS`: how every step says what failed."""
    return f"{type(exc).__name__}: {exc}"[:FAILURE_CHARS]


def guarded(case, *args, **kwargs) -> tuple[dict | None, float]:
    """``(case(*args, **kwargs), seconds)``, an exception as a failed result ``{"passed": False, "error": ...}``: a
    case that crashes is a failed case with its reason, not the end of the run."""
    start = time.monotonic()
    try:
        result = case(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any error of a case is its result
        result = dict(passed=False, error=failure(exc))
    return result, time.monotonic() - start
