"""The sharing cost rules, in bytes (numpy only, no torch): whether sharing a prefix-tree node pays
(:func:`sharing_pays_off`), and whether a request can gain from any node at all (:func:`request_sharing_pays_off`).

The one definition of both: the numpy planner (:mod:`prefixattn.planner.node_choice`) calls them on arrays, the
compiled planner (:mod:`prefixattn.planner.compiled.node_choice`) compiles them with ``numba.njit`` and calls them per
node and per request, and the simulator (:mod:`prefixattn.sim.step_cost`) calls the node rule per shared run. Their
parameters are positional-or-keyword (numba compiles no keyword-only parameters); call them with keywords.
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
#: MLA: query heads one program packs into its rows at most (its head block: the rule's ``group`` of an MLA node,
#: whose latent each head block reads); a decode tile's 16 lanes are one row's 16 heads.
MLA_MAX_HEADS_PER_PROGRAM = 16


def mla_heads_per_program(num_heads):
    """Query heads per MLA program (a divisor of ``num_heads``, so every head block is whole): DeepSeek-V3's 128 heads
    (or 16 per GPU under tensor parallelism 8) run 16 a program, 8 or 4 heads all in one."""
    a, b = num_heads, MLA_MAX_HEADS_PER_PROGRAM
    while b:  # Euclid's gcd: this module imports nothing
        a, b = b, a % b
    return a


def mla_cost_head_dim(kv_lora_rank, rope_dim):
    """The head size the cost models price an MLA KV position at: one latent row of ``kv_lora_rank + rope_dim``
    serves as K and V, so half of it per tensor (rounded up). The rule then prices an MLA node's partial states at
    this size too, about half their ``kv_lora_rank``: an MLA node is kept from about half the tokens its states call
    for."""
    return -(-(kv_lora_rank + rope_dim) // 2)


def unshared_reads(q_len, rows_per_chunk, rows_per_decode):
    """How often a request's own suffix tiles read one KV position: once (one decode tile, up to ``rows_per_decode``
    rows), else once per chunk tile of ``rows_per_chunk`` rows. Scalars or arrays, and ``numba.njit``."""
    return 1 + (q_len > rows_per_decode) * (-(-q_len // rows_per_chunk) - 1)


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
    (:mod:`prefixattn.planner.choose`).

    Parameters
    ----------
    num_requests, num_rows, num_m_tiles, num_tokens : int or ndarray of int64 (one entry per node)
        The node's requests, their query rows, the shared tiles' M tiles holding those rows, the node's KV tokens.
    group, head_dim, elt_bytes : int
        Query heads per KV head, the head dimension, the KV caches' element size in bytes.
    extra_reads : int or ndarray of int64
        Unshared reads of the node's KV beyond one per request (requests cut into several chunk tiles: the sum of
        :func:`unshared_reads` minus one).

    Returns
    -------
    bool, or ndarray of bool (one per node)

    Works on scalars or numpy arrays, and compiles under ``numba.njit``. Example: fp16, head_dim 128, GQA 8,
    decode: 2 requests share from 65 tokens on, 64 requests from 35 tokens on.
    """
    saved = (num_requests + extra_reads - num_m_tiles) * num_tokens * KV_TENSORS * head_dim * elt_bytes
    added = num_rows * group * (head_dim + 1) * FP32_BYTES * STATE_PASSES * STATES_CHARGED_PER_ROW
    return saved > added


def request_sharing_pays_off(q_len, reads, shareable, rows_per_shared, group, head_dim, elt_bytes):
    """Whether a request can gain from any shared node: its own terms of :func:`sharing_pays_off`, at its whole
    shareable length (the most KV any node holding it can share). The planner's ``SHARING_APART`` mode keeps a request
    that fails it out of every node (:mod:`prefixattn.planner.choose` says when that plan runs).

    * saved: unshared, the request reads each shared token ``reads`` times (:func:`unshared_reads`); shared, its rows
      fill ``q_len / rows_per_shared`` of the M tiles that read it.
    * added: :func:`sharing_pays_off`'s states for its ``q_len`` rows.

    A node's verdict sums these terms over its requests (up to the rounding of M tiles), so a node that pays for its
    decode rows also takes the prefill chunks under its prefix, whose full chunk tiles read the prefix once per tile
    either way. Each term grows with the node's tokens: a request that fails at its whole shareable length adds cost
    to every node (and every chain of nodes) that holds it.

    Parameters
    ----------
    q_len, reads, shareable : int or ndarray of int64 (one entry per request)
        The request's query rows, :func:`unshared_reads` of it, and its shareable KV tokens.
    rows_per_shared : int
        Query rows of a shared M tile.
    group, head_dim, elt_bytes : int
        As in :func:`sharing_pays_off`.

    Returns
    -------
    bool, or ndarray of bool (one per request)

    Example (fp16, head_dim 128, MHA, 128-row tiles): a 2,048-row chunk never gains; a 64-row chunk gains from 517
    tokens on, a one-row decode request from 5.
    """
    # Multiplied through by rows_per_shared: integers only.
    saved = (reads * rows_per_shared - q_len) * shareable * KV_TENSORS * head_dim * elt_bytes
    added = q_len * group * (head_dim + 1) * FP32_BYTES * STATE_PASSES * STATES_CHARGED_PER_ROW * rows_per_shared
    return saved > added
