"""Warm-up: which kernel variants a configuration compiles (the ones plan() will launch), the launches, the CLI."""

import json

import pytest
import torch

import prefixattn
from prefixattn import warmup as w
from prefixattn.autotune.lookup import planning_target
from prefixattn.cli import main
from prefixattn.kernels.layout import CLASS_SHARED, WORK_CLASSES
from tests.launch_count import count_launches, launch_arguments

LLAMA8B = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def test_query_len_buckets():
    assert w.query_len_buckets(1) == [1]
    assert w.query_len_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert w.query_len_buckets(10 ** 6)[-2:] == [2048, w.MAX_DISTINCT_Q_LEN]  # longer chunks: the same tiles
    with pytest.raises(ValueError, match="max_q_len: expected a positive int"):
        w.query_len_buckets(0)


def test_heuristic_variants_of_a_gqa4_model():
    # No GPU table (target None): one binary per work class, each with its own launch options, no LSE. The shared
    # and decode classes serve every step; chunk tiles (64 lanes) run once a chunk passes a decode tile's 4 rows.
    vs = w.attention_variants(**LLAMA8B, dtypes=torch.bfloat16, max_q_len=8192, target=None)
    got = [(WORK_CLASSES[v.work_class], v.tiles.block_m, v.tiles.launch.num_warps, v.max_q_lens) for v in vs]
    decode, prefill = (1, 2, 4), (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert got == [("shared", 128, 8, decode + prefill), ("decode", 16, 4, decode + prefill),
                   ("chunk", 64, 4, prefill)]
    assert all(not v.has_lse and v.kernel == w.ATTENTION and v.dtype == torch.bfloat16 for v in vs)


def test_lse_dtypes_and_kv_write_multiply_the_variants():
    base = w.kernel_variants(**LLAMA8B, dtypes=torch.float16, max_q_len=1, target=None)
    assert len(base) == 2  # decode only: the shared and the decode class
    full = w.kernel_variants(**LLAMA8B, dtypes=[torch.float16, torch.float32], max_q_len=1, with_lse=True,
                             kv_write=True, target=None)
    assert len(full) == 2 * 2 * 2 + 2
    assert [v.dtype for v in full if v.kernel == w.KV_WRITE] == [torch.float16, torch.float32]



FP8 = torch.float8_e4m3fn


def test_kv_dtypes_default_to_the_q_dtypes():
    cfg = dict(**LLAMA8B, dtypes=[torch.float16, torch.bfloat16], max_q_len=64, kv_write=True, target=None)
    assert w.kernel_variants(**cfg) == w.kernel_variants(**cfg, kv_dtypes=[torch.float16, torch.bfloat16])
    assert all(v.kv_dtype is None and not v.has_kv_scale for v in w.kernel_variants(**cfg))


def test_an_fp8_cache_lists_its_own_attention_and_kv_write_binaries():
    from prefixattn.autotune.config_space import FP8_SUFFIX_MIN_WARPS

    base = w.kernel_variants(**LLAMA8B, dtypes=torch.bfloat16, max_q_len=64, kv_write=True, target=None)
    fp8 = w.kernel_variants(**LLAMA8B, dtypes=torch.bfloat16, max_q_len=64, kv_write=True, target=None,
                            kv_dtypes=FP8)
    assert len(fp8) == len(base) == 4  # the shared, decode and chunk classes, one write_kv
    attn = [v for v in fp8 if v.kernel == w.ATTENTION]
    assert all(v.kv_dtype == FP8 and v.cache_dtype == FP8 and v.kv_fp8 and v.has_kv_scale for v in attn)
    assert [v.tiles for v in attn] == [v.tiles for v in base if v.kernel == w.ATTENTION]  # tiles follow q's dtype
    # fp8 suffix-only launches take more warps (LaunchOptions.for_kv): the report shows the launch they compile.
    suffix = [v for v in attn if v.work_class != CLASS_SHARED]
    assert all(v.tiles.launch.for_kv(has_shared=False, kv_fp8=True, is_hip=False, block_d=128,
                                     block_m=v.tiles.block_m, block_n=v.tiles.block_n).num_warps
               >= FP8_SUFFIX_MIN_WARPS for v in suffix)
    assert all(f"w{FP8_SUFFIX_MIN_WARPS}/" in v.describe() for v in suffix)
    (write,) = [v for v in fp8 if v.kernel == w.KV_WRITE]
    assert write.dtype == torch.bfloat16 and write.kv_dtype == FP8
    assert write.describe() == "kv_write bfloat16 kv float8_e4m3fn h32/8 d128 slots int64"
    assert attn[0].describe().startswith("prefix_attention bfloat16 kv float8_e4m3fn h32/8 d128 page 16 "
                                         "shared no-lse +kv_scale ")
    # Both scale switches (SGLang: float scales with v_scale 1 launch without HAS_KV_SCALE), both caches at once.
    both = w.attention_variants(**LLAMA8B, dtypes=torch.bfloat16, max_q_len=1, target=None,
                                kv_dtypes=[torch.bfloat16, FP8, torch.float8_e5m2], fp8_kv_scales=(True, False))
    assert [(v.cache_dtype, v.has_kv_scale) for v in both[::2]] == [
        (torch.bfloat16, False), (FP8, True), (FP8, False), (torch.float8_e5m2, True), (torch.float8_e5m2, False)]


@pytest.mark.parametrize("kv_dtypes, message", [
    (torch.int8, "kv_dtypes: expected torch.float16/bfloat16/float32/float8_e4m3fn/float8_e5m2, got"),
    (torch.float16, r"kv_dtypes: expected fp8 or one of the q dtypes \['bfloat16'\]"),
    ([], "kv_dtypes: expected"),
])
def test_bad_kv_dtypes(kv_dtypes, message):
    with pytest.raises(ValueError, match=message):
        w.kernel_variants(**LLAMA8B, dtypes=torch.bfloat16, kv_dtypes=kv_dtypes)


def test_fp8_variants_launch_fp8_caches_with_scales_in_the_interpreter(monkeypatch):
    import prefixattn.kv_write as kv_write_module
    import prefixattn.prefix_attention as attention_module

    seen = []

    class Recorder:
        def __init__(self, kernel, switch):
            self.kernel, self.switch = kernel, switch

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                # The attention launcher passes the kernel's arguments by position, the K/V write by keyword.
                named = launch_arguments(args, kwargs) if args else kwargs
                seen.append((self.switch, named["k_cache_ptr"].dtype, named[self.switch]))
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention_module, "prefix_attention_kernel",
                        Recorder(attention_module.prefix_attention_kernel, "HAS_KV_SCALE"))
    monkeypatch.setattr(kv_write_module, "kv_write_kernel", Recorder(kv_write_module.kv_write_kernel, "IS_FP8"))
    report = prefixattn.warmup_kernels(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                                       dtypes=torch.float16, kv_dtypes=torch.float8_e5m2, kv_write=True,
                                       fp8_kv_scales=(True, False), layout=w.VLLM_LAYOUT, run_in_interpreter=True)
    assert [r.status for r in report.results] == ["launched"] * 5, "\n".join(report.lines())
    e5m2 = torch.float8_e5m2
    # Per scale switch: the shared class's warm-up step (its shared and decode launches), then the decode class's.
    assert seen == [("HAS_KV_SCALE", e5m2, True)] * 3 + [("HAS_KV_SCALE", e5m2, False)] * 3 + [("IS_FP8", e5m2, True)]
    assert "kv float8_e5m2" in "\n".join(report.lines())

@pytest.mark.parametrize("target", [None, "sm90", "gfx942"])
def test_every_plan_launches_a_listed_variant(target):
    # The property warm-up rests on: whatever step plan() builds for this configuration, each of its launches (work
    # class, that class's tiles) is one of the listed variants.
    g = torch.Generator().manual_seed(0)
    cfg = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    vs = w.attention_variants(**cfg, dtypes=torch.float16, max_q_len=300, target=target)
    listed = {(v.work_class == CLASS_SHARED, v.tiles) for v in vs}
    with planning_target(target):
        for q_len in (1, 3, 5, 17, 64, 300):
            for sharing in ("always", "never"):
                n = 3
                q = torch.tensor([1, q_len, int(torch.randint(1, q_len + 1, (1,), generator=g))])
                kv = q + 40
                table = torch.tensor([[0, 1, 2 + r] + [9] * 20 for r in range(n)])  # blocks 0, 1 shared
                p = prefixattn.plan(torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)]), kv, table,
                                    q_dtype=torch.float16, sharing=sharing, **cfg)
                assert w.launch_binaries(p) <= listed, (q_len, sharing)


def test_under_the_interpreter_nothing_is_compiled_or_launched(monkeypatch):
    with count_launches(monkeypatch) as c:
        report = prefixattn.warmup_kernels(**LLAMA8B, dtypes=torch.float16, max_q_len=64, kv_write=True)
    assert c.triton == [] and report.mode == "skipped"
    assert len(report.results) == 4 and {r.status for r in report.results} == {"skipped"}
    assert "4 skipped" in report.summary()


def test_run_in_interpreter_launches_each_variant_once(monkeypatch):
    cfg = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=5)  # the generic PAGE_SIZE binary
    with count_launches(monkeypatch) as c:
        report = prefixattn.warmup_kernels(**cfg, dtypes=torch.float32, max_q_len=32, with_lse=True, kv_write=True,
                                           run_in_interpreter=True)
    variants = w.kernel_variants(**cfg, dtypes=torch.float32, max_q_len=32, with_lse=True, kv_write=True)
    assert [r.variant for r in report.results] == variants and len(variants) == 7  # 3 classes x LSE, write_kv
    assert {r.status for r in report.results} == {"launched"} and not report.failed
    # The shared class's warm-up step launches its decode tiles too: 4 launches per LSE switch (shared + decode,
    # decode, chunk).
    assert c.triton == ["prefix_attention_kernel"] * 8 + ["kv_write_kernel"]
    text = "\n".join(report.lines())
    assert "page any shared +lse" in text and "page any chunk +lse" in text
    assert "kv_write float32 h2/1 d64 slots int64" in text


def test_engine_layouts():
    v = w.kv_write_variants(num_qo_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtypes=torch.float16)[0]
    q, k, _ = w._rows(v, 3, w.VLLM_LAYOUT, "cpu")
    assert q.stride() == (8 * 64, 64, 1) and k.stride() == (8 * 64, 64, 1)  # slices of a [T, (4 + 2 * 2) * 64] row
    k_cache, v_cache = w._caches(v, w.VLLM_LAYOUT, "cpu")
    assert k_cache.stride() == v_cache.stride() == (16 * 2 * 128, 2 * 128, 128, 1)  # K | V halves of the last dim
    assert v_cache.data_ptr() - k_cache.data_ptr() == 64 * 2
    k_cache, v_cache = w._caches(v, w.SGLANG_LAYOUT, "cpu")
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.data_ptr() != v_cache.data_ptr()
    assert w._rows(v, 3, w.WarmupLayout(), "cpu")[0].is_contiguous()


def test_engine_layouts_launch_in_the_interpreter():
    report = prefixattn.warmup_kernels(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                                       dtypes=torch.float16, kv_write=True, layout=w.VLLM_LAYOUT,
                                       run_in_interpreter=True)
    assert [r.status for r in report.results] == ["launched"] * 3


def test_a_failing_variant_is_reported_and_the_others_still_run(monkeypatch):
    def boom(v, layout, device):
        if v.work_class == CLASS_SHARED:
            raise RuntimeError("ptxas fatal")
    monkeypatch.setattr(w, "_launch_attention", boom)
    report = prefixattn.warmup_kernels(num_qo_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                                       dtypes=torch.float32, run_in_interpreter=True)
    assert [r.status for r in report.results] == ["failed", "launched"]
    assert report.failed[0].error == "RuntimeError: ptxas fatal"


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False), ("off", False), ("no", False)])
def test_environment_switch(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv(w.WARMUP_ENV, raising=False)
    else:
        monkeypatch.setenv(w.WARMUP_ENV, value)
    assert w.warmup_enabled() is enabled


@pytest.mark.parametrize("change, message", [
    (dict(num_qo_heads=6, num_kv_heads=4), "num_qo_heads"),
    (dict(head_dim=68), "head_dim"),  # not a multiple of 8
    (dict(block_size=0), "block_size: expected a positive int, got 0"),
    (dict(dtypes=torch.int8), "dtypes: expected torch.float16/bfloat16/float32"),
])
def test_bad_configuration(change, message):
    with pytest.raises(ValueError, match=message):
        w.kernel_variants(**{**LLAMA8B, "dtypes": torch.float16, **change})


# ---------------------------------------------------------------------------------------------------------------
# prefixattn warmup
# ---------------------------------------------------------------------------------------------------------------
CLI = ["warmup", "--num-qo-heads", "32", "--num-kv-heads", "8", "--head-dim", "128"]


def test_cli_under_the_interpreter_lists_the_variants_as_skipped(capsys):
    assert main([*CLI, "--dtype", "bf16,fp16", "--max-q-len", "1", "--kv-write"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("prefixattn warm-up (skipped): 6 kernel variants: 6 skipped")
    assert sum("kv_write" in line for line in out) == 2 and len(out) == 8
    assert out[1].strip().startswith("planner")  # the host planner is warmed too (compiled, or numpy: 0 s)


def test_cli_target_json_lists_what_that_gpu_would_compile(capsys):
    assert main([*CLI, "--target", "sm90", "--max-q-len", "8192", "--lse", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "listed"
    rows = report["variants"]
    expected = w.attention_variants(**LLAMA8B, dtypes=torch.bfloat16, max_q_len=8192, with_lse=True, target="sm90")
    assert [r["description"] for r in rows] == [v.describe() for v in expected]
    assert {r["status"] for r in rows} == {"listed"} and all("config" in r for r in rows)


def test_cli_layout_reaches_the_warm_up(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(w, "warmup_kernels", lambda **config: seen.append(config["layout"]) or w.WarmupReport([]))
    assert main([*CLI, "--layout", "vllm"]) == 0 and main([*CLI]) == 0
    assert seen == [w.VLLM_LAYOUT, w.WarmupLayout()]
    assert main([*CLI, "--layout", "nhd"]) == 2


def test_cli_kv_dtype_lists_the_fp8_variants(capsys):
    assert main([*CLI, "--dtype", "bf16", "--kv-dtype", "fp8", "--max-q-len", "1", "--kv-write", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["variants"]
    assert [(r["kernel"], r["kv_dtype"], r["has_kv_scale"]) for r in rows] == [
        (w.ATTENTION, "float8_e4m3fn", True)] * 2 + [(w.KV_WRITE, "float8_e4m3fn", False)]
    assert main([*CLI, "--kv-dtype", "fp8_e5m2", "--no-fp8-scales", "--max-q-len", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("kv float8_e5m2") == 2 and "+kv_scale" not in out


def test_cli_dry_run(capsys):
    assert main([*CLI, "--dry-run", "--max-q-len", "1"]) == 0
    assert capsys.readouterr().out.startswith("prefixattn warm-up (listed): 2 kernel variants: 2 listed")


@pytest.mark.parametrize("argv, fragment", [
    ([*CLI[:-1], "68"], "--head-dim"),
    ([*CLI, "--dtype", "fp8"], "expected comma-separated dtypes"),
    ([*CLI, "--kv-dtype", "int8"], "expected comma-separated dtypes"),
    ([*CLI, "--kv-dtype", "fp16"], "kv_dtypes: expected fp8 or one of the q dtypes"),
    ([*CLI, "--max-q-len", "0"], "expected a positive int, got 0"),
    (["warmup", "--num-kv-heads", "8", "--head-dim", "128"], "--num-qo-heads"),
    ([*CLI, "--target", "sm99"], "target: expected one of"),
    (["warmup", "--num-qo-heads", "6", "--num-kv-heads", "4", "--head-dim", "128"], "num_qo_heads"),
])
def test_cli_bad_arguments_exit_2(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_cli_exits_1_when_a_variant_fails(capsys, monkeypatch):
    def failing(*, layout, **config):
        v = w.kernel_variants(**config)[0]
        return w.WarmupReport([w.VariantResult(v, "failed", 1.5, "CompilationError: out of resources")])
    monkeypatch.setattr(w, "warmup_kernels", failing)
    assert main([*CLI, "--max-q-len", "1"]) == 1
    out = capsys.readouterr().out
    assert "1 failed" in out and "CompilationError: out of resources" in out


# ---------------------------------------------------------------------------------------------------------------
# On a GPU: after the warm-up, real steps of the configuration compile nothing
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e5m2])  # e5m2: fp8 loads from sm80 on
def test_after_the_warm_up_real_steps_compile_nothing(kv_dtype):
    from prefixattn.kernels.kv_write_kernel import kv_write_kernel
    from prefixattn.kernels.prefix_attention_kernel import prefix_attention_kernel

    cfg = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, block_size=16)
    fp8 = kv_dtype != torch.float16
    # fp8: vLLM's way, per-tensor scale tensors read by pointer (the warm-up's default fp8_kv_scales)
    scales = {n: torch.ones(1, device="cuda") for n in ("k_scale", "v_scale")} if fp8 else {}
    report = prefixattn.warmup_kernels(**cfg, dtypes=torch.float16, max_q_len=64, kv_write=True, kv_dtypes=kv_dtype)
    assert not report.failed and report.mode == "gpu", "\n".join(report.lines())
    binaries = (w._binaries_in_process(prefix_attention_kernel), w._binaries_in_process(kv_write_kernel))
    assert None not in binaries  # this Triton exposes its per-device cache: the check below means something
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(64, 16, 2, 128, generator=g, device="cuda", dtype=torch.float16).to(kv_dtype)
    v_cache = torch.randn(64, 16, 2, 128, generator=g, device="cuda", dtype=torch.float16).to(kv_dtype)
    # A decode step under a shared prefix, a chunked prefill (64 rows) next to decodes, a step sharing nothing.
    for q_lens, sharing in (([1] * 6, "always"), ([64, 1, 1], "auto"), ([3, 17], "never")):
        n = len(q_lens)
        qo = torch.tensor([0] + q_lens).cumsum(0)
        kv_lens = torch.tensor(q_lens) + 40
        table = torch.tensor([[0, 1] + [2 + 5 * r + j for j in range(5)] for r in range(n)])
        p = prefixattn.plan(qo, kv_lens, table, q_dtype=torch.float16, kv_dtype=kv_dtype, sharing=sharing,
                            device="cuda", **cfg)
        q = torch.randn(int(qo[-1]), 8, 128, generator=g, device="cuda", dtype=torch.float16)
        new_kv = torch.randn(int(qo[-1]), 2, 128, generator=g, device="cuda", dtype=torch.float16)
        slots = torch.arange(int(qo[-1]), device="cuda") + 16 * 40
        prefixattn.write_kv(new_kv, new_kv, k_cache, v_cache, slots, **scales)
        prefixattn.attention(q, k_cache, v_cache, p, **scales)
    torch.cuda.synchronize()
    assert (w._binaries_in_process(prefix_attention_kernel), w._binaries_in_process(kv_write_kernel)) == binaries
