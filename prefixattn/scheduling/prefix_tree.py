"""Prefix trees of prompt batches for the scheduler: :func:`prefix_tree` checks and packs its input and builds the tree
with the numpy-only prefix-tree module :mod:`prefixattn.lcp_tree` (the planner's block tree is built there too).
``PrefixTree`` and ``sort_and_lcp`` are re-exported from there.
"""

from __future__ import annotations

from prefixattn.lcp_tree import PrefixTree, sort_and_lcp, tree_of_rows
from prefixattn.scheduling.sequences import PackedSequences, pack_sequences

__all__ = ["PrefixTree", "prefix_tree", "prefix_tree_packed", "sort_and_lcp"]


def prefix_tree(seqs, *, drop_last: int = 0, name: str = "seqs") -> PrefixTree:
    """Compact prefix tree of a batch of integer sequences (token ids or block ids).

    Parameters
    ----------
    seqs : Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray | PackedSequences
        ``N >= 1`` rows of ids in ``[0, 2**32 - 2]``; see :func:`pack_sequences`.
    drop_last : int
        Build the tree over each row without its last ``drop_last`` ids (rows must be at least that long). The
        scheduler passes 1: a request must compute its last prompt token itself to get its first output token.
    name : str
        Argument name used in error messages.

    Returns
    -------
    PrefixTree

    Examples
    --------
    >>> t = prefix_tree([[1, 2, 3], [1, 2, 4], [7]])
    >>> t.depth[t.parent[t.leaf >= 0]].tolist()   # the two [1, 2, ...] rows share an internal node of depth 2
    [2, 2, 0]
    >>> t.shared_tokens()
    5
    """
    packed = pack_sequences(seqs, name=name, min_len=max(1, drop_last))
    return prefix_tree_packed(packed, drop_last=drop_last)


def prefix_tree_packed(packed: PackedSequences, *, drop_last: int = 0) -> PrefixTree:
    """:func:`prefix_tree` on an already checked :class:`PackedSequences`."""
    return tree_of_rows(packed.values, packed.offsets, packed.lengths - drop_last)
