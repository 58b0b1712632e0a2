"""Prefix-sharing groups over an offline batch (BatchLLM sec. 4.2) and the token saving ratio (BatchLLM Eq. 2).

``group_prompts`` builds the compact prefix tree of all prompts (:mod:`prefixattn.scheduling.prefix_tree`) and
turns it into groups:

* ``levels=1``: BatchLLM Algorithm 1 (``MaximizeReuse``) enlarges the first-level prefixes bottom-up: a grandchild
  ``g`` of node ``D`` (through child ``c``) is forked out of ``c`` and merged with it when
  ``(leaves(g) - 1) * tokens(g) > tokens(c)``, i.e. when sharing ``g``'s tokens saves more than computing ``c``'s
  tokens once more costs. One refinement over the paper: a child left with a single grandchild after forking is
  merged with it (nothing is left to share, so the merge costs nothing).
* ``levels=k > 1``: the top ``k - 1`` levels of the tree are kept exactly and everything below level ``k - 1`` is
  flattened into level ``k`` by the same algorithm; the attention kernel computes each level's shared KV once.
* ``levels=None``: the whole tree, which reaches the optimal saving ratio.

Every request must compute its last prompt token itself (its logits give the first output token; engines never
serve a whole prompt from the prefix cache), so sharing is computed over each prompt without its last token: a
group's ``prefix_len`` is at most ``len(prompt) - 1`` of every member, and two prompts of length 1 share nothing.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from prefixattn.scheduling.checks import check_positive_int
from prefixattn.scheduling.prefix_tree import PrefixTree, prefix_tree_packed
from prefixattn.scheduling.sequences import PackedSequences, pack_sequences


@dataclass(eq=False)
class PrefixGroup:
    """Requests that share their first ``prefix_len`` prompt tokens; the unit of scheduling.

    Attributes
    ----------
    prefix_len : int
        Tokens, from the start of the prompt, shared by every request of the group (0 for a singleton).
    request_ids : list[int]
        Every request of the group, nested groups included, in prefix-tree (DFS) order: each child's requests are
        contiguous. Request ids are indices into the batch given to :func:`group_prompts`.
    prompt_lens : list[int]
        Prompt length of each request, aligned with ``request_ids``.
    children : list[PrefixGroup]
        Nested groups (``levels > 1``): subsets of ``request_ids`` sharing a longer prefix. Empty for ``levels=1``.
    parent_prefix_len : int
        ``prefix_len`` of the enclosing group (0 at the top level).
    dfs_rank : int
        Position of the group's first request in the sorted (prefix-tree) order of the whole batch, so sorting
        groups by it gives the DFS order (SGLang's prefix order); -1 when unknown.

    Examples
    --------
    >>> g = PrefixGroup(prefix_len=4, request_ids=[2, 0], prompt_lens=[6, 9])
    >>> g.shared_tokens, g.processed_tokens, g.logical_tokens
    (4, 11, 15)
    """

    prefix_len: int
    request_ids: list[int]
    prompt_lens: list[int]
    children: list[PrefixGroup] = field(default_factory=list)
    parent_prefix_len: int = 0
    dfs_rank: int = -1

    @property
    def members(self) -> list[int]:
        """Alias of ``request_ids``."""
        return self.request_ids

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def shared_tokens(self) -> int:
        """Tokens this level adds to the enclosing group's prefix, computed once: ``prefix_len - parent_prefix_len``.
        Summed over :meth:`walk`, these are the shared tokens whose KV blocks are stored once."""
        return self.prefix_len - self.parent_prefix_len

    @property
    def logical_tokens(self) -> int:
        """Prompt tokens of all requests, as if nothing were shared."""
        return int(sum(self.prompt_lens))

    @property
    def processed_tokens(self) -> int:
        """Prompt tokens computed with the group's sharing: every shared level once plus each request's rest."""
        saved = sum((g.num_requests - 1) * g.shared_tokens for g, _ in self.walk())
        return self.logical_tokens - saved - (self.num_requests - 1) * self.parent_prefix_len

    @property
    def direct_request_ids(self) -> list[int]:
        """Requests of this group that are in none of its children (they share exactly ``prefix_len`` tokens)."""
        if not self.children:
            return list(self.request_ids)
        nested = {r for c in self.children for r in c.request_ids}
        return [r for r in self.request_ids if r not in nested]

    def walk(self, level: int = 1) -> Iterator[tuple[PrefixGroup, int]]:
        """Yield ``(group, level)`` for this group (at ``level``) and every nested group, parents first."""
        stack = [(self, level)]
        while stack:
            g, lv = stack.pop()
            yield g, lv
            stack.extend((c, lv + 1) for c in reversed(g.children))


def _check_levels(levels) -> int | None:
    if levels is None:
        return None
    if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or levels < 1:
        raise ValueError(f"levels: expected a positive int or None (unlimited), got {levels!r}")
    return int(levels)


def _maximize_reuse(tree: PrefixTree, ch: list[list[int]], first: list[int], nodes: Sequence[int]) -> list[int]:
    """BatchLLM Algorithm 1 on ``nodes`` (a post-order), rewriting the children lists ``ch`` in place; returns the
    nodes whose children changed."""
    depth = tree.depth.tolist()
    is_leaf = (tree.leaf >= 0).tolist()
    leaves = tree.num_leaves.tolist()
    changed = []
    for d in nodes:
        kids = ch[d]
        if not kids:
            continue
        new_kids = []
        for c in kids:
            if is_leaf[c]:
                new_kids.append(c)
                continue
            penalty = depth[c] - depth[d]  # computing c's tokens once more, for the requests left in c
            keep = []
            for g in ch[c]:
                if not is_leaf[g] and (leaves[g] - 1) * (depth[g] - depth[c]) > penalty:
                    new_kids.append(g)  # fork c and merge it with g: g's prefix becomes d's first level
                else:
                    keep.append(g)
            if len(keep) == len(ch[c]):
                new_kids.append(c)
            elif len(keep) == 1:
                new_kids.append(keep[0])  # nothing left to share in c: merge it with its last child
            elif keep:
                ch[c] = keep
                leaves[c] = sum(leaves[k] for k in keep)
                first[c] = first[keep[0]]
                changed.append(c)
                new_kids.append(c)
        if len(new_kids) != len(kids) or any(a != b for a, b in zip(new_kids, kids)):
            new_kids.sort(key=first.__getitem__)
            ch[d] = new_kids
            changed.append(d)
    return changed


def _children_lists(tree: PrefixTree) -> list[list[int]]:
    """Children of every node; leaves (most nodes) share one empty tuple: nothing ever reads or rewrites theirs."""
    indptr, kids = tree.children()
    kids_list = kids.tolist()
    bounds = indptr.tolist()
    ch: list = [()] * tree.num_nodes
    for v in np.flatnonzero(tree.leaf < 0).tolist():
        ch[v] = kids_list[bounds[v]:bounds[v + 1]]
    return ch


def _untouched_subtrees(tree: PrefixTree, changed: list[int]) -> list[bool]:
    """Per node: no node of its subtree had its children rewritten, so its requests are its sorted positions
    ``lo:hi`` in order (children stay sorted by position), one slice instead of a walk."""
    parent = tree.parent.tolist()
    clean = [True] * tree.num_nodes
    for v in changed:
        while v >= 0 and clean[v]:  # an ancestor already marked has its whole path marked
            clean[v] = False
            v = parent[v]
    return clean


def group_prompts(prompts, *, levels: int | None = 1, min_shared_tokens: int = 1) -> list[PrefixGroup]:
    """Find the prefix-sharing groups of an offline batch of prompts.

    Parameters
    ----------
    prompts : Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray | PackedSequences
        ``N >= 1`` prompts of token ids (non-empty; ids in ``[0, 2**32 - 2]``). Request ``i`` is ``prompts[i]``.
    levels : int or None
        Nesting depth of the groups: 1 (default) gives BatchLLM's single-level groups (Algorithm 1), ``k > 1``
        nested groups up to ``k`` deep, None the whole prefix tree (optimal sharing).
    min_shared_tokens : int
        A group level adding fewer shared tokens than this is dissolved into its parent (or into singletons at
        the top level). Engines that share KV by whole blocks may pass their block size.

    Returns
    -------
    list[PrefixGroup]
        Top-level groups in prefix-tree (DFS) order; every request is in exactly one. A request that shares
        nothing is a singleton group with ``prefix_len=0``. Identical prompts form one group (sharing all but
        their last token).

    Raises
    ------
    ValueError
        Empty batch, an empty prompt, non-integer or out-of-range ids, ``levels`` or ``min_shared_tokens`` not a
        positive int.

    Examples
    --------
    >>> sys_p, doc = [1, 2], [7, 7, 7, 7]
    >>> groups = group_prompts([sys_p + doc + [5], sys_p + [9, 9], sys_p + doc + [6]])
    >>> [(g.prefix_len, g.request_ids) for g in groups]
    [(6, [0, 2]), (0, [1])]
    >>> nested = group_prompts([sys_p + doc + [5], sys_p + [9, 9], sys_p + doc + [6]], levels=None)
    >>> [(g.prefix_len, g.request_ids, [(c.prefix_len, c.request_ids) for c in g.children]) for g in nested]
    [(2, [0, 2, 1], [(6, [0, 2])])]
    """
    levels = _check_levels(levels)
    min_shared_tokens = check_positive_int("min_shared_tokens", min_shared_tokens)
    packed = pack_sequences(prompts, name="prompts", min_len=1)
    tree = prefix_tree_packed(packed, drop_last=1)
    return groups_from_tree(tree, packed.lengths, levels=levels, min_shared_tokens=min_shared_tokens)


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause the cyclic garbage collector while the groups are built: they are hundreds of thousands of new lists
    and dataclasses at BlendServe's scale, none in a reference cycle, and every collection they trigger re-walks all
    of them (measured: 0.55 s of 1.0 s for 400,000 case-1 requests). The pause is process-wide (other threads too)
    for those ~0.5 s; the previous state is restored."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def groups_from_tree(tree: PrefixTree, prompt_lens: np.ndarray, *, levels: int | None = 1,
                     min_shared_tokens: int = 1) -> list[PrefixGroup]:
    """:func:`group_prompts` on a prefix tree built over the prompts without their last token."""
    with _cyclic_gc_paused():
        return _groups_from_tree(tree, prompt_lens, levels=levels, min_shared_tokens=min_shared_tokens)


def _groups_from_tree(tree: PrefixTree, prompt_lens: np.ndarray, *, levels: int | None,
                      min_shared_tokens: int) -> list[PrefixGroup]:
    ch = _children_lists(tree)
    first = tree.lo.tolist()
    changed: list[int] = []
    if levels is not None:
        changed = _maximize_reuse(tree, ch, first, _reuse_nodes(tree=tree, levels=levels))
    lens = prompt_lens.tolist()
    build = _group_builder(tree=tree, ch=ch, first=first, changed=changed, lens=lens, levels=levels,
                           min_shared_tokens=min_shared_tokens)
    groups: list[PrefixGroup] = []
    for c in ch[0]:
        for g in build(c, 1, 0):
            if isinstance(g, PrefixGroup):
                groups.append(g)
            else:  # a request reached through dissolved top-level nodes: a singleton
                groups.append(PrefixGroup(prefix_len=0, request_ids=[g], prompt_lens=[lens[g]], dfs_rank=-1))
    for g in groups:
        if g.num_requests == 1:
            g.prefix_len = 0
    return groups


def _reuse_nodes(*, tree: PrefixTree, levels: int) -> list[int]:
    """The internal nodes, in post-order, that Algorithm 1 runs on for ``levels``."""
    internal = (tree.leaf < 0).tolist()
    post = tree.post_order.tolist()
    if levels == 1:
        return [v for v in post if internal[v]]
    # Group level of each internal node (root 0); Algorithm 1 runs on the nodes at level >= levels - 1.
    parent = tree.parent.tolist()
    level = [0] * tree.num_nodes
    for v in reversed(post):  # parents before children
        p = parent[v]
        if p >= 0:
            level[v] = level[p] + internal[v]
    return [v for v in post if internal[v] and level[v] >= levels - 1]


def _group_builder(*, tree: PrefixTree, ch: list, first: list[int], changed: list[int], lens: list[int],
                   levels: int | None, min_shared_tokens: int):
    """``build(v, lv, parent_len)``: the groups of node ``v`` at group level ``lv`` over the (rewritten) children
    lists ``ch``; a request id in place of a group where a leaf sits below group level 1. Closures over plain lists:
    the recursion visits every node of the tree."""
    is_leaf = (tree.leaf >= 0).tolist()
    clean = _untouched_subtrees(tree, changed)
    depth = tree.depth.tolist()
    order = tree.order.tolist()
    hi = tree.hi.tolist()
    max_level = levels if levels is not None else 1 << 62

    def leaves_under(v: int) -> list[int]:
        if clean[v]:
            return order[first[v]:hi[v]]
        out, stack = [], [v]
        while stack:
            u = stack.pop()
            if is_leaf[u]:
                out.append(order[first[u]])
            else:
                stack.extend(reversed(ch[u]))
        return out

    def build(v: int, lv: int, parent_len: int) -> list[PrefixGroup]:
        """Groups for node ``v`` at group level ``lv``: one group, or its contents when ``v`` is dissolved."""
        if is_leaf[v]:
            r = order[first[v]]
            return [PrefixGroup(prefix_len=parent_len, request_ids=[r], prompt_lens=[lens[r]],
                                parent_prefix_len=parent_len, dfs_rank=first[v])] if lv == 1 else [r]
        keep = depth[v] - parent_len >= min_shared_tokens
        child_lv, child_parent = (lv + 1, depth[v]) if keep else (lv, parent_len)
        if keep and lv == max_level:
            ids = leaves_under(v)
            return [PrefixGroup(prefix_len=depth[v], request_ids=ids, prompt_lens=[lens[r] for r in ids],
                                parent_prefix_len=parent_len, dfs_rank=first[v])]
        items = []
        for c in ch[v]:
            if is_leaf[c] and child_lv > 1:
                items.append(order[first[c]])
            else:
                items.extend(build(c, child_lv, child_parent))
        if not keep:
            return items
        ids, children = [], []
        for it in items:
            if isinstance(it, PrefixGroup):
                children.append(it)
                ids.extend(it.request_ids)
            else:
                ids.append(it)
        return [PrefixGroup(prefix_len=depth[v], request_ids=ids, prompt_lens=[lens[r] for r in ids],
                            children=children, parent_prefix_len=parent_len, dfs_rank=first[v])]

    return build


def _packed_and_lengths(prompts) -> PackedSequences:
    return pack_sequences(prompts, name="prompts", min_len=1)


def optimal_saving_ratio(prompts) -> float:
    """Best achievable BatchLLM Eq. 2 saving ratio: every shared prompt token computed once.

    ``R = 1 - processed / logical`` with ``logical = sum(len(p))`` and ``processed`` the tokens of the prefix
    tree over the prompts without their last token, plus one last token per request (see the module notes).

    Parameters
    ----------
    prompts : Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray | PackedSequences
        ``N >= 1`` non-empty prompts.

    Returns
    -------
    float
        In ``[0, 1)`` (a fraction; multiply by 100 for Eq. 2's percent).

    Examples
    --------
    >>> optimal_saving_ratio([[1, 2, 3, 4], [1, 2, 3, 5]])
    0.375
    """
    packed = _packed_and_lengths(prompts)
    tree_lens = packed.lengths - 1
    from prefixattn.scheduling.prefix_tree import sort_and_lcp

    _, lcp = sort_and_lcp(packed.values, packed.offsets, tree_lens)
    return float(lcp.sum() / packed.lengths.sum())


def _check_groups(groups, lengths: np.ndarray) -> list[tuple[PrefixGroup, int, int]]:
    """Check ``groups`` against the batch; return ``(group, parent prefix_len, depth)`` for every group."""
    n = lengths.shape[0]
    if isinstance(groups, (PrefixGroup, str, bytes)) or not isinstance(groups, Sequence):
        raise ValueError(f"groups: expected a list of PrefixGroup, got {type(groups).__name__}")
    seen = np.zeros(n, dtype=np.int64)
    out = []
    stack = [(g, 0, f"groups[{i}]", None) for i, g in reversed(list(enumerate(groups)))]
    while stack:
        g, parent_len, where, parent_ids = stack.pop()
        if not isinstance(g, PrefixGroup):
            raise ValueError(f"{where}: expected a PrefixGroup, got {type(g).__name__}")
        ids = np.asarray(g.request_ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError(f"{where}: expected at least one request id, got none")
        if ids.min() < 0 or ids.max() >= n:
            bad = int(ids[(ids < 0) | (ids >= n)][0])
            raise ValueError(f"{where}: expected request ids in [0, {n}), got {bad}")
        if parent_ids is not None and not np.isin(ids, parent_ids).all():
            bad = int(ids[~np.isin(ids, parent_ids)][0])
            raise ValueError(f"{where}: expected the requests of a nested group to be in its parent, got {bad}")
        if g.prefix_len < parent_len:
            raise ValueError(f"{where}: expected prefix_len >= the enclosing group's {parent_len}, got "
                             f"{g.prefix_len}")
        cap = int(lengths[ids].min()) - (1 if ids.size > 1 else 0)
        if g.prefix_len > cap:
            raise ValueError(f"{where}: expected prefix_len <= {cap} (every member computes its last prompt token "
                             f"itself), got {g.prefix_len}")
        if parent_ids is None:
            np.add.at(seen, ids, 1)
        child_seen = np.zeros(n, dtype=np.int64)
        for c in g.children:
            if isinstance(c, PrefixGroup):
                np.add.at(child_seen, np.asarray(c.request_ids, dtype=np.int64), 1)
        if (child_seen > 1).any():
            raise ValueError(f"{where}: expected disjoint nested groups, got request {int(np.argmax(child_seen > 1))} "
                             "in two of them")
        out.append((g, parent_len, where))
        stack.extend((c, g.prefix_len, f"{where}.children[{j}]", ids)
                     for j, c in reversed(list(enumerate(g.children))))
    if (seen != 1).any():
        r = int(np.argmax(seen != 1))
        raise ValueError(f"groups: expected every request in exactly one top-level group, got request {r} in "
                         f"{int(seen[r])}")
    return out


def saving_ratio(prompts, groups: Sequence[PrefixGroup]) -> float:
    """BatchLLM Eq. 2 saving ratio of a grouping: ``1 - processed / logical`` prompt tokens.

    Each group level's shared tokens (``prefix_len - parent prefix_len``) are computed once for all its requests;
    every other prompt token is computed per request.

    Parameters
    ----------
    prompts : Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray | PackedSequences
        The batch the groups were made from.
    groups : Sequence[PrefixGroup]
        Top-level groups covering every request exactly once (e.g. from :func:`group_prompts`).

    Returns
    -------
    float
        In ``[0, 1)`` (a fraction; multiply by 100 for Eq. 2's percent).

    Raises
    ------
    ValueError
        A request in no group or in two, a nested group outside its parent, or a ``prefix_len`` its members do
        not actually share (or that covers a member's last prompt token).

    Examples
    --------
    >>> prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [8, 9]]
    >>> saving_ratio(prompts, group_prompts(prompts))
    0.3
    """
    packed = _packed_and_lengths(prompts)
    lengths = packed.lengths
    checked = _check_groups(groups, lengths)
    saved = 0
    for g, parent_len, where in checked:
        ids = np.asarray(g.request_ids, dtype=np.int64)
        if ids.size < 2 or g.prefix_len == parent_len:
            continue
        cols = np.arange(parent_len, g.prefix_len, dtype=np.int64)
        first = packed.values[packed.offsets[ids[0]] + cols]
        for chunk in np.array_split(ids[1:], max(1, (ids.size - 1) * cols.size // (1 << 22))):
            rows = packed.values[packed.offsets[chunk][:, None] + cols[None, :]]
            bad = (rows != first[None, :]).any(axis=1)
            if bad.any():
                raise ValueError(f"{where}: expected all requests to share the first prefix_len={g.prefix_len} "
                                 f"tokens, got request {int(chunk[np.argmax(bad)])} differing from request "
                                 f"{int(ids[0])}")
        saved += (ids.size - 1) * (g.prefix_len - parent_len)
    return float(saved / lengths.sum())
