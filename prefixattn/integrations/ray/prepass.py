"""Distributed grouping pre-pass: prefix groups computed by Ray Data workers, bucket by bucket, merged on the driver.

:func:`run_batch` groups on the driver by default (one :func:`prefixattn.scheduling.group_prompts` call over every
prompt). For very large inputs :func:`group_prompts_distributed` spreads that work:

1. **Bucket** (``map_batches``): each row goes to bucket ``hash(first k tokens) mod B`` (``k = bucket_tokens``; a
   prompt shorter than ``k`` is keyed by all of it). The hash is a fixed digest (BLAKE2b), the same in every process.
2. **Group each bucket** (``groupby(bucket).map_groups``, the buckets in parallel): the bucket's prompts are split by
   their exact first-``k`` key, and each key's prompts are grouped with ``group_prompts`` (a key with one prompt is
   a singleton; the request ids are the batch's). Splitting by key first makes the result independent of the hash
   (two keys that land in one bucket are grouped apart, as in any other bucket).
3. **Merge on the driver**: the groups, in the batch's prefix-tree order (the scheduler's sort of each group's first
   prompt: top-level groups are disjoint subtrees), with ``dfs_rank`` renumbered for the whole batch.

**Why it is exact at depth >= k.** Prompts that share a prefix of at least ``k`` tokens have the same first ``k``
tokens, hence the same key and bucket: every group whose members share ``>= k`` tokens is found whole, with the
same members, prefix and nesting as :func:`group_prompts` over the key's prompts. **What is lost below k**: sharing
between prompts that agree on fewer than ``k`` tokens (different keys) is never seen, so a global group whose shared
prefix is shorter than ``k`` (a short system prompt over otherwise different prompts) falls apart into one group per
key. The result equals ``group_prompts`` applied to each key's prompts separately (:func:`group_by_key`, the
driver-side reference); it equals ``group_prompts`` over the whole batch when no two prompts of different keys share
a prefix of ``min_shared_tokens`` or more (every shared prefix at least ``k`` long, or the whole batch one key).
Pick ``k`` at most the shortest shared prefix worth keeping (a system prompt's length).
"""

from __future__ import annotations

import hashlib
import pickle

import numpy as np

from prefixattn.scheduling import PrefixGroup, group_prompts
from prefixattn.scheduling.prefix_tree import sort_and_lcp
from prefixattn.scheduling.sequences import pack_sequences

#: Key length of the buckets: short enough that a short system prompt still lands in one bucket (its sharing is
#: kept), long enough to spread documents over buckets. Sharing shorter than this is not found (module notes).
DEFAULT_BUCKET_TOKENS = 8
ROW_COLUMN = "__row__"
BUCKET_COLUMN = "__bucket__"
_GROUP_COLUMN = "__groups__"


def prompt_key(prompt, bucket_tokens: int) -> bytes:
    """The first ``bucket_tokens`` token ids of ``prompt`` as bytes (int64)."""
    return np.asarray(list(prompt[:bucket_tokens]), dtype=np.int64).tobytes()


def bucket_of(prompt, bucket_tokens: int, num_buckets: int) -> int:
    """Bucket of a prompt: a fixed 64-bit digest of its key, modulo ``num_buckets``."""
    digest = hashlib.blake2b(prompt_key(prompt, bucket_tokens), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_buckets


def _packed(prompts: list) -> tuple:
    """``sort_and_lcp`` arguments as ``group_prompts`` passes them: each prompt but its last token (which every
    request computes itself) is its path in the prefix tree."""
    packed = pack_sequences(prompts, name="prompts", min_len=1)
    return packed.values, packed.offsets, packed.lengths - 1


def _renumber(group: PrefixGroup, ids, shift: int) -> PrefixGroup:
    """``group`` with local request ids mapped through ``ids`` and ``dfs_rank`` shifted."""
    return PrefixGroup(prefix_len=group.prefix_len, request_ids=[int(ids[r]) for r in group.request_ids],
                       prompt_lens=list(group.prompt_lens),
                       children=[_renumber(c, ids, shift) for c in group.children],
                       parent_prefix_len=group.parent_prefix_len,
                       dfs_rank=group.dfs_rank + shift if group.dfs_rank >= 0 else -1)


def _group_by_key(prompts, ids, bucket_tokens: int, levels, min_shared_tokens: int) -> list:
    """``[(first prompt, group)]`` of :func:`group_by_key`, sorted; ``dfs_rank`` within these prompts."""
    by_key: dict = {}
    for j, p in enumerate(prompts):
        by_key.setdefault(prompt_key(p, bucket_tokens), []).append(j)
    found = []
    for members in by_key.values():
        if len(members) == 1:
            j = members[0]
            found.append((list(prompts[j]), PrefixGroup(prefix_len=0, request_ids=[int(ids[j])],
                                                        prompt_lens=[len(prompts[j])], dfs_rank=0)))
            continue
        sub = [prompts[j] for j in members]
        sub_ids = [int(ids[j]) for j in members]
        for g in group_prompts(sub, levels=levels, min_shared_tokens=min_shared_tokens):
            found.append((list(sub[g.request_ids[0]]), _renumber(g, sub_ids, -g.dfs_rank)))
    return _merge(found)


def _merge(found: list) -> list:
    """Groups (each with ``dfs_rank`` relative to itself) in the batch's prefix-tree order, ranked: top-level groups
    are disjoint runs of that order, so sorting their first requests' prompts (the scheduler's own sort) orders
    them."""
    if not found:
        return []
    order, _ = sort_and_lcp(*_packed([first for first, _ in found]))
    out, rank = [], 0
    for first, g in (found[i] for i in order.tolist()):
        out.append((first, _renumber(g, {r: r for r in g.request_ids}, rank - g.dfs_rank)))
        rank += g.num_requests
    return out


def group_by_key(prompts, ids, bucket_tokens: int = DEFAULT_BUCKET_TOKENS, *, levels: int | None = 1,
                 min_shared_tokens: int = 1) -> list:
    """``group_prompts`` over each first-``bucket_tokens`` key's prompts separately: what one bucket computes, and
    (over the whole batch) the driver-side reference of :func:`group_prompts_distributed`.

    Parameters
    ----------
    prompts : list of list[int]
    ids : list[int]
        Request id of each prompt (its row in the batch).
    bucket_tokens, levels, min_shared_tokens
        See :func:`group_prompts_distributed`.

    Returns
    -------
    list[PrefixGroup]
        With the given ids, in lexicographic order of each group's first prompt (``dfs_rank`` within these prompts).

    Examples
    --------
    >>> sys_p = [9, 9]
    >>> [g.request_ids for g in group_by_key([sys_p + [1, 2], sys_p + [3, 4], sys_p + [1, 2, 5]], [0, 1, 2], 3)]
    [[2, 0], [1]]
    """
    return [g for _, g in _group_by_key(prompts, ids, bucket_tokens, levels, min_shared_tokens)]


def _group_bucket(batch, prompt_column: str, bucket_tokens: int, levels, min_shared_tokens: int):
    """``map_groups`` function: one bucket's rows -> one row per group, pickled with its first prompt."""
    import pandas as pd

    prompts = [[int(t) for t in p] for p in batch[prompt_column]]
    ids = [int(i) for i in batch[ROW_COLUMN]]
    found = _group_by_key(prompts, ids, bucket_tokens, levels, min_shared_tokens)
    return pd.DataFrame({_GROUP_COLUMN: [pickle.dumps(fg) for fg in found]})


def _add_bucket(batch, prompt_column: str, bucket_tokens: int, num_buckets: int):
    batch[BUCKET_COLUMN] = [bucket_of(p, bucket_tokens, num_buckets) for p in batch[prompt_column]]
    return batch


def group_prompts_distributed(ds, *, prompt_column: str = "prompt_token_ids",
                              bucket_tokens: int = DEFAULT_BUCKET_TOKENS, num_buckets: int = 16,
                              levels: int | None = 1, min_shared_tokens: int = 1, num_cpus: float = 1.0) -> list:
    """Prefix groups of a Ray Dataset's prompts, computed bucket by bucket on Ray workers (see module notes).

    Parameters
    ----------
    ds : ray.data.Dataset
        Rows with ``prompt_column`` (token ids) and ``__row__`` (the request id, unique int).
    prompt_column : str
    bucket_tokens : int
        ``k``: prompts are bucketed by their first ``k`` tokens; sharing shorter than ``k`` is not found.
    num_buckets : int
        ``B``: buckets, grouped in parallel.
    levels, min_shared_tokens
        Passed to :func:`prefixattn.scheduling.group_prompts`.
    num_cpus : float
        CPUs of each bucket task.

    Returns
    -------
    list[PrefixGroup]
        Top-level groups in the batch's prefix-tree order, request ids from ``__row__``; equal to
        ``group_by_key(all prompts, all ids, bucket_tokens)``.

    Raises
    ------
    ValueError
        ``bucket_tokens`` or ``num_buckets`` not a positive int.

    Examples
    --------
    >>> rows = [{"__row__": i, "prompt_token_ids": p} for i, p in enumerate(prompts)]  # doctest: +SKIP
    >>> ds = ray.data.from_items(rows)  # doctest: +SKIP
    >>> groups = group_prompts_distributed(ds, bucket_tokens=8)  # doctest: +SKIP
    """
    for name, v in (("bucket_tokens", bucket_tokens), ("num_buckets", num_buckets)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    bucketed = ds.map_batches(_add_bucket, batch_format="pandas", num_cpus=num_cpus,
                              fn_kwargs=dict(prompt_column=prompt_column, bucket_tokens=int(bucket_tokens),
                                             num_buckets=int(num_buckets)))
    grouped = bucketed.groupby(BUCKET_COLUMN, num_partitions=int(num_buckets)).map_groups(
        _group_bucket, batch_format="pandas", num_cpus=num_cpus,
        fn_kwargs=dict(prompt_column=prompt_column, bucket_tokens=int(bucket_tokens), levels=levels,
                       min_shared_tokens=int(min_shared_tokens)))
    found = [pickle.loads(row[_GROUP_COLUMN]) for row in grouped.take_all()]
    return [g for _, g in _merge(found)]
