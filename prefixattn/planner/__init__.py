"""The host planner: from one engine step's metadata to the kernel's work tables.

The public names are ``prefixattn.plan``, ``prefixattn.Plan`` and ``prefixattn.CapacityError``. This file imports
nothing, so that the simulator can import :mod:`prefixattn.planner.cost_rule` alone.

One pipeline (:func:`~prefixattn.planner.plans.plan_with_options`), its stages in the order a step goes through
them, each a module of its own:

* :mod:`~prefixattn.planner.checks`: the metadata checked, the per-request lengths;
* :mod:`~prefixattn.planner.tree`: the block prefix tree (and its per-thread cache);
* :mod:`~prefixattn.planner.node_choice`: which tree nodes a step shares, deciding with
  :mod:`~prefixattn.planner.cost_rule` (the sharing cost rule, defined once); :mod:`~prefixattn.planner.window`:
  sharing under sliding windows;
* :mod:`~prefixattn.planner.choose`: shared, shared with some requests apart, or unshared, by the modeled launches
  of :mod:`~prefixattn.planner.split_rule` (split-k per work class, and each candidate's price);
* :mod:`~prefixattn.planner.work_list`: the chosen candidate's work list, once; :mod:`~prefixattn.planner.tiles`:
  the tiles each class launches with; :mod:`~prefixattn.planner.stats`: the modeled times of ``Plan.stats``;
* :mod:`~prefixattn.planner.device_tables` and :mod:`~prefixattn.planner.workspace`: the tables on the device, new
  per plan or in a capacity-sized workspace.

Each stage is computed by the process's back-end (:mod:`~prefixattn.planner.backend`): numpy, or the compiled
(numba) stages of :mod:`prefixattn.planner.compiled`, one file per numpy stage, tested equal to numpy
(``tests/test_plan_compiled.py``).

Why two back-ends: numpy runs everywhere and needs nothing past numpy; the compiled stages make plan() a few times
cheaper per step but cost numba's import (~0.3-0.4 s on the 2-core CPU host), and their first compile (~100 s there;
cached on disk next to their sources, or in ``NUMBA_CACHE_DIR``, then ~1 s to load; ``prefixattn warmup`` pays it
ahead of time) again after an upgrade changes their files. So numba stays optional (``pip install
prefixattn[fast]``) and ``PREFIXATTN_PLANNER`` picks the back-end.
"""
