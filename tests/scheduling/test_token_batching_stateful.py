"""Hypothesis state machine over TokenBatcher: add groups / step / finish / abort, checked against an independent
model of what the plans did.

Checked at every step: token budget and KV budget (the model's own block count, shared prefix blocks counted
once, equals the batcher's and stays within the budget); chunks are contiguous in each sequence; a request's
distinct tokens start only after every prefix level above it completed in an earlier step; decodes only after the
prompt is done; a twin batcher fed the same operations plans the same steps. At the end every request is drained
to completion within a bounded number of steps (no starvation, no deadlock) and finished exactly once. Runs with
two memory classes (shares per class) check the same invariants.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from prefixattn.scheduling import ChunkKind, PrefixGroup, TokenBatcher, group_prompts

#: Steps a running request may go without being scheduled before we call it starved (decodes rotate by wait).
STARVATION_STEPS = 64


def _shift(g: PrefixGroup, offset: int) -> PrefixGroup:
    return PrefixGroup(prefix_len=g.prefix_len, request_ids=[r + offset for r in g.request_ids],
                       prompt_lens=list(g.prompt_lens), children=[_shift(c, offset) for c in g.children],
                       parent_prefix_len=g.parent_prefix_len, dfs_rank=g.dfs_rank)


prompt_batches = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 2), min_size=0, max_size=10)),
    min_size=1, max_size=6)


class BatcherMachine(RuleBasedStateMachine):
    @initialize(token_budget=st.integers(1, 24), kv_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4]),
                estimate=st.sampled_from([None, 0, 3]),
                shares=st.sampled_from([None, (0.5, 0.5), (0.8, 0.2), (1.0, 0.0)]))
    def setup(self, token_budget, kv_blocks, block_size, estimate, shares):
        kw = dict(token_budget=token_budget, kv_blocks=kv_blocks, block_size=block_size, output_lens=estimate)
        if shares is not None:
            # odd request ids in the second memory class (ids past the array: class 0)
            kw.update(memory_classes=np.arange(200) % 2, class_shares=shares)
        self.a, self.b = TokenBatcher(**kw), TokenBatcher(**kw)
        self.budget, self.kv, self.bs = token_budget, kv_blocks, block_size
        self.next_id = 0
        self.req: dict[int, dict] = {}  # request id -> model state
        self.node_kv: dict[int, int] = {}  # prefix level -> tokens held
        self.node_done_step: dict[int, int] = {}
        self.step_no = 0
        self.preemptions = 0
        self.recomputed = 0

    # ---------------------------------------------------------------------------------------------------- rules
    @rule(batch=prompt_batches, levels=st.sampled_from([1, 2, None]))
    def add(self, batch, levels):
        # prompts built from a few shared stems so groups (and nested groups) really form
        stems = [[7, 7, 7, 7], [7, 7, 8], [9, 9, 9, 9, 9, 9], []]
        prompts = [stems[s] + tail + [1] for s, tail in batch]
        groups = [_shift(g, self.next_id) for g in group_prompts(prompts, levels=levels)]
        expect_reject = any(self._need_blocks(g, r) > self.kv for g in groups for r in g.request_ids)
        errors = []
        for batcher in (self.a, self.b):
            try:
                batcher.add_groups(groups)
            except ValueError as e:
                errors.append(str(e))
        assert len(errors) in (0, 2)
        assert bool(errors) == expect_reject, errors
        if errors:
            assert "can never fit" in errors[0]
            return
        for g in groups:
            self._register(g, base=0)
        self.next_id += len(prompts)

    @rule()
    def step(self):
        plan = self.a.step()
        twin = self.b.step()
        for name in ("kinds", "request_ids", "nodes", "starts", "num_tokens"):
            assert np.array_equal(getattr(plan, name), getattr(twin, name)), name
        assert (plan.preempted, plan.truncated, plan.freed_nodes) == (twin.preempted, twin.truncated,
                                                                      twin.freed_nodes)
        self._apply(plan)

    @precondition(lambda self: any(r["state"] == "decode" for r in self.req.values()))
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.req.items() if m["state"] == "decode")))
        self.a.finish(rid)
        self.b.finish(rid)
        self._end(rid)

    @precondition(lambda self: any(r["state"] not in ("done",) for r in self.req.values()))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, m in self.req.items() if m["state"] != "done")))
        self.a.abort(rid)
        self.b.abort(rid)
        self._end(rid)

    def teardown(self):
        if not hasattr(self, "a"):
            return
        work = sum(m["own"] + 2 for m in self.req.values()) + sum(self._level_sizes()) + 10
        limit = 10 * work + 50
        for _ in range(limit):
            if self.a.done:
                break
            plan = self.a.step()
            self.b.step()
            self._apply(plan)
            for rid in sorted(r for r, m in self.req.items() if m["state"] == "decode"):
                self.a.finish(rid)
                self.b.finish(rid)
                self._end(rid)
        assert self.a.done, f"not drained after {limit} steps: {self.a.stats}"
        assert all(m["state"] == "done" for m in self.req.values())
        assert all(m["ends"] == 1 for m in self.req.values())
        assert self.a.kv_blocks_used == 0
        assert self.a.stats["preemptions"] == self.preemptions
        assert self.a.stats["recomputed_tokens"] == self.recomputed

    # ---------------------------------------------------------------------------------------------------- model
    def _level_sizes(self):
        return [self.a.prefix_node(v).size for v in self.node_kv]

    def _need_blocks(self, g: PrefixGroup, rid: int) -> int:
        """Blocks request ``rid`` needs alone: its shared levels, its own prompt part and one output token."""
        blocks, base, node = 0, 0, g
        while True:
            if node.num_requests > 1 and node.prefix_len > base:
                blocks += math.ceil((node.prefix_len - base) / self.bs)
                base = node.prefix_len
            inner = [c for c in node.children if rid in c.request_ids]
            if not inner:
                break
            node = inner[0]
        length = node.prompt_lens[node.request_ids.index(rid)]
        return blocks + math.ceil((length - base + 1) / self.bs)

    def _register(self, g: PrefixGroup, base: int):
        here = g.prefix_len if g.num_requests > 1 and g.prefix_len > base else base
        nested = {r for c in g.children for r in c.request_ids}
        for c in g.children:
            self._register(c, here)
        for r, p in zip(g.request_ids, g.prompt_lens):
            if r not in nested:
                self.req[r] = dict(state="waiting", base=here, own=p - here, target=p - here, kv=0, generated=0,
                                   last=self.step_no, ends=0, node=None)

    def _end(self, rid: int):
        m = self.req[rid]
        assert m["state"] != "done"
        m.update(state="done", kv=0)
        m["ends"] += 1

    def _blocks(self) -> int:
        return sum(math.ceil(kv / self.bs) for kv in self.node_kv.values()) + \
            sum(math.ceil(m["kv"] / self.bs) for m in self.req.values())

    def _chain_complete_before(self, node: int) -> int:
        """Tokens covered by the complete levels from ``node`` up; asserts each completed in an earlier step."""
        covered = 0
        while node >= 0:
            info = self.a.prefix_node(node)
            assert self.node_kv.get(node, 0) == info.size, "distinct tokens before their prefix is complete"
            assert self.node_done_step[node] < self.step_no, "distinct tokens in the step that completed the prefix"
            covered += info.size
            node = info.parent
        return covered

    def _apply(self, plan):
        assert plan.step == self.step_no
        assert plan.total_tokens <= self.budget
        for v in plan.freed_nodes:
            self.node_kv[v] = 0
            self.node_done_step.pop(v, None)
        for rid in plan.preempted:
            m = self.req[rid]
            self.preemptions += 1
            self.recomputed += m["kv"]
            if m["generated"]:
                m["target"] = m["own"] + m["generated"] - 1
            m.update(state="waiting", kv=0)
        for rid in plan.truncated:
            self._end(rid)
        completed = []
        seen = set()
        for kind, rid, node, start, n in zip(plan.kinds.tolist(), plan.request_ids.tolist(), plan.nodes.tolist(),
                                             plan.starts.tolist(), plan.num_tokens.tolist()):
            assert n >= 1
            if kind == ChunkKind.PREFIX:
                info = self.a.prefix_node(node)
                held = self.node_kv.get(node, 0)
                assert start == info.start + held and held + n <= info.size
                if info.parent >= 0:
                    self._chain_complete_before(info.parent)
                self.node_kv[node] = held + n
                if held + n == info.size:
                    self.node_done_step[node] = self.step_no
                continue
            m = self.req[rid]
            assert rid not in seen, "a request got two chunks in one step"
            seen.add(rid)
            assert m["state"] != "done"
            assert start == m["base"] + m["kv"], "chunks must be contiguous"
            if kind == ChunkKind.DECODE:
                assert m["state"] == "decode" and n == 1
                m["generated"] += 1
            else:
                assert m["state"] in ("waiting", "prefill")
                assert m["kv"] + n <= m["target"]
                covered = self._chain_complete_before(node) if node >= 0 else 0
                assert covered == m["base"], "a request's prefix levels must cover everything before its own part"
                m["state"] = "prefill"
                if m["kv"] + n == m["target"]:
                    completed.append(rid)
            m["kv"] += n
            m["last"] = self.step_no
        for rid in completed:
            m = self.req[rid]
            m["state"] = "decode"
            m["generated"] = max(m["generated"], 1)
        blocks = self._blocks()
        assert blocks == plan.kv_blocks_used, (blocks, plan.kv_blocks_used)
        assert blocks <= self.kv
        self.step_no += 1
        for rid, m in self.req.items():
            if m["state"] == "decode":
                assert self.step_no - m["last"] <= STARVATION_STEPS, f"request {rid} starved"


BatcherMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestTokenBatcherStateful = BatcherMachine.TestCase
