"""vLLM-style scheduling (the v0.5.4 baseline of BatchLLM's Table 1): FCFS, hash-block prefix cache with LRU,
optional chunked prefill with a 2048-token budget, ``max_num_seqs`` 256, preemption by recompute.

With chunked prefill each step takes, in running-queue order, one token per decode and a chunk of every unfinished
prefill, then admits waiting prompts FCFS into the remaining budget. Without it a step is either a batch of whole new
prompts (prefill-only, budget ``max(max_model_len, 2048)``) or a decode of every running sequence. A new prompt is
admitted only if the blocks of its whole uncached prompt fit above the watermark (v0.5's ``can_allocate``); a
running sequence that cannot get a block preempts the most recently admitted one.
"""

from __future__ import annotations

from collections import deque

from prefixattn.sim.policies.base import UNBOUNDED_STEPS, Policy


class VLLMPolicy(Policy):
    """vLLM emulation.

    Parameters
    ----------
    prefix_caching : bool
        ``enable_prefix_caching`` (hash-block cache with LRU eviction).
    chunked_prefill : bool
        ``enable_chunked_prefill`` with ``max_num_batched_tokens`` from the calibration table (2048).
    order : {"arrival", "dfs"}
        ``dfs`` feeds the requests in the depth-first order of their prefix tree (BlendServe's vLLM-DFS baseline);
        the order comes from :mod:`prefixattn.scheduling`.
    name : str, optional
    """

    cache_mode = "lru"

    def __init__(self, prefix_caching: bool = True, chunked_prefill: bool = True, order: str = "arrival",
                 name: str | None = None) -> None:
        if order not in ("arrival", "dfs"):
            raise ValueError(f"order: expected 'arrival' or 'dfs', got {order!r}")
        self.prefix_sharing = prefix_caching
        self.cache_mode = "lru" if prefix_caching else None
        self.chunked = chunked_prefill
        self.order = order
        self.name = name or "vllm"
        self.waiting: deque = deque()
        self.running: list = []
        self._admission_blocked = False

    def describe(self) -> dict:
        return dict(super().describe(), chunked_prefill=self.chunked, order=self.order)

    def kv_capacity_tokens(self, cost) -> int:
        c = cost.calib
        self.max_seqs = int(c.vllm_max_num_seqs)
        self.budget = int(c.vllm_max_num_batched_tokens) if self.chunked else \
            max(cost.model.max_model_len, int(c.vllm_max_num_batched_tokens))
        self.watermark_frac = c.vllm_watermark
        # vLLM profiles a forward pass of max_num_batched_tokens over max_num_seqs sequences
        return cost.kv_pool_tokens(c.vllm_gpu_memory_utilization, self.budget, self.max_seqs)

    def prepare(self, engine) -> None:
        seqs = engine.seqs
        if self.order == "dfs":
            from prefixattn.sim.policies.ordering import request_ids_in_tree_order
            seqs = [seqs[i] for i in request_ids_in_tree_order(engine.workload)]
        self.waiting = deque(seqs)
        self.running = []
        self.watermark = int(self.watermark_frac * engine.pool.num_blocks)

    # ------------------------------------------------------------------ helpers
    def _ensure(self, engine, index: int, n: int) -> bool:
        """Blocks for ``n`` more tokens of ``running[index]``, preempting the most recently admitted sequences not
        yet scheduled this step (vLLM pops its running queue from the back); False if the sequence itself went."""
        seq = self.running[index]
        while not engine.grow(seq, n):
            victim = self.running.pop()
            engine.preempt(victim)
            self.waiting.appendleft(victim)
            if victim is seq:
                return False
        return True

    def _try_admit(self, engine, budget_left: int, whole: bool):
        """Admit the head of the waiting queue if its prompt fits; returns (seq, tokens) or None."""
        seq = self.waiting[0]
        cached = engine.match_len(seq)
        new_tokens = seq.target - cached
        if whole and new_tokens > budget_left:
            return None
        # v0.5's can_allocate counts every block of the prompt, cached or not
        need = -(-seq.target // engine.block_size)
        if engine.pool.available() - need < self.watermark:
            self._admission_blocked = True
            return None
        self.waiting.popleft()
        engine.admit(seq)
        if not engine.grow(seq, seq.target - seq.computed):  # v0.5 allocates the whole prompt at admission
            raise RuntimeError("vllm policy: admission passed the memory check but allocation failed")
        self.running.append(seq)
        return seq, (new_tokens if whole else min(new_tokens, budget_left))

    # ------------------------------------------------------------------ steps
    def schedule(self, engine) -> list:
        self._admission_blocked = False
        return self._schedule_chunked(engine) if self.chunked else self._schedule_default(engine)

    def _schedule_chunked(self, engine) -> list:
        budget = self.budget
        plan = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = 1 if seq.decoding else min(seq.remaining_prefill, budget)
            if seq.decoding and not self._ensure(engine, i, 1):
                break  # it was the last running sequence: nothing after it remains
            plan.append((seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            got = self._try_admit(engine, budget, whole=False)
            if got is None:
                break
            plan.append(got)
            budget -= got[1]
        if len(self.running) >= self.max_seqs and self.waiting:
            self._admission_blocked = True
        return plan

    def _schedule_default(self, engine) -> list:
        plan = []
        budget = self.budget
        while self.waiting and len(self.running) < self.max_seqs:
            got = self._try_admit(engine, budget, whole=True)
            if got is None:
                break
            plan.append(got)
            budget -= got[1]
        if plan:
            return plan
        if self.waiting and len(self.running) >= self.max_seqs:
            self._admission_blocked = True
        if self.waiting and not self._admission_blocked:
            self._admission_blocked = True  # head prompt over budget cannot happen: budget >= max_model_len
        i = 0
        while i < len(self.running):
            if not self._ensure(engine, i, 1):
                break
            plan.append((self.running[i], 1))
            i += 1
        return plan

    def steady_steps(self, engine, plan) -> int:
        if not self.waiting or self._admission_blocked:
            return UNBOUNDED_STEPS
        return 1

    def on_step_done(self, engine, finished: list) -> None:
        if finished:
            done = set(id(s) for s in finished)
            self.running = [s for s in self.running if id(s) not in done]
