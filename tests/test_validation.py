"""Every bad input at a public entry point raises a ValueError that names the argument."""

import pytest
import torch

from prefixattn import merge_states, merge_states_n, reference_attention


def _good(dtype=torch.float16):
    q = torch.randn(4, 4, 64).to(dtype)
    k = torch.randn(6, 16, 2, 64).to(dtype)
    return dict(q=q, k_cache=k, v_cache=torch.randn_like(k), qo_indptr=torch.tensor([0, 1, 4]),
                kv_lens=torch.tensor([10, 20]), block_table=torch.tensor([[0, 1], [2, 3]]))


def _call(**overrides):
    args = _good()
    args.update(overrides)
    return reference_attention(**args)


def test_good_input_passes():
    assert _call().shape == (4, 4, 64)


@pytest.mark.parametrize("name,bad,match", [
    ("q", torch.randn(4, 4, 64).to(torch.int8), "q: expected dtype"),
    ("q", torch.randn(4, 256), "q: expected a 3-D tensor"),
    ("q", [[1.0]], "q: expected a torch.Tensor"),
    ("k_cache", torch.randn(6, 16, 2, 64, dtype=torch.float32), "k_cache: expected the dtype of q"),
    ("k_cache", torch.randn(6, 16, 3, 64, dtype=torch.float16),
     "v_cache: expected the blocks, block size and KV heads"),
    ("k_cache", torch.randn(16, 2, 64, dtype=torch.float16), "k_cache: expected a 4-D tensor"),
    ("v_cache", torch.randn(6, 8, 2, 64, dtype=torch.float16), "v_cache: expected the blocks, block size and KV heads"),
    ("qo_indptr", torch.tensor([0, 3, 1]), "qo_indptr: expected a non-decreasing"),
    ("qo_indptr", torch.tensor([1, 2, 4]), r"qo_indptr: expected qo_indptr\[0\] == 0"),
    ("qo_indptr", torch.tensor([0, 1, 3]), r"qo_indptr: expected qo_indptr\[-1\] == number of query tokens"),
    ("qo_indptr", torch.tensor([0, 4]), "qo_indptr: expected length num_requests"),
    ("qo_indptr", torch.tensor([0.0, 1.0, 4.0]), "qo_indptr: expected dtype"),
    ("kv_lens", torch.tensor([10, 2]), r"kv_lens: expected kv_lens\[r\] >= q_len\[r\]"),
    ("kv_lens", torch.tensor([10, 40]), "block_table: expected at least 3 columns"),
    ("kv_lens", torch.tensor([[10, 20]]), "kv_lens: expected a 1-D tensor"),
    ("block_table", torch.tensor([[0, 1], [2, 6]]), r"block_table: expected block ids in \[0, 6\)"),
    ("block_table", torch.tensor([[-1, 0], [2, 3]]), r"block_table\[0, 0\]=-1"),
    ("block_table", torch.tensor([[0, 1]]), "block_table: expected 2 rows"),
])
def test_bad_input_names_the_argument(name, bad, match):
    with pytest.raises(ValueError, match=match):
        _call(**{name: bad})


def test_cache_head_dim_checked():
    cache = torch.randn(6, 16, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache: expected head_dim 64"):
        _call(k_cache=cache, v_cache=cache)


def test_gqa_head_counts_checked():
    args = _good()
    args["q"] = torch.randn(4, 3, 64).to(torch.float16)
    with pytest.raises(ValueError, match="num_qo_heads: expected a positive multiple of num_kv_heads=2"):
        reference_attention(**args)


def test_unused_block_table_entries_are_not_checked():
    # Padding past a request's last block is engine garbage (vLLM pads with 0, others with -1): not an error.
    args = _good()
    args["block_table"] = torch.tensor([[0, -1, 99], [2, 3, -1]])
    assert reference_attention(**args).shape == (4, 4, 64)


def test_error_messages_never_print_tensor_contents():
    with pytest.raises(ValueError) as info:
        _call(qo_indptr=torch.tensor([0, 3, 1]))
    assert "tensor(" not in str(info.value)


@pytest.mark.parametrize("fn_args,match", [
    (lambda v, s: (v, s.double(), v, s), "s_a: expected dtype float32"),
    (lambda v, s: (v, s, v, s[:, :1]), r"s_b: expected shape \(3, 2\)"),
    (lambda v, s: (v, s, v[:2], s[:2]), "v_b: expected the shape of v_a"),
    (lambda v, s: (v, s, v.float(), s), "v_b: expected the dtype of v_a"),
    (lambda v, s: (v[0], s, v, s), "v_a: expected a 3-D tensor"),
])
def test_merge_states_bad_input(fn_args, match):
    v, s = torch.randn(3, 2, 64).half(), torch.randn(3, 2)
    with pytest.raises(ValueError, match=match):
        merge_states(*fn_args(v, s))


def test_merge_states_bad_out():
    v, s = torch.randn(3, 2, 64).half(), torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"out\[0\]: expected shape"):
        merge_states(v, s, v, s, out=(torch.empty(3, 2, 32).half(), torch.empty(3, 2)))
    with pytest.raises(ValueError, match="out: expected a"):
        merge_states(v, s, v, s, out=torch.empty(3, 2, 64).half())


def test_merge_states_n_bad_input():
    with pytest.raises(ValueError, match="s: expected shape"):
        merge_states_n(torch.randn(3, 2, 2, 64), torch.randn(3, 2, 3))
    with pytest.raises(ValueError, match="v: expected a 4-D tensor"):
        merge_states_n(torch.randn(3, 2, 64), torch.randn(3, 2))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    v, s = torch.randn(3, 2, 64).half(), torch.randn(3, 2)
    with pytest.raises(ValueError, match="v_a: expected a CUDA/ROCm tensor, got a CPU tensor"):
        merge_states(v, s, v, s)
