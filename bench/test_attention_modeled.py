"""MODELED (not measured) kernel time on A100 / H100 / MI300X: the simulator's cost model (prefixattn.sim) applied
to the traffic and launches measured in the interpreter (test_attention_traffic.py's measurements, reused: nothing
runs twice). Rows are labelled ``device=<gpu> (modeled)``.

The cost formula is the simulator's, never re-implemented here: this module needs
``prefixattn.sim.costmodel.measured_kernel_time(hardware, *, bytes_moved, flops, launches) -> seconds`` and skips
with that reason while the simulator does not provide it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from peers.base import CPU_PROVIDERS
from peers.cache import measurements, start_selected
from shapes import TRAFFIC_SHAPES as SHAPES

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="models time from interpreter-measured traffic (TRITON_INTERPRET=1)")

BENCHMARK = "attention_modeled"
HARDWARE = ["a100", "h100", "mi300x"]
_FLOPS_PER_MAC = 2
_MATMULS = 2  # QK^T and PV


def _cost_function():
    try:
        from prefixattn.sim.costmodel import measured_kernel_time
    except ImportError:
        pytest.skip("prefixattn.sim.costmodel.measured_kernel_time(hardware, *, bytes_moved, flops, launches) is not "
                    "there yet (simulator issue): modeled rows need the simulator's formula")
    return measured_kernel_time


def attention_flops(shape) -> float:
    """FLOPs the batch needs (every visible (query, key) pair, QK^T and PV, all query heads): the same for every
    provider, so modeled differences come from measured bytes and launches only."""
    from shapes import build_batch

    b = build_batch(shape, metadata_only=True)
    q = b.q_lens.astype(np.float64)
    kv = b.kv_lens.cpu().numpy().astype(np.float64)
    pairs = float((q * (kv - q) + q * (q + 1) / 2).sum())
    return pairs * shape.head_dim * shape.num_qo_heads * _FLOPS_PER_MAC * _MATMULS


@pytest.fixture(scope="module", autouse=True)
def _start_engine_workers(request):
    # Engines' subprocesses start before the first test, so they overlap with prefixattn's in-process runs.
    start_selected(request.session)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_attention_modeled(results, provider, shape):
    cost = _cost_function()
    record = measurements().get(provider, shape)
    assert "error" not in record, f"{provider} failed on {shape.name}: {record.get('error')}"
    m = record["metrics"]
    moved = m["kv_bytes"] + m["q_bytes"] + m["other_loaded_bytes"] + m["stored_bytes"] + m["atomic_bytes"]
    flops = attention_flops(shape)
    label = f"{shape.paper} [{shape.name}]"
    for hw in HARDWARE:
        seconds = cost(hw, bytes_moved=moved, flops=flops, launches=m["launches"])
        assert seconds > 0
        results.add(BENCHMARK, provider, label, "modeled_time_us", seconds * 1e6, "us (modeled)",
                    device=f"{hw} (modeled)")
