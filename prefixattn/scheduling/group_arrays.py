"""Per-group arrays the ordering policies compute on (flattened members, prefill tokens, tie-breakers)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from prefixattn.scheduling.grouping import PrefixGroup


def group_arrays(groups: Sequence[PrefixGroup]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flatten groups: ``(group_of_each_entry, request_ids, prompt_lens)``, all int64 of length ``sum(sizes)``."""
    sizes = np.fromiter((len(g.request_ids) for g in groups), dtype=np.int64, count=len(groups))
    owner = np.repeat(np.arange(len(groups), dtype=np.int64), sizes)
    ids = np.fromiter((r for g in groups for r in g.request_ids), dtype=np.int64, count=int(sizes.sum()))
    lens = np.fromiter((p for g in groups for p in g.prompt_lens), dtype=np.int64, count=int(sizes.sum()))
    return owner, ids, lens


def processed_tokens(groups: Sequence[PrefixGroup]) -> np.ndarray:
    """``[G]`` prompt tokens each group computes with its sharing (``L_prefix + sum L_distinct``)."""
    out = np.empty(len(groups), dtype=np.int64)
    for i, g in enumerate(groups):
        out[i] = g.processed_tokens if g.children else sum(g.prompt_lens) - (len(g.request_ids) - 1) * g.prefix_len
    return out


def first_request(groups: Sequence[PrefixGroup]) -> np.ndarray:
    """``[G]`` smallest request id of each group: the tie-breaker of every policy."""
    return np.fromiter((min(g.request_ids) for g in groups), dtype=np.int64, count=len(groups))
