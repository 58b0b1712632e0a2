"""What an engine does by default, in miniature: requests in arrival order, chunked prefill, an LRU prefix cache.

The whole-batch runs (whole_batch.py) compare prefixattn's scheduler (TokenBatcher: groups, BatchLLM's
order) with this: vLLM's schedule as its V1 scheduler runs it by default. Each step, under a token budget, the
running requests first in arrival order (a decode is one token, an unfinished prefill its next chunk), then waiting
requests in arrival order while the budget and the blocks last. A request admitted first looks its prompt up in the
prefix cache (full blocks keyed by the chain hash of their tokens; never its last token, which must be computed to
sample). Blocks nobody holds stay cached and are evicted least recently freed first. When a running request needs a
block and none is free, the newest running request is preempted (its blocks freed; it recomputes later). Output
tokens get ids no prompt uses, so no two outputs share a cached block.

:func:`schedule` returns every step as a :class:`model_layout.StepLayout` over physical block ids ``< num_blocks``;
each step's groups are the runs of requests whose tables start with the same blocks (the cascade peer's oracle).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from gpu_check.model_layout import StepLayout


#: Requests running at once: vLLM's default ``max_num_seqs``.
MAX_RUNNING = 256


class _Pool:
    """Physical blocks: reference counts, the cache of full blocks by chain hash, the LRU order of free ones."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        self.key_of: dict[int, int] = {}  # block -> chain key of the tokens it holds (full blocks only)
        self.block_of: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # oldest first

    def lookup(self, key: int) -> int | None:
        return self.block_of.get(key)

    def take(self, block: int) -> None:
        """Hold ``block`` (a cache hit or a fresh allocation)."""
        if self.refs[block] == 0:
            self.free.pop(block)
        self.refs[block] += 1

    def allocate(self) -> int | None:
        """A block off the LRU end of the free list (its cached key evicted), held; None when none is free."""
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
        self.refs[block] = 1
        return block

    def cache(self, block: int, key: int) -> None:
        """``block`` now holds the full block ``key`` (another copy of the same key keeps the first)."""
        if key not in self.block_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def release(self, blocks: list) -> None:
        for b in reversed(blocks):  # the tail first: a prefix's head stays cached longest
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None


class _Request:
    def __init__(self, rid: int, prompt, output_len: int) -> None:
        self.rid, self.output_len = rid, output_len
        self.prompt_len = len(prompt)
        self.tokens = [int(t) for t in prompt]  # the prompt, then the outputs so far
        self.prefill_end = self.prompt_len  # positions the current prefill computes (all tokens after a preemption)
        self.computed = 0  # positions whose KV exists
        self.blocks: list[int] = []
        self.keys: list[int] = []  # chain keys of its full, computed blocks, in order

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_end

    @property
    def outputs(self) -> int:
        return len(self.tokens) - self.prompt_len


def _chain_keys(tokens: list, block_size: int, keys: list) -> list:
    """``keys`` extended to every full block of ``tokens``: block j's key hashes block j-1's key with its tokens."""
    out = list(keys)
    for j in range(len(out), len(tokens) // block_size):
        out.append(hash((out[-1] if out else None, tuple(tokens[j * block_size:(j + 1) * block_size]))))
    return out


def schedule(prompts, outputs, *, token_budget: int, num_blocks: int, block_size: int,
             max_running: int = MAX_RUNNING, stats: dict | None = None) -> list:
    """Every step of the batch under the arrival-order schedule (module docstring): a list of StepLayout. ``stats``
    (a dict, optional) gets ``preemptions`` and ``cached_tokens`` (prompt positions found in the cache)."""
    stats = {} if stats is None else stats
    stats.update(preemptions=0, cached_tokens=0)
    waiting = [_Request(i, p, int(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]
    waiting.reverse()  # pop() takes the earliest arrival
    running: list[_Request] = []
    pool, steps = _Pool(num_blocks), []
    next_token = -1  # output ids below every prompt id: never a cache hit
    while waiting or running:
        budget, chunks = token_budget, []
        for req in list(running):
            if req not in running:  # preempted below for an older request
                continue
            n = min(req.prefill_end - req.computed, budget) if req.prefilling else 1
            while n and not _grow(pool, req, req.computed + n, block_size):
                victim = running.pop()  # the newest: it recomputes later
                _preempt(pool, victim)
                stats["preemptions"] += 1
                waiting.append(victim)
                if victim is req:
                    n = 0
            if n:
                chunks.append((req, req.computed, n))
                budget -= n
            if budget <= 0:
                break
        while waiting and budget > 0 and len(running) < max_running:
            req = waiting[-1]
            req.prefill_end = len(req.tokens)
            hit = _cached_prefix(pool, req, block_size)
            n = min(req.prefill_end - hit, budget)
            if not _grow(pool, req, hit + n, block_size):
                _preempt(pool, req)
                break
            waiting.pop()
            running.append(req)
            stats["cached_tokens"] += hit
            chunks.append((req, hit, n))
            budget -= n
        if not chunks:
            raise RuntimeError(f"arrival-order schedule: a request needs more than the pool's {num_blocks} blocks")
        steps.append(_layout(len(steps), chunks, block_size))
        for req, start, n in chunks:
            req.computed = start + n
            if not req.prefilling:  # a decode, or the chunk that ends the prefill: samples a token
                req.tokens.append(next_token)
                next_token -= 1
            _cache_full_blocks(pool, req, block_size)
            if req.outputs >= req.output_len:
                running.remove(req)
                pool.release(req.blocks)
    return steps


def _cached_prefix(pool: _Pool, req: _Request, block_size: int) -> int:
    """Hold the request's leading cached blocks (never the last position, which must be computed to sample): the
    positions they cover, now computed."""
    req.blocks, req.keys = [], []
    for key in _chain_keys(req.tokens[:req.prefill_end - 1], block_size, []):
        block = pool.lookup(key)
        if block is None:
            break
        pool.take(block)
        req.blocks.append(block)
        req.keys.append(key)
    req.computed = len(req.blocks) * block_size
    return req.computed


def _grow(pool: _Pool, req: _Request, positions: int, block_size: int) -> bool:
    """Blocks for ``positions`` positions; False (keeping those it got) when the pool has none left."""
    while len(req.blocks) * block_size < positions:
        block = pool.allocate()
        if block is None:
            return False
        req.blocks.append(block)
    return True


def _cache_full_blocks(pool: _Pool, req: _Request, block_size: int) -> None:
    """Key the request's newly full, computed blocks in the cache."""
    full, first = req.computed // block_size, len(req.keys)
    if full > first:
        req.keys = _chain_keys(req.tokens[:full * block_size], block_size, req.keys)
        for block, key in zip(req.blocks[first:full], req.keys[first:]):
            pool.cache(block, key)


def _preempt(pool: _Pool, req: _Request) -> None:
    """Recompute preemption: the blocks go back to the pool; prompt and outputs are computed again on re-admission."""
    pool.release(req.blocks)
    req.blocks, req.keys, req.computed = [], [], 0


def _layout(step: int, chunks: list, block_size: int) -> StepLayout:
    """One step's StepLayout: decodes first, then prefill chunks, each part in scheduling order."""
    chunks = sorted(chunks, key=lambda c: c[1] < c[0].prefill_end)  # stable: decodes first
    q_lens = np.array([n for _, _, n in chunks], dtype=np.int64)
    kv_lens = np.array([s + n for _, s, n in chunks], dtype=np.int64)
    width = max(len(r.blocks) for r, _, _ in chunks)
    table = np.zeros((len(chunks), width), dtype=np.int32)
    for i, (r, _, _) in enumerate(chunks):
        table[i, :len(r.blocks)] = r.blocks
    indptr = np.r_[0, np.cumsum(q_lens)]
    positions = np.concatenate([np.arange(s, s + n) for _, s, n in chunks])
    rows = np.repeat(np.arange(len(chunks)), q_lens)
    slots = table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    sampled = np.array([indptr[i + 1] - 1 for i, (r, s, n) in enumerate(chunks) if s + n >= r.prefill_end],
                       dtype=np.int64)
    decode = all(s >= r.prefill_end for r, s, _ in chunks)
    return StepLayout(step=step, kind="decode" if decode else "mixed", qo_indptr=indptr.astype(np.int32),
                      kv_lens=kv_lens.astype(np.int32), block_table=table, num_blocks=int(table.max()) + 1,
                      positions=positions, slots=slots, sampled_rows=sampled,
                      groups=_groups(table, kv_lens, q_lens, block_size))


def _groups(table: np.ndarray, kv_lens: np.ndarray, q_lens: np.ndarray, block_size: int) -> list:
    """Runs of consecutive rows that start with the same whole blocks (before their query rows): ``[(rows, shared
    tokens)]``, every row in one run."""
    seen = (kv_lens - q_lens) // block_size  # whole blocks every row of the request sees
    groups, i = [], 0
    while i < len(table):
        j, shared = i, int(seen[i])
        while j + 1 < len(table):
            common = int(min(shared, seen[j + 1]))
            k = 0
            while k < common and table[i, k] == table[j + 1, k]:
                k += 1
            if k == 0:
                break
            shared, j = k, j + 1
        members = list(range(i, j + 1))
        groups.append((members, shared * block_size if len(members) > 1 else 0))
        i = j + 1
    return groups
