"""KV block accounting of :class:`prefixattn.scheduling.TokenBatcher`: blocks held against the budget.

A prefix level holds ``ceil(tokens / block_size)`` blocks (counted once for all its members) and each request holds
``ceil(own tokens / block_size)`` for the tokens after its deepest shared prefix (its distinct prompt and its
output), which is what a paged cache with per-request copies of partially filled shared blocks needs at most. The
ledger counts both in one total; the scheduling rules (:mod:`prefixattn.scheduling.token_batching`) decide who may
take blocks and who gives them back.
"""

from __future__ import annotations

from prefixattn.scheduling.admission import blocks
from prefixattn.scheduling.batch_state import PrefixLevels


class KVLedger:
    """Blocks in use out of ``kv_blocks``, the started prefix levels and the levels freed since the last plan.

    Parameters
    ----------
    kv_blocks : int
        KV cache blocks available to requests (BatchLLM's ``M_threshold``).
    block_size : int
        Tokens per KV block.
    """

    def __init__(self, kv_blocks: int, block_size: int) -> None:
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.used = 0  # blocks held by levels and requests
        self.active: dict[int, None] = {}  # started prefix levels (holding or computing KV), in start order
        self.active_full_blocks = 0  # blocks of the active levels once complete (for reservations)
        self.freed: list[int] = []  # levels whose KV was dropped since the last plan

    def blocks(self, tokens: int) -> int:
        return blocks(tokens, self.block_size)

    def fits(self, more: int) -> bool:
        """Whether ``more`` blocks are free."""
        return self.used + more <= self.kv_blocks

    def room(self, held: int) -> int:
        """Tokens an owner holding ``held`` tokens can add: the rest of its last block and every free block."""
        return (self.blocks(held) + self.kv_blocks - self.used) * self.block_size - held

    def take(self, more: int) -> None:
        """``more`` blocks are now in use."""
        self.used += more

    def extend(self, held: int, n: int) -> None:
        """An owner holding ``held`` tokens computes ``n`` more."""
        self.used += self.blocks(held + n) - self.blocks(held)

    def release(self, held: int) -> None:
        """An owner holding ``held`` tokens drops them."""
        self.used -= self.blocks(held)

    def activate(self, levels: PrefixLevels, v: int) -> None:
        """Level ``v`` starts (holds nothing yet; its full size counts toward the reservations)."""
        levels.active[v] = True
        self.active[v] = None
        self.active_full_blocks += self.blocks(levels.size[v])

    def free_level(self, levels: PrefixLevels, v: int, report: bool) -> None:
        """Drop level ``v``'s KV (if started), reported in the next plan's ``freed_nodes`` when ``report``."""
        if levels.active[v]:
            self.used -= self.blocks(levels.done[v])
            self.active_full_blocks -= self.blocks(levels.size[v])
            del self.active[v]
            if report:
                self.freed.append(v)
        levels.done[v] = 0
        levels.active[v] = False

    def take_freed(self) -> list[int]:
        """The levels freed since the last call."""
        freed, self.freed = self.freed, []
        return freed
