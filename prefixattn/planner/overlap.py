"""Overlapped work classes (``plan(overlap=True)``): the decode launch beside the compute-bound ones.

Launched in series on one stream, a mixed step's chunk class computes while no decode program reads KV, the decode
class reads KV while the tensor cores idle, and each launch's last wave leaves SMs idle until it drains. With
``overlap=True`` the decode launch goes to a side stream forked from the current one (and joined back before
:func:`prefixattn.attention` returns: :func:`prefixattn.launcher.side_stream`), so the GPU's block scheduler places
decode programs on whatever SMs the shared and chunk launches leave free, from their start. The merge protocol
already allows it: no program waits on another, and a row's last report merges it whichever launch makes it.

The split of the SMs is left to the block scheduler. Planning one, with the compute classes as persistent launches
on part of the SMs, needs a loop over items around the attention body, which on sm_90 (Triton 3.9, bf16, the
shipped 128x64 shared and chunk tiles) took every one of the 255 registers and spilled 24-272 bytes at head sizes
128 and 256 (against 216-237 registers and no spill without the loop): the compile check refuses such a binary.

**Modeled** (:mod:`prefixattn.autotune.program_cost`): the overlapped step takes the longest of the compute
classes' launches in series, the decode launch, and all three classes' programs spread evenly over every slot
(each launch's modeled ``ideal``): the block scheduler is taken to keep every SM busy. A step is overlapped only where
that is below the classes in series (:func:`~prefixattn.planner.stats.modeled_step_us`), i.e. where it has a decode
launch and a compute launch; its sharing candidates are compared by that time too (:func:`overlap_faster`).
"""

from __future__ import annotations

from prefixattn.autotune.program_cost import LAUNCH_GAP_US
from prefixattn.kernels import layout as K
from prefixattn.planner.stats import modeled_step_us

#: The compute-bound classes, launched in this order on the current stream (the decode class runs beside them).
COMPUTE_CLASSES = (K.CLASS_SHARED, K.CLASS_CHUNK)


def overlapped_us(modeled, class_ends) -> float:
    """The step's modeled time with the decode launch beside the compute launches (module docstring): ``modeled``
    ``[NUM_CLASSES, 2]`` (makespan, ideal) of each class's launch alone (the split stage's), ``class_ends`` one past
    each class's last item. Rounded to 0.01 us."""
    spans, ideals = modeled[:, 0].tolist(), modeled[:, 1].tolist()
    compute_launches = (class_ends[0] > 0) + (class_ends[1] > class_ends[0])
    compute = sum(spans[c] for c in COMPUTE_CLASSES) + max(0, int(compute_launches) - 1) * LAUNCH_GAP_US
    return round(max(compute, spans[K.CLASS_DECODE], sum(ideals)), 2)


def overlap_stats(modeled, class_ends) -> dict:
    """``Plan.stats``' entries of a step planned with ``overlap=True``: ``overlapped`` (its decode launch runs beside
    its compute launches) and ``modeled_overlap_us`` (the step's modeled time as it runs: :func:`overlapped_us` when
    overlapped, else in series). ``modeled``, ``class_ends``: :func:`overlapped_us`'s."""
    serial = modeled_step_us(modeled, class_ends)
    if class_ends[1] == 0 or class_ends[2] == class_ends[1]:  # no compute launch, or no decode launch
        return dict(overlapped=False, modeled_overlap_us=serial)
    step = overlapped_us(modeled, class_ends)
    return dict(overlapped=step < serial, modeled_overlap_us=min(step, serial))


def overlap_faster(candidate, current) -> bool:
    """:func:`~prefixattn.planner.stats.modeled_faster` of a step planned with ``overlap=True``: split candidates
    compared by their time as they would run (``modeled_overlap_us``). A shared launch beside the decode launch costs
    what it adds to the longer side, not its whole time: a short decode step under a short prefix keeps its node
    (modeled, sm90, 32 decodes of GQA 32:4 under a 256-token prefix: 44.3 us shared and overlapped against 49.2 us
    unshared, where in series it is 54.9 us shared)."""
    return (overlap_stats(candidate.modeled, candidate.class_ends)["modeled_overlap_us"]
            < overlap_stats(current.modeled, current.class_ends)["modeled_overlap_us"])
