"""Shared plumbing for `pytest bench/`: one results file, one row format.

Every benchmark records rows through the ``results`` fixture; the session writes them to
``bench/results/latest.csv`` (kept out of git) with columns
``benchmark, provider, shape, device, metric, value, unit, commit, versions``.
Benchmarks report; they never assert timings. ``PREFIXATTN_BENCH_RESULTS=path.csv`` writes elsewhere (two runs in one
checkout would otherwise overwrite each other's file).
"""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("PREFIXATTN_BENCH_GPU") else "1")

import pytest  # noqa: E402

RESULTS_DIR = Path(__file__).parent / "results"
COLUMNS = ["benchmark", "provider", "shape", "device", "metric", "value", "unit", "commit", "versions"]


def _commit() -> str:
    # The GPU machine gets a copy of the working tree whose git metadata may lag it: the caller names the commit.
    if os.environ.get("PREFIXATTN_BENCH_COMMIT"):
        return os.environ["PREFIXATTN_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> str:
    import numpy
    import torch
    import triton

    return f"torch={torch.__version__};triton={triton.__version__};numpy={numpy.__version__}"


def _device() -> str:
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "cpu-interpreter"
    return torch.cuda.get_device_name()


class Results:
    """Collects benchmark rows; ``add`` one per (benchmark, provider, shape, metric)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.commit = _commit()
        self.versions = _versions()
        self.device = _device()

    def add(self, benchmark: str, provider: str, shape: str, metric: str, value: float, unit: str,
            device: str | None = None) -> None:
        self.rows.append(dict(benchmark=benchmark, provider=provider, shape=shape, device=device or self.device,
                              metric=metric, value=value, unit=unit, commit=self.commit, versions=self.versions))

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)


@pytest.fixture(scope="session")
def results(request):
    collected = Results()
    yield collected
    out = Path(os.environ.get("PREFIXATTN_BENCH_RESULTS") or RESULTS_DIR / "latest.csv")
    collected.write(out)
    print(f"\nprefixattn bench: wrote {len(collected.rows)} rows to {out}")


@pytest.fixture(autouse=True)
def _interpreter_memcheck():
    """Interpreted launches are bounds-checked as in the tests (tests/memcheck.py)."""
    from tests.memcheck import checked

    with checked():
        yield
