"""The MLA kernel (prefixattn.mla) against the absorbed-form reference: decode, prefill chunks, shared prefixes,
split-k, fp8 latent caches, odd widths and head counts, and its bad inputs."""

import pytest
import torch

import prefixattn
from prefixattn import mla_attention, plan_mla, reference_mla_attention
from prefixattn.kernels import layout as K
from tests.tolerances import ATTENTION_TOL, LSE_TOL

#: A small latent (kv_lora_rank, rope_dim) for the interpreter; 24 pads to 32 lanes and 8 rotary lanes to 16.
SMALL = (24, 8)


def _batch(device, *, q_lens, kv_lens, block_size, shared_blocks, num_heads, dims=SMALL, dtype=torch.float32,
           seed=0):
    """Requests whose block tables share their first ``shared_blocks`` blocks, the rest their own (shuffled)."""
    g = torch.Generator().manual_seed(seed)
    width = sum(dims)
    blocks = [-(-n // block_size) for n in kv_lens]
    own = sum(max(0, b - shared_blocks) for b in blocks)
    num_blocks = shared_blocks + own + 3
    ids = torch.randperm(num_blocks, generator=g)
    shared, rest = ids[:shared_blocks], ids[shared_blocks:].tolist()
    table = torch.zeros(len(kv_lens), max(blocks + [1]), dtype=torch.int32)
    for r, b in enumerate(blocks):
        row = shared[:min(b, shared_blocks)].tolist() + [rest.pop() for _ in range(max(0, b - shared_blocks))]
        table[r, :len(row)] = torch.tensor(row, dtype=torch.int32)
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qo[-1]), num_heads, width, generator=g).to(dtype).to(device)
    kv = torch.randn(num_blocks, block_size, width, generator=g).to(dtype).to(device)
    return q, kv, qo, torch.tensor(kv_lens, dtype=torch.int32), table


def _check(q, kv, qo, lens, table, p, *, dims=SMALL, kv_scale=None, run=None, **call):
    """``run`` (default: mla_attention with the plan) against the fp64 reference, output and LSE."""
    if run is None:
        out, lse = mla_attention(q, kv, p, return_lse=True, kv_scale=kv_scale, **call)
    else:
        out, lse = run(q, kv, return_lse=True, kv_scale=kv_scale, **call)
    n = int(qo[-1])
    ref, ref_lse = reference_mla_attention(q[:n], kv, qo, lens, table, kv_lora_rank=dims[0], sm_scale=p.sm_scale,
                                           return_lse=True, compute_dtype=torch.float64, kv_scale=kv_scale)
    atol, rtol = ATTENTION_TOL[q.dtype]
    torch.testing.assert_close(out[:n].double().cpu(), ref[:n].cpu(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse[:n].double().cpu(), ref_lse[:n].cpu(), atol=LSE_TOL[0], rtol=LSE_TOL[1])
    return out


@pytest.mark.parametrize("sharing", ["never", "always"])
@pytest.mark.parametrize("num_heads", [16, 4, 48])
def test_decode_and_chunks_with_shared_prefix(device, sharing, num_heads):
    # Three decodes and a 7-row chunk under a 2-block prefix; 48 heads run as 3 head blocks of 16, 4 heads as one.
    q, kv, qo, lens, table = _batch(device, q_lens=[1, 1, 7, 1], kv_lens=[37, 33, 45, 32], block_size=16,
                                    shared_blocks=2, num_heads=num_heads)
    p = plan_mla(qo, lens, table, block_size=16, num_heads=num_heads, sm_scale=0.3, kv_lora_rank=SMALL[0],
                 rope_dim=SMALL[1], q_dtype=torch.float32, sharing=sharing)
    assert p.heads_per_program == min(num_heads, 16)
    assert p.has_shared == (sharing == "always")
    assert p.stats["mla_form"] == "absorbed"
    _check(q, kv, qo, lens, table, p)


def test_split_k_and_odd_block_size(device):
    # Long ranges split over the device and merged in the kernel; a block size of 5 runs the generic binary
    # (PAGE_SIZE 0); an empty request, a length-1 request and a prefix ending mid-block.
    q, kv, qo, lens, table = _batch(device, q_lens=[1, 0, 1, 3, 1], kv_lens=[300, 4, 1, 290, 23], block_size=5,
                                    shared_blocks=3, num_heads=16)
    p = plan_mla(qo, lens, table, block_size=5, num_heads=16, sm_scale=0.2, kv_lora_rank=SMALL[0],
                 rope_dim=SMALL[1], q_dtype=torch.float32, sharing="always", min_split_tokens=48)
    items = p.work.items
    pieces = ((items[:, K.ITEM_KIND] == K.KIND_SUFFIX) & (items[:, K.ITEM_REQ] == 0)).sum()
    assert p.num_merge_rows > 0 and pieces > 1  # request 0's own 285 tokens in several split-k chunks
    _check(q, kv, qo, lens, table, p)


def test_deepseek_widths_bf16(device):
    # DeepSeek-V3's 512 + 64 in bf16, decodes and a chunk over a shared prefix; output into a strided out.
    dims = (512, 64)
    q, kv, qo, lens, table = _batch(device, q_lens=[1, 2, 1], kv_lens=[70, 66, 40], block_size=32, shared_blocks=1,
                                    num_heads=16, dims=dims, dtype=torch.bfloat16)
    p = plan_mla(qo, lens, table, block_size=32, num_heads=16, sm_scale=192 ** -0.5, q_dtype=torch.bfloat16,
                 sharing="always")
    out = torch.zeros(q.shape[0], 16, 2 * dims[0], dtype=torch.bfloat16, device=device)[..., ::2]
    got = _check(q, kv, qo, lens, table, p, dims=dims, out=out)
    assert got.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_latent_cache(device, kv_dtype):
    q, kv, qo, lens, table = _batch(device, q_lens=[1, 1, 2], kv_lens=[40, 35, 20], block_size=16, shared_blocks=2,
                                    num_heads=8, dtype=torch.float16)
    kv8 = (kv / 2).to(kv_dtype)
    p = plan_mla(qo, lens, table, block_size=16, num_heads=8, sm_scale=0.3, kv_lora_rank=SMALL[0], rope_dim=SMALL[1],
                 q_dtype=torch.float16, kv_dtype=kv_dtype, sharing="always")
    # One plan, a scale of 1 then others: a float scale of 1 launches without the scale, any other with it.
    for scale in (1.0, 2.0, torch.tensor([2.0], device=device)):
        _check(q, kv8, qo, lens, table, p, kv_scale=scale)


def test_nan_in_one_query_row_stays_there(device):
    q, kv, qo, lens, table = _batch(device, q_lens=[1, 1], kv_lens=[40, 36], block_size=16, shared_blocks=2,
                                    num_heads=4)
    q[0, 1, 3] = float("nan")
    p = plan_mla(qo, lens, table, block_size=16, num_heads=4, sm_scale=0.3, kv_lora_rank=SMALL[0],
                 rope_dim=SMALL[1], q_dtype=torch.float32, sharing="always")
    out = mla_attention(q, kv, p)
    assert torch.isnan(out[0, 1]).all()
    assert torch.isfinite(out[0, [0, 2, 3]]).all() and torch.isfinite(out[1]).all()


def test_absorbed_reference_is_naive_mla():
    # The conventions of mla_attention: the absorbed output times W_UV is naive MLA (keys [k_nope | k_pe] with
    # k_nope = latent @ W_UK, values latent @ W_UV), so q's latent part is q_nope @ W_UK^T per head.
    g = torch.Generator().manual_seed(1)
    h, c, r, nope, vdim, n = 3, 16, 8, 12, 10, 9
    latent, w_uk, w_uv, q_nope, q_pe = (torch.randn(*shape, generator=g).double() for shape in
                                        ((n, c + r), (h, nope, c), (h, c, vdim), (1, h, nope), (1, h, r)))
    scale = (nope + r) ** -0.5
    k = torch.cat([torch.einsum("nc,hdc->hnd", latent[:, :c], w_uk), latent[None, :, c:].expand(h, n, r)], -1)
    v = torch.einsum("nc,hcv->hnv", latent[:, :c], w_uv)
    p = torch.softmax(torch.einsum("hd,hnd->hn", torch.cat([q_nope[0], q_pe[0]], -1), k) * scale, -1)
    naive = torch.einsum("hn,hnv->hv", p, v)
    q_abs = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_uk), q_pe], -1)
    # The reference takes fp32 inputs (computing in fp64): the fp32 rounding of q and the latent bounds the match.
    absorbed = reference_mla_attention(q_abs.float(), latent[None].float(), torch.tensor([0, 1]), torch.tensor([n]),
                                       torch.tensor([[0]]), kv_lora_rank=c, sm_scale=scale, causal=False,
                                       compute_dtype=torch.float64)
    torch.testing.assert_close(torch.einsum("hc,hcv->hv", absorbed[0], w_uv), naive, atol=1e-5, rtol=1e-5)


def test_bad_input(device):
    q, kv, qo, lens, table = _batch(device, q_lens=[1, 1], kv_lens=[20, 20], block_size=16, shared_blocks=1,
                                    num_heads=4)
    kw = dict(block_size=16, num_heads=4, kv_lora_rank=SMALL[0], rope_dim=SMALL[1], q_dtype=torch.float32)
    with pytest.raises(ValueError, match="sm_scale: expected the MLA model's softmax scale"):
        plan_mla(qo, lens, table, sm_scale=None, **kw)
    with pytest.raises(ValueError, match="kv_lora_rank: expected a multiple of 8 in \\[8, 512\\], got 520"):
        plan_mla(qo, lens, table, sm_scale=0.1, **{**kw, "kv_lora_rank": 520})
    with pytest.raises(ValueError, match="rope_dim: expected a multiple of 8 in \\[8, 128\\], got 0"):
        plan_mla(qo, lens, table, sm_scale=0.1, **{**kw, "rope_dim": 0})
    with pytest.raises(ValueError, match="num_heads: expected a positive int, got 0"):
        plan_mla(qo, lens, table, sm_scale=0.1, **{**kw, "num_heads": 0})
    p = plan_mla(qo, lens, table, sm_scale=0.1, **kw)
    with pytest.raises(ValueError, match="q: expected shape \\[\\*, 4, 32\\]"):
        mla_attention(q[..., :-1], kv, p)
    with pytest.raises(ValueError, match="kv_cache: expected shape \\[\\*, 16, 32\\]"):
        mla_attention(q, kv[:, :8], p)
    with pytest.raises(ValueError, match="kv_cache: expected a 3-D tensor"):
        mla_attention(q, kv[:, :, None], p)
    with pytest.raises(ValueError, match="q: expected dtype float32 \\(the plan's q_dtype\\), got float16"):
        mla_attention(q.half(), kv.half(), p)
    with pytest.raises(ValueError, match="kv_cache: expected the dtype of q \\(float32\\) or an fp8 dtype"):
        mla_attention(q, kv.half(), p)
    with pytest.raises(ValueError, match="kv_cache: expected more than"):
        mla_attention(q, kv[:1], p)
    with pytest.raises(ValueError, match="out: expected shape \\(2, 4, 24\\)"):
        mla_attention(q, kv, p, out=torch.empty(2, 4, 32, device=device))
    with pytest.raises(ValueError, match="kv_scale: expected None, a finite positive float"):
        mla_attention(q, kv, p, kv_scale=-1.0)
    with pytest.raises(ValueError, match="plan: expected an MLA plan \\(from prefixattn.plan_mla\\)"):
        mla_attention(q, kv, prefixattn.plan(qo, lens, table, block_size=16, num_qo_heads=4, num_kv_heads=1,
                                             head_dim=32, q_dtype=torch.float32))
    with pytest.raises(ValueError, match="plan: expected a plan from prefixattn.plan, got an MLA plan"):
        prefixattn.attention(q, kv[:, :, None], kv[:, :, None], p)


def test_wrapper_graph_launch_is_fixed_by_the_capacity(device):
    # Two different steps on one use_cuda_graph wrapper: each correct, and both launched with the same grids over the
    # workspace's own tables (what a captured graph replays).
    from prefixattn.launcher import prepared_launches

    kw = dict(num_heads=16, block_size=16, sm_scale=0.3, kv_lora_rank=SMALL[0], rope_dim=SMALL[1],
              q_dtype=torch.float32, max_tokens=16, max_requests=8, max_blocks_per_request=8, device=device)
    attn = prefixattn.MLAPrefixSharedAttention(**kw, use_cuda_graph=True, max_q_len=4)
    launches = []
    for seed, (q_lens, kv_lens) in enumerate((([1, 1, 3], [37, 33, 45]), ([1, 2, 1, 1], [20, 50, 33, 40]))):
        q, kv, qo, lens, table = _batch(device, q_lens=q_lens, kv_lens=kv_lens, block_size=16, shared_blocks=2,
                                        num_heads=16, seed=seed)
        q = torch.cat([q, torch.zeros(16 - q.shape[0], *q.shape[1:], device=device)])  # the graph's padded rows
        p = attn.plan(qo, lens, table)
        assert p.stats["mla_form"] == "absorbed"
        _check(q, kv, qo, lens, table, p, out=torch.empty(16, 16, SMALL[0], device=device), run=attn.run)
        [launch] = prepared_launches(p).values()
        fixed = [i for i in range(len(launch.params.names)) if i not in launch.params.per_call]
        launches.append([(grid, [args[i].data_ptr() if isinstance(args[i], torch.Tensor) else args[i] for i in fixed])
                         for grid, args, *_ in launch.launches])
    assert launches[0] == launches[1]
    # Without capacities: the free plan, as plan_mla.
    free = prefixattn.MLAPrefixSharedAttention(**{k: v for k, v in kw.items() if not k.startswith("max_")})
    _check(q, kv, qo, lens, table, free.plan(qo, lens, table), run=free.run)


def test_wrapper_refuses_what_mla_has_not():
    kw = dict(num_heads=16, block_size=16, sm_scale=0.3, max_tokens=16, max_requests=8, max_blocks_per_request=8,
              device="cpu")
    with pytest.raises(ValueError, match="window_left: expected it off for an MLA plan"):
        prefixattn.MLAPrefixSharedAttention(**kw).plan(torch.tensor([0, 1]), torch.tensor([5]),
                                                       torch.tensor([[0]]), window_left=3)
    with pytest.raises(ValueError, match="logits_soft_cap: expected an option of MLAPrefixSharedAttention"):
        prefixattn.MLAPrefixSharedAttention(**kw, logits_soft_cap=30.0)
    with pytest.raises(ValueError, match="sm_scale: expected the MLA model's softmax scale"):
        prefixattn.MLAPrefixSharedAttention(**{**kw, "sm_scale": None})


@pytest.mark.parametrize("block_size", [1, 64])
def test_token_pool_and_large_pages(device, block_size):
    # SGLang's token pool (1-token pages: PAGE_SIZE 1) and vLLM's 64-token MLA pages, a shared prompt either way.
    q, kv, qo, lens, table = _batch(device, q_lens=[1, 2, 1], kv_lens=[70, 66, 69], block_size=block_size,
                                    shared_blocks=64 // block_size, num_heads=8)
    p = plan_mla(qo, lens, table, block_size=block_size, num_heads=8, sm_scale=0.3, kv_lora_rank=SMALL[0],
                 rope_dim=SMALL[1], q_dtype=torch.float32, sharing="always")
    assert p.has_shared
    _check(q, kv, qo, lens, table, p)
