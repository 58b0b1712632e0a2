"""The host's own speed on plan()-like work, reported beside host timings (plan() on the CPU, the GPU check's plan
and launch times): at the same commit (a513667) the free plan()'s step took a 74.5 us median on one session's 2-core
host and 126 us at best (medians 130-230) on the next one's, so host times from different machines compare only
through these.
"""

from __future__ import annotations

import statistics
import time

#: Iterations of the Python loop: attribute reads, calls and int arithmetic, as the planner's glue code (~3 ms).
PYTHON_LOOP = 10_000
#: Timed runs of each reference; the median is reported.
RUNS = 200


def _python_loop() -> None:
    total = 0
    for k in range(PYTHON_LOOP):
        total += len(str(k & 7)) + abs(k - 5)


def measure() -> dict:
    """``{"python-loop": us, "torch-empty": us}``: medians of RUNS runs of the Python loop and of one small CPU
    ``torch.empty`` (the free plan() allocates 3 tensors and makes 5 views)."""
    import torch

    out = {}
    for name, fn in (("python-loop", _python_loop),
                     ("torch-empty", lambda: torch.empty((256, 32), dtype=torch.int32))):
        fn()
        times = []
        for _ in range(RUNS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    return out


def record(results, benchmark: str) -> None:
    """Add :func:`measure`'s medians to ``results`` (bench/conftest.py's rows) under ``benchmark``: providers
    ``host-reference-python-loop`` and ``host-reference-torch-empty``, shape ``host``, device ``host-cpu``."""
    for name, value in measure().items():
        results.add(benchmark, f"host-reference-{name}", "host", "time_us_median", value, "us", device="host-cpu")
