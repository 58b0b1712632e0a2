"""Run one provider on one batch under the traffic counter and check its output against the fp32 reference."""

from __future__ import annotations

import importlib
import time

import torch

from peers.base import MODULE_OF
from traffic import count_traffic
from traffic.counter import OTHER

#: Labels whose bytes are KV-cache traffic: the paged cache and an engine's copy of the new tokens' KV.
KV_LABELS = ("k_cache", "v_cache", "k_new", "v_new")
#: Output check before any number is reported: the fp32 reference vs a kernel's fp16/bf16/fp32 output. The tests'
#: table (tests/tolerances.py) is not importable from bench/; these are the same (atol, rtol) values.
TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-4)}


def measure(provider: str, batch, reference: torch.Tensor | None = None) -> dict:
    """Counted run of ``provider`` on ``batch``: a dict of metrics (bytes, launches, error) plus ``notes``.

    Host-side preparation (plans, metadata) runs before the counter starts: it is once per engine step, the kernels
    run once per layer.
    """
    from prefixattn import reference_attention

    module = importlib.import_module(MODULE_OF[provider])
    prepared = module.prepare(batch, provider)
    labels = dict(k_cache=batch.k_cache, v_cache=batch.v_cache, q=batch.q, **prepared.labels)
    start = time.perf_counter()
    with count_traffic(tensors=labels) as t:
        out = prepared.run()
    seconds = time.perf_counter() - start
    if reference is None:
        reference = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr, batch.kv_lens,
                                        batch.block_table)
    err = (out.float() - reference).abs()
    atol, rtol = TOLERANCE[batch.q.dtype]
    ok = bool(torch.isfinite(out.float()).all() and (err <= atol + rtol * reference.abs()).all())
    loaded = t.by_label("loaded")
    return dict(
        kv_bytes=t.loaded(*KV_LABELS),
        unique_kv_bytes=batch.unique_kv_bytes(),
        launches=t.num_launches,
        programs=sum(launch.programs for launch in t.launches),
        q_bytes=loaded.get("q", 0),
        other_loaded_bytes=t.loaded() - t.loaded(*KV_LABELS) - loaded.get("q", 0),
        stored_bytes=t.stored(),
        atomic_bytes=t.atomic(),
        unattributed_bytes=loaded.get(OTHER, 0) + t.by_label("stored").get(OTHER, 0),
        max_abs_err=float(err.max()),
        correct=ok,
        interpreter_seconds=seconds,
        kernels=",".join(launch.kernel for launch in t.launches),
        notes=prepared.notes,
        extra=prepared.extra,
    )
