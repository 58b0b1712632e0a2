"""The state :class:`prefixattn.scheduling.TokenBatcher` keeps: requests, prefix levels, one step's context.

Requests live in slots of growable numpy columns (the decode path reads and updates all decoding requests at once);
prefix levels in plain lists (few, touched one at a time). Both are data with their own bookkeeping (a new slot, a
decoded token, a level chain's counts); the scheduling rules are in :mod:`prefixattn.scheduling.token_batching`, the
queues in :mod:`prefixattn.scheduling.work_queues`, the KV block count in :mod:`prefixattn.scheduling.kv_ledger`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable

import numpy as np

from prefixattn.scheduling.admission import growth
from prefixattn.scheduling.grouping import PrefixGroup
from prefixattn.scheduling.step_batch import ChunkList

#: Slots allocated before the first group arrives; the columns double when full.
INITIAL_SLOTS = 64


class RequestState(IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    FINISHED = 3
    ABORTED = 4


#: ``RequestStore`` columns: (name, dtype, fill of new slots) and what each holds, per slot.
REQUEST_COLUMNS = (
    ("rid", np.int64, 0),  # request id
    ("node", np.int64, -1),  # deepest prefix level, -1 for none
    ("base", np.int64, 0),  # tokens before the request's own part (its deepest prefix length)
    ("own", np.int64, 0),  # prompt tokens after the prefix
    ("target", np.int64, 0),  # own tokens to prefill now (own, or more when recomputing)
    ("computed", np.int64, 0),  # own tokens whose KV is held
    ("generated", np.int64, 0),  # output tokens produced
    ("est_out", np.int64, 0),  # output tokens reserved (the estimate, clipped)
    ("est_full", np.int64, 0),  # the estimate, unclipped (class projections)
    ("cls", np.int64, 0),  # memory class
    ("rank", np.int64, 0),  # admission rank (order of the groups as added)
    ("last", np.int64, 0),  # last step the request computed anything
    ("state", np.int8, 0),  # RequestState
)


class RequestStore:
    """Requests by slot, as numpy columns (see :data:`REQUEST_COLUMNS`); ``slot`` maps request ids to slots."""

    rid: np.ndarray
    node: np.ndarray
    base: np.ndarray
    own: np.ndarray
    target: np.ndarray
    computed: np.ndarray
    generated: np.ndarray
    est_out: np.ndarray
    est_full: np.ndarray
    cls: np.ndarray
    rank: np.ndarray
    last: np.ndarray
    state: np.ndarray

    def __init__(self) -> None:
        self.n = 0  # slots in use
        self.slot: dict[int, int] = {}
        for name, dtype, fill in REQUEST_COLUMNS:
            setattr(self, name, np.full(INITIAL_SLOTS, fill, dtype=dtype))

    def grow(self, need: int) -> None:
        """Room for ``need`` more slots."""
        cap = self.rid.shape[0]
        if self.n + need <= cap:
            return
        new = max(cap * 2, self.n + need)
        for name, dtype, fill in REQUEST_COLUMNS:
            arr = np.full(new, fill, dtype=dtype)
            arr[:cap] = getattr(self, name)
            setattr(self, name, arr)

    def add(self, r: int, prompt_len: int, node: int, base: int, rank: int, step: int) -> int:
        """A new slot for request ``r`` below prefix level ``node`` (``base`` tokens of its ``prompt_len``), waiting
        to start, at admission rank ``rank``, added at ``step``; the estimates and the class are the caller's."""
        s = self.n
        self.n += 1
        self.slot[r] = s
        self.rid[s] = r
        self.node[s] = node
        self.base[s] = base
        self.own[s] = prompt_len - base
        self.target[s] = prompt_len - base
        self.rank[s] = rank
        self.last[s] = step
        return s

    def decoded(self, idx, step: int) -> None:
        """Slots ``idx`` (one, or an array of distinct slots) computed one more token at ``step``: the KV of their
        pending output token, whose logits give the next one."""
        self.computed[idx] += 1
        self.generated[idx] += 1
        self.last[idx] = step

    def started_growth(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The admission rule's ``(now, more)`` (:mod:`prefixattn.scheduling.admission`) of started slots ``idx``:
        their prompt and output so far (or what they hold, when more) and their reserved output still to come."""
        return growth(np.maximum(self.computed[idx], self.own[idx] + self.generated[idx]), self.est_out[idx],
                      self.generated[idx])

    def waiting_growth(self, s: int) -> tuple[int, int]:
        """``(now, more)`` of waiting slot ``s``: its prefill (or recomputation) target and its reserved output
        still to come."""
        now, more = growth(int(self.target[s]), int(self.est_out[s]), int(self.generated[s]))
        return now, int(more)

    def state_name(self, s: int) -> str:
        """Slot ``s``'s :class:`RequestState`, lower case (for messages)."""
        return RequestState(int(self.state[s])).name.lower()

    def slot_of(self, request_id) -> int:
        s = self.slot.get(int(request_id)) if isinstance(request_id, (int, np.integer)) else None
        if s is None:
            raise ValueError(f"request_id: expected a request added to this batcher, got {request_id!r}")
        return s


class PrefixLevels:
    """Shared prefix levels (one per shared level of every multi-request group), one list entry per level."""

    def __init__(self) -> None:
        self.start: list[int] = []  # first token of the level
        self.size: list[int] = []  # tokens of the level
        self.done: list[int] = []  # tokens computed
        self.parent: list[int] = []
        self.rank: list[int] = []
        self.rep: list[int] = []  # a member request id (its prompt holds the tokens)
        self.refs: list[int] = []  # unfinished requests below
        self.started_members: list[int] = []  # members (anywhere below) currently started
        self.done_step: list[int] = []  # step in which the level completed, -1 while incomplete
        self.kids: list[list[int]] = []  # child levels
        self.members: list[list[int]] = []  # slots whose deepest level this is
        self.active: list[bool] = []  # started (holding or computing KV)

    def __len__(self) -> int:
        return len(self.start)

    def new(self, start: int, size: int, parent: int, rank: int, rep: int) -> int:
        v = len(self.start)
        self.start.append(start)
        self.size.append(size)
        self.done.append(0)
        self.parent.append(parent)
        self.rank.append(rank)
        self.rep.append(rep)
        self.refs.append(0)
        self.started_members.append(0)
        self.done_step.append(-1)
        self.kids.append([])
        self.members.append([])
        self.active.append(False)
        if parent >= 0:
            self.kids[parent].append(v)
        return v

    def add_group(self, g: PrefixGroup, rank0: int, add_request: Callable[[int, int, int, int, int], int]
                  ) -> tuple[list[int], list[int]]:
        """A level for every shared level of ``g`` (admission ranks from ``rank0``, in ``g``'s request order), and
        ``add_request(request id, prompt length, level, base tokens, rank) -> slot`` for every request under its
        deepest level. Returns ``(top levels, slots of requests under no level)``: what admits the group."""
        top_nodes: list[int] = []
        top_slots: list[int] = []
        # (group, enclosing node, base tokens of the enclosing node)
        stack = [(g, -1, 0)]
        rank_of = {r: rank0 + i for i, r in enumerate(g.request_ids)}
        while stack:
            sub, parent, base = stack.pop()
            shared = sub.num_requests > 1 and sub.prefix_len > base
            if shared:
                node = self.new(base, sub.prefix_len - base, parent, rank_of[sub.request_ids[0]], sub.request_ids[0])
                here, here_base = node, sub.prefix_len
                if parent < 0:
                    top_nodes.append(node)
            else:
                here, here_base = parent, base
            nested = set()
            for c in reversed(sub.children):
                stack.append((c, here, here_base))
                nested.update(c.request_ids)
            for r, p in zip(sub.request_ids, sub.prompt_lens):
                if r in nested:
                    continue
                s = add_request(r, p, here, here_base, rank_of[r])
                if here >= 0:
                    self.members[here].append(s)
                    v = here
                    while v >= 0:
                        self.refs[v] += 1
                        v = self.parent[v]
                else:
                    top_slots.append(s)
        return top_nodes, top_slots

    def mark_started(self, v: int, delta: int) -> None:
        """A member below level ``v`` (-1: none) starts (``delta`` 1) or stops (-1)."""
        while v >= 0:
            self.started_members[v] += delta
            v = self.parent[v]

    def unref(self, v: int) -> list[int]:
        """A request below level ``v`` (-1: none) ended: the levels of ``v``'s chain that no unfinished request is
        below any more, innermost first."""
        unused = []
        while v >= 0:
            self.refs[v] -= 1
            if self.refs[v] == 0:
                unused.append(v)
            v = self.parent[v]
        return unused

    def chain(self, v: int) -> list[int]:
        """``v`` and its enclosing levels, innermost first (empty for -1)."""
        out = []
        while v >= 0:
            out.append(v)
            v = self.parent[v]
        return out

    def chain_ready(self, v: int, step: int) -> bool:
        """Every level of ``v``'s chain completed before ``step``."""
        while v >= 0:
            if self.done_step[v] < 0 or self.done_step[v] >= step:
                return False
            v = self.parent[v]
        return True


@dataclass
class StepContext:
    """What one :meth:`TokenBatcher.step` call accumulates: the chunks, the token budget left and what happened."""

    step: int
    budget: int
    plan: ChunkList = field(default_factory=ChunkList)
    preempted: list[int] = field(default_factory=list)  # request ids whose KV was dropped
    truncated: list[int] = field(default_factory=list)  # request ids stopped for good
    completed_prefill: list[int] = field(default_factory=list)  # slots whose last prefill chunk is in the plan
    scheduled: set[int] = field(default_factory=set)  # slots that run this step (not preemption victims)
