"""The compiled (numba) back-end of the planner: each stage of :mod:`prefixattn.planner.backend` in one compiled
call, one file per numpy stage it mirrors (same names): :mod:`~prefixattn.planner.compiled.checks`,
:mod:`~prefixattn.planner.compiled.tree`, :mod:`~prefixattn.planner.compiled.node_choice`,
:mod:`~prefixattn.planner.compiled.split_rule`, :mod:`~prefixattn.planner.compiled.work_list` and
:mod:`~prefixattn.planner.compiled.device_tables` (the block table's staging). This file is the Python side: it
imports numba only when the back-end is asked for, packs the stages' arguments and turns their results into the
planner's objects (:class:`~prefixattn.planner.checks.Inputs`, :class:`~prefixattn.lcp_tree.LcpTree`,
:class:`~prefixattn.planner.work_list.SharedNodes`, :class:`~prefixattn.planner.split_rule.Split`,
:class:`~prefixattn.planner.work_list.WorkList`).

numba is an optional dependency (``pip install prefixattn[fast]``). The compiled functions are cached on disk
(``cache=True``): the first process compiles them (:func:`prefixattn.planner.plans.compile_planner`, also run by
``prefixattn warmup``), later processes load them. numba's cache keys a function on its own file alone, so a file
whose compiled functions call another file's pins that file by its source hash (:func:`source_hash`; the tests fail
until each pin matches): the tree pins the checks (their row primitives), the node choice the cost rule, the work
list the split rule.

What stays in numpy on this back-end: the argument checks (types, shapes, options; on a failed value check the numpy
checks run and raise their message), the sliding-window stage (:mod:`prefixattn.planner.window`) and a block table
that is not C-contiguous, which is copied first (one compiled variant per table dtype, int32 and int64).
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import numpy as np

# Module-level imports (none of these imports the planner's pipeline): an import statement inside a per-step function
# costs ~1-2 us per call.
from prefixattn.lcp_tree import LcpTree, compiled_cache, keep_compiled_tree, set_cached_blocks
from prefixattn.planner.checks import Inputs
from prefixattn.planner.options import SHARING_APART
from prefixattn.planner.split_rule import NodeRows, Split, SplitPieces, Tiles
from prefixattn.planner.window import windowed
from prefixattn.planner.work_list import SharedNodes, WorkList
from prefixattn.validation import check_host_metadata, host_metadata_arrays


def source_hash(module) -> str:
    """What a pin holds for ``module``: the first 16 hex digits of the sha256 of its file (line endings normalized)."""
    return hashlib.sha256(Path(module.__file__).read_bytes().replace(b"\r\n", b"\n")).hexdigest()[:16]


class CompileFailed(Exception):
    """A compiled stage failed to compile under ``PREFIXATTN_PLANNER=auto`` (numba's error is its ``__cause__``): the
    process plans in numpy from now on (:func:`prefixattn.planner.backend.fall_back_to_numpy`); the caller plans the
    step again there."""


def backend(*, strict: bool):
    """The compiled back-end, or None when numba cannot be imported (``strict``: a compile error is raised, not
    turned into :class:`CompileFailed`)."""
    try:
        from numba.core.errors import NumbaError

        from prefixattn.planner.compiled import checks, device_tables, node_choice, split_rule, tree, work_list
    except ImportError:
        return None
    return CompiledBackend((checks, tree, node_choice, split_rule, work_list, device_tables), NumbaError, strict)


_SHARING_CODES = {"auto": 0, "always": 1, "never": 2, SHARING_APART: 3}
_NO_CACHE = {np.dtype(np.int32): np.zeros((0, 0), dtype=np.int32), np.dtype(np.int64): np.zeros((0, 0), dtype=np.int64)}
_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_NO_NODES = np.zeros(0, dtype=np.int64)
_NO_NODES.setflags(write=False)  # as every compiled tree's arrays (one array type for the compiled planner)
_NO_DEST = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64))


class _TreeHints:
    """What the compiled checks hand the compiled tree: the cache entry they compared (or None) and its buffer for
    the next rows (``keep``: :func:`prefixattn.lcp_tree.compiled_cache`), whether its rows still match, its table's
    dtype was the batch's, the shareable blocks per request and the LCP hints."""

    __slots__ = ("entry", "keep", "same_rows", "use_cache", "sh_blocks", "prev_lcp")

    def __init__(self, entry, keep, same_rows, use_cache, sh_blocks, prev_lcp):
        self.entry, self.keep, self.same_rows, self.use_cache = entry, keep, same_rows, use_cache
        self.sh_blocks, self.prev_lcp = sh_blocks, prev_lcp


class CompiledBackend:
    """The compiled stages (module docstring); the same methods and results as
    :class:`prefixattn.planner.backend.NumpyBackend`."""

    name = "numba"

    def __init__(self, modules: tuple, numba_error: type, strict: bool) -> None:
        self.checks, self.tree_mod, self.node_choice, self.split_rule, self.work, self.device = modules
        self._error, self._strict = numba_error, strict
        self._lay, self._rule = self.work.layout_args(), self.split_rule.rule_args()
        self._costs: dict = {}  # ProgramCost tuples (by identity, holding them) -> their float64 array
        #: the work list's ``dest_lay`` per workspace (weak keys: a dropped wrapper's buffers are freed), and the last
        #: one read (a weak reference and its layout: one call where the dictionary's lookup cost ~1.5 us a step)
        self._dest_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_dest = (lambda: None, None)

    def _failed(self, error: Exception):
        """A numba compile error (an incompatible numba or numpy): raised under ``PREFIXATTN_PLANNER=numba``, else
        :class:`CompileFailed` (the pipeline switches the process to numpy, warned, and plans the step there)."""
        if self._strict:
            raise error
        raise CompileFailed from error

    # ---- stage 1: checks
    def check(self, qo_indptr, kv_lens, block_table, *, block_size: int, num_blocks: int | None, causal: bool,
              sharing: str) -> Inputs:
        """:func:`prefixattn.planner.checks.check_inputs` (its messages: the numpy checks run when the compiled ones
        refuse); ``indptr`` and ``lens`` int32 when both came so (the compiled stages have variants for both)."""
        indptr, lens, table = host_metadata_arrays(qo_indptr, kv_lens, block_table, block_size=block_size,
                                                   num_blocks=num_blocks, table_as_is=True, index_as_is=True)
        if not table.flags.c_contiguous:  # a column slice of an engine's table: one copy, not a new compiled variant
            table = np.ascontiguousarray(table)
        entry, keep = compiled_cache(table.dtype)
        # Same dtype only (another would compile another variant); the compiled check compares the row counts.
        use_cache = entry is not None and entry[0].dtype == table.dtype
        try:
            ok, max_id, q_len, shareable, sh_blocks, max_q_len, width, same_rows, prev_lcp = self.checks.check_values(
                indptr, lens, table, block_size, _block_shift(block_size),
                -1 if num_blocks is None else int(num_blocks), causal, sharing == "never",
                entry[0] if use_cache else _NO_CACHE[table.dtype], entry[1] if use_cache else _NO_BLOCKS,
                entry[3] if use_cache else -1)
        except self._error as e:
            self._failed(e)
        if not ok:
            check_host_metadata(qo_indptr, kv_lens, block_table, block_size=block_size, num_blocks=num_blocks,
                                table_as_is=True)  # raises the message
            raise AssertionError("the compiled metadata checks refused a batch the numpy checks accept")
        return Inputs(indptr=indptr, lens=lens, table=table, max_block_id=max_id, q_len=q_len, shareable=shareable,
                      max_q_len=max_q_len, width=width,
                      tree_hints=_TreeHints(entry, keep, same_rows, use_cache, sh_blocks, prev_lcp))

    # ---- stage 2: the block prefix tree (and its cache)
    def tree(self, inputs: Inputs, *, block_size: int, sharing: str) -> LcpTree:
        h = inputs.tree_hints
        entry, keep, use = h.entry, h.keep, h.use_cache
        try:
            tree_width, status, packed, kept, entry_max = self.tree_mod.block_tree(
                inputs.table, h.sh_blocks, h.prev_lcp, h.same_rows, entry[0] if use else _NO_CACHE[inputs.table.dtype],
                entry[1] if use else _NO_BLOCKS, entry[3] if use else -1, entry[2].order if use else _NO_NODES,
                entry[2].lcp if use else _NO_NODES, use, keep)
        except self._error as e:
            self._failed(e)
        if status == 1 or status == 3:  # the cached tree: the same shareable rows as its step, or grown past every LCP
            tree = entry[2]
        else:
            # Read-only, as every tree the compiled planner gets (one array type); the tree's arrays are views of it.
            packed.setflags(write=False)
            tree = _unpack_tree(packed, inputs.lens.shape[0])
        if kept:  # a new tree with nodes, or the cached one grown past its rows' width: the call copied the rows
            keep_compiled_tree(keep[:h.sh_blocks.shape[0] * tree_width].reshape(-1, tree_width), h.sh_blocks, tree,
                               entry_max)
        elif status == 3:  # the cached rows hold the grown ids: the entry takes the new block counts
            set_cached_blocks(h.sh_blocks, entry_max)
        return tree

    # ---- stage 3: the node choice
    def nodes(self, tree: LcpTree, inputs: Inputs, o, tiles, *, sharing: str) -> tuple[SharedNodes, np.ndarray]:
        rows = tiles.tile_rows(o.group)
        try:
            kv_start, kv_end, depth_blocks, offsets, members, suffix_start = self.node_choice.select_nodes(
                tree.order, tree.depth, tree.lb, tree.rb, tree.parent, inputs.shareable, inputs.q_len, o.block_size,
                rows.rows_per_shared_tile, o.group, o.head_dim, o.kv_dtype.itemsize, _SHARING_CODES[sharing],
                rows.rows_per_chunk_tile, rows.decode_class_rows)
        except self._error as e:
            self._failed(e)
        nodes = SharedNodes(kv_start=kv_start, kv_end=kv_end, depth_blocks=depth_blocks, offsets=offsets,
                            members=members)
        return windowed(nodes, suffix_start, inputs, o)

    # ---- stage 4: the split rule (per candidate)
    def split(self, nodes: SharedNodes, suffix_start: np.ndarray, inputs: Inputs, o, tiles, *, num_sms: int,
              costs: tuple) -> Split:
        t = tiles.tile_rows(o.group).split_args
        try:
            packed, node_split, scalars, modeled = self.split_rule.split_work(
                nodes.kv_start, nodes.kv_end, nodes.offsets, nodes.members, suffix_start, inputs.indptr[:-1],
                inputs.q_len, inputs.lens, o.causal, t["rows_per_shared"], t["rows_per_chunk"], t["rows_per_decode"],
                t["block_n_shared"], t["block_n_chunk"], t["block_n_decode"], o.num_kv_heads, num_sms,
                o.min_split_tokens, self._cost_args(costs), self._rule)
        except self._error as e:
            self._failed(e)
        n, grain_sh, grain_ch, grain_de, end_sh, end_ch, end_de, saved = scalars.tolist()  # S_* order
        num_requests = inputs.lens.shape[0]
        return Split(shared_grain=grain_sh, tile_grains=(grain_ch, grain_de), modeled=modeled,
                     class_ends=(end_sh, end_ch, end_de), reads_saved=saved, packed=(packed, node_split, scalars),
                     pieces_of=lambda: self._pieces(packed, node_split, n, num_requests))

    def _pieces(self, packed: np.ndarray, node_split: np.ndarray, n: int, num_requests: int) -> SplitPieces:
        """The :class:`SplitPieces` of the compiled split's packed arrays (``n`` tiles): views, built only when read
        (the compiled work list reads the packed arrays; 9 slices and the NodeRows cost ~4 us a step)."""
        s = self.split_rule
        tile = Tiles(req=packed[s.T_REQ, :n], first=packed[s.T_FIRST, :num_requests], row0=0,
                     rows=packed[s.T_ROWS, :n], tok0=packed[s.T_TOK0, :n], lo=packed[s.T_LO, :n],
                     hi=packed[s.T_HI, :n], qpos=packed[s.T_QPOS, :n], decode=packed[s.T_DECODE, :n] != 0)
        return SplitPieces(tiles=tile, rows=NodeRows(node_rows=node_split[s.N_ROWS], node_mtiles=node_split[s.N_MTILES]),
                           node_pieces=node_split[s.N_PIECES], tile_pieces=packed[s.T_PIECES, :n])

    def _cost_args(self, costs: tuple) -> np.ndarray:
        """The work classes' :class:`~prefixattn.autotune.program_cost.ProgramCost` as the split's float64 ``[3,
        NUM_COST]`` argument (``C_*`` columns), memoized by identity (the planner's costs come from a memo)."""
        hit = self._costs.get(id(costs))
        if hit is not None and hit[0] is costs:
            return hit[1]
        s = self.split_rule
        out = np.empty((len(costs), s.NUM_COST), dtype=np.float64)
        for i, c in enumerate(costs):
            out[i, s.C_FIXED_US], out[i, s.C_TILE_US] = c.fixed_us, c.tile_us
            out[i, s.C_SLOTS], out[i, s.C_FIXED_TOKENS] = c.slots_per_sm, c.fixed_tokens
        if len(self._costs) >= _MAX_MEMO:
            self._costs.clear()
        self._costs[id(costs)] = (costs, out)
        return out

    # ---- stage 5: the work list, straight into its staging buffer
    def work_list(self, nodes: SharedNodes, split: Split, inputs: Inputs, o, tiles, *, workspace,
                  width: int) -> tuple[WorkList, object, bool]:
        """``(work list, staged, written)``: with ``workspace`` (``width`` 0: it stages its table itself) the tables
        go straight into its host buffer when the step fits its capacities (``written``); else into one new int32
        buffer with the block table's first ``width`` columns after them when its ids fit int32 (``staged``: the
        buffer and whether the table is in it, as :func:`prefixattn.planner.device_tables.metadata_to_device` reads
        it)."""
        table = inputs.table
        rows, cols = table.shape[0], min(width, table.shape[1])
        dest, dest_lay = self._dest_args(workspace)
        packed, node_split, scalars = split.packed
        tile_rows = tiles.tile_rows(o.group)
        try:
            fits = bool(width) and self.device._table_fits(table, cols)
            flat, items, gather, mrows, num_ws_rows, num_units, in_dest = self.work.work_list(
                self._lay, nodes.kv_start, nodes.kv_end, nodes.offsets, nodes.members, inputs.indptr[:-1],
                inputs.q_len, packed, node_split, scalars, tile_rows.rows_per_shared_tile, tile_rows.rows_per_chunk_tile,
                rows * width if fits else 0, dest, dest_lay)
            if fits:
                self.device.table_into_flat(flat, table, width)
        except self._error as e:
            self._failed(e)
        work = WorkList(items=items, gather=gather, mrows=mrows, num_ws_rows=num_ws_rows, num_units=num_units,
                        class_ends=split.class_ends, modeled_us=split.modeled)
        return work, (None if in_dest else (flat, fits)), in_dest

    def _dest_args(self, workspace) -> tuple:
        """``(dest, dest_lay)`` of the work list: ``workspace``'s host buffer and its sections and capacities
        (``compiled.work_list.D_*``); empty arrays without a workspace."""
        if workspace is None:
            return _NO_DEST
        ref, lay = self._last_dest
        if ref() is workspace:
            return workspace.host_buffer(), lay
        lay = self._dest_layouts.get(workspace)
        w = self.work
        if lay is None:
            c, lay = workspace.capacity, np.empty(w.NUM_DEST_FIELDS, dtype=np.int64)
            for index, name in ((w.D_RANGES, "ranges"), (w.D_ITEMS, "items"), (w.D_GATHER, "gather"),
                                (w.D_MROWS, "mrows")):
                lay[index] = workspace.section_start(name)
            # The capacities PlanWorkspace.overflow checks but the table's width (a step over it is refused after the
            # write: PlanWorkspace.refused_after_writing).
            lay[w.D_MAX_ITEMS], lay[w.D_MAX_GATHER] = c.max_items, c.max_gather_rows
            lay[w.D_MAX_MROWS], lay[w.D_MAX_WS_ROWS] = c.max_merge_rows, c.max_ws_rows
            lay[w.D_MAX_TOKENS], lay[w.D_MAX_REQUESTS] = c.max_tokens, c.max_requests
            self._dest_layouts[workspace] = lay
        self._last_dest = (weakref.ref(workspace), lay)
        return workspace.host_buffer(), lay

    # ---- the device tables' staging of the block table
    def stage_table(self, stage: np.ndarray, table: np.ndarray, num_requests: int, width: int,
                    max_block_id: int) -> bool:
        """The used columns of the checked table into a workspace's int32 host table, when they fit (else False: the
        workspace copies or refuses it)."""
        try:
            return bool(self.device.stage_table(stage, table, num_requests, width, max_block_id))
        except self._error as e:
            self._failed(e)


_MAX_MEMO = 256


def _block_shift(block_size: int) -> int:
    """``log2(block_size)`` for a power of two, else -1."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1


def _unpack_tree(packed: np.ndarray, n: int) -> LcpTree:
    """The :class:`LcpTree` of the compiled tree's packed array (views). Slices written out, and no node slices for a
    tree without nodes (every step of a batch without sharing): 2.6 -> 1.1 us on the 2-core host."""
    m = (packed.shape[0] - 2 * n) // 4
    if m == 0:
        return LcpTree(packed[:n], packed[n:], _NO_NODES, _NO_NODES, _NO_NODES, _NO_NODES)
    o = 2 * n
    return LcpTree(packed[:n], packed[n:o], packed[o:o + m], packed[o + m:o + 2 * m], packed[o + 2 * m:o + 3 * m],
                   packed[o + 3 * m:])
