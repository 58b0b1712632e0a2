"""The sharing cost rule: whether sharing a prefix-tree node pays, in bytes (numpy only, no torch).

The one definition: the numpy planner (:mod:`prefixattn.planner.node_choice`) calls it on arrays, the compiled
planner (:mod:`prefixattn.planner.compiled_core`) compiles it with ``numba.njit`` and calls it per node, and the
simulator (:mod:`prefixattn.sim.step_cost`) calls it per shared run. Its parameters are positional-or-keyword (numba
compiles no keyword-only parameters); call it with keywords.
"""

from __future__ import annotations

#: A shared token saves a read of its K and of its V.
KV_TENSORS = 2
#: Bytes of one fp32 number: partial states (o, lse) are kept in fp32 whatever the input dtype.
FP32_BYTES = 4
#: A partial state costs one write by its producer and one read by the merge.
STATE_PASSES = 2
#: Sharing a node gives each of its rows one more state AND may push a row that had a single state (written straight
#: to ``out``) through the workspace: we charge two states per row, an upper bound that keeps marginal nodes unshared.
STATES_CHARGED_PER_ROW = 2


def sharing_pays_off(num_requests, num_rows, num_m_tiles, num_tokens, group, head_dim, elt_bytes, extra_reads=0):
    """The cost rule: share a node when the KV bytes it saves exceed the bytes' worth it adds (per KV head).

    * saved: without sharing every suffix tile of the node's requests reads its KV (one per decode request, and
      ``extra_reads`` more for requests cut into several chunk tiles); shared, each M tile of packed rows reads it
      once: ``(num_requests + extra_reads - num_m_tiles) * num_tokens * 2 (K and V) * head_dim * elt_bytes``
      (``elt_bytes``: the KV caches' element size, 1 for fp8).
    * added: ``STATES_CHARGED_PER_ROW`` fp32 states ``(o, lse)`` per (row x GQA head), each written and read once:
      ``num_rows * group * (head_dim + 1) * FP32_BYTES * STATE_PASSES * STATES_CHARGED_PER_ROW`` (the merge itself
      reads exactly those states and writes ``out``, which is written anyway).

    Not charged: the shared launch itself (its programs' start and epilogue, and the gap before the next work
    class's launch, which waits for it): a step-level check prices it on the whole work list
    (:mod:`prefixattn.planner.sharing_check`).

    Parameters
    ----------
    num_requests, num_rows, num_m_tiles, num_tokens : int or ndarray of int64 (one entry per node)
        The node's requests, their query rows, the shared tiles' M tiles holding those rows, the node's KV tokens.
    group, head_dim, elt_bytes : int
        Query heads per KV head, the head dimension, the KV caches' element size in bytes.
    extra_reads : int or ndarray of int64
        Unshared reads of the node's KV beyond one per request (requests cut into several chunk tiles).

    Returns
    -------
    bool, or ndarray of bool (one per node)

    Works on scalars or numpy arrays, and compiles under ``numba.njit``. Example: fp16, head_dim 128, GQA 8,
    decode: 2 requests share from 65 tokens on, 64 requests from 35 tokens on.
    """
    saved = (num_requests + extra_reads - num_m_tiles) * num_tokens * KV_TENSORS * head_dim * elt_bytes
    added = num_rows * group * (head_dim + 1) * FP32_BYTES * STATE_PASSES * STATES_CHARGED_PER_ROW
    return saved > added
