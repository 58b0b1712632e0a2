"""The host planner: from one engine step's metadata to the kernel's work tables.

Imports nothing (the simulator imports :mod:`prefixattn.planner.cost_rule` without the rest): the public names are
``prefixattn.plan``, ``prefixattn.Plan`` and ``prefixattn.CapacityError``.
"""
