"""``Plan.stats``' modeled entries: the launches' modeled times of a work list or of a split candidate, in series or
chained by programmatic dependent launch, and the comparison of two candidates by them."""

from __future__ import annotations

from prefixattn.autotune.program_cost import LAUNCH_GAP_US
from prefixattn.kernels import layout as K


def modeled_step_us(modeled, class_ends) -> float:
    """The step's modeled time (microseconds on the planning target, :mod:`prefixattn.autotune.program_cost`): each
    class launch's makespan (``modeled[c][0]``; ``modeled``: ``[NUM_CLASSES, 2]`` float64 array) summed, plus a
    ``LAUNCH_GAP_US`` between consecutive launches (the classes with items: ``class_ends``, one past each class's
    last item), rounded to 0.01 us."""
    spans = modeled[:, 0].tolist()  # Python floats: indexing numpy's scalars costs ~0.3 us each
    return _step_us(spans, class_ends)


def _step_us(spans: list, class_ends) -> float:
    launches = (class_ends[0] > 0) + (class_ends[1] > class_ends[0]) + (class_ends[2] > class_ends[1])
    return round(spans[K.CLASS_SHARED] + spans[K.CLASS_CHUNK] + spans[K.CLASS_DECODE]
                 + max(0, int(launches) - 1) * LAUNCH_GAP_US, 2)


def chained_us(modeled, class_ends) -> float:
    """The step's modeled time with its launches chained by PDL (:mod:`prefixattn.autotune.pdl`; ``modeled``,
    ``class_ends``: :func:`modeled_step_us`'): no gap between launches, and a class's programs take the slots as the
    classes before it leave them, so the step is the longest of all programs' time spread evenly over every slot
    (the ideals summed) and, per class, the ideals of the classes before it plus its own makespan (its longest
    programs start no earlier). Optimistic where a class's last wave leaves fewer slots than the next class fills.
    Rounded to 0.01 us."""
    spans, ideals = modeled.T.tolist()
    before = step = 0.0
    first = 0
    for c in range(K.NUM_CLASSES):  # the classes with items, in launch order
        if class_ends[c] > first:
            step = max(step, before + spans[c])
            before += ideals[c]
        first = class_ends[c]
    return round(max(step, before), 2)


def modeled_stats(modeled, class_ends) -> dict:
    """``Plan.stats``' modeled entries (``modeled``, ``class_ends``: :func:`modeled_step_us`'): each class launch's
    makespan, the step (:func:`modeled_step_us`), and the critical path: the makespans' sum over the programs' time
    spread evenly over the slots (1.0: every launch ends in a full wave)."""
    spans, ideals = modeled.T.tolist()
    ideal, total = sum(ideals), sum(spans)
    return dict(modeled_class_us=tuple(round(x, 2) for x in spans), modeled_step_us=_step_us(spans, class_ends),
                critical_path=round(total / ideal, 4) if ideal > 0 else 0.0)


def modeled_faster(candidate, current) -> bool:
    """Whether split candidate ``candidate``'s modeled step time (:func:`modeled_step_us`) is below ``current``'s
    (:class:`~prefixattn.planner.split_rule.Split` each)."""
    return (modeled_step_us(candidate.modeled, candidate.class_ends)
            < modeled_step_us(current.modeled, current.class_ends))


def chained_faster(candidate, current) -> bool:
    """:func:`modeled_faster` of a plan whose launches chain by PDL: by :func:`chained_us`. A shared launch chained
    to the decode launch costs its programs' share of the slots, not its makespan and a gap."""
    return chained_us(candidate.modeled, candidate.class_ends) < chained_us(current.modeled, current.class_ends)
