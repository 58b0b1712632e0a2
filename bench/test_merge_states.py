"""merge_states: kernel vs the fp32 torch reference (error and bytes moved), one row per shape and dtype."""

import pytest
import torch

from prefixattn import merge_states, merge_states_n

SHAPES = [(1, 32, 128), (64, 32, 128), (256, 8, 64), (7, 5, 80)]  # (num_tokens, num_heads, head_dim)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _torch_merge(v_a, s_a, v_b, s_b):
    m = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)
    v = (w_a.unsqueeze(-1) * v_a.float() + w_b.unsqueeze(-1) * v_b.float()) / (w_a + w_b).unsqueeze(-1)
    return v, m + torch.log(w_a + w_b)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_merge_states_vs_reference(results, shape, dtype):
    g = torch.Generator().manual_seed(0)
    v_a, v_b = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    s_a, s_b = (torch.randn(*shape[:2], generator=g) * 3 for _ in range(2))
    v, s = merge_states(v_a, s_a, v_b, s_b)
    v_ref, s_ref = _torch_merge(v_a, s_a, v_b, s_b)
    name = "x".join(map(str, shape)) + f"/{str(dtype).replace('torch.', '')}"
    elt = v_a.element_size()
    results.add("merge_states", "prefixattn", name, "max_abs_err_out", (v.float() - v_ref).abs().max().item(), "abs")
    results.add("merge_states", "prefixattn", name, "max_abs_err_lse", (s - s_ref).abs().max().item(), "abs")
    # Minimum traffic: read two states, write one (values in the input dtype, LSE fp32).
    moved = v_a.numel() * elt * 3 + s_a.numel() * 4 * 3
    results.add("merge_states", "prefixattn", name, "min_bytes", moved, "bytes")


def test_merge_states_n_vs_reference(results):
    g = torch.Generator().manual_seed(1)
    v, s = torch.randn(16, 4, 8, 128, generator=g), torch.randn(16, 4, 8, generator=g)
    got_v, got_s = merge_states_n(v, s)
    w = torch.softmax(s, dim=1)
    want_v, want_s = (w.unsqueeze(-1) * v).sum(1), torch.logsumexp(s, dim=1)
    results.add("merge_states_n", "prefixattn", "16x4x8x128/float32", "max_abs_err_out",
                (got_v - want_v).abs().max().item(), "abs")
    results.add("merge_states_n", "prefixattn", "16x4x8x128/float32", "max_abs_err_lse",
                (got_s - want_s).abs().max().item(), "abs")
