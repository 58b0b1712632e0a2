"""Engines a replica actor can own: vLLM with prefixattn, prefixattn's simulator, or any callable.

An engine has ``generate(prompts, rows) -> list[dict]``: ``prompts`` are the replica's token-id lists (its whole
share of the batch, grouped by prefix), ``rows`` the matching input rows (without the pipeline's own columns); it
returns one dict of output columns per prompt, in the same order. ``stats()`` (optional) returns a dict about the
last call, reported per replica. :func:`as_engine` adapts a plain callable ``fn(prompts) -> list`` (one output per
prompt, reported in the column ``output``).
"""

from __future__ import annotations

from typing import Any, Callable

#: Output tokens when a row names none (neither the pipeline's output-length column nor ``max_tokens``).
DEFAULT_MAX_TOKENS = 128


class CallableEngine:
    """Wraps ``fn(prompts) -> list`` (one output per prompt) as an engine; outputs go to the column ``output``."""

    def __init__(self, fn: Callable) -> None:
        if not callable(fn):
            raise ValueError(f"fn: expected a callable fn(prompts) -> list, got {type(fn).__name__}")
        self.fn = fn

    def generate(self, prompts: list, rows: list) -> list:
        outs = self.fn(prompts)
        return [{"output": o} for o in outs]


def as_engine(obj) -> Any:
    """``obj`` if it has ``generate``, else a :class:`CallableEngine` around it."""
    if hasattr(obj, "generate") and callable(obj.generate):
        return obj
    if callable(obj):
        return CallableEngine(obj)
    raise ValueError(f"engine: expected an object with generate(prompts, rows) or a callable fn(prompts), got "
                     f"{type(obj).__name__}")


def _max_tokens(row: dict, column: str | None, default: int) -> int:
    for key in (column, "max_tokens", "output_len"):
        if key and row.get(key) is not None:
            return int(row[key])
    return default


class SimulatedEngine:
    """prefixattn's simulator as the engine: runs one policy over the replica's requests on the cost model.

    No tokens are produced: each request reports the tokens it would generate, its modeled finish step and time;
    ``stats()`` gives the replica's modeled time, saving ratio and steps. It lets the pipeline (partitioning, one
    actor per replica, retries, joins) run anywhere, and the benchmark measure modeled makespans.

    Parameters
    ----------
    policy : str
        A :func:`prefixattn.sim.policies.make_policy` name (``prefixattn``, ``batchllm``, ``vllm``...).
    model, gpu : str
        :mod:`prefixattn.sim.presets` names.
    output_len_column : str, optional
        Row column with each request's output tokens (then ``max_tokens``, ``output_len``, else ``default_output_len``).
    """

    def __init__(self, policy: str = "prefixattn", model: str = "mistral-7b", gpu: str = "a100", *,
                 output_len_column: str | None = None, default_output_len: int = DEFAULT_MAX_TOKENS) -> None:
        from prefixattn.sim.step_cost import CostModel
        from prefixattn.sim.policies import make_policy

        make_policy(policy)  # fail on a bad name at construction, not mid-batch
        self.policy = policy
        self.cost = CostModel(gpu, model)
        self.output_len_column = output_len_column
        self.default_output_len = int(default_output_len)
        self._stats: dict = {}

    def generate(self, prompts: list, rows: list) -> list:
        import numpy as np

        from prefixattn.sim.engine import Engine
        from prefixattn.sim.policies import make_policy
        from prefixattn.sim.workloads import Request, Workload

        reqs = [Request(i, np.asarray(p, dtype=np.int32), _max_tokens(r, self.output_len_column,
                                                                        self.default_output_len))
                for i, (p, r) in enumerate(zip(prompts, rows))]
        engine = Engine(Workload("replica", reqs), self.cost, make_policy(self.policy))
        result = engine.run()
        clock = np.asarray(engine.timeline.clock, dtype=np.float64)
        ends = np.cumsum(np.asarray(engine.timeline.count, dtype=np.int64))  # step count after each record
        out = []
        for seq in engine.seqs:
            rec = int(np.searchsorted(ends, seq.finished_step, side="left"))
            out.append({"output_len": seq.generated, "finish_step": seq.finished_step,
                        "finish_time_s": float(clock[min(rec, clock.shape[0] - 1)])})
        self._stats = dict(modeled_time_s=result.time_s, saving_ratio=result.saving_ratio, steps=result.steps,
                           preemptions=result.preemptions, policy=self.policy)
        return out

    def stats(self) -> dict:
        return dict(self._stats)


class VLLMEngine:
    """vLLM ``LLM`` with prefixattn's attention backend and prefix-group scheduler (when ``use_prefixattn``).

    Built inside the actor (the model loads once per replica). Requests are submitted in one ``generate`` call, so
    vLLM's scheduler sees the replica's whole share and
    :class:`prefixattn.integrations.vllm.scheduler.PrefixGroupScheduler` admits it group by group.

    Parameters
    ----------
    model : str
        Model path or name for ``vllm.LLM``.
    sampling : dict, optional
        ``vllm.SamplingParams`` keyword arguments (default: greedy, ``detokenize=False``); ``max_tokens`` comes from
        each row when it has one.
    use_prefixattn : bool
        ``PREFIXATTN`` backend + prefix-group scheduler + prefix caching
        (:func:`prefixattn.integrations.vllm.scheduler.memory_bound_engine_kwargs`); False runs stock vLLM.
    output_len_column : str, optional
        Row column with each request's ``max_tokens``.
    **llm_kwargs
        More ``vllm.LLM`` arguments (they override the prefixattn defaults).
    """

    def __init__(self, model: str, *, sampling: dict | None = None, use_prefixattn: bool = True,
                 output_len_column: str | None = None, **llm_kwargs) -> None:
        from vllm import LLM, SamplingParams

        kwargs = {}
        if use_prefixattn:
            from prefixattn.integrations.vllm.plugin import register
            from prefixattn.integrations.vllm.scheduler import memory_bound_engine_kwargs

            register()
            kwargs = memory_bound_engine_kwargs(async_scheduling=llm_kwargs.pop("async_scheduling", False))
        kwargs.update(llm_kwargs)
        self.llm = LLM(model=model, **kwargs)
        self._sampling_cls = SamplingParams
        self.sampling = dict(dict(temperature=0.0, detokenize=False), **(sampling or {}))
        self.output_len_column = output_len_column
        self._stats: dict = {}

    def generate(self, prompts: list, rows: list) -> list:
        default = int(self.sampling.get("max_tokens", DEFAULT_MAX_TOKENS))
        base = {k: v for k, v in self.sampling.items() if k != "max_tokens"}
        params = [self._sampling_cls(max_tokens=_max_tokens(r, self.output_len_column, default), **base)
                  for r in rows]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            result.append({"output_token_ids": list(c.token_ids), "output_text": c.text or "",
                           "num_cached_tokens": int(getattr(o, "num_cached_tokens", 0) or 0)})
        self._stats = dict(cached_prompt_tokens=sum(r["num_cached_tokens"] for r in result),
                           output_tokens=sum(len(r["output_token_ids"]) for r in result))
        return result

    def stats(self) -> dict:
        return dict(self._stats)
