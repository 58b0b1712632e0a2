"""plan(): find the KV prefixes a batch shares and turn them into one launch's work list (host, once per step).

Steps (numpy, vectorized over requests; Python loops only over tree change points and shared nodes):
1. Each request with queries has a *shareable* KV length: ``kv_len - q_len`` when causal (positions every one of
   its query rows sees), ``kv_len`` otherwise.
2. A block-level prefix tree over the requests' block-id rows (:mod:`prefixattn.lcp_tree`): a node with >= 2
   requests shares KV ``[parent_end, end)``, ``end = min(depth * block_size, min shareable length of its requests)``
   (the cap at the first query position, as vLLM's cascade attention did).
3. A cost rule (:func:`sharing_pays_off`) keeps a node only when the KV traffic it saves beats the partial-state
   traffic it adds; a dropped node gives its tokens back to its children, or to the requests' suffixes.
4. :func:`prefixattn.planner.work_list.build_work_list` emits the work items, split-k chunks and merge units.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from prefixattn.planner import compiled as compiled_planner
from prefixattn.planner.tiles import DECODE_CLASS_ALL_ROWS, AttentionTiles, choose_tiles
from prefixattn.autotune.buckets import dtype_name
from prefixattn.autotune.lookup import READ_FIXED_ENV, current_target
from prefixattn.autotune.program_cost import LAUNCH_GAP_US, class_costs
from prefixattn.lcp_tree import LcpTree, block_prefix_tree
from prefixattn.runtime import interpreter_enabled
from prefixattn.kernels import layout as K
from prefixattn.memo import typed_memo
from prefixattn.validation import (CPU_DEVICE, SUPPORTED_DTYPES, canonical_device, check_head_dim, check_heads,
                                   check_host_metadata, check_kv_dtype, check_soft_cap, check_window_left)
from prefixattn.planner.device_tables import check_workspace_args, device_tables
from prefixattn.ragged import expand, offsets
from prefixattn.planner.window import window_shared_nodes
from prefixattn.planner.work_list import SharedNode, SharedNodes, WorkList, build_work_list
from prefixattn.planner.workspace import PlanWorkspace

#: Bytes of one fp32 number: partial states (o, lse) are kept in fp32 whatever the input dtype.
FP32_BYTES = 4
#: A partial state costs one write by its producer and one read by the merge.
STATE_PASSES = 2
#: Sharing a node gives each of its rows one more state AND may push a row that had a single state (written straight
#: to ``out``) through the workspace: we charge two states per row, an upper bound that keeps marginal nodes unshared.
STATES_CHARGED_PER_ROW = 2
#: SMs assumed when no GPU is visible (plan() on a CPU host, or the interpreter): an H100 SXM, the tuning target.
DEFAULT_NUM_SMS = 132
#: Shortest split-k chunk (KV tokens). A chunk costs a program start (~a few us) and a partial-state write + read;
#: below ~256 tokens per chunk that overhead is comparable to the chunk's own KV read at head_dim 128.
MIN_SPLIT_TOKENS = 256
_SHARING_MODES = ("auto", "always", "never")
_INT64_MAX = int(np.iinfo(np.int64).max)
#: Whether the kernels run in Triton's interpreter, as when they were imported (``triton.jit`` decides it then, from
#: ``TRITON_INTERPRET``): read once, not per plan (an environment read costs ~0.8 us on the 2-core host).
_KERNELS_INTERPRETED = interpreter_enabled()


def sharing_pays_off(*, num_requests, num_rows, num_m_tiles, num_tokens, group, head_dim, elt_bytes,
                     extra_reads=0):
    """The cost rule: share a node when the KV bytes it saves exceed the bytes' worth it adds (per KV head).

    * saved: without sharing every suffix tile of the node's requests reads its KV (one per decode request, and
      ``extra_reads`` more for requests cut into several chunk tiles); shared, each M tile of packed rows reads it
      once: ``(num_requests + extra_reads - num_m_tiles) * num_tokens * 2 (K and V) * head_dim * elt_bytes``
      (``elt_bytes``: the KV caches' element size, 1 for fp8).
    * added: ``STATES_CHARGED_PER_ROW`` fp32 states ``(o, lse)`` per (row x GQA head), each written and read once:
      ``num_rows * group * (head_dim + 1) * FP32_BYTES * STATE_PASSES * STATES_CHARGED_PER_ROW`` (the merge itself
      reads exactly those states and writes ``out``, which is written anyway).

    A shared program's fixed cost (its start and epilogue) is not charged: in a step that does not fill the GPU it
    runs beside the suffix programs on idle SMs, and in one that does, the split rule's makespan prices it
    (:mod:`prefixattn.planner.split_rule`).

    Works on scalars or numpy arrays. Example: fp16, head_dim 128, GQA 8, decode: 2 requests share from 65 tokens
    on, 64 requests from 35 tokens on.
    """
    saved = (num_requests + extra_reads - num_m_tiles) * num_tokens * 2 * head_dim * elt_bytes
    added = num_rows * group * (head_dim + 1) * FP32_BYTES * STATE_PASSES * STATES_CHARGED_PER_ROW
    return saved > added


@dataclass
class Plan:
    """One step's work list on the device, reusable by every layer (:func:`prefixattn.attention`).

    Host copies (numpy) of the tables are kept for inspection and tests: ``work`` (:class:`WorkList`), ``tree``
    (:class:`LcpTree` over the requests' shareable blocks) and ``nodes`` (:class:`SharedNodes`, the nodes the cost
    rule kept, top-down; ``shared_nodes`` lists them as :class:`SharedNode` objects). A plan loaded into a
    workspace by the compiled planner has ``work``'s tables in the workspace's host buffer (no copy): like its
    device tables, they hold this plan only while it :meth:`is_current`. Plans of the free :func:`plan` in which no
    rows merge (``num_merge_rows == 0``) share one placeholder ``counters``/``ws_o``/``ws_lse`` per device and head
    count, which no launch reads or writes.
    """

    num_tokens: int
    num_requests: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    causal: bool
    sm_scale: float
    q_dtype: torch.dtype
    device: torch.device
    tiles: AttentionTiles
    use_fp32_dot: bool
    has_shared: bool  # any shared-node item
    #: Largest block id the work list reads (-1: none). attention() refuses a cache with ``shape[0] <= max_block_id``
    #: on the host, so a plan can never make the kernel read outside the cache it is given.
    max_block_id: int
    work: WorkList = field(repr=False)
    tree: LcpTree = field(repr=False)
    nodes: SharedNodes = field(repr=False)
    # device tensors
    ranges: tuple = field(repr=False)  # NUM_CLASSES views [RANGE_FIELDS] int32: each class's items (layout)
    items: torch.Tensor = field(repr=False)
    gather: torch.Tensor = field(repr=False)
    mrows: torch.Tensor = field(repr=False)
    block_table: torch.Tensor = field(repr=False)
    counters: torch.Tensor = field(repr=False)  # [num_mrows, num_qo_heads] int32, zeroed before a step's launches
    ws_o: torch.Tensor = field(repr=False)
    ws_lse: torch.Tensor = field(repr=False)
    stats: dict = field(default_factory=dict)
    logits_soft_cap: float = 0.0  # c > 0: scaled logits become c * tanh(s / c); 0: off
    window_left: int = -1  # W >= 0: the query at position p sees keys p - W .. p; -1: off
    nan_guard: bool = False  # the kernel's USE_NAN_GUARD (hidden non-finite V never leaks into a row)
    kv_dtype: torch.dtype | None = None  # the caches' dtype the cost rule priced (None: q_dtype)
    #: The capacity-sized buffers the tables live in (None: this plan's own tensors) and the workspace's step count
    #: when this plan was loaded: a later plan on the same workspace overwrites the tables (:meth:`is_current`).
    workspace: PlanWorkspace | None = field(default=None, repr=False)
    workspace_step: int = -1

    def is_current(self) -> bool:
        """False once a later plan was loaded into this plan's workspace (its device tables are gone)."""
        return self.workspace is None or self.workspace.step == self.workspace_step

    @property
    def shared_nodes(self) -> list[SharedNode]:
        """The kept shared nodes, top-down, as objects (built on access; the planner works on ``nodes``)."""
        return self.nodes.to_list()

    @property
    def num_items(self) -> int:
        return self.work.num_items

    @property
    def num_merge_rows(self) -> int:
        return int(self.work.mrows.shape[0])

    @property
    def work_classes(self) -> tuple[int, ...]:
        """The work classes with items (``layout.CLASS_*``), in launch order: one launch each."""
        return tuple(c for c in range(K.NUM_CLASSES) if self.work.class_range(c)[1] > self.work.class_range(c)[0])

    @property
    def num_launches(self) -> int:
        """Kernel launches one :func:`prefixattn.attention` call makes: one per work class with items (0 for a
        batch with no query rows)."""
        return len(self.work_classes)

    def kv_bytes_read(self, elt_bytes: int | None = None) -> int:
        """KV bytes the work items load (K and V, all KV heads), counting a range once per item that reads it."""
        elt = elt_bytes or (self.kv_dtype or self.q_dtype).itemsize
        items = self.work.items
        tokens = int((items[:, K.ITEM_KV_END].astype(np.int64) - items[:, K.ITEM_KV_START]).sum())
        return tokens * self.num_kv_heads * self.head_dim * 2 * elt


def _check_options(*, causal, sm_scale, logits_soft_cap, window_left, alibi_slopes, sharing, q_dtype,
                   nan_guard) -> tuple[float, int]:
    """The feature options' checks; returns ``(logits_soft_cap, window_left)`` normalized (0.0 / -1: off)."""
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported yet (expected None), got a value")
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {type(causal).__name__}")
    soft_cap = check_soft_cap(logits_soft_cap)
    window_left = check_window_left(window_left, causal)
    if not isinstance(nan_guard, bool):
        raise ValueError(f"nan_guard: expected a bool, got {type(nan_guard).__name__}")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating))
                                 or not math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale: expected a finite float or None, got {sm_scale!r}")
    if sharing not in _SHARING_MODES:
        raise ValueError(f"sharing: expected one of {_SHARING_MODES}, got {sharing!r}")
    if q_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q_dtype: expected one of {[str(d) for d in SUPPORTED_DTYPES]}, got {q_dtype}")
    return soft_cap, window_left


class PlanOptions(NamedTuple):
    """plan()'s options, checked and normalized (:func:`checked_options`): what every step of an engine shares."""

    causal: bool
    sm_scale: float  # the scale used: 1 / sqrt(head_dim) when not given
    q_dtype: torch.dtype
    kv_dtype: torch.dtype  # q_dtype when not given
    logits_soft_cap: float  # 0.0: off
    window_left: int  # -1: off
    sharing: str
    nan_guard: bool
    block_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    min_split_tokens: int
    num_sms: int | None  # None: from the plan's device

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@typed_memo(maxsize=256)  # an engine plans with the same options every step (~5 us of checks on the 2-core host)
def checked_options(*, causal, sm_scale, logits_soft_cap, window_left, alibi_slopes, sharing, q_dtype, kv_dtype,
                    nan_guard, block_size, num_qo_heads, num_kv_heads, head_dim, min_split_tokens,
                    num_sms) -> PlanOptions:
    """plan()'s option checks (its parameters of the same names): the options normalized, or the ``ValueError`` of
    the first bad one. :data:`OPTION_DEFAULTS` holds plan()'s defaults."""
    soft_cap, window_left = _check_options(
        causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
        alibi_slopes=alibi_slopes, sharing=sharing, q_dtype=q_dtype, nan_guard=nan_guard)
    kv_dtype, block_size = check_kv_dtype(kv_dtype, q_dtype), _positive_int("block_size", block_size)
    num_qo_heads, num_kv_heads = _positive_int("num_qo_heads", num_qo_heads), _positive_int("num_kv_heads",
                                                                                            num_kv_heads)
    check_heads(num_qo_heads, num_kv_heads)
    check_head_dim("head_dim", head_dim)
    return PlanOptions(
        causal=causal, sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale), q_dtype=q_dtype,
        kv_dtype=kv_dtype, logits_soft_cap=soft_cap, window_left=window_left, sharing=sharing, nan_guard=nan_guard,
        block_size=block_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, min_split_tokens=_positive_int("min_split_tokens", min_split_tokens),
        num_sms=None if num_sms is None else _positive_int("num_sms", num_sms))


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _default_num_sms(device: torch.device) -> int:
    if device is CPU_DEVICE:  # canonical_device's CPU object: no torch attribute read (~0.5 us) per step
        return DEFAULT_NUM_SMS
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def _node_levels(parent: np.ndarray) -> np.ndarray:
    """Ancestors per node (0 under the root), one vectorized step per tree level."""
    level = np.zeros(parent.shape[0], dtype=np.int64)
    ancestor = parent.copy()
    while (ancestor >= 0).any():
        has = ancestor >= 0
        level += has
        ancestor = np.where(has, parent[np.maximum(ancestor, 0)], -1)
    return level


def select_shared_nodes(tree: LcpTree, *, shareable: np.ndarray, q_len: np.ndarray, block_size: int,
                        rows_per_shared: int, group: int, head_dim: int, elt_bytes: int, sharing: str = "auto",
                        rows_per_chunk: int = 1,
                        rows_per_decode: int = DECODE_CLASS_ALL_ROWS) -> tuple[SharedNodes, np.ndarray]:
    """Walk the tree top-down, one level at a time, and keep the nodes the cost rule accepts (``sharing="auto"``),
    every node with KV (``"always"``, for tests and benchmarks) or none (``"never"``: plain paged attention).
    ``rows_per_chunk``/``rows_per_decode``: a request of more rows than ``rows_per_decode`` reads an unshared node
    once per chunk tile of ``rows_per_chunk`` rows (:func:`sharing_pays_off`'s ``extra_reads``).

    Returns the kept nodes (top-down, requests ascending within each) and ``suffix_start[r]``: the end of the deepest
    kept node holding request ``r`` (0 if none).
    """
    num_nodes = tree.num_nodes
    suffix_start = np.zeros(q_len.shape[0], dtype=np.int64)
    if num_nodes == 0 or sharing == "never":
        return SharedNodes.empty(), suffix_start
    # Nodes are intervals [lb, rb] of the sorted order: one reduceat over (lb, rb + 1) pairs gives every node's
    # minimum shareable length (the +inf sentinel makes rb + 1 == n a valid index).
    n = tree.order.shape[0]
    sorted_shareable = np.empty(n + 1, dtype=np.int64)
    sorted_shareable[:n] = shareable[tree.order]
    sorted_shareable[n] = _INT64_MAX
    bounds = np.empty(2 * num_nodes, dtype=np.int64)
    bounds[0::2] = tree.lb
    bounds[1::2] = tree.rb + 1
    min_shareable = np.minimum.reduceat(sorted_shareable, bounds)[::2]
    ends = np.minimum(tree.depth * block_size, min_shareable)
    cum_rows = offsets(q_len[tree.order])
    rows = cum_rows[tree.rb + 1] - cum_rows[tree.lb]
    # Unshared, a request past a decode tile's rows reads a node's KV once per chunk tile: its extra reads.
    extra = np.where(q_len > rows_per_decode, -(-q_len // rows_per_chunk) - 1, 0)
    cum_extra = offsets(extra[tree.order])
    extra_reads = cum_extra[tree.rb + 1] - cum_extra[tree.lb]
    sizes = tree.rb - tree.lb + 1
    one_level = bool((tree.parent < 0).all())  # one level of sharing (disjoint nodes): the common case
    level = np.zeros(num_nodes, dtype=np.int64) if one_level else _node_levels(tree.parent)
    # A node starts where its nearest kept ancestor ends; a dropped node passes its own start down, so its tokens
    # go back to its children or to the requests' suffixes.
    start = np.zeros(num_nodes, dtype=np.int64)
    effective_end = np.zeros(num_nodes, dtype=np.int64)
    keep = np.zeros(num_nodes, dtype=bool)
    for depth in range(int(level.max()) + 1):
        idx = slice(None) if one_level else (level == depth).nonzero()[0]
        if not one_level:
            parent = tree.parent[idx]
            start[idx] = np.where(parent >= 0, effective_end[np.maximum(parent, 0)], 0)
        tokens = ends[idx] - start[idx]
        ok = tokens > 0
        if sharing == "auto":
            ok &= sharing_pays_off(num_requests=sizes[idx], num_rows=rows[idx],
                                   num_m_tiles=-(-rows[idx] // rows_per_shared), num_tokens=tokens, group=group,
                                   head_dim=head_dim, elt_bytes=elt_bytes, extra_reads=extra_reads[idx])
        keep[idx] = ok
        if not one_level:
            effective_end[idx] = np.where(ok, ends[idx], start[idx])
    kept = keep.nonzero()[0]
    if not one_level:
        kept = kept[np.argsort(level[kept], kind="stable")]  # top-down
    counts = sizes[kept]
    node_of, rank = expand(counts)
    members = tree.order[tree.lb[kept][node_of] + rank]
    # Requests ascending within each node: one sort of (node, request) keys.
    key = node_of * q_len.shape[0]
    members = np.sort(key + members) - key
    kept_ends = ends[kept]
    if one_level:  # disjoint nodes: each request in at most one
        suffix_start[members] = kept_ends[node_of]
    else:
        np.maximum.at(suffix_start, members, kept_ends[node_of])  # deeper kept nodes end later
    nodes = SharedNodes(kv_start=start[kept], kv_end=kept_ends, depth_blocks=tree.depth[kept],
                        offsets=offsets(counts), members=members)
    return nodes, suffix_start


def plan(
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    causal: bool = True,
    sm_scale: float | None = None,
    q_dtype: torch.dtype = torch.float16,
    kv_dtype: torch.dtype | None = None,
    logits_soft_cap: float | None = None,
    window_left: int | None = None,
    alibi_slopes=None,
    device=None,
    num_sms: int | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    sharing: str = "auto",
    num_blocks: int | None = None,
    tiles: AttentionTiles | None = None,
    workspace: PlanWorkspace | None = None,
    device_block_table: torch.Tensor | None = None,
    nan_guard: bool = False,
) -> Plan:
    """Plan one engine step of prefix-shared paged attention (host; reuse the plan for every layer).

    Finds the KV prefixes requests share (identical leading block ids in ``block_table``, as a paged engine's prefix
    cache produces), keeps the ones worth sharing, and builds the step's work list: shared-node tiles (all query
    rows of a node's requests against one copy of its KV), per-request suffix tiles (prefill-chunk tiles and decode
    tiles), split-k chunks when a class's launch would not fill the device, and in-kernel merges. Each work class
    runs as its own launch (:attr:`Plan.work_classes`). With nothing shared it is plain paged attention: one item per
    request tile, written straight to the output, no workspace.

    Parameters
    ----------
    qo_indptr : Tensor, ``[num_requests + 1]``, int32/int64
        Query-row offsets per request (same conventions as :func:`prefixattn.reference_attention`).
    kv_lens : Tensor, ``[num_requests]``, int32/int64
        KV length per request, including its new query tokens.
    block_table : Tensor, ``[num_requests, max_blocks]``, int32/int64
        Physical block of each request's KV positions ``j * block_size ...``.
    block_size, num_qo_heads, num_kv_heads, head_dim : int
        Shapes of the paged caches and of q that :func:`prefixattn.attention` will get.
    causal : bool
        Query row ``i`` of request ``r`` sees KV positions ``<= kv_len - q_len + i`` (else all of them).
    sm_scale : float, optional
        Logit scale, default ``1 / sqrt(head_dim)``.
    q_dtype : torch.dtype
        dtype of q (fp16/bf16/fp32): picks the tiles and the dot precision.
    kv_dtype : torch.dtype, optional
        dtype of the K/V caches: ``q_dtype`` (the default) or fp8 (``float8_e4m3fn``/``float8_e5m2``). Prices the KV
        bytes in the cost rule (an fp8 prefix saves half the bytes per shared token of a 16-bit one).
    logits_soft_cap : float, optional
        ``c > 0``: each scaled logit ``s`` becomes ``c * tanh(s / c)`` (None or 0: off).
    window_left : int, optional
        ``W >= 0`` (causal only): the query at KV position ``p`` sees keys ``p - W .. p`` (None or -1: off; vLLM's
        ``sliding_window=S`` is ``W = S - 1``). Shared prefixes are shared only where every member's window covers
        them (:mod:`prefixattn.planner.window`). Models that mix windowed and full layers need one plan per kind of layer.
    alibi_slopes
        Not supported yet: anything but None raises ``ValueError``.
    device : torch.device or str, optional
        Where the work list lives; default the device of ``block_table``. Stored canonically (``cpu:0`` is
        ``cpu``, ``cuda`` is the current CUDA device), so any spelling of the tensors' device matches.
    num_sms : int, optional
        SMs the launch spreads over (the split rule's fair share, :mod:`prefixattn.planner.split_rule`); default from the
        CUDA device, else ``DEFAULT_NUM_SMS``.
    min_split_tokens : int
        Shortest split-k chunk in KV tokens (``MIN_SPLIT_TOKENS``).
    sharing : {"auto", "always", "never"}
        ``"auto"`` applies the cost rule (:func:`sharing_pays_off`); the others force every/no candidate node.
    num_blocks : int, optional
        Number of blocks in the cache, to refuse an out-of-range id here, at plan time. Without it the plan still
        records the largest id it reads (``Plan.max_block_id``) and :func:`prefixattn.attention` checks it against
        the cache it gets.
    tiles : AttentionTiles, optional
        Fixed tiles instead of :func:`~prefixattn.planner.tiles.choose_tiles`'s choice for this batch (a
        CUDA-graph wrapper keeps one set for every step; any tiles give the same results).
    workspace : PlanWorkspace, optional
        Capacity-sized buffers (:mod:`prefixattn.planner.workspace`) to write the device tables into (one non-blocking
        copy, no device allocation); a step beyond a capacity raises ``ValueError`` naming it. Default: new
        tensors for this plan (device allocations), its tables staged in page-locked memory on a GPU and moved by
        one non-blocking copy on the current stream (a launch on another stream must wait for it, as for the
        workspace's copy; an engine loop plans into :class:`~prefixattn.PrefixSharedAttention`'s workspace
        instead: no allocation).
    device_block_table : Tensor, optional, ``[>= num_requests, >= used blocks]`` int32, on ``device``
        With ``workspace``: the same block ids, already on the device (an engine's persistent table); the kernel
        reads it and the plan copies no table. Its values must equal ``block_table``'s (not checked: no sync).
    nan_guard : bool
        Keep a non-finite V value at a key a row does not see (inside a causal or window-edge tile) out of that
        row, as the reference does: items whose result is non-finite are redone key by key. Off by default: the
        check alone costs registers in the decode launch (the kernel's ``USE_NAN_GUARD``).

    Returns
    -------
    Plan

    Examples
    --------
    >>> p = plan(torch.tensor([0, 1, 2]), torch.tensor([40, 40]), torch.tensor([[0, 1, 2], [0, 1, 3]]),
    ...          block_size=16, num_qo_heads=8, num_kv_heads=2, head_dim=128, q_dtype=torch.float32)
    >>> [(n.kv_start, n.kv_end, n.requests.tolist()) for n in p.shared_nodes]
    [(0, 32, [0, 1])]
    >>> out = attention(q, k_cache, v_cache, p)  # q: [2, 8, 128]
    """
    options = checked_options(
        causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
        alibi_slopes=alibi_slopes, sharing=sharing, q_dtype=q_dtype, kv_dtype=kv_dtype, nan_guard=nan_guard,
        block_size=block_size, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        min_split_tokens=min_split_tokens, num_sms=num_sms)
    return plan_with_options(options, qo_indptr, kv_lens, block_table, device=device, num_blocks=num_blocks,
                             tiles=tiles, workspace=workspace, device_block_table=device_block_table)


#: plan()'s option parameters (:class:`PlanOptions`' inputs) and their defaults: a wrapper checks its options once.
OPTION_DEFAULTS = {name: param.default for name, param in inspect.signature(plan).parameters.items()
                   if name in inspect.signature(checked_options).parameters}


#: :func:`plan_with_options`' default ``planner``: the one ``PREFIXATTN_PLANNER`` picks at that call.
PLANNER_FROM_ENV = "env"


def plan_with_options(options: PlanOptions, qo_indptr: torch.Tensor, kv_lens: torch.Tensor,
                      block_table: torch.Tensor, *, device=None, num_blocks: int | None = None,
                      tiles: AttentionTiles | None = None, workspace: PlanWorkspace | None = None,
                      device_block_table: torch.Tensor | None = None, planner=PLANNER_FROM_ENV,
                      fixed_env=READ_FIXED_ENV) -> Plan:
    """:func:`plan` with its options checked already (:func:`checked_options`; a wrapper checks them once): the
    per-step half. ``planner``: :func:`prefixattn.planner.compiled.compiled_modules`' answer (the compiled planner's
    modules, or None: numpy), by default asked now (an environment read, ~0.8 us; a wrapper asks once);
    ``fixed_env``: ``PREFIXATTN_TILE_CONFIG`` for the tile choice (:func:`~prefixattn.planner.tiles.choose_tiles`),
    likewise. The other arguments are :func:`plan`'s."""
    o = options
    compiled = compiled_planner.still_compiled(compiled_planner.compiled_modules() if planner is PLANNER_FROM_ENV else planner)
    # A workspace that stages the table: the compiled checks write it while they read it.
    stage = workspace.host_table() if compiled and workspace is not None and device_block_table is None else None
    (indptr, lens, table, max_block_id, q_len, shareable, max_q_len, width, tree,
     table_staged) = _checked_inputs_and_tree(
        compiled, qo_indptr=qo_indptr, kv_lens=kv_lens, block_table=block_table, block_size=o.block_size,
        num_blocks=num_blocks, causal=o.causal, sharing=o.sharing, stage=stage)
    written = False
    try:
        device = canonical_device("device", device if device is not None else block_table.device)
        # Before the compiled planner writes the work list into the workspace.
        check_workspace_args(workspace=workspace, device_block_table=device_block_table, device=device,
                             num_requests=lens.shape[0], width=width)
        num_sms = o.num_sms or _default_num_sms(device)
        group = o.group
        if tiles is None:
            tiles = choose_tiles(head_dim=o.head_dim, group=group, max_q_len=max(max_q_len, 1), dtype=o.q_dtype,
                                 fixed_env=fixed_env)
        nodes, work, staged_flat, written = _host_tables(
            compiled_planner.still_compiled(compiled), tree, o, tiles=tiles, num_sms=num_sms, indptr=indptr, q_len=q_len,
            lens=lens, shareable=shareable, table=table, workspace=workspace,
            width=width if workspace is None else 0)  # a workspace's table: staged by the checks or PlanWorkspace.load
        num_tokens, num_nodes = int(indptr[-1]), int(nodes.kv_start.shape[0])
        dev = device_tables(work, table, width, workspace=workspace, device_block_table=device_block_table,
                             device=device, staged=staged_flat, num_qo_heads=o.num_qo_heads, head_dim=o.head_dim,
                             num_tokens=num_tokens, max_block_id=max_block_id, table_staged=table_staged,
                             tables_written=written)
    except BaseException:
        if workspace is not None:  # a refused step that wrote into the workspace: the earlier plans' tables changed
            workspace.refused_after_writing(table=table_staged, work_list=written)
        raise
    return Plan(
        num_tokens=num_tokens, num_requests=int(lens.shape[0]), num_qo_heads=o.num_qo_heads,
        num_kv_heads=o.num_kv_heads, head_dim=o.head_dim, block_size=o.block_size, causal=o.causal,
        sm_scale=o.sm_scale, q_dtype=o.q_dtype, kv_dtype=o.kv_dtype, device=device, tiles=tiles,
        # The interpreter's dot on fp16/bf16 is numpy's (bf16 on raw bits); fp32 inputs need IEEE fp32 (tf32 would
        # miss the 1e-4 tolerance).
        use_fp32_dot=_KERNELS_INTERPRETED or o.q_dtype == torch.float32,
        has_shared=num_nodes > 0, max_block_id=max_block_id,
        logits_soft_cap=o.logits_soft_cap, window_left=o.window_left, nan_guard=o.nan_guard,
        work=work, tree=tree, nodes=nodes,
        **dev,
        stats=dict(num_shared_nodes=num_nodes, num_units=work.num_units, num_merge_rows=work.mrows.shape[0],
                   num_ws_rows=work.num_ws_rows, num_sms=num_sms, **modeled_stats(work)),
        workspace=workspace, workspace_step=workspace.step if workspace is not None else -1,
    )


def _checked_inputs_and_tree(compiled, *, qo_indptr, kv_lens, block_table, block_size: int,
                             num_blocks: int | None, causal: bool, sharing: str, stage=None) -> tuple:
    """The checked host metadata and the block prefix tree: ``(indptr, lens, table, max_block_id, q_len, shareable,
    max_q_len, width, tree, table_staged)``, from the compiled planner's checks (``compiled``: its modules, or None)
    when it is there, else from numpy (same results, same errors). ``stage``: a workspace's host table, which the
    compiled checks fill (``table_staged``; numpy never does). ``indptr`` and ``lens`` are int64, or int32 both from
    the compiled checks (``q_len`` and ``shareable`` int64 always)."""
    # None: no compiled planner, or (PREFIXATTN_PLANNER=auto) it failed to compile: numpy, same results.
    checked = compiled and compiled_planner.check_and_tree(compiled, qo_indptr, kv_lens, block_table, block_size=block_size,
                                                      num_blocks=num_blocks, causal=causal, sharing=sharing,
                                                      stage=stage)
    if checked:
        return checked
    indptr, lens, table, max_block_id = check_host_metadata(qo_indptr, kv_lens, block_table,
                                                            block_size=block_size, num_blocks=num_blocks,
                                                            table_as_is=True)
    q_len = indptr[1:] - indptr[:-1]
    shareable = np.where(q_len > 0, lens - q_len if causal else lens, 0)
    max_q_len = int(q_len.max()) if q_len.shape[0] else 1
    width = max(-(-int(lens.max()) // block_size) if lens.shape[0] else 0, 1)  # blocks of the longest request
    # sharing="never" needs no tree (an empty one keeps Plan.tree well-formed).
    tree = block_prefix_tree(table, shareable if sharing != "never" else np.zeros_like(shareable), block_size)
    return indptr, lens, table, max_block_id, q_len, shareable, max_q_len, width, tree, False


def _host_tables(compiled, tree, o: PlanOptions, *, tiles: AttentionTiles, num_sms: int, indptr, q_len, lens,
                 shareable, table, width, workspace):
    """The shared nodes, the work list, the compiled planner's staged buffer (None from numpy) and whether the
    compiled planner wrote the work list into ``workspace``'s host buffer: ``(SharedNodes, WorkList, staged,
    written)``. ``compiled``: the compiled planner's modules, or None; ``width``: the table columns to stage (0:
    none)."""
    costs = _class_costs(o, tiles)
    # The compiled path (window_left: numpy, compiled_core's docstring); None as above.
    tables = compiled and o.window_left < 0 and compiled_planner.plan_tables(
        compiled, tree, _core_params(o, tiles, num_sms), costs[1], indptr=indptr, q_len=q_len, kv_len=lens,
        shareable=shareable, table=table, width=width, workspace=workspace)
    if tables:
        nodes, work, flat, fits, written = tables
        return nodes, work, (flat, fits), written
    tile_args = _tile_args(o, tiles, num_sms)
    # int64: the compiled checks pass int32 pairs through, and numpy's int32 sums with Python ints stay int32
    indptr, lens = indptr.astype(np.int64, copy=False), lens.astype(np.int64, copy=False)
    nodes, work = _numpy_tables(tree, q_start=indptr[:-1], q_len=q_len, lens=lens, shareable=shareable,
                                causal=o.causal, sharing=o.sharing, block_size=o.block_size, group=o.group,
                                head_dim=o.head_dim, elt_bytes=o.kv_dtype.itemsize, window_left=o.window_left,
                                costs=costs[0], **tile_args)
    return nodes, work, None, False


#: Each step's class costs by (options, tiles, target), keyed by identity and holding the objects (as
#: :data:`_core_params_memo`): ``(ProgramCosts, their compiled planner argument)``.
_costs_memo: dict = {}


def _class_costs(o: PlanOptions, tiles: AttentionTiles) -> tuple:
    """The work classes' :class:`~prefixattn.autotune.program_cost.ProgramCost` on the planning target
    (:func:`prefixattn.autotune.lookup.current_target`; on a host without a known GPU the tuning target's), and the
    same as the compiled planner's float array."""
    target = current_target()
    key = (id(o), id(tiles), id(target))
    hit = _costs_memo.get(key)
    if hit is not None and hit[0] is o and hit[1] is tiles and hit[2] is target:
        return hit[3]
    if len(_costs_memo) >= _MAX_CORE_PARAMS:
        _costs_memo.clear()
    costs = class_costs(tiles, head_dim=o.head_dim, dtype=dtype_name(o.q_dtype), kv_bytes=o.kv_dtype.itemsize,
                        target=target)
    out = (costs, compiled_planner.cost_args(costs))
    _costs_memo[key] = (o, tiles, target, out)
    return out


def modeled_stats(work: WorkList) -> dict:
    """``Plan.stats``' modeled entries (microseconds on the planning target, modeled by
    :mod:`prefixattn.autotune.program_cost`): each class launch's makespan, the step (their sum and a
    ``LAUNCH_GAP_US`` between consecutive launches), and the critical path: the makespans' sum over the programs'
    time spread evenly over the slots (1.0: every launch ends in a full wave)."""
    spans = [float(span) for span, _ in work.modeled_us]
    ideal = float(sum(i for _, i in work.modeled_us))
    total = sum(spans)
    launches = sum(1 for c in range(K.NUM_CLASSES) if work.class_ends[c] > (work.class_ends[c - 1] if c else 0))
    return dict(modeled_class_us=tuple(round(x, 2) for x in spans),
                modeled_step_us=round(total + max(0, launches - 1) * LAUNCH_GAP_US, 2),
                critical_path=round(total / ideal, 4) if ideal > 0 else 0.0)


def _tile_args(o: PlanOptions, tiles: AttentionTiles, num_sms: int) -> dict:
    """The work list's tile and split arguments."""
    group = o.group
    return dict(rows_per_shared=tiles.rows_per_shared_tile(group), rows_per_chunk=tiles.rows_per_chunk_tile(group),
                rows_per_decode=tiles.decode_class_rows(group), block_n_shared=tiles.shared.block_n,
                block_n_chunk=tiles.chunk.block_n, block_n_decode=tiles.decode.block_n,
                num_kv_heads=o.num_kv_heads, num_sms=num_sms, min_split_tokens=o.min_split_tokens)


#: The compiled planner's parameter arrays by (options, tiles, SMs), keyed by identity (both come from memos: the
#: same objects step after step) and holding the objects, so a recycled id never matches: ~2 us a step less than
#: building the key from their values.
_core_params_memo: dict = {}
_MAX_CORE_PARAMS = 256


def _core_params(o: PlanOptions, tiles: AttentionTiles, num_sms: int) -> np.ndarray:
    key = (id(o), id(tiles), num_sms)
    hit = _core_params_memo.get(key)
    if hit is not None and hit[0] is o and hit[1] is tiles:
        return hit[2]
    if len(_core_params_memo) >= _MAX_CORE_PARAMS:
        _core_params_memo.clear()
    params = compiled_planner.core_params(causal=o.causal, sharing=o.sharing, block_size=o.block_size, group=o.group,
                                     head_dim=o.head_dim, elt_bytes=o.kv_dtype.itemsize,  # the cache's dtype prices KV
                                     **_tile_args(o, tiles, num_sms))
    _core_params_memo[key] = (o, tiles, params)
    return params


def _numpy_tables(tree, *, q_start, q_len, lens, shareable, causal, sharing, block_size, group, head_dim, elt_bytes,
                  window_left, rows_per_shared, rows_per_chunk, rows_per_decode, block_n_shared, block_n_chunk,
                  block_n_decode, num_kv_heads, num_sms, min_split_tokens, costs):
    """The numpy planner from the tree to the work list: ``(SharedNodes, WorkList)``."""
    nodes, suffix_start = select_shared_nodes(
        tree, shareable=shareable, q_len=q_len, block_size=block_size, rows_per_shared=rows_per_shared, group=group,
        head_dim=head_dim, elt_bytes=elt_bytes, sharing=sharing,
        rows_per_chunk=rows_per_chunk, rows_per_decode=rows_per_decode)
    if window_left >= 0:  # share only what every member's window covers
        nodes, suffix_start = window_shared_nodes(nodes, suffix_start, kv_len=lens, q_len=q_len,
                                                  window_left=window_left)
    work = build_work_list(
        q_start=q_start, q_len=q_len, kv_len=lens, causal=causal, nodes=nodes, suffix_start=suffix_start,
        rows_per_shared=rows_per_shared, rows_per_chunk=rows_per_chunk, rows_per_decode=rows_per_decode,
        block_n_shared=block_n_shared, block_n_chunk=block_n_chunk, block_n_decode=block_n_decode,
        num_kv_heads=num_kv_heads, num_sms=num_sms, min_split_tokens=min_split_tokens, costs=costs)
    return nodes, work
