"""``Plan.stats``' modeled entries: the launches' modeled times of a work list (:func:`modeled_stats`)."""

from __future__ import annotations

from prefixattn.autotune.program_cost import LAUNCH_GAP_US
from prefixattn.kernels import layout as K
from prefixattn.planner.work_list import WorkList


def modeled_stats(work: WorkList) -> dict:
    """``Plan.stats``' modeled entries (microseconds on the planning target, modeled by
    :mod:`prefixattn.autotune.program_cost`): each class launch's makespan, the step (their sum and a
    ``LAUNCH_GAP_US`` between consecutive launches), and the critical path: the makespans' sum over the programs'
    time spread evenly over the slots (1.0: every launch ends in a full wave)."""
    spans = [float(span) for span, _ in work.modeled_us]
    ideal = float(sum(i for _, i in work.modeled_us))
    total = sum(spans)
    launches = sum(1 for c in range(K.NUM_CLASSES) if work.class_ends[c] > (work.class_ends[c - 1] if c else 0))
    return dict(modeled_class_us=tuple(round(x, 2) for x in spans),
                modeled_step_us=round(total + max(0, launches - 1) * LAUNCH_GAP_US, 2),
                critical_path=round(total / ideal, 4) if ideal > 0 else 0.0)
