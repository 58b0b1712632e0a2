"""The step-level check behind ``sharing="auto"``: a step whose shared launch may cost more than its nodes save is
also planned without sharing, and the faster plan (modeled) runs.

The per-node cost rule (:mod:`prefixattn.planner.cost_rule`) counts bytes: the KV reads a node saves against the
partial states it adds. It does not see the shared class's own launch (its programs' fixed cost, its last wave and
the gap before the next class's launch, which waits for it), and in a short step that launch can cost more than the
reads it saves (modeled, sm90: 32 decodes of GQA 32:4 under a 256-token prefix, 54.9 us shared against 49.2 us
unshared). Pricing the launch needs the whole step's work list, so the check runs after the planner: a cheap screen
first (:func:`shared_launch_may_lose`), then, only where it fires, the unshared plan and a comparison of the two
modeled step times (:func:`unshared_is_faster`). Both use :mod:`prefixattn.autotune.program_cost`: modeled, never
measured.
"""

from __future__ import annotations

import numpy as np

from prefixattn.autotune.program_cost import LAUNCH_GAP_US
from prefixattn.kernels import layout as K
from prefixattn.planner.stats import modeled_stats
from prefixattn.planner.work_list import SharedNodes, WorkList

#: The screen plans the step a second time (host time) only where the shared launch costs more than this fraction of
#: an optimistic estimate of what its nodes save: each member beyond the first reads the node's KV once less, at the
#: decode class's per-tile cost spread over every slot. Steps with long shared prefixes save 10-1000x their shared
#: launch and never pay for the second plan; the fraction leaves the estimate a 4x margin before it could skip a
#: step the comparison would have changed.
UNSHARED_CHECK_RATIO = 0.25


def shared_launch_may_lose(nodes: SharedNodes, work: WorkList, costs: tuple, *, num_kv_heads: int,
                           num_sms: int) -> bool:
    """Whether the shared class's modeled launch (its makespan plus :data:`LAUNCH_GAP_US`) exceeds
    :data:`UNSHARED_CHECK_RATIO` of the suffix-class time its nodes save, estimated optimistically (see the
    constant). ``costs``: the step's ``(shared, chunk, decode)``
    :class:`~prefixattn.autotune.program_cost.ProgramCost`; ``work``: the sharing plan's work list."""
    if len(nodes) == 0:
        return False
    shared_us = float(work.modeled_us[K.CLASS_SHARED][0]) + LAUNCH_GAP_US
    extra_members = np.diff(nodes.offsets) - 1
    saved_positions = float(((nodes.kv_end - nodes.kv_start) * extra_members).sum()) * num_kv_heads
    decode = costs[K.CLASS_DECODE]
    saved_us = saved_positions / decode.block_n * decode.tile_us / (num_sms * decode.slots_per_sm)
    return shared_us > UNSHARED_CHECK_RATIO * saved_us


def unshared_is_faster(shared: WorkList, unshared: WorkList) -> bool:
    """Whether the unshared plan's modeled step time (:func:`~prefixattn.planner.stats.modeled_stats`) is below the
    sharing plan's."""
    return modeled_stats(unshared)["modeled_step_us"] < modeled_stats(shared)["modeled_step_us"]
