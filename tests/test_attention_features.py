"""The kernel's features against the reference: any head size (multiple of 8, 32..256), logit soft-capping,
attention sinks, fp8 KV caches with per-tensor scales and sliding windows, each next to shared prefixes and split-k
merges (interpreter on CPU: small grids)."""

from __future__ import annotations

import math

import pytest
import torch

from prefixattn import attention, plan, reference_attention
from prefixattn.kernels import layout as K
from tests.prefix_batches import make_batch
from tests.tolerances import ATTENTION_TOL, LSE_TOL


def _to(batch, device):
    for name in ("q", "k_cache", "v_cache", "qo_indptr", "kv_lens", "block_table"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def _compare(got, want, dtype):
    (o, lse), (o_ref, lse_ref) = got, want
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(o.float(), o_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_ref, atol=LSE_TOL[0], rtol=LSE_TOL[1])


def _shared_batch(device, *, head_dim=64, dtype=torch.float32, seed=0, **kw):
    # Two requests under a 2-block shared prefix (one decode, one 5-row prefill chunk), one alone with 3 rows.
    args = dict(q_lens=[1, 5, 3], extra_lens=[3, 9, 6], paths=[("a",), ("a",), ()], level_blocks={"a": 2},
                block_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    args.update(kw)
    return _to(make_batch(seed, **args), device)


@pytest.mark.parametrize("head_dim, dtype", [(32, torch.float32), (40, torch.float16), (112, torch.float32),
                                             (192, torch.bfloat16)])
def test_any_head_size_multiple_of_8(device, head_dim, dtype):
    # Padded tiles (BLOCK_D 32, 64, 128, 256) masked at head_dim; shared node, suffixes and a split-k merge.
    b = _shared_batch(device, head_dim=head_dim, dtype=dtype)
    p = plan(*b.metadata, **b.heads, q_dtype=dtype, sharing="always", num_sms=4, min_split_tokens=4)
    assert p.shared_nodes and p.work.num_ws_rows > 0
    got = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True)
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True)
    _compare(got, want, dtype)


def _run(b, *, plan_kw=None, attn_kw=None, ref_kw=None):
    plan_kw, attn_kw = dict(plan_kw or {}), dict(attn_kw or {})
    p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, **plan_kw)
    got = attention(b.q, b.k_cache, b.v_cache, p, return_lse=True, **attn_kw)
    ref = {k: plan_kw[k] for k in ("logits_soft_cap", "window_left") if k in plan_kw}
    ref.update(attn_kw)
    ref.update(ref_kw or {})
    want = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True, **ref)
    return p, got, want


#: Shared node + suffixes + split-k merges in one launch (tiny grid).
_SPLIT = dict(sharing="always", num_sms=4, min_split_tokens=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plan_kw", [_SPLIT, dict(sharing="never")], ids=["shared-split", "plain"])
def test_logit_soft_cap(device, dtype, plan_kw):
    b = _shared_batch(device, dtype=dtype)
    b.q = b.q * 6  # logits of |s| ~ 5-20: the cap (3.0) bends them hard
    p, got, want = _run(b, plan_kw=dict(logits_soft_cap=3.0, **plan_kw))
    plain = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata)
    assert (want[0] - plain).abs().max() > 0.1, "the cap changes the answer"
    assert p.logits_soft_cap == 3.0
    _compare(got, want, dtype)


_SINKS = [0.5, -1.0, 6.0, -math.inf]


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plan_kw", [_SPLIT, dict(sharing="never")], ids=["merged", "single-state"])
def test_sinks_once_per_row(device, plan_kw, sink_dtype):
    # Merged rows (shared levels + split chunks) get the sink at the last-arriver merge, single-state rows at their
    # store: exactly once either way, so both agree with the reference (a sink per partial would not). Sinks in
    # the model's dtype (gpt-oss keeps bf16 ones) are upcast in the kernel.
    b = _shared_batch(device)
    sinks = torch.tensor(_SINKS, device=device).to(sink_dtype)
    p, got, want = _run(b, plan_kw=plan_kw, attn_kw=dict(sinks=sinks))
    assert (p.work.num_ws_rows > 0) == (plan_kw is _SPLIT)
    _compare(got, want, torch.float32)


def test_sinks_with_chunks_a_row_does_not_see(device):
    # A causal prefill split in chunks: early rows get empty (0, -inf) partials from later chunks, and the sink
    # must still be counted once; the returned LSE includes it.
    b = _shared_batch(device, q_lens=[24], extra_lens=[24], paths=[()], level_blocks={})
    sinks = torch.tensor(_SINKS, device=device)
    p, got, want = _run(b, plan_kw=dict(num_sms=4, min_split_tokens=4), attn_kw=dict(sinks=sinks))
    assert p.work.num_ws_rows > 0
    _compare(got, want, torch.float32)
    plain = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata, return_lse=True)
    torch.testing.assert_close(got[1][:, 0], torch.logaddexp(plain[1][:, 0], torch.tensor(0.5)), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_fp8_kv_cache_next_to_shared_prefixes(device, kv_dtype, q_dtype):
    # fp8 pages: the shared prefix is dequantized once per tile for all its requests; tensor and float scales.
    b = _shared_batch(device, dtype=q_dtype)
    b.k_cache, b.v_cache = (b.k_cache.float() * 4).to(kv_dtype), (b.v_cache.float() * 2).to(kv_dtype)
    scales = dict(k_scale=0.25, v_scale=torch.tensor([0.5], device=device))
    p, got, want = _run(b, plan_kw=_SPLIT, attn_kw=scales)
    assert p.shared_nodes and p.work.num_ws_rows > 0
    _compare(got, want, q_dtype)
    # Both scales as tensors (vLLM's layer._k_scale / _v_scale), no scales (1.0).
    for kw in (dict(k_scale=torch.tensor([0.25], device=device), v_scale=torch.tensor([0.5], device=device)), {}):
        _, got, want = _run(b, plan_kw=_SPLIT, attn_kw=kw)
        _compare(got, want, q_dtype)


def test_kv_dtype_must_be_q_dtype_or_fp8(device):
    b = _shared_batch(device, dtype=torch.float16)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache: expected the dtype of q \\(float16\\) or an fp8 dtype"):
        attention(b.q, b.k_cache.bfloat16(), b.v_cache.bfloat16(), p)
    with pytest.raises(ValueError, match="v_cache: expected the dtype of k_cache"):
        attention(b.q, b.k_cache.to(torch.float8_e4m3fn), b.v_cache.to(torch.float8_e5m2), p)
    with pytest.raises(ValueError, match="k_scale: expected a 1-element tensor"):
        attention(b.q, b.k_cache, b.v_cache, p, k_scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="sinks: expected shape \\(4,\\)"):
        attention(b.q, b.k_cache, b.v_cache, p, sinks=torch.zeros(2, device=device))


# (q_lens, extra_lens, shared blocks, window_left, why)
WINDOW_CASES = [
    ([1, 5, 3], [3, 9, 6], 2, 5, "edge inside a block (block_size 4)"),
    ([1, 9, 3], [3, 11, 6], 2, 2, "window shorter than the query chunk"),
    ([1, 1, 2], [2, 7, 3], 6, 10, "window starts inside the shared prefix"),
    ([1, 1, 2], [2, 3, 3], 6, 100, "window covers everything: sharing kept"),
    ([1, 4, 2], [1, 5, 3], 6, 0, "each query sees only itself"),
    ([1, 1, 8], [100, 110, 120], 2, 70, "window wider than a KV tile: edge tiles, full tiles, split chunks"),
]


@pytest.mark.parametrize("q_lens, extra, blocks, window, why", WINDOW_CASES, ids=[c[4] for c in WINDOW_CASES])
@pytest.mark.parametrize("plan_kw", [_SPLIT, dict(sharing="always")], ids=["split", "unsplit"])
# fp32 q masks the window edge in the middle KV loop, 16-bit q runs it in a loop of its own (_attend_item).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(device, q_lens, extra, blocks, window, why, plan_kw, dtype):
    b = _shared_batch(device, q_lens=q_lens, extra_lens=extra, level_blocks={"a": blocks}, dtype=dtype)
    long = window == 70
    if long and plan_kw is _SPLIT:
        plan_kw = dict(plan_kw, num_sms=64, min_split_tokens=16)
    p, got, want = _run(b, plan_kw=dict(window_left=window, **plan_kw))
    full = reference_attention(b.q, b.k_cache, b.v_cache, *b.metadata)
    if long and dtype == torch.float32:  # the 8-row chunk's window edge spans more than an fp32 KV tile
        assert max(p.tiles.chunk.block_n, p.tiles.decode.block_n) < window - 8
        assert p.work.num_ws_rows > 0 or "num_sms" not in plan_kw, "the long suffixes are split"
    if window < 100:
        assert (want[0] - full).abs().max() > 1e-3, "the window hides keys"
    else:
        assert p.shared_nodes, "a window that covers the whole prefix keeps it shared"
    _compare(got, want, dtype)


def test_window_shares_only_what_every_member_sees(device):
    # Three decodes under a 6-block (24-token) prefix; request 2 is far past it. With W = 30 requests 0 and 1 see
    # the whole prefix, request 2 only its tail: it leaves the node, whose members read it once.
    b = _shared_batch(device, q_lens=[1, 1, 1], extra_lens=[2, 3, 20], paths=[("a",)] * 3, level_blocks={"a": 6})
    p, got, want = _run(b, plan_kw=dict(window_left=30, sharing="always"))
    assert [n.requests.tolist() for n in p.shared_nodes] == [[0, 1]]
    _compare(got, want, torch.float32)
    # Far windows: nobody sees the whole prefix, nothing is shared, and suffixes skip what no row sees.
    p, got, want = _run(b, plan_kw=dict(window_left=3, sharing="always"))
    assert not p.shared_nodes and p.kv_bytes_read(4) < 3 * 8 * 2 * 64 * 4 * 2
    _compare(got, want, torch.float32)


def test_all_features_together(device, monkeypatch):
    from prefixattn import prefix_attention
    from prefixattn.autotune.config_space import FP8_DECODE_NARROW_BLOCK_N, FP8_SWITCHED_DECODE_MAX_REGS
    from tests.launch_count import RecordingKernel

    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    b = _shared_batch(device, dtype=torch.bfloat16, head_dim=72, q_lens=[1, 6, 3], extra_lens=[2, 9, 6],
                      level_blocks={"a": 4})
    b.k_cache, b.v_cache = b.k_cache.to(torch.float8_e4m3fn), b.v_cache.to(torch.float8_e4m3fn)
    attn_kw = dict(sinks=torch.tensor(_SINKS, device=device), k_scale=torch.tensor([0.7], device=device),
                   v_scale=1.5)
    _, got, want = _run(b, plan_kw=dict(logits_soft_cap=2.0, window_left=7, **_SPLIT), attn_kw=attn_kw)
    _compare(got, want, torch.bfloat16)
    # The launch carries the model switches' fp8 rule (head_dim 72 pads to 128; NVIDIA's tables): 16-position KV
    # tiles at most 128 registers for the decode class (LaunchOptions.for_kv, fp8_block_n).
    decode = [args for _, args in rec.launches if args["BLOCK_M"] <= 16 and not args["IS_SHARED"]]
    assert decode and all(a["BLOCK_N"] == FP8_DECODE_NARROW_BLOCK_N for a in decode)
    assert all(a.get("maxnreg") == FP8_SWITCHED_DECODE_MAX_REGS for a in decode)


def test_fp8_e4m3_is_refused_on_gpus_before_sm89(monkeypatch):
    # Triton compiles float8_e4m3fn loads for NVIDIA from sm_89 on (compile-check: sm80 fails to compile them).
    from types import SimpleNamespace

    from prefixattn import validation

    cache = SimpleNamespace(dtype=torch.float8_e4m3fn, device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(validation, "_capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match="k_cache: expected float8_e5m2 on this GPU \\(compute capability 8.0"):
        validation.check_fp8_support("k_cache", cache)
    validation.check_fp8_support("k_cache", SimpleNamespace(dtype=torch.float8_e5m2, device=cache.device))
    monkeypatch.setattr(validation, "_capability", lambda index: (9, 0))
    validation.check_fp8_support("k_cache", cache)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_whole_tiles_then_the_tail(device, dtype):
    # The KV loops run whole BLOCK_N tiles unmasked, then the tiles with masked keys: shared nodes of exactly whole
    # tiles (no tail), of whole tiles and a tail, and shorter than a tile; chunks whose diagonal starts mid-tile.
    n = 32 if dtype == torch.float32 else 64  # the heuristic tiles' BLOCK_N at head_dim 64 (asserted below)
    block_size = 4
    b = _to(make_batch(5, q_lens=[1, 7, 1, 3, 1, 2], extra_lens=[3, n + 9, 1, 5, 2, 4],
                       paths=[("x",), ("x",), ("y",), ("y",), ("z",), ("z",)],
                       level_blocks={"x": 2 * n // block_size, "y": (n + 8) // block_size, "z": 2},
                       block_size=block_size, num_qo_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype), device)
    p, got, want = _run(b, plan_kw=dict(sharing="always", min_split_tokens=4 * n))
    assert p.tiles.shared.block_n == n
    items = p.work.items[p.work.items[:, K.ITEM_KIND] == K.KIND_SHARED]
    lengths = set((items[:, K.ITEM_KV_END] - items[:, K.ITEM_KV_START]).tolist())
    assert {2 * n, n + 8, 8} <= lengths, lengths
    _compare(got, want, dtype)


def test_zero_sm_scale_weighs_every_key_alike(device):
    # A scale of 0 is allowed (>= 0): every visible key gets the same weight, in masked and unmasked tiles alike.
    b = _shared_batch(device, dtype=torch.float32)
    _, got, want = _run(b, plan_kw=dict(_SPLIT, sm_scale=0.0), ref_kw=dict(sm_scale=0.0))
    _compare(got, want, torch.float32)


def test_a_negative_tensor_k_scale_gives_nan(device):
    # plan() refuses a negative sm_scale; a tensor K scale is read on the device, so a negative one makes the output
    # NaN rather than a softmax of the wrong sign.
    b = _shared_batch(device, dtype=torch.float32)
    p = plan(*b.metadata, **b.heads, q_dtype=torch.float32, **_SPLIT)
    out = attention(b.q, b.k_cache, b.v_cache, p, k_scale=torch.tensor([-0.5], device=device))
    assert out.isnan().all()
