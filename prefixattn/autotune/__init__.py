"""What a kernel launch and the planner read at run time: GPU targets, the config space, shape buckets, the shipped
tile tables and the user's tuning cache, the config lookup, the analytic cost model (the lookup's last resort before
the heuristic) and the calibrated program-cost model the planner prices plans with.

The offline tools that produce and check what is read here (the tuner, the shipped-table builder, the compile check)
are :mod:`prefixattn.tuning`; nothing here imports them.
"""
