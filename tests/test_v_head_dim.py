"""Values with a head size of their own (``plan(v_head_dim=...)``: keys 192, values 128 in DeepSeek's up-projected
MLA prefill): the kernel against the reference over every work class and merge path, the model switches, the
wrapper's workspace, the launch's constexprs and the refusals (interpreter on CPU: small grids)."""

from __future__ import annotations

import pytest
import torch

from prefixattn import (MLAPrefixSharedAttention, PrefixSharedAttention, attention, plan, prefix_attention,
                        reference_attention)
from prefixattn.kernels import layout as K
from tests.prefix_batches import (MODEL_SWITCH_IDS, MODEL_SWITCHES, check_against_reference, make_batch,
                                  model_switch_call, on_device, random_batch)
from tests.test_attention import CountingKernel


def _with_values(b, v_head_dim: int, seed: int = 0):
    """The batch with a V cache of ``v_head_dim`` (K's blocks, block size and KV heads; q's dtype)."""
    g = torch.Generator().manual_seed(seed)
    b.v_cache = torch.randn(*b.k_cache.shape[:3], v_head_dim, generator=g).to(b.k_cache.dtype).to(b.k_cache.device)
    return b


@pytest.mark.parametrize("head_dim, v_head_dim, dtype, seed", [
    (48, 32, torch.float32, 0),  # narrower V, both padded (64 and 32 lanes)
    (40, 72, torch.float16, 1),  # wider V: the tiles are chosen for V's size
    (192, 128, torch.bfloat16, 2),  # DeepSeek's up-projected keys and values
])
def test_values_of_their_own_head_size(device, head_dim, v_head_dim, dtype, seed):
    # Shared prefixes, prefill chunks and decodes, split-k pieces (4 SMs): every class and merge path.
    b = random_batch(seed, num_requests=7, levels=2, block_size=4, num_qo_heads=4, num_kv_heads=2,
                     head_dim=head_dim, dtype=dtype, max_q_len=6, decode_fraction=0.5)
    b = on_device(_with_values(b, v_head_dim, seed), device)
    p = plan(*b.metadata, **b.heads, v_head_dim=v_head_dim, q_dtype=dtype, sharing="always", num_sms=4,
             min_split_tokens=4)
    assert p.v_head_dim == v_head_dim and p.ws_o.shape[2] == v_head_dim
    assert p.shared_nodes and p.work.num_ws_rows > 0 and K.CLASS_DECODE in p.work_classes
    check_against_reference(b, p)


@pytest.mark.parametrize("plan_kw, attn_kw", MODEL_SWITCHES, ids=MODEL_SWITCH_IDS)
def test_model_switches_with_values_of_their_own_size(device, plan_kw, attn_kw):
    b = make_batch(4, q_lens=[1, 3, 2, 1], extra_lens=[9, 2, 13, 30], paths=[("a",), ("a",), ("a",), ()],
                   level_blocks={"a": 3}, block_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=64)
    b = on_device(_with_values(b, 40), device)
    attn_kw = model_switch_call(b, attn_kw, device)
    p = plan(*b.metadata, **b.heads, v_head_dim=40, q_dtype=b.q.dtype, kv_dtype=b.k_cache.dtype, sharing="always",
             num_sms=4, min_split_tokens=4, **plan_kw)
    check_against_reference(b, p, **attn_kw)


def test_nan_guard_redoes_rows_with_values_of_their_own_size(device):
    # A NaN value at a key the causal mask hides from some rows of its tile: the guard's redos (both of them: the
    # all-at-once and the lane-by-lane one) read V rows of V's size.
    b = make_batch(5, q_lens=[4, 1], extra_lens=[6, 20], paths=[(), ()], level_blocks={}, block_size=4,
                   num_qo_heads=2, num_kv_heads=1, head_dim=32)
    b = on_device(_with_values(b, 48), device)
    last = int(b.kv_lens[0]) - 1  # request 0's last key: hidden from its first three rows
    blk = int(b.block_table[0, last // 4])
    b.v_cache[blk, last % 4] = float("nan")
    p = plan(*b.metadata, **b.heads, v_head_dim=48, q_dtype=b.q.dtype, nan_guard=True)
    got = attention(b.q, b.k_cache, b.v_cache, p)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata)
    assert torch.isnan(got[3]).all() and not torch.isnan(got[:3]).any()
    torch.testing.assert_close(got, want, equal_nan=True, atol=1e-4, rtol=1e-4)


def test_wrapper_sizes_its_workspace_by_the_values(device):
    b = random_batch(3, num_requests=5, levels=1, block_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                     dtype=torch.float32, max_q_len=2, decode_fraction=1.0)
    b = on_device(_with_values(b, 32), device)
    attn = PrefixSharedAttention(**b.heads, v_head_dim=32, q_dtype=torch.float32, max_tokens=16,
                                 max_requests=8, max_blocks_per_request=b.block_table.shape[1], device=device,
                                 use_cuda_graph=True, sharing="always", num_sms=4, min_split_tokens=4)
    assert attn.workspace.ws_o.shape[2] == 32
    p = attn.plan(*b.metadata)
    out = torch.empty(b.q.shape[0], 4, 32, device=device)
    attn.run(b.q, b.k_cache, b.v_cache, out=out)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata)
    assert p.v_head_dim == 32
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_launch_compiles_the_second_size_only_where_it_differs(device, monkeypatch):
    b = on_device(make_batch(6, q_lens=[1, 1], extra_lens=[9, 30], paths=[(), ()], level_blocks={}, block_size=4,
                             num_qo_heads=2, num_kv_heads=2, head_dim=96), device)
    counter = CountingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", counter)
    attention(b.q, b.k_cache, b.v_cache, plan(*b.metadata, **b.heads, q_dtype=b.q.dtype))
    kw = counter.kwargs[-1]
    assert not kw["HAS_V_HEAD_DIM"] and kw["BLOCK_D"] == kw["BLOCK_DV"] == 128
    b = _with_values(b, 64)
    attention(b.q, b.k_cache, b.v_cache, plan(*b.metadata, **b.heads, v_head_dim=64, q_dtype=b.q.dtype))
    kw = counter.kwargs[-1]
    assert kw["HAS_V_HEAD_DIM"] and (kw["BLOCK_D"], kw["BLOCK_DV"], kw["v_head_dim"]) == (128, 64, 64)


def test_refusals_name_v_head_dim(device):
    b = on_device(make_batch(7, q_lens=[1], extra_lens=[9], paths=[()], level_blocks={}, block_size=4, num_qo_heads=2,
                             num_kv_heads=1, head_dim=64), device)
    with pytest.raises(ValueError, match="v_head_dim: expected a head_dim that is a multiple of 8"):
        plan(*b.metadata, **b.heads, v_head_dim=20)
    p = plan(*b.metadata, **b.heads, v_head_dim=32, q_dtype=b.q.dtype)
    with pytest.raises(ValueError, match=r"v_head_dim \(v_cache dim 3\): expected 32 \(from the plan\), got 64"):
        attention(b.q, b.k_cache, b.v_cache, p)
    b = _with_values(b, 32)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 32\)"):
        attention(b.q, b.k_cache, b.v_cache, p, out=torch.empty_like(b.q))
    with pytest.raises(ValueError, match="v_cache: expected the blocks, block size and KV heads of k_cache"):
        attention(b.q, b.k_cache, b.v_cache[:, :2], p)
    with pytest.raises(ValueError, match="v_head_dim: expected a head_dim"):
        PrefixSharedAttention(**b.heads, v_head_dim=300, max_tokens=4, max_requests=1,
                              max_blocks_per_request=4, device=device)
    with pytest.raises(ValueError, match="v_head_dim: expected an option of MLAPrefixSharedAttention"):
        MLAPrefixSharedAttention(num_heads=4, block_size=4, sm_scale=0.1, kv_lora_rank=32, rope_dim=16, v_head_dim=32)
    # A workspace's partial states have its output head size: a step of another one would write past their rows.
    attn = PrefixSharedAttention(**b.heads, max_tokens=4, max_requests=1, max_blocks_per_request=4, device=device)
    for override in (dict(v_head_dim=128), dict(head_dim=128)):
        with pytest.raises(ValueError, match=r"v_head_dim \(the output's head size.*expected 64 \(the workspace's"):
            attn.plan(*b.metadata, **override)


def test_reference_matches_naive_attention_with_narrower_values():
    # One request, no paging subtleties: softmax(q k^T * scale) v with V of its own width.
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 24, generator=g)
    k_cache = torch.randn(1, 4, 1, 24, generator=g)
    v_cache = torch.randn(1, 4, 1, 16, generator=g)
    out = reference_attention(q, k_cache, v_cache, torch.tensor([0, 1]), torch.tensor([4]), torch.tensor([[0]]),
                              compute_dtype=torch.float64)
    w = torch.softmax(torch.einsum("hd,kd->hk", q[0].double(), k_cache[0, :, 0].double()) / 24 ** 0.5, dim=-1)
    torch.testing.assert_close(out[0], w @ v_cache[0, :, 0].double())


def test_warmup_compiles_the_binaries_of_values_of_their_own_size(monkeypatch, capsys):
    from prefixattn import warmup as w
    from prefixattn.cli import main

    counter = CountingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", counter)
    cfg = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtypes=torch.float32, v_head_dim=32)
    report = w.warmup_kernels(**cfg, layout=w.VLLM_LAYOUT, run_in_interpreter=True)
    assert [r.status for r in report.results] == ["launched"] * 2, "\n".join(report.lines())
    # Every launch: V's binary, writing 32-lane rows.
    assert counter.kwargs and {(kw["HAS_V_HEAD_DIM"], kw["BLOCK_DV"], kw["out_ptr"].shape[-1])
                               for kw in counter.kwargs} == {(True, 32, 32)}
    assert all(v.v_head_dim == 32 for v in w.kernel_variants(**cfg)) and "d64 v32" in "\n".join(report.lines())
    assert all(v.v_head_dim is None for v in w.kernel_variants(**{**cfg, "v_head_dim": 64}))
    with pytest.raises(ValueError, match="kv_write: expected False with a v_head_dim of its own"):
        w.kernel_variants(**cfg, kv_write=True)
    assert main(["warmup", "--num-qo-heads", "2", "--num-kv-heads", "1", "--head-dim", "64", "--v-head-dim", "32",
                 "--max-q-len", "1", "--dry-run"]) == 0
    assert "d64 v32" in capsys.readouterr().out
