"""Checks of what :class:`prefixattn.scheduling.TokenBatcher` is given: budgets, output estimates, groups."""

from __future__ import annotations

from typing import Container

import numpy as np

from prefixattn.scheduling.admission import blocks
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


def check_output_lens(output_lens) -> None | float | np.ndarray:
    """None, one float for every request, or ``[num_requests]`` float64 estimates (all finite, >= 0)."""
    if output_lens is None:
        return None
    if np.isscalar(output_lens):
        if isinstance(output_lens, bool) or not isinstance(output_lens, (int, float, np.integer, np.floating)) \
                or not np.isfinite(output_lens) or output_lens < 0:
            raise ValueError(f"output_lens: expected None, a length >= 0 or one per request, got {output_lens!r}")
        return float(output_lens)
    est = np.asarray(output_lens, dtype=np.float64)
    if est.ndim != 1 or not np.isfinite(est).all() or (est < 0).any():
        raise ValueError("output_lens: expected a 1-D array of finite lengths >= 0 (one per request id)")
    return est


def check_groups(groups, added: Container[int], block_size: int, kv_blocks: int, min_out: int) -> list:
    """``groups`` (one PrefixGroup or a sequence) as a list, checked: well formed, no request in ``added`` or twice,
    and every request able to fit alone (its shared levels, prompt and ``min_out`` output tokens in ``kv_blocks``)."""
    if isinstance(groups, PrefixGroup):
        groups = [groups]
    groups = list(groups)
    seen: set[int] = set()
    too_big = []
    for gi, g in enumerate(groups):
        if not isinstance(g, PrefixGroup):
            raise ValueError(f"groups[{gi}]: expected a PrefixGroup, got {type(g).__name__}")
        if len(g.request_ids) != len(g.prompt_lens) or not g.request_ids:
            raise ValueError(f"groups[{gi}]: expected one prompt length per request id and at least one request")
        for r, p in zip(g.request_ids, g.prompt_lens):
            if r in added or r in seen:
                raise ValueError(f"groups[{gi}]: request {r} was already added")
            if p < 1:
                raise ValueError(f"groups[{gi}]: expected prompt lengths >= 1, got {p} for request {r}")
            seen.add(r)
        for sub, _ in g.walk():
            if sub.num_requests > 1 and sub.prefix_len > min(sub.prompt_lens) - 1:
                raise ValueError(f"groups[{gi}]: expected prefix_len <= shortest prompt - 1 = "
                                 f"{min(sub.prompt_lens) - 1}, got {sub.prefix_len}")
        for r, chain_blocks, own in _chains(g, block_size):
            if chain_blocks + -(-(own + min_out) // block_size) > kv_blocks:
                too_big.append(r)
    if too_big:
        raise ValueError(f"groups: requests {too_big[:8]}{'...' if len(too_big) > 8 else ''} can never fit: "
                         f"their shared prefix, prompt and {min_out} output token(s) need more than "
                         f"kv_blocks={kv_blocks} blocks of {block_size} tokens")
    return groups


def _chains(g: PrefixGroup, block_size: int) -> list:
    """``(request id, blocks of its shared levels, own tokens)`` for every request of ``g`` (as added)."""
    out = []
    stack = [(g, 0, 0)]
    while stack:
        sub, held, base = stack.pop()
        if sub.num_requests > 1 and sub.prefix_len > base:
            held += blocks(sub.prefix_len - base, block_size)
            base = sub.prefix_len
        nested = set()
        for c in sub.children:
            stack.append((c, held, base))
            nested.update(c.request_ids)
        out.extend((r, held, p - base) for r, p in zip(sub.request_ids, sub.prompt_lens) if r not in nested)
    return out
