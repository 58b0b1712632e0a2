"""The simplest path for offline batches: ``generate(llm, prompts, sampling_params)``.

Groups the whole batch by shared prompt prefix and orders the groups globally (BatchLLM by default) *before*
handing it to ``LLM.generate``, so requests that share a prefix are admitted together and compute it once through
vLLM's prefix cache; returns the outputs in the caller's original order. Works with any vLLM scheduler: under the
default FCFS policy the order of submission is the admission order; under ``scheduling_policy="priority"`` the
order is passed as priorities (ties keep the caller's priorities first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from prefixattn.integrations.vllm.scheduler import DEFAULT_LEVELS, DEFAULT_ORDERING, OUTPUT_LEN_KEY, group_order


def _token_ids(prompt, tokenizer_fn) -> list[int] | None:
    """Token ids of one prompt in any of ``LLM.generate``'s forms; None when it has none (embeddings only)."""
    if isinstance(prompt, str):
        return tokenizer_fn(prompt)
    if isinstance(prompt, dict):
        if prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        if prompt.get("prompt") is not None:
            return tokenizer_fn(prompt["prompt"])
        return None
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def _output_lens(sampling_params, n: int):
    """``(known, limits)`` per prompt from ``SamplingParams`` (one, or one per prompt), as the scheduler reads them
    from its requests: the ``extra_args`` estimate (NaN where none) and ``max_tokens`` (inf where None)."""
    if sampling_params is None:
        return None, None
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: expected one entry per prompt ({n}), got {len(params)}")
    limits = [math.inf if getattr(p, "max_tokens", None) is None else float(p.max_tokens) for p in params]
    known = [(getattr(p, "extra_args", None) or {}).get(OUTPUT_LEN_KEY, math.nan) for p in params]
    return [float(k) for k in known], limits


def admission_order(prompts: Sequence[Any], *, ordering: str = DEFAULT_ORDERING, levels: int = DEFAULT_LEVELS,
                    min_shared_tokens: int = 1, tokenize=None, sampling_params=None) -> list[int]:
    """Indices of ``prompts`` in the order to submit them: prefix groups together, groups in ``ordering``'s order.

    Prompts without token ids (embeddings) keep their relative order after the others. ``tokenize(text)`` turns a
    text prompt into token ids (e.g. the LLM's tokenizer); without it a text prompt raises ValueError.
    ``sampling_params`` (one, or one per prompt) give the ordering its decode weights, as in the scheduler.
    """
    def no_tokenizer(text):
        raise ValueError("prompts: expected token ids (a {'prompt_token_ids': [...]} dict or a list of ints) for "
                         "an LLM without a tokenizer, got a text prompt")

    ids = [_token_ids(p, tokenize or no_tokenizer) for p in prompts]
    with_ids = [i for i, t in enumerate(ids) if t]
    known, limits = _output_lens(sampling_params, len(prompts))
    order = group_order([ids[i] for i in with_ids], ordering=ordering, levels=levels,
                        min_shared_tokens=min_shared_tokens,
                        known=None if known is None else [known[i] for i in with_ids],
                        limits=None if limits is None else [limits[i] for i in with_ids])
    return [with_ids[k] for k in order] + [i for i, t in enumerate(ids) if not t]


def generate(llm, prompts: Sequence[Any], sampling_params=None, *, ordering: str = DEFAULT_ORDERING,
             levels: int = DEFAULT_LEVELS, **generate_kwargs) -> list:
    """``llm.generate`` with the batch grouped by shared prefix and ordered globally; outputs in input order.

    Parameters
    ----------
    llm : vllm.LLM
        Any engine; with prefix caching on, members of a group reuse their prefix's KV (prefixattn's attention
        backend then also reads it once per step).
    prompts : sequence of prompts
        Any form ``LLM.generate`` takes (token-id dicts, text, ...). Text is tokenized with the LLM's tokenizer
        to find the groups.
    sampling_params : SamplingParams or list of them, optional
        A list is paired with ``prompts`` one by one, as in ``LLM.generate``.
    ordering : str
        A policy of :data:`prefixattn.scheduling.ORDERINGS` (``batchllm``, ``dfs``, ``fcfs``, ``blendserve``).
    levels : int
        Prefix-group nesting depth (1 = BatchLLM's single level).
    **generate_kwargs
        Passed to ``LLM.generate``; per-prompt lists (``lora_request``, ``priority``) are reordered with the prompts.

    Returns
    -------
    list[RequestOutput]
        ``outputs[i]`` belongs to ``prompts[i]``.

    Examples
    --------
    >>> from prefixattn.integrations.vllm.offline import generate
    >>> outs = generate(llm, [{"prompt_token_ids": ids} for ids in batch], SamplingParams(max_tokens=64))
    """
    prompts = list(prompts)
    if not prompts:
        return []
    engine_config = llm.llm_engine.vllm_config
    tokenize = None
    if not engine_config.model_config.skip_tokenizer_init:
        tokenizer = llm.get_tokenizer()
        tokenize = lambda text: list(tokenizer.encode(text))  # noqa: E731
    block_size = int(engine_config.cache_config.block_size or 1)
    order = admission_order(prompts, ordering=ordering, levels=levels, min_shared_tokens=block_size,
                            tokenize=tokenize, sampling_params=sampling_params)
    n = len(prompts)

    def permute(name, value):
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name}: expected one entry per prompt ({n}), got {len(value)}")
            return [value[i] for i in order]
        return value

    sampling_params = permute("sampling_params", sampling_params)
    kwargs = {k: permute(k, v) for k, v in generate_kwargs.items()}
    if str(getattr(engine_config.scheduler_config, "policy", "fcfs")) == "priority":
        # Priority scheduling admits by (priority, arrival): encode the order as a tie-breaking rank under the
        # caller's priorities (scaled so a caller's priority step always dominates the rank).
        given = kwargs.get("priority")
        base = given if isinstance(given, list) else [given or 0] * n
        kwargs["priority"] = [int(p) * n + rank for rank, p in enumerate(base)]
    outputs = llm.generate([prompts[i] for i in order], sampling_params, **kwargs)
    result = [None] * n
    for pos, i in enumerate(order):
        result[i] = outputs[pos]
    return result
