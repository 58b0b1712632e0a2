"""The planner's choice between sharing plans: the nodes the cost rule kept, the same with the requests that gain
from no node apart, or no sharing (:func:`choose`), decided on the split stage's modeled launch times before any
work list is built (one work list per step).

The per-node cost rule (:mod:`prefixattn.planner.cost_rule`) counts bytes: the KV reads a node saves against the
partial states it adds. It does not see the shared class's own launch (its programs' fixed cost, its last wave and
the gap before the next class's launch, which waits for it), and in a short step that launch can cost more than the
reads it saves (modeled, sm90: 32 decodes of GQA 32:4 under a 256-token prefix, 54.9 us shared against 49.2 us
unshared). Pricing the launch needs the whole step's split, so a cheap screen runs first
(:func:`shared_launch_may_lose`) and, only where it fires, the unshared candidate is split and the two modeled
step times compared (:func:`~prefixattn.planner.stats.modeled_faster`; with ``overlap=True`` as the step would run,
:func:`~prefixattn.planner.overlap.overlap_faster`). Both use :mod:`prefixattn.autotune.program_cost`: modeled,
never measured.

Requests apart: a node's byte rule sums over its requests, so a node that pays for its decode rows takes the prefill
chunks under the same prefix too, whose full chunk tiles gain no KV reads and add merge states
(:func:`prefixattn.planner.cost_rule.request_sharing_pays_off`). Leaving them out is not always faster: a chunk's
suffix tiles then read the whole prefix in a few long programs, where the shared class spread it over every SM
(modeled, sm90, 7 chunks of 128 rows + 256 decodes under 8,192-token prefixes, MHA: 791 us with the chunks in the
nodes, 863 us apart; 7 chunks of 2,048 rows under a 256-token prefix: 3,721 us in, 3,653 apart, and measured on an
H200 the plan with them in was 10% slower than no sharing). So where a node holds both kinds
(:func:`~prefixattn.planner.node_choice.requests_may_stay_apart`) both candidates are priced.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixattn.autotune.program_cost import LAUNCH_GAP_US
from prefixattn.kernels import layout as K
from prefixattn.lcp_tree import LcpTree
from prefixattn.planner.node_choice import requests_may_stay_apart
from prefixattn.planner.options import SHARING_APART
from prefixattn.planner.overlap import overlap_faster
from prefixattn.planner.split_rule import Split
from prefixattn.planner.stats import chained_faster, modeled_faster
from prefixattn.planner.work_list import SharedNodes

#: The screen prices the unshared candidate (host time) only where the shared launch costs more than this fraction of
#: an optimistic estimate of what its nodes save: each member beyond the first reads the node's KV once less, at the
#: decode class's per-tile cost spread over every slot. Steps with long shared prefixes save 10-1000x their shared
#: launch and never pay for the second plan; the fraction leaves the estimate a 4x margin before it could skip a
#: step the comparison would have changed.
UNSHARED_CHECK_RATIO = 0.25


@dataclass(slots=True)
class Choice:
    """The chosen candidate: its nodes, each request's suffix start, its split; ``apart``: the requests that gain
    from no node were left out of the nodes; ``declined``: the step runs unshared although the cost rule kept
    nodes."""

    nodes: SharedNodes
    suffix_start: object
    split: Split
    apart: bool
    declined: bool


def choose(backend, tree: LcpTree, inputs, o, tiles, *, num_sms: int, costs: tuple, priced: bool,
           chained: bool = False) -> Choice:
    """The nodes and split of the step's plan (module docstring). ``backend``: the planner's stages
    (:mod:`prefixattn.planner.backend`); ``o``: the plan's :class:`~prefixattn.planner.options.PlanOptions`;
    ``costs``: each class's :class:`~prefixattn.autotune.program_cost.ProgramCost`; ``priced``: ``sharing="auto"``
    on a known planning GPU (a host without one, the interpreter, has no launches to price: the cost rule's nodes
    stand); ``chained``: the plan's launches chain by PDL (:mod:`prefixattn.autotune.pdl`), and its candidates are
    priced so (:func:`~prefixattn.planner.stats.chained_faster`; ``overlap=True`` prices them overlapped first)."""
    def candidate(sharing: str):
        nodes, suffix_start = backend.nodes(tree, inputs, o, tiles, sharing=sharing)
        return nodes, suffix_start, backend.split(nodes, suffix_start, inputs, o, tiles, num_sms=num_sms,
                                                  costs=costs)

    nodes, suffix_start, split = candidate(o.sharing)
    apart = declined = False
    # Candidates priced as the step would run.
    faster = overlap_faster if o.overlap else chained_faster if chained else modeled_faster
    if priced and requests_may_stay_apart(tree, q_len=inputs.q_len, max_q_len=inputs.max_q_len,
                                          shareable=inputs.shareable, group=o.group, head_dim=o.cost_head_dim,
                                          elt_bytes=o.kv_dtype.itemsize, **tiles.tile_rows(o.group).rule_args):
        alt = candidate(SHARING_APART)  # the plan with them apart too: the faster (modeled)
        if faster(alt[2], split):
            (nodes, suffix_start, split), apart = alt, True
    if priced and len(nodes) and shared_launch_may_lose(split.reads_saved, split.modeled, costs,
                                                        num_kv_heads=o.num_kv_heads, num_sms=num_sms):
        alt = candidate("never")  # a short step: unshared too, the faster (modeled)
        if faster(alt[2], split):
            (nodes, suffix_start, split), declined = alt, True
    return Choice(nodes=nodes, suffix_start=suffix_start, split=split, apart=apart, declined=declined)


def shared_launch_may_lose(reads_saved: int, modeled, costs: tuple, *, num_kv_heads: int, num_sms: int) -> bool:
    """Whether the shared class's modeled launch (its makespan plus :data:`LAUNCH_GAP_US`) exceeds
    :data:`UNSHARED_CHECK_RATIO` of the suffix-class time its nodes save, estimated optimistically (see the
    constant). ``reads_saved``: the KV positions per KV head the nodes save
    (:func:`~prefixattn.planner.split_rule.shared_reads_saved`); ``costs``: the step's ``(shared, chunk, decode)``
    :class:`~prefixattn.autotune.program_cost.ProgramCost`; ``modeled``: the sharing candidate's modeled launches
    (:attr:`Split.modeled <prefixattn.planner.split_rule.Split.modeled>`)."""
    shared_us = float(modeled[K.CLASS_SHARED, 0]) + LAUNCH_GAP_US
    decode = costs[K.CLASS_DECODE]
    saved_us = reads_saved * num_kv_heads / decode.block_n * decode.tile_us / (num_sms * decode.slots_per_sm)
    return shared_us > UNSHARED_CHECK_RATIO * saved_us
