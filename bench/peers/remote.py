"""Measure a provider where its engine is installed: in this interpreter if the package imports here, else in the
engine's own venv as a subprocess (``peers.worker``), else not at all (the caller skips that column with a reason).

Why subprocesses: vLLM and SGLang pin their own torch and dependency sets and cannot share the main venv, but their
Triton kernels run unmodified in any interpreter that has them. Nothing of theirs is copied into this repository.

Engine venvs are looked up as ``PREFIXATTN_BENCH_<ENGINE>_PYTHON`` (a python executable) or ``.venv-<engine>`` at the
repository root (what ``scripts/test_<engine>.sh`` creates).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
#: A whole engine's list of shapes in one subprocess: importing an engine costs ~10 s, one shape a few seconds.
SUBPROCESS_TIMEOUT_S = 1800


def engine_python(engine: str) -> tuple[str | None, str]:
    """(python to run ``engine``'s providers with, or None; why). ``sys.executable`` when it imports here."""
    if importlib.util.find_spec(engine) is not None:
        return sys.executable, f"{engine} importable in this interpreter"
    override = os.environ.get(f"PREFIXATTN_BENCH_{engine.upper()}_PYTHON")
    candidates = [Path(override)] if override else []
    candidates.append(REPO_ROOT / f".venv-{engine}" / "bin" / "python")
    for python in candidates:
        if python.exists():
            return str(python), f"{engine} from {python}"
    return None, (f"{engine} is not installed here and no engine venv was found (set PREFIXATTN_BENCH_"
                  f"{engine.upper()}_PYTHON or create .venv-{engine}, see scripts/test_{engine}.sh)")


def run_worker(python: str, providers: list[str], shapes: list) -> dict:
    """Measure ``providers`` x ``shapes`` in a subprocess; ``{(provider, shape_json): record}`` where a record has
    ``metrics`` or ``error``."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    stdin = "".join(s.to_json() + "\n" for s in shapes)
    proc = subprocess.run([python, "-W", "ignore::RuntimeWarning", "-m", "peers.worker", *providers], input=stdin,
                          capture_output=True, text=True, env=env, cwd=BENCH_DIR, timeout=SUBPROCESS_TIMEOUT_S)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"provider"'):  # engines log to stdout too
            record = json.loads(line)
            records[(record["provider"], record["shape"])] = record
    missing = [(p, s.to_json()) for p in providers for s in shapes if (p, s.to_json()) not in records]
    for key in missing:
        records[key] = dict(provider=key[0], shape=key[1],
                            error=f"worker exited with {proc.returncode} before this shape:\n{proc.stderr[-3000:]}")
    return records
