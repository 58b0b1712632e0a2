"""compile-check: parsing of compiler output (unit) and one real AOT compile per target (``compile`` marker)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixattn.autotune.builds import HOPPER_HEAD_DIMS
from prefixattn.autotune.config_space import FP8_LARGE_HEAD_DECODE_WARPS, FP8_SUFFIX_MIN_WARPS
from prefixattn.autotune.targets import TARGETS
from prefixattn.tuning.compile_analysis import (count_matrix_instrs, count_private_memory_ops, hopper_features,
                                               parse_amdgcn, parse_dots, parse_pipeline, parse_ptxas)
from prefixattn.tuning.compile_check import exclusions_from_report, failures
from prefixattn.tuning.compile_specs import build_signature

TTGIR = """
#blocked2 = #ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [8, 4], warpsPerCTA = [4, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 64, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 4], instrShape = [16, 8]}>
    %c = ttng.warp_group_dot %a_16, %b_25, %cst_4 {inputPrecision = 0 : i32} : !ttg.memdesc<128x64xf16, #shared, #smem> * !ttg.memdesc<64x32xf16, #shared, #smem> -> tensor<128x32xf32, #mma> loc(#loc42)
    %d = tt.dot %a_30, %b_31, %cst_5, inputPrecision = tf32 : tensor<16x64xf16, #ttg.dot_op<{opIdx = 0, parent = #mma1, kWidth = 2}>> * tensor<64x32xf16, #ttg.dot_op<{opIdx = 1, parent = #mma1, kWidth = 2}>> -> tensor<16x32xf32, #mma1> loc(#loc51)
    %e = tt.dot %a_26, %b_27, %cst_4 : tensor<32x64xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked2}>> * tensor<64x16xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked2}>> -> tensor<32x16xf32, #blocked2> loc(#loc42)
"""


def test_parse_dots_classifies_layouts_and_shapes():
    dots = parse_dots(TTGIR)
    assert [(d["m"], d["k"], d["n"], d["layout"]) for d in dots] == [
        (128, 64, 32, "wgmma"), (16, 64, 32, "mma_v2"), (32, 64, 16, "fma")]
    mfma = parse_dots("#mma = #ttg.amd_mfma<{version = 3}>\n %c = tt.dot %a, %b, %c : tensor<64x128xbf16, #x> * "
                      "tensor<128x64xbf16, #y> -> tensor<64x64xf32, #mma>")
    assert mfma == [{"m": 64, "k": 128, "n": 64, "dtype": "bf16", "layout": "mfma"}]


#: The KV loop of the sm_90 TTGIR (Triton 3.9), trimmed: K and V each one commit group per iteration, three buffer
#: copies, and the in-loop wait leaves the next tile's two groups in flight; a drain wait after the loop and a merge
#: loop without copies around it.
NV_LOOP = """
      %k_187 = ttg.local_alloc : () -> !ttg.memdesc<{bufs}x128x64xbf16, #shared1, #smem, mutable> loc(#loc481)
      %v_188 = ttg.local_alloc : () -> !ttg.memdesc<{bufs}x64x128xbf16, #shared, #smem, mutable> loc(#loc482)
      %q_1 = ttg.local_alloc %q_0 : (tensor<128x128xbf16, #blocked>) -> !ttg.memdesc<128x128xbf16, #shared, #smem>
      %r:11 = scf.for %i = %kv_start to %kv_end step %c64_i32 iter_args(%a = %cst_5, %k_330 = %k_225) -> (tensor<128x128xf32, #mma1>, !ttg.async.token)  : i32 {{
        %k_344 = ttg.async_wait %k_330, %v_332 {{num = {num} : i32}} loc(#loc481)
        %s = scf.if %c -> (tensor<128x64xf32, #mma2>) {{
          scf.yield %s_300 : tensor<128x64xf32, #mma2>
        }} else {{
          scf.yield %cst : tensor<128x64xf32, #mma2>
        }} loc(#loc494)
        %k_410 = ttg.async_copy_global_to_local %k_406, %k_407 mask %m other %cst_31 {{contiguity = 8 : i32}} : tensor<128x64x!tt.ptr<bf16>, #blocked2> -> <128x64xbf16, #shared1, #smem, mutable>
        %k_411 = ttg.async_commit_group tokens %k_410 loc(#loc481)
        %v_422 = ttg.async_copy_global_to_local %v_418, %v_419 mask %m other %cst_30 : tensor<64x128x!tt.ptr<bf16>, #blocked> -> <64x128xbf16, #shared, #smem, mutable>
        %v_423 = ttg.async_commit_group tokens %v_422 loc(#loc482)
        scf.yield %acc_363, %k_331 : tensor<128x128xf32, #mma1>, !ttg.async.token loc(#loc862)
      }} loc(#loc862)
      %blk_next_296 = ttg.async_wait {{num = 0 : i32}} loc(#loc862)
      %acc:3 = scf.for %state = %c0_i32 to %max_states step %c1_i32 iter_args(%m = %cst_22) -> (tensor<128xf32, #blocked1>)  : i32 {{
        %s_326 = tt.load %s_325, %live_318, %cst_36 {{isVolatile = true}} : tensor<128x!tt.ptr<f32>, #blocked4>
        scf.yield %m_new : tensor<128xf32, #blocked1> loc(#loc565)
      }} loc(#loc850)
"""

#: gfx942's KV loop (stream pipeliner, num_stages=2): one LDS copy per tile; the next tile's K and V are loaded at the
#: top of the iteration and stored to LDS at its end (V through a layout change).
AMD_LOOP = """
      %k_188 = ttg.local_alloc : () -> !ttg.memdesc<1x128x64xbf16, #shared1, #smem, mutable> loc(#loc482)
      %v_189 = ttg.local_alloc : () -> !ttg.memdesc<1x64x128xbf16, #shared2, #smem, mutable> loc(#loc483)
      %k_224 = tt.load %k_221, %m, %cst_43 {amd.pipeliner_part = "prologue"} : tensor<128x64x!tt.ptr<bf16>, #blocked>
      %r:8 = scf.for %i = %kv_start to %kv_end step %c64_i32 iter_args(%k_303 = %k_235) -> (!ttg.memdesc<128x64xbf16, #shared1, #smem, mutable>)  : i32 {
        %k_347 = tt.load %k_346, %k_342, %cst_43 : tensor<128x64x!tt.ptr<bf16>, #blocked> loc(#loc482)
        %k_348 = ttg.local_load %k_303 : !ttg.memdesc<128x64xbf16, #shared1, #smem, mutable> -> tensor<128x64xbf16, #dot>
        %v_356 = tt.load %v_355, %v_351, %cst_12 : tensor<64x128x!tt.ptr<bf16>, #blocked3> loc(#loc483)
        %v_385 = amdg.in_thread_transpose %v_356 : tensor<64x128xbf16, #blocked3> -> tensor<64x128xbf16, #linear>
        ttg.local_store %k_347, %k_383 : tensor<128x64xbf16, #blocked> -> !ttg.memdesc<128x64xbf16, #shared1, #smem, mutable>
        ttg.local_store %v_385, %v_384 : tensor<64x128xbf16, #linear> -> !ttg.memdesc<64x128xbf16, #shared2, #smem, mutable>
        scf.yield %k_383 : !ttg.memdesc<128x64xbf16, #shared1, #smem, mutable> loc(#loc485)
      } loc(#loc486)
"""


def test_parse_pipeline_counts_tiles_in_flight_on_nvidia():
    two = parse_pipeline(NV_LOOP.format(bufs=3, num=2))
    assert two == {"kv_buffers": [3, 3], "waits": [2], "groups_per_iter": [2], "prefetch": False, "depth": 2}
    # The loop before block ids were loaded ahead: one buffer, every iteration waits for all of its copies.
    one = parse_pipeline(NV_LOOP.format(bufs=1, num=0))
    assert (one["kv_buffers"], one["waits"], one["depth"]) == ([1, 1], [0], 1)
    # num_stages=4: two tiles left in flight at the wait; buffer copies cap the count.
    assert parse_pipeline(NV_LOOP.format(bufs=3, num=4))["depth"] == 3
    assert parse_pipeline(NV_LOOP.format(bufs=2, num=4))["depth"] == 2


def test_parse_pipeline_reads_the_kv_loop_inside_a_persistent_loop():
    # A loop over work items around the KV loop: its own body holds the pipeline's prologue copies and the drain
    # wait (num 0), which are not the KV loop's depth.
    kv = NV_LOOP.format(bufs=3, num=2)
    persistent = ("      %w:2 = scf.for %item = %pid to %n step %grid iter_args(%x = %c0) -> (i32)  : i32 {\n"
                  "        %k_1 = ttg.async_copy_global_to_local %k_0, %k_buf : tensor<128x64x!tt.ptr<bf16>, #b> -> "
                  "<128x64xbf16, #shared1, #smem, mutable>\n"
                  "        %k_2 = ttg.async_commit_group tokens %k_1 loc(#loc481)\n"
                  + kv +
                  "        scf.yield %x : i32\n"
                  "      } loc(#loc900)\n")
    assert parse_pipeline(persistent) == parse_pipeline(kv)
    assert parse_pipeline(persistent)["depth"] == 2


def test_parse_pipeline_sees_amd_register_prefetch():
    got = parse_pipeline(AMD_LOOP)
    assert got == {"kv_buffers": [1, 1], "waits": [], "groups_per_iter": [], "prefetch": True, "depth": 2}
    # The same loop storing a tile it did not load in this iteration: no prefetch, one tile at a time.
    unpiped = AMD_LOOP.replace("ttg.local_store %k_347", "ttg.local_store %k_999").replace(
        "ttg.local_store %v_385", "ttg.local_store %v_998")
    assert parse_pipeline(unpiped)["depth"] == 1 and not parse_pipeline(unpiped)["prefetch"]
    # No loop staging tiles (the merge kernels): nothing to pipeline.
    assert parse_pipeline("%a = tt.load %p : tensor<64x!tt.ptr<f32>, #b>\n")["depth"] is None


def test_hopper_features():
    # Today's sm_90 fused kernel (Triton 3.9): per-thread cp.async copies, every wgmma waited for at once.
    portable = ("cp.async.cg.shared.global [%r1], [%rd2], 16;\ncp.async.commit_group;\n"
                "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...};\nwgmma.wait_group.sync.aligned 0;\n")
    assert hopper_features(portable) == {"tma": 0, "setmaxnreg": 0, "wgmma": 1, "cp_async": 1, "wgmma_waits": [0]}
    specialized = ("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd2];\n"
                   "setmaxnreg.dec.sync.aligned.u32 40;\nsetmaxnreg.inc.sync.aligned.u32 232;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {...};\nwgmma.wait_group.sync.aligned 1;\n"
                   "wgmma.wait_group.sync.aligned 0;\n")
    assert hopper_features(specialized) == {"tma": 1, "setmaxnreg": 2, "wgmma": 1, "cp_async": 0,
                                            "wgmma_waits": [0, 1]}


def test_matrix_instruction_counts():
    assert count_matrix_instrs("mma.sync.aligned.m16n8k16 x\nwgmma.mma_async.sync y\nmma.sync.aligned", "cuda") == \
        {"mma.sync": 2, "wgmma.mma_async": 1}
    assert count_matrix_instrs("v_mfma_f32_32x32x8_f16 a\n v_mfma_f32_32x32x8_f16 b\n v_add", "hip") == \
        {"v_mfma_f32_32x32x8_f16": 2}
    assert count_matrix_instrs("fma.rn.f32", "cuda") == {}


def test_parse_ptxas_and_amdgcn():
    log = ("ptxas info    : Function properties for k\n    8 bytes stack frame, 16 bytes spill stores, 24 bytes spill "
           "loads\nptxas info    : Used 255 registers, used 1 barriers")
    assert parse_ptxas(log) == {"registers": 255, "spill_bytes": 40, "stack_bytes": 8}
    asm = ("    .agpr_count:     4\n    .group_segment_fixed_size: 32768\n    .private_segment_fixed_size: 0\n"
           "    .sgpr_count:     100\n    .sgpr_spill_count: 9\n    .vgpr_count:     44\n    .vgpr_spill_count: 0\n")
    got = parse_amdgcn(asm)
    assert (got["registers"], got["agprs"], got["vgpr_spills"], got["sgpr_spills"], got["lds_bytes"]) == \
        (44, 4, 0, 9, 32768)


def test_private_memory_ops_tell_a_reserved_scratch_slot_from_a_spill():
    reserved = ("\t\t.amdhsa_user_sgpr_private_segment_buffer 1\n\ts_mov_b64 s[96:97], s[0:1]\n"
                "\ts_mov_b64 s[98:99], s[2:3]\n"
                "\tbuffer_load_dwordx4 v[18:21], v15, s[8:11], 0 offen\n")
    assert count_private_memory_ops(reserved) == 0
    assert count_private_memory_ops(reserved + "\tbuffer_store_dword v3, off, s[96:99], 0 offset:8\n") == 1
    assert count_private_memory_ops(reserved + "\tbuffer_load_dword v40, v2, s[0:3], 0 offen\n") == 0
    assert count_private_memory_ops("\tscratch_store_dwordx4 off, v[0:3], s33\n\tscratch_load_dword v1, off, s33\n") == 2
    # without a private-segment buffer (flat scratch), s[0:3] is an ordinary resource
    assert count_private_memory_ops("\tbuffer_load_dword v1, v2, s[0:3], 0 offen\n") == 0


def test_failures_flag_spills_smem_and_missing_matrix_units():
    ok = dict(ok=True, default=True, spills=0, registers=100, shared_bytes=1000, shared_limit=65536,
              require_matrix=True, shared_part_matrix=True)
    assert failures(ok) == []
    assert "spills (8)" in failures({**ok, "spills": 8})
    assert any("shared memory" in w for w in failures({**ok, "shared_bytes": 70000}))
    assert any("matrix" in w for w in failures({**ok, "shared_part_matrix": False}))
    assert failures({**ok, "shared_part_matrix": False, "require_matrix": False}) == []
    assert failures({"ok": False, "error": "boom"}) == ["compile failed: boom"]
    shallow = {**ok, "min_pipeline_depth": 2, "pipeline": {"depth": 1}}
    assert any("pipeline depth 1 < 2" in w for w in failures(shallow))
    assert failures({**shallow, "pipeline": {"depth": 2}}) == []
    assert failures({**shallow, "min_pipeline_depth": 0}) == []  # AMD: reported, not required
    heavy = {**ok, "registers": 130, "max_registers": 128}
    assert failures(heavy) == ["130 registers > 128 (decode suffix-only budget)"]
    assert failures({**heavy, "registers": 126}) == [] and failures({**heavy, "max_registers": 0}) == []


def test_exclusions_from_a_report_cover_the_twins_of_a_failed_config(tmp_path):
    base = dict(kernel="prefix_attention", ok=True, registers=200, spills=0, default=True)
    records = [dict(base, target="sm90", dtype="fp16", head_dim=128, config_name="bad", spills=64),
               dict(base, target="sm90", dtype="fp16", head_dim=128, config_name="good"),
               dict(base, target="sm80", dtype="fp16", head_dim=128, config_name="other-target", ok=False),
               dict(base, target="sm90", dtype="fp32", head_dim=64, config_name="fp32-fail", ok=False, error="x")]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"records": records}))
    out = exclusions_from_report(report, "sm90")
    # head sizes padded to the same BLOCK_D (80, 96, 128) and the other 16-bit dtype share the binary's resources
    # A failed launch with shared items also excludes the same binary under other suffix-only options (name_sfw*).
    assert out == {**{(hd, dt): {"bad", "bad_sfw*"} for hd in (80, 96, 128) for dt in ("fp16", "bf16")},
                   (64, "fp32"): {"fp32-fail", "fp32-fail_sfw*"}}
    records = [dict(base, target="sm90", dtype="fp32", head_dim=64, variant="decode/suffix-only", spills=8,
                    config_name="sh64x32_sf16x16_w8_s3_sfw4_s3")]
    report.write_text(json.dumps({"records": records}))
    from prefixattn.tuning.table_builder import is_excluded

    # A failed suffix-only launch rules out every config with the same suffix binary: its tiles under the same
    # suffix launch (own _sfw options, or the shared launch's), whatever the shared tiles; after a spill, deeper too.
    excluded = exclusions_from_report(report, "sm90")[(64, "fp32")]
    assert "sh64x32_sf16x16_w8_s3_sfw4_s3" in excluded
    for same in ("sh32x64_sf16x16_w8_s4_sfw4_s3", "sh16x16_sf16x16_w4_s3", "sh64x32_sf16x16_w8_s3_sfw4_s4"):
        assert is_excluded(same, excluded), same
    for other in ("sh64x32_sf16x16_w8_s3", "sh64x32_sf16x32_w8_s3_sfw4_s3", "sh64x32_sf16x16_w8_s3_sfw4_s2",
                  "sh64x32_sf16x16_w8_s3_sfw8_s3"):
        assert not is_excluded(other, excluded), other

    assert is_excluded("sh64x32_sf16x16_w8_s3_sfw4_s4", {"sh64x32_sf16x16_w8_s3_sfw*"})
    assert not is_excluded("sh64x32_sf16x16_w8_s3", {"sh64x32_sf16x16_w8_s3_sfw*"})
    # After a spill, deeper pipelines of the same tiles and warps are ruled out too.
    records = [dict(base, target="sm90", dtype="fp32", head_dim=64, variant="chunked_prefill", spills=108,
                    config_name="sh128x64_sf128x64_w8_s3")]
    report.write_text(json.dumps({"records": records}))
    excluded = exclusions_from_report(report, "sm90")[(64, "fp32")]
    assert is_excluded("sh128x64_sf128x64_w8_s4_sfw8_s3", excluded) and is_excluded("sh128x64_sf128x64_w8_s4", excluded)
    assert not is_excluded("sh128x64_sf128x64_w8_s2", excluded) and not is_excluded("sh128x32_sf128x64_w8_s3", excluded)
    # A binary whose launch a rule changed (@...) failed under the rule's options, not the table's: no exclusion.
    records = [dict(base, target="sm80", dtype="bf16", head_dim=64, spills=24, config_name="sh128x64_sf16x32_w8_s3",
                    variant="decode/suffix-only+lse+nan_guard+fp8e5@w8s3")]
    report.write_text(json.dumps({"records": records}))
    assert exclusions_from_report(report, "sm80") == {}


def test_signature_follows_launch_specialization():
    sig, consts, attrs = build_signature(
        ["o_ptr", "n", "stride_t", "stride_d", "scale", "BLOCK"], {"o_ptr": "fp16"},
        {"n": 7, "stride_t": 4096, "stride_d": 1, "scale": 0.5}, {"BLOCK": 64}, TARGETS["gfx942"])
    assert sig == {"o_ptr": "*fp16", "n": "i32", "stride_t": "i32", "stride_d": "constexpr", "scale": "fp32",
                   "BLOCK": "constexpr"}
    assert consts == {"stride_d": 1, "BLOCK": 64}
    assert attrs[(0,)] == [["tt.divisibility", 16], ["tt.pointer_range", 32]]
    assert attrs[(2,)] == [["tt.divisibility", 16]] and (1,) not in attrs


def _shipped_binaries(target_name):
    """(head_dim, variant prefix, config name) of every binary of the target's bf16 default configs."""
    from prefixattn.autotune.config_space import HEAD_DIMS
    from prefixattn.tuning.compile_check import class_binaries, default_attention_configs

    target = TARGETS[target_name]
    return {(hd, mode + ("" if has_shared else "/suffix-only"), cfg.short())
            for hd in HEAD_DIMS
            for mode, cfg, has_shared in class_binaries(default_attention_configs(target, hd, "bf16"))}


def _packed_decode_binaries(target_name):
    """(head_dim, variant prefix, config name) of the decode binaries the worst case compiles with several KV heads
    per program."""
    from prefixattn.autotune.config_space import KV_HEADS_MAX_BLOCK_D
    from prefixattn.tuning.compile_check import WORST_CASE_KV_HEADS, class_binaries, default_attention_configs

    hd, heads = KV_HEADS_MAX_BLOCK_D, WORST_CASE_KV_HEADS
    return {(hd, f"{mode}/kv_heads={heads}/suffix-only",
             dataclasses.replace(cfg, suffix=dataclasses.replace(cfg.suffix, kv_heads=heads)).short())
            for mode, cfg, has_shared in class_binaries(default_attention_configs(TARGETS[target_name], hd, "bf16"))
            if mode == "decode" and not has_shared}


def _pdl_binaries(target_name):
    """(head_dim, variant, config name) of the binaries the worst case compiles as launches chained by PDL: every
    class binary at ``KV_HEADS_MAX_BLOCK_D``, on the targets that have grid dependency control."""
    from prefixattn.autotune.config_space import KV_HEADS_MAX_BLOCK_D
    from prefixattn.tuning.compile_check import class_binaries, default_attention_configs

    target = TARGETS[target_name]
    if target.is_hip or target.arch < 90:
        return set()
    hd = KV_HEADS_MAX_BLOCK_D
    return {(hd, mode + ("" if has_shared else "/suffix-only") + "+lse+pdl", cfg.short())
            for mode, cfg, has_shared in class_binaries(default_attention_configs(target, hd, "bf16"))}


def _own_v_binaries(target_name):
    """(head_dim, variant, config name) of the binaries the worst case compiles with keys and values of their own
    head sizes: the class binaries of the tabled rows of their padded head size, on its targets only."""
    from prefixattn.autotune.config_space import block_d
    from prefixattn.tuning.compile_check import (WORST_CASE_QK_V_HEAD_DIMS, WORST_CASE_QK_V_TARGETS, class_binaries,
                                                 default_attention_configs)

    if target_name not in WORST_CASE_QK_V_TARGETS:
        return set()
    qk, v = WORST_CASE_QK_V_HEAD_DIMS
    configs = default_attention_configs(TARGETS[target_name], block_d(max(qk, v)), "bf16")
    return {(qk, mode + ("" if has_shared else "/suffix-only") + f"+lse+v{v}", cfg.short())
            for mode, cfg, has_shared in class_binaries(configs)}


@pytest.mark.compile
def test_worst_case_selection_covers_every_shipped_binary_and_feature_axis(tmp_path):
    """CI's compile-check (``--worst-case``, ~8 minutes on 2 cores): every shipped bf16 binary, and at the extreme
    head sizes the feature switches over each fp8 type, compile without spills at the promised pipeline depth; so do
    the MLA kernel's, the decode binaries with several KV heads per program, the class binaries chained by PDL (with
    their grid dependency control: failures() requires it) and the matrix classes' Hopper build."""
    from prefixattn.autotune.config_space import FP8_SUFFIX_MAX_STAGES, HEAD_DIMS
    from prefixattn.tuning.compile_specs import fp8_kv_types

    out = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-m", "prefixattn.cli", "compile-check", "--worst-case", "--jobs", "2", "--quiet",
           "--json", str(out)]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2],
                         timeout=1800)
    elapsed = time.perf_counter() - t0
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    records = json.loads(out.read_text())["records"]
    fused = [r for r in records if r["kernel"] == "prefix_attention"]
    plain = [r for r in fused if "+kv_scale" not in r["variant"] and "+soft_cap" not in r["variant"]]
    features = [r for r in fused if r not in plain]
    for name in ("sm80", "sm90", "gfx90a", "gfx942"):
        target = TARGETS[name]
        # Every binary of the shipped tables, bf16 with LSE.
        got = {(r["head_dim"], r["variant"].removesuffix("+lse"), r["config_name"]) for r in plain
               if r["target"] == name and r["dtype"] == "bf16"}
        packed = {b for b in got if "/kv_heads=" in b[1]}
        own_v = {b for b in got if re.search(r"\+v\d+$", b[1])}
        chained = {b for b in got if b[1].endswith("+pdl")}
        assert got - packed - own_v - chained == _shipped_binaries(name)
        # And sm90's class binaries at KV_HEADS_MAX_BLOCK_D as launches chained by PDL.
        assert chained == _pdl_binaries(name)
        # And sm90's binaries of keys and values of their own head sizes.
        assert own_v == _own_v_binaries(name)
        # And each decode binary at KV_HEADS_MAX_BLOCK_D with WORST_CASE_KV_HEADS KV heads per program.
        assert packed == _packed_decode_binaries(name)
        # At the smallest and largest head size each of them with every model switch over a 16-bit cache, and each
        # fp8 type alone and under every model switch, the suffix-only ones also under every switch and the NaN
        # guard over each fp8 type (bf16); the fp32 binaries there with LSE.
        extremes = (min(HEAD_DIMS), max(HEAD_DIMS))
        mine = [r for r in features if r["target"] == name]
        assert all(r["dtype"] == "bf16" and r["head_dim"] in extremes for r in mine)
        kinds = {(r["head_dim"], r["variant"].split("+")[-1].split("@")[0]) for r in mine}
        assert kinds == {(hd, kv) for hd in extremes for kv in ("sinks", *fp8_kv_types(target))}
        guarded = [r for r in mine if "+soft_cap+window+sinks+kv_scale+nan_guard+fp8" in r["variant"]]
        with_model = [r for r in mine if "+soft_cap+window+sinks" in r["variant"] and r not in guarded]
        alone = [r for r in mine if r not in with_model and r not in guarded]
        assert all("+lse+kv_scale+fp8" in r["variant"] for r in alone)
        at_extremes = [b for b in _shipped_binaries(name) if b[0] in extremes]
        per_binary = len(at_extremes)
        assert len(with_model) == per_binary * (1 + len(fp8_kv_types(target)))
        assert len(alone) == per_binary * len(fp8_kv_types(target))
        assert all("/suffix-only" in r["variant"] for r in guarded)
        suffix_only = len([b for b in at_extremes if b[1].endswith("/suffix-only")])
        assert len(guarded) == suffix_only * len(fp8_kv_types(target))
        fp32 = {r["head_dim"] for r in plain if r["target"] == name and r["dtype"] == "fp32"}
        assert fp32 == set(extremes)
    for r in features:
        # The fp8 launch rules (config_space.LaunchOptions.for_kv): suffix-only NVIDIA launches at <= 3 stages and
        # >= 8 warps, 32-row tiles at head_dim 256 at 4 ...
        tiles = r["config"]["suffix" if "/suffix-only" in r["variant"] else "shared"]
        if "/suffix-only" in r["variant"] and "fp8" in r["variant"] and not TARGETS[r["target"]].is_hip:
            if r["head_dim"] == 256 and 32 <= tiles["block_m"] < 64:
                assert r["options"]["num_warps"] == FP8_LARGE_HEAD_DECODE_WARPS, r["variant"]
            else:
                assert r["options"]["num_warps"] >= FP8_SUFFIX_MIN_WARPS, r["variant"]
            assert r["options"]["num_stages"] <= FP8_SUFFIX_MAX_STAGES, r["variant"]
        # ... and tiles of 32 rows or more at head_dim 256 read 16-position KV tiles (config_space.fp8_block_n).
        if "fp8" in r["variant"] and r["head_dim"] == 256 and tiles["block_m"] >= 32:
            assert tiles["block_n"] <= 16 or r["variant"].endswith("@n16"), r["variant"]
    assert sorted(r["kernel"] for r in records
                  if r["kernel"] not in ("prefix_attention", "mla_attention", "hopper")) == \
        sorted(["merge_state_pair", "merge_states"] * 4)
    # The matrix classes' Hopper build on sm90 only: the shared and the chunk class at each head size it serves with
    # LSE, at the extremes also under every model switch; TMA, warpgroup MMAs and setmaxnreg in each (failures()
    # requires them).
    hopper = [r for r in records if r["kernel"] == "hopper"]
    served = [hd for hd in HEAD_DIMS if hd in HOPPER_HEAD_DIMS]
    assert sorted((r["target"], r["head_dim"], r["variant"]) for r in hopper) == sorted(
        [("sm90", hd, f"hopper-{c}+lse") for hd in served for c in ("shared", "chunk")]
        + [("sm90", hd, f"hopper-{c}+lse+soft_cap+window+sinks") for hd in (min(HEAD_DIMS), max(HEAD_DIMS))
           if hd in served for c in ("shared", "chunk")])
    assert all(r["hopper"]["tma"] and r["hopper"]["setmaxnreg"] and r["hopper"]["wgmma"] for r in hopper)
    # The PDL launches signal their dependents and wait for their predecessor (failures() requires both), at the
    # registers of the same binary without PDL (the wait sits at the start of the grid's last program; program 0
    # waiting at its end kept the program id alive in every program: sm_90's 16 x 32 decode tile 82 -> 97).
    chained = [r for r in records if r["variant"].endswith("+pdl")]
    assert chained and all(r["pdl"]["launch_dependents"] and r["pdl"]["wait"] for r in chained)
    by_binary = {(r["target"], r["head_dim"], r["variant"], r["config_name"]): r for r in records
                 if r["kernel"] == "prefix_attention"}
    for r in chained:
        twin = by_binary[(r["target"], r["head_dim"], r["variant"].removesuffix("+pdl"), r["config_name"])]
        assert r["registers"] == twin["registers"] and twin["pdl"] == {"launch_dependents": 0, "wait": 0}, r
    # The MLA kernel's three class binaries on every target, bf16, and on sm90 over an e5m2 latent too.
    assert sorted((r["target"], r["variant"]) for r in records if r["kernel"] == "mla_attention") == sorted(
        (name, f"{cls}+lse{kv}") for name in ("sm80", "sm90", "gfx90a", "gfx942")
        for cls in ("shared", "chunk", "decode") for kv in ("", "+fp8e5") if name == "sm90" or not kv)
    for r in records:
        assert r["ok"] and r["spills"] == 0 and r["registers"] > 0
        assert r["shared_bytes"] <= TARGETS[r["target"]].max_shared_bytes
        if r["kernel"] == "mla_attention" and not TARGETS[r["target"]].is_hip:
            assert r["pipeline"]["depth"] >= 2, r["pipeline"]
            assert r["variant"] != "shared+lse" or r["shared_part_matrix"] is True, r
        if r["kernel"] == "prefix_attention" and not TARGETS[r["target"]].is_hip:
            # K/V tiles in flight (required on NVIDIA; on AMD the compiler's choice, reported: a 1-stage launch has
            # none)
            assert r["pipeline"]["depth"] is not None and r["pipeline"]["depth"] >= 2, r["pipeline"]
            if "/suffix-only" not in r["variant"] and r["dtype"] == "bf16":
                assert r["shared_part_matrix"] is True and r["matrix_instrs"], r
    print(f"compile-check --worst-case: {len(records)} compiles in {elapsed:.0f} s")


@pytest.mark.compile
def test_worst_case_selection_fails_on_a_spilling_table_entry(monkeypatch):
    """A table entry that spills (sm_90, head_dim 128: 128 x 64 shared tiles at 4 warps hold a 128 x 128 fp32
    accumulator, 128 registers per thread, on top of the scores) is in CI's selection and fails it."""
    from prefixattn.autotune import lookup
    from prefixattn.autotune.config_space import AttentionConfig
    from prefixattn.tuning import compile_check

    spilling = AttentionConfig.from_dict({"shared": {"block_m": 128, "block_n": 64},
                                          "suffix": {"block_m": 16, "block_n": 32},
                                          "launch": {"num_warps": 4, "num_stages": 3}})
    shipped = lookup.load_shipped("sm90")
    table = {b: (spilling if b.head_dim == 128 and b.dtype == "bf16" and b.max_q_len == 1 else cfg)
             for b, cfg in shipped.items()}
    assert table != shipped
    monkeypatch.setattr(lookup, "load_shipped", lambda name: table)
    jobs = [j for j in compile_check.worst_case_jobs([TARGETS["sm90"]])
            if j.config_name == spilling.short() and j.kernel == "prefix_attention"  # not its Hopper build's
            and not j.require_pdl]  # nor its binaries chained by PDL (the same tiles)
    assert [j.variant for j in jobs] == ["decode+lse", "decode/suffix-only+lse"]
    shared, suffix = compile_check.run_jobs(jobs, workers=1)
    assert any(why.startswith("spills") for why in compile_check.failures(shared)), shared
    assert compile_check.failures(suffix) == []  # the suffix launch (16 x 32 tiles) was not touched
