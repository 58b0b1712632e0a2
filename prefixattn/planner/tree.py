"""The planner's second stage: the block prefix tree of one step (which requests hold the same leading blocks).

:func:`block_tree` is :func:`prefixattn.lcp_tree.block_prefix_tree` over each request's *shareable* blocks
(:mod:`prefixattn.planner.checks`), with the per-thread tree cache an engine's decode loop hits at most steps;
``sharing="never"`` needs no tree (an empty one keeps ``Plan.tree`` well-formed). The compiled tree
(:mod:`prefixattn.planner.compiled.tree`) builds the same one and shares the cache.
"""

from __future__ import annotations

import numpy as np

from prefixattn.lcp_tree import LcpTree, block_prefix_tree
from prefixattn.planner.checks import Inputs


def block_tree(inputs: Inputs, *, block_size: int, sharing: str) -> LcpTree:
    """The prefix tree over ``inputs.table``'s shareable blocks (none with ``sharing="never"``)."""
    shareable = inputs.shareable if sharing != "never" else np.zeros_like(inputs.shareable)
    return block_prefix_tree(inputs.table, shareable, block_size)
