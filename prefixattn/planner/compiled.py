"""Which planner runs plan(): the compiled one (numba, optional) or the numpy reference.

``PREFIXATTN_PLANNER`` picks it, read at every :func:`prefixattn.plan` call (a
:class:`~prefixattn.PrefixSharedAttention` reads it when it checks its options, at its first plan without
overrides, and keeps the choice):

* ``auto`` (default): numba when it can be imported, else numpy;
* ``numba``: the compiled planner (``ValueError`` at plan() time when numba is missing);
* ``numpy``: the numpy planner, the reference the compiled one is tested against (``tests/test_plan_native.py``:
  equal Plan fields on the golden cases and on random batches).

numba is an optional dependency (``pip install prefixattn[fast]``): plan() runs everywhere without it, at numpy's
per-call overhead (~0.5-1 us per numpy call, a few hundred calls per plan). The compiled functions are cached on disk
(``cache=True``): the first process compiles them (:func:`prefixattn.planner.plans.compile_planner`, also run by
``prefixattn warmup``), later processes load them.

Per plan() the compiled path makes two compiled calls: the metadata value checks, per-request lengths and the block
prefix tree or the tree cache's check (:mod:`prefixattn.planner.compiled_tree`; on a failed check the numpy checks
run and raise their ``ValueError``), then node choice + split rule + work list + staging buffer
(:mod:`prefixattn.planner.compiled_core`, the split rule in :mod:`prefixattn.planner.compiled_split`). What stays in
Python/numpy on that path:

* ``window_left >= 0``: the node choice, :mod:`prefixattn.planner.window` and the work list run in numpy (the tree is
  still compiled);
* argument checks (types, shapes, options), the tile choice, the device tensors and the :class:`Plan` object;
* with a ``workspace``: :meth:`prefixattn.planner.workspace.PlanWorkspace.load` copies the compiled tables (numpy);
* a block table that is not C-contiguous is copied first (one compiled variant per table dtype, int32 and int64).
"""

from __future__ import annotations

import os
import warnings
import weakref

import numpy as np

# Module-level imports (none of these imports the planner): an import statement inside a per-step function costs
# ~1-2 us per call.
from prefixattn.lcp_tree import LcpTree, compiled_cache, keep_compiled_tree, set_cached_blocks
from prefixattn.validation import check_host_metadata, host_metadata_arrays
from prefixattn.planner.options import SHARING_APART
from prefixattn.planner.work_list import SharedNodes, WorkList

ENV_VAR = "PREFIXATTN_PLANNER"
PLANNERS = ("auto", "numba", "numpy")

_numba_error: type = Exception  # numba.core.errors.NumbaError once numba is imported
_modules = None  # (tree, core, split) modules once imported; False when numba cannot be imported


def _load():
    global _modules
    if _modules is None:
        try:
            from numba.core.errors import NumbaError

            from prefixattn.planner import compiled_core, compiled_split, compiled_tree
        except ImportError:
            _modules = False
        else:
            global _numba_error
            _numba_error = NumbaError
            _modules = (compiled_tree, compiled_core, compiled_split)
    return _modules


def _compile_failed(error: Exception) -> None:
    """What a numba compile error (an incompatible numba or numpy) in a compiled call means: raised again, except
    under ``PREFIXATTN_PLANNER=auto``, which switches this process to the numpy planner with a warning and returns
    None (the callers then plan in numpy: the same results). The calls catch it themselves (a wrapper around them
    cost ~0.3 us a call)."""
    if os.environ.get(ENV_VAR, "auto") != "auto":
        raise error
    global _modules
    _modules = False
    warnings.warn(f"prefixattn: the compiled planner failed to compile ({type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}); plan() uses the numpy planner "
                  f"(same results; {ENV_VAR}=numpy skips numba)", RuntimeWarning, stacklevel=3)
    return None


def numba_available() -> bool:
    """numba can be imported (the compiled planner can run)."""
    return bool(_load())


def planner_name(choice: str | None = None) -> str:
    """``"numba"`` or ``"numpy"``: the planner plan() uses under ``choice`` (default: ``$PREFIXATTN_PLANNER``)."""
    choice = os.environ.get(ENV_VAR, "auto") if choice is None else choice
    if choice == "auto":
        return "numba" if _load() else "numpy"
    if choice == "numpy":
        return "numpy"
    if choice == "numba":
        if not _load():
            raise ValueError(f"{ENV_VAR}: expected numba to be importable for '{choice}' (pip install "
                             f"prefixattn[fast]), got no numba")
        return "numba"
    raise ValueError(f"{ENV_VAR}: expected one of {PLANNERS}, got {choice!r}")


def compiled_modules():
    """``(tree, core, split)`` modules when the numba planner is chosen, else None."""
    return _load() if planner_name() == "numba" else None


def still_compiled(modules):
    """``modules``, or None once a compile error switched this process to the numpy planner (:func:`_compile_failed`):
    plan() reads the planner choice once and asks this between its two compiled calls."""
    return modules if _modules else None


_SHARING_CODES = {"auto": 0, "always": 1, "never": 2, SHARING_APART: 3}
_constants: list = []


def _constant_args(modules) -> tuple:
    if not _constants:
        _constants.append((modules[1].layout_args(), modules[2].rule_args()))
    return _constants[0]


_NO_CACHE = {np.dtype(np.int32): np.zeros((0, 0), dtype=np.int32), np.dtype(np.int64): np.zeros((0, 0), dtype=np.int64)}
_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_NO_STAGE = np.zeros((0, 0), dtype=np.int32)


def check_and_tree(modules, qo_indptr, kv_lens, block_table, *, block_size, num_blocks, causal, sharing,
                   stage=None):
    """:func:`prefixattn.validation.check_host_metadata` (its messages: the numpy checks run when the compiled ones
    fail), the per-request lengths plan() derives and the block prefix tree with its cache
    (:mod:`prefixattn.lcp_tree`), in one compiled call: ``(indptr, lens, table, max_block_id, q_len, shareable,
    max_q_len, width, tree, staged)`` (``indptr`` and ``lens`` int32 when both came so, else int64; the compiled
    calls have variants for both); None when it failed to compile (:func:`_compile_failed`). ``stage``: a
    workspace's host block table (:meth:`prefixattn.planner.workspace.PlanWorkspace.host_table`), which gets the used
    columns of a valid batch's table when they fit (``staged``; the same cells ``PlanWorkspace.load`` would stage)."""
    # qo_indptr and kv_lens as they are when they share a dtype (the compiled calls have int32 and int64 variants)
    indptr, lens, table = host_metadata_arrays(qo_indptr, kv_lens, block_table, block_size=block_size,
                                               num_blocks=num_blocks, table_as_is=True, index_as_is=True)
    if not table.flags.c_contiguous:  # a column slice of an engine's table: one copy, not a new compiled variant
        table = np.ascontiguousarray(table)
    last, keep = compiled_cache(table.dtype)  # keep: where the call copies a new tree's rows
    # Same dtype only (another would compile another variant); the compiled check compares the row counts.
    use_cache = last is not None and last[0].dtype == table.dtype
    try:
        out = modules[0].check_and_tree(indptr, lens, table, block_size, _block_shift(block_size),
                                        -1 if num_blocks is None else int(num_blocks), causal, sharing == "never",
                                        last[0] if use_cache else _NO_CACHE[table.dtype],
                                        last[1] if use_cache else _NO_BLOCKS, last[3] if use_cache else -1,
                                        last[2].order if use_cache else _NO_NODES,
                                        last[2].lcp if use_cache else _NO_NODES, use_cache,
                                        _NO_STAGE if stage is None else stage, keep)
    except _numba_error as e:
        return _compile_failed(e)
    ok, max_block_id, max_q_len, width, tree_width, status, lengths, packed, staged, kept, entry_max = out
    if not ok:
        check_host_metadata(qo_indptr, kv_lens, block_table, block_size=block_size, num_blocks=num_blocks,
                            table_as_is=True)  # raises the message
        raise AssertionError("the compiled metadata checks refused a batch the numpy checks accept")
    q_len, shareable, sh_blocks = lengths[0], lengths[1], lengths[2]
    if status == 1 or status == 3:  # the cached tree: the same shareable rows as its step, or grown past every LCP
        tree = last[2]
    else:
        # Read-only, as every tree the compiled planner gets (one array type); the tree's arrays are views of it.
        packed.setflags(write=False)
        tree = _unpack_tree(packed, lens.shape[0])
    if kept:  # a new tree with nodes, or the cached one grown past its rows' width: the call copied the rows
        keep_compiled_tree(keep[:sh_blocks.shape[0] * tree_width].reshape(-1, tree_width), sh_blocks, tree,
                           entry_max)
    elif status == 3:  # the cached rows hold the grown ids: the entry takes the new block counts
        set_cached_blocks(sh_blocks, entry_max)
    return indptr, lens, table, max_block_id, q_len, shareable, max_q_len, width, tree, staged


def _block_shift(block_size: int) -> int:
    """``log2(block_size)`` for a power of two, else -1."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1


_NO_NODES = np.zeros(0, dtype=np.int64)
_NO_NODES.setflags(write=False)  # as every compiled tree's arrays (one array type for the compiled planner)


def _unpack_tree(packed: np.ndarray, n: int) -> LcpTree:
    """The :class:`LcpTree` of ``compiled_tree.check_and_tree``'s packed tree (views). Slices written out, and
    no node slices for a tree without nodes (every step of a batch without sharing): 2.6 -> 1.1 us on the 2-core
    host."""
    m = (packed.shape[0] - 2 * n) // 4
    if m == 0:
        return LcpTree(packed[:n], packed[n:], _NO_NODES, _NO_NODES, _NO_NODES, _NO_NODES)
    o = 2 * n
    return LcpTree(packed[:n], packed[n:o], packed[o:o + m], packed[o + m:o + 2 * m], packed[o + 2 * m:o + 3 * m],
                   packed[o + 3 * m:])


def core_params(*, causal, sharing, block_size, group, head_dim, elt_bytes, rows_per_shared, rows_per_chunk,
                rows_per_decode, block_n_shared, block_n_chunk, block_n_decode, num_kv_heads, num_sms,
                min_split_tokens) -> np.ndarray:
    """:func:`plan_tables`' parameter array (``compiled_core.P_*`` order) of one set of options and tiles
    (``elt_bytes``: the KV caches' element size, which the cost rule prices)."""
    return np.array((causal, _SHARING_CODES[sharing], block_size, group, head_dim, elt_bytes, rows_per_shared,
                     rows_per_chunk, rows_per_decode, block_n_shared, block_n_chunk, block_n_decode, num_kv_heads,
                     num_sms, min_split_tokens), dtype=np.int64)


def cost_args(costs) -> np.ndarray | None:
    """The work classes' :class:`~prefixattn.autotune.program_cost.ProgramCost` as :func:`plan_tables`' float64
    ``[NUM_CLASSES, NUM_COST]`` argument (``compiled_split.C_*`` columns); None without numba."""
    modules = _load()
    if not modules:
        return None
    split = modules[2]
    out = np.empty((len(costs), split.NUM_COST), dtype=np.float64)
    for i, c in enumerate(costs):
        out[i, split.C_FIXED_US], out[i, split.C_TILE_US] = c.fixed_us, c.tile_us
        out[i, split.C_SLOTS], out[i, split.C_FIXED_TOKENS] = c.slots_per_sm, c.fixed_tokens
    return out


_NO_DEST = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64))
#: plan_core's ``dest_lay`` per workspace (weak keys: a dropped wrapper's buffers are freed).
_dest_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _dest_args(core, workspace) -> tuple:
    """``(dest, dest_lay)`` of ``plan_core``: ``workspace``'s host buffer and its sections (``compiled_core.D_*``)
    and capacities; empty arrays without a workspace."""
    if workspace is None:
        return _NO_DEST
    lay = _dest_layouts.get(workspace)
    if lay is None:
        c, lay = workspace.capacity, np.empty(core.NUM_DEST_FIELDS, dtype=np.int64)
        for index, name in ((core.D_RANGES, "ranges"), (core.D_ITEMS, "items"), (core.D_GATHER, "gather"),
                            (core.D_MROWS, "mrows")):
            lay[index] = workspace.section_start(name)
        # The capacities PlanWorkspace.overflow checks but the table's width (a step over it is refused after the
        # write: PlanWorkspace.refused_after_writing).
        lay[core.D_MAX_ITEMS], lay[core.D_MAX_GATHER] = c.max_items, c.max_gather_rows
        lay[core.D_MAX_MROWS], lay[core.D_MAX_WS_ROWS] = c.max_merge_rows, c.max_ws_rows
        lay[core.D_MAX_TOKENS], lay[core.D_MAX_REQUESTS] = c.max_tokens, c.max_requests
        _dest_layouts[workspace] = lay
    return workspace.host_buffer(), lay


def plan_tables(modules, tree, params, costs, *, indptr, q_len, kv_len, shareable, table, width, workspace=None):
    """:func:`prefixattn.planner.node_choice.select_shared_nodes`, :func:`prefixattn.planner.work_list.build_work_list`
    and the staging buffer in one compiled call: ``(SharedNodes, WorkList, flat, table_fits, in_workspace)`` (None when
    it failed to compile, :func:`_compile_failed`); ``params`` from :func:`core_params`, ``costs`` from
    :func:`cost_args`, ``flat`` is
    :func:`prefixattn.planner.device_tables.metadata_to_device`'s host buffer (the table's used columns last when they
    fit int32). With ``workspace`` (and ``width`` 0) the work list is written into its host buffer instead when it fits
    the capacities (``in_workspace``; the WorkList's arrays are then views of that buffer).
    """
    core = modules[1]
    lay, rule = _constant_args(modules)
    dest, dest_lay = _dest_args(core, workspace)
    try:
        out = core.plan_core(lay, rule, costs, params, width, tree.order, tree.depth, tree.lb, tree.rb, tree.parent,
                             indptr, q_len, kv_len, shareable, table, dest, dest_lay)
    except _numba_error as e:
        return _compile_failed(e)
    (kv_start, kv_end, depth_blocks, offsets, members, flat, items, gather, mrows, fits, num_ws_rows, num_units,
     class_ends, modeled, in_dest) = out
    nodes = SharedNodes(kv_start=kv_start, kv_end=kv_end, depth_blocks=depth_blocks, offsets=offsets,
                        members=members)
    work = WorkList(items=items, gather=gather, mrows=mrows, num_ws_rows=num_ws_rows, num_units=num_units,
                    class_ends=tuple(class_ends.tolist()), modeled_us=modeled)
    return nodes, work, flat, fits, in_dest
