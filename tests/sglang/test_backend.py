"""The prefixattn SGLang backend against SGLang's own torch_native backend, on SGLang's real pools and batches.

One scenario, run as an engine would: a first request is prefilled and cached in the radix cache; four more arrive
and get its system prompt (and, for two of them, its document) as cached slots; everyone decodes; a sixth request is
chunk-prefilled, its second chunk in a MIXED batch with five decodes. At every step both backends compute the same
layer on their own KV pools and must agree, and the plan must have found exactly the prefixes the radix cache
shared (the same slot ids), not the ones that are merely equal tokens (the two requests with document B each
computed it themselves).
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from prefixattn.integrations.sglang.backend import PrefixAttnBackend
from tests.sglang.engine import MiniEngine

pytestmark = pytest.mark.sglang

#: ours vs SGLang's torch_native. Both are checked against exact math elsewhere (ours: tests/tolerances.py
#: ATTENTION_TOL vs the fp32 reference; torch_native: ~1e-3 in fp16 per ../shared/notes/engines-on-cpu.md), so the
#: gap between them is bounded by the sum: fp16 2e-3 + 1e-3; fp32 1e-4 covers both (torch_native fp32 is ~5e-7).
PEER_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3)}

SYSTEM = list(range(100, 112))   # 12 tokens: 3 pages of 4
DOC_A = list(range(200, 208))    # 8 tokens: 2 pages
DOC_B = list(range(300, 308))


def _question(i: int, n: int = 4) -> list[int]:
    return [400 + 10 * i + j for j in range(n)]


class Side:
    """One backend over its own KV pool."""

    def __init__(self, engine: MiniEngine, make):
        self.pool = engine.make_pool()
        self.backend = make(engine.runner(self.pool))


def _step(engine, sides, extend, mode):
    fb = engine.batch(extend, mode)
    q, k, v = engine.qkv(int(sum(extend.values())))
    outs = []
    for side in sides:
        side.backend.init_forward_metadata(fb)
        outs.append(side.backend.forward(q.clone(), k.clone(), v.clone(), engine.layer, fb))
    return outs


def _shared_groups(backend: PrefixAttnBackend):
    """(members as batch indices, kv_end) of every shared node of the step's plan."""
    (p,) = backend.forward_metadata.plans.values()  # one layer geometry -> one plan per step
    return {(frozenset(n.requests.tolist()), n.kv_end) for n in p.shared_nodes}


def _assert_close(ours, peer, dtype):
    atol, rtol = PEER_TOL[dtype]
    torch.testing.assert_close(ours.float(), peer.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch_native_through_a_radix_cache_session(page_size, dtype):
    eng = MiniEngine(page_size=page_size, dtype=dtype)
    peer = Side(eng, TorchNativeAttnBackend)
    ours = Side(eng, lambda runner: PrefixAttnBackend(runner, sharing="always"))
    sides = [peer, ours]

    # 1. First request, computed from scratch (EXTEND, nothing cached).
    r0 = eng.add_request(SYSTEM + DOC_A + _question(0))
    o_peer, o_ours = _step(eng, sides, {r0: 24}, ForwardMode.EXTEND)
    _assert_close(o_ours, o_peer, dtype)
    assert _shared_groups(ours.backend) == set()
    eng.cache_request(r0)

    # 2. Four requests reuse the cache: r1, r2 get system + document A (20 slots), r3, r4 only the system prompt.
    r1, r2, r3, r4 = (eng.add_request(SYSTEM + doc + _question(i)) for i, doc in
                      ((1, DOC_A), (2, DOC_A), (3, DOC_B), (4, DOC_B)))
    assert [eng.requests[r].cached_len for r in (r1, r2, r3, r4)] == [20, 20, 12, 12]
    o_peer, o_ours = _step(eng, sides, {r1: 4, r2: 4, r3: 12, r4: 12}, ForwardMode.EXTEND)
    _assert_close(o_ours, o_peer, dtype)
    # Causal extend shares only what every query row sees: the cached prefixes.
    assert _shared_groups(ours.backend) == {(frozenset({0, 1, 2, 3}), 12), (frozenset({0, 1}), 20)}
    for r in (r1, r2, r3, r4):
        eng.cache_request(r)

    # 3. Everyone decodes a token: 0-2 share system + document A, all five the system prompt.
    for r in range(5):
        eng.append_token(r, 500 + r)
    o_peer, o_ours = _step(eng, sides, {r: 1 for r in range(5)}, ForwardMode.DECODE)
    _assert_close(o_ours, o_peer, dtype)
    assert _shared_groups(ours.backend) == {(frozenset({0, 1, 2, 3, 4}), 12), (frozenset({0, 1, 2}), 20)}

    # 4. Chunked prefill: r5 gets system + document B from r3's cache entry, computes 3 of its 6 question tokens...
    r5 = eng.add_request(SYSTEM + DOC_B + _question(5, n=6))
    assert eng.requests[r5].cached_len == 20
    o_peer, o_ours = _step(eng, sides, {r5: 3}, ForwardMode.EXTEND)
    _assert_close(o_ours, o_peer, dtype)

    # 5. ...and the other 3 in a MIXED batch with a decode step of the five others.
    for r in range(5):
        eng.append_token(r, 600 + r)
    o_peer, o_ours = _step(eng, sides, {**{r: 1 for r in range(5)}, r5: 3}, ForwardMode.MIXED)
    _assert_close(o_ours, o_peer, dtype)
    assert _shared_groups(ours.backend) == {
        (frozenset({0, 1, 2, 3, 4, 5}), 12), (frozenset({0, 1, 2}), 20), (frozenset({3, 5}), 20)}

    # Both backends wrote the same K/V into the same slots.
    torch.testing.assert_close(ours.pool.get_key_buffer(0), peer.pool.get_key_buffer(0), atol=0, rtol=0)
    torch.testing.assert_close(ours.pool.get_value_buffer(0), peer.pool.get_value_buffer(0), atol=0, rtol=0)


def test_default_sharing_mode_matches_torch_native_on_decode():
    """The backend as SGLang builds it (cost rule decides what to share) on a decode step with shared prefixes."""
    eng = MiniEngine()
    peer = Side(eng, TorchNativeAttnBackend)
    ours = Side(eng, PrefixAttnBackend)
    assert ours.backend.sharing == "auto"
    r0 = eng.add_request(SYSTEM + DOC_A + _question(0))
    _step(eng, [peer, ours], {r0: 24}, ForwardMode.EXTEND)
    eng.cache_request(r0)
    rs = [eng.add_request(SYSTEM + DOC_A + _question(i)) for i in range(1, 4)]
    _step(eng, [peer, ours], {r: 4 for r in rs}, ForwardMode.EXTEND)
    for r in [r0, *rs]:
        eng.append_token(r, 700 + r)
    o_peer, o_ours = _step(eng, [peer, ours], {r: 1 for r in [r0, *rs]}, ForwardMode.DECODE)
    _assert_close(o_ours, o_peer, torch.float32)


def test_refuses_what_it_does_not_implement():
    eng = MiniEngine()
    backend = PrefixAttnBackend(eng.runner(eng.make_pool()))
    r = eng.add_request(SYSTEM)
    fb = eng.batch({r: 12}, ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    q, k, v = eng.qkv(12)

    fb.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(NotImplementedError, match="supports DECODE, EXTEND and MIXED batches, got TARGET_VERIFY"):
        backend.init_forward_metadata(fb)

    runner = eng.runner(eng.make_pool())
    runner.token_to_kv_pool = object()
    with pytest.raises(ValueError, match="token_to_kv_pool: expected SGLang's MHATokenToKVPool"):
        PrefixAttnBackend(runner)


def _extend_of_12_rows(eng):
    """A fresh pool and backend on ``eng``, one 12-row extend of the system prompt with its metadata initialized:
    ``(pool, backend, forward_batch, (q, k, v))``."""
    pool = eng.make_pool()
    backend = PrefixAttnBackend(eng.runner(pool))
    r = eng.add_request(SYSTEM)
    fb = eng.batch({r: 12}, ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    return pool, backend, fb, eng.qkv(12)


def _paged_caches(backend, pool):
    """Layer 0's K and V pools as the backend pages them for the kernel (and the reference)."""
    return backend._paged(pool.get_key_buffer(0), "key"), backend._paged(pool.get_value_buffer(0), "value")


def test_logit_cap_window_and_sinks_run_in_the_kernel():
    """Gemma-2-like ``layer.logit_cap`` and ``layer.sliding_window_size``, gpt-oss-like ``sinks`` (the forward
    keyword SGLang passes) against the reference on the backend's own pool and metadata (12 rows, window 5)."""
    import prefixattn

    eng = MiniEngine()
    pool, backend, fb, (q, k, v) = _extend_of_12_rows(eng)
    q = q * 4  # logits large enough for the cap to bend them
    eng.layer.logit_cap = 2.0
    eng.layer.sliding_window_size = 5  # FlashInfer's window_left, as SGLang's backends read it
    sinks = torch.tensor([0.5, -1.0, 3.0, -2.0])
    o = backend.forward(q, k, v, eng.layer, fb, sinks=sinks)
    meta = backend.forward_metadata
    k_cache, v_cache = _paged_caches(backend, pool)
    q3 = q.reshape(-1, eng.num_heads, eng.head_dim)
    want = prefixattn.reference_attention(q3, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.block_table,
                                          sm_scale=float(eng.layer.scaling), logits_soft_cap=2.0, sinks=sinks,
                                          window_left=5)
    plain = prefixattn.reference_attention(q3, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.block_table,
                                           sm_scale=float(eng.layer.scaling))
    assert (want - plain).abs().max() > 0.05, "cap, window and sinks change the answer"
    torch.testing.assert_close(o.view_as(q3), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_with_per_tensor_scales(kv_dtype):
    """An fp8 pool with SGLang's layer scales: the pool holds k / k_scale (set_kv_buffer quantizes a copy, the
    caller's k is untouched) and the kernel reads it back times k_scale; checked against the reference on the pool's
    own bytes, and the scales must matter."""
    import prefixattn

    eng = MiniEngine(kv_dtype=kv_dtype)
    pool, backend, fb, (q, k, v) = _extend_of_12_rows(eng)
    k_in, v_in = k.clone(), v.clone()
    layer = eng.layer
    layer.k_scale, layer.v_scale = torch.nn.Parameter(torch.tensor(0.25)), torch.nn.Parameter(torch.tensor(2.0))
    layer.k_scale_float, layer.v_scale_float = 0.25, 2.0
    o = backend.forward(q, k, v, layer, fb)
    assert torch.equal(k, k_in) and torch.equal(v, v_in)
    k_cache, v_cache = _paged_caches(backend, pool)
    assert k_cache.dtype == kv_dtype
    slots = fb.out_cache_loc
    torch.testing.assert_close(pool.get_key_buffer(0)[slots].float(), (k_in / 0.25).to(kv_dtype).float())
    meta = backend.forward_metadata
    q3 = q.reshape(-1, eng.num_heads, eng.head_dim)
    args = (q3, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.block_table)
    want = prefixattn.reference_attention(*args, sm_scale=float(layer.scaling), k_scale=0.25, v_scale=2.0)
    unscaled = prefixattn.reference_attention(*args, sm_scale=float(layer.scaling))
    assert (want - unscaled).abs().max() > 0.5, "the scales change the answer"
    torch.testing.assert_close(o.view_as(q3), want, atol=1e-4, rtol=1e-4)
    # The step's plans price the pool's 1-byte KV in the sharing cost rule, not q's dtype.
    assert {p.kv_dtype for p in meta.plans.values()} == {kv_dtype}
