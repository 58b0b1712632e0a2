"""bench/peers/flashinfer.py against a signature-faithful stand-in for FlashInfer 0.6.0 (fake_flashinfer.py): every
peer's constructor, plan and run calls are made with the real parameter names, its paged lists and cuda-graph buffers
must describe the batch, and its output must match the fp32 reference. What this cannot show: FlashInfer's kernels
themselves (speed, numerics, capture), which only a GPU run of scripts/gpu_check.sh measures."""

import sys

import pytest
import torch

from batches.shapes import Shape, build_batch

from prefixattn import reference_attention

from . import fake_flashinfer

SHAPES = [
    Shape(scenario="decode", num_decode=5, num_prefill=0, shared=32, distinct=9, per_group=2, num_qo_heads=4,
          num_kv_heads=2, head_dim=16, dtype="float32"),
    Shape(scenario="mixed", num_decode=3, num_prefill=2, shared=16, distinct=7, per_group=3, num_qo_heads=4,
          num_kv_heads=1, head_dim=16, dtype="float32"),
    Shape(scenario="decode", num_decode=3, num_prefill=0, shared=0, distinct=21, per_group=1, num_qo_heads=2,
          num_kv_heads=2, head_dim=16, dtype="float32"),
]
#: Peers that cannot take a batch kind, and why (the adapter must say so, not compute something else).
NOT_FOR = {"decode": ("flashinfer-pod", "flashinfer-split"),
           "mixed": ("flashinfer-decode", "flashinfer-decode-tc-fa2", "flashinfer-decode-tc-fa3")}


@pytest.fixture
def fake(monkeypatch):
    import peers.flashinfer as fi

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(fi, "device_major", lambda device: fi.FA3_MAJOR)  # as on an H100
    return fi


@pytest.mark.parametrize("graph", [True, False], ids=["graph-buffers", "eager"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_peer_computes_the_batch_through_flashinfers_api(fake, shape, graph):
    batch = build_batch(shape)
    want = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr, batch.kv_lens,
                               batch.block_table)
    for name in fake.PEERS:
        if name in NOT_FOR[shape.scenario]:
            with pytest.raises(fake.Unavailable):
                fake.prepare(batch, name, graph=graph)
            continue
        prepared = fake.prepare(batch, name, graph=graph)
        got = prepared.result(prepared.run())
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        assert prepared.extra["oracle_groups"] == float(name in fake.CASCADES)


@pytest.mark.parametrize("name", ["flashinfer-cascade2", "flashinfer-cascade2-fa2"])
def test_cascade_levels_follow_the_groups(fake, name):
    shared = fake.prepare(build_batch(SHAPES[0]), name)
    assert shared.notes.startswith("levels=2")
    # No group shares a block: one level, a plain causal batch prefill.
    assert fake.prepare(build_batch(SHAPES[2]), name).notes.startswith("levels=1")


def test_fa2_cascade_plans_fa2_prefill_levels_and_merges_into_its_own_buffers(fake):
    """The fastest cascade: FlashInfer's two levels on fa2 batch prefill wrappers (KV split), causal on the last level
    only, merged in place into output buffers allocated once (a replay rewrites the same tensors)."""
    batch = build_batch(SHAPES[0])
    peer = fake.plan_peer("flashinfer-cascade2-fa2", fake.meta_of(batch), graph=True)
    assert [w._backend for w in peer.wrappers] == ["fa2", "fa2"]
    assert [w._causal for w in peer.wrappers] == [False, True]
    out = peer.launch(batch.q, batch.k_cache, batch.v_cache)
    assert out.data_ptr() == peer.partials[-1][0].data_ptr()
    assert peer.launch(batch.q, batch.k_cache, batch.v_cache).data_ptr() == out.data_ptr()


def test_fa3_needs_hopper(fake, monkeypatch):
    monkeypatch.setattr(fake, "device_major", lambda device: 8)
    with pytest.raises(fake.Unavailable, match="sm90"):
        fake.prepare(build_batch(SHAPES[0]), "flashinfer-prefill-fa3")


def test_graph_buffers_hold_the_plan(fake):
    """In cuda-graph mode the wrapper reads the metadata from its own buffers: the adapter's buffers must be the
    exact sizes FlashInfer checks (batch size + 1 indptr, batch size last-page lengths, enough indices)."""
    batch = build_batch(SHAPES[0])
    peer = fake.plan_peer("flashinfer-decode-tc-fa3", fake.meta_of(batch), graph=True)
    indptr, indices, last = peer.wrapper._meta
    assert len(indptr) == batch.kv_lens.shape[0] + 1 and len(last) == batch.kv_lens.shape[0]
    assert int(indptr[-1]) == len(indices)
