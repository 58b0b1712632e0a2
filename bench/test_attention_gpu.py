"""Kernel time on a GPU (marker ``gpu``; ``prefixattn bench --gpu``): prefixattn vs FlashInfer cascade (2 and 3
levels) and batch decode/prefill, the flash-attn cascade vLLM used to run, vLLM's Triton ``unified_attention``,
SGLang's Triton decode/extend kernels, and torch SDPA.

Shapes: BatchLLM Fig. 8 at full size (MHA 32 heads and GQA 32:4, head_dim 128, fp16) and FlashInfer's old cascade
grid. Every provider's output is checked against the fp32 reference before it is timed with
``triton.testing.do_bench`` (median, p20, p80). A peer whose package is missing here skips its column with the
reason. Nothing is asserted about speed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from batches.shapes import build_batch, fig8_shapes, flashinfer_cascade_grid
from peers.base import ENGINE_OF, MODULE_OF
from peers.gpu import GPU_ONLY, Unavailable
from peers.measure import TOLERANCE

_ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA/ROCm GPU and compiled Triton: run `prefixattn "
                                                     "bench --gpu` (or PREFIXATTN_BENCH_GPU=1 pytest bench/)")]

BENCHMARK = "attention_gpu_time"
#: The interpreter suite's providers (same adapters, same engines), then the CUDA-only ones.
PROVIDERS = list(MODULE_OF) + list(GPU_ONLY)
SHAPES = fig8_shapes(scaled=False) + fig8_shapes(scaled=False, gqa=True) + flashinfer_cascade_grid()
#: do_bench quantiles reported: median, p20, p80.
QUANTILES = (0.5, 0.2, 0.8)

#: The current shape's batch and fp32 reference, shared by its providers (tests run shape by shape: the provider
#: parameter varies fastest). One shape at a time: full-size batches and references take gigabytes.
_current: dict = {}


def _batch_and_reference(shape):
    from prefixattn import reference_attention

    key = shape.to_json()
    if _current.get("key") != key:
        _current.clear()
        torch.cuda.empty_cache()
        batch = build_batch(shape, device="cuda")
        reference = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr, batch.kv_lens,
                                        batch.block_table)
        _current.update(key=key, batch=batch, reference=reference)
    return _current["batch"], _current["reference"]


def _prepare(provider, batch):
    if provider in GPU_ONLY:
        try:
            return GPU_ONLY[provider](batch)
        except Unavailable as exc:
            pytest.skip(str(exc))
    package = ENGINE_OF[provider]
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed in this environment (on a GPU, engines' kernels run in-process)")
    return importlib.import_module(MODULE_OF[provider]).prepare(batch, provider)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.paper + "/" + s.name)
def test_attention_gpu_time(results, shape, provider):
    import triton.testing

    batch, want = _batch_and_reference(shape)
    prepared = _prepare(provider, batch)
    out = prepared.result(prepared.run())
    torch.cuda.synchronize()
    # Correctness before timing: a provider that computes something else is a failure, not a number.
    atol, rtol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol,
                               msg=lambda m: f"{provider} differs from the fp32 reference on {shape.name}: {m}")
    median, p20, p80 = triton.testing.do_bench(prepared.run, quantiles=list(QUANTILES))
    label = f"{shape.paper} [{shape.name}]"
    device = torch.cuda.get_device_name()
    for metric, value in (("time_us_median", median), ("time_us_p20", p20), ("time_us_p80", p80)):
        results.add(BENCHMARK, provider, label, metric, value * 1e3, "us", device=device)  # do_bench gives ms
    results.add(BENCHMARK, provider, label, "max_abs_err", float((out.float() - want).abs().max()), "abs",
                device=device)
    # Effective bandwidth against the unique-KV lower bound: what a kernel that reads every KV byte once would need.
    results.add(BENCHMARK, provider, label, "unique_kv_gbps", batch.unique_kv_bytes() / (median * 1e-3) / 1e9,
                "GB/s", device=device)
