"""Eager SGLang steps (extend, mixed, decode without a graph) plan into one capacity-sized wrapper per layer
geometry: every step reuses the same device buffers and reads the step's device block table (gathered from
``req_to_token``) in place; a step beyond the runner's limits falls back to a per-step plan() and is counted."""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

import prefixattn
from prefixattn.integrations.sglang.backend import PrefixAttnBackend
from tests.sglang.engine import MiniEngine
from tests.tolerances import ATTENTION_TOL

pytestmark = pytest.mark.sglang

SYSTEM = list(range(100, 112))  # 12 tokens: 3 pages of 4


def _step(eng, backend, extend, mode):
    """One layer of one step through the backend, checked against the fp32 reference on the pool after the write."""
    fb = eng.batch(extend, mode)
    q, k, v = eng.qkv(int(sum(extend.values())))
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, eng.layer, fb)
    meta = backend.forward_metadata
    (p,) = meta.plans.values()
    k_cache = backend._paged(backend.token_to_kv_pool.get_key_buffer(0), "key")
    v_cache = backend._paged(backend.token_to_kv_pool.get_value_buffer(0), "value")
    ref = prefixattn.reference_attention(q.view(-1, eng.num_heads, eng.head_dim), k_cache, v_cache, meta.qo_indptr,
                                         meta.kv_lens, meta.block_table)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(out.view(ref.shape), ref, atol=atol, rtol=rtol)
    return p


def _addresses(p) -> dict:
    return {name: getattr(p, name).data_ptr() for name in ("items", "gather", "mrows", "counters",
                                                            "ws_o", "ws_lse")}


def _session(eng, backend):
    """A cached system prompt, then steps of different shapes: two extends sharing it, a decode of three."""
    r0 = eng.add_request(SYSTEM + [1, 2, 3, 4])
    plans = [_step(eng, backend, {r0: 16}, ForwardMode.EXTEND)]
    eng.cache_request(r0)
    r1, r2 = eng.add_request(SYSTEM + [5, 6, 7, 8, 9]), eng.add_request(SYSTEM + [10, 11])
    plans.append(_step(eng, backend, {r1: 5, r2: 2}, ForwardMode.EXTEND))
    for r in (r0, r1, r2):
        eng.append_token(r, 500 + r)
    plans.append(_step(eng, backend, {r0: 1, r1: 1, r2: 1}, ForwardMode.DECODE))
    return plans


def test_eager_steps_of_different_shapes_reuse_one_workspace():
    eng = MiniEngine(page_size=4)
    runner = eng.runner(eng.make_pool())
    runner.server_args = types.SimpleNamespace(chunked_prefill_size=64)
    runner.max_running_requests = 8
    backend = PrefixAttnBackend(runner, sharing="always")
    assert backend.eager_capacity == dict(max_tokens=64, max_requests=8)
    plans = _session(eng, backend)
    (attn,) = backend.eager_wrappers.values()  # one layer geometry, one wrapper
    ws = attn.workspace
    assert all(p.workspace is ws for p in plans) and backend.capacity_fallbacks == 0
    _, extend, decode = plans
    assert extend.has_shared and decode.has_shared and extend.num_tokens != decode.num_tokens
    assert _addresses(extend) == _addresses(decode)  # the same device buffers at every step
    assert _addresses(decode)["items"] == ws.items.data_ptr() and _addresses(decode)["ws_o"] == ws.ws_o.data_ptr()
    assert decode.block_table is backend.forward_metadata.device_block_table  # the step's device table, in place


def test_a_step_beyond_the_runner_limits_falls_back_to_a_per_step_plan(caplog):
    eng = MiniEngine(page_size=4)
    runner = eng.runner(eng.make_pool())
    runner.server_args = types.SimpleNamespace(chunked_prefill_size=16)
    runner.max_running_requests = 2
    backend = PrefixAttnBackend(runner, sharing="always")
    with caplog.at_level("WARNING"):
        first, extend, decode = _session(eng, backend)  # 16 tokens, 2 requests fit; 3 requests do not
    assert first.workspace is extend.workspace is not None and decode.workspace is None
    assert backend.capacity_fallbacks == 1
    assert "max_requests: expected at most 2" in caplog.text and "capacity_fallbacks" in caplog.text


def test_eager_capacity_from_the_runner(monkeypatch):
    import prefixattn.integrations.sglang.startup as startup

    eng = MiniEngine(page_size=4)
    pool = eng.make_pool()
    runner = eng.runner(pool)  # a bare runner outside a server: the pool's slots and the request pool's size
    monkeypatch.setattr(startup, "_published_schedule", lambda: None)
    assert PrefixAttnBackend(runner).eager_capacity == dict(max_tokens=pool.size,
                                                            max_requests=eng.req_to_token_pool.size)
    # --chunked-prefill-size unset: the size SGLang resolved at start-up
    monkeypatch.setattr(startup, "_published_schedule",
                        lambda: types.SimpleNamespace(chunked_prefill_size=96, max_prefill_tokens=16384))
    runner.server_args = types.SimpleNamespace(chunked_prefill_size=None, max_prefill_tokens=None)
    runner.max_running_requests = 8
    assert PrefixAttnBackend(runner).eager_capacity == dict(max_tokens=96, max_requests=8)
    # chunking off: max(--max-prefill-tokens, context length); decode steps: one token per running request
    runner.server_args = types.SimpleNamespace(chunked_prefill_size=-1, max_prefill_tokens=100)
    runner.model_config = types.SimpleNamespace(context_len=200)
    assert PrefixAttnBackend(runner).eager_capacity == dict(max_tokens=200, max_requests=8)
    runner.max_running_requests = 300
    assert PrefixAttnBackend(runner).eager_capacity == dict(max_tokens=300, max_requests=300)


def _runner_with_a_model(eng, **server_args):
    """A runner whose model has SGLang RadixAttention layers of two geometries (as a model's modules())."""
    from sglang.srt.layers.radix_attention import RadixAttention

    runner = eng.runner(eng.make_pool())
    runner.dtype = torch.float32
    runner.server_args = types.SimpleNamespace(**server_args)
    runner.max_running_requests = 4
    runner.model_config = types.SimpleNamespace(context_len=200)
    windowed = RadixAttention(eng.num_heads, eng.head_dim, eng.head_dim ** -0.5, eng.num_kv_heads, layer_id=1,
                              sliding_window_size=15)
    runner.model = torch.nn.ModuleList([eng.layer, windowed])
    return runner


def test_eager_workspaces_are_allocated_at_start_up():
    # Built with the backend (SGLang builds it at start-up, after its KV pool), one per layer geometry of the model:
    # an out-of-memory is a start-up error, not the first request's; the steps then use exactly these.
    eng = MiniEngine(page_size=4)
    backend = PrefixAttnBackend(_runner_with_a_model(eng, chunked_prefill_size=64), sharing="always")
    assert len(backend.eager_wrappers) == 2  # full attention and the 15-token window: two plans per step
    before = dict(backend.eager_wrappers)
    plans = _session(eng, backend)
    assert backend.eager_wrappers == before  # no wrapper made at a step
    (attn,) = [a for key, a in before.items() if key[-1] == -1]
    assert all(p.workspace is attn.workspace for p in plans)


def test_without_chunked_prefill_the_context_length_workspace_is_allocated_at_start_up():
    # --chunked-prefill-size -1: a step may prefill a whole context, so the capacity is the context length; its
    # workspace is allocated (or fails) when the backend is built.
    eng = MiniEngine(page_size=4)
    backend = PrefixAttnBackend(_runner_with_a_model(eng, chunked_prefill_size=-1, max_prefill_tokens=100))
    assert backend.eager_capacity == dict(max_tokens=200, max_requests=4)
    assert {a.workspace.capacity.max_tokens for a in backend.eager_wrappers.values()} == {200}


def test_a_workspace_that_does_not_fit_is_a_start_up_error_naming_the_setting(monkeypatch):
    import prefixattn.integrations.sglang.backend as backend_module

    eng = MiniEngine(page_size=4)

    def out_of_memory(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(backend_module.prefixattn, "PrefixSharedAttention", out_of_memory)
    with pytest.raises(RuntimeError, match="eager attention workspace for 200 tokens .* --chunked-prefill-size"):
        PrefixAttnBackend(_runner_with_a_model(eng, chunked_prefill_size=-1, max_prefill_tokens=100))
