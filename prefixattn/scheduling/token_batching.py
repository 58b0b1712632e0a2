"""Memory-centric token batching over prefix groups, one engine step at a time (BatchLLM sec. 4.3, Sarathi-Serve).

Each step fills a token budget in this order (BatchLLM's three queues with Sarathi's stall-free order):

1. decodes of running requests (one token each; if there are more than the budget, the longest-waiting first);
2. partially computed distinct prompts, then partially computed shared prefixes (chunked prefill continues);
3. distinct prompts whose prefix is complete (computed in an earlier step), in admission order;
4. the prefixes of nested groups whose parent prefix is complete;
5. new groups, in the given order: a group's first prefix chunk (or, for a singleton, its prompt).

New groups are admitted only when everything admitted before has started, so at most one group waits on memory
and admission stays in order (no starvation). Prefill chunks are as large as the remaining token budget allows.

KV memory is counted in blocks: a shared prefix's blocks are counted once for all its members (BatchLLM
Algorithm 2: the limit is memory, never a request count). With output-length estimates, a request is only started
when its estimated final footprint fits next to the others' (a reservation); when outputs run longer than
estimated and a decode needs a block that is not free, the latest-admitted request is preempted and later
recomputed (vLLM's recompute preemption; counted in :attr:`TokenBatcher.stats`). A request that cannot fit even
alone is rejected when added; one whose output outgrows the whole budget is stopped and reported as truncated.

Memory classes (optional; BlendServe's dual scanner, sec. 3.4: ``M_L + M_R = M``): each request has a class (e.g.
compute-intensive 0, memory-intensive 1) and each class a share of the KV blocks. While requests of another class
wait to start, a request starts only if its class's *projected peak* (the started requests of the class plus this
one, each growing by one token per step until its estimated output is done, then freeing its blocks) stays within
the class's share; the first request of a class always may start. With a reservation clip the projection is a
rolling horizon: each request grows for at most ``clip`` more steps from now, so a long output that has used up its
clipped reservation still counts as growing, not as about to end. Each class keeps its own admission order, so a
class at its share does not hold back the others: long-output requests cannot fill the pool and leave the steps a
few dozen decode tokens wide, and compute-heavy prefills keep running beside them.

Block accounting: a prefix level holds ``ceil(tokens / block_size)`` blocks and each request holds
``ceil(own tokens / block_size)`` for the tokens after its deepest shared prefix (its distinct prompt and its
output), which is what a paged cache with per-request copies of partially filled shared blocks needs at most.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple, Sequence

import numpy as np

from prefixattn.scheduling.admission import admits, blocks, projected_blocks, projected_peak_blocks, reserved_output
from prefixattn.scheduling.grouping import PrefixGroup

#: Largest accepted token budget per step: far above any GPU's useful batch (a few thousand tokens); larger values
#: are almost certainly a unit mistake (bytes or blocks passed as tokens).
MAX_TOKEN_BUDGET = 1 << 24
#: Largest accepted KV budget in blocks (2**32 blocks of 16 tokens is far beyond any device).
MAX_KV_BLOCKS = 1 << 32
#: Largest accepted block size in tokens.
MAX_BLOCK_SIZE = 1 << 16
#: Largest accepted output length or reservation clip in tokens: a sanity bound (2**40 tokens), not a model limit.
MAX_OUTPUT_TOKENS = 1 << 40


class ChunkKind(IntEnum):
    """What a scheduled chunk computes."""

    DECODE = 0  #: one output token of a running request
    DISTINCT = 1  #: prompt tokens of one request after its shared prefix (or recomputation after preemption)
    PREFIX = 2  #: tokens of a shared prefix level, computed once for the group


class Chunk(NamedTuple):
    """One unit of work of a step. ``request_id`` for a PREFIX chunk is a member whose prompt holds the tokens."""

    kind: ChunkKind
    request_id: int
    node: int
    start: int
    num_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """What to run in one engine step, as parallel arrays (one entry per chunk).

    Attributes
    ----------
    step : int
        Step number (0-based).
    kinds : np.ndarray
        ``[C]`` int8 :class:`ChunkKind` values.
    request_ids : np.ndarray
        ``[C]`` int64 request of each chunk (for PREFIX: a member whose prompt holds the prefix tokens).
    nodes : np.ndarray
        ``[C]`` int64 prefix level id for PREFIX chunks (see :meth:`TokenBatcher.prefix_node`), else the
        request's deepest shared level or -1.
    starts : np.ndarray
        ``[C]`` int64 position of the chunk's first token in the request's sequence (prompt then output).
    num_tokens : np.ndarray
        ``[C]`` int64 tokens to compute.
    preempted : tuple[int, ...]
        Requests whose KV was dropped this step; they are recomputed later (free their engine-side state).
    truncated : tuple[int, ...]
        Requests stopped because their output alone outgrew the KV budget: treat them as finished (length).
    freed_nodes : tuple[int, ...]
        Prefix levels whose KV was dropped since the previous plan (all their requests ended, or the level was
        released under memory pressure and will be recomputed): free their blocks.
    kv_blocks_used : int
        Blocks held after this step's allocations.
    """

    step: int
    kinds: np.ndarray
    request_ids: np.ndarray
    nodes: np.ndarray
    starts: np.ndarray
    num_tokens: np.ndarray
    preempted: tuple[int, ...]
    truncated: tuple[int, ...]
    freed_nodes: tuple[int, ...]
    kv_blocks_used: int

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks as named tuples (convenient, slower than the arrays)."""
        return [Chunk(ChunkKind(int(k)), int(r), int(n), int(s), int(t)) for k, r, n, s, t in
                zip(self.kinds, self.request_ids, self.nodes, self.starts, self.num_tokens)]

    def tokens_by_request(self) -> dict[int, int]:
        """Tokens computed per request this step (PREFIX chunks excluded: they belong to the group)."""
        out: dict[int, int] = {}
        for k, r, t in zip(self.kinds.tolist(), self.request_ids.tolist(), self.num_tokens.tolist()):
            if k != ChunkKind.PREFIX:
                out[r] = out.get(r, 0) + t
        return out


class PrefixNode(NamedTuple):
    """A shared prefix level: tokens ``[start, start + size)`` of every request below it."""

    start: int
    size: int
    representative: int  #: a member request id whose prompt holds the tokens
    parent: int  #: enclosing level, -1 at the top


class _State(IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    FINISHED = 3
    ABORTED = 4


def _check_int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value!r}")
    return int(value)


class TokenBatcher:
    """Step-by-step token batching of prefix groups under a token budget and a KV block budget.

    Parameters
    ----------
    token_budget : int
        Tokens per step (chunked-prefill chunk size, BatchLLM's ``S_chunk``).
    kv_blocks : int
        KV cache blocks available to requests (BatchLLM's ``M_threshold``).
    block_size : int
        Tokens per KV block.
    output_lens : None, float or array-like
        Estimated output length per request id (or a constant) used to reserve memory when starting requests;
        None reserves nothing (pure BatchLLM Algorithm 2: current usage only).
    max_output_len : int, optional
        Hard cap on output tokens per request; requests whose prompt plus this cap cannot fit are rejected when
        added (otherwise prompt plus one token must fit).
    reservation_clip : int, optional
        Cap on each request's output estimate *as a memory reservation* (SGLang's clip: a few very long outputs
        cannot reserve the whole pool); the memory-class projections look at most this many steps ahead of the
        current step (a rolling horizon over the full estimates).
    memory_classes : array-like of int, optional
        Class of each request id (``0 .. K-1``; ids beyond the array are class 0); needs ``class_shares``. The class
        projections use ``output_lens`` (without them, current holdings only).
    class_shares : sequence of float, optional
        ``[K]`` fraction of ``kv_blocks`` each class may fill (projected peak) while another class has requests
        waiting to start, each in ``[0, 1]`` (BlendServe: ``M_L + M_R = M``, so they sum to 1).

    Examples
    --------
    >>> from prefixattn.scheduling import group_prompts
    >>> b = TokenBatcher(token_budget=8, kv_blocks=16, block_size=4)
    >>> b.add_groups(group_prompts([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]]))
    >>> [(c.kind.name, c.request_id, c.start, c.num_tokens) for c in b.step().chunks]
    [('PREFIX', 0, 0, 5)]
    >>> [(c.kind.name, c.request_id, c.start, c.num_tokens) for c in b.step().chunks]
    [('DISTINCT', 0, 5, 1), ('DISTINCT', 1, 5, 1)]
    >>> [(c.kind.name, c.request_id, c.start) for c in b.step().chunks]
    [('DECODE', 0, 6), ('DECODE', 1, 6)]
    >>> b.finish(0); b.finish(1); b.done
    True
    """

    def __init__(self, *, token_budget: int, kv_blocks: int, block_size: int = 16, output_lens=None,
                 max_output_len: int | None = None, reservation_clip: int | None = None, memory_classes=None,
                 class_shares=None) -> None:
        self.token_budget = _check_int("token_budget", token_budget, 1, MAX_TOKEN_BUDGET)
        self.kv_blocks = _check_int("kv_blocks", kv_blocks, 1, MAX_KV_BLOCKS)
        self.block_size = _check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
        self.max_output_len = None if max_output_len is None else \
            _check_int("max_output_len", max_output_len, 1, MAX_OUTPUT_TOKENS)
        if output_lens is None:
            self._est = None
        elif np.isscalar(output_lens):
            if isinstance(output_lens, bool) or not isinstance(output_lens, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(output_lens) or output_lens < 0:
                raise ValueError(f"output_lens: expected None, a length >= 0 or one per request, got {output_lens!r}")
            self._est = float(output_lens)
        else:
            est = np.asarray(output_lens, dtype=np.float64)
            if est.ndim != 1 or not np.isfinite(est).all() or (est < 0).any():
                raise ValueError("output_lens: expected a 1-D array of finite lengths >= 0 (one per request id)")
            self._est = est
        self.reservation_clip = None if reservation_clip is None else \
            _check_int("reservation_clip", reservation_clip, 1, MAX_OUTPUT_TOKENS)
        self._classes, self._shares = self._check_classes(memory_classes, class_shares)
        k = 1 if self._shares is None else self._shares.shape[0]
        self._class_waiting = np.zeros(k, np.int64)  # requests of each class not started (waiting or preempted)
        self._class_started: list[dict[int, None]] = [{} for _ in range(k)]  # started slots of each class
        self._step = 0
        self._used = 0  # blocks held by nodes and requests
        self._slot: dict[int, int] = {}  # request id -> slot
        cap = 64
        self._rid = np.zeros(cap, np.int64)
        self._node = np.full(cap, -1, np.int64)  # deepest prefix node, -1 for none
        self._base = np.zeros(cap, np.int64)  # tokens before the request's own part (its deepest prefix length)
        self._own = np.zeros(cap, np.int64)  # prompt tokens after the prefix
        self._target = np.zeros(cap, np.int64)  # own tokens to prefill now (own, or more when recomputing)
        self._computed = np.zeros(cap, np.int64)  # own tokens whose KV is held
        self._generated = np.zeros(cap, np.int64)
        self._est_out = np.zeros(cap, np.int64)  # output tokens reserved (the estimate, clipped)
        self._est_full = np.zeros(cap, np.int64)  # the estimate, unclipped (class projections)
        self._cls = np.zeros(cap, np.int64)  # memory class
        self._rank = np.zeros(cap, np.int64)
        self._last = np.zeros(cap, np.int64)  # last step the request computed anything
        self._state = np.zeros(cap, np.int8)
        self._n = 0
        # prefix nodes (one per shared level of every multi-request group)
        self._n_start: list[int] = []  # first token of the level
        self._n_size: list[int] = []  # tokens of the level
        self._n_done: list[int] = []  # tokens computed
        self._n_parent: list[int] = []
        self._n_rank: list[int] = []
        self._n_rep: list[int] = []  # a member request id (its prompt holds the tokens)
        self._n_refs: list[int] = []  # unfinished requests below
        self._n_started_members: list[int] = []  # members (anywhere below) currently started
        self._n_done_step: list[int] = []  # step in which the level completed, -1 while incomplete
        self._n_kids: list[list[int]] = []  # child nodes
        self._n_members: list[list[int]] = []  # slots whose deepest node this is
        self._n_active: list[bool] = []  # started (holding or computing KV)
        # queues
        self._groups: list[tuple[list[int], list[int]]] = []  # pending groups: (top nodes, top-level slots)
        self._next_group = 0
        self._decoding: dict[int, None] = {}  # slots in decode, insertion ordered
        self._prefilling: dict[int, None] = {}  # slots with a partial prefill
        # per memory class, a heap (rank, slot): chain complete, not started
        self._ready: list[list[tuple[int, int]]] = [[] for _ in range(k)]
        self._ready_nodes: list[tuple[int, int]] = []  # heap (rank, node): parent complete, not started
        self._partial_nodes: dict[int, None] = {}
        self._active_nodes: dict[int, None] = {}  # started prefix levels (holding or computing KV)
        self._active_full_blocks = 0  # blocks of the active levels once complete (for reservations)
        self._freed_nodes: list[int] = []  # levels whose KV was dropped since the last plan
        self._open = 0  # requests neither finished nor aborted
        self._stats = dict(preemptions=0, recomputed_tokens=0, released_prefix_tokens=0, truncated=0, steps=0,
                           finished=0, aborted=0)

    # ----------------------------------------------------------------------------------------------- public API
    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``steps``, ``preemptions`` and the KV tokens they dropped (``recomputed_tokens``), prefix
        tokens dropped by releasing idle prefix levels (``released_prefix_tokens``), ``truncated``, ``finished``,
        ``aborted``."""
        return dict(self._stats)

    @property
    def kv_blocks_used(self) -> int:
        return self._used

    @property
    def done(self) -> bool:
        """Every added request finished or aborted."""
        return self._open == 0

    def prefix_node(self, node: int) -> PrefixNode:
        """The prefix level ``node`` (an id from :attr:`StepPlan.nodes`)."""
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or not 0 <= node < len(self._n_start):
            raise ValueError(f"node: expected a prefix level id in [0, {len(self._n_start)}), got {node!r}")
        return PrefixNode(self._n_start[node], self._n_size[node], self._n_rep[node], self._n_parent[node])

    def request_state(self, request_id: int) -> str:
        """``waiting``, ``prefill``, ``decode``, ``finished`` or ``aborted``."""
        return _State(int(self._state[self._slot_of(request_id)])).name.lower()

    def add_groups(self, groups: Sequence[PrefixGroup]) -> None:
        """Queue groups for admission, in the given order (e.g. from :func:`order_groups`).

        Raises
        ------
        ValueError
            A request id already added, a malformed group, or requests that can never fit in ``kv_blocks``
            (nothing is added then).
        """
        if isinstance(groups, PrefixGroup):
            groups = [groups]
        groups = list(groups)
        seen: set[int] = set()
        too_big = []
        bs = self.block_size
        min_out = self.max_output_len or 1
        for gi, g in enumerate(groups):
            if not isinstance(g, PrefixGroup):
                raise ValueError(f"groups[{gi}]: expected a PrefixGroup, got {type(g).__name__}")
            if len(g.request_ids) != len(g.prompt_lens) or not g.request_ids:
                raise ValueError(f"groups[{gi}]: expected one prompt length per request id and at least one request")
            for r, p in zip(g.request_ids, g.prompt_lens):
                if r in self._slot or r in seen:
                    raise ValueError(f"groups[{gi}]: request {r} was already added")
                if p < 1:
                    raise ValueError(f"groups[{gi}]: expected prompt lengths >= 1, got {p} for request {r}")
                seen.add(r)
            for sub, _ in g.walk():
                if sub.num_requests > 1 and sub.prefix_len > min(sub.prompt_lens) - 1:
                    raise ValueError(f"groups[{gi}]: expected prefix_len <= shortest prompt - 1 = "
                                     f"{min(sub.prompt_lens) - 1}, got {sub.prefix_len}")
            for r, chain_blocks, own in self._chains(g):
                if chain_blocks + -(-(own + min_out) // bs) > self.kv_blocks:
                    too_big.append(r)
        if too_big:
            raise ValueError(f"groups: requests {too_big[:8]}{'...' if len(too_big) > 8 else ''} can never fit: "
                             f"their shared prefix, prompt and {min_out} output token(s) need more than "
                             f"kv_blocks={self.kv_blocks} blocks of {bs} tokens")
        for g in groups:
            self._add_group(g)

    def step(self) -> StepPlan:
        """Plan the next engine step and account for it as executed.

        Returns
        -------
        StepPlan
            Requests whose last prefill chunk is in this plan produce their first output token in it and are
            decoded from the next step on; call :meth:`finish` for requests that end.
        """
        step = self._step
        plan = _PlanBuilder()
        self._budget = self.token_budget
        self._preempted: list[int] = []
        self._truncated: list[int] = []
        self._completed_prefill: list[int] = []
        self._scheduled: set[int] = set()
        self._schedule_decodes(plan, step)
        for s in list(self._prefilling):
            if self._budget == 0:
                break
            self._prefill_chunk(plan, s, step)
        for v in list(self._partial_nodes):
            if self._budget == 0:
                break
            self._node_chunk(plan, v, step)
        self._start_ready(plan, step)
        while not plan.size and self._open and self._relieve():
            # Nothing could run: memory is held by work that cannot finish without more of it (greedy
            # Algorithm 2 admission can fill memory with partial prefills and idle prefixes). Drop the latest
            # admitted such work and retry; the earliest waiting request fits alone (checked when added).
            for s in list(self._prefilling):
                self._prefill_chunk(plan, s, step)
            for v in list(self._partial_nodes):
                self._node_chunk(plan, v, step)
            self._start_ready(plan, step)
        for s in self._completed_prefill:
            if self._state[s] == _State.PREFILL:
                del self._prefilling[s]
                if self._generated[s] == 0:
                    self._generated[s] = 1  # the last prefill chunk's logits give the first output token
                self._state[s] = _State.DECODE
                self._decoding[s] = None
        self._step += 1
        self._stats["steps"] += 1
        freed, self._freed_nodes = self._freed_nodes, []
        return plan.build(step, self._preempted, self._truncated, freed, self._used)

    def finish(self, request_id: int) -> None:
        """Mark a decoding request finished (end of sequence or length limit) and free its KV.

        Raises
        ------
        ValueError
            Unknown request, or a request that has not produced an output token yet (use :meth:`abort`).
        """
        s = self._slot_of(request_id)
        if self._state[s] != _State.DECODE:
            raise ValueError(f"request_id: expected a decoding request, got request {request_id} in state "
                             f"{_State(int(self._state[s])).name.lower()}")
        self._end(s, _State.FINISHED)
        self._stats["finished"] += 1

    def abort(self, request_id: int) -> None:
        """Drop a request in any unfinished state and free its KV.

        Raises
        ------
        ValueError
            Unknown request, or one already finished or aborted.
        """
        s = self._slot_of(request_id)
        if self._state[s] in (_State.FINISHED, _State.ABORTED):
            raise ValueError(f"request_id: expected an unfinished request, got request {request_id} "
                             f"({_State(int(self._state[s])).name.lower()})")
        if self._state[s] == _State.WAITING:
            self._unstarted_drop(s)
        self._end(s, _State.ABORTED)
        self._stats["aborted"] += 1

    # ---------------------------------------------------------------------------------------- group bookkeeping
    def _chains(self, g: PrefixGroup):
        """``(request id, blocks of its shared levels, own tokens)`` for every request of ``g`` (as added)."""
        out = []
        stack = [(g, 0, 0)]
        while stack:
            sub, blocks, base = stack.pop()
            if sub.num_requests > 1 and sub.prefix_len > base:
                blocks += self._blocks(sub.prefix_len - base)
                base = sub.prefix_len
            nested = set()
            for c in sub.children:
                stack.append((c, blocks, base))
                nested.update(c.request_ids)
            out.extend((r, blocks, p - base) for r, p in zip(sub.request_ids, sub.prompt_lens) if r not in nested)
        return out

    def _grow(self, need: int) -> None:
        cap = self._rid.shape[0]
        if self._n + need <= cap:
            return
        new = max(cap * 2, self._n + need)
        for name in ("_rid", "_node", "_base", "_own", "_target", "_computed", "_generated", "_est_out", "_est_full",
                     "_cls", "_rank", "_last", "_state"):
            old = getattr(self, name)
            arr = np.full(new, -1 if name == "_node" else 0, dtype=old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)

    def _new_node(self, start: int, size: int, parent: int, rank: int, rep: int) -> int:
        v = len(self._n_start)
        self._n_start.append(start)
        self._n_size.append(size)
        self._n_done.append(0)
        self._n_parent.append(parent)
        self._n_rank.append(rank)
        self._n_rep.append(rep)
        self._n_refs.append(0)
        self._n_started_members.append(0)
        self._n_done_step.append(-1)
        self._n_kids.append([])
        self._n_members.append([])
        self._n_active.append(False)
        if parent >= 0:
            self._n_kids[parent].append(v)
        return v

    def _add_group(self, g: PrefixGroup) -> None:
        self._grow(g.num_requests)
        top_nodes: list[int] = []
        top_slots: list[int] = []
        # (group, enclosing node, base tokens of the enclosing node)
        stack = [(g, -1, 0)]
        rank0 = self._n
        rank_of = {r: rank0 + i for i, r in enumerate(g.request_ids)}
        while stack:
            sub, parent, base = stack.pop()
            shared = sub.num_requests > 1 and sub.prefix_len > base
            if shared:
                node = self._new_node(base, sub.prefix_len - base, parent, rank_of[sub.request_ids[0]],
                                      sub.request_ids[0])
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
                s = self._n
                self._n += 1
                self._open += 1
                self._slot[r] = s
                self._rid[s] = r
                self._node[s] = here
                self._base[s] = here_base
                self._own[s] = p - here_base
                self._target[s] = p - here_base
                self._rank[s] = rank_of[r]
                self._last[s] = self._step
                if self._est is not None:
                    est = self._est if isinstance(self._est, float) else \
                        (self._est[r] if r < self._est.shape[0] else 0.0)
                    self._est_full[s], self._est_out[s] = reserved_output(est, self.reservation_clip)
                if self._classes is not None and r < self._classes.shape[0]:
                    self._cls[s] = self._classes[r]
                self._class_waiting[self._cls[s]] += 1
                if here >= 0:
                    self._n_members[here].append(s)
                    v = here
                    while v >= 0:
                        self._n_refs[v] += 1
                        v = self._n_parent[v]
                else:
                    top_slots.append(s)
        self._groups.append((top_nodes, top_slots))

    def _slot_of(self, request_id) -> int:
        s = self._slot.get(int(request_id)) if isinstance(request_id, (int, np.integer)) else None
        if s is None:
            raise ValueError(f"request_id: expected a request added to this batcher, got {request_id!r}")
        return s

    # ---------------------------------------------------------------------------------------------- accounting
    def _blocks(self, tokens: int) -> int:
        return blocks(tokens, self.block_size)

    def _chain_ready(self, s: int, step: int) -> bool:
        v = int(self._node[s])
        while v >= 0:
            if self._n_done_step[v] < 0 or self._n_done_step[v] >= step:
                return False
            v = self._n_parent[v]
        return True

    def _reserved(self) -> int:
        """Blocks the started work will hold at its estimated end (current holdings when larger)."""
        total = self._active_full_blocks
        started = [s for s in (*self._decoding, *self._prefilling)]
        if not started:
            return total
        idx = np.fromiter(started, dtype=np.int64, count=len(started))
        return total + projected_blocks(self._computed[idx], self._own[idx], self._est_out[idx],
                                        self._generated[idx], self.block_size)

    def _mark_started(self, s: int, delta: int) -> None:
        v = int(self._node[s])
        while v >= 0:
            self._n_started_members[v] += delta
            v = self._n_parent[v]

    def _free_request_blocks(self, s: int) -> None:
        self._used -= self._blocks(int(self._computed[s]))
        self._computed[s] = 0

    def _end(self, s: int, state: _State) -> None:
        if s in self._decoding:
            del self._decoding[s]
        if s in self._prefilling:
            del self._prefilling[s]
        if self._state[s] in (_State.PREFILL, _State.DECODE):
            self._mark_started(s, -1)
            self._class_started[self._cls[s]].pop(s, None)
        elif self._state[s] == _State.WAITING:
            self._class_waiting[self._cls[s]] -= 1
        self._free_request_blocks(s)
        self._state[s] = state
        self._open -= 1
        v = int(self._node[s])
        while v >= 0:
            self._n_refs[v] -= 1
            if self._n_refs[v] == 0:
                self._free_node(v)
                self._n_done_step[v] = -1
            v = self._n_parent[v]

    def _activate_node(self, v: int) -> None:
        self._n_active[v] = True
        self._active_nodes[v] = None
        self._active_full_blocks += self._blocks(self._n_size[v])

    def _free_node(self, v: int, report: bool = True) -> None:
        if self._n_active[v]:
            self._used -= self._blocks(self._n_done[v])
            self._active_full_blocks -= self._blocks(self._n_size[v])
            del self._active_nodes[v]
            if report:
                self._freed_nodes.append(v)
        self._n_done[v] = 0
        self._n_active[v] = False
        self._partial_nodes.pop(v, None)

    def _unstarted_drop(self, s: int) -> None:
        """A waiting request leaves: entries in the ready heap are skipped lazily by state."""

    def _preempt(self, s: int) -> None:
        """Drop a started request's KV; it is recomputed (prompt and output so far) when it starts again."""
        kept = int(self._computed[s])
        if s in self._decoding:
            del self._decoding[s]
        if s in self._prefilling:
            del self._prefilling[s]
        self._mark_started(s, -1)
        self._stats["preemptions"] += 1
        self._stats["recomputed_tokens"] += kept
        if self._generated[s] > 0:
            self._target[s] = self._own[s] + self._generated[s] - 1  # all KV but the pending output token
        self._free_request_blocks(s)
        self._state[s] = _State.WAITING
        self._push_ready(s)
        self._class_waiting[self._cls[s]] += 1
        self._class_started[self._cls[s]].pop(s, None)
        self._preempted.append(int(self._rid[s]))

    def _idle_nodes(self) -> list[int]:
        """Started prefix levels with no started member below, latest admitted first."""
        idle = [v for v in self._active_nodes if self._n_started_members[v] == 0
                and not any(self._n_active[k] for k in self._n_kids[v])]
        return sorted(idle, key=lambda v: -self._n_rank[v])

    def _relieve(self) -> bool:
        """Preempt the latest-admitted partial prefill or release the latest idle prefix level; False if none."""
        best, is_node = None, False
        for s in self._prefilling:
            if best is None or self._rank[s] > best[0]:
                best = (int(self._rank[s]), s)
        idle = self._idle_nodes()
        if idle and (best is None or self._n_rank[idle[0]] > best[0]):
            best, is_node = (self._n_rank[idle[0]], idle[0]), True
        if best is None:
            return False
        if is_node:
            self._release_node(best[1])
        else:
            self._preempt(best[1])
        return True

    def _release_node(self, v: int) -> None:
        """Free an idle prefix level; it is recomputed before its members start."""
        self._stats["released_prefix_tokens"] += self._n_done[v]
        self._free_node(v)
        self._n_done_step[v] = -1
        heapq.heappush(self._ready_nodes, (self._n_rank[v], v))

    # -------------------------------------------------------------------------------------------- scheduling
    def _schedule_decodes(self, plan: _PlanBuilder, step: int) -> None:
        if not self._decoding:
            return
        dec = np.fromiter(self._decoding, dtype=np.int64, count=len(self._decoding))
        comp = self._computed[dec]
        need = (comp % self.block_size == 0).astype(np.int64)  # the new token opens a block
        if dec.size <= self._budget and self._used + int(need.sum()) <= self.kv_blocks:
            plan.add_many(ChunkKind.DECODE, self._rid[dec], self._node[dec], self._base[dec] + comp)
            self._computed[dec] = comp + 1
            self._generated[dec] += 1
            self._last[dec] = step
            self._used += int(need.sum())
            self._budget -= dec.size
            return
        # Slow path: the longest-waiting first; preempt the latest-admitted started requests for memory.
        order = dec[np.lexsort((self._rank[dec], self._last[dec]))].tolist()
        for s in order:
            if self._budget == 0:
                break
            if self._state[s] != _State.DECODE:
                continue  # preempted earlier in this loop
            need_block = int(self._computed[s]) % self.block_size == 0
            if need_block and self._used + 1 > self.kv_blocks and not self._make_room(s, 1):
                continue
            if self._state[s] != _State.DECODE:
                continue
            c = int(self._computed[s])
            plan.add(ChunkKind.DECODE, int(self._rid[s]), int(self._node[s]), int(self._base[s]) + c, 1)
            self._computed[s] = c + 1
            self._generated[s] += 1
            self._last[s] = step
            self._used += int(need_block)
            self._budget -= 1
            self._scheduled.add(s)

    def _make_room(self, s: int, blocks: int) -> bool:
        """Free ``blocks`` for request ``s``'s decode by preemption; False when ``s`` itself had to stop."""
        while self._used + blocks > self.kv_blocks:
            victims = [v for v in (*self._decoding, *self._prefilling) if v != s and v not in self._scheduled]
            if victims:
                self._preempt(max(victims, key=lambda v: int(self._rank[v])))
                continue
            idle = self._idle_nodes()
            if idle:
                self._release_node(idle[0])
                continue
            if len(self._decoding) + len(self._prefilling) > 1:
                self._preempt(s)  # requests admitted earlier already run this step: s waits for them
                return False
            self._truncated.append(int(self._rid[s]))  # alone and still too big: stop it
            self._stats["truncated"] += 1
            self._end(s, _State.FINISHED)
            self._scheduled.add(s)
            return False
        return True

    def _prefill_chunk(self, plan: _PlanBuilder, s: int, step: int) -> bool:
        """Next chunk of a started prefill within the budgets; False when nothing fits."""
        c = int(self._computed[s])
        room = (self._blocks(c) + self.kv_blocks - self._used) * self.block_size - c
        n = min(int(self._target[s]) - c, self._budget, room)
        if n <= 0:
            return False
        plan.add(ChunkKind.DISTINCT, int(self._rid[s]), int(self._node[s]), int(self._base[s]) + c, n)
        self._used += self._blocks(c + n) - self._blocks(c)
        self._computed[s] = c + n
        self._budget -= n
        self._last[s] = step
        self._scheduled.add(s)
        if c + n == self._target[s]:
            self._completed_prefill.append(s)
        return True

    def _node_chunk(self, plan: _PlanBuilder, v: int, step: int) -> bool:
        c = self._n_done[v]
        room = (self._blocks(c) + self.kv_blocks - self._used) * self.block_size - c
        n = min(self._n_size[v] - c, self._budget, room)
        if n <= 0:
            return False
        plan.add(ChunkKind.PREFIX, self._n_rep[v], v, self._n_start[v] + c, n)
        self._used += self._blocks(c + n) - self._blocks(c)
        self._n_done[v] = c + n
        self._budget -= n
        if c + n == self._n_size[v]:
            self._partial_nodes.pop(v, None)
            self._n_done_step[v] = step
            for k in self._n_kids[v]:
                heapq.heappush(self._ready_nodes, (self._n_rank[k], k))
            for m in self._n_members[v]:
                self._push_ready(m)
        else:
            self._partial_nodes[v] = None
        return True

    def _start_request(self, plan: _PlanBuilder, s: int, step: int, reserved: list[int]) -> bool:
        """Start a waiting request if its reservation and first chunk fit."""
        if self._est is not None:
            end = int(self._target[s]) + max(int(self._est_out[s]) - int(self._generated[s]), 0)
            if not admits(reserved[0], self._blocks(end), self.kv_blocks, bool(self._decoding or self._prefilling)):
                return False
        self._state[s] = _State.PREFILL
        self._prefilling[s] = None
        self._mark_started(s, 1)
        if not self._prefill_chunk(plan, s, step):
            del self._prefilling[s]
            self._mark_started(s, -1)
            self._state[s] = _State.WAITING
            return False
        if self._est is not None:
            reserved[0] += self._blocks(int(self._target[s]) + max(int(self._est_out[s]) - int(self._generated[s]),
                                                                   0))
        self._class_waiting[self._cls[s]] -= 1
        self._class_started[self._cls[s]][s] = None
        return True

    def _start_node(self, plan: _PlanBuilder, v: int, step: int, reserved: list[int]) -> bool:
        if self._est is not None:
            if not admits(reserved[0], self._blocks(self._n_size[v]), self.kv_blocks,
                          bool(self._decoding or self._prefilling)):
                return False
        self._activate_node(v)
        if not self._node_chunk(plan, v, step):
            self._free_node(v, report=False)
            return False
        if self._est is not None:
            reserved[0] += self._blocks(self._n_size[v])
        return True

    def _start_ready(self, plan: _PlanBuilder, step: int) -> None:
        reserved = [self._reserved() if self._est is not None else 0]
        blocked = False  # an earlier request or level could not start: nothing later may overtake it
        # Admitted work in admission (rank) order: distinct prompts whose prefixes are complete and nested prefix
        # levels whose parent is complete. Rank order keeps a preempted request from overtaking earlier work.
        held: set[int] = set()  # classes at their share this step: their requests wait, other classes go on
        while self._budget > 0:
            c = self._next_class(held)
            if c < 0 and not self._ready_nodes:
                break
            take_node = bool(self._ready_nodes) and (c < 0 or self._ready_nodes[0][0] <= self._ready[c][0][0])
            if take_node:
                rank, v = self._ready_nodes[0]
                if self._n_active[v] or self._n_refs[v] == 0:
                    heapq.heappop(self._ready_nodes)
                    continue
                parent = self._n_parent[v]
                if parent >= 0 and self._n_done_step[parent] < 0:
                    heapq.heappop(self._ready_nodes)  # parent released: re-queued when it completes again
                    continue
                if parent >= 0 and self._n_done_step[parent] >= step:
                    break  # its parent completed in this very step: it starts next step (later work waits too)
                if not self._start_node(plan, v, step, reserved):
                    blocked = True
                    break
                heapq.heappop(self._ready_nodes)
                continue
            heap = self._ready[c]
            rank, s = heap[0]
            if self._state[s] != _State.WAITING:
                heapq.heappop(heap)
                continue
            if not self._chain_ready(s, step):
                if all(self._n_done_step[u] >= 0 for u in self._chain(int(self._node[s]))):
                    break  # its prefix completed in this very step: it starts next step (later work waits too)
                heapq.heappop(heap)  # its prefix was released: re-queued when recomputed
                continue
            if not self._class_admits(s):
                held.add(c)
                continue
            if not self._start_request(plan, s, step, reserved):
                blocked = True
                break
            heapq.heappop(heap)
        # New groups, in order, while the budgets allow and no partial prefix is pending.
        while not blocked and self._budget > 0 and self._next_group < len(self._groups) and not self._partial_nodes:
            top_nodes, top_slots = self._groups[self._next_group]
            live_nodes = [v for v in top_nodes if self._n_refs[v] > 0]
            if live_nodes:
                if not self._start_node(plan, live_nodes[0], step, reserved):
                    break
                for other in live_nodes[1:]:
                    heapq.heappush(self._ready_nodes, (self._n_rank[other], other))
            for i, s in enumerate(top_slots):
                if self._state[s] != _State.WAITING:
                    continue
                c = int(self._cls[s])
                if blocked or c in held:
                    self._push_ready(s)
                elif not self._class_admits(s):
                    held.add(c)
                    self._push_ready(s)
                elif not self._start_request(plan, s, step, reserved):
                    self._push_ready(s)
                    blocked = True
            self._next_group += 1

    def _next_class(self, held: set[int]) -> int:
        """The class whose ready heap holds the earliest-ranked request, skipping ``held``; -1 when none."""
        best, best_rank = -1, None
        for c, heap in enumerate(self._ready):
            if heap and c not in held and (best_rank is None or heap[0][0] < best_rank):
                best, best_rank = c, heap[0][0]
        return best

    def _push_ready(self, s: int) -> None:
        heapq.heappush(self._ready[self._cls[s]], (int(self._rank[s]), s))

    # ------------------------------------------------------------------------------------------- memory classes
    @staticmethod
    def _check_classes(memory_classes, class_shares):
        if memory_classes is None and class_shares is None:
            return None, None
        if memory_classes is None or class_shares is None:
            raise ValueError("memory_classes: expected memory_classes and class_shares together, got only "
                             f"{'class_shares' if memory_classes is None else 'memory_classes'}")
        shares = np.asarray(class_shares, dtype=np.float64)
        if shares.ndim != 1 or shares.size == 0 or not np.isfinite(shares).all() or (shares < 0).any() \
                or (shares > 1).any():
            raise ValueError(f"class_shares: expected a 1-D sequence of fractions in [0, 1], got {class_shares!r}")
        classes = np.asarray(memory_classes)
        if classes.ndim != 1 or not np.issubdtype(classes.dtype, np.integer) and classes.size:
            raise ValueError("memory_classes: expected a 1-D array of int classes (one per request id)")
        classes = classes.astype(np.int64)
        if classes.size and (classes.min() < 0 or classes.max() >= shares.size):
            raise ValueError(f"memory_classes: expected classes in [0, {shares.size}) (one share per class), got "
                             f"{int(classes[(classes < 0) | (classes >= shares.size)][0])}")
        return classes, shares

    def _class_admits(self, s: int) -> bool:
        """Whether waiting request ``s`` may start under its class's share (always, without classes)."""
        if self._shares is None:
            return True
        c = int(self._cls[s])
        started = self._class_started[c]
        if not started:
            return True  # every class may run one request: none starves behind another class's work
        if not any(n > 0 for k, n in enumerate(self._class_waiting.tolist()) if k != c):
            return True  # nothing of another class waits: the share would only leave memory idle
        cap = self._shares[c] * self.kv_blocks
        idx = np.array([*started, s], dtype=np.int64)
        cur = np.maximum(self._computed[idx], self._target[idx])  # a partial prefill counts as complete
        # a rolling horizon: a long output past its clipped reservation still grows for up to `clip` more steps
        rem = self._est_full[idx] - self._generated[idx]
        if self.reservation_clip is not None:
            rem = np.minimum(rem, self.reservation_clip)
        rem = np.maximum(rem, 1)
        bound = ((cur + rem - 1) // self.block_size + 1).sum()  # everyone at its end at once: an upper bound
        if bound <= cap:
            return True
        return projected_peak_blocks(cur, rem, self.block_size) <= cap

    def _chain(self, v: int) -> list[int]:
        out = []
        while v >= 0:
            out.append(v)
            v = self._n_parent[v]
        return out


class _PlanBuilder:
    """Collects chunks: scalar appends for prefills, whole arrays for the decodes."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.kinds: list[int] = []
        self.rids: list[int] = []
        self.nodes: list[int] = []
        self.starts: list[int] = []
        self.ntok: list[int] = []
        self.size = 0

    def add(self, kind: ChunkKind, rid: int, node: int, start: int, n: int) -> None:
        self.kinds.append(int(kind))
        self.rids.append(rid)
        self.nodes.append(node)
        self.starts.append(start)
        self.ntok.append(n)
        self.size += 1

    def add_many(self, kind: ChunkKind, rids: np.ndarray, nodes: np.ndarray, starts: np.ndarray) -> None:
        m = rids.shape[0]
        self.parts.append((np.full(m, int(kind), np.int8), rids.astype(np.int64), nodes.astype(np.int64),
                           starts.astype(np.int64), np.ones(m, np.int64)))
        self.size += m

    def build(self, step: int, preempted: list[int], truncated: list[int], freed: list[int], used: int
              ) -> StepPlan:
        parts = list(self.parts)
        if self.kinds:
            parts.append((np.array(self.kinds, np.int8), np.array(self.rids, np.int64), np.array(self.nodes, np.int64),
                          np.array(self.starts, np.int64), np.array(self.ntok, np.int64)))
        if not parts:
            empty = np.zeros(0, np.int64)
            cols = (np.zeros(0, np.int8), empty, empty, empty, empty)
        elif len(parts) == 1:
            cols = parts[0]
        else:
            cols = tuple(np.concatenate(c) for c in zip(*parts))
        return StepPlan(step=step, kinds=cols[0], request_ids=cols[1], nodes=cols[2], starts=cols[3],
                        num_tokens=cols[4], preempted=tuple(preempted), truncated=tuple(truncated),
                        freed_nodes=tuple(freed), kv_blocks_used=used)
