"""Measured memory traffic on the CPU interpreter: prefixattn vs the engines' own Triton kernels on the same batches.

Every provider runs the same scaled-down BatchLLM Fig. 8 batch (bench/batches/shapes.py) under the interpreter traffic
counter (bench/traffic); rows per (provider, shape): ``kv_bytes`` (K and V bytes loaded, masked lanes excluded),
``unique_kv_bytes`` (each distinct KV position of the batch read once: the lower bound), ``launches``, and
details. Peers run where their engine is installed (bench/peers/remote.py); a missing engine skips its column only.

Asserted (correctness, never speed): every provider's output matches the fp32 reference, and no provider reads fewer
KV bytes than the lower bound (a kernel that did would be wrong, or the counter would be). The targets (prefixattn
<= 1.05x the bound and below every peer on shared batches, <= 1.02x the best peer without sharing, one launch) are
reported in the summary, not asserted.
"""

from __future__ import annotations

import os
import pytest

from batches.shapes import TRAFFIC_SHAPES, in_default_traffic_grid
from peers.base import CPU_PROVIDERS
from peers.cache import measurements, start_selected

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="measures traffic in the Triton interpreter (TRITON_INTERPRET=1, no --gpu)")

#: The whole grid; the shapes outside the default part are marked slow (batches.shapes.TRAFFIC_DEFAULT says which
#: and why).
SHAPES = [pytest.param(s, id=s.name, marks=() if in_default_traffic_grid(s) else pytest.mark.slow)
          for s in TRAFFIC_SHAPES]
BENCHMARK = "attention_traffic"
METRIC_UNITS = {"kv_bytes": "bytes", "unique_kv_bytes": "bytes", "launches": "count", "programs": "count",
                "q_bytes": "bytes", "other_loaded_bytes": "bytes", "stored_bytes": "bytes", "atomic_bytes": "bytes",
                "max_abs_err": "abs"}


def shape_label(shape) -> str:
    """The CSV ``shape`` column: the paper's setting, then the scaled batch actually run."""
    return f"{shape.paper} [{shape.name}]"


@pytest.fixture(scope="module", autouse=True)
def _start_engine_workers(request):
    # Engines' subprocesses start before the first test, so they overlap with prefixattn's in-process runs.
    start_selected(request.session)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_attention_traffic(results, provider, shape):
    record = measurements().get(provider, shape)
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
    if "tile_kv_load_bytes" in m.get("extra", {}):
        # Plan.kv_bytes_read() is documented as the KV bytes the work items load: the counter must agree exactly.
        assert m["kv_bytes"] == m["extra"]["tile_kv_load_bytes"]
