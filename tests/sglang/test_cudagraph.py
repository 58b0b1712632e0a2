"""Decode CUDA graphs in SGLang, everything up to the capture (CPU): the hooks SGLang's decode graph runner calls, in
its order, on batches padded as its buffer registry pads them.

SGLang's runner: ``init_cuda_graph_state(max_bs, max_num_tokens)`` once; per captured size, the capture batch (every
request slot a dummy: ``req_pool_indices`` 0, ``seq_lens`` = the fill value, ``out_cache_loc`` 0) goes through
``init_forward_metadata_out_graph(in_capture=True)``, then warm-up forwards and, inside ``graph.capture()``,
``init_forward_metadata_in_graph`` + the forward. A replay pads the live batch to the captured size (padding:
``req_pool_indices``/``out_cache_loc`` 0, ``seq_lens`` = fill, ``num_padding`` = pad count) and calls
``init_forward_metadata_out_graph`` then ``graph.replay()``, which reruns the in-graph part. A CPU cannot capture;
the tests pin that every replayed step's attention launch has exactly the captured arguments and that its real
rows match SGLang's own torch_native backend on the unpadded batch.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from prefixattn.integrations.sglang.backend import CUDA_GRAPH_SEQ_LEN_FILL, PrefixAttnBackend
from tests.launch_count import RecordingKernel
from tests.sglang.engine import MiniEngine

pytestmark = pytest.mark.sglang

GRAPH_BS = 8  # the captured batch size (SGLang's max_bs here)
SYSTEM = list(range(100, 112))
DOC = list(range(200, 208))


def _padded(fb: ForwardBatch | None, bs: int) -> ForwardBatch:
    """The batch SGLang's decode graph runner hands the backend: padded to ``bs`` request slots (``fb`` None: the
    capture batch, all slots dummies)."""
    raw = 0 if fb is None else fb.batch_size

    def pad(t, value):
        out = torch.full((bs,), value, dtype=torch.int64)
        if raw:
            out[:raw] = t[:raw]
        return out

    seq_lens = pad(None if fb is None else fb.seq_lens, CUDA_GRAPH_SEQ_LEN_FILL)
    view = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=pad(None if fb is None else fb.req_pool_indices, 0), seq_lens=seq_lens,
        out_cache_loc=pad(None if fb is None else fb.out_cache_loc, 0), seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.clone(), positions=torch.zeros(bs, dtype=torch.int64))
    view.num_padding = bs - raw if fb is not None else 0
    return view


def _fill_static(static, live):
    """The graph's static q/k/v (the same tensors at capture and every replay): live rows first, padding zero."""
    for s, t in zip(static, live):
        s.zero_()
        s[:t.shape[0]] = t
    return static


def _graph_step(backend, view, q, k, v, layer, *, capture=False):
    backend.init_forward_metadata_out_graph(view, in_capture=capture)
    backend.init_forward_metadata_in_graph(view)
    return backend.forward(q, k, v, layer, view)


@pytest.mark.parametrize("page_size", [1, 4])
def test_capture_and_padded_replays_reuse_the_launch(page_size, monkeypatch):
    from prefixattn import prefix_attention

    eng = MiniEngine(page_size=page_size)
    peer = TorchNativeAttnBackend(eng.runner(peer_pool := eng.make_pool()))
    ours = PrefixAttnBackend(eng.runner(our_pool := eng.make_pool()), sharing="always")
    ours.init_cuda_graph_state(max_bs=GRAPH_BS, max_num_tokens=GRAPH_BS)
    assert ours.get_cuda_graph_seq_len_fill_value() == CUDA_GRAPH_SEQ_LEN_FILL

    def eager(extend, mode):
        fb = eng.batch(extend, mode)
        q, k, v = eng.qkv(int(sum(extend.values())))
        for b in (peer, ours):
            b.init_forward_metadata(fb)
            b.forward(q.clone(), k.clone(), v.clone(), eng.layer, fb)

    # Prefill a first request, cache it, admit four more on its prefix and prefill their questions (eager).
    r0 = eng.add_request(SYSTEM + DOC + [400, 401, 402, 403])
    eager({r0: 24}, ForwardMode.EXTEND)
    eng.cache_request(r0)
    rs = [eng.add_request(SYSTEM + (DOC if i < 2 else []) + [410 + i, 420 + i]) for i in range(4)]
    eager({r: len(eng.requests[r].tokens) - eng.requests[r].cached_len for r in rs}, ForwardMode.EXTEND)

    # Capture: SGLang's dummy batch; the warm-up forward creates the graph wrapper, the second is the captured one.
    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    capture = _padded(None, GRAPH_BS)
    static = tuple(torch.zeros(GRAPH_BS, *s) for s in ((4 * 64,), (2, 64), (2, 64)))
    _graph_step(ours, capture, *static, eng.layer, capture=True)
    _graph_step(ours, capture, *static, eng.layer, capture=True)
    assert ours.forward_metadata.graph and len(ours._graph.wrappers) == 1

    # Two replays: 3 and then 5 live decodes, padded to the captured size.
    for live in ([r0, rs[0], rs[2]], [r0, *rs]):
        for r in live:
            eng.append_token(r, 500 + r)
        fb = eng.batch({r: 1 for r in live}, ForwardMode.DECODE)
        q, k, v = eng.qkv(len(live))
        peer.init_forward_metadata(fb)
        want = peer.forward(q.clone(), k.clone(), v.clone(), eng.layer, fb)
        got = _graph_step(ours, _padded(fb, GRAPH_BS), *_fill_static(static, (q, k, v)), eng.layer)
        torch.testing.assert_close(got[:len(live)], want, atol=1e-4, rtol=1e-4)
    (p,) = ours.forward_metadata.plans.values()
    assert p.has_shared and p.num_tokens == 5  # padding slots planned with no query rows

    # One launch per graph work class (shared, decode) per forward: the warm-up forward's, the captured ones and
    # the two replays'.
    (graph_attn,) = ours._graph.wrappers.values()
    per_step = len(graph_attn.graph_work_classes)
    assert per_step == 2 and len(rec.launches) == 4 * per_step
    steps = [[(grid, {k: a for k, a in args.items() if k != "out_ptr"})  # out: the graph pool's
              for grid, args in rec.launches[i * per_step:(i + 1) * per_step]] for i in (1, 2, 3)]
    assert steps[0] == steps[1] == steps[2]
    # Every real slot holds the same K/V as the peer's pool; padding wrote only slot 0 (SGLang's padding slot).
    torch.testing.assert_close(our_pool.get_key_buffer(0)[1:], peer_pool.get_key_buffer(0)[1:], atol=0, rtol=0)


def test_prefill_graphs_and_hooks_out_of_order_are_refused():
    eng = MiniEngine()
    backend = PrefixAttnBackend(eng.runner(eng.make_pool()))
    r = eng.add_request(SYSTEM)
    with pytest.raises(ValueError, match="init_cuda_graph_state: expected it to run before"):
        backend.init_forward_metadata_out_graph(_padded(None, 2), in_capture=True)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    with pytest.raises(NotImplementedError, match="--disable-prefill-cuda-graph"):
        backend.init_forward_metadata_out_graph(eng.batch({r: 12}, ForwardMode.EXTEND), in_capture=True)
    with pytest.raises(NotImplementedError, match="--disable-prefill-cuda-graph"):
        backend.init_forward_metadata_for_breakable_cuda_graph_capture(None)


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_in_graph_refill_copies_each_requests_used_pages_only(page_size):
    # A gather of whole req_to_token rows is batch x max context per replay; the refill copies each request slot's
    # ceil(seq_len / page_size) pages and leaves the rest of its row as it was (a sentinel here).
    import types

    eng = MiniEngine(page_size=page_size, max_context=256)
    backend = PrefixAttnBackend(eng.runner(eng.make_pool()))
    backend.init_cuda_graph_state(max_bs=GRAPH_BS, max_num_tokens=GRAPH_BS)
    table = backend._graph.table
    table.fill_(-7)
    r2t = eng.req_to_token_pool.req_to_token
    rows = torch.tensor([3, 1, 5, 0])  # row 0: SGLang's padding row, as a padded slot of a replay
    seq_lens = torch.tensor([9, 1, 200, CUDA_GRAPH_SEQ_LEN_FILL])
    r2t[rows[:3]] = torch.randint(1, 1000, (3, r2t.shape[1]), dtype=torch.int32) * page_size
    view = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=rows, seq_lens=seq_lens,
                                 batch_size=4)
    backend.init_forward_metadata_in_graph(view)
    for r in range(4):
        used = -(-int(seq_lens[r]) // page_size)
        assert table[r, :used].tolist() == (r2t[rows[r], ::page_size][:used] // page_size).tolist()
        assert (table[r, used:] == -7).all(), f"slot {r}: pages past its used length were written"
    assert (table[4:] == -7).all()  # slots past the batch are not touched
