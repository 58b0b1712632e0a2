"""Offline tools over :mod:`prefixattn.autotune`: timing configs on a GPU into the user's tuning cache (``tuner``),
building the shipped tile tables from the analytic cost model (``table_builder``) within the launch limits
(``launch_limits``), and compiling every binary ahead of time to check registers, spills, shared memory, pipeline
depth and matrix instructions (``compile_specs`` builds the jobs, ``compile_check`` runs and judges them,
``compile_analysis`` reads the compiler's output).

They run from the command line (``prefixattn tune``, ``prefixattn compile-check``), the tests and the benchmarks;
no launch or plan imports them.
"""
