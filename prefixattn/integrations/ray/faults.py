"""Fault injection for the replica actors: make one engine call fail once, then let Ray retry it.

``FailOnce(engine_factory, marker_dir, mode=...)`` is an engine factory: the engine it builds fails the first
``generate`` call that wins a marker file in ``marker_dir`` (created atomically, so exactly one call fails across
all actors and restarts), and behaves like the wrapped engine afterwards. ``mode="raise"`` raises
:class:`InjectedFault` inside the actor (an application error, retried when the pipeline retries exceptions);
``mode="exit"`` kills the actor process halfway through the batch (after the engine ran on half of the prompts),
which Ray sees as an actor death: it restarts the actor and retries the task.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefixattn.integrations.ray.engines import as_engine

MODES = ("raise", "exit")
#: Exit status of an injected actor death (any non-zero status is a death to Ray).
_EXIT_STATUS = 17


class InjectedFault(RuntimeError):
    """Raised by a :class:`FailOnce` engine on its one failing call."""


class FailOnce:
    """Engine factory whose engines fail exactly one ``generate`` call across all actors (see module notes).

    Parameters
    ----------
    engine_factory : callable
        Zero-argument factory of the real engine.
    marker_dir : str or Path
        A directory every actor can write to (one machine, or a shared file system).
    mode : {"raise", "exit"}
    """

    def __init__(self, engine_factory, marker_dir, mode: str = "raise") -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if not callable(engine_factory):
            raise ValueError(f"engine_factory: expected a zero-argument callable, got {type(engine_factory).__name__}")
        self.engine_factory = engine_factory
        self.marker = Path(marker_dir) / "prefixattn-fault-injected"
        self.mode = mode

    def __call__(self):
        return _FailingEngine(as_engine(self.engine_factory()), self.marker, self.mode)


class _FailingEngine:
    def __init__(self, engine, marker: Path, mode: str) -> None:
        self.engine = engine
        self.marker = marker
        self.mode = mode

    def _claim(self) -> bool:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True

    def generate(self, prompts: list, rows: list) -> list:
        if self._claim():
            if self.mode == "raise":
                raise InjectedFault(f"injected failure in actor process {os.getpid()}")
            half = max(len(prompts) // 2, 1)
            self.engine.generate(prompts[:half], rows[:half])  # mid-batch: some work done, nothing returned
            os._exit(_EXIT_STATUS)
        return self.engine.generate(prompts, rows)

    def stats(self) -> dict:
        fn = getattr(self.engine, "stats", None)
        return fn() if callable(fn) else {}
