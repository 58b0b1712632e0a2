"""Hostile input at the public API: out-of-cache block ids, huge lengths, device spellings, NaN in the
reference, and user errors that used to surface as something other than a ValueError."""

import math

import pytest
import torch

from prefixattn import attention, merge_states, merge_states_n, plan, reference_attention

INT32_MAX = 2 ** 31 - 1
HEADS = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=4, q_dtype=torch.float32)


def _one_request(table, kv_len=12, **plan_kwargs):
    p = plan(torch.tensor([0, 1]), torch.tensor([kv_len]), torch.tensor(table), **HEADS, **plan_kwargs)
    q = torch.randn(1, 2, 64)
    return p, q


def _cache(num_blocks):
    k = torch.randn(num_blocks, 4, 1, 64)
    return k, torch.randn_like(k)


# ---------------------------------------------------------------------------------------------------------------
# 1. Block ids the cache does not hold
# ---------------------------------------------------------------------------------------------------------------
def test_plan_records_the_largest_block_id_it_reads():
    # Columns past kv_len (padding, here 99 and -1) are never read, so they do not count.
    p = plan(torch.tensor([0, 1, 2]), torch.tensor([12, 5]), torch.tensor([[0, 1, 7, 99], [3, 2, -1, -1]]), **HEADS)
    assert p.max_block_id == 7
    empty = plan(torch.tensor([0, 0]), torch.tensor([0]), torch.zeros(1, 0, dtype=torch.int64), **HEADS)
    assert empty.max_block_id == -1


def test_attention_rejects_a_block_id_outside_the_cache(device):
    p, q = _one_request([[0, 1, 7]])
    k, v = _cache(4)
    with pytest.raises(ValueError, match=r"k_cache: expected more than 7 blocks in dim 0 \(the plan reads block "
                                         r"id 7\), got 4"):
        attention(q.to(device), k.to(device), v.to(device), p)


def test_plan_for_a_bigger_cache_then_a_smaller_one_is_refused(device):
    p, q = _one_request([[0, 1, 50]], num_blocks=100)
    k, v = _cache(4)
    with pytest.raises(ValueError, match="k_cache: expected more than 50 blocks"):
        attention(q.to(device), k.to(device), v.to(device), p)


def test_v_cache_smaller_than_k_cache_is_refused(device):
    p, q = _one_request([[0, 1, 3]])
    k, _ = _cache(4)
    # The blocks, block size and KV heads of k_cache (check_qkv): a smaller v_cache is caught there, before the
    # block-id check.
    with pytest.raises(ValueError, match="v_cache: expected the blocks, block size and KV heads of k_cache"):
        attention(q.to(device), k.to(device), k[:2].to(device), p)


def test_block_id_near_int32_max_is_refused_not_a_crash(device):
    # Used to be a SIGSEGV: block id x block stride pointed far outside the cache.
    p, q = _one_request([[0, 1, INT32_MAX - 1]])
    assert p.max_block_id == INT32_MAX - 1
    k, v = _cache(4)
    with pytest.raises(ValueError, match=f"k_cache: expected more than {INT32_MAX - 1} blocks"):
        attention(q.to(device), k.to(device), v.to(device), p)


def test_block_id_check_reads_no_tensor(device, monkeypatch):
    # The check compares two host ints: no .item(), no copy of any device tensor.
    p, q = _one_request([[0, 1, 2]])
    k, v = _cache(4)
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append("item"))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: calls.append("cpu"))
    with pytest.raises(ValueError):
        attention(q, k[:2], v[:2], p)
    assert calls == []


# ---------------------------------------------------------------------------------------------------------------
# 4. Lengths that do not fit the int32 work items
# ---------------------------------------------------------------------------------------------------------------
def test_kv_lens_of_2_to_the_31_are_refused():
    # A table wide enough for kv_len = 2^31 with block_size 2^20 (2^11 columns): only the length is bad.
    table = torch.zeros(1, 2 ** 11, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"kv_lens: expected values <= 2147483647 \(int32 work items\), got "
                                         r"kv_lens\[0\]=2147483648"):
        plan(torch.tensor([0, 1]), torch.tensor([2 ** 31]), table, **{**HEADS, "block_size": 2 ** 20})


def test_negative_kv_lens_are_refused():
    with pytest.raises(ValueError, match=r"kv_lens: expected values >= 0, got kv_lens\[1\]=-5"):
        plan(torch.tensor([0, 1, 1]), torch.tensor([4, -5]), torch.tensor([[0], [1]]), **HEADS)


def test_query_rows_past_int32_are_refused():
    with pytest.raises(ValueError, match=r"qo_indptr: expected values <= 2147483647"):
        plan(torch.tensor([0, 2 ** 31]), torch.tensor([2 ** 31]), torch.zeros(1, 1, dtype=torch.int64),
             **{**HEADS, "block_size": 2 ** 31})


# ---------------------------------------------------------------------------------------------------------------
# 6. Devices compared by what they are
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["cpu:0", torch.device("cpu", 0), "cpu"])
def test_a_plan_for_cpu0_runs_on_cpu_tensors(spelling):
    p, q = _one_request([[0, 1, 2]], device=spelling)
    k, v = _cache(4)
    assert p.device == torch.device("cpu")
    torch.testing.assert_close(attention(q, k, v, p), reference_attention(
        q, k, v, torch.tensor([0, 1]), torch.tensor([12]), torch.tensor([[0, 1, 2]])), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the 'cuda' spelling is the current device)")
def test_cuda_without_index_is_the_current_device():
    from prefixattn.validation import canonical_device

    assert canonical_device("device", "cuda") == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_plan_on_cuda_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="device: expected an available device, got 'cuda'"):
        _one_request([[0, 1, 2]], device="cuda")


@pytest.mark.parametrize("bad", ["not-a-device", 3.5, "cuda:x"])
def test_plan_device_that_is_no_device(bad):
    with pytest.raises(ValueError, match="device: expected"):
        _one_request([[0, 1, 2]], device=bad)


def test_meta_block_table_is_a_value_error():
    with pytest.raises(ValueError, match="block_table: expected a tensor with data .* got a meta tensor"):
        plan(torch.tensor([0, 1]), torch.tensor([12]), torch.tensor([[0, 1, 2]], device="meta"), **HEADS)
    with pytest.raises(ValueError, match="device: expected"):
        _one_request([[0, 1, 2]], device="meta")


def test_num_blocks_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="num_blocks: expected a non-negative int or None, got -1"):
        _one_request([[0, 1, 2]], num_blocks=-1)


# ---------------------------------------------------------------------------------------------------------------
# 2. NaN in the reference (the kernels: tests/test_nan_kernel.py)
# ---------------------------------------------------------------------------------------------------------------
def _ref_batch():
    torch.manual_seed(0)
    q = torch.randn(3, 2, 64)
    k, v = _cache(4)
    # request 0: 1 query over 6 KV; request 1: 2 queries over 8 KV (causal: row 0 sees 7, row 1 sees 8).
    meta = (torch.tensor([0, 1, 3]), torch.tensor([6, 8]), torch.tensor([[0, 1], [2, 3]]))
    return q, k, v, meta


def test_reference_nan_in_q_gives_nan():
    q, k, v, meta = _ref_batch()
    q[0, 1, 5] = float("nan")
    out, lse = reference_attention(q, k, v, *meta, return_lse=True)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, 1])
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all()


def test_reference_nan_in_a_visible_k_row_gives_nan():
    q, k, v, meta = _ref_batch()
    k[3, 1, 0, 7] = float("nan")  # block 3 slot 1 = position 5 of request 1: seen by both its rows
    out, lse = reference_attention(q, k, v, *meta, return_lse=True)
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()
    assert torch.isfinite(out[0]).all()


def test_reference_nan_in_a_visible_v_row_gives_nan_out():
    q, k, v, meta = _ref_batch()
    v[0, 2, 0, 0] = float("nan")  # position 2 of request 0
    out, lse = reference_attention(q, k, v, *meta, return_lse=True)
    assert torch.isnan(out[0, :, 0]).all() and torch.isfinite(lse).all()


def test_reference_nan_in_a_hidden_position_stays_hidden():
    q, k, v, meta = _ref_batch()
    k[3, 3, 0, 0] = float("nan")  # position 7 of request 1: causally hidden from its row 0
    v[3, 3, 0, 0] = float("nan")
    out, lse = reference_attention(q, k, v, *meta, return_lse=True)
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    assert torch.isnan(out[2]).all()


def test_reference_row_with_no_kv_is_zero_and_minus_inf():
    q, k, v, _ = _ref_batch()
    out, lse = reference_attention(q, k, v, torch.tensor([0, 0, 3]), torch.tensor([0, 3]),
                                   torch.tensor([[0], [1]]), causal=False, return_lse=True)
    assert torch.isfinite(out).all()
    out0, lse0 = reference_attention(q[:0], k, v, torch.tensor([0, 0]), torch.tensor([0]), torch.tensor([[0]]),
                                     return_lse=True)
    assert out0.shape == (0, 2, 64) and lse0.shape == (0, 2)


def test_reference_rejects_a_non_finite_sm_scale():
    q, k, v, meta = _ref_batch()
    with pytest.raises(ValueError, match="sm_scale: expected a finite float or None, got nan"):
        reference_attention(q, k, v, *meta, sm_scale=math.nan)


# ---------------------------------------------------------------------------------------------------------------
# 7. User errors that were not ValueErrors
# ---------------------------------------------------------------------------------------------------------------
def test_merge_states_head_dim_zero():
    v, s = torch.randn(3, 2, 0), torch.randn(3, 2)
    with pytest.raises(ValueError, match="v_a: expected head_dim >= 1 in the last dim, got 0"):
        merge_states(v, s, v, s)
    with pytest.raises(ValueError, match="v: expected head_dim >= 1 in the last dim, got 0"):
        merge_states_n(v[:, None], s[:, None])


def test_merge_states_zero_heads_is_a_no_op():
    v, s = torch.randn(3, 0, 64), torch.randn(3, 0)
    out, lse = merge_states(v, s, v, s)
    assert out.shape == (3, 0, 64) and lse.shape == (3, 0)


def test_order_groups_with_a_list_is_a_value_error():
    from prefixattn.scheduling import group_prompts
    from prefixattn.scheduling.ordering import order_groups

    groups = group_prompts([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match=r"ordering: expected a policy name \(str\) from .*, got list"):
        order_groups(groups, ["dfs"])



@pytest.mark.parametrize("bad", [True, math.inf, "0.1", -0.125])
def test_plan_sm_scale(bad):
    with pytest.raises(ValueError, match=r"sm_scale: expected a finite float >= 0 or None"):
        _one_request([[0, 1, 2]], sm_scale=bad)
