"""The planner's back-end: who computes each stage of :func:`prefixattn.plan`, chosen once per process.

A back-end has one callable per stage (:mod:`prefixattn.planner.plans` calls each once a step, in this order):
``check`` (:mod:`~prefixattn.planner.checks`), ``tree`` (:mod:`~prefixattn.planner.tree`), ``nodes``
(:mod:`~prefixattn.planner.node_choice`, then :mod:`~prefixattn.planner.window` under a sliding window), ``split``
(:mod:`~prefixattn.planner.split_rule`; called per candidate by :mod:`~prefixattn.planner.choose`), ``work_list``
(:mod:`~prefixattn.planner.work_list`) and ``stage_table`` (the block table into a workspace's host buffer), and
``compile_errors``, what its stages raise when they cannot be compiled (``strict``: raised, not answered by planning
in numpy). Two back-ends compute the same results:

* numpy (:class:`NumpyBackend`): runs everywhere, the definition the other is tested against;
* compiled (:class:`prefixattn.planner.compiled.CompiledBackend`): numba, optional (``pip install
  prefixattn[fast]``), a few compiled calls per step instead of a few hundred numpy calls; the numpy window stage
  between its node choice and its split.

``PREFIXATTN_PLANNER`` picks one when the first plan of the process asks (:func:`backend`): ``auto`` (default:
compiled when numba imports, else numpy), ``numba``, ``numpy``. Under ``auto`` a numba compile error (an
incompatible numba or numpy) switches the process to numpy with a warning and the step is planned again there; under
``numba`` it is raised. :func:`using` switches it for a block (tests compare the two).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np

from prefixattn.planner.checks import Inputs, check_inputs
from prefixattn.planner.node_choice import select_shared_nodes
from prefixattn.planner.split_rule import Split, split_work
from prefixattn.planner.tree import block_tree
from prefixattn.planner.window import windowed
from prefixattn.planner.work_list import SharedNodes, WorkList, build_work_list, prefix_runs

ENV_VAR = "PREFIXATTN_PLANNER"
PLANNERS = ("auto", "numba", "numpy")


class NumpyBackend:
    """The numpy stages (module docstring)."""

    name = "numpy"
    compile_errors = ()  # nothing to compile
    strict = True

    def check(self, qo_indptr, kv_lens, block_table, *, block_size: int, num_blocks: int | None, causal: bool,
              sharing: str) -> Inputs:
        return check_inputs(qo_indptr, kv_lens, block_table, block_size=block_size, num_blocks=num_blocks,
                            causal=causal)

    def tree(self, inputs: Inputs, *, block_size: int, sharing: str):
        return block_tree(inputs, block_size=block_size, sharing=sharing)

    def nodes(self, tree, inputs: Inputs, o, tiles, *, sharing: str) -> tuple[SharedNodes, np.ndarray]:
        nodes, suffix_start = select_shared_nodes(
            tree, shareable=inputs.shareable, q_len=inputs.q_len, block_size=o.block_size, group=o.group,
            head_dim=o.cost_head_dim, elt_bytes=o.kv_dtype.itemsize, sharing=sharing,
            **tiles.tile_rows(o.group).rule_args)
        return windowed(nodes, suffix_start, inputs, o)

    def split(self, nodes: SharedNodes, suffix_start: np.ndarray, inputs: Inputs, o, tiles, *, num_sms: int,
              costs: tuple) -> Split:
        return split_work(nodes, suffix_start, q_start=inputs.indptr[:-1], q_len=inputs.q_len, kv_len=inputs.lens,
                          causal=o.causal, num_sms=num_sms, min_split_tokens=o.min_split_tokens,
                          num_kv_heads=o.num_kv_heads, costs=costs, **tiles.tile_rows(o.group).split_args)

    def work_list(self, nodes: SharedNodes, split: Split, inputs: Inputs, o, tiles, *, workspace,
                  width: int) -> tuple[WorkList, object, bool]:
        """``(work list, staged, written)``: numpy builds the tables; the device-table stage copies them (nothing
        staged, nothing written into ``workspace``)."""
        rows = tiles.tile_rows(o.group)
        work = build_work_list(nodes, split, q_start=inputs.indptr[:-1], q_len=inputs.q_len,
                               rows_per_shared=rows.rows_per_shared_tile, rows_per_chunk=rows.rows_per_chunk_tile,
                               runs=prefix_runs(inputs.table, inputs.lens, nodes.members, o.block_size))
        return work, None, False

    def stage_table(self, stage: np.ndarray, table: np.ndarray, num_requests: int, width: int,
                    max_block_id: int) -> bool:
        """The numpy back-end leaves the table to the workspace's own copy (``PlanWorkspace.load``)."""
        return False


NUMPY = NumpyBackend()
_chosen: list = []  # [backend] once chosen


def backend():
    """The process's back-end (module docstring): chosen at the first call from ``PREFIXATTN_PLANNER``."""
    if not _chosen:
        _chosen.append(_from_env())
    return _chosen[0]


def _from_env():
    from prefixattn.planner import compiled

    choice = os.environ.get(ENV_VAR, "auto")
    if choice not in PLANNERS:
        raise ValueError(f"{ENV_VAR}: expected one of {PLANNERS}, got {choice!r}")
    if choice == "numpy":
        return NUMPY
    made = compiled.backend(strict=choice == "numba")
    if made is None:
        if choice == "numba":
            raise ValueError(f"{ENV_VAR}: expected numba to be importable for 'numba' (pip install "
                             f"prefixattn[fast]), got no numba")
        return NUMPY
    return made


def fall_back_to_numpy(error: BaseException) -> None:
    """The compiled back-end failed to compile under ``auto`` (``error``: numba's): numpy from now on, in this
    process, with a warning."""
    _chosen[:] = [NUMPY]
    warnings.warn(f"prefixattn: the compiled planner failed to compile ({type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}); plan() uses the numpy planner "
                  f"(same results; {ENV_VAR}=numpy skips numba)", RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def using(name: str):
    """Plan with the back-end ``name`` (one of :data:`PLANNERS`, as ``PREFIXATTN_PLANNER`` takes it) inside the
    block, then with the process's again."""
    before = list(_chosen)
    saved = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = name
    try:
        _chosen[:] = [_from_env()]
        yield _chosen[0]
    finally:
        if saved is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved
        _chosen[:] = before


def planner_name() -> str:
    """``"numba"`` or ``"numpy"``: the back-end :func:`backend` plans with."""
    return backend().name
