"""A vLLM scheduler that admits waiting requests by prefix group, in BatchLLM order (``scheduler_cls=...``).

vLLM admits waiting requests from the head of its waiting queue while the step's token budget and the KV cache
allow (its KV manager counts a shared, prefix-cached block once for all requests using it). This scheduler keeps
vLLM's scheduling loop - KV allocation, prefix caching, chunked prefill, preemption, async output - and replaces
only the waiting queue with :class:`PrefixGroupRequestQueue`, which groups the waiting requests by shared prompt
prefix (:func:`prefixattn.scheduling.group_prompts`) and orders the groups with a named policy
(:func:`prefixattn.scheduling.order_groups`, ``batchllm`` by default), weighing each request's decode by the
estimate in ``SamplingParams.extra_args["prefixattn_output_len"]``, else its group's estimate from the requests that
carry one, else its ``max_tokens`` (:func:`output_len_inputs`). Members of a group are contiguous, so they are
admitted together: the first member computes the prefix and the rest hit its blocks in the prefix cache (in the
same step, or the next one under chunked prefill), and prefixattn's attention backend then runs their shared KV
once per step.

Select it with ``LLM(..., scheduler_cls="prefixattn.integrations.vllm.scheduler.PrefixGroupScheduler")``: vLLM's async
scheduler, or its synchronous one where async scheduling is off. Options come from
``additional_config={"prefixattn": {"ordering": "batchllm", "levels": 1}}`` or the environment
(``PREFIXATTN_ORDERING``, ``PREFIXATTN_GROUP_LEVELS``).

Memory-centric admission (BatchLLM Algorithm 2; ``additional_config={"prefixattn": {"memory_admission": True}}``):
vLLM allocates a request's prompt blocks and reserves nothing for its decode growth, so a memory-bound offline batch
admits too much, then preempts and recomputes. With this option a waiting request starts only while the started
requests plus it, each projected to its prompt plus its reserved output (``SamplingParams.max_tokens``, or the
estimate in ``SamplingParams.extra_args["prefixattn_output_len"]`` when smaller, clipped at ``reservation_clip``),
fit ``kv_threshold`` of the KV cache; a group's shared prefix blocks count once. The reservation, the projection and
the decision are one piece of code, :class:`prefixattn.scheduling.admission.AdmissionRule`, the one
:class:`prefixattn.scheduling.TokenBatcher` applies and so the simulator's BatchLLM/BlendServe/prefixattn policies
(``tests/vllm/test_scheduler_admission.py`` checks that both make the same decisions on the same running set).
vLLM's loop still schedules running requests (decodes and partial prefills) before new ones.

``admission_projection`` picks the projection (:data:`prefixattn.scheduling.admission.PROJECTIONS`): ``"ends"``
(default here, in ``TokenBatcher`` and in ``prefixattn simulate``) sums every request at its end, as if all ended at
once, an upper bound; ``"peak"`` is the peak when each request grows one token per step and frees its blocks at its
end (:func:`prefixattn.scheduling.admission.projected_peak_blocks`): it admits more, and stays preemption-free as
long as the running requests decode every step (``bench/vllm_offline_batch.py`` measures both; ``TokenBatcher(...,
projection="peak")`` and ``prefixattn simulate --projection peak`` model it).

Memory, not a request count, is what limits a step: vLLM's own admission stops at the first request whose KV
blocks do not fit. vLLM's model runner still has ``max_num_seqs`` request slots (its persistent buffers are sized by
it, a scheduler cannot change that); :func:`memory_bound_engine_kwargs` sets it high enough that the KV cache binds
first.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from prefixattn.integrations.vllm.version import check_vllm_version

check_vllm_version()

from prefixattn.scheduling import ORDERINGS, group_prompts, order_groups  # noqa: E402
from prefixattn.scheduling.admission import PROJECTIONS, AdmissionRule, blocks, growth  # noqa: E402
from prefixattn.scheduling.output_lengths import request_output_lens  # noqa: E402
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
#: Fraction of the KV cache memory-centric admission may plan to fill (BatchLLM's ``M_threshold``): a little
#: headroom for outputs that outrun their reservation (an estimate smaller than ``max_tokens``).
DEFAULT_KV_THRESHOLD = 0.95
#: ``SamplingParams.extra_args`` key of a per-request output-length estimate (tokens) for the reservation.
OUTPUT_LEN_KEY = "prefixattn_output_len"


def scheduling_options(vllm_config=None) -> dict[str, Any]:
    """``{"ordering", "levels", "memory_admission", "kv_threshold", "reservation_clip", "admission_projection"}`` from
    ``additional_config["prefixattn"]`` (ordering and levels also from the environment)."""
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
    memory = own.get("memory_admission", False)
    threshold = own.get("kv_threshold", DEFAULT_KV_THRESHOLD)
    clip = own.get("reservation_clip")
    if not isinstance(memory, bool):
        raise ValueError(f"additional_config['{CONFIG_KEY}']['memory_admission']: expected a bool, got {memory!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(f"additional_config['{CONFIG_KEY}']['kv_threshold']: expected a fraction in (0, 1], got "
                         f"{threshold!r}")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int) or clip < 1):
        raise ValueError(f"additional_config['{CONFIG_KEY}']['reservation_clip']: expected a positive int or None, "
                         f"got {clip!r}")
    projection = own.get("admission_projection", PROJECTIONS[0])
    if projection not in PROJECTIONS:
        raise ValueError(f"additional_config['{CONFIG_KEY}']['admission_projection']: expected one of {PROJECTIONS}, "
                         f"got {projection!r}")
    return dict(ordering=ordering, levels=levels, memory_admission=memory, kv_threshold=float(threshold),
                reservation_clip=clip, admission_projection=projection)


def group_order(prompts: list[list[int]], *, ordering: str = DEFAULT_ORDERING, levels: int = DEFAULT_LEVELS,
                min_shared_tokens: int = 1, known=None, limits=None) -> list[int]:
    """Indices of ``prompts`` in admission order: grouped by shared prefix, groups ordered by ``ordering``.

    ``known`` (an output-length estimate per prompt, NaN where none) and ``limits`` (``max_tokens`` per prompt, inf
    where none) give the ordering its decode weights
    (:func:`prefixattn.scheduling.output_lengths.request_output_lens`); both None: lengths unknown (constant).

    Examples
    --------
    >>> group_order([[1] * 50 + [2], [4, 5, 6], [1] * 50 + [3]])
    [1, 0, 2]
    """
    return _grouped(prompts, ordering=ordering, levels=levels, min_shared_tokens=min_shared_tokens, known=known,
                    limits=limits)[0]


def output_len_inputs(requests) -> tuple[list[float], list[float]]:
    """``(known, limits)`` of vLLM requests for :func:`group_order`: the ``extra_args`` estimate
    (:data:`OUTPUT_LEN_KEY`, NaN where none) and ``max_tokens`` (inf where none), both less the tokens a request
    already generated."""
    known, limits = [], []
    for r in requests:  # pooling requests have no sampling params and no max_tokens: unknown, unlimited
        done = int(getattr(r, "num_output_tokens", 0))
        limit = getattr(r, "max_tokens", None)
        limits.append(math.inf if limit is None else max(0.0, float(limit) - done))
        extra = getattr(getattr(r, "sampling_params", None), "extra_args", None) or {}
        estimate = extra.get(OUTPUT_LEN_KEY)
        known.append(math.nan if estimate is None else max(0.0, float(estimate) - done))
    return known, limits


def _grouped(prompts, *, ordering, levels, min_shared_tokens, known=None, limits=None) -> tuple[list[int], list]:
    """Admission order and, per prompt, ``(group index, top-level prefix_len)`` of its group."""
    if not prompts:
        return [], []
    groups = group_prompts(prompts, levels=levels, min_shared_tokens=min_shared_tokens)
    lens = None
    if known is not None or limits is not None:
        lens = request_output_lens(groups, [math.nan] * len(prompts) if known is None else known, limits)
    groups = order_groups(groups, ordering, output_lens=lens)
    order, group_of = [], [None] * len(prompts)
    for k, g in enumerate(groups):
        order.extend(g.request_ids)
        for i in g.request_ids:
            group_of[i] = (k, g.prefix_len)
    return order, group_of


class MemoryAdmission:
    """BatchLLM Algorithm 2 over vLLM's running set (see the module notes): whether a waiting request may start.

    The reservation, the projection and the decision are :class:`prefixattn.scheduling.admission.AdmissionRule`'s
    (the rule :class:`prefixattn.scheduling.TokenBatcher` applies); this class only reads vLLM's requests into the
    rule's ``(now, more)`` columns and counts each group's shared prefix blocks once.
    """

    def __init__(self, scheduler, *, kv_threshold: float, reservation_clip: int | None,
                 projection: str = PROJECTIONS[0]) -> None:
        self.scheduler = scheduler
        self.block_size = int(scheduler.block_size)
        # vLLM's block pool keeps one null block that no request can hold
        self.rule = AdmissionRule(capacity=kv_threshold * (int(scheduler.kv_cache_config.num_blocks) - 1),
                                  block_size=self.block_size, projection=projection, clip=reservation_clip)
        self.group_of: dict[str, tuple] = {}  # request id -> (group key, shared prefix tokens)
        self.refused = 0  # times a request was held back (reported by the benchmark)

    @property
    def projection(self) -> str:
        return self.rule.projection

    def _reserved(self, request) -> int:
        """Reserved output tokens: the ``extra_args`` estimate, at most ``max_tokens``, clipped."""
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        limit = int(request.max_tokens)
        return self.rule.reservation(float(extra.get(OUTPUT_LEN_KEY, limit)), limit)[1]

    def _columns(self, request) -> tuple[int, int, tuple | None]:
        """``(now, more, prefix)`` of a request: the tokens it holds alone once prefilled (a partial prefill counts
        as complete; a recomputation may hold more), its reserved output still to come, and its group's shared
        full-block prefix ``(group key, tokens)`` (None: none), counted once per group."""
        group = self.group_of.get(request.request_id)
        shared = 0 if group is None else (group[1] // self.block_size) * self.block_size
        generated = int(request.num_output_tokens)
        now = max(int(request.num_computed_tokens) - shared, int(request.num_prompt_tokens) - shared + generated)
        more = int(growth(now, self._reserved(request), generated)[1])
        return now, more, (group[0], shared) if shared else None

    def admits(self, request) -> bool:
        running = self.scheduler.running
        now, more, prefixes = [], [], {}
        for r in running:
            n, m, prefix = self._columns(r)
            now.append(n)
            more.append(m)
            if prefix:
                prefixes[prefix[0]] = prefix[1]
        started = self.rule.start(now, more, shared_blocks=sum(blocks(t, self.block_size) for t in prefixes.values()))
        n, m, prefix = self._columns(request)
        shared = blocks(prefix[1], self.block_size) if prefix and prefix[0] not in prefixes else 0
        ok = started.fits(n, m, shared=shared, anything_started=bool(running))
        self.refused += not ok
        return ok


class PrefixGroupRequestQueue(RequestQueue):
    """vLLM waiting queue that hands out requests grouped by shared prompt prefix, groups in policy order.

    New arrivals are regrouped together with the requests still waiting the next time the scheduler looks at the
    queue (once per step at most: vLLM adds requests between steps). Requests put back at the front (preempted, or
    skipped this step) keep vLLM's FCFS front semantics and go first. Under vLLM's ``priority`` policy, priority
    stays the primary key and grouping orders requests of equal priority. Requests without prompt token ids (prompt
    embeddings) keep their arrival order after the grouped ones.
    """

    def __init__(self, *, ordering: str = DEFAULT_ORDERING, levels: int = DEFAULT_LEVELS,
                 min_shared_tokens: int = 1, by_priority: bool = False,
                 admission: MemoryAdmission | None = None) -> None:
        self.admission = admission
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
        known, limits = output_len_inputs(with_ids)
        order, group_of = _grouped([list(r.prompt_token_ids) for r in with_ids], ordering=self.ordering,
                                   levels=self.levels, min_shared_tokens=self.min_shared_tokens, known=known,
                                   limits=limits)
        if self.admission is not None:
            # group keys are unique per regrouping; a member regrouped later counts its prefix again (conservative)
            self.admission.group_of.update((r.request_id, ((self.regroupings, g[0]), g[1]))
                                           for r, g in zip(with_ids, group_of) if g is not None)
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
        """Whether a request may be admitted now: vLLM's admission loop stops at False. With memory-centric
        admission, False also while the next request's projected KV does not fit (``len`` still counts it)."""
        if not (self._front or self._ordered or self._pending):
            return False
        return self.admission is None or self.admission.admits(self.peek_request())

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
        by_priority=scheduler.policy == SchedulingPolicy.PRIORITY,
        admission=MemoryAdmission(scheduler, kv_threshold=options["kv_threshold"],
                                  reservation_clip=options["reservation_clip"],
                                  projection=options["admission_projection"])
        if options["memory_admission"] else None)


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
