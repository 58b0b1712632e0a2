"""One offline batch through the real vLLM engine with per-step scheduler counts:
``python -m bench.vllm_batch_run IN.json OUT.json`` (a fresh process per configuration, run by
:mod:`bench.vllm_offline_batch`).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so :class:`StepRecorder` can wrap the
scheduler instance's ``schedule()`` and read each :class:`SchedulerOutput` plus the scheduler's request states; it
changes nothing the scheduler decides. vLLM's own ``SchedulerStats`` carry prefix-cache hits only with stats logging
on and no per-step token counts, hence the wrapper.

IN.json: ``{"model", "prompts": [[ids]], "max_tokens": [int per prompt], "llm": {LLM kwargs}}``.
OUT.json: greedy token ids per prompt, the min top-2 logprob gap, the per-step rows and their totals
(:meth:`StepRecorder.summary`), the scheduler class, seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time


class StepRecorder:
    """Per-step counts of a vLLM v1 scheduler, taken from what ``schedule()`` returns (behavior unchanged).

    Per step: tokens scheduled, requests scheduled, requests still waiting after the step, preemptions, recomputed
    tokens (positions a request had computed before a preemption and computes again), prefix-cache hit tokens of the
    requests admitted in the step (their computed tokens before their first chunk: the cache hit), split into first
    admissions and resumptions, and the KV cache usage after the step's allocation.
    """

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.rows: list[tuple] = []
        self.high: dict[str, int] = {}  # request id -> most positions it ever had computed
        self.admitted: set[str] = set()  # admitted at least once (a later admission is a resumption)
        inner = scheduler.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            self._record(out)
            return out

        scheduler.schedule = schedule

    def _record(self, out) -> None:
        if out.total_num_scheduled_tokens == 0:
            return
        starting = {r.req_id for r in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.resumed_req_ids)
        recomputed = hits = resumed_hits = 0
        for rid, n in out.num_scheduled_tokens.items():
            before = int(self.scheduler.requests[rid].num_computed_tokens) - n  # vLLM advances it in schedule()
            high = self.high.get(rid, 0)
            recomputed += max(0, min(before + n, high) - before)
            self.high[rid] = max(high, before + n)
            if rid in starting:
                if rid in self.admitted:
                    resumed_hits += before
                else:
                    hits += before
                    self.admitted.add(rid)
        waiting = self.scheduler.get_request_counts()[1]
        usage = float(self.scheduler.kv_cache_manager.usage)  # fraction of KV blocks held after the allocation
        self.rows.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), waiting,
                          len(out.preempted_req_ids or ()), recomputed, hits, resumed_hits, usage))

    def summary(self) -> dict:
        """Totals: steps, preemptions, recomputed tokens, prefix-cache hit tokens (first admissions and
        resumptions), mean / min scheduled tokens per step, and the min over steps that left requests waiting
        (BatchLLM's valleys: a low step while work was available)."""
        tokens = [r[0] for r in self.rows]
        busy = [r[0] for r in self.rows if r[2] > 0]
        return dict(steps=len(self.rows), preemptions=sum(r[3] for r in self.rows),
                    recomputed_tokens=sum(r[4] for r in self.rows), prefix_hit_tokens=sum(r[5] for r in self.rows),
                    resumed_hit_tokens=sum(r[6] for r in self.rows), scheduled_tokens=sum(tokens),
                    mean_tokens_per_step=sum(tokens) / max(1, len(tokens)), min_tokens_per_step=min(tokens),
                    min_tokens_per_step_while_waiting=min(busy) if busy else None,
                    max_requests_per_step=max(r[1] for r in self.rows),
                    mean_kv_usage=sum(r[7] for r in self.rows) / max(1, len(self.rows)),
                    mean_kv_usage_while_waiting=(sum(r[7] for r in self.rows if r[2] > 0) /
                                                 max(1, sum(r[2] > 0 for r in self.rows))))


def main(in_path: str, out_path: str) -> None:
    cfg = json.load(open(in_path))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: the recorder sees it
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, seed=0, enforce_eager=True, **cfg["llm"])
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    recorder = StepRecorder(scheduler)
    t_init = time.perf_counter()
    # ignore_eos: every request generates exactly max_tokens, so the output lengths are the ones asked for.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False, logprobs=2)
              for m in cfg["max_tokens"]]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in cfg["prompts"]], params, use_tqdm=False)
    t_gen = time.perf_counter()
    gaps = [top[0] - top[1] for o in outs for step in o.outputs[0].logprobs
            for top in [sorted((lp.logprob for lp in step.values()), reverse=True)]]
    admission = getattr(scheduler.waiting, "admission", None)
    json.dump(dict(tokens=[list(o.outputs[0].token_ids) for o in outs], min_top2_gap=min(gaps),
                   stats=dict(recorder.summary(), refused=getattr(admission, "refused", None)),
                   per_step=recorder.rows, scheduler_class=type(scheduler).__name__,
                   num_blocks=int(scheduler.kv_cache_config.num_blocks),
                   max_num_seqs=int(scheduler.scheduler_config.max_num_seqs),
                   max_num_batched_tokens=int(scheduler.scheduler_config.max_num_batched_tokens),
                   seconds=dict(init=t_init - t0, generate=t_gen - t_init)), open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
