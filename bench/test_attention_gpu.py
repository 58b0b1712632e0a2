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

from peers.gpu import GPU_ONLY, Unavailable
from peers.measure import TOLERANCE
from shapes import build_batch, fig8_shapes, flashinfer_cascade_grid

_ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA/ROCm GPU and TRITON_INTERPRET unset "
                                                     "(prefixattn bench --gpu)")]

BENCHMARK = "attention_gpu_time"
#: Triton/engine providers shared with the interpreter suite (same adapters), then the CUDA-only ones.
TRITON_PROVIDERS = {"prefixattn": "peers.ours", "prefixattn-nosharing": "peers.ours",
                    "sglang-triton": "peers.sglang_triton", "cascade-sglang": "peers.sglang_triton",
                    "vllm-triton": "peers.vllm_triton"}
ENGINE_PACKAGE = {"sglang-triton": "sglang", "cascade-sglang": "sglang", "vllm-triton": "vllm"}
PROVIDERS = list(TRITON_PROVIDERS) + list(GPU_ONLY)
SHAPES = fig8_shapes(scaled=False) + fig8_shapes(scaled=False, gqa=True) + flashinfer_cascade_grid()
#: do_bench quantiles reported: median, p20, p80.
QUANTILES = (0.5, 0.2, 0.8)

_references: dict = {}


def _prepare(provider, batch):
    if provider in GPU_ONLY:
        try:
            return GPU_ONLY[provider](batch)
        except Unavailable as exc:
            pytest.skip(str(exc))
    package = ENGINE_PACKAGE.get(provider)
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed in this environment")
    return importlib.import_module(TRITON_PROVIDERS[provider]).prepare(batch, provider)


def _reference(shape, batch):
    from prefixattn import reference_attention

    key = shape.to_json()
    if key not in _references:
        _references.clear()  # one shape at a time: full-size references are large
        _references[key] = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr,
                                               batch.kv_lens, batch.block_table)
    return _references[key]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.paper + "/" + s.name)
def test_attention_gpu_time(results, shape, provider):
    import triton.testing

    batch = build_batch(shape, device="cuda")
    prepared = _prepare(provider, batch)
    out = prepared.run()
    torch.cuda.synchronize()
    want = _reference(shape, batch)
    atol, rtol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
    median, p20, p80 = triton.testing.do_bench(prepared.run, quantiles=list(QUANTILES))
    label = f"{shape.paper} [{shape.name}]"
    device = torch.cuda.get_device_name()
    for metric, value in (("time_us_median", median), ("time_us_p20", p20), ("time_us_p80", p80)):
        results.add(BENCHMARK, provider, label, metric, value * 1e3, "us", device=device)
    # Effective bandwidth against the unique-KV lower bound: what a kernel that reads every KV byte once would need.
    results.add(BENCHMARK, provider, label, "unique_kv_gbps", batch.unique_kv_bytes() / (median * 1e-3) / 1e9,
                "GB/s", device=device)
