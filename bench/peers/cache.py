"""One measurement per (provider, shape) per pytest session, shared by the benchmarks that report on it (measured
traffic, and the modeled times computed from it)."""

from __future__ import annotations

import sys

import pytest

from peers.base import CPU_PROVIDERS, ENGINE_OF
from peers.measure import measure
from peers.remote import engine_python, run_worker
from shapes import TRAFFIC_SHAPES, build_batch

_SINGLETON = None


class _Measurements:
    """Measures lazily and once: each engine's providers over all shapes in one subprocess at first use (its
    import costs ~10 s), prefixattn in this process. ``get`` skips the calling test when the engine is missing."""

    def __init__(self, shapes=TRAFFIC_SHAPES) -> None:
        self.shapes = shapes
        self.records: dict = {}
        self.unavailable: dict = {}
        self.engines_done: set = set()

    def get(self, provider: str, shape) -> dict:
        engine = ENGINE_OF[provider]
        key = (provider, shape.to_json())
        if key in self.records:
            return self.records[key]
        if engine is not None and engine not in self.engines_done:
            self.engines_done.add(engine)
            python, why = engine_python(engine)
            if python is None:
                self.unavailable[engine] = why
            elif python != sys.executable:
                providers = [p for p in CPU_PROVIDERS if ENGINE_OF[p] == engine]
                self.records.update(run_worker(python, providers, self.shapes))
                return self.records[key]
        if engine in self.unavailable:
            pytest.skip(self.unavailable[engine])
        try:
            record = dict(metrics=measure(provider, build_batch(shape)))
        except Exception as exc:  # recorded like a worker's failure, raised below
            record = dict(error=f"{type(exc).__name__}: {exc}")
        self.records[key] = record
        return record


def measurements() -> _Measurements:
    """The session's measurements (created at first use)."""
    global _SINGLETON
    if _SINGLETON is None:
        _SINGLETON = _Measurements()
    return _SINGLETON
