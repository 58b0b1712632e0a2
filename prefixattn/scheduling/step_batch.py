"""What :class:`prefixattn.scheduling.TokenBatcher` hands out: chunks, one step's batch of them, prefix levels."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np


class ChunkKind(IntEnum):
    """What a scheduled chunk computes."""

    DECODE = 0  #: one output token of a running request
    DISTINCT = 1  #: prompt tokens of one request after its shared prefix (or recomputation after preemption)
    PREFIX = 2  #: tokens of a shared prefix level, computed once for the group


class Chunk(NamedTuple):
    """One unit of work of a step. ``request_id`` for a PREFIX chunk is a member whose prompt holds the tokens."""

    kind: ChunkKind
    request_id: int
    node: int
    start: int
    num_tokens: int


@dataclass(frozen=True)
class StepBatch:
    """What to run in one engine step, as parallel arrays (one entry per chunk).

    Attributes
    ----------
    step : int
        Step number (0-based).
    kinds : np.ndarray
        ``[C]`` int8 :class:`ChunkKind` values.
    request_ids : np.ndarray
        ``[C]`` int64 request of each chunk (for PREFIX: a member whose prompt holds the prefix tokens).
    nodes : np.ndarray
        ``[C]`` int64 prefix level id for PREFIX chunks (see :meth:`TokenBatcher.prefix_node`), else the
        request's deepest shared level or -1.
    starts : np.ndarray
        ``[C]`` int64 position of the chunk's first token in the request's sequence (prompt then output).
    num_tokens : np.ndarray
        ``[C]`` int64 tokens to compute.
    preempted : tuple[int, ...]
        Requests whose KV was dropped this step; they are recomputed later (free their engine-side state).
    truncated : tuple[int, ...]
        Requests stopped because their output alone outgrew the KV budget: treat them as finished (length).
    freed_nodes : tuple[int, ...]
        Prefix levels whose KV was dropped since the previous plan (all their requests ended, or the level was
        released under memory pressure and will be recomputed): free their blocks.
    kv_blocks_used : int
        Blocks held after this step's allocations.
    """

    step: int
    kinds: np.ndarray
    request_ids: np.ndarray
    nodes: np.ndarray
    starts: np.ndarray
    num_tokens: np.ndarray
    preempted: tuple[int, ...]
    truncated: tuple[int, ...]
    freed_nodes: tuple[int, ...]
    kv_blocks_used: int

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks as named tuples (convenient, slower than the arrays)."""
        return [Chunk(ChunkKind(int(k)), int(r), int(n), int(s), int(t)) for k, r, n, s, t in
                zip(self.kinds, self.request_ids, self.nodes, self.starts, self.num_tokens)]


class PrefixNode(NamedTuple):
    """A shared prefix level: tokens ``[start, start + size)`` of every request below it."""

    start: int
    size: int
    representative: int  #: a member request id whose prompt holds the tokens
    parent: int  #: enclosing level, -1 at the top


class ChunkList:
    """The chunks of one step as they are scheduled: scalar appends for prefills, whole arrays for the decodes."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.kinds: list[int] = []
        self.rids: list[int] = []
        self.nodes: list[int] = []
        self.starts: list[int] = []
        self.ntok: list[int] = []
        self.size = 0

    def add(self, kind: ChunkKind, rid: int, node: int, start: int, n: int) -> None:
        self.kinds.append(int(kind))
        self.rids.append(rid)
        self.nodes.append(node)
        self.starts.append(start)
        self.ntok.append(n)
        self.size += 1

    def add_many(self, kind: ChunkKind, rids: np.ndarray, nodes: np.ndarray, starts: np.ndarray) -> None:
        m = rids.shape[0]
        self.parts.append((np.full(m, int(kind), np.int8), rids.astype(np.int64), nodes.astype(np.int64),
                           starts.astype(np.int64), np.ones(m, np.int64)))
        self.size += m

    def build(self, step: int, preempted: list[int], truncated: list[int], freed: list[int], used: int
              ) -> StepBatch:
        parts = list(self.parts)
        if self.kinds:
            parts.append((np.array(self.kinds, np.int8), np.array(self.rids, np.int64), np.array(self.nodes, np.int64),
                          np.array(self.starts, np.int64), np.array(self.ntok, np.int64)))
        if not parts:
            empty = np.zeros(0, np.int64)
            cols = (np.zeros(0, np.int8), empty, empty, empty, empty)
        elif len(parts) == 1:
            cols = parts[0]
        else:
            cols = tuple(np.concatenate(c) for c in zip(*parts))
        return StepBatch(step=step, kinds=cols[0], request_ids=cols[1], nodes=cols[2], starts=cols[3],
                        num_tokens=cols[4], preempted=tuple(preempted), truncated=tuple(truncated),
                        freed_nodes=tuple(freed), kv_blocks_used=used)
