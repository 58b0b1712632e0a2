"""One measurement per (provider, shape) per pytest session, shared by the benchmarks that report on it (measured
traffic, and the modeled times computed from it)."""

from __future__ import annotations

import sys

import pytest

from batches.shapes import build_batch
from peers.base import ENGINE_OF
from peers.measure import measure
from peers.remote import Worker, engine_python

_SINGLETON = None


class _Measurements:
    """Measures lazily and once per session. :meth:`start` launches, for the selected (provider, shape) pairs, one
    subprocess per engine provider (an engine import costs ~10 s), which runs while this process measures prefixattn.
    ``get`` skips the calling test when the provider's engine is missing."""

    def __init__(self) -> None:
        self.records: dict = {}
        self.engines: dict = {}  # engine -> (python, why); python None when missing
        self.workers: list = []  # (Worker, keys it measures)

    def _engine(self, engine):
        if engine not in self.engines:
            self.engines[engine] = engine_python(engine)
        return self.engines[engine]

    def start(self, pairs) -> None:
        """Start workers for the ``(provider, shape)`` pairs the session selected that no worker covers yet."""
        todo: dict = {}
        covered = {k for _, keys in self.workers for k in keys}
        for provider, shape in pairs:
            engine = ENGINE_OF[provider]
            key = (provider, shape.to_json())
            if engine is None or key in covered or key in self.records:
                continue
            python, _ = self._engine(engine)
            if python is not None and python != sys.executable:
                todo.setdefault(engine, {}).setdefault(provider, {})[shape.to_json()] = shape
        # One subprocess per provider, not per engine: on the 2-core machine the engines' providers then finish
        # together with prefixattn's in-process runs instead of one engine's two providers queueing behind each
        # other while a core idles (an extra engine import costs ~10 s of CPU; the slowest provider took ~2 min).
        for engine, by_provider in todo.items():
            for provider, shapes in sorted(by_provider.items()):
                keys = {(provider, key) for key in shapes}
                self.workers.append((Worker(self._engine(engine)[0], [provider], list(shapes.values())), keys))

    def get(self, provider: str, shape) -> dict:
        engine = ENGINE_OF[provider]
        key = (provider, shape.to_json())
        if engine is not None:
            python, why = self._engine(engine)
            if python is None:
                pytest.skip(why)
            if python != sys.executable:
                self.start([(provider, shape)])
                for worker, keys in self.workers:
                    if key in keys:
                        return worker.records()[key]
        if key not in self.records:
            try:
                self.records[key] = dict(metrics=measure(provider, build_batch(shape)))
            except Exception as exc:  # reported like a worker's failure: the test fails with it
                self.records[key] = dict(error=f"{type(exc).__name__}: {exc}")
        return self.records[key]


def start_selected(session, modules=("test_attention_traffic", "test_attention_modeled")) -> None:
    """Start the engine workers for the selected tests of ``modules`` (their ``provider``/``shape`` parameters)."""
    pairs = []
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = getattr(getattr(item, "module", None), "__name__", "")
        if module.rsplit(".", 1)[-1] in modules and params.get("provider") in ENGINE_OF and "shape" in params:
            pairs.append((params["provider"], params["shape"]))
    measurements().start(pairs)


def measurements() -> _Measurements:
    """The session's measurements (created at first use)."""
    global _SINGLETON
    if _SINGLETON is None:
        _SINGLETON = _Measurements()
    return _SINGLETON
