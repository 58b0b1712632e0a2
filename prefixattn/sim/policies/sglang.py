"""SGLang-style scheduling (0.5.x defaults): radix cache with LRU eviction of leaves, prefill and decode in separate
steps, one chunked request at a time, admission against a reserved-output budget, retraction on decode OOM.

Each iteration runs a prefill batch when one can be formed (new prompts' uncached tokens up to
``chunked_prefill_size``, a longer prompt is chunked and continued first next time), otherwise a decode step of
every running request. A new request is admitted only if its uncached prompt plus its whole (clipped) output fit the
free+evictable tokens left after reserving ``new_token_ratio`` x the remaining outputs of running requests; the
ratio decays from 0.7 to 0.098 over 600 decode steps and resets on a retraction.

Ordering: ``lpm`` (longest cached prefix first) falls back to FCFS when more than 128 requests wait, as SGLang's
``_determine_active_policy`` does; ``dfs-weight`` orders by a depth-first walk of the prompts' prefix tree (taken once
from :mod:`prefixattn.scheduling`'s DFS order: SGLang recomputes it on the runtime tree each step, which converges to
the same order once prefixes are cached); ``fcfs``.

Deviations: pages of 16 tokens instead of SGLang's default page size 1 (prefix matches lose < 16 tokens each); no
``max_running_requests`` cap (SGLang derives a large one from memory); mixed prefill+decode batches are off (SGLang's
default).
"""

from __future__ import annotations

from prefixattn.sim.policies.base import UNBOUNDED_STEPS, Policy

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")


class SGLangPolicy(Policy):
    """SGLang emulation.

    Parameters
    ----------
    schedule_policy : {"lpm", "dfs-weight", "fcfs"}
    name : str, optional
    """

    cache_mode = "radix"

    def __init__(self, schedule_policy: str = "lpm", name: str | None = None) -> None:
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy: expected one of {SCHEDULE_POLICIES}, got {schedule_policy!r}")
        self.schedule_policy = schedule_policy
        self.name = name or ("sglang" if schedule_policy == "lpm" else f"sglang-{schedule_policy}")
        self.waiting: list = []
        self.running: list = []
        self.chunked = None

    def describe(self) -> dict:
        return dict(super().describe(), schedule_policy=self.schedule_policy)

    def kv_capacity_tokens(self, cost) -> int:
        c = cost.calib
        large = cost.hw.memory_bytes >= c.sglang_large_gpu_bytes
        self.chunk = int(c.sglang_chunked_prefill_size_large if large else c.sglang_chunked_prefill_size)
        self.max_prefill = int(c.sglang_max_prefill_tokens)
        self.lpm_threshold = int(c.sglang_lpm_fcfs_threshold)
        self.clip = int(c.sglang_clip_max_new_tokens)
        self.init_ratio = c.sglang_init_new_token_ratio
        self.min_ratio = self.init_ratio * c.sglang_min_new_token_ratio_factor
        self.decay = (self.init_ratio - self.min_ratio) / c.sglang_new_token_ratio_decay_steps
        self.ratio = self.init_ratio
        # mem_fraction_static covers weights + KV pool; activations live outside it
        reserved = cost.weight_bytes
        return cost.kv_pool_tokens(c.sglang_mem_fraction_static, self.chunk, 0, reserved_bytes=reserved)

    def prepare(self, engine) -> None:
        seqs = list(engine.seqs)
        if self.schedule_policy == "dfs-weight":
            from prefixattn.sim.policies.ordering import request_ids_in_tree_order
            seqs = [seqs[i] for i in request_ids_in_tree_order(engine.workload)]
        self.waiting = seqs
        self.running = []
        self.chunked = None
        self.ratio = self.init_ratio

    # ------------------------------------------------------------------ prefill
    def _reserved_tokens(self) -> float:
        return sum(min(s.output_len - s.generated, self.clip) for s in self.running if s.decoding) * self.ratio

    def _order_waiting(self, engine) -> None:
        if self.schedule_policy == "lpm" and len(self.waiting) <= self.lpm_threshold:
            self.waiting.sort(key=lambda s: -engine.match_len(s))  # stable: FCFS among equal matches

    def _prefill(self, engine) -> list:
        bs = engine.block_size
        rem_total = engine.pool.available() * bs - self._reserved_tokens()
        rem_chunk = self.chunk
        rem_input = self.max_prefill
        plan = []
        if self.chunked is not None:
            seq = self.chunked
            n = min(seq.remaining_prefill, rem_chunk)
            if n < seq.remaining_prefill:
                n -= n % bs
            if n <= 0 or not engine.grow(seq, n):
                return []
            plan.append((seq, n))
            rem_chunk -= n
            rem_input -= n
            if n == seq.remaining_prefill:
                self.chunked = None
        if self.chunked is not None or not self.waiting:
            return plan
        self._order_waiting(engine)
        taken = 0
        for seq in self.waiting:
            if rem_chunk <= 0 or rem_input <= 0:
                break
            cached = engine.match_len(seq)
            extend = seq.target - cached
            need = extend + min(seq.output_len - seq.generated, self.clip)
            if need > rem_total:
                break
            n = min(extend, rem_chunk)
            if n < extend:
                n -= n % bs
                if n <= 0:
                    break
            # the hit blocks may leave the evictable pool when referenced: count them against availability
            if -(-(cached + n) // bs) > engine.pool.available():
                break
            engine.admit(seq)
            if not engine.grow(seq, n):
                raise RuntimeError("sglang policy: admission passed the memory check but allocation failed")
            plan.append((seq, n))
            taken += 1
            rem_total -= need
            rem_chunk -= n
            rem_input -= n
            self.running.append(seq)
            if n < extend:
                self.chunked = seq
                break
        del self.waiting[:taken]
        return plan

    # ------------------------------------------------------------------ decode
    def _retract_one(self, engine) -> None:
        # SGLang retracts the request with the fewest output tokens and, among those, the longest input
        victim = min((s for s in self.running if s.decoding), key=lambda s: (s.generated, -s.prompt_len))
        self.running.remove(victim)
        engine.preempt(victim)
        self.waiting.insert(0, victim)
        self.ratio = self.init_ratio

    def _decode(self, engine) -> list:
        decoding = [s for s in self.running if s.decoding]
        while decoding:
            need = sum(engine.blocks_needed(s, 1) for s in decoding)
            if need <= engine.pool.available():
                break
            self._retract_one(engine)
            decoding = [s for s in self.running if s.decoding]
        plan = []
        for seq in decoding:
            if not engine.grow(seq, 1):
                raise RuntimeError("sglang policy: decode allocation failed after the memory check")
            plan.append((seq, 1))
        self.ratio = max(self.min_ratio, self.ratio - self.decay)
        return plan

    def schedule(self, engine) -> list:
        plan = self._prefill(engine)
        return plan if plan else self._decode(engine)

    def steady_steps(self, engine, plan) -> int:
        # the reservation ratio decays every decode step, so admission may open without a finish: only promise
        # steadiness when nothing waits
        return UNBOUNDED_STEPS if not self.waiting and self.chunked is None else 1

    def on_step_done(self, engine, finished: list) -> None:
        if finished:
            done = set(id(s) for s in finished)
            self.running = [s for s in self.running if id(s) not in done]
