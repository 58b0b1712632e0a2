"""The GPU-only peers' adapters (bench/peers/gpu.py), checked where they can be on a CPU: torch SDPA on gathered KV
against the fp32 reference, and the CUDA-only peers turning a missing package into a skip reason (Unavailable)."""

import pytest
import torch

from batches.shapes import Shape, build_batch
from peers.gpu import GPU_ONLY, Unavailable, prepare_sdpa
from peers.measure import TOLERANCE

from prefixattn import reference_attention

# Tiny batches: one group sharing a 32-token prefix plus a singleton, decode only and with two prefill chunks (the
# bottom-right causal mask path), MHA and GQA 4:1.
SMALL = [
    Shape(scenario="decode", num_decode=3, num_prefill=0, shared=32, distinct=5, per_group=2, num_qo_heads=2,
          num_kv_heads=2, head_dim=16),
    Shape(scenario="mixed", num_decode=3, num_prefill=2, shared=16, distinct=7, per_group=3, num_qo_heads=4,
          num_kv_heads=1, head_dim=32),
]


@pytest.mark.parametrize("shape", SMALL, ids=lambda s: s.name)
def test_sdpa_adapter_matches_reference(shape):
    batch = build_batch(shape)
    prepared = prepare_sdpa(batch)
    got = prepared.run()
    want = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr, batch.kv_lens,
                               batch.block_table)
    atol, rtol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    # Requests with equal (q_len, kv_len) share one call: decodes together, prefills together.
    assert prepared.notes == f"calls={1 + (shape.num_prefill > 0)}"


@pytest.mark.parametrize("provider", ["flashinfer-cascade2", "flashinfer-decode", "flashinfer-prefill-fa2",
                                      "flashinfer-batch-attention", "flash-attn-cascade"])
def test_cuda_only_peers_skip_with_a_reason_when_missing(provider):
    needs = "vllm" if provider == "flash-attn-cascade" else "flashinfer"
    try:
        __import__("vllm.vllm_flash_attn" if needs == "vllm" else "flashinfer")
        pytest.skip(f"{needs} is installed here: the missing-package path cannot be exercised")
    except ImportError:
        pass
    with pytest.raises(Unavailable, match="not importable"):
        GPU_ONLY[provider](build_batch(SMALL[0]))

