"""Which planner runs plan(): the compiled one (numba, optional) or the numpy reference.

``PREFIXATTN_PLANNER`` picks it, read at every :func:`prefixattn.plan` call:

* ``auto`` (default): numba when it can be imported, else numpy;
* ``numba``: the compiled planner (``ValueError`` at plan() time when numba is missing);
* ``numpy``: the numpy planner, the reference the compiled one is tested against (``tests/test_plan_native.py``:
  equal Plan fields on the golden cases and on random batches).

numba is an optional dependency (``pip install prefixattn[fast]``): plan() runs everywhere without it, at numpy's
per-call overhead (~0.5-1 us per numpy call, a few hundred calls per plan). The compiled functions are cached on disk
(``cache=True``): the first process compiles them (:func:`compile_planner`, also run by ``prefixattn warmup``), later
processes load them.

What the compiled path covers is listed in :mod:`prefixattn.plan_native_core`; everything else runs in numpy.
"""

from __future__ import annotations

import os
import time

ENV_VAR = "PREFIXATTN_PLANNER"
PLANNERS = ("auto", "numba", "numpy")

_modules = None  # (tree module, core module) once imported; False when numba cannot be imported


def _load():
    global _modules
    if _modules is None:
        try:
            from prefixattn import plan_native_core, plan_native_tree
        except ImportError:
            _modules = False
        else:
            _modules = (plan_native_tree, plan_native_core)
    return _modules


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
    """``(tree module, core module)`` when the numba planner is chosen, else None."""
    return _load() if planner_name() == "numba" else None


_SHARING_CODES = {"auto": 0, "always": 1, "never": 2}
_args_cache: list = []


def _constant_args(core) -> tuple:
    if not _args_cache:
        _args_cache.append((core.layout_args(), *core.rule_args()))
    return _args_cache[0]


def plan_tables(core, tree, *, q_start, q_len, kv_len, shareable, causal, sharing, block_size, group, head_dim,
                elt_bytes, rows_per_shared, rows_per_suffix, block_n_shared, block_n_suffix, num_kv_heads, num_sms,
                min_split_tokens):
    """:func:`prefixattn.planner.select_shared_nodes` then :func:`prefixattn.work_list.build_work_list` in one
    compiled call: ``(SharedNodes, WorkList, critical_path)``."""
    from prefixattn.work_list import SharedNodes, WorkList

    lay, rule, state_bytes = _constant_args(core)
    (kv_start, kv_end, depth_blocks, offsets, members, items, gather, mrows, num_ws_rows, num_units,
     crit) = core.plan_core(lay, rule, state_bytes, tree.order, tree.depth, tree.lb, tree.rb, tree.parent, q_start,
                            q_len, kv_len, shareable, causal, _SHARING_CODES[sharing], block_size, group, head_dim,
                            elt_bytes, rows_per_shared, rows_per_suffix, block_n_shared, block_n_suffix,
                            num_kv_heads, num_sms, min_split_tokens)
    nodes = SharedNodes(kv_start=kv_start, kv_end=kv_end, depth_blocks=depth_blocks, offsets=offsets,
                        members=members)
    work = WorkList(items=items, gather=gather, mrows=mrows, num_ws_rows=num_ws_rows, num_units=num_units)
    return nodes, work, crit
