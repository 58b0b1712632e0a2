"""prefixattn's SGLang MLA backend on SGLang's latent pool (CPU): extend and decode batches against SGLang's own
torch_native backend on the same pool kind, decode CUDA graphs up to the capture (the replayed launches have the
captured arguments), and what it refuses. End to end with SGLang's DeepSeek-V3 model code: test_e2e_models.py."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from prefixattn.integrations.sglang.mla_backend import PrefixAttnMLABackend
from tests.launch_count import fixed_launch_args
from tests.sglang.engine import MiniEngine
from tests.sglang.test_cudagraph import DOC, GRAPH_BS, SYSTEM, _fill_static, _graph_step, _padded

pytestmark = pytest.mark.sglang

#: Small latent widths keep the interpreter fast (DeepSeek-V3: 512 + 64).
KV_LORA_RANK, ROPE_DIM = 24, 8
HEADS = 4
SCALE = 0.3


def _engine(page_size: int) -> MiniEngine:
    return MiniEngine(num_heads=HEADS, num_kv_heads=1, head_dim=KV_LORA_RANK + ROPE_DIM, page_size=page_size)


def _pool(eng: MiniEngine, dtype=torch.float32) -> MLATokenToKVPool:
    return MLATokenToKVPool(eng.pool_size, eng.page_size, dtype, kv_lora_rank=KV_LORA_RANK,
                            qk_rope_head_dim=ROPE_DIM, layer_num=1, device="cpu", enable_memory_saver=False)


@pytest.fixture(autouse=True)
def one_rank_without_dcp():
    """What SGLang's latent pool reads when it writes (no decode context parallelism): a served model publishes it
    with its parallel config; here, for this test only."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dcp_enabled=False):
        yield


def _mqa_layer() -> RadixAttention:
    """SGLang's DeepSeek ``attn_mqa`` layer: the absorbed query and key (latent + rope) against one latent KV head."""
    return RadixAttention(HEADS, KV_LORA_RANK + ROPE_DIM, SCALE, 1, layer_id=0, v_head_dim=KV_LORA_RANK)


LAYER = _mqa_layer()


def _qkv(eng: MiniEngine, num_tokens: int):
    """q ``[T, H * (rank + rope)]``, k ``[T, 1, rank + rope]`` and v = k's latent, as DeepSeek's layer passes them."""
    q, k, _ = eng.qkv(num_tokens)
    return q, k, k[..., :KV_LORA_RANK].clone()


def _session(eng, backends, layer=LAYER):
    """A first request prefilled and cached, four more admitted on its prefix (two share more), their questions
    prefilled in one extend batch; each backend runs every batch. Returns ``(eager, r0, rs)``."""
    def eager(extend, mode):
        fb = eng.batch(extend, mode)
        q, k, v = _qkv(eng, int(sum(extend.values())))
        outs = []
        for b in backends:
            b.init_forward_metadata(fb)
            outs.append(b.forward(q.clone(), k.clone(), v.clone(), layer, fb))
        return outs

    r0 = eng.add_request(SYSTEM + DOC + [400, 401, 402, 403])
    eager({r0: 24}, ForwardMode.EXTEND)
    eng.cache_request(r0)
    rs = [eng.add_request(SYSTEM + (DOC if i < 2 else []) + [410 + i, 420 + i]) for i in range(4)]
    return eager, r0, rs


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_and_decode_match_torch_native(page_size):
    eng = _engine(page_size)
    peer = TorchNativeAttnBackend(eng.runner(_pool(eng)))
    ours = PrefixAttnMLABackend(eng.runner(_pool(eng)), sharing="always")
    eager, r0, rs = _session(eng, (peer, ours))
    want, got = eager({r: len(eng.requests[r].tokens) - eng.requests[r].cached_len for r in rs}, ForwardMode.EXTEND)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for step in range(2):
        for r in (r0, *rs):
            eng.append_token(r, 500 + r + step)
        want, got = eager({r: 1 for r in (r0, *rs)}, ForwardMode.DECODE)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    (p,) = ours.forward_metadata.plans.values()
    assert p.has_shared and p.stats["mla_form"] == "absorbed"


def test_decode_graph_capture_and_padded_replays_reuse_the_launch():
    eng = _engine(1)
    peer = TorchNativeAttnBackend(eng.runner(_pool(eng)))
    ours = PrefixAttnMLABackend(eng.runner(_pool(eng)), sharing="always")
    ours.init_cuda_graph_state(max_bs=GRAPH_BS, max_num_tokens=GRAPH_BS)
    eager, r0, rs = _session(eng, (peer, ours))
    eager({r: len(eng.requests[r].tokens) - eng.requests[r].cached_len for r in rs}, ForwardMode.EXTEND)

    capture = _padded(None, GRAPH_BS)
    width = KV_LORA_RANK + ROPE_DIM
    static = tuple(torch.zeros(GRAPH_BS, *s) for s in ((HEADS * width,), (1, width), (1, KV_LORA_RANK)))
    _graph_step(ours, capture, *static, LAYER, capture=True)  # the warm-up forward creates the graph wrapper
    _graph_step(ours, capture, *static, LAYER, capture=True)  # the captured one
    assert ours.forward_metadata.graph and len(ours._graph.wrappers) == 1
    captured = fixed_launch_args(next(iter(ours.forward_metadata.plans.values())))

    for live in ([r0, rs[0], rs[2]], [r0, *rs]):  # two replays, padded to the captured size
        for r in live:
            eng.append_token(r, 500 + r)
        fb = eng.batch({r: 1 for r in live}, ForwardMode.DECODE)
        q, k, v = _qkv(eng, len(live))
        peer.init_forward_metadata(fb)
        want = peer.forward(q.clone(), k.clone(), v.clone(), LAYER, fb)
        got = _graph_step(ours, _padded(fb, GRAPH_BS), *_fill_static(static, (q, k, v)), LAYER)
        torch.testing.assert_close(got[:len(live)], want, atol=1e-4, rtol=1e-4)
        (p,) = ours.forward_metadata.plans.values()
        assert fixed_launch_args(p) == captured  # the captured launch runs this step's plan
    assert p.has_shared and p.num_tokens == 5


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_latent_pool_with_a_checkpoint_scale(fp8):
    """An fp8 pool holds k / k_scale (SGLang's latent pool applies no scale itself); attention reads it back times
    k_scale: the reference over the dequantized pool, and the pool's rows are exactly the quantized k."""
    import prefixattn

    eng = _engine(1)
    pool = _pool(eng, fp8)
    ours = PrefixAttnMLABackend(eng.runner(pool), sharing="always")
    layer = _mqa_layer()
    layer.k_scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)
    layer.k_scale_float = 0.5
    eager, r0, rs = _session(eng, (ours,), layer)
    eager({r: len(eng.requests[r].tokens) - eng.requests[r].cached_len for r in rs}, ForwardMode.EXTEND)
    reqs = (r0, *rs)
    for r in reqs:
        eng.append_token(r, 600 + r)
    fb = eng.batch({r: 1 for r in reqs}, ForwardMode.DECODE)
    q, k, v = _qkv(eng, len(reqs))
    ours.init_forward_metadata(fb)
    got = ours.forward(q.clone(), k.clone(), v.clone(), layer, fb)
    slots = fb.out_cache_loc
    torch.testing.assert_close(pool.get_key_buffer(0)[slots].float(), (k / 0.5).to(fp8).float(), atol=0, rtol=0)
    lens = fb.seq_lens.cpu()
    table = torch.stack([eng.req_to_token_pool.req_to_token[eng.requests[r].row, :int(lens.max())] for r in reqs])
    want = prefixattn.reference_mla_attention(
        q.view(-1, HEADS, KV_LORA_RANK + ROPE_DIM), pool.get_key_buffer(0), torch.arange(len(reqs) + 1), lens,
        table, kv_lora_rank=KV_LORA_RANK, sm_scale=SCALE, kv_scale=0.5)
    torch.testing.assert_close(got.view(-1, HEADS, KV_LORA_RANK), want, atol=1e-4, rtol=1e-4)


def test_refusals_name_what_is_wrong():
    eng = _engine(1)
    with pytest.raises(ValueError, match="token_to_kv_pool: expected SGLang's MLATokenToKVPool"):
        PrefixAttnMLABackend(eng.runner(eng.make_pool()))
    ours = PrefixAttnMLABackend(eng.runner(_pool(eng)))
    r0 = eng.add_request([1, 2, 3])
    fb = eng.batch({r0: 3}, ForwardMode.EXTEND)
    ours.init_forward_metadata(fb)
    # DeepSeek's up-projected form (attn_mha: every head its own K/V) never reaches the latent pool.
    mha = RadixAttention(HEADS, 16, SCALE, HEADS, layer_id=0, v_head_dim=8)
    with pytest.raises(ValueError, match="expected SGLang's absorbed MLA attention .* force_absorbed_mla"):
        ours.forward(torch.zeros(3, HEADS * 16), torch.zeros(3, HEADS, 16), torch.zeros(3, HEADS, 8), mha, fb)


def test_the_backend_warms_up_its_mla_layers(monkeypatch):
    # The layers' head counts over the latent pool (under the interpreter: listed, nothing compiled); SGLang's
    # up-projected attn_mha layers, which never reach this backend, are left out.
    import types

    monkeypatch.delenv("PREFIXATTN_WARMUP", raising=False)
    eng = _engine(4)
    runner = eng.runner(_pool(eng))
    runner.model = torch.nn.ModuleList([LAYER, RadixAttention(HEADS, 16, SCALE, HEADS, layer_id=1, v_head_dim=8)])
    runner.server_args = types.SimpleNamespace(chunked_prefill_size=64)
    (report,) = PrefixAttnMLABackend(runner).warmup_report
    assert report.mode == "skipped"
    lines = "\n".join(report.lines())
    # Page size 4 runs the generic PAGE_SIZE binary ("any").
    assert f"mla_attention float32 h{HEADS} latent {KV_LORA_RANK}+{ROPE_DIM} page any shared" in lines
    assert "decode no-lse" in lines
