"""plan(): find the KV prefixes a batch shares and turn them into the step's work list (host, once per step).

One straight pipeline (:func:`plan_with_options`), each stage called once a step, each computed by the process's
back-end (numpy, or numba where installed: :mod:`prefixattn.planner.backend`):

1. checks (:mod:`~prefixattn.planner.checks`): the metadata checked; each request's *shareable* KV length
   (``kv_len - q_len`` when causal: the positions every one of its query rows sees; ``kv_len`` otherwise);
2. tree (:mod:`~prefixattn.planner.tree`): a block-level prefix tree over the requests' block-id rows; a node with
   >= 2 requests shares KV ``[parent_end, end)``, ``end = min(depth * block_size, min shareable length of its
   requests)`` (the cap at the first query position, as vLLM's cascade attention did);
3. nodes (:mod:`~prefixattn.planner.node_choice`): a cost rule (:mod:`~prefixattn.planner.cost_rule`) keeps a node
   only when the KV traffic it saves beats the partial-state traffic it adds; a dropped node gives its tokens back to
   its children, or to the requests' suffixes (:mod:`~prefixattn.planner.window` under a sliding window);
4. choose (:mod:`~prefixattn.planner.choose`): that plan, the same with the requests that gain from no node apart,
   or no sharing, by their modeled step times (the split stage, :mod:`~prefixattn.planner.split_rule`, prices each
   candidate without building its work list);
5. work list (:mod:`~prefixattn.planner.work_list`): the chosen candidate's work items, split-k pieces and merge
   units, once;
6. device tables (:mod:`~prefixattn.planner.device_tables`): the tables on the device, new per plan or in a
   capacity-sized workspace (:mod:`~prefixattn.planner.workspace`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from prefixattn.autotune.buckets import dtype_name
from prefixattn.autotune.builds import HOPPER_CLASSES, PORTABLE, class_build, requested_build
from prefixattn.autotune.lookup import READ_FIXED_ENV, current_target
from prefixattn.autotune.pdl import pdl_choice, requested_pdl
from prefixattn.autotune.program_cost import class_costs
from prefixattn.kernels import layout as K
from prefixattn.lcp_tree import LcpTree, clear_tree_cache
from prefixattn.planner.backend import NUMPY, backend, fall_back_to_numpy, using
from prefixattn.planner.choose import choose
from prefixattn.planner.device_tables import check_workspace_args, device_tables
from prefixattn.planner.options import MIN_SPLIT_TOKENS, PlanOptions, _default_num_sms, checked_options
from prefixattn.planner.overlap import overlap_stats
from prefixattn.planner.stats import chained_us, modeled_stats
from prefixattn.planner.tiles import AttentionTiles, choose_tiles, fit_kv_heads, mla_tiles, tile_head_dim
from prefixattn.planner.work_list import SharedNode, SharedNodes, WorkList
from prefixattn.planner.workspace import PlanWorkspace
from prefixattn.runtime import interpreter_enabled
from prefixattn.validation import canonical_device

#: The form an MLA plan attends in (``stats["mla_form"]``): the absorbed form (the naive form over a prefix
#: up-projected once per group: :mod:`prefixattn.mla_naive`, on top of two plans).
MLA_FORM = "absorbed"
#: Whether the kernels run in Triton's interpreter, as when they were imported (``triton.jit`` decides it then, from
#: ``TRITON_INTERPRET``): read once, not per plan (an environment read costs ~0.8 us on the 2-core host).
_KERNELS_INTERPRETED = interpreter_enabled()


@dataclass(eq=False)  # compared by identity: the launcher keys its prepared launches on the plan
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
    head_dim: int  # q's and K's head size (an MLA plan's: the latent width)
    v_head_dim: int  # V's and the output's (head_dim unless plan(v_head_dim=...))
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
    counters: torch.Tensor = field(repr=False)  # [num_mrows, num_qo_heads] int32: zeroed by plan(), kept 0 by launches
    ws_o: torch.Tensor = field(repr=False)
    ws_lse: torch.Tensor = field(repr=False)
    #: ``stats`` but the modeled entries, which the first read of ``stats`` adds (:func:`modeled_stats`: ~3 us of
    #: Python a plan, on the 2-core host, that an engine's step never reads). A wrapper or an engine backend adds its
    #: own entries here, not through ``stats``, which would compute the modeled ones every step.
    counts: dict = field(default_factory=dict, repr=False)
    logits_soft_cap: float = 0.0  # c > 0: scaled logits become c * tanh(s / c); 0: off
    window_left: int = -1  # W >= 0: the query at position p sees keys p - W .. p; -1: off
    nan_guard: bool = False  # the kernel's USE_NAN_GUARD (hidden non-finite V never leaks into a row)
    kv_dtype: torch.dtype | None = None  # the caches' dtype the cost rule priced (None: q_dtype)
    #: > 0: an MLA plan (:func:`prefixattn.plan_mla`, run by :func:`prefixattn.mla_attention`): ``head_dim`` is the
    #: latent width (``kv_lora_rank``), this the rotary key width, and ``num_kv_heads`` counts head blocks (the
    #: programs of an item, :attr:`heads_per_program` query heads each; the latent cache has one head).
    rope_dim: int = 0
    #: The capacity-sized buffers the tables live in (None: this plan's own tensors) and the workspace's step count
    #: when this plan was loaded: a later plan on the same workspace overwrites the tables (:meth:`is_current`).
    workspace: PlanWorkspace | None = field(default=None, repr=False)
    workspace_step: int = -1
    #: The decode launch runs beside the compute launches, on a side stream (``plan(overlap=True)`` where it pays,
    #: modeled: :mod:`prefixattn.planner.overlap`).
    overlapped: bool = False
    #: The shared and the chunk class's builds (:mod:`prefixattn.autotune.builds`): ``"portable"`` or ``"hopper"``;
    #: why in ``stats["shared_build_why"]``, ``stats["chunk_build_why"]``.
    shared_build: str = PORTABLE
    chunk_build: str = PORTABLE
    #: The launches after the step's first chain to the one before by programmatic dependent launch (its portable
    #: launches: :mod:`prefixattn.autotune.pdl`); why in ``stats["pdl_why"]``.
    pdl: bool = False

    @property
    def heads_per_program(self) -> int:
        """Query heads one program's rows pack (the GQA group; an MLA plan's head block)."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def stats(self) -> dict:
        """The plan's counts (``num_shared_nodes``, ``num_units``, ``num_merge_rows``, ``num_ws_rows``, ``num_sms``,
        ``sharing_declined``, ``requests_apart``), its matrix classes' builds (``shared_build``, ``shared_build_why``,
        ``chunk_build``, ``chunk_build_why``: :mod:`prefixattn.autotune.builds`), whether its launches chain by PDL
        (``pdl``, ``pdl_why``: :mod:`prefixattn.autotune.pdl`) and modeled times
        (:func:`~prefixattn.planner.stats.modeled_stats`:
        ``modeled_class_us``, ``modeled_step_us``, ``critical_path``; with ``overlap=True`` also ``overlapped`` and
        ``modeled_overlap_us``: :func:`~prefixattn.planner.overlap.overlap_stats`; with PDL ``modeled_pdl_us``:
        :func:`~prefixattn.planner.stats.chained_us`); a wrapper adds its own entries."""
        if "modeled_step_us" not in self.counts:
            self.counts.update(modeled_stats(self.work.modeled_us, self.work.class_ends))
        return self.counts

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

    def build_of(self, work_class: int) -> str:
        """The build the launches of ``work_class`` (``layout.CLASS_*``) take: ``"portable"`` or ``"hopper"``."""
        return (self.shared_build, self.chunk_build, PORTABLE)[work_class]

    @property
    def num_launches(self) -> int:
        """Kernel launches one :func:`prefixattn.attention` call makes: one per work class with items (0 for a
        batch with no query rows)."""
        return len(self.work_classes)

    def kv_bytes_read(self, elt_bytes: int | None = None) -> int:
        """KV bytes the work items load (K and V, all KV heads; an MLA plan's latent rows, once per head block),
        counting a range once per item that reads it."""
        elt = elt_bytes or (self.kv_dtype or self.q_dtype).itemsize
        items = self.work.items
        tokens = int((items[:, K.ITEM_KV_END].astype(np.int64) - items[:, K.ITEM_KV_START]).sum())
        row = self.head_dim + (self.rope_dim or self.v_head_dim)
        return tokens * self.num_kv_heads * row * elt



def plan(
    qo_indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
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
    overlap: bool = False,
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
    v_head_dim : int, optional
        V's head size and the output's, where it differs from ``head_dim`` (q's and K's), as in DeepSeek's
        up-projected MLA prefill (keys 192, values 128); the same sizes are supported. Default ``head_dim``.
    causal : bool
        Query row ``i`` of request ``r`` sees KV positions ``<= kv_len - q_len + i`` (else all of them).
    sm_scale : float, optional
        Logit scale (finite, >= 0), default ``1 / sqrt(head_dim)``.
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
        them (:mod:`prefixattn.planner.window`). Models that mix windowed and full layers need one plan per kind of
        layer.
    alibi_slopes
        Not supported yet: anything but None raises ``ValueError``.
    device : torch.device or str, optional
        Where the work list lives; default the device of ``block_table``. Stored canonically (``cpu:0`` is
        ``cpu``, ``cuda`` is the current CUDA device), so any spelling of the tensors' device matches.
    num_sms : int, optional
        SMs the launch spreads over (the split rule's fair share, :mod:`prefixattn.planner.split_rule`); default from
        the CUDA device, else ``prefixattn.planner.options.DEFAULT_NUM_SMS``.
    min_split_tokens : int
        Shortest split-k chunk in KV tokens (``MIN_SPLIT_TOKENS``).
    sharing : {"auto", "always", "never"}
        ``"auto"`` applies the cost rule (:func:`prefixattn.planner.cost_rule.sharing_pays_off`) per node; on a
        known planning GPU it then keeps requests that gain from no node (prefill chunks of full chunk tiles) out of
        the nodes where the step's modeled time is lower so (``stats["requests_apart"]``), and drops all sharing in a
        step whose modeled time is lower without it (a short step, where the shared launch costs more than it saves;
        ``stats["sharing_declined"]``): :mod:`prefixattn.planner.choose`. The others force every/no candidate
        node.
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
        row, as the reference does: the rows whose result is non-finite are redone key by key. Off by default: the
        check alone costs registers in the decode launch (the kernel's ``USE_NAN_GUARD``).
    overlap : bool
        Run the step's decode class beside its compute-bound classes (shared nodes, prefill chunks) instead of after
        them: on a GPU the decode launch goes to a side stream forked from the current one, which the current stream
        joins before :func:`prefixattn.attention` returns (its results and what follows on the current stream are
        ordered as without it). Taken where the step has both kinds and the cost model says it pays
        (:mod:`prefixattn.planner.overlap`; ``Plan.overlapped``, ``stats["overlapped"]``); a CUDA-graph wrapper's
        captured launches fork at every replay instead (``PrefixSharedAttention.graph_overlapped``).

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
        min_split_tokens=min_split_tokens, num_sms=num_sms, overlap=overlap, v_head_dim=v_head_dim)
    return plan_with_options(options, qo_indptr, kv_lens, block_table, device=device, num_blocks=num_blocks,
                             tiles=tiles, workspace=workspace, device_block_table=device_block_table)


#: plan()'s option parameters (:class:`PlanOptions`' inputs) and their defaults: a wrapper checks its options once.
OPTION_DEFAULTS = {name: param.default for name, param in inspect.signature(plan).parameters.items()
                   if name in inspect.signature(checked_options).parameters}


def plan_with_options(options: PlanOptions, qo_indptr: torch.Tensor, kv_lens: torch.Tensor,
                      block_table: torch.Tensor, *, device=None, num_blocks: int | None = None,
                      tiles: AttentionTiles | None = None, workspace: PlanWorkspace | None = None,
                      device_block_table: torch.Tensor | None = None, planner=None,
                      fixed_env=READ_FIXED_ENV) -> Plan:
    """:func:`plan` with its options checked already (:func:`checked_options`; a wrapper checks them once): the
    per-step half, the pipeline of the module docstring. ``planner``: the back-end (default: the process's,
    :func:`prefixattn.planner.backend.backend`); ``fixed_env``: ``PREFIXATTN_TILE_CONFIG`` for the tile choice
    (:func:`~prefixattn.planner.tiles.choose_tiles`), read once by a wrapper. The other arguments are :func:`plan`'s."""
    args = (options, qo_indptr, kv_lens, block_table, device, num_blocks, tiles, workspace, device_block_table,
            fixed_env)
    be = planner or backend()
    try:
        return _pipeline(be, *args)
    except be.compile_errors as error:  # the compiled back-end failed to compile (an incompatible numba)
        if be.strict:
            raise
        fall_back_to_numpy(error)  # PREFIXATTN_PLANNER=auto: numpy from now on, this step too
        return _pipeline(NUMPY, *args)


def _pipeline(be, o: PlanOptions, qo_indptr, kv_lens, block_table, device, num_blocks, tiles, workspace,
              device_block_table, fixed_env) -> Plan:
    inputs = be.check(qo_indptr, kv_lens, block_table, block_size=o.block_size, num_blocks=num_blocks,
                      causal=o.causal, sharing=o.sharing)
    tree = be.tree(inputs, block_size=o.block_size, sharing=o.sharing)
    written = False
    try:
        device = canonical_device("device", device if device is not None else block_table.device)
        check_workspace_args(workspace=workspace, device_block_table=device_block_table, device=device,
                             num_requests=inputs.num_requests, width=inputs.width)
        num_sms = o.num_sms or _default_num_sms(device)
        if tiles is None and o.rope_dim:
            tiles = mla_tiles(kv_lora_rank=o.head_dim, dtype=o.q_dtype, kv_fp8=o.kv_dtype.itemsize == 1)
        elif tiles is None:
            tiles = choose_tiles(head_dim=tile_head_dim(o.head_dim, o.v_head_dim), group=o.group,
                                 max_q_len=max(inputs.max_q_len, 1), dtype=o.q_dtype, fixed_env=fixed_env)
        tiles = fit_kv_heads(tiles, num_kv_heads=o.num_kv_heads, group=o.group, nan_guard=o.nan_guard)
        builds = _class_builds(o, tiles, device)
        pdl, pdl_why = _pdl(o, device)
        # Priced on the planning GPU (a host with no known GPU, the interpreter, has no launches to price: the tuning
        # target's costs, for the modeled stats).
        target = current_target()
        costs = class_costs(tiles, head_dim=o.cost_head_dim, dtype=o.q_dtype, kv_bytes=o.kv_dtype.itemsize,
                            target=target)
        chosen = choose(be, tree, inputs, o, tiles, num_sms=num_sms, costs=costs,
                        priced=o.sharing == "auto" and target is not None, chained=pdl)
        overlap = overlap_stats(chosen.split.modeled, chosen.split.class_ends) if o.overlap else {}
        chain = {"modeled_pdl_us": chained_us(chosen.split.modeled, chosen.split.class_ends)} if pdl else {}
        work, staged, written = be.work_list(chosen.nodes, chosen.split, inputs, o, tiles, workspace=workspace,
                                             width=inputs.width if workspace is None else 0)
        dev = device_tables(work, inputs, workspace=workspace, device_block_table=device_block_table, device=device,
                            staged=staged, num_qo_heads=o.num_qo_heads, head_dim=o.v_head_dim, tables_written=written,
                            stage_table=be.stage_table)
    except BaseException:
        if workspace is not None:  # a refused step that wrote into the workspace: the earlier plans' tables changed
            workspace.refused_after_writing(table=False, work_list=written)
        raise
    nodes, num_nodes = chosen.nodes, len(chosen.nodes)
    return Plan(
        num_tokens=inputs.num_tokens, num_requests=inputs.num_requests, num_qo_heads=o.num_qo_heads,
        num_kv_heads=o.num_kv_heads, head_dim=o.head_dim, v_head_dim=o.v_head_dim, block_size=o.block_size,
        causal=o.causal, sm_scale=o.sm_scale, q_dtype=o.q_dtype, kv_dtype=o.kv_dtype, device=device, tiles=tiles,
        # The interpreter's dot on fp16/bf16 is numpy's (bf16 on raw bits); fp32 inputs need IEEE fp32 (tf32 would
        # miss the 1e-4 tolerance).
        use_fp32_dot=_KERNELS_INTERPRETED or o.q_dtype == torch.float32,
        has_shared=num_nodes > 0, max_block_id=inputs.max_block_id,
        logits_soft_cap=o.logits_soft_cap, window_left=o.window_left, nan_guard=o.nan_guard, rope_dim=o.rope_dim,
        work=work, tree=tree, nodes=nodes,
        **dev,
        counts=dict(num_shared_nodes=num_nodes, num_units=work.num_units, num_merge_rows=work.mrows.shape[0],
                    num_ws_rows=work.num_ws_rows, num_sms=num_sms, sharing_declined=chosen.declined,
                    requests_apart=chosen.apart, **builds, pdl=pdl, pdl_why=pdl_why,
                    **({"mla_form": MLA_FORM} if o.rope_dim else {}), **overlap, **chain),
        workspace=workspace, workspace_step=workspace.step if workspace is not None else -1,
        overlapped=overlap.get("overlapped", False), shared_build=builds["shared_build"],
        chunk_build=builds["chunk_build"], pdl=pdl,
    )


#: Every plan's builds where the portable kernel is asked for (made once: every plan would pay for it).
_PORTABLE_BUILDS = {f"{name}_build{key}": value for name in HOPPER_CLASSES
                    for key, value in zip(("", "_why"), class_build(name, PORTABLE, interpreted=False))}


def _class_builds(o: PlanOptions, tiles: AttentionTiles, device) -> dict:
    """The matrix classes' builds for this plan, ``{"<class>_build": ..., "<class>_build_why": ...}``
    (:func:`prefixattn.autotune.builds.class_build`: the one decision), each read at its launch's tile."""
    requested = requested_build()
    if requested == PORTABLE or o.rope_dim:  # MLA plans run the MLA kernel
        return _PORTABLE_BUILDS
    is_hip, arch = _device_arch(device)
    switches = (("HAS_SOFT_CAP", o.logits_soft_cap > 0), ("HAS_WINDOW", o.window_left >= 0),
                ("USE_NAN_GUARD", o.nan_guard))
    features = tuple(f for f, on in switches if on)
    kv_dtype = None if o.kv_dtype == o.q_dtype else "fp8" if o.kv_dtype.itemsize == 1 else dtype_name(o.kv_dtype)
    builds = {}
    for name in HOPPER_CLASSES:
        launch = tiles.launch_options(K.WORK_CLASSES.index(name))  # 16-bit K/V: no switch narrows its tile
        builds[f"{name}_build"], builds[f"{name}_build_why"] = class_build(
            name, requested, interpreted=_KERNELS_INTERPRETED, is_hip=is_hip, arch=arch, dtype=dtype_name(o.q_dtype),
            kv_dtype=kv_dtype, head_dim=o.head_dim, v_head_dim=o.v_head_dim, block_size=o.block_size,
            block_m=launch["BLOCK_M"], block_n=launch["BLOCK_N"], kv_heads=launch["KV_HEADS"], features=features)
    return builds


#: A plan's PDL choice where it is not asked for (made once: every plan would pay for it).
_PDL_DEFAULT = pdl_choice(False)


def _pdl(o: PlanOptions, device) -> tuple[bool, str]:
    """``(pdl, why)`` of this plan (:func:`prefixattn.autotune.pdl.pdl_choice`: the one decision)."""
    if not requested_pdl():
        return _PDL_DEFAULT
    if o.rope_dim:
        return False, "MLA plans run the MLA kernel, whose launches stay in series"
    is_hip, arch = _device_arch(device)
    return pdl_choice(True, is_hip=is_hip, arch=arch, interpreted=_KERNELS_INTERPRETED)


@functools.cache
def _device_arch(device: torch.device) -> tuple[bool, object]:
    """``(is_hip, arch)`` of the plan's device: compute capability as an int (``90``) or the gfx ISA; ``(False,
    None)`` off a GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, None
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        return True, props.gcnArchName.split(":")[0]
    return False, props.major * 10 + props.minor


def compile_planner() -> dict:
    """Compile (or load from numba's cache) every variant of the compiled back-end's stages that plan() uses: int32
    and int64 block tables, int32 and int64 ``qo_indptr``/``kv_lens`` pairs, sharing and not. Returns seconds per
    step (``import``: numba and the compiled modules, ``plans``: compile or cache load of every variant, and the
    plans themselves); ``{}`` without numba."""
    from prefixattn.planner import compiled

    t0 = time.perf_counter()
    if compiled.backend(strict=True) is None:
        return {}
    t1 = time.perf_counter()
    with using("numba"):
        for dtype, index_dtype in itertools.product((torch.int32, torch.int64), repeat=2):
            table = torch.tensor([[0, 1, 2], [0, 1, 3], [4, 5, 6]], dtype=dtype)
            clear_tree_cache()
            for sharing in ("auto", "auto", "never"):  # the second plan reuses the tree: the cache's check
                plan(torch.tensor([0, 1, 2, 3], dtype=index_dtype), torch.tensor([40, 40, 40], dtype=index_dtype),
                     table, block_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64, sharing=sharing,
                     device="cpu")
    clear_tree_cache()
    return {"import": t1 - t0, "plans": time.perf_counter() - t1}
