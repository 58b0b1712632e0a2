"""Measured memory traffic on the CPU interpreter: prefixattn vs the engines' own Triton kernels on the same batches.

Every provider runs the same scaled-down BatchLLM Fig. 8 batch (bench/shapes.py) under the interpreter traffic
counter (bench/traffic); rows per (provider, shape): ``kv_bytes`` (K and V bytes loaded, masked lanes excluded),
``unique_kv_bytes`` (each distinct KV position of the batch read once: the lower bound), ``launches``, and
details. Peers run where their engine is installed (bench/peers/remote.py); a missing engine skips its column only.

Asserted (correctness, never speed): every provider's output matches the fp32 reference, and no provider reads fewer
KV bytes than the lower bound (a kernel that did would be wrong, or the counter would be). The targets (prefixattn
<= 1.05x the bound and below every peer on shared batches, <= 1.02x the best peer without sharing, one launch) are
reported in the summary, not asserted.
"""

from __future__ import annotations

import sys

import pytest

from peers.base import CPU_PROVIDERS, ENGINE_OF
from peers.measure import measure
from peers.remote import engine_python, run_worker
from shapes import build_batch, fig8_shapes

BENCHMARK = "attention_traffic"
#: Fig. 8 at MHA (2:2 heads) in full, and the GQA 8:1 variant on the 256-request decode and mixed batches.
SHAPES = fig8_shapes() + [s for s in fig8_shapes(gqa=True) if s.num_decode > 4 and s.shared]
METRIC_UNITS = {"kv_bytes": "bytes", "unique_kv_bytes": "bytes", "launches": "count", "programs": "count",
                "q_bytes": "bytes", "other_loaded_bytes": "bytes", "stored_bytes": "bytes", "atomic_bytes": "bytes",
                "max_abs_err": "abs"}


def shape_label(shape) -> str:
    """The CSV ``shape`` column: the paper's setting, then the scaled batch actually run."""
    return f"{shape.paper} [{shape.name}]"


class _Measurements:
    """Measures lazily and once: each engine's providers over all SHAPES in one subprocess at first use."""

    def __init__(self, shapes) -> None:
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


@pytest.fixture(scope="session")
def measurements():
    return _Measurements(SHAPES)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_attention_traffic(results, measurements, provider, shape):
    record = measurements.get(provider, shape)
    assert "error" not in record, f"{provider} failed on {shape.name}: {record.get('error')}"
    m = record["metrics"]
    label = shape_label(shape)
    for metric, unit in METRIC_UNITS.items():
        results.add(BENCHMARK, provider, label, metric, m[metric], unit)
    results.add(BENCHMARK, provider, label, "kv_over_unique", m["kv_bytes"] / m["unique_kv_bytes"], "ratio")
    for metric, value in m.get("extra", {}).items():
        results.add(BENCHMARK, provider, label, metric, value, "bytes" if metric.endswith("bytes") else "count")
    assert m["correct"], f"{provider} output differs from the fp32 reference on {shape.name} " \
                         f"(max abs err {m['max_abs_err']:.3g})"
    assert m["kv_bytes"] >= m["unique_kv_bytes"], "read less KV than the batch holds: counter or kernel is wrong"
    if "planned_kv_bytes" in m.get("extra", {}):
        # Plan.kv_bytes_read() is documented as the KV bytes the work items load: the counter must agree exactly.
        assert m["kv_bytes"] == m["extra"]["planned_kv_bytes"]
