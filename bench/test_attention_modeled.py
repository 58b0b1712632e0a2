"""MODELED (not measured) kernel time on A100 / H100 / MI300X: the simulator's cost model applied to the traffic and
launches measured in the interpreter (test_attention_traffic.py's measurements, reused: nothing runs twice).

The formula is the simulator's, never re-implemented here: ``prefixattn.sim.step_cost.measured_kernel_time`` (the
attention roofline: max(FLOPs / peak x efficiency, bytes / HBM bandwidth x efficiency) + launches x launch
overhead). Rows say so twice: ``device=<gpu> (modeled)`` and ``unit=us (modeled)``. On the scaled-down batches the
bytes are megabytes, so the launch term dominates: read these rows as "what the launch count and measured traffic
would cost", not as kernel times.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from prefixattn.sim.step_cost import measured_kernel_time

from batches.shapes import TRAFFIC_SHAPES, in_default_traffic_grid
from peers.base import CPU_PROVIDERS
from peers.cache import measurements, start_selected

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="models time from interpreter-measured traffic (TRITON_INTERPRET=1)")

#: The whole grid; the shapes outside the default part are marked slow (batches.shapes.TRAFFIC_DEFAULT says which
#: and why).
SHAPES = [pytest.param(s, id=s.name, marks=() if in_default_traffic_grid(s) else pytest.mark.slow)
          for s in TRAFFIC_SHAPES]
BENCHMARK = "attention_modeled"
HARDWARE = ["a100", "h100", "mi300x"]
_FLOPS_PER_MAC = 2
_MATMULS = 2  # QK^T and PV


def attention_flops(shape) -> float:
    """FLOPs the batch needs (every visible (query, key) pair, QK^T and PV, all query heads): the same for every
    provider, so modeled differences come from measured bytes and launches only."""
    from batches.shapes import build_batch

    b = build_batch(shape, metadata_only=True)
    q = b.q_lens.astype(np.float64)
    kv = b.kv_lens.cpu().numpy().astype(np.float64)
    pairs = float((q * (kv - q) + q * (q + 1) / 2).sum())
    return pairs * shape.head_dim * shape.num_qo_heads * _FLOPS_PER_MAC * _MATMULS


@pytest.fixture(scope="module", autouse=True)
def _start_engine_workers(request):
    # Engines' subprocesses start before the first test, so they overlap with prefixattn's in-process runs.
    start_selected(request.session)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_attention_modeled(results, provider, shape):
    record = measurements().get(provider, shape)
    assert "error" not in record, f"{provider} failed on {shape.name}: {record.get('error')}"
    m = record["metrics"]
    moved = m["kv_bytes"] + m["q_bytes"] + m["other_loaded_bytes"] + m["stored_bytes"] + m["atomic_bytes"]
    flops = attention_flops(shape)
    label = f"{shape.paper} [{shape.name}]"
    for hw in HARDWARE:
        seconds = measured_kernel_time(hw, bytes_moved=moved, flops=flops, launches=m["launches"])
        assert seconds > 0
        results.add(BENCHMARK, provider, label, "modeled_time_us", seconds * 1e6, "us (modeled)",
                    device=f"{hw} (modeled)")
