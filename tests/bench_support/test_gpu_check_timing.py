"""The GPU check's timing and model-step code paths with FlashInfer in them, on a CPU: FlashInfer is the
signature-faithful stand-in (fake_flashinfer.py), times are the dry run's wall clock. What runs here is the harness
(checks, FlashInfer best, rows); only a GPU run measures anything."""

import sys
import types

import pytest

from batches.shapes import Shape, build_batch
from gpu_check import clock as step_clock
from gpu_check import model_layout, model_step, timing
from gpu_check.measure import Timer

from prefixattn import reference_attention

from . import fake_flashinfer


class Rows:
    def __init__(self):
        self.rows, self.device = [], "cpu-interpreter"

    def add(self, benchmark, provider, shape, metric, value, unit):
        self.rows.append(dict(benchmark=benchmark, provider=provider, shape=shape, metric=metric, value=value,
                              unit=unit))

    def get(self, provider, metric):
        return [r["value"] for r in self.rows if r["provider"] == provider and r["metric"] == metric]


@pytest.fixture
def fake(monkeypatch):
    import peers.flashinfer as fi

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(fi, "device_major", lambda device: fi.FA3_MAJOR)
    monkeypatch.setattr(step_clock, "DEADLINE", float("inf"))
    return {name: True for name in fi.PEERS}


def test_timing_step_times_every_peer_and_names_flashinfers_best(fake):
    shape = Shape(scenario="mixed", num_decode=3, num_prefill=1, shared=32, distinct=16, per_group=0,
                  num_qo_heads=4, num_kv_heads=1, head_dim=32, dtype="float32", paper="t")
    batch = build_batch(shape)
    want = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr, batch.kv_lens,
                               batch.block_table)
    floors = dict(memory=1e-3, compute=1e-3, overlapped=1e-3, serial=2e-3, bytes=1e6)
    rows, timer, timed = Rows(), Timer(True, "cpu"), {}
    for provider in ["prefixattn", *fake]:
        timed[provider] = timing.time_provider(provider, batch, want, "t", floors, timer, rows, fake)
    # Decode-only peers skip a mixed batch with their reason; every other peer is correct and timed.
    skipped = {p for p, t in timed.items() if t is None}
    assert skipped == {"flashinfer-decode", "flashinfer-decode-tc-fa2", "flashinfer-decode-tc-fa3"}
    assert all(v == 1.0 for v in rows.get("flashinfer-pod", "correct") + rows.get("prefixattn", "correct"))
    assert rows.get("flashinfer-cascade2", "oracle_groups") == rows.get("flashinfer-cascade2-fa2", "oracle_groups") \
        == [1.0]
    # Each of prefixattn's work classes timed alone, their sum beside the whole.
    assert rows.get("prefixattn", "class_chunk_us_median") and rows.get("prefixattn", "class_decode_us_median")
    assert rows.get("prefixattn", "classes_sum_us") == [sum(rows.get("prefixattn", "class_chunk_us_median") +
                                                            rows.get("prefixattn", "class_decode_us_median") +
                                                            rows.get("prefixattn", "class_shared_us_median"))]
    # Peers a batch does not suit have a not_run row with the reason.
    assert [r["unit"] for r in rows.rows if r["provider"] == "flashinfer-decode" and r["metric"] == "not_run"] == [
        "reason: the decode wrapper takes decode batches only (one query row per request)"]
    best = timing.record_best(rows, "t", timed)
    assert best[0].startswith("flashinfer-") and rows.get(best[0], "is_flashinfer_best") == [1.0]
    assert len(rows.get("flashinfer-best", "graph_flushed_us_median")) == 1


def test_model_step_picks_flashinfers_best_and_runs_the_cascade_on_scheduler_batches(fake):
    prompts, outputs = model_layout.workload("batchllm-case1", 12, 32)
    batcher, steps = model_layout.run_batcher(prompts, outputs, token_budget=64, kv_blocks=200, block_size=16)
    mixed = [s for s in model_layout.select_steps(steps, 1) if model_layout.step_kind(s) == "mixed"][0]
    lay = model_layout.layout(mixed, batcher, prompts, 16)
    import torch

    model = model_step.Model(model_step.DRY_MODEL, torch.float32, "cpu", lay.num_blocks)
    rows = Rows()
    clock = types.SimpleNamespace(left=lambda: 1.0)
    ceil = dict(hbm_bytes_per_s=1e12, attention_flops_per_s=1e14, l2_bytes=50 * 2 ** 20)
    measured = model_step._time_step("batchllm-case1", lay, model, Timer(True, "cpu"), "cpu", rows, fake, clock, True,
                                     ceil)
    providers = {m["provider"] for m in measured}
    assert providers == {"prefixattn", "prefixattn-nosharing", "flashinfer-best", "flashinfer-cascade2",
                         "flashinfer-cascade2-fa2"}
    assert all(v == 1.0 for r in rows.rows if r["metric"] == "correct" for v in [r["value"]])
    [best] = [r["provider"] for r in rows.rows if r["metric"] == "is_flashinfer_best"]
    assert best in model_step.FI_CANDIDATES["mixed"]
    assert {m["kernel"] for m in measured} == {"fused", "paged", "cascade"}


def test_the_paged_rate_batch_shuffles_distinct_pages_and_counts_causal_flops():
    from gpu_check.cases import causal_attention_flops
    from gpu_check.floors import DRY_PAGED_CHUNKS, RATE_PAGE, paged_chunk_batch

    n, new, cached = DRY_PAGED_CHUNKS
    q, k, _, qo, lens, table, flops = paged_chunk_batch(True, "cpu")
    # Every page of the cache used once, by one request, and not in order (an engine's cache after a while).
    assert sorted(table.flatten().tolist()) == list(range(k.shape[0]))
    assert table.shape == (n, (new + cached) // RATE_PAGE) and k.shape[1] == RATE_PAGE
    assert table.flatten().tolist() != sorted(table.flatten().tolist())
    assert qo.tolist() == [i * new for i in range(n + 1)] and lens.tolist() == [new + cached] * n
    # Each new row sees the cached context and the chunk's rows up to its own.
    rows_keys = n * sum(cached + i + 1 for i in range(new))
    assert flops == causal_attention_flops([new] * n, [new + cached] * n, q.shape[1], q.shape[2]) == \
        4.0 * rows_keys * q.shape[1] * q.shape[2]
