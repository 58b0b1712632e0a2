"""The planner's first stage: one step's metadata checked, and the per-request lengths every later stage reads.

:func:`check_inputs` runs :func:`prefixattn.validation.check_host_metadata` (the one definition of every message)
and derives ``q_len``, the *shareable* KV length (``kv_len - q_len`` when causal: the positions every query row of
the request sees; ``kv_len`` otherwise; 0 for a request without queries), ``max_q_len`` and the table columns the
batch reads. The compiled checks (:mod:`prefixattn.planner.compiled.checks`) return the same :class:`Inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixattn.validation import check_host_metadata


@dataclass(slots=True)
class Inputs:
    """One step's checked metadata, read-only for the later stages.

    ``indptr`` ``[R + 1]`` and ``lens`` ``[R]``: int64, or int32 both where the compiled checks took them so;
    ``table`` ``[R, cols]``: the block table in its own dtype (int32/int64, a view of the caller's CPU tensor);
    ``q_len``, ``shareable`` ``[R]`` int64; ``max_block_id``: the largest id the batch reads (-1: none); ``width``:
    the table columns the batch reads (at least 1). ``tree_hints``: what the compiled checks hand the compiled tree
    (whether the tree cache's rows still match, the rows' LCP hints; None from numpy).
    """

    indptr: np.ndarray
    lens: np.ndarray
    table: np.ndarray
    max_block_id: int
    q_len: np.ndarray
    shareable: np.ndarray
    max_q_len: int
    width: int
    tree_hints: object = None

    @property
    def num_requests(self) -> int:
        return int(self.lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.indptr[-1])


def check_inputs(qo_indptr, kv_lens, block_table, *, block_size: int, num_blocks: int | None,
                 causal: bool) -> Inputs:
    """Check one step's metadata (``ValueError`` naming the argument) and derive the lengths (module docstring)."""
    indptr, lens, table, max_block_id = check_host_metadata(qo_indptr, kv_lens, block_table, block_size=block_size,
                                                            num_blocks=num_blocks, table_as_is=True)
    q_len = indptr[1:] - indptr[:-1]
    shareable = np.where(q_len > 0, lens - q_len if causal else lens, 0)
    max_q_len = int(q_len.max()) if q_len.shape[0] else 1
    width = max(-(-int(lens.max()) // block_size) if lens.shape[0] else 0, 1)  # blocks of the longest request
    return Inputs(indptr=indptr, lens=lens, table=table, max_block_id=max_block_id, q_len=q_len, shareable=shareable,
                  max_q_len=max_q_len, width=width)
