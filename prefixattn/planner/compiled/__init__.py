"""The compiled (numba) back-end of the planner: each stage of :mod:`prefixattn.planner.backend` in one compiled
call, one file per numpy stage it mirrors (same names): :mod:`~prefixattn.planner.compiled.checks`,
:mod:`~prefixattn.planner.compiled.tree`, :mod:`~prefixattn.planner.compiled.node_choice`,
:mod:`~prefixattn.planner.compiled.split_rule`, :mod:`~prefixattn.planner.compiled.work_list` and
:mod:`~prefixattn.planner.compiled.device_tables` (the block table's staging). Each file ends with
its stage's Python side (``check``, ``tree``, ``nodes``, ``split``, ``work_list``): it packs the compiled call's
arguments and turns its results into the planner's objects (:class:`~prefixattn.planner.checks.Inputs`,
:class:`~prefixattn.lcp_tree.LcpTree`, :class:`~prefixattn.planner.work_list.SharedNodes`,
:class:`~prefixattn.planner.split_rule.Split`, :class:`~prefixattn.planner.work_list.WorkList`), so a step enters
each file once. This file imports numba only when the back-end is asked for (:func:`backend`).

numba is an optional dependency (``pip install prefixattn[fast]``). The compiled functions are cached on disk
(``cache=True``): the first process compiles them (:func:`prefixattn.planner.plans.compile_planner`, also run by
``prefixattn warmup``), later processes load them. numba's cache keys a function on its own file alone, so a file
whose compiled functions call another file's pins that file by its source hash (:func:`source_hash`; the tests fail
until each pin matches): the tree pins the checks (their row primitives), the node choice the cost rule, the work
list the split rule. A pin holds the whole file, its stage's Python side included.

What stays in numpy on this back-end: the argument checks (types, shapes, options; on a failed value check the numpy
checks run and raise their message), the sliding-window stage (:mod:`prefixattn.planner.window`) and a block table
that is not C-contiguous, which is copied first (one compiled variant per table dtype, int32 and int64).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def source_hash(module) -> str:
    """What a pin holds for ``module``: the first 16 hex digits of the sha256 of its file (line endings normalized)."""
    return hashlib.sha256(Path(module.__file__).read_bytes().replace(b"\r\n", b"\n")).hexdigest()[:16]


def backend(*, strict: bool):
    """The compiled back-end, or None when numba cannot be imported (``strict``: a compile error is raised, not
    answered by the numpy back-end: :func:`prefixattn.planner.plans.plan_with_options`)."""
    try:
        from numba.core.errors import NumbaError

        from prefixattn.planner.compiled import checks, device_tables, node_choice, split_rule, tree, work_list
    except ImportError:
        return None
    return CompiledBackend((checks, tree, node_choice, split_rule, work_list, device_tables), NumbaError, strict)


class CompiledBackend:
    """The compiled stages (module docstring): the same stages and results as
    :class:`prefixattn.planner.backend.NumpyBackend`, each attribute the stage's function in its own file.
    ``compile_errors``: what a stage raises when numba fails to compile it (an incompatible numba or numpy);
    ``strict``: such an error is raised (``PREFIXATTN_PLANNER=numba``), else the process plans in numpy from then
    on (``auto``: :func:`prefixattn.planner.backend.fall_back_to_numpy`)."""

    name = "numba"

    def __init__(self, modules: tuple, numba_error: type, strict: bool) -> None:
        checks, tree, node_choice, split_rule, work_list, device_tables = modules
        self.check, self.tree, self.nodes = checks.check, tree.tree, node_choice.nodes
        self.split, self.work_list, self.stage_table = split_rule.split, work_list.work_list, device_tables.stage_table
        self.compile_errors, self.strict = (numba_error,), strict
