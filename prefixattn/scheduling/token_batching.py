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
while the started work's projected footprint with it fits (a reservation: :mod:`prefixattn.scheduling.admission`,
the rule the vLLM scheduler applies, projection ``ends`` by default or ``peak``); when outputs run longer than
estimated and a decode needs a block that is not free, the latest-admitted request is preempted and later
recomputed (vLLM's recompute preemption; counted in :attr:`TokenBatcher.stats`). A request that cannot fit even
alone is rejected when added; one whose output outgrows the whole budget is stopped and reported as truncated.

Memory classes (optional; BlendServe's dual scanner, sec. 3.4: ``M_L + M_R = M``): each request has a class and each
class a share of the KV blocks that its projected peak may fill while another class waits
(:mod:`prefixattn.scheduling.class_shares`). Each class keeps its own admission order, so a class at its share does
not hold back the others: long-output requests cannot fill the pool and leave the steps a few dozen decode tokens
wide, and compute-heavy prefills keep running beside them.

The state lives in small types: the requests' numpy columns, the prefix levels and one step's context
(:mod:`prefixattn.scheduling.batch_state`), the queues (:mod:`prefixattn.scheduling.work_queues`), the KV blocks in
use (:mod:`prefixattn.scheduling.kv_ledger`, which says how blocks are counted); the step types (`StepBatch`,
chunks) are in :mod:`prefixattn.scheduling.step_batch`. This module holds the rules.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from prefixattn.scheduling.admission import PROJECTIONS, AdmissionPass, AdmissionRule
from prefixattn.scheduling.batch_state import PrefixLevels, RequestState, RequestStore, StepContext
from prefixattn.scheduling.class_shares import ClassShares
from prefixattn.scheduling.batch_input import (MAX_BLOCK_SIZE, MAX_KV_BLOCKS, MAX_OUTPUT_TOKENS, MAX_TOKEN_BUDGET,
                                               check_groups, check_output_lens)
from prefixattn.scheduling.checks import check_int
from prefixattn.scheduling.grouping import PrefixGroup
from prefixattn.scheduling.kv_ledger import KVLedger
from prefixattn.scheduling.step_batch import Chunk, ChunkKind, PrefixNode, StepBatch
from prefixattn.scheduling.work_queues import WorkQueues

__all__ = ["Chunk", "ChunkKind", "PrefixNode", "StepBatch", "TokenBatcher"]  # the types stay importable from here

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
        added (otherwise prompt plus one token must fit). No reservation exceeds it (as ``max_tokens`` in vLLM).
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
    projection : {"ends", "peak"}
        How the reservation projects the started requests' KV (:mod:`prefixattn.scheduling.admission`, the rule the
        vLLM scheduler applies too): ``ends`` (default) every request at its estimated end at once, ``peak`` the
        peak when each frees its blocks as it ends (admits more).

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
                 class_shares=None, projection: str = PROJECTIONS[0]) -> None:
        self.token_budget = check_int("token_budget", token_budget, 1, MAX_TOKEN_BUDGET)
        self.kv_blocks = check_int("kv_blocks", kv_blocks, 1, MAX_KV_BLOCKS)
        self.block_size = check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
        self.max_output_len = None if max_output_len is None else \
            check_int("max_output_len", max_output_len, 1, MAX_OUTPUT_TOKENS)
        self._est = check_output_lens(output_lens)
        self.reservation_clip = None if reservation_clip is None else \
            check_int("reservation_clip", reservation_clip, 1, MAX_OUTPUT_TOKENS)
        # the reservation, projection and admit test (a reservation never exceeds the hard output cap)
        self._rule = AdmissionRule(capacity=self.kv_blocks, block_size=self.block_size, projection=projection,
                                   clip=self.reservation_clip)
        self._classes = ClassShares(memory_classes, class_shares)
        self._step = 0
        self._req = RequestStore()
        self._lv = PrefixLevels()  # prefix levels (one per shared level of every multi-request group)
        self._kv = KVLedger(self.kv_blocks, self.block_size)
        self._q = WorkQueues(self._classes.num_classes)
        self._ctx = StepContext(step=0, budget=0)  # replaced at every step()
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
    def projection(self) -> str:
        """The admission projection, ``ends`` or ``peak``."""
        return self._rule.projection

    @property
    def kv_blocks_used(self) -> int:
        return self._kv.used

    @property
    def done(self) -> bool:
        """Every added request finished or aborted."""
        return self._open == 0

    def prefix_node(self, node: int) -> PrefixNode:
        """The prefix level ``node`` (an id from :attr:`StepBatch.nodes`)."""
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or not 0 <= node < len(self._lv.start):
            raise ValueError(f"node: expected a prefix level id in [0, {len(self._lv.start)}), got {node!r}")
        return PrefixNode(self._lv.start[node], self._lv.size[node], self._lv.rep[node], self._lv.parent[node])

    def request_state(self, request_id: int) -> str:
        """``waiting``, ``prefill``, ``decode``, ``finished`` or ``aborted``."""
        return self._req.state_name(self._req.slot_of(request_id))

    def add_groups(self, groups: Sequence[PrefixGroup]) -> None:
        """Queue groups for admission, in the given order (e.g. from :func:`order_groups`).

        Raises
        ------
        ValueError
            A request id already added, a malformed group, or requests that can never fit in ``kv_blocks``
            (nothing is added then).
        """
        groups = check_groups(groups, self._req.slot, self.block_size, self.kv_blocks, self.max_output_len or 1)
        for g in groups:
            self._add_group(g)

    def step(self) -> StepBatch:
        """Plan the next engine step and account for it as executed.

        Returns
        -------
        StepBatch
            Requests whose last prefill chunk is in this plan produce their first output token in it and are
            decoded from the next step on; call :meth:`finish` for requests that end.
        """
        self._ctx = ctx = StepContext(step=self._step, budget=self.token_budget)
        self._schedule_decodes()
        for s in list(self._q.prefilling):
            if ctx.budget == 0:
                break
            self._prefill_chunk(s)
        for v in list(self._q.partial_nodes):
            if ctx.budget == 0:
                break
            self._node_chunk(v)
        self._start_ready()
        while not ctx.plan.size and self._open and self._relieve():
            # Nothing could run: memory is held by work that cannot finish without more of it (greedy
            # Algorithm 2 admission can fill memory with partial prefills and idle prefixes). Drop the latest
            # admitted such work and retry; the earliest waiting request fits alone (checked when added).
            for s in list(self._q.prefilling):
                self._prefill_chunk(s)
            for v in list(self._q.partial_nodes):
                self._node_chunk(v)
            self._start_ready()
        for s in ctx.completed_prefill:
            if self._req.state[s] == RequestState.PREFILL:
                del self._q.prefilling[s]
                if self._req.generated[s] == 0:
                    self._req.generated[s] = 1  # the last prefill chunk's logits give the first output token
                self._req.state[s] = RequestState.DECODE
                self._q.decoding[s] = None
        self._step += 1
        self._stats["steps"] += 1
        return ctx.plan.build(ctx.step, ctx.preempted, ctx.truncated, self._kv.take_freed(), self._kv.used)

    def finish(self, request_id: int) -> None:
        """Mark a decoding request finished (end of sequence or length limit) and free its KV.

        Raises
        ------
        ValueError
            Unknown request, or a request that has not produced an output token yet (use :meth:`abort`).
        """
        s = self._req.slot_of(request_id)
        if self._req.state[s] != RequestState.DECODE:
            raise ValueError(f"request_id: expected a decoding request, got request {request_id} in state "
                             f"{self._req.state_name(s)}")
        self._end(s, RequestState.FINISHED)
        self._stats["finished"] += 1

    def abort(self, request_id: int) -> None:
        """Drop a request in any unfinished state and free its KV.

        Raises
        ------
        ValueError
            Unknown request, or one already finished or aborted.
        """
        s = self._req.slot_of(request_id)
        if self._req.state[s] in (RequestState.FINISHED, RequestState.ABORTED):
            raise ValueError(f"request_id: expected an unfinished request, got request {request_id} "
                             f"({self._req.state_name(s)})")
        self._end(s, RequestState.ABORTED)
        self._stats["aborted"] += 1

    # ---------------------------------------------------------------------------------------- group bookkeeping
    def _add_group(self, g: PrefixGroup) -> None:
        self._req.grow(g.num_requests)
        rank0 = self._req.n
        self._q.groups.append(self._lv.add_group(g, rank0, self._add_request))

    def _add_request(self, r: int, prompt_len: int, node: int, base: int, rank: int) -> int:
        """A new slot for request ``r`` below prefix level ``node`` (``base`` tokens), waiting to start, with its
        output reservation and its memory class."""
        req = self._req
        s = req.add(r, prompt_len, node, base, rank, self._step)
        self._open += 1
        if self._est is not None:
            est = self._est if isinstance(self._est, float) else (self._est[r] if r < self._est.shape[0] else 0.0)
            req.est_full[s], req.est_out[s] = self._rule.reservation(est, self.max_output_len)
        req.cls[s] = self._classes.class_of(r)
        self._classes.waiting[req.cls[s]] += 1
        return s

    # ---------------------------------------------------------------------------------------------- accounting
    def _admission(self) -> AdmissionPass | None:
        """The started work's projection for one admission pass (started prefix levels at their full size); None
        without output estimates (nothing is reserved)."""
        if self._est is None:
            return None
        return self._rule.start(*self._req.started_growth(self._q.started_slots()),
                                shared_blocks=self._kv.active_full_blocks)

    def admits(self, request_id: int) -> bool:
        """Whether memory-centric admission (:mod:`prefixattn.scheduling.admission`) lets the waiting request start
        now next to the started requests, with its prefix levels that have not started: the test :meth:`step`
        applies first in its admission pass (token budget and class shares aside). True without output estimates.

        Raises
        ------
        ValueError
            Unknown request, or one that is not waiting.
        """
        s = self._req.slot_of(request_id)
        if self._req.state[s] != RequestState.WAITING:
            raise ValueError(f"request_id: expected a waiting request, got request {request_id} in state "
                             f"{self._req.state_name(s)}")
        adm = self._admission()
        levels = sum(self._kv.blocks(self._lv.size[v]) for v in self._lv.chain(int(self._req.node[s]))
                     if not self._lv.active[v])
        return adm is None or adm.fits(*self._req.waiting_growth(s), shared=levels,
                                       anything_started=self._q.anything_started())

    def _free_request_blocks(self, s: int) -> None:
        self._kv.release(int(self._req.computed[s]))
        self._req.computed[s] = 0

    def _end(self, s: int, state: RequestState) -> None:
        self._q.stop(s)
        if self._req.state[s] in (RequestState.PREFILL, RequestState.DECODE):
            self._lv.mark_started(int(self._req.node[s]), -1)
            self._classes.started[self._req.cls[s]].pop(s, None)
        elif self._req.state[s] == RequestState.WAITING:
            self._classes.waiting[self._req.cls[s]] -= 1
        self._free_request_blocks(s)
        self._req.state[s] = state
        self._open -= 1
        for v in self._lv.unref(int(self._req.node[s])):
            self._free_node(v)
            self._lv.done_step[v] = -1

    def _free_node(self, v: int, report: bool = True) -> None:
        self._kv.free_level(self._lv, v, report)
        self._q.partial_nodes.pop(v, None)

    def _preempt(self, s: int) -> None:
        """Drop a started request's KV; it is recomputed (prompt and output so far) when it starts again."""
        kept = int(self._req.computed[s])
        self._q.stop(s)
        self._lv.mark_started(int(self._req.node[s]), -1)
        self._stats["preemptions"] += 1
        self._stats["recomputed_tokens"] += kept
        if self._req.generated[s] > 0:
            self._req.target[s] = self._req.own[s] + self._req.generated[s] - 1  # all KV but the pending output token
        self._free_request_blocks(s)
        self._req.state[s] = RequestState.WAITING
        self._push_ready(s)
        self._classes.waiting[self._req.cls[s]] += 1
        self._classes.started[self._req.cls[s]].pop(s, None)
        self._ctx.preempted.append(int(self._req.rid[s]))

    def _idle_nodes(self) -> list[int]:
        """Started prefix levels with no started member below, latest admitted first."""
        idle = [v for v in self._kv.active if self._lv.started_members[v] == 0
                and not any(self._lv.active[k] for k in self._lv.kids[v])]
        return sorted(idle, key=lambda v: -self._lv.rank[v])

    def _relieve(self) -> bool:
        """Preempt the latest-admitted partial prefill or release the latest idle prefix level; False if none."""
        best, is_node = None, False
        for s in self._q.prefilling:
            if best is None or self._req.rank[s] > best[0]:
                best = (int(self._req.rank[s]), s)
        idle = self._idle_nodes()
        if idle and (best is None or self._lv.rank[idle[0]] > best[0]):
            best, is_node = (self._lv.rank[idle[0]], idle[0]), True
        if best is None:
            return False
        if is_node:
            self._release_node(best[1])
        else:
            self._preempt(best[1])
        return True

    def _release_node(self, v: int) -> None:
        """Free an idle prefix level; it is recomputed before its members start."""
        self._stats["released_prefix_tokens"] += self._lv.done[v]
        self._free_node(v)
        self._lv.done_step[v] = -1
        self._q.push_ready_node(self._lv.rank[v], v)

    # -------------------------------------------------------------------------------------------- scheduling
    def _schedule_decodes(self) -> None:
        if not self._q.decoding:
            return
        req, ctx = self._req, self._ctx
        dec = np.fromiter(self._q.decoding, dtype=np.int64, count=len(self._q.decoding))
        comp = req.computed[dec]
        need = (comp % self.block_size == 0).astype(np.int64)  # the new token opens a block
        if dec.size <= self._ctx.budget and self._kv.fits(int(need.sum())):
            ctx.plan.add_many(ChunkKind.DECODE, req.rid[dec], req.node[dec], req.base[dec] + comp)
            req.decoded(dec, ctx.step)
            self._kv.take(int(need.sum()))
            self._ctx.budget -= dec.size
            return
        # Slow path: the longest-waiting first; preempt the latest-admitted started requests for memory.
        order = dec[np.lexsort((self._req.rank[dec], self._req.last[dec]))].tolist()
        for s in order:
            if self._ctx.budget == 0:
                break
            if self._req.state[s] != RequestState.DECODE:
                continue  # preempted earlier in this loop
            need_block = int(self._req.computed[s]) % self.block_size == 0
            if need_block and not self._kv.fits(1) and not self._make_room(s, 1):
                continue
            if self._req.state[s] != RequestState.DECODE:
                continue
            c = int(self._req.computed[s])
            ctx.plan.add(ChunkKind.DECODE, int(req.rid[s]), int(req.node[s]), int(req.base[s]) + c, 1)
            req.decoded(s, ctx.step)
            self._kv.take(int(need_block))
            self._ctx.budget -= 1
            self._ctx.scheduled.add(s)

    def _make_room(self, s: int, blocks: int) -> bool:
        """Free ``blocks`` for request ``s``'s decode by preemption; False when ``s`` itself had to stop."""
        while not self._kv.fits(blocks):
            victims = [v for v in (*self._q.decoding, *self._q.prefilling) if v != s and v not in self._ctx.scheduled]
            if victims:
                self._preempt(max(victims, key=lambda v: int(self._req.rank[v])))
                continue
            idle = self._idle_nodes()
            if idle:
                self._release_node(idle[0])
                continue
            if len(self._q.decoding) + len(self._q.prefilling) > 1:
                self._preempt(s)  # requests admitted earlier already run this step: s waits for them
                return False
            self._ctx.truncated.append(int(self._req.rid[s]))  # alone and still too big: stop it
            self._stats["truncated"] += 1
            self._end(s, RequestState.FINISHED)
            self._ctx.scheduled.add(s)
            return False
        return True

    def _prefill_chunk(self, s: int) -> bool:
        """Next chunk of a started prefill within the budgets; False when nothing fits."""
        req = self._req
        c = int(req.computed[s])
        room = self._kv.room(c)
        n = min(int(req.target[s]) - c, self._ctx.budget, room)
        if n <= 0:
            return False
        self._ctx.plan.add(ChunkKind.DISTINCT, int(req.rid[s]), int(req.node[s]), int(req.base[s]) + c, n)
        self._kv.extend(c, n)
        self._req.computed[s] = c + n
        self._ctx.budget -= n
        self._req.last[s] = self._ctx.step
        self._ctx.scheduled.add(s)
        if c + n == self._req.target[s]:
            self._ctx.completed_prefill.append(s)
        return True

    def _node_chunk(self, v: int) -> bool:
        c = self._lv.done[v]
        room = self._kv.room(c)
        n = min(self._lv.size[v] - c, self._ctx.budget, room)
        if n <= 0:
            return False
        self._ctx.plan.add(ChunkKind.PREFIX, self._lv.rep[v], v, self._lv.start[v] + c, n)
        self._kv.extend(c, n)
        self._lv.done[v] = c + n
        self._ctx.budget -= n
        if c + n == self._lv.size[v]:
            self._q.partial_nodes.pop(v, None)
            self._lv.done_step[v] = self._ctx.step
            for k in self._lv.kids[v]:
                self._q.push_ready_node(self._lv.rank[k], k)
            for m in self._lv.members[v]:
                self._push_ready(m)
        else:
            self._q.partial_nodes[v] = None
        return True

    def _start_request(self, s: int, adm: AdmissionPass | None) -> bool:
        """Start a waiting request if its reservation and first chunk fit."""
        if adm is not None:
            cand = self._req.waiting_growth(s)
            if not adm.fits(*cand, anything_started=self._q.anything_started()):
                return False
        self._req.state[s] = RequestState.PREFILL
        self._q.prefilling[s] = None
        self._lv.mark_started(int(self._req.node[s]), 1)
        if not self._prefill_chunk(s):
            del self._q.prefilling[s]
            self._lv.mark_started(int(self._req.node[s]), -1)
            self._req.state[s] = RequestState.WAITING
            return False
        if adm is not None:
            adm.add(*cand)
        self._classes.waiting[self._req.cls[s]] -= 1
        self._classes.started[self._req.cls[s]][s] = None
        return True

    def _start_node(self, v: int, adm: AdmissionPass | None) -> bool:
        """Start a prefix level if its full size fits the reservation and its first chunk fits."""
        if adm is not None and not adm.fits(shared=self._kv.blocks(self._lv.size[v]),
                                            anything_started=self._q.anything_started()):
            return False
        self._kv.activate(self._lv, v)
        if not self._node_chunk(v):
            self._free_node(v, report=False)
            return False
        if adm is not None:
            adm.add(shared=self._kv.blocks(self._lv.size[v]))
        return True

    def _start_ready(self) -> None:
        adm = self._admission()
        blocked = False  # an earlier request or level could not start: nothing later may overtake it
        # Admitted work in admission (rank) order: distinct prompts whose prefixes are complete and nested prefix
        # levels whose parent is complete. Rank order keeps a preempted request from overtaking earlier work.
        held: set[int] = set()  # classes at their share this step: their requests wait, other classes go on
        while self._ctx.budget > 0:
            c = self._q.next_class(held)
            if c < 0 and not self._q.ready_nodes:
                break
            take_node = bool(self._q.ready_nodes) and (c < 0 or self._q.ready_nodes[0][0] <= self._q.ready[c][0][0])
            if take_node:
                rank, v = self._q.ready_nodes[0]
                if self._lv.active[v] or self._lv.refs[v] == 0:
                    heapq.heappop(self._q.ready_nodes)
                    continue
                parent = self._lv.parent[v]
                if parent >= 0 and self._lv.done_step[parent] < 0:
                    heapq.heappop(self._q.ready_nodes)  # parent released: re-queued when it completes again
                    continue
                if parent >= 0 and self._lv.done_step[parent] >= self._ctx.step:
                    break  # its parent completed in this very step: it starts next step (later work waits too)
                if not self._start_node(v, adm):
                    blocked = True
                    break
                heapq.heappop(self._q.ready_nodes)
                continue
            heap = self._q.ready[c]
            rank, s = heap[0]
            if self._req.state[s] != RequestState.WAITING:
                heapq.heappop(heap)
                continue
            if not self._lv.chain_ready(int(self._req.node[s]), self._ctx.step):
                if all(self._lv.done_step[u] >= 0 for u in self._lv.chain(int(self._req.node[s]))):
                    break  # its prefix completed in this very step: it starts next step (later work waits too)
                heapq.heappop(heap)  # its prefix was released: re-queued when recomputed
                continue
            if not self._class_admits(s):
                held.add(c)
                continue
            if not self._start_request(s, adm):
                blocked = True
                break
            heapq.heappop(heap)
        # New groups, in order, while the budgets allow and no partial prefix is pending.
        while (not blocked and self._ctx.budget > 0 and self._q.next_group < len(self._q.groups)
               and not self._q.partial_nodes):
            top_nodes, top_slots = self._q.groups[self._q.next_group]
            live_nodes = [v for v in top_nodes if self._lv.refs[v] > 0]
            if live_nodes:
                if not self._start_node(live_nodes[0], adm):
                    break
                for other in live_nodes[1:]:
                    self._q.push_ready_node(self._lv.rank[other], other)
            for i, s in enumerate(top_slots):
                if self._req.state[s] != RequestState.WAITING:
                    continue
                c = int(self._req.cls[s])
                if blocked or c in held:
                    self._push_ready(s)
                elif not self._class_admits(s):
                    held.add(c)
                    self._push_ready(s)
                elif not self._start_request(s, adm):
                    self._push_ready(s)
                    blocked = True
            self._q.next_group += 1

    def _push_ready(self, s: int) -> None:
        self._q.push_ready(int(self._req.cls[s]), int(self._req.rank[s]), s)

    def _class_admits(self, s: int) -> bool:
        return self._classes.admits(self._req, s, self.kv_blocks, self.block_size, self.reservation_clip)
