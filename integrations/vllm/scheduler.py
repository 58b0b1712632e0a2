"""A vLLM scheduler that admits waiting requests by prefix group, in BatchLLM order (``scheduler_cls=...``).

vLLM admits waiting requests from the head of its waiting queue while the step's token budget and the KV cache
allow (its KV manager counts a shared, prefix-cached block once for all requests using it). This scheduler keeps
vLLM's scheduling loop - KV allocation, prefix caching, chunked prefill, preemption, async output - and replaces
only the waiting queue with :class:`PrefixGroupRequestQueue`, which groups the waiting requests by shared prompt
prefix (:func:`prefixattn.scheduling.group_prompts`) and orders the groups with a named policy
(:func:`prefixattn.scheduling.order_groups`, ``batchllm`` by default). Members of a group are contiguous, so they are
admitted together: the first member computes the prefix and the rest hit its blocks in the prefix cache (in the
same step, or the next one under chunked prefill), and prefixattn's attention backend then runs their shared KV
once per step.

Select it with ``LLM(..., scheduler_cls="integrations.vllm.scheduler.PrefixGroupScheduler")``: vLLM's async
scheduler, or its synchronous one where async scheduling is off. Options come from
``additional_config={"prefixattn": {"ordering": "batchllm", "levels": 1}}`` or the environment
(``PREFIXATTN_ORDERING``, ``PREFIXATTN_GROUP_LEVELS``).

Memory, not a request count, is what limits a step: vLLM's own admission stops at the first request whose KV
blocks do not fit. vLLM's model runner still has ``max_num_seqs`` request slots (its persistent buffers are sized by
it, a scheduler cannot change that); :func:`memory_bound_engine_kwargs` sets it high enough that the KV cache binds
first.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from integrations.vllm.version import check_vllm_version

check_vllm_version()

from prefixattn.scheduling import ORDERINGS, group_prompts, order_groups  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

#: Policy used when none is configured: BatchLLM Eq. 4 (groups with less prefill work per request first).
DEFAULT_ORDERING = "batchllm"
#: Group nesting depth: 1 is BatchLLM's single-level grouping; deeper nesting changes which requests are adjacent
#: only within a top-level group, which the prefix cache and the attention plan handle anyway.
DEFAULT_LEVELS = 1
#: Request slots :func:`memory_bound_engine_kwargs` asks vLLM's model runner for: its per-slot buffers cost a few
#: KB each, and BatchLLM-scale offline batches run several hundred requests per step.
MEMORY_BOUND_MAX_NUM_SEQS = 1024
CONFIG_KEY = "prefixattn"


def scheduling_options(vllm_config=None) -> dict[str, Any]:
    """``{"ordering": str, "levels": int}`` from ``additional_config["prefixattn"]``, else the environment."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    own = extra.get(CONFIG_KEY, {}) if isinstance(extra, dict) else {}
    ordering = own.get("ordering", os.environ.get("PREFIXATTN_ORDERING", DEFAULT_ORDERING))
    levels = own.get("levels", os.environ.get("PREFIXATTN_GROUP_LEVELS", DEFAULT_LEVELS))
    if ordering not in ORDERINGS:
        raise ValueError(f"additional_config['{CONFIG_KEY}']['ordering']: expected one of {sorted(ORDERINGS)}, "
                         f"got {ordering!r}")
    try:
        levels = int(levels)
    except (TypeError, ValueError):
        levels = -1
    if levels < 1:
        raise ValueError(f"additional_config['{CONFIG_KEY}']['levels']: expected a positive int, got "
                         f"{own.get('levels', os.environ.get('PREFIXATTN_GROUP_LEVELS'))!r}")
    return dict(ordering=ordering, levels=levels)


def group_order(prompts: list[list[int]], *, ordering: str = DEFAULT_ORDERING, levels: int = DEFAULT_LEVELS,
                min_shared_tokens: int = 1) -> list[int]:
    """Indices of ``prompts`` in admission order: grouped by shared prefix, groups ordered by ``ordering``.

    Examples
    --------
    >>> group_order([[1] * 50 + [2], [4, 5, 6], [1] * 50 + [3]])
    [1, 0, 2]
    """
    if not prompts:
        return []
    groups = group_prompts(prompts, levels=levels, min_shared_tokens=min_shared_tokens)
    return [i for g in order_groups(groups, ordering) for i in g.request_ids]


class PrefixGroupRequestQueue(RequestQueue):
    """vLLM waiting queue that hands out requests grouped by shared prompt prefix, groups in policy order.

    New arrivals are regrouped together with the requests still waiting the next time the scheduler looks at the
    queue (once per step at most: vLLM adds requests between steps). Requests put back at the front (preempted, or
    skipped this step) keep vLLM's FCFS front semantics and go first. Under vLLM's ``priority`` policy, priority
    stays the primary key and grouping orders requests of equal priority. Requests without prompt token ids (prompt
    embeddings) keep their arrival order after the grouped ones.
    """

    def __init__(self, *, ordering: str = DEFAULT_ORDERING, levels: int = DEFAULT_LEVELS,
                 min_shared_tokens: int = 1, by_priority: bool = False) -> None:
        self.ordering = ordering
        self.levels = levels
        self.min_shared_tokens = min_shared_tokens
        self.by_priority = by_priority
        self._front: deque = deque()  # put back by the scheduler: served first, as given
        self._ordered: deque = deque()  # grouped and ordered
        self._pending: list = []  # arrived since the last regrouping
        self.regroupings = 0

    # -- ordering
    def _regroup(self) -> None:
        if not self._pending:
            return
        waiting = list(self._ordered) + self._pending
        with_ids = [r for r in waiting if r.prompt_token_ids]
        without = [r for r in waiting if not r.prompt_token_ids]
        order = group_order([list(r.prompt_token_ids) for r in with_ids], ordering=self.ordering,
                            levels=self.levels, min_shared_tokens=self.min_shared_tokens)
        ranked = [with_ids[i] for i in order] + without
        if self.by_priority:
            ranked.sort(key=lambda r: r.priority)  # stable: grouping order within a priority
        self._ordered = deque(ranked)
        self._pending = []
        self.regroupings += 1

    # -- RequestQueue
    def add_request(self, request) -> None:
        self._pending.append(request)

    def pop_request(self):
        self._regroup()
        if self._front:
            return self._front.popleft()
        if not self._ordered:
            raise IndexError("pop from an empty queue")
        return self._ordered.popleft()

    def peek_request(self):
        self._regroup()
        if self._front:
            return self._front[0]
        if not self._ordered:
            raise IndexError("peek from an empty queue")
        return self._ordered[0]

    def prepend_request(self, request) -> None:
        self._front.appendleft(request)

    def prepend_requests(self, requests: Iterable) -> None:
        self._front.extendleft(requests)  # same order semantics as vLLM's FCFS queue

    def remove_request(self, request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable) -> None:
        drop = set(requests) if not isinstance(requests, set) else requests
        self._front = deque(r for r in self._front if r not in drop)
        self._ordered = deque(r for r in self._ordered if r not in drop)
        self._pending = [r for r in self._pending if r not in drop]

    def __bool__(self) -> bool:
        return bool(self._front or self._ordered or self._pending)

    def __len__(self) -> int:
        return len(self._front) + len(self._ordered) + len(self._pending)

    def __iter__(self) -> Iterator:
        self._regroup()
        yield from list(self._front)
        yield from list(self._ordered)


def _install_queue(scheduler: Scheduler) -> None:
    options = scheduling_options(scheduler.vllm_config)
    is_async = isinstance(scheduler, AsyncScheduler)
    if bool(scheduler.vllm_config.scheduler_config.async_scheduling) != is_async:
        # vLLM's async scheduler keeps output placeholders that only the async engine loop resolves.
        want = "PrefixGroupScheduler" if not is_async else "PrefixGroupSyncScheduler"
        raise ValueError(f"scheduler_cls: async_scheduling={scheduler.vllm_config.scheduler_config.async_scheduling} "
                         f"needs {__name__}.{want}, got {type(scheduler).__name__}")
    if scheduler.waiting:
        raise RuntimeError("PrefixGroupScheduler: the waiting queue must be replaced before requests arrive")
    scheduler.waiting = PrefixGroupRequestQueue(
        ordering=options["ordering"], levels=options["levels"],
        # Sharing shorter than a block saves no KV block and no attention work: not worth keeping together.
        min_shared_tokens=max(1, int(scheduler.block_size)),
        by_priority=scheduler.policy == SchedulingPolicy.PRIORITY)


class PrefixGroupScheduler(AsyncScheduler):
    """vLLM's async scheduler admitting waiting requests by prefix group in BatchLLM (or another) order.

    The one name to pass as ``scheduler_cls``: where async scheduling ends up off (``async_scheduling=False``, or a
    platform that turns it off, such as vLLM's CPU platform) it builds a :class:`PrefixGroupSyncScheduler`.
    """

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is PrefixGroupScheduler and vllm_config is not None \
                and not vllm_config.scheduler_config.async_scheduling:
            return PrefixGroupSyncScheduler(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _install_queue(self)


class PrefixGroupSyncScheduler(Scheduler):
    """The same with vLLM's synchronous scheduler (for engines run with async scheduling off)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _install_queue(self)


def memory_bound_engine_kwargs(**overrides) -> dict[str, Any]:
    """``LLM(**kwargs)`` for offline prefix-shared batches: prefixattn's backend and scheduler, prefix caching on,
    and enough request slots that KV memory, not ``max_num_seqs``, limits each step.

    Examples
    --------
    >>> llm = LLM(model, **memory_bound_engine_kwargs())
    """
    kwargs = dict(
        attention_backend="PREFIXATTN", enable_prefix_caching=True, max_num_seqs=MEMORY_BOUND_MAX_NUM_SEQS,
        scheduler_cls=f"{__name__}.PrefixGroupScheduler")
    kwargs.update(overrides)
    return kwargs
