"""MLA warm-up: which MLA kernel binaries a configuration compiles (the ones plan_mla() steps launch, with the
arguments' specialization of real steps) and the launches."""

import json

import pytest
import torch

import prefixattn
from prefixattn import mla_warmup as mw
from prefixattn.kernels.layout import CLASS_CHUNK, CLASS_DECODE, CLASS_SHARED
from prefixattn.warmup import launch_binaries
from tests.launch_count import count_launches, specialization_keys

DEEPSEEK = dict(kv_lora_rank=512, rope_dim=64, block_size=64)
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def _classes(variants) -> list:
    return [v.work_class for v in variants]


def test_variants_of_deepseek_v3_per_gpu():
    # 16 heads (tensor parallel 8), decode only: a 32-lane shared tile holds two requests' heads, the decode tile one.
    vs = prefixattn.mla_kernel_variants(num_heads=16, dtypes=BF16, is_hip=False, **DEEPSEEK)
    assert _classes(vs) == [CLASS_SHARED, CLASS_DECODE]
    assert [(v.tiles.block_m, v.tiles.block_n) for v in vs] == [(32, 32), (16, 16)]
    assert "mla_attention bfloat16 h16 latent 512+64 page 64 shared no-lse 32x32 w8/s3" == vs[0].describe()
    # Prefill chunks (SGLang plans them absorbed) add the chunk class; the LSE doubles every class.
    vs = prefixattn.mla_kernel_variants(num_heads=128, dtypes=BF16, max_q_len=8192, with_lse=True, is_hip=False,
                                        **DEEPSEEK)
    assert _classes(vs) == [CLASS_SHARED, CLASS_DECODE, CLASS_CHUNK] * 2 and [v.has_lse for v in vs] == [False] * 3 + \
        [True] * 3


def test_an_fp8_latent_at_16_heads_warms_no_shared_class():
    # Every class runs 16 x 16 tiles over an fp8 latent: a shared tile packs one request's 16 heads and reads the
    # prefix as often as the request's own tile, so sharing="auto" keeps no node and the binary would never run.
    vs = prefixattn.mla_kernel_variants(num_heads=16, dtypes=BF16, kv_dtypes=E4M3, max_q_len=512,
                                        fp8_kv_scales=(True, False), is_hip=False, **DEEPSEEK)
    assert _classes(vs) == [CLASS_DECODE] * 2 and [v.has_kv_scale for v in vs] == [True, False]
    assert all(v.kv_dtype == E4M3 for v in vs) and "kv float8_e4m3fn" in vs[0].describe()
    # At 8 heads a shared tile holds two requests: the shared class is back.
    vs = prefixattn.mla_kernel_variants(num_heads=8, dtypes=BF16, kv_dtypes=E4M3, is_hip=False, **DEEPSEEK)
    assert _classes(vs) == [CLASS_SHARED, CLASS_DECODE]


@pytest.mark.parametrize("num_heads, dtype, kv_dtype", [(16, BF16, None), (16, BF16, E4M3), (8, BF16, E4M3),
                                                        (128, BF16, None), (4, torch.float32, None)])
def test_every_auto_plan_launches_a_listed_variant(num_heads, dtype, kv_dtype):
    # The property the warm-up rests on, for the engines' sharing="auto": each launch (work class, its tiles) of any
    # step is a listed variant.
    vs = prefixattn.mla_kernel_variants(num_heads=num_heads, dtypes=dtype, kv_dtypes=kv_dtype, max_q_len=300,
                                        **DEEPSEEK)
    listed = {(v.work_class == CLASS_SHARED, v.tiles) for v in vs}
    for q_lens in ([1] * 8, [1, 3, 5], [300, 1, 1, 17]):
        n = len(q_lens)
        qo = torch.tensor([0] + q_lens).cumsum(0)
        table = torch.tensor([[0, 1, 2 + r] + [9] * 6 for r in range(n)])  # blocks 0 and 1 shared by every request
        p = prefixattn.plan_mla(qo, torch.tensor(q_lens) + 130, table, num_heads=num_heads, sm_scale=0.1,
                                q_dtype=dtype, kv_dtype=kv_dtype, **DEEPSEEK)
        assert launch_binaries(p) <= listed, q_lens


def test_bad_configuration():
    with pytest.raises(ValueError, match="num_heads: expected a positive int, got 0"):
        prefixattn.mla_kernel_variants(num_heads=0, dtypes=BF16, **DEEPSEEK)
    with pytest.raises(ValueError, match="max_q_len"):
        prefixattn.mla_kernel_variants(num_heads=16, dtypes=BF16, max_q_len=0, **DEEPSEEK)
    with pytest.raises(ValueError, match="rope_dim"):
        prefixattn.mla_kernel_variants(num_heads=16, dtypes=BF16, kv_lora_rank=512, rope_dim=63, block_size=64)
    with pytest.raises(ValueError, match="dtypes"):
        prefixattn.mla_kernel_variants(num_heads=16, dtypes=torch.int8, **DEEPSEEK)


def test_under_the_interpreter_nothing_is_launched(monkeypatch):
    with count_launches(monkeypatch) as c:
        report = prefixattn.warmup_mla_kernels(num_heads=16, dtypes=BF16, **DEEPSEEK)
    assert c.triton == [] and report.mode == "skipped" and len(report.results) == 2


#: A small latent: the interpreter runs the warm-up's steps in well under a second.
SMALL = dict(kv_lora_rank=32, rope_dim=16, block_size=16)


# 32 heads: two head blocks of 16; 8 over an fp8 latent: one head block (an int argument == 1).
@pytest.mark.parametrize("num_heads, kv_dtype", [(32, None), (8, torch.float8_e5m2)])
def test_the_warm_up_compiles_what_real_steps_launch(monkeypatch, num_heads, kv_dtype):
    # Each warm-up variant launches once, and every launch of real steps (the engines' layout: contiguous q, a
    # [blocks, block_size, width] latent cache, sharing="auto") is one of the warm-up's binaries with the same
    # specialization of its other arguments (an int == 1, divisibility by 16): nothing left to compile.
    plans = []
    real_mla = mw.mla_attention
    monkeypatch.setattr(mw, "mla_attention", lambda q, cache, p, **kw: (plans.append(p), real_mla(q, cache, p, **kw)))
    kv = dict(kv_dtypes=kv_dtype, fp8_kv_scales=(True,)) if kv_dtype else {}
    with count_launches(monkeypatch) as c:
        report = prefixattn.warmup_mla_kernels(num_heads=num_heads, dtypes=BF16, max_q_len=40,
                                               run_in_interpreter=True, **kv, **SMALL)
    assert {r.status for r in report.results} == {"launched"} and len(plans) == len(report.results) >= 2
    # The shared class's step launches its decode tiles too.
    shared = sum(v.work_class == CLASS_SHARED for v in (r.variant for r in report.results))
    assert c.triton == ["mla_attention_kernel"] * (len(plans) + shared)
    warmed = {}
    for p in plans:
        warmed.update(specialization_keys(p))
    width = SMALL["kv_lora_rank"] + SMALL["rope_dim"]
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, 16, width, generator=g).to(kv_dtype or BF16)
    scale = torch.ones(1) if kv_dtype else None
    for q_lens in ([1] * 6, [40, 1, 1], [3, 17]):
        qo = torch.tensor([0] + q_lens).cumsum(0)
        table = torch.tensor([[0, 1] + [2 + 5 * r + j for j in range(5)] for r in range(len(q_lens))])
        p = prefixattn.plan_mla(qo, torch.tensor(q_lens) + 40, table, num_heads=num_heads, sm_scale=0.1,
                                q_dtype=BF16, kv_dtype=kv_dtype, kv_lora_rank=SMALL["kv_lora_rank"],
                                rope_dim=SMALL["rope_dim"], block_size=16)
        q = torch.randn(int(qo[-1]), num_heads, width, generator=g).to(BF16)
        prefixattn.mla_attention(q, cache, p, kv_scale=scale)
        for key, others in specialization_keys(p).items():
            assert warmed.get(key) == others, (q_lens, key)


MLA_CLI = ["warmup", "--mla", "--num-qo-heads", "16", "--block-size", "64"]


def test_cli_lists_the_mla_variants(capsys):
    from prefixattn.cli import main

    assert main([*MLA_CLI, "--max-q-len", "1", "--target", "sm90", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["variants"]
    assert [(r["kernel"], r["work_class"], r["num_heads"], r["kv_lora_rank"], r["rope_dim"]) for r in rows] == [
        ("mla_attention", "shared", 16, 512, 64), ("mla_attention", "decode", 16, 512, 64)]
    assert main([*MLA_CLI, "--kv-dtype", "fp8", "--kv-lora-rank", "256", "--rope-dim", "32"]) == 0
    out = capsys.readouterr().out  # the interpreter: nothing to compile
    assert out.startswith("prefixattn warm-up (skipped): 1 kernel variants") and "latent 256+32" in out


@pytest.mark.parametrize("argv, fragment", [
    ([*MLA_CLI, "--head-dim", "128"], "--head-dim: not an MLA argument"),
    ([*MLA_CLI, "--kv-write"], "--kv-write: not an MLA argument"),
    ([*MLA_CLI, "--rope-dim", "60"], "rope_dim: expected a multiple of 8"),
    (["warmup", "--num-qo-heads", "16", "--head-dim", "128"], "--num-kv-heads: required (or --mla"),
])
def test_cli_bad_mla_arguments_exit_2(capsys, argv, fragment):
    from prefixattn.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e5m2])  # e5m2: fp8 loads from sm80 on
def test_after_the_mla_warm_up_real_steps_compile_nothing(kv_dtype):
    from prefixattn.kernels.mla_attention_kernel import mla_attention_kernel
    from prefixattn.warmup import _binaries_in_process

    cfg = dict(num_heads=16, **DEEPSEEK)
    report = prefixattn.warmup_mla_kernels(**cfg, dtypes=BF16, kv_dtypes=kv_dtype, max_q_len=64)
    assert not report.failed and report.mode == "gpu", "\n".join(report.lines())
    binaries = _binaries_in_process(mla_attention_kernel)
    assert binaries is not None  # this Triton exposes its per-device cache: the check below means something
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(32, 64, 576, generator=g, device="cuda").to(kv_dtype or BF16)
    scale = torch.ones(1, device="cuda") if kv_dtype else None
    for q_lens, sharing in (([1] * 6, "auto"), ([64, 1, 1], "auto"), ([3, 17], "never")):
        qo = torch.tensor([0] + q_lens).cumsum(0)
        table = torch.tensor([[0, 1] + [2 + 5 * r + j for j in range(5)] for r in range(len(q_lens))])
        p = prefixattn.plan_mla(qo, torch.tensor(q_lens) + 130, table, sm_scale=0.1, q_dtype=BF16,
                                kv_dtype=kv_dtype, sharing=sharing, device="cuda", **cfg)
        q = torch.randn(int(qo[-1]), 16, 576, generator=g, device="cuda").to(BF16)
        prefixattn.mla_attention(q, cache, p, kv_scale=scale)
    torch.cuda.synchronize()
    assert _binaries_in_process(mla_attention_kernel) == binaries
