"""Prefix-group schedule policies for SGLang's waiting queue, ordered by :mod:`prefixattn.scheduling`.

SGLang's prefix-aware policy (``lpm``) turns itself into FCFS when more than 128 requests wait
(``WAITING_QUEUE_PREFIX_MATCH_MAX`` in sglang 0.5.23), which is exactly the offline-batch case: thousands of prompts
submitted at once come out in arrival order and requests sharing a document are spread over the whole run, so the
radix cache evicts the document between them. The policies here group the *whole* waiting queue by shared prompt
prefix with prefixattn's global scheduler and put each group's requests next to each other, groups in the order the
scheduler picks, with no cap on the queue length.

Selected by name, like SGLang's own policies: ``--schedule-policy prefixattn`` (the scheduler's default ordering) or
``--schedule-policy prefixattn-<ordering>`` for any ordering :mod:`prefixattn.scheduling` names.

Plumbing, through SGLang's plugin hook registry (all three hooks leave every other policy untouched):

* ``SchedulePolicy.__init__`` (around): a prefixattn policy name builds SGLang's FCFS policy (so SGLang keeps doing
  its own bookkeeping: cache matching for load reports, LRU touches) and attaches a :class:`PrefixGroupOrder`;
* ``SchedulePolicy.calc_priority`` (around): runs SGLang's FCFS pass, then reorders the queue in place;
* ``ServerArgs.add_cli_args`` (after): adds the policy names to ``--schedule-policy``'s choices (SGLang keeps that
  list inside a field annotation, so there is no ``add_*_choices`` function for it as there is for backends).

The queue is regrouped only when requests the policy has not ranked yet arrive; otherwise the cached ranks are
reused (admission only removes requests from the front, retraction puts known ones back).

Output lengths: the ``batchllm`` and ``blendserve`` orderings weigh groups by their decode work, so the policy hands
them one length per request (:func:`request_output_lens`): an estimate the request carries in
``SamplingParams.custom_params["prefixattn_output_len"]`` (measured on a sample, as BlendServe does), else its
group's estimate from the requests that carry one, else its ``max_new_tokens``; always capped at what it may still
generate (``max_new_tokens`` minus the tokens it already has, for a retracted request).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

#: ``--schedule-policy`` name of the default prefix-group ordering; ``prefixattn-<ordering>`` selects another one.
POLICY_NAME = "prefixattn"

_TARGET_INIT = "sglang.srt.managers.schedule_policy.SchedulePolicy.__init__"
_TARGET_CALC = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"
_TARGET_CLI = "sglang.srt.server_args.ServerArgs.add_cli_args"
_ATTR = "prefixattn_order"  # attribute of SGLang's SchedulePolicy holding our PrefixGroupOrder
#: ``SamplingParams.custom_params`` key of a per-request output-length estimate (tokens); the same name as the vLLM
#: scheduler's ``extra_args`` key.
OUTPUT_LEN_KEY = "prefixattn_output_len"

_hooks_registered = False


# ---------------------------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------------------------
def ordering_names() -> list[str]:
    """Orderings :mod:`prefixattn.scheduling` offers by name."""
    from prefixattn.scheduling import ORDERINGS

    return list(ORDERINGS)


def default_ordering() -> str:
    from prefixattn.scheduling import DEFAULT_ORDERING

    return DEFAULT_ORDERING


def policy_names() -> list[str]:
    """Every ``--schedule-policy`` name this module adds."""
    return [POLICY_NAME] + [f"{POLICY_NAME}-{name}" for name in ordering_names()]


def ordering_of(policy: str) -> str | None:
    """The scheduler ordering a policy name selects, or None when the name is not a prefixattn policy."""
    if policy == POLICY_NAME:
        return default_ordering()
    prefix = POLICY_NAME + "-"
    if isinstance(policy, str) and policy.startswith(prefix):
        ordering = policy[len(prefix):]
        if ordering not in ordering_names():
            raise ValueError(f"schedule_policy: expected one of {policy_names()}, got {policy!r}")
        return ordering
    return None


# ---------------------------------------------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------------------------------------------
def prefix_group_order(prompts: Sequence[Sequence[int]], ordering: str, *, known=None, limits=None) -> list[int]:
    """Indices of ``prompts`` with every prefix group contiguous, groups in ``ordering`` (prefixattn.scheduling).

    ``known`` (NaN where none) and ``limits`` (inf where none) are per-prompt output lengths, turned into the
    ordering's decode weights by :func:`prefixattn.scheduling.output_lengths.request_output_lens`; both None: lengths
    unknown (treated as constant).
    """
    from prefixattn.scheduling import group_prompts, order_groups
    from prefixattn.scheduling.output_lengths import request_output_lens

    groups = group_prompts(prompts)
    lens = None
    if known is not None or limits is not None:
        n = len(prompts)
        lens = request_output_lens(groups, [math.nan] * n if known is None else known, limits)
    return [int(i) for group in order_groups(groups, ordering, output_lens=lens) for i in group.members]


def output_len_inputs(reqs: Sequence) -> tuple[list[float], list[float]]:
    """``(known, limits)`` of SGLang ``Req`` objects for :func:`prefix_group_order`: the ``custom_params`` estimate
    (NaN where none) and ``max_new_tokens`` (inf where None), both less the output tokens a request already has."""
    known, limits = [], []
    for r in reqs:
        params = r.sampling_params
        done = len(r.output_ids)
        limit = params.max_new_tokens
        limits.append(math.inf if limit is None else max(0.0, float(limit) - done))
        estimate = (params.custom_params or {}).get(OUTPUT_LEN_KEY)
        if isinstance(estimate, bool) or not isinstance(estimate, (int, float)) or not estimate >= 0:
            if estimate is not None:
                raise ValueError(f"custom_params['{OUTPUT_LEN_KEY}'] of request {r.rid}: expected a length >= 0, "
                                 f"got {estimate!r}")
            known.append(math.nan)
        else:
            known.append(max(0.0, float(estimate) - done))
    return known, limits


class PrefixGroupOrder:
    """Sorts SGLang's waiting queue (a list of ``Req``) in place into prefix groups.

    Requests only group with requests of the same radix-cache namespace (``extra_key``, ``cache_salt``): prompts
    in different namespaces never share KV. Namespaces keep the order in which they first appear in the queue.

    Parameters
    ----------
    ordering : str
        A name in :func:`ordering_names`.
    order_fn : callable, optional
        ``(prompts, ordering, *, known, limits) -> indices``; default :func:`prefix_group_order`.
    """

    def __init__(self, ordering: str, *, order_fn: Callable | None = None):
        self.ordering = ordering
        self.order_fn = order_fn or prefix_group_order
        self._rank: dict[str, int] = {}
        self.regroups = 0  # how many times the queue was regrouped (new requests arrived)

    def sort(self, waiting_queue: list) -> None:
        if not waiting_queue:
            return
        if any(r.rid not in self._rank for r in waiting_queue):
            self._regroup(waiting_queue)
        waiting_queue.sort(key=lambda r: self._rank[r.rid])

    def _regroup(self, waiting_queue: list) -> None:
        namespaces: dict[tuple, list] = {}
        for r in waiting_queue:
            namespaces.setdefault((r.extra_key, r.cache_salt), []).append(r)
        rank: dict[str, int] = {}
        for reqs in namespaces.values():
            prompts = [list(r.origin_input_ids) + list(r.output_ids) for r in reqs]
            known, limits = output_len_inputs(reqs)
            for i in self.order_fn(prompts, self.ordering, known=known, limits=limits):
                rank[reqs[i].rid] = len(rank)
        self._rank = rank
        self.regroups += 1


# ---------------------------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------------------------
def _init_hook(original, self, policy, *args, **kwargs):
    ordering = ordering_of(policy)
    if ordering is None:
        return original(self, policy, *args, **kwargs)
    result = original(self, "fcfs", *args, **kwargs)
    setattr(self, _ATTR, PrefixGroupOrder(ordering))
    return result


def _calc_priority_hook(original, self, waiting_queue, *args, **kwargs):
    result = original(self, waiting_queue, *args, **kwargs)
    order = getattr(self, _ATTR, None)
    if order is not None:
        order.sort(waiting_queue)
    return result


def _add_cli_args_hook(result, parser, *args, **kwargs):
    # argparse keeps no public accessor for an added argument; its option-string table is stable since Python 2.7.
    action = parser._option_string_actions.get("--schedule-policy")
    if action is not None and action.choices is not None:
        choices = list(action.choices)
        action.choices = choices + [n for n in policy_names() if n not in choices]
    return result


def register_hooks() -> None:
    """Register the three hooks with SGLang's ``HookRegistry`` (once per process; SGLang applies them)."""
    global _hooks_registered
    if _hooks_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET_INIT, _init_hook, HookType.AROUND)
    HookRegistry.register(_TARGET_CALC, _calc_priority_hook, HookType.AROUND)
    HookRegistry.register(_TARGET_CLI, _add_cli_args_hook, HookType.AFTER)
    _hooks_registered = True
