"""Block-granular KV memory with the prefix-cache behaviours of the emulated engines.

The pool has ``num_blocks`` blocks of ``block_size`` tokens. A block is

* free,
* private to one sequence (a partially filled block, a decode block, or a duplicate of a cached block),
* a *keyed* prompt block: full, identified by the hash of every token up to its end, shareable through the key, with
  a reference count; at reference count 0 it stays cached (evictable) or is freed, depending on ``cache``.

``cache`` selects what happens to unreferenced blocks:

``"lru"``
    vLLM's hash-based prefix cache: every full block of a finished or preempted sequence stays cached and the
    least-recently-used one is evicted first, deepest first among equals (vLLM's evictor order);
``"radix"``
    SGLang's radix cache: same LRU clock, but only leaves of the cached tree can be evicted;
``None``
    no implicit cache: unreferenced blocks are freed at once. Sharing then happens only while some sequence holds the
    blocks (BatchLLM's explicit group prefixes).

Generated (decode) blocks are cached too in the ``lru``/``radix`` modes, as both engines do, but can never hit (their
tokens are unique): they are kept as anonymous evictable bundles, which is what makes them compete with prompt
blocks for cache space.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

CACHE_MODES = ("lru", "radix", None)

#: Odd 64-bit multiplier of the polynomial prefix hash (any odd constant with well-mixed bits works).
_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)
_POWERS = np.ones(1, dtype=np.uint64)
#: Heap depth key of a bundle of generated blocks: deeper than any prompt block, so among blocks released at the same
#: time it goes first (vLLM evicts the deepest block among equally old ones).
_BUNDLE_DEPTH = 2 ** 62


def _powers(n: int) -> np.ndarray:
    global _POWERS
    if _POWERS.shape[0] < n:
        size = max(n, 2 * _POWERS.shape[0])
        with np.errstate(over="ignore"):
            _POWERS = np.cumprod(np.full(size, _HASH_BASE, dtype=np.uint64))
    return _POWERS[:n]


def prefix_block_keys(tokens: np.ndarray, block_size: int) -> list:
    """Keys of the full blocks of ``tokens``: block ``j``'s key hashes every token in ``[0, (j + 1) * block_size)``.

    Two prompts get equal keys for block ``j`` exactly when they agree on all tokens up to the end of that block (up
    to 64-bit hash collisions), which is what vLLM's chained block hashes express.
    """
    n_full = tokens.shape[0] // block_size
    if n_full == 0:
        return []
    n = n_full * block_size
    with np.errstate(over="ignore"):
        h = np.cumsum((tokens[:n].astype(np.uint64) + np.uint64(1)) * _powers(n), dtype=np.uint64)
    return h[block_size - 1::block_size].tolist()


class Block:
    """A keyed (shareable) full prompt block."""

    __slots__ = ("key", "depth", "ref", "last_access", "version", "parent", "children")

    def __init__(self, key: int, depth: int, parent: "Block | None") -> None:
        self.key = key
        self.depth = depth
        self.ref = 1
        self.last_access = 0.0
        self.version = 0
        self.parent = parent
        self.children = 0


class KVPool:
    """Blocks, reference counts and the prefix cache.

    Parameters
    ----------
    num_blocks : int
        Capacity in blocks.
    block_size : int
        Tokens per block.
    cache : {"lru", "radix", None}
        What happens to unreferenced keyed blocks (see module docstring).
    """

    def __init__(self, num_blocks: int, block_size: int, cache: str | None) -> None:
        if cache not in CACHE_MODES:
            raise ValueError(f"cache: expected one of {CACHE_MODES}, got {cache!r}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive block count, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self.free = num_blocks
        self.private = 0
        self.keyed_in_use = 0
        self.evictable = 0
        self.table: dict = {}
        self._heap: list = []
        self._tick = itertools.count()
        self.peak_used = 0
        self.evictions = 0

    # ------------------------------------------------------------------ accounting
    @property
    def used(self) -> int:
        """Blocks referenced by some sequence."""
        return self.private + self.keyed_in_use

    def available(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones it may evict."""
        return self.free + self.evictable

    def check(self) -> None:
        """Raise if the block accounting does not add up to the capacity."""
        total = self.free + self.private + self.keyed_in_use + self.evictable
        if total != self.num_blocks or min(self.free, self.private, self.keyed_in_use, self.evictable) < 0:
            raise RuntimeError(f"KV pool accounting broken: free {self.free} + private {self.private} + keyed "
                               f"{self.keyed_in_use} + evictable {self.evictable} != {self.num_blocks}")

    def _note_peak(self) -> None:
        used = self.private + self.keyed_in_use
        if used > self.peak_used:
            self.peak_used = used

    # ------------------------------------------------------------------ lookup
    def match(self, keys: list, max_blocks: int) -> list:
        """Longest run of cached blocks for ``keys[:max_blocks]`` (not yet referenced: call :meth:`acquire`)."""
        out = []
        table = self.table
        for key in keys[:max_blocks]:
            blk = table.get(key)
            if blk is None:
                break
            out.append(blk)
        return out

    def acquire(self, blocks: list, now: float) -> None:
        """Reference ``blocks`` (hits): cached-evictable ones come back into use."""
        for blk in blocks:
            if blk.ref == 0:
                self.evictable -= 1
                self.keyed_in_use += 1
                blk.version += 1
            blk.ref += 1
            blk.last_access = now
        self._note_peak()

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> bool:
        """Take ``n`` private blocks, evicting cached ones if needed; False (and nothing taken) if impossible."""
        if n <= 0:
            return True
        if n > self.free + self.evictable:
            return False
        while self.free < n:
            self._evict_one()
        self.free -= n
        self.private += n
        self._note_peak()
        return True

    def _evict_one(self) -> None:
        heap = self._heap
        while heap:
            _, _, _, blk, version, count = heapq.heappop(heap)
            if blk is None:  # anonymous bundle of generated blocks
                self.evictable -= count
                self.free += count
                self.evictions += count
                return
            if blk.ref != 0 or blk.version != version or blk.key is None:
                continue  # stale entry
            if self.cache == "radix" and blk.children:
                continue  # not a leaf any more; re-pushed when it becomes one
            self._drop(blk)
            return
        raise RuntimeError("KV pool: eviction requested with nothing evictable")

    def _drop(self, blk: Block) -> None:
        del self.table[blk.key]
        blk.key = None
        self.evictable -= 1
        self.free += 1
        self.evictions += 1
        parent = blk.parent
        if parent is not None:
            parent.children -= 1
            if self.cache == "radix" and parent.children == 0 and parent.ref == 0 and parent.key is not None:
                self._push(parent)

    def _push(self, blk: Block) -> None:
        heapq.heappush(self._heap, (blk.last_access, -blk.depth, next(self._tick), blk, blk.version, 1))

    # ------------------------------------------------------------------ keyed blocks
    def promote(self, key: int, depth: int, parent: Block | None, now: float) -> Block | None:
        """A private block of a sequence just became a full prompt block with ``key``: make it shareable.

        Returns the keyed block (reference held by the caller), or None when an equal block is already keyed (a
        duplicate computed concurrently stays private, as in vLLM v1).
        """
        if key in self.table:
            return None
        blk = Block(key, depth, parent)
        blk.last_access = now
        self.table[key] = blk
        if parent is not None:
            parent.children += 1
        self.private -= 1
        self.keyed_in_use += 1
        return blk

    def release(self, blocks: list, n_private: int, n_cacheable_private: int, now: float) -> None:
        """Drop one sequence's references: keyed ``blocks`` and ``n_private`` private blocks.

        ``n_cacheable_private`` of the private blocks are full generated blocks: kept as an evictable bundle when the
        pool caches, freed otherwise.
        """
        for blk in reversed(blocks):
            blk.ref -= 1
            blk.last_access = now
            if blk.ref == 0:
                self.keyed_in_use -= 1
                blk.version += 1
                if self.cache is None:
                    del self.table[blk.key]
                    blk.key = None
                    self.free += 1
                    if blk.parent is not None:
                        blk.parent.children -= 1
                else:
                    self.evictable += 1
                    if self.cache == "lru" or blk.children == 0:
                        self._push(blk)
        self.private -= n_private
        if self.cache is not None and n_cacheable_private > 0:
            self.evictable += n_cacheable_private
            self.free += n_private - n_cacheable_private
            heapq.heappush(self._heap, (now, -_BUNDLE_DEPTH, next(self._tick), None, 0, n_cacheable_private))
        else:
            self.free += n_private
