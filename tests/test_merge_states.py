"""merge_states / merge_states_n against the fp32 torch reference of the LSE merge."""

import math

import pytest
import torch

from prefixattn import merge_states, merge_states_n
from tests.tolerances import LSE_TOL, MERGE_TOL

INF = math.inf


def _reference_merge(v: torch.Tensor, s: torch.Tensor):
    """v [T, N, H, D], s [T, N, H] -> merged (fp32), following the definition; empty states weigh nothing."""
    v, s = v.double(), s.double()
    m = s.max(dim=1, keepdim=True).values
    diff = torch.where(s == m, torch.zeros_like(s), s - m)  # +inf - +inf is the max itself
    w = torch.where(s == -INF, torch.zeros_like(s), torch.exp(diff))
    w_sum = w.sum(dim=1)
    out = torch.where(w_sum.unsqueeze(-1) > 0, (w.unsqueeze(-1) * v).sum(1) / w_sum.clamp_min(1e-300).unsqueeze(-1),
                      torch.zeros_like(v[:, 0]))
    lse = torch.where(w_sum > 0, m.squeeze(1) + torch.log(w_sum.clamp_min(1e-300)), torch.full_like(w_sum, -INF))
    return out.float(), lse.float()


def _states(seed, num_tokens, num_states, num_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(num_tokens, num_states, num_heads, head_dim, generator=g).to(dtype)
    s = torch.randn(num_tokens, num_states, num_heads, generator=g) * 4
    return v, s


def _assert_merged(got, want, dtype):
    (v_got, s_got), (v_want, s_want) = got, want
    atol, rtol = MERGE_TOL[dtype]
    assert not torch.isnan(v_got).any() and not torch.isnan(s_got).any()
    torch.testing.assert_close(v_got.float(), v_want, atol=atol, rtol=rtol)
    torch.testing.assert_close(s_got, s_want, atol=LSE_TOL[0], rtol=LSE_TOL[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,head_dim", [(4, 64), (3, 80), (2, 128)])
def test_merge_pair_matches_reference(dtype, num_heads, head_dim):
    v, s = _states(0, 5, 2, num_heads, head_dim, dtype)
    got = merge_states(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    _assert_merged(got, _reference_merge(v, s), dtype)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_pair_empty_and_infinite_states(dtype):
    v, s = _states(1, 6, 2, 2, 64, dtype)
    s[0] = -INF                        # both empty -> (0, -inf), never NaN
    s[1, 0] = -INF                     # one empty -> the other state unchanged
    s[2, 1] = -INF
    s[3, 0] = INF                      # +inf dominates a finite state
    s[4] = INF                         # two +inf states: equal weights
    s[5, 0, 0], s[5, 1, 1] = -INF, INF  # per head mixtures
    got = merge_states(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    _assert_merged(got, _reference_merge(v, s), dtype)
    assert torch.all(got[0][0] == 0) and torch.all(got[1][0] == -INF)
    torch.testing.assert_close(got[0][1].float(), v[1, 1].float())
    torch.testing.assert_close(got[1][1], s[1, 1])


def test_merge_pair_strided_inputs_and_out():
    v, s = _states(2, 4, 2, 4, 64, torch.float16)
    # States interleaved in one buffer (as a split-k workspace holds them), heads-major LSE: all non-contiguous.
    s_t = s.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    v_out = torch.full((4, 8, 64), float("nan"), dtype=torch.float16)[:, ::2]
    s_out = torch.full((4, 8), float("nan"))[:, 1::2]
    got = merge_states(v[:, 0], s_t[:, 0], v[:, 1], s_t[:, 1], out=(v_out, s_out))
    assert got[0] is v_out and got[1] is s_out
    _assert_merged(got, _reference_merge(v, s), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_states", [1, 3, 7])
def test_merge_n_matches_reference(dtype, num_states):
    v, s = _states(3, 4, num_states, 3, 96, dtype)
    if num_states > 1:
        s[0, :, :] = -INF
        s[1, 1:, 0] = -INF
        s[2, 0, 1] = INF
    _assert_merged(merge_states_n(v, s), _reference_merge(v, s), dtype)


def test_merge_n_zero_states_and_zero_tokens():
    v, s = _states(4, 3, 0, 2, 64, torch.float32)
    v_out, s_out = merge_states_n(v, s)
    assert v_out.shape == (3, 2, 64) and torch.all(v_out == 0) and torch.all(s_out == -INF)
    v, s = _states(4, 0, 2, 2, 64, torch.float32)
    v_out, s_out = merge_states_n(v, s)
    assert v_out.shape == (0, 2, 64) and s_out.shape == (0, 2)


def test_merge_n_strided():
    v, s = _states(5, 3, 4, 4, 64, torch.float32)
    v_strided = v.transpose(1, 2).contiguous().transpose(1, 2)  # [T, N, H, D] stored head-major
    _assert_merged(merge_states_n(v_strided, s.transpose(0, 2).contiguous().transpose(0, 2)),
                   _reference_merge(v, s), torch.float32)


def test_merge_pair_equals_attention_over_union():
    """The merge of attention over two disjoint KV halves is attention over the union (BatchLLM Eq. 1)."""
    g = torch.Generator().manual_seed(6)
    q, k, vv = torch.randn(3, 64, generator=g), torch.randn(10, 64, generator=g), torch.randn(10, 64, generator=g)

    def attn(keys, vals):
        logits = q @ keys.T / 8
        return torch.softmax(logits, -1) @ vals, torch.logsumexp(logits, -1)

    (va, sa), (vb, sb), (vu, su) = attn(k[:4], vv[:4]), attn(k[4:], vv[4:]), attn(k, vv)
    v_m, s_m = merge_states(va.unsqueeze(1), sa.unsqueeze(1), vb.unsqueeze(1), sb.unsqueeze(1))
    torch.testing.assert_close(v_m.squeeze(1), vu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_m.squeeze(1), su, atol=1e-5, rtol=1e-5)
