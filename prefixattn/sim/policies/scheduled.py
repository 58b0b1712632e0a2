"""Policies built on :mod:`prefixattn.scheduling`: BatchLLM, BlendServe, NanoFlow-DFS and prefixattn.

Grouping (:func:`group_prompts`), ordering (:func:`order_groups`), output-length sampling and token batching
(:class:`TokenBatcher`: three queues, memory-centric batching, explicit group prefixes) all come from the scheduler;
this module only translates each :class:`StepBatch` into engine work:

* a PREFIX chunk is computed by a *holder* sequence that keeps the prefix's KV for the group's members;
* DISTINCT / DECODE chunks advance the request's own sequence, on top of its prefix (``Seq.base``);
* preempted requests are released and recomputed later (the batcher keeps the pending output token);
* finished requests are reported back with :meth:`TokenBatcher.finish`; a holder is released when the batcher
  reports its prefix freed (all its requests ended, or dropped under memory pressure and recomputed later).

The engine's block pool holds exactly what the batcher counts, and every step checks that the two agree, so the
memory the policy believes it has is the memory the simulation charges.
"""

from __future__ import annotations

import numpy as np

from prefixattn.scheduling import (ChunkKind, DensityModel, TokenBatcher, estimate_output_lens,
                                   order_groups, sample_requests)
from prefixattn.scheduling.admission import PROJECTIONS
from prefixattn.scheduling.blendserve import memory_classes
from prefixattn.sim.engine import RUNNING, WAITING
from prefixattn.sim.policies.base import Policy
from prefixattn.sim.policies.ordering import groups_of
from prefixattn.sim.policies.registry import register

_DECODE, _DISTINCT, _PREFIX = int(ChunkKind.DECODE), int(ChunkKind.DISTINCT), int(ChunkKind.PREFIX)


class ScheduledPolicy(Policy):
    """A serving policy whose every decision comes from :mod:`prefixattn.scheduling`.

    Parameters
    ----------
    name : str
    ordering : str
        :func:`prefixattn.scheduling.order_groups` policy (``batchllm``, ``blendserve``, ``dfs``, ``fcfs``).
    levels : int or None
        :func:`group_prompts` nesting depth (1 = BatchLLM's single level; None = the whole tree).
    outputs : {"constant", "sampled"}
        ``constant``: output lengths unknown (BatchLLM's Eq. 4 assumption, no reservation); ``sampled``: 1% of the
        requests are measured first (BlendServe sec. 3.2) and the estimates drive ordering and memory reservation.
    kernel, split_k, backend
        Attention kernel kind, split-k, engine backend (see :mod:`prefixattn.sim.step_cost`).
    min_shared_blocks : int
        Prefix levels adding fewer than this many KV blocks are not shared (passed to :func:`group_prompts`).
    budget_constant : str
        Calibration-table name of the token budget per step.
    clip_constant : str, optional
        Calibration-table name of a cap on each request's output estimate *as a memory reservation* (ordering still
        sees the full estimate), SGLang's reservation clip: a few very long outputs then cannot reserve the whole
        KV pool (:class:`TokenBatcher`'s ``reservation_clip``; its memory-class projection then looks that many
        steps ahead of now).
    memory_split : bool
        Split the KV memory between compute- and memory-intensive requests (BlendServe's dual-scanner partition,
        :func:`prefixattn.scheduling.blendserve.memory_classes`, enforced by the :class:`TokenBatcher`); needs
        sampled outputs.
    projection : {"ends", "peak"}
        :class:`TokenBatcher`'s reservation projection (:mod:`prefixattn.scheduling.admission`, the rule the vLLM
        scheduler applies); a projection other than the default is appended to the policy's name. Only matters
        with sampled outputs (without estimates nothing is reserved).
    """

    cache_mode = None
    prefix_sharing = False
    commits_steady_steps = True

    def __init__(self, name: str, ordering: str, levels, outputs: str, kernel: str, split_k: bool, backend: str,
                 min_shared_blocks: int = 1, budget_constant: str = "batchllm_chunk_tokens",
                 clip_constant: str | None = None, memory_split: bool = False,
                 projection: str = PROJECTIONS[0]) -> None:
        if outputs not in ("constant", "sampled"):
            raise ValueError(f"outputs: expected 'constant' or 'sampled', got {outputs!r}")
        self.name = name
        self.ordering = ordering
        self.levels = levels
        self.outputs = outputs
        self.kernel = kernel
        self.split_k = split_k
        self.backend = backend
        self.min_shared_blocks = min_shared_blocks
        self.budget_constant = budget_constant
        self.clip_constant = clip_constant
        if memory_split and outputs != "sampled":
            raise ValueError("memory_split: needs outputs='sampled' (the split follows estimated output lengths)")
        self.memory_split = memory_split
        self._base_name = name
        self.use_projection(projection)
        self._pending = None

    def use_projection(self, projection: str) -> None:
        if projection not in PROJECTIONS:
            raise ValueError(f"projection: expected one of {PROJECTIONS}, got {projection!r}")
        self.projection = projection
        self.name = self._base_name if projection == PROJECTIONS[0] else f"{self._base_name}-{projection}"

    def describe(self) -> dict:
        return dict(super().describe(), ordering=self.ordering, levels=self.levels, outputs=self.outputs,
                    memory_split=self.memory_split, projection=self.projection)

    def kv_capacity_tokens(self, cost) -> int:
        c = cost.calib
        self.token_budget = int(getattr(c, self.budget_constant))
        self.threshold = c.batchllm_memory_threshold
        self.sample_rate = c.output_sample_rate
        # BatchLLM (and prefixattn's integration) run inside vLLM: its memory profile (a forward pass of the token
        # budget, the sampler at max_num_seqs rows); steps sampling more rows than that live in the 10% of device
        # memory gpu_memory_utilization leaves out
        return cost.kv_pool_tokens(c.vllm_gpu_memory_utilization, self.token_budget, int(c.vllm_max_num_seqs))

    # ------------------------------------------------------------------ offline preparation
    def _density_model(self, cost) -> DensityModel:
        m, hw = cost.model, cost.hw
        # kv_dim: the K (or V) width of BlendServe's 2-tensor, 2-byte formula (MLA: half the latent row)
        return DensityModel(params=float(m.active_params), hidden=m.hidden_size, num_layers=m.num_layers,
                            kv_dim=m.kv_width // 2, compute=hw.peak_flops, bandwidth=hw.hbm_bandwidth)

    def prepare(self, engine) -> None:
        w = engine.workload
        bs = engine.block_size
        groups = groups_of(w, self.levels, self.min_shared_blocks * bs)
        est = None
        if self.outputs == "sampled":
            ids = sample_requests(groups, rate=self.sample_rate, seed=0)
            est = estimate_output_lens(groups, ids, [w.requests[i].output_len for i in ids])
        options = dict(cost_model=self._density_model(engine.cost)) if self.ordering == "blendserve" else {}
        ordered = order_groups(groups, self.ordering, output_lens=est, **options)
        clip = int(getattr(engine.calib, self.clip_constant)) if est is not None and self.clip_constant else None
        classes = shares = None
        if self.memory_split:
            classes, shares = memory_classes(groups, est, self._density_model(engine.cost))
            self.class_shares = shares.tolist()
        self.batcher = TokenBatcher(token_budget=self.token_budget,
                                    kv_blocks=int(engine.pool.num_blocks * self.threshold), block_size=bs,
                                    output_lens=est, reservation_clip=clip, memory_classes=classes,
                                    class_shares=shares, projection=self.projection)
        self.batcher.add_groups(ordered)
        # prefix levels per request: (key, start, end), outermost first, as the batcher builds its nodes
        self.paths: dict = {}
        for g in ordered:
            self._walk(g, [], 0)
        self.seqs = engine.seqs
        for seq in self.seqs:
            path = self.paths.get(seq.rid, [])
            seq.path = path
            seq.base = path[-1][2] if path else 0
        self.holders: dict = {}
        self._pending = None

    def _walk(self, g, path, base) -> None:
        if g.num_requests > 1 and g.prefix_len > base:
            path = path + [(id(g), base, g.prefix_len)]
            base = g.prefix_len
        nested = set()
        for c in g.children:
            self._walk(c, path, base)
            nested.update(c.request_ids)
        for r in g.request_ids:
            if r not in nested:
                self.paths[r] = path

    # ------------------------------------------------------------------ steps
    def _holder(self, engine, v: int):
        holder = self.holders.get(v)
        if holder is None:
            node = self.batcher.prefix_node(v)
            path = self.paths[node.representative]
            key = next(k for k, s, e in path if s == node.start and e == node.start + node.size)
            holder = engine.new_holder(self.seqs[node.representative].prompt[:node.start + node.size], base=node.start,
                                       path=[p for p in path if p[2] <= node.start], tag=key)
            self.holders[v] = holder
        return holder

    def _grow(self, engine, seq, n: int) -> None:
        if not engine.grow(seq, n):
            raise RuntimeError(f"{self.name}: the engine's KV pool disagrees with the token batcher "
                               f"(no room for {n} tokens of {seq})")

    def _convert(self, engine, sp) -> list:
        for v in sp.freed_nodes:
            holder = self.holders.get(v)
            if holder is not None and holder.state == RUNNING:
                engine.drop_holder(holder)  # all its requests ended, or it was dropped for memory (recomputed later)
        for rid in sp.preempted:
            seq = self.seqs[rid]
            if seq.state == RUNNING:
                engine.preempt(seq, keep_pending=True)
        if sp.truncated:
            raise RuntimeError(f"{self.name}: the batcher truncated requests {sp.truncated[:4]}: an output outgrew "
                               "the KV budget")
        plan = []
        append = plan.append
        seqs = self.seqs
        bs = engine.block_size
        kinds = sp.kinds
        if sp.num_tokens.shape[0] and (kinds == _DECODE).all():
            # pure decode (the common step): only block boundaries need an allocation
            for rid in sp.request_ids.tolist():
                seq = seqs[rid]
                if (len(seq.blocks) + seq.n_private) * bs <= seq.computed - seq.base:
                    self._grow(engine, seq, 1)
                append((seq, 1))
            return plan
        for kind, rid, node, start, n in zip(kinds.tolist(), sp.request_ids.tolist(), sp.nodes.tolist(),
                                             sp.starts.tolist(), sp.num_tokens.tolist()):
            if kind == _DECODE:
                seq = seqs[rid]
            elif kind == _DISTINCT:
                seq = seqs[rid]
                if seq.state == WAITING:
                    engine.admit_with_base(seq)
            else:
                seq = self._holder(engine, node)
                if seq.state != RUNNING:
                    engine.admit_with_base(seq)
            if seq.computed != start:
                raise RuntimeError(f"{self.name}: chunk of {seq} starts at {start}, engine is at {seq.computed}")
            self._grow(engine, seq, n)
            append((seq, n))
        return plan

    def schedule(self, engine) -> list:
        if self._pending is not None:
            sp, self._pending = self._pending, None
        else:
            sp = self.batcher.step()
        self._current = sp
        plan = self._convert(engine, sp)
        used = engine.pool.used
        if used != sp.kv_blocks_used:
            raise RuntimeError(f"{self.name}: engine holds {used} KV blocks, batcher counts {sp.kv_blocks_used}")
        return plan

    def steady_steps(self, engine, plan) -> int:
        """Pull further batcher steps while they repeat this pure-decode step exactly (same requests, nothing
        preempted), up to the first step in which a request can finish; the first different plan is kept."""
        sp = self._current
        if sp.preempted or not (sp.kinds == _DECODE).all():
            return 1
        k_max = min(s.output_len - s.generated for s, _ in plan)
        count = 1
        ids = sp.request_ids
        while count < k_max:
            nxt = self.batcher.step()
            if nxt.preempted or nxt.truncated or nxt.freed_nodes or nxt.request_ids.shape != ids.shape or \
                    not (nxt.kinds == _DECODE).all() or not np.array_equal(nxt.request_ids, ids):
                self._pending = nxt
                break
            count += 1
        return count

    def on_step_done(self, engine, finished: list) -> None:
        for seq in finished:
            self.batcher.finish(seq.rid)

register("batchllm", lambda **kw: ScheduledPolicy("batchllm", "batchllm", 1, "constant", "fused", False,
                                                  "sequential", **kw),
         "BatchLLM: single-level global groups (Algorithm 1), Eq. 4 order, three queues, memory-centric batching, "
         "fused prefix attention (no split-k)")
register("blendserve", lambda **kw: ScheduledPolicy("blendserve", "blendserve", 1, "sampled", "paged", False,
                                                    "overlap", memory_split=True, **kw),
         "BlendServe: density-sorted groups + dual scanner (1% output sampling; memory split between compute- and "
         "memory-intensive requests), memory-based batching, paged attention, NanoFlow-style overlapped backend")
register("nanoflow-dfs", lambda **kw: ScheduledPolicy("nanoflow-dfs", "dfs", 1, "sampled", "paged", False,
                                                      "overlap", **kw),
         "NanoFlow-DFS (BlendServe's baseline): prefix-tree DFS order, same batching and overlapped backend")
register("prefixattn", lambda **kw: ScheduledPolicy("prefixattn", "batchllm", 2, "sampled", "fused", True,
                                                    "sequential", budget_constant="prefixattn_token_budget",
                                                    clip_constant="prefixattn_reservation_clip", memory_split=True,
                                                    **kw),
         "prefixattn: two-level groups, Eq. 3 order with sampled output lengths, memory-centric batching with "
         "reservations and a memory split for long-output requests, fused prefix attention with split-k")
register("prefixattn-2k", lambda **kw: ScheduledPolicy("prefixattn-2k", "batchllm", 2, "sampled", "fused", True,
                                                       "sequential", clip_constant="prefixattn_reservation_clip",
                                                       memory_split=True, **kw),
         "prefixattn with BatchLLM's 2048-token budget (sensitivity of the token-budget choice)")
register("prefixattn-overlap", lambda **kw: ScheduledPolicy("prefixattn-overlap", "batchllm", 2, "sampled", "fused",
                                                            True, "overlap", budget_constant="prefixattn_token_budget",
                                                            clip_constant="prefixattn_reservation_clip",
                                                            memory_split=True, **kw),
         "prefixattn's scheduling and kernel on a NanoFlow-style overlapped backend (same-backend comparison with "
         "BlendServe; operator overlap is not part of this library)")
