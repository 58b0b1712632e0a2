"""The host planner: from one engine step's metadata to the kernel's work tables.

The public names are ``prefixattn.plan``, ``prefixattn.Plan`` and ``prefixattn.CapacityError``. This file imports
nothing, so that the simulator can import :mod:`prefixattn.planner.cost_rule` alone.

Modules, in the order a step goes through them:

* :mod:`~prefixattn.planner.plans`: :func:`plan`, :class:`Plan`, ``plan_with_options``;
  :mod:`~prefixattn.planner.options`: the option checks;
* :mod:`~prefixattn.planner.node_choice`: which prefix-tree nodes a step shares (numpy), deciding with
  :mod:`~prefixattn.planner.cost_rule` (the sharing cost rule, defined once); :mod:`~prefixattn.planner.window`:
  sharing under sliding windows;
* :mod:`~prefixattn.planner.split_rule` and :mod:`~prefixattn.planner.work_list`: split-k and the work list, per
  work class; :mod:`~prefixattn.planner.tiles`: the tiles each class launches with;
  :mod:`~prefixattn.planner.stats`: the modeled launch times of ``Plan.stats``;
* :mod:`~prefixattn.planner.device_tables` and :mod:`~prefixattn.planner.workspace`: the tables on the device,
  new per plan or in a capacity-sized workspace;
* :mod:`~prefixattn.planner.compiled`, :mod:`~prefixattn.planner.compiled_tree`,
  :mod:`~prefixattn.planner.compiled_core` (with :mod:`~prefixattn.planner.compiled_split`, the split rule): the
  compiled (numba) planner, which computes the same tables as node_choice, split_rule and work_list in two compiled
  calls (tested equal: ``tests/test_plan_native.py``).

Why two planners. The numpy planner runs everywhere and needs nothing past numpy; the compiled one makes plan()
cheaper per step but costs numba's import and compile. Measured on a 2-core AMD EPYC host under load (load average
3-4), a tiny plan() in a fresh process:

=====================================================  ==================
``import prefixattn`` (torch and triton included)      3.0-4.6 s
numba's import on top (only when the compiled planner  0.3-0.4 s
is used; the compiled modules add 0.05 s)
first plan(), compiled planner, empty numba cache      97 s (compiling)
first plan(), compiled planner, warm numba cache       0.9-1.2 s
first plan(), numpy planner                            0.33-0.37 s
=====================================================  ==================

The cold compile is paid once per installation (the compiled functions are cached on disk next to their sources, or
in ``NUMBA_CACHE_DIR``; ``prefixattn warmup`` pays it ahead of time), and again after an upgrade changes their
files: a user would notice it. So numba stays optional (``pip install prefixattn[fast]``) and both planners stay:
``PREFIXATTN_PLANNER`` picks one (:mod:`~prefixattn.planner.compiled`), the numpy planner is the reference the tests
check the compiled one against, and sliding windows are planned in numpy.
"""
