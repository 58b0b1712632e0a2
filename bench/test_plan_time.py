"""prefixattn.plan() on full-size BatchLLM Fig. 8 steps (host only, no kernel): plan time, and the KV bytes the
plan's work items will read vs the unique-KV lower bound (sharing "auto" vs "never"), decode and mixed batches.

The kernel cannot run at these sizes on the interpreter; test_attention_traffic.py measures real traffic on scaled
batches, and checks there that the planned bytes match the measured ones.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

import prefixattn
from prefixattn.autotune.lookup import planning_target
from shapes import build_batch, fig8_shapes

BENCHMARK = "plan_time"
#: Timed plan() calls per shape after warm-up: enough for stable percentiles of a ~1 ms call.
TIMED_RUNS = 30
WARMUP_RUNS = 3
#: Every full-size Fig. 8 batch, MHA and GQA 8:1 (32:4): decode with 32 and 256 requests, mixed 7 prefill + 256
#: decode (prefill chunks of up to 2048 tokens: a tiled kernel re-reads their KV once per query tile, so the unique
#: bound is out of reach there for any tiled kernel), and the batches without sharing. ~20 ms per plan at most.
SHAPES = fig8_shapes(scaled=False) + fig8_shapes(scaled=False, gqa=True)
#: Tiles of the plans: the shipped H100 table (what an H100 runs), not the CPU heuristic "auto" falls back to here;
#: the tiles set the query rows per tile, hence how often a shared prefix or a prefill chunk's KV is re-read.
PLAN_TARGET = "sm90"


def _percentile(values, q):
    return float(np.percentile(np.asarray(values), q))


@pytest.mark.parametrize("sharing", ["auto", "never"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_plan_time(results, shape, sharing):
    batch = build_batch(shape, metadata_only=True)
    s = shape
    kwargs = dict(block_size=s.block_size, num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads,
                  head_dim=s.head_dim, q_dtype=batch.dtype, sharing=sharing, num_blocks=batch.num_blocks)
    with planning_target(PLAN_TARGET):
        for _ in range(WARMUP_RUNS):
            p = prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, **kwargs)
        times = []
        for _ in range(TIMED_RUNS):
            start = time.perf_counter()
            p = prefixattn.plan(batch.qo_indptr, batch.kv_lens, batch.block_table, **kwargs)
            times.append(time.perf_counter() - start)
    provider = "prefixattn" if sharing == "auto" else "prefixattn-nosharing"
    label = f"{s.paper} [{s.name}]"
    unique = batch.unique_kv_bytes()
    planned = p.kv_bytes_read()
    for metric, value in (("plan_us_median", statistics.median(times) * 1e6),
                          ("plan_us_p20", _percentile(times, 20) * 1e6), ("plan_us_p80", _percentile(times, 80) * 1e6)):
        results.add(BENCHMARK, provider, label, metric, value, "us", device="host-cpu")
    results.add(BENCHMARK, provider, label, "planned_kv_bytes", planned, "bytes", device="host-cpu")
    results.add(BENCHMARK, provider, label, "unique_kv_bytes", unique, "bytes", device="host-cpu")
    results.add(BENCHMARK, provider, label, "work_items", p.num_items, "count", device="host-cpu")
    results.add(BENCHMARK, provider, label, "shared_nodes", len(p.shared_nodes), "count", device="host-cpu")
    results.add(BENCHMARK, provider, label, "launches", p.num_launches, "count", device="host-cpu")
    results.add(BENCHMARK, provider, label, "rows_per_suffix_tile", p.tiles.rows_per_suffix_tile(s.num_qo_heads //
                s.num_kv_heads), "count", device="host-cpu")
    assert planned >= unique, "the plan reads less KV than the batch holds"
    if sharing == "never":
        assert not p.shared_nodes
