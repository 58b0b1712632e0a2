"""The step-level checks behind ``sharing="auto"``: a step whose prefixes hold requests that gain from no node is
also planned with those requests apart (:func:`requests_may_stay_apart`), and a step whose shared launch may cost
more than its nodes save is also planned without sharing; the faster plan (modeled) runs.

The per-node cost rule (:mod:`prefixattn.planner.cost_rule`) counts bytes: the KV reads a node saves against the
partial states it adds. It does not see the shared class's own launch (its programs' fixed cost, its last wave and
the gap before the next class's launch, which waits for it), and in a short step that launch can cost more than the
reads it saves (modeled, sm90: 32 decodes of GQA 32:4 under a 256-token prefix, 54.9 us shared against 49.2 us
unshared). Pricing the launch needs the whole step's work list, so the check runs after the planner: a cheap screen
first (:func:`shared_launch_may_lose`), then, only where it fires, the unshared plan and a comparison of the two
modeled step times (:func:`modeled_faster`). Both use :mod:`prefixattn.autotune.program_cost`: modeled, never
measured.

Requests apart: a node's byte rule sums over its requests, so a node that pays for its decode rows takes the prefill
chunks under the same prefix too, whose full chunk tiles gain no KV reads and add merge states
(:func:`prefixattn.planner.cost_rule.request_sharing_pays_off`). Leaving them out is not always faster: a chunk's
suffix tiles then read the whole prefix in a few long programs, where the shared class spread it over every SM
(modeled, sm90, 7 chunks of 128 rows + 256 decodes under 8,192-token prefixes, MHA: 791 us with the chunks in the
nodes, 863 us apart; 7 chunks of 2,048 rows under a 256-token prefix: 3,721 us in, 3,653 apart, and measured on an
H200 the plan with them in was 10% slower than no sharing). So both plans are priced whole.
"""

from __future__ import annotations

import numpy as np

from prefixattn.autotune.program_cost import LAUNCH_GAP_US
from prefixattn.kernels import layout as K
from prefixattn.lcp_tree import LcpTree
from prefixattn.planner.node_choice import joining_requests
from prefixattn.planner.stats import modeled_stats
from prefixattn.planner.work_list import SharedNodes, WorkList
from prefixattn.ragged import offsets

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


def requests_may_stay_apart(tree: LcpTree, *, q_len: np.ndarray, max_q_len: int, shareable: np.ndarray,
                            rows_per_shared: int, rows_per_chunk: int, rows_per_decode: int, group: int,
                            head_dim: int, elt_bytes: int) -> bool:
    """Whether a top-level node of ``tree`` holds both a request that gains from no node
    (:func:`~prefixattn.planner.node_choice.joining_requests`) and one that may: then the plan with the
    former apart (``SHARING_APART``) can differ, and is priced too. ``q_len``, ``shareable``: int64 per request;
    ``max_q_len``: ``q_len``'s largest.

    Only steps with a chunk (a request of more than ``rows_per_decode`` rows) are looked at: a decode request fails
    the request rule only at a few shareable tokens (fp16, head_dim 128: at most 4 at MHA, 36 at GQA 8), under nodes
    too short for the node rule to keep for its neighbours either, and decode steps skip the check's host time.
    """
    if tree.num_nodes == 0 or max_q_len <= rows_per_decode:
        return False
    joins = joining_requests(q_len=q_len, shareable=shareable, rows_per_shared=rows_per_shared,
                             rows_per_chunk=rows_per_chunk, rows_per_decode=rows_per_decode, group=group,
                             head_dim=head_dim, elt_bytes=elt_bytes)
    roots = tree.parent < 0
    cum = offsets(joins[tree.order].astype(np.int64))
    lb, rb = tree.lb[roots], tree.rb[roots]
    joined = cum[rb + 1] - cum[lb]
    return bool(((joined > 0) & (joined < rb - lb + 1)).any())


def modeled_faster(candidate: WorkList, current: WorkList) -> bool:
    """Whether ``candidate``'s modeled step time (:func:`~prefixattn.planner.stats.modeled_stats`) is below
    ``current``'s."""
    return modeled_stats(candidate)["modeled_step_us"] < modeled_stats(current)["modeled_step_us"]
