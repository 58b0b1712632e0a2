"""CUDA graphs in SGLang, everything up to the capture (CPU): the hooks SGLang's decode graph runner and its "full"
prefill graph runner call, in their order, on batches padded as they pad them.

SGLang's runner: ``init_cuda_graph_state(max_bs, max_num_tokens)`` once; per captured size, the capture batch (every
request slot a dummy: ``req_pool_indices`` 0, ``seq_lens`` = the fill value, ``out_cache_loc`` 0) goes through
``init_forward_metadata_out_graph(in_capture=True)``, then warm-up forwards and, inside ``graph.capture()``,
``init_forward_metadata_in_graph`` + the forward. A replay pads the live batch to the captured size (padding:
``req_pool_indices``/``out_cache_loc`` 0, ``seq_lens`` = fill, ``num_padding`` = pad count) and calls
``init_forward_metadata_out_graph`` then ``graph.replay()``, which reruns the in-graph part. A CPU cannot capture;
the tests pin that every replayed step's attention launch has exactly the captured arguments and that its real
rows match SGLang's own torch_native backend on the unpadded batch. The prefill runner: :class:`PrefillGraphRunner`.
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


class PrefillGraphRunner:
    """SGLang's "full" prefill graph runner (``PrefillCudaGraphRunner`` with ``FullCudaGraphBackend``) as the backend
    sees it: static request-slot buffers and bucket-sized token buffers; a capture batch of context-bounded synthetic
    requests then zero-length sentinel slots; a replay writes the live batch into the static buffers (sentinels 0,
    padded tokens 0: slot 0, as ``load_batch`` does) and runs SGLang's own replay-time hook, which hands the backend a
    slot-padded shallow copy of the live batch (its host ``extend_seq_lens_cpu`` still lists the live requests only,
    its ``input_ids`` is the bucket)."""

    def __init__(self, backend, slots: int, bucket: int, context: int):
        import types

        from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

        self.slots, self.bucket = slots, bucket
        zeros = lambda n: torch.zeros(n, dtype=torch.int64)  # noqa: E731
        self.static = {name: zeros(slots) for name in ("seq_lens", "extend_seq_lens", "extend_prefix_lens",
                                                         "req_pool_indices")}
        self.tokens = {name: zeros(bucket) for name in ("input_ids", "out_cache_loc", "positions")}
        lens = [min(context, bucket - start) for start in range(0, bucket, context)]
        lens += [0] * (slots - len(lens))
        for name in ("seq_lens", "extend_seq_lens"):
            self.static[name].copy_(torch.tensor(lens))
        self.static["req_pool_indices"].copy_(torch.arange(slots))
        self.capture_batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=slots, seq_lens_cpu=torch.tensor(lens), seq_lens_sum=bucket,
            **self.static, **self.tokens)
        self.capture_batch.extend_num_tokens = bucket
        self.capture_batch.extend_seq_lens_cpu, self.capture_batch.extend_prefix_lens_cpu = list(lens), [0] * slots
        # SGLang's runner, reduced to what its replay-time metadata hook reads.
        self.sglang = object.__new__(PrefillCudaGraphRunner)
        self.sglang.__dict__.update(
            _is_full_backend=True, _capture_req_slots=slots, _prefill_static_buffers=self.static,
            _full_cg_seq_lens_cpu=zeros(slots), model_runner=types.SimpleNamespace(attn_backend=backend))
        self.shape_key = types.SimpleNamespace(size=bucket)

    def replay(self, fb: ForwardBatch) -> None:
        bs, n = fb.batch_size, int(fb.extend_num_tokens)
        for name, t in self.static.items():
            t.zero_()
            t[:bs] = getattr(fb, name)
        for name, t in self.tokens.items():
            t.zero_()
            t[:n] = getattr(fb, name)
        self.sglang._prepare_forward_metadata_for_replay(fb, self.capture_batch, self.shape_key)


@pytest.mark.parametrize("page_size", [1, 4])
def test_full_prefill_graphs_capture_and_padded_replays_reuse_the_launch(page_size, monkeypatch):
    from prefixattn import prefix_attention

    slots, bucket = 4, 32
    eng = MiniEngine(page_size=page_size)
    peer = TorchNativeAttnBackend(eng.runner(peer_pool := eng.make_pool()))
    ours = PrefixAttnBackend(eng.runner(our_pool := eng.make_pool()), sharing="always")
    runner = PrefillGraphRunner(ours, slots, bucket, context=eng.req_to_token_pool.req_to_token.shape[1])

    # A first request, prefilled eagerly and cached: the prefix the graph steps' requests find.
    r0 = eng.add_request(SYSTEM + DOC + [400, 401, 402, 403])
    fb = eng.batch({r0: 24}, ForwardMode.EXTEND)
    q, k, v = eng.qkv(24)
    for b in (peer, ours):
        b.init_forward_metadata(fb)
        b.forward(q.clone(), k.clone(), v.clone(), eng.layer, fb)
    eng.cache_request(r0)

    # Capture (prefill graphs come before init_cuda_graph_state): the warm-up forward creates the wrapper.
    rec = RecordingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", rec)
    static = tuple(torch.zeros(bucket, *s) for s in ((4 * 64,), (2, 64), (2, 64)))
    for _ in range(2):
        ours.init_forward_metadata_out_graph(runner.capture_batch, in_capture=True)
        ours.forward(*static, eng.layer, runner.capture_batch)
    assert ours._graph is None and len(ours._prefill_graph.wrappers) == 1

    # Replays: four requests prefilling their questions on r0's prefix, then a mixed step (two decodes, a prefill).
    rs = [eng.add_request(SYSTEM + (DOC if i < 2 else []) + [410 + i, 420 + i]) for i in range(4)]
    r5 = eng.add_request(SYSTEM + list(range(430, 440)))
    eng.append_token(r0, 500)
    steps = [({r: len(eng.requests[r].tokens) - eng.requests[r].cached_len for r in rs}, ForwardMode.EXTEND),
             ({r0: 1, r5: len(eng.requests[r5].tokens) - eng.requests[r5].cached_len}, ForwardMode.MIXED)]
    for extend, mode in steps:
        fb = eng.batch(extend, mode)
        n = int(fb.extend_num_tokens)
        q, k, v = eng.qkv(n)
        peer.init_forward_metadata(fb)
        want = peer.forward(q.clone(), k.clone(), v.clone(), eng.layer, fb)
        runner.replay(fb)
        got = ours.forward(*_fill_static(static, (q, k, v)), eng.layer, runner.capture_batch)
        torch.testing.assert_close(got[:n], want, atol=1e-4, rtol=1e-4)
        (p,) = ours.forward_metadata.plans.values()
        assert p.has_shared and p.num_tokens == n  # sentinel slots planned with no query rows

    # One launch per graph work class per forward, with the same arguments at capture and at every replay.
    (graph_attn,) = ours._prefill_graph.wrappers.values()
    per_step = len(graph_attn.graph_work_classes)
    assert len(rec.launches) == 4 * per_step
    launches = [[(grid, {k: a for k, a in args.items() if k != "out_ptr"})  # out: the graph pool's
                 for grid, args in rec.launches[i * per_step:(i + 1) * per_step]] for i in (1, 2, 3)]
    assert launches[0] == launches[1] == launches[2]
    # Every real slot holds the same K/V as the peer's pool; padded tokens wrote only slot 0.
    torch.testing.assert_close(our_pool.get_key_buffer(0)[1:], peer_pool.get_key_buffer(0)[1:], atol=0, rtol=0)


def test_graph_hooks_out_of_order_and_beyond_the_first_capture_are_refused():
    eng = MiniEngine()
    backend = PrefixAttnBackend(eng.runner(eng.make_pool()))
    with pytest.raises(ValueError, match="init_cuda_graph_state: expected it to run before"):
        backend.init_forward_metadata_out_graph(_padded(None, 2), in_capture=True)
    runner = PrefillGraphRunner(backend, slots=2, bucket=16, context=256)
    with pytest.raises(ValueError, match="expected a prefill graph's capture .* before its replays"):
        backend.init_forward_metadata_out_graph(runner.capture_batch)
    runner.capture_batch.forward_mode = ForwardMode.TARGET_VERIFY  # refused before it sizes a prefill graph
    with pytest.raises(NotImplementedError, match="got TARGET_VERIFY"):
        backend.init_forward_metadata_out_graph(runner.capture_batch, in_capture=True)
    assert backend._prefill_graph is None
    runner.capture_batch.forward_mode = ForwardMode.EXTEND
    backend.init_forward_metadata_out_graph(runner.capture_batch, in_capture=True)
    bigger = PrefillGraphRunner(backend, slots=2, bucket=32, context=256)
    with pytest.raises(ValueError, match="at most 16 tokens and 2 request slots .* got 32 tokens and 2 slots"):
        backend.init_forward_metadata_out_graph(bigger.capture_batch, in_capture=True)
    with pytest.raises(NotImplementedError, match="--cuda-graph-backend-prefill full"):
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
