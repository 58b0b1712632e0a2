"""Iteration-level engine: block-granular KV memory, prefix sharing, preemption by recompute, a modeled clock.

The engine owns the mechanics every emulated system shares (sequences, KV blocks, the cache, executing a step and
advancing the clock by the cost model); a :class:`prefixattn.sim.policies.Policy` owns the decisions (order,
admission, what goes into each step, whom to preempt). One step is a list of ``(sequence, new_tokens)``.

Sequence life: ``admit`` (prefix match, hits referenced) -> prefill chunks until the context is computed -> the step
that completes the prefill samples the first output token -> one decode token per step until ``output_len`` tokens
exist -> release. A preempted sequence frees everything and later recomputes its prompt *and* its generated tokens
(vLLM's recompute preemption); the cache may give part of that back.

Pure-decode stretches in which the policy promises not to change the batch (no admission possible, no finish) are
executed in one go ("fast-forward"): the batch is the same, every context grows by one token per step, and the time
is integrated from the cost at the start, middle and end of the stretch (Simpson's rule on a cost that is linear in
the context length except for a tail term). This is what makes 16K-token video decodes affordable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from prefixattn.sim.step_cost import CostModel, SharedRun, StepShape
from prefixattn.sim.kvpool import KVPool, prefix_block_keys

WAITING, RUNNING, FINISHED = 0, 1, 2


class Seq:
    """One sequence in the engine: a request, or a group-prefix holder (``output_len == 0``, never samples).

    Attributes
    ----------
    target : int
        Context tokens the current prefill must compute (prompt, plus generated tokens after a preemption).
    computed : int
        Context tokens whose KV exists (cache hits included).
    generated : int
        Output tokens sampled so far.
    decoding : bool
        The prefill is done; each step adds one token.
    blocks : list
        Keyed (shareable) prompt blocks held, in order; ``n_private`` more blocks are private.
    path : list
        ``(node_key, start, end)`` token ranges read as shared prefix nodes (fused/cascade kernels only).
    base : int
        Leading context tokens whose KV another sequence holds (an explicit group prefix); this sequence's own
        blocks cover the tokens after them.
    """

    __slots__ = ("rid", "prompt", "prompt_len", "output_len", "target", "computed", "generated", "decoding",
                 "blocks", "n_private", "keys", "state", "attempts", "first_hit", "hit_total", "path", "tag",
                 "is_holder", "admitted_step", "finished_step", "base")

    def __init__(self, rid: int, prompt: np.ndarray, output_len: int, is_holder: bool = False) -> None:
        self.rid = rid
        self.prompt = prompt
        self.prompt_len = int(prompt.shape[0])
        self.output_len = int(output_len)
        self.target = self.prompt_len
        self.computed = 0
        self.generated = 0
        self.decoding = False
        self.blocks: list = []
        self.n_private = 0
        self.keys = None
        self.state = WAITING
        self.attempts = 0
        self.first_hit = -1
        self.hit_total = 0
        self.path: list = []
        self.tag = None
        self.is_holder = is_holder
        self.admitted_step = -1
        self.finished_step = -1
        self.base = 0

    @property
    def remaining_prefill(self) -> int:
        return self.target - self.computed

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + self.n_private

    def __repr__(self) -> str:
        return (f"Seq(rid={self.rid}, computed={self.computed}/{self.target}, gen={self.generated}/"
                f"{self.output_len}, blocks={self.num_blocks})")


@dataclass
class Timeline:
    """Per-step records (a fast-forwarded stretch is one record with ``count`` > 1)."""

    count: list = field(default_factory=list)
    start_step: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    prefill_tokens: list = field(default_factory=list)
    seqs: list = field(default_factory=list)
    time: list = field(default_factory=list)
    clock: list = field(default_factory=list)
    used_blocks: list = field(default_factory=list)
    compute_s: list = field(default_factory=list)
    memory_s: list = field(default_factory=list)


def _fill_groups(shape: StepShape, keys: list, ends: list, qs: list) -> None:
    """The step's prefix groups, whatever the kernel shares (the cost model's L2 reuse reads them): sequences whose
    deepest held prefix node (``keys``, an int key per sequence, -1 for none; ``ends`` its end) is the same, where
    >= 2 of them run in the step, numbered in batch order. Nested groups count at their deepest node (sequences
    sharing only an outer node are not grouped together: an understatement of reuse)."""
    k = np.asarray(keys, dtype=np.int64)
    uniq, first, inverse, counts = np.unique(k, return_index=True, return_inverse=True, return_counts=True)
    ok = (uniq >= 0) & (counts >= 2)
    if not ok.any():
        return
    number = np.full(uniq.shape[0], -1, dtype=np.int64)
    chosen = np.nonzero(ok)[0]
    number[chosen[np.argsort(first[chosen], kind="stable")]] = np.arange(chosen.shape[0])
    ids = number[inverse.reshape(-1)]
    grouped = ids >= 0
    e = np.asarray(ends, dtype=np.int64)
    shape.group_ids, shape.group_lens = ids, np.where(grouped, e, 0)
    rows = np.bincount(ids[grouped], weights=np.asarray(qs, dtype=np.float64)[grouped], minlength=chosen.shape[0])
    prefix = np.zeros(chosen.shape[0], dtype=np.int64)
    prefix[ids[grouped]] = e[grouped]
    shape.group_runs = [SharedRun(int(t), int(r)) for t, r in zip(prefix, rows)]


class Engine:
    """Runs one policy over one workload on the cost model.

    Parameters
    ----------
    workload : prefixattn.sim.workloads.Workload
    cost : CostModel
    policy : prefixattn.sim.policies.Policy
    check : bool
        Verify the KV accounting after every step (tests).
    """

    def __init__(self, workload, cost: CostModel, policy, check: bool = False) -> None:
        self.workload = workload
        self.cost = cost
        self.calib = cost.calib
        self.policy = policy
        self.block_size = int(policy.block_size(self.calib))
        self.kv_tokens = int(policy.kv_capacity_tokens(cost))
        self.pool = KVPool(self.kv_tokens // self.block_size, self.block_size, policy.cache_mode)
        self.share = policy.prefix_sharing
        self.check = check
        self.seqs = [Seq(r.rid, r.prompt, r.output_len) for r in workload.requests]
        self.holders: list = []
        self.clock = 0.0
        self.step = 0
        self.timeline = Timeline()
        self.preemptions = 0
        self.prefill_executed = 0
        self.decode_executed = 0
        self.prefill_samples = 0
        self.attempt_work = 0
        self.finished = 0
        self.last_prefill_clock = 0.0
        self.peak_seqs = 0
        #: modeled seconds by part (linear / attention / other / launch / host), for explaining results
        self.breakdown = dict(linear=0.0, attention=0.0, other=0.0, launch=0.0, host=0.0, overlap=0.0)

    # ------------------------------------------------------------------ sequences
    def new_holder(self, prompt: np.ndarray, base: int = 0, path=(), tag=None) -> Seq:
        """A sequence that computes a group prefix ``prompt[base:]`` and holds its KV for the members (never
        samples); ``prompt[:base]`` is an enclosing prefix held by another holder."""
        seq = Seq(-1 - len(self.holders), prompt, 0, is_holder=True)
        seq.base = base
        seq.path = list(path)
        seq.tag = tag
        self.holders.append(seq)
        return seq

    def keys_of(self, seq: Seq) -> list:
        if seq.keys is None:
            seq.keys = prefix_block_keys(seq.prompt, self.block_size)
        return seq.keys

    def match_len(self, seq: Seq) -> int:
        """Tokens a fresh admission of ``seq`` would find cached right now (no side effects)."""
        if not self.share:
            return 0
        max_blocks = (seq.target - 1) // self.block_size if not seq.is_holder else seq.target // self.block_size
        return len(self.pool.match(self.keys_of(seq), max_blocks)) * self.block_size

    def admit(self, seq: Seq) -> int:
        """Start (or restart) ``seq``: reference its cached prefix blocks. Returns the hit tokens.

        At least the last context token is always computed (it produces the logits), so hits stop one token short of
        the context, rounded down to whole blocks.
        """
        hit = 0
        if self.share:
            # a holder samples nothing, so it may hit its whole prompt
            max_blocks = seq.target // self.block_size if seq.is_holder else (seq.target - 1) // self.block_size
            blocks = self.pool.match(self.keys_of(seq), max_blocks)
            if blocks:
                self.pool.acquire(blocks, self.clock)
                seq.blocks = blocks
                hit = len(blocks) * self.block_size
        seq.computed = hit
        seq.state = RUNNING
        seq.admitted_step = self.step
        if seq.first_hit < 0:
            seq.first_hit = hit
        seq.hit_total += hit
        seq.attempts += 1
        self.attempt_work += seq.target - hit
        return hit

    def admit_with_base(self, seq: Seq) -> None:
        """Start ``seq`` on top of its explicit prefix: the first ``seq.base`` tokens are held elsewhere."""
        seq.computed = seq.base
        seq.state = RUNNING
        seq.admitted_step = self.step
        if seq.first_hit < 0:
            seq.first_hit = seq.base
        seq.hit_total += seq.base
        seq.attempts += 1
        self.attempt_work += seq.target - seq.base

    def blocks_needed(self, seq: Seq, n_tokens: int) -> int:
        """New blocks ``seq`` needs to hold ``n_tokens`` more tokens of KV."""
        return -(-(seq.computed - seq.base + n_tokens) // self.block_size) - len(seq.blocks) - seq.n_private

    def grow(self, seq: Seq, n_tokens: int) -> bool:
        """Allocate the blocks for ``n_tokens`` more tokens; False (nothing taken) when memory is short."""
        if n_tokens == 1 and (len(seq.blocks) + seq.n_private) * self.block_size > seq.computed - seq.base:
            return True  # the next token lands in a block already held (the common decode case)
        need = self.blocks_needed(seq, n_tokens)
        if need <= 0:
            return True
        if not self.pool.allocate(need):
            return False
        seq.n_private += need
        return True

    def _release(self, seq: Seq) -> None:
        full_generated = 0
        if seq.generated:
            # full blocks past the prompt (generated tokens) go to the cache as anonymous evictable blocks
            full_generated = max(seq.computed // self.block_size - max(len(seq.blocks), seq.prompt_len //
                                                                        self.block_size), 0)
            full_generated = min(full_generated, seq.n_private)
        self.pool.release(seq.blocks, seq.n_private, full_generated, self.clock)
        seq.blocks = []
        seq.n_private = 0

    def preempt(self, seq: Seq, keep_pending: bool = False) -> None:
        """Preempt by recompute: free all of ``seq``'s KV; it restarts with prompt + generated tokens as context.

        With ``keep_pending`` the recompute stops one token short (the last sampled token is then decoded, as
        :class:`prefixattn.scheduling.TokenBatcher` does) instead of recomputing it and sampling again (vLLM).
        """
        if not seq.decoding:
            self.attempt_work -= seq.target - seq.computed  # the rest of this attempt is never executed
        self._release(seq)
        seq.target = seq.prompt_len + seq.generated - (1 if keep_pending and seq.generated else 0)
        seq.computed = 0
        seq.decoding = False
        seq.state = WAITING
        self.preemptions += 1

    def drop_holder(self, seq: Seq) -> None:
        """Free a holder's prefix KV (its group ended, or the scheduler dropped it to recompute later)."""
        if not seq.decoding:
            self.attempt_work -= seq.target - seq.computed
        self._release(seq)
        seq.computed = 0
        seq.decoding = False
        seq.state = WAITING

    def release_holder(self, seq: Seq) -> None:
        """A group completed: drop the holder's references to the prefix KV."""
        self._release(seq)
        seq.state = FINISHED
        seq.finished_step = self.step

    # ------------------------------------------------------------------ steps
    def _shape(self, plan: list, offset: float = 0) -> StepShape:
        qs = []
        kvs = []
        sampled = 0
        shared_kernel = self.policy.kernel != "paged"
        nodes: dict = {}
        reads = []  # per sequence: the (key, end) of the prefix nodes its KV reads, outermost first
        deep_keys, deep_ends = [], []  # per sequence: the deepest prefix node its KV holds (key, end; -1, 0: none)
        for seq, k in plan:
            c = seq.computed
            qs.append(k)
            kvs.append(c + k)
            # a token is sampled when the step computes the newest token of the sequence
            if not seq.is_holder and c + k == seq.prompt_len + seq.generated:
                sampled += 1
            mine = []
            for key, start, end in seq.path:
                if c < end:
                    break
                if shared_kernel:
                    node = nodes.get(key)
                    if node is None:
                        nodes[key] = [end - start, k, 1, len(mine) + 1]
                    else:
                        node[1] += k
                        node[2] += 1
                mine.append((key, end))
            reads.append(mine)
            deep_keys.append(mine[-1][0] if mine else -1)
            deep_ends.append(mine[-1][1] if mine else 0)
        kv = np.array(kvs, dtype=np.int64)
        shape = StepShape(q_lens=np.array(qs, dtype=np.int64), kv_lens=kv + offset if offset else kv,
                          num_sampled=sampled)
        _fill_groups(shape, deep_keys, deep_ends, qs)
        if nodes:
            fused = self.policy.kernel == "fused"
            pays = self.cost.sharing_pays_off
            # v = [kv_len, queries, members, level]; the fused kernel shares a node only where its cost rule pays.
            # A dict, not a set: the keys are id()s, and a set's order (the order the step cost sums the nodes in)
            # would follow memory addresses, making runs differ in the last bit.
            shared = {key: None for key, v in nodes.items() if v[2] >= 2 and (not fused or pays(v[2], v[1], v[0]))}
            if shared:
                lens = []
                grown: dict = {}
                for mine in reads:
                    total = 0
                    for key, end in mine:
                        if key in shared:
                            # a dropped outer node's tokens go to the next shared node inside it
                            grown[key] = end - total
                            total = end
                    lens.append(total)
                shape.shared_lens = np.array(lens, dtype=np.int64)
                shape.shared_nodes = [SharedRun(grown[key], nodes[key][1], nodes[key][3]) for key in shared]
        return shape

    def _cost(self, shape: StepShape):
        p = self.policy
        return self.cost.step_cost(shape, kernel=p.kernel, split_k=p.split_k, backend=p.backend)

    def execute(self, plan: list) -> list:
        """Run one step: advance the clock by its modeled time, update every sequence; return finished requests.

        Every sequence in ``plan`` must already hold the blocks for its new tokens (:meth:`grow`).
        """
        if not plan:
            raise RuntimeError("engine: empty step (policy produced nothing while work remains)")
        cost = self._cost(self._shape(plan))
        return self._apply(plan, 1, cost.total, cost)

    def _apply(self, plan: list, count: int, elapsed: float, cost) -> list:
        bs = self.block_size
        share = self.share
        finished = []
        prefill_tokens = 0
        tokens = 0
        for seq, k in plan:
            tokens += k
            if seq.decoding:
                seq.computed += k
                seq.generated += k
                self.decode_executed += k
            else:
                prefill_tokens += k
                seq.computed += k
                if seq.computed == seq.target:
                    seq.decoding = True
                    if not seq.is_holder and seq.computed == seq.prompt_len + seq.generated:
                        seq.generated += 1
                        self.prefill_samples += 1
                # prompt blocks fill up only while prefilling
                if share and seq.computed >= (len(seq.blocks) + 1) * bs and len(seq.blocks) * bs < seq.prompt_len:
                    self._promote(seq)
            if seq.generated >= seq.output_len and not seq.is_holder:
                finished.append(seq)
        self.prefill_executed += prefill_tokens
        self.clock += elapsed
        tl = self.timeline
        tl.count.append(count)
        tl.start_step.append(self.step)
        tl.tokens.append(tokens if count == 1 else len(plan))
        tl.prefill_tokens.append(prefill_tokens)
        tl.seqs.append(len(plan))
        tl.time.append(elapsed)
        tl.clock.append(self.clock)
        tl.used_blocks.append(self.pool.used)
        tl.compute_s.append(cost.compute_s * count)
        tl.memory_s.append(cost.memory_s * count)
        # parts scaled so they add up to the elapsed time (a stretch's parts are its first step's, rescaled)
        scale = elapsed / cost.total if cost.total else 0.0
        bd = self.breakdown
        bd["linear"] += cost.linear * scale
        bd["attention"] += cost.attention * scale
        bd["other"] += cost.other * scale
        bd["host"] += cost.host * scale
        bd["launch"] += cost.launch * scale
        bd["overlap"] += cost.overlap * scale
        if prefill_tokens:
            self.last_prefill_clock = self.clock
        self.step += count
        self.peak_seqs = max(self.peak_seqs, len(plan))
        for seq in finished:
            self._release(seq)
            seq.state = FINISHED
            seq.finished_step = self.step
            self.finished += 1
        if self.check:
            self.pool.check()
            if self.pool.used > self.pool.num_blocks:
                raise RuntimeError("KV pool over capacity")
        return finished

    def _promote(self, seq: Seq) -> None:
        """Key the prompt blocks ``seq`` just filled, until one turns out to be a duplicate."""
        bs = self.block_size
        keys = self.keys_of(seq)
        limit = min(seq.computed, seq.prompt_len) // bs
        while len(seq.blocks) < limit and seq.n_private > 0:
            j = len(seq.blocks)
            parent = seq.blocks[-1] if seq.blocks else None
            blk = self.pool.promote(keys[j], j, parent, self.clock)
            if blk is None:
                return
            seq.blocks.append(blk)
            seq.n_private -= 1

    # ------------------------------------------------------------------ fast-forward
    def decode_horizon(self, plan: list, limit: int) -> int:
        """Steps the pure-decode batch ``plan`` can run unchanged: until the first finish, within free memory."""
        comp = np.fromiter((s.computed - s.base for s, _ in plan), dtype=np.int64, count=len(plan))
        left = np.fromiter((s.output_len - s.generated for s, _ in plan), dtype=np.int64, count=len(plan))
        k_max = int(min(left.min(), limit))
        if k_max <= 1:
            return 1
        bs = self.block_size
        have = -(-comp // bs)
        avail = self.pool.available() - self.policy.decode_reserve_blocks(self)

        def need(k: int) -> int:
            return int((-(-(comp + k) // bs) - have).sum())

        if need(k_max) <= avail:
            return k_max
        lo, hi = 1, k_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= avail:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def execute_decode_stretch(self, plan: list, k: int) -> list:
        """Run ``k`` identical pure-decode steps at once (see module docstring)."""
        for seq, _ in plan:
            if not self.grow(seq, k):
                raise RuntimeError("engine: decode stretch ran out of memory (horizon miscomputed)")
        c0 = self._cost(self._shape(plan, 0))
        c_end = self._cost(self._shape(plan, k - 1))
        if k == 2:
            total = c0.total + c_end.total
        else:
            c_mid = self._cost(self._shape(plan, (k - 1) / 2))
            total = k * (c0.total + 4 * c_mid.total + c_end.total) / 6
        return self._apply([(s, k) for s, _ in plan], k, total, c0)

    # ------------------------------------------------------------------ run
    def run(self, progress=None):
        """Run the policy to completion and return a :class:`prefixattn.sim.metrics.SimResult`."""
        from prefixattn.sim.metrics import collect

        policy = self.policy
        policy.prepare(self)
        total = len(self.seqs)
        while self.finished < total:
            plan = policy.schedule(self)
            if not plan:
                raise RuntimeError(f"engine: policy {policy.name} scheduled nothing with "
                                   f"{total - self.finished} requests unfinished")
            k = 1
            if all(s.decoding for s, _ in plan):
                limit = policy.steady_steps(self, plan)
                if limit > 1:
                    # a policy that already committed to `limit` identical steps gets exactly that many
                    k = limit if policy.commits_steady_steps else self.decode_horizon(plan, limit)
            if k > 1:
                done = self.execute_decode_stretch(plan, k)
            else:
                done = self.execute(plan)
            policy.on_step_done(self, done)
            if progress is not None and done:
                progress(len(done))
        for holder in self.holders:
            if holder.state != FINISHED:
                self.release_holder(holder)
        return collect(self)
