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
import threading
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


class Worker:
    """``providers`` x ``shapes`` measured in a subprocess started now; :meth:`records` waits for it.

    Started early, engine workers run while this process measures prefixattn: on the 2-core machine the engines'
    subprocesses and the main process overlap instead of queueing.
    """

    def __init__(self, python: str, providers: list[str], shapes: list) -> None:
        self.providers, self.shapes = providers, shapes
        env = dict(os.environ)
        env["TRITON_INTERPRET"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), env.get("PYTHONPATH", "")) if p)
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        self._proc = subprocess.Popen([python, "-W", "ignore::RuntimeWarning", "-m", "peers.worker", *providers],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=BENCH_DIR)
        self._out: list = []
        stdin = "".join(s.to_json() + "\n" for s in shapes)
        # communicate() in a thread: it writes stdin and drains both pipes (an engine's logs could fill a pipe).
        self._thread = threading.Thread(target=lambda: self._out.extend(self._proc.communicate(stdin)), daemon=True)
        self._thread.start()
        self._records: dict | None = None

    def records(self) -> dict:
        """``{(provider, shape_json): record}``, a record holding ``metrics`` or ``error``."""
        if self._records is not None:
            return self._records
        self._thread.join(SUBPROCESS_TIMEOUT_S)
        if self._thread.is_alive():
            self._proc.kill()
            self._thread.join()
        stdout, stderr = self._out if len(self._out) == 2 else ("", "")
        records = {}
        for line in stdout.splitlines():
            if line.startswith('{"provider"'):  # engines log to stdout too
                record = json.loads(line)
                records[(record["provider"], record["shape"])] = record
        for p in self.providers:
            for s in self.shapes:
                records.setdefault((p, s.to_json()), dict(
                    provider=p, shape=s.to_json(),
                    error=f"worker exited with {self._proc.returncode} before this shape:\n{stderr[-3000:]}"))
        self._records = records
        return records
