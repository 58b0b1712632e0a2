"""Per layer the SGLang backend runs the pool's ``set_kv_buffer`` and one attention launch; the backend warms up.

``set_kv_buffer`` is SGLang's own cache write: one ``store_cache`` kernel on CUDA/ROCm, two ``index_put`` on CPU
(its CPU path without AMX) - counted here as one engine op whatever it does inside.
"""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from prefixattn.integrations.sglang.backend import PrefixAttnBackend
from tests.launch_count import count_engine_op, count_launches
from tests.sglang.engine import MiniEngine

pytestmark = pytest.mark.sglang


def _second_layer_launches(monkeypatch, *, shared: bool):
    """Counts of a step's second layer (the first one also builds the step's plan on the host)."""
    eng = MiniEngine(page_size=4)
    pool = eng.make_pool()
    backend = PrefixAttnBackend(eng.runner(pool), sharing="always")
    prompt = list(range(100, 116))
    r0 = eng.add_request(prompt + [1, 2])
    fb = eng.batch({r0: 18}, ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    backend.forward(*eng.qkv(18), eng.layer, fb)
    eng.cache_request(r0)
    rs = [eng.add_request((prompt if shared else list(range(200 + 20 * i, 216 + 20 * i))) + [3 + i])
          for i in range(2)]
    fb = eng.batch({r: (1 if shared else 17) for r in rs}, ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    q, k, v = eng.qkv(int(fb.extend_num_tokens))
    backend.forward(q, k, v, eng.layer, fb)  # first layer: plans
    with count_launches(monkeypatch) as c:
        count_engine_op(monkeypatch, c, pool, "set_kv_buffer")
        backend.forward(q, k, v, eng.layer, fb)
    (plan,) = backend.forward_metadata.plans.values()
    return c, plan


def test_a_layer_is_the_pools_write_and_one_attention_launch(monkeypatch):
    c, plan = _second_layer_launches(monkeypatch, shared=False)
    assert not plan.has_shared and plan.stats["num_merge_rows"] == 0
    assert c.engine_ops == ["set_kv_buffer"] and c.triton == ["prefix_attention_kernel"] and c.torch_ops == []


def test_with_a_shared_prefix_a_layer_is_one_launch_per_work_class(monkeypatch):
    c, plan = _second_layer_launches(monkeypatch, shared=True)
    assert plan.has_shared and plan.stats["num_merge_rows"] > 0
    # One launch per work class: the shared prefix's programs and the decodes'; no memset of the merge counters
    # (they leave themselves at zero; plan() zeroes them once a step).
    assert plan.num_launches == 2
    assert c.engine_ops == ["set_kv_buffer"] and c.triton == ["prefix_attention_kernel"] * 2
    assert c.torch_ops == []


# ---------------------------------------------------------------------------------------------------------------
# Warm-up hook
# ---------------------------------------------------------------------------------------------------------------
def _runner(eng, pool, *, chunk=512, layers=((4, 2, 64),)):
    runner = eng.runner(pool)
    runner.model = torch.nn.ModuleList(
        [RadixAttention(hq, d, d ** -0.5, hkv, layer_id=i) for i, (hq, hkv, d) in enumerate(layers)])
    runner.server_args = types.SimpleNamespace(chunked_prefill_size=chunk)
    return runner


@pytest.fixture
def recorded(monkeypatch):
    import prefixattn
    from prefixattn.warmup import WarmupReport

    calls = []

    def record(**config):
        calls.append(config)
        return WarmupReport([])

    monkeypatch.setattr(prefixattn, "warmup_kernels", record)
    monkeypatch.delenv("PREFIXATTN_WARMUP", raising=False)
    return calls


def test_backend_warms_up_every_layer_geometry(recorded):
    eng = MiniEngine(page_size=4, dtype=torch.float16)
    pool = eng.make_pool()
    backend = PrefixAttnBackend(_runner(eng, pool, layers=((4, 2, 64), (4, 2, 64), (8, 2, 128))))
    from prefixattn.warmup import SGLANG_LAYOUT

    common = dict(block_size=4, dtypes=torch.float16, max_q_len=512, layout=SGLANG_LAYOUT, device=None)
    assert recorded == [dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, **common),
                        dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, **common)]
    assert len(backend.warmup_report) == 2


@pytest.mark.parametrize("scales, switches", [(None, (False,)), ((0.5, 2.0), (True,)), ((0.5, 1.0), (False,)),
                                               ("mixed", (False, True))])
def test_an_fp8_pool_warms_its_fp8_variants(recorded, scales, switches):
    # fp8 pools: the fp8-loading binaries at start-up; HAS_KV_SCALE as the layers' scales make their launches
    # (a float k_scale folds into the softmax scale: only v_scale != 1 is the scaled binary).
    eng = MiniEngine(dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2)
    pool = eng.make_pool()
    runner = _runner(eng, pool, layers=((4, 2, 64), (4, 2, 64)))
    runner.dtype = torch.bfloat16
    for i, layer in enumerate(runner.model):
        k, v = (0.5, 2.0 if i else 1.0) if scales == "mixed" else (scales or (None, None))
        layer.k_scale = None if k is None else torch.nn.Parameter(torch.tensor(k), requires_grad=False)
        layer.v_scale = None if v is None else torch.nn.Parameter(torch.tensor(v), requires_grad=False)
        layer.k_scale_float, layer.v_scale_float = k, v
    PrefixAttnBackend(runner)
    (call,) = recorded
    assert call["dtypes"] == torch.bfloat16 and call["kv_dtypes"] == torch.float8_e5m2
    assert call["fp8_kv_scales"] == switches


def test_without_chunked_prefill_every_query_length_is_warmed(recorded):
    from prefixattn.warmup import MAX_DISTINCT_Q_LEN

    eng = MiniEngine()
    PrefixAttnBackend(_runner(eng, eng.make_pool(), chunk=-1))
    assert [c["max_q_len"] for c in recorded] == [MAX_DISTINCT_Q_LEN]


def test_no_model_or_switched_off_means_no_warm_up(recorded, monkeypatch):
    eng = MiniEngine()
    assert PrefixAttnBackend(eng.runner(eng.make_pool())).warmup_report == []  # a bare runner (other tests)
    monkeypatch.setenv("PREFIXATTN_WARMUP", "0")
    assert PrefixAttnBackend(_runner(eng, eng.make_pool())).warmup_report == []
    assert recorded == []


def test_a_failed_variant_stops_the_start_up(monkeypatch):
    import prefixattn
    from prefixattn import warmup as w

    def failing(**config):
        v = w.kernel_variants(**{k: config[k] for k in config if k not in ("device", "layout")})[0]
        return w.WarmupReport([w.VariantResult(v, "failed", 0.1, "CompilationError: out of resources")])

    monkeypatch.setattr(prefixattn, "warmup_kernels", failing)
    eng = MiniEngine()
    with pytest.raises(RuntimeError, match="kernel warm-up failed(.|\n)*out of resources"):
        PrefixAttnBackend(_runner(eng, eng.make_pool()))


def test_the_real_warm_up_under_the_interpreter_compiles_nothing():
    eng = MiniEngine()
    (report,) = PrefixAttnBackend(_runner(eng, eng.make_pool())).warmup_report
    assert report.mode == "skipped" and {r.variant.kernel for r in report.results} == {"prefix_attention"}
