"""Shape buckets and config spaces: rounding, keys, distance, the prune's reasons."""

import dataclasses

import math

import pytest

from prefixattn.autotune.buckets import Bucket, distance, dtype_name, make_bucket, nearest
from prefixattn.autotune.config_space import (FP8_SUFFIX_MIN_WARPS, AttentionConfig, LaunchOptions, Tiles,
                                              attention_space, launch_space, prune, prune_reason)
from prefixattn.autotune.targets import TARGETS, get_target, parse_targets, target_for, writes_own_l2_fences


def test_make_bucket_rounds_counts_up_to_powers_of_two_and_clamps():
    b = make_bucket(head_dim=128, dtype="float16", group=6, q_rows=700, max_q_len=1, kv_len=100000)
    assert (b.group, b.q_rows, b.max_q_len, b.kv_len, b.dtype) == (8, 1024, 1, 65536, "fp16")
    assert make_bucket(head_dim=64, dtype="bf16", q_rows=0, kv_len=3).q_rows == 1
    assert make_bucket(head_dim=64, dtype="bf16", kv_len=3).kv_len == 16


def test_bucket_key_roundtrip():
    b = make_bucket(head_dim=96, dtype="fp32", group=4, q_rows=300, max_q_len=512, kv_len=4000)
    assert b.key() == "d96-fp32-g4-q512-l512-kv4096"
    assert Bucket.from_key(b.key()) == b
    assert Bucket.from_dict(b.to_dict()) == b
    with pytest.raises(ValueError, match="bucket key"):
        Bucket.from_key("d96-fp8-g4")


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=0, dtype="fp16"), "head_dim"),
    (dict(head_dim=128, dtype="int8"), "dtype"),
    (dict(head_dim=128, dtype="fp16", group=0), "group"),
    (dict(head_dim=128, dtype="fp16", kv_len=-1), "kv_len"),
])
def test_make_bucket_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_bucket(**kwargs)


def test_dtype_name_accepts_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert [dtype_name(d) for d in (torch.float16, torch.bfloat16, torch.float32)] == ["fp16", "bf16", "fp32"]


def test_distance_is_log2_l1_and_infinite_across_head_dims_or_dtypes():
    a = make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=256, kv_len=1024)
    b = make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=1024, kv_len=2048)
    assert distance(a, b) == 3.0
    assert distance(a, make_bucket(head_dim=64, dtype="fp16", group=4, q_rows=256, kv_len=1024)) == math.inf
    assert distance(a, make_bucket(head_dim=128, dtype="bf16", group=4, q_rows=256, kv_len=1024)) == math.inf
    # decode vs prefill weighs double: a decode bucket prefers a decode entry with another KV length
    decode_far_kv = make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=256, kv_len=8192)
    prefill = make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=256, max_q_len=4, kv_len=1024)
    assert nearest(a, [prefill, decode_far_kv]) == decode_far_kv


def test_target_table_has_the_six_targets_and_their_knobs():
    assert set(TARGETS) == {"sm80", "sm89", "sm90", "gfx90a", "gfx942", "gfx950"}
    assert TARGETS["gfx950"].hip_knobs["kpack"] == (1,)
    assert TARGETS["gfx942"].warp_size == 64 and TARGETS["sm90"].warp_size == 32
    assert TARGETS["sm80"].max_shared_bytes == 166912 and TARGETS["gfx90a"].max_shared_bytes == 65536
    assert target_for(capability=(9, 0)).name == "sm90"
    assert target_for(gcn_arch="gfx942:sramecc+:xnack-").name == "gfx942"
    assert target_for(capability=(7, 5)) is None and target_for(gcn_arch="gfx1100") is None
    assert [t.name for t in parse_targets("sm80, gfx942,sm80")] == ["sm80", "gfx942"]
    with pytest.raises(ValueError, match="target: expected one of"):
        get_target("sm70")


@pytest.mark.parametrize("arch, version, want", [
    ("gfx942", "3.6.0", True), ("gfx950", "3.8.0+rocm7.1", True), ("gfx942", "3.9.0", False),
    ("gfx942", "3.10.1", False), ("gfx90a", "3.6.0", False), (90, "3.6.0", False)])
def test_the_kernel_writes_its_own_merge_fences_only_where_triton_misplaces_them(arch, version, want):
    """gfx942/gfx950 use buffer atomics, whose fences Triton before 3.9 put the wrong way round (triton#11081)."""
    assert writes_own_l2_fences(arch, version) is want


def test_a_triton_version_without_major_and_minor_is_refused():
    with pytest.raises(ValueError, match="triton_version: expected 'MAJOR.MINOR"):
        writes_own_l2_fences("gfx942", "nightly")


def test_launch_space_has_hip_knobs_only_on_hip():
    assert all(lo.kpack == 1 and lo.waves_per_eu == 0 for lo in launch_space(TARGETS["sm90"]))
    hip = launch_space(TARGETS["gfx942"])
    assert {lo.kpack for lo in hip} == {1, 2} and {lo.num_stages for lo in hip} == {1, 2}
    assert {lo.kpack for lo in launch_space(TARGETS["gfx950"])} == {1}
    assert LaunchOptions(num_warps=8).compile_options(TARGETS["sm80"]) == {"num_warps": 8, "num_stages": 2}
    assert "kpack" in LaunchOptions().compile_options(TARGETS["gfx90a"])


def _cfg(sm=64, sn=64, fm=16, fn=64, **launch):
    return AttentionConfig(Tiles(sm, sn), Tiles(fm, fn), LaunchOptions(**launch))


@pytest.mark.parametrize("cfg, target, shape, match", [
    (_cfg(fm=16), "sm90", dict(group=32), "block_m 16 < GQA group 32"),
    (_cfg(kpack=2), "sm90", {}, "HIP knobs set on a CUDA target"),
    (_cfg(kpack=2), "gfx950", {}, "kpack 2 not accepted"),
    (_cfg(matrix_instr_nonkdim=32), "gfx942", {}, "nonkdim 32"),
    (_cfg(num_stages=3), "gfx90a", {}, "num_stages 3 not used on HIP"),
    (_cfg(sm=128), "sm80", dict(q_rows=2, group=1), "exceeds 2 rows"),
    (_cfg(sm=16, sn=128, fn=64, num_stages=4, num_warps=8), "sm89", {}, "shared memory"),
    (_cfg(sm=128, sn=128, num_warps=2), "sm80", {}, "registers"),
])
def test_prune_reasons(cfg, target, shape, match):
    reason = prune_reason(cfg, TARGETS[target], head_dim=128, dtype="fp16", **shape)
    assert reason is not None and match in reason


def test_prune_keeps_feasible_configs_and_every_survivor_fits():
    target = TARGETS["sm90"]
    space = attention_space(target)
    kept = prune(space, target, head_dim=128, dtype="fp16", group=4, q_rows=256, max_q_len=1, kv_len=4096)
    assert 0 < len(kept) < len(space)
    assert all(c.shared.block_m >= 4 and c.suffix.block_m >= 4 for c in kept)
    assert _cfg(num_warps=8) in kept


def test_config_dict_roundtrip_and_validation():
    c = _cfg(sm=128, sn=32, num_warps=8, num_stages=3)
    assert AttentionConfig.from_dict(c.to_dict()) == c
    bad = c.to_dict()
    bad["shared"]["block_m"] = 48
    with pytest.raises(ValueError, match="config.shared.block_m"):
        AttentionConfig.from_dict(bad)
    with pytest.raises(ValueError, match="config: expected"):
        AttentionConfig.from_dict({"shared": {}})


def test_fp8_suffix_launches_take_more_warps_on_nvidia_only():
    # The launch rule (compile-check measures the same options): fp8 K/V, suffix-only, NVIDIA -> <= 3 stages and
    # >= 8 warps, except 32-row decode tiles of 256-wide heads: 4 warps.
    from prefixattn.autotune.config_space import FP8_LARGE_HEAD_DECODE_WARPS

    lo = LaunchOptions(num_warps=4, num_stages=4)
    fp8_suffix = dict(has_shared=False, kv_fp8=True, is_hip=False, block_n=64)
    assert lo.for_kv(**fp8_suffix, block_d=128, block_m=32) == LaunchOptions(num_warps=FP8_SUFFIX_MIN_WARPS,
                                                                             num_stages=3)
    assert lo.for_kv(**fp8_suffix, block_d=256, block_m=64) == LaunchOptions(num_warps=FP8_SUFFIX_MIN_WARPS,
                                                                             num_stages=3)
    assert LaunchOptions(num_warps=8).for_kv(**fp8_suffix, block_d=256, block_m=32) == LaunchOptions(
        num_warps=FP8_LARGE_HEAD_DECODE_WARPS, num_stages=2)
    assert lo.for_kv(**fp8_suffix, block_d=256, block_m=16).num_warps == FP8_SUFFIX_MIN_WARPS
    for kw in (dict(has_shared=True, kv_fp8=True, is_hip=False), dict(has_shared=False, kv_fp8=False, is_hip=False),
               dict(has_shared=False, kv_fp8=True, is_hip=True)):
        assert lo.for_kv(**kw, block_d=256, block_m=32, block_n=64) == lo, kw
    assert LaunchOptions(num_warps=16).for_kv(**fp8_suffix, block_d=64, block_m=16).num_warps == 16


def test_nan_guard_suffix_launches_of_small_heads_take_more_warps_on_nvidia_only():
    # The NaN guard's rule, after the fp8 one: suffix-only NVIDIA launches at BLOCK_D <= 64 run at >= 8 warps.
    from prefixattn.autotune.config_space import NAN_GUARD_MIN_WARPS, NAN_GUARD_SMALL_HEAD_DIM

    lo = LaunchOptions(num_warps=4, num_stages=4)
    guard = dict(has_shared=False, kv_fp8=False, is_hip=False, block_m=16, block_n=64, nan_guard=True)
    assert lo.for_kv(**guard, block_d=NAN_GUARD_SMALL_HEAD_DIM) == LaunchOptions(num_warps=NAN_GUARD_MIN_WARPS,
                                                                                 num_stages=4)
    assert lo.for_kv(**guard, block_d=128) == lo
    assert lo.for_kv(**dict(guard, has_shared=True), block_d=64) == lo
    assert lo.for_kv(**dict(guard, is_hip=True), block_d=64) == lo
    assert lo.for_kv(**dict(guard, nan_guard=False), block_d=64) == lo
    # Over an fp8 cache its decode tiles are capped at NAN_GUARD_FP8_MAX_REGS (ptxas spilled at its own 80);
    # chunk tiles, larger heads and launches without the guard are not.
    from prefixattn.autotune.config_space import NAN_GUARD_DECODE_ROWS, NAN_GUARD_FP8_MAX_REGS

    fp8 = dict(guard, kv_fp8=True)
    assert lo.for_kv(**fp8, block_d=64) == LaunchOptions(num_warps=8, num_stages=3, maxnreg=NAN_GUARD_FP8_MAX_REGS)
    assert lo.for_kv(**dict(fp8, block_m=2 * NAN_GUARD_DECODE_ROWS), block_d=64).maxnreg == 0
    assert lo.for_kv(**fp8, block_d=128).maxnreg == 0
    assert lo.for_kv(**dict(fp8, nan_guard=False), block_d=64).maxnreg == 0
    assert lo.for_kv(**dict(fp8, is_hip=True), block_d=64).maxnreg == 0


def test_maxnreg_reaches_nvidia_launches_only_and_stays_out_of_tables():
    capped = LaunchOptions(num_warps=8, num_stages=3, maxnreg=128)
    assert capped.compile_options(TARGETS["sm80"]) == {"num_warps": 8, "num_stages": 3, "maxnreg": 128}
    assert "maxnreg" not in capped.compile_options(TARGETS["gfx942"])
    assert "maxnreg" not in LaunchOptions(num_warps=8).compile_options(TARGETS["sm90"])
    assert "maxnreg" not in LaunchOptions().to_dict() and capped.to_dict()["maxnreg"] == 128
    from prefixattn.planner.tiles import tiles_from_configs
    from prefixattn.kernels import layout as K

    cfg = _cfg(sm=64, sn=64, fm=16, fn=32, num_warps=4, num_stages=3)
    for is_hip in (False, True):
        tiles = tiles_from_configs(decode=cfg, chunk=cfg, head_dim=64, is_hip=is_hip)
        opts = tiles.launch_options(K.CLASS_DECODE, kv_fp8=True, nan_guard=True)
        assert opts.get("maxnreg") == (None if is_hip else 128), is_hip
        assert "maxnreg" not in tiles.launch_options(K.CLASS_DECODE, kv_fp8=True)


def test_nan_guard_decode_launches_of_head_128_take_four_warps_with_16_bit_inputs():
    from prefixattn.autotune.config_space import (NAN_GUARD_DECODE_ROWS, NAN_GUARD_MID_HEAD_DECODE_WARPS,
                                                  NAN_GUARD_MID_HEAD_DIM)

    lo = LaunchOptions(num_warps=8, num_stages=3)
    guard = dict(has_shared=False, kv_fp8=False, is_hip=False, nan_guard=True, block_d=NAN_GUARD_MID_HEAD_DIM,
                 block_n=64)
    want = LaunchOptions(num_warps=NAN_GUARD_MID_HEAD_DECODE_WARPS, num_stages=3)
    assert lo.for_kv(**guard, block_m=NAN_GUARD_DECODE_ROWS) == want
    # Chunk tiles, fp32 q, fp8 caches (their own rule), other heads, AMD and shared launches keep theirs.
    assert lo.for_kv(**guard, block_m=2 * NAN_GUARD_DECODE_ROWS) == lo
    assert lo.for_kv(**guard, block_m=16, q_fp32=True) == lo
    assert lo.for_kv(**dict(guard, kv_fp8=True), block_m=16) == lo
    assert lo.for_kv(**dict(guard, block_d=256), block_m=16) == lo
    assert lo.for_kv(**dict(guard, is_hip=True), block_m=16) == lo
    assert lo.for_kv(**dict(guard, has_shared=True), block_m=16) == lo
    # Narrow KV tiles take at least NAN_GUARD_MIN_WARPS instead.
    from prefixattn.autotune.config_space import NAN_GUARD_MIN_WARPS, NAN_GUARD_NARROW_BLOCK_N

    narrow = dict(guard, block_n=NAN_GUARD_NARROW_BLOCK_N, block_m=NAN_GUARD_DECODE_ROWS)
    assert LaunchOptions(4, 3).for_kv(**narrow) == LaunchOptions(num_warps=NAN_GUARD_MIN_WARPS, num_stages=3)
    assert LaunchOptions(16, 3).for_kv(**narrow) == LaunchOptions(num_warps=16, num_stages=3)


def test_fp8_suffix_launches_of_narrow_tiles_keep_their_warps():
    from prefixattn.autotune.config_space import FP8_NARROW_TILE

    fp8_suffix = dict(has_shared=False, kv_fp8=True, is_hip=False, block_d=128)
    lo = LaunchOptions(num_warps=4, num_stages=4)
    assert lo.for_kv(**fp8_suffix, block_m=FP8_NARROW_TILE, block_n=FP8_NARROW_TILE) == LaunchOptions(4, 3)
    assert lo.for_kv(**fp8_suffix, block_m=FP8_NARROW_TILE, block_n=2 * FP8_NARROW_TILE).num_warps == 8
    assert lo.for_kv(**fp8_suffix, block_m=2 * FP8_NARROW_TILE, block_n=FP8_NARROW_TILE).num_warps == 8


def test_fp8_caches_take_narrower_kv_tiles_under_large_tiles_of_large_heads():
    from prefixattn.autotune.config_space import FP8_MAX_BLOCK_N, fp8_block_n

    nvidia = dict(has_shared=True, is_hip=False, nan_guard=False)
    assert fp8_block_n(64, 32, kv_fp8=True, block_d=256, **nvidia) == FP8_MAX_BLOCK_N == 16
    assert fp8_block_n(128, 64, kv_fp8=True, block_d=256, **nvidia) == 16
    assert fp8_block_n(32, 32, kv_fp8=True, block_d=256, **nvidia) == 16
    assert fp8_block_n(32, 32, kv_fp8=True, block_d=256, **dict(nvidia, is_hip=True)) == 16
    # 16-bit caches, 16-row decode tiles, smaller heads and tiles already narrow keep theirs.
    assert fp8_block_n(64, 32, kv_fp8=False, block_d=256, **nvidia) == 32
    assert fp8_block_n(16, 64, kv_fp8=True, block_d=256, **nvidia) == 64
    assert fp8_block_n(64, 32, kv_fp8=True, block_d=128, **nvidia) == 32
    assert fp8_block_n(64, 16, kv_fp8=True, block_d=256, **nvidia) == 16


def test_fp8_suffix_launches_of_head_128_take_narrower_kv_tiles_on_nvidia_only():
    from prefixattn.autotune.config_space import (FP8_MID_HEAD_DIM, FP8_MID_HEAD_SUFFIX_MAX_BLOCK_N,
                                                  FP8_DECODE_NARROW_BLOCK_N, fp8_block_n)

    suffix = dict(kv_fp8=True, block_d=FP8_MID_HEAD_DIM, has_shared=False, is_hip=False, nan_guard=False)
    assert fp8_block_n(16, 64, **suffix) == FP8_MID_HEAD_SUFFIX_MAX_BLOCK_N == 32
    assert fp8_block_n(128, 64, **suffix) == 32
    assert fp8_block_n(16, 64, **dict(suffix, nan_guard=True)) == FP8_DECODE_NARROW_BLOCK_N == 16
    assert fp8_block_n(128, 64, **dict(suffix, nan_guard=True)) == 32  # chunk tiles: the plain limit
    for other in (dict(has_shared=True), dict(is_hip=True), dict(kv_fp8=False), dict(block_d=64)):
        assert fp8_block_n(16, 64, **dict(suffix, **other)) == 64, other


def test_fp8_decode_launches_of_head_128_under_a_model_switch_take_16_position_tiles_and_128_registers():
    # Triton 3.6 spilled sm_90's 16 x 32 binary over e4m3 with a window at ptxas's 128-register line; 16-position
    # tiles capped at 128 compile with room to spare (FP8_SWITCHED_DECODE_MAX_REGS). Chunk tiles, other head sizes,
    # 16-bit caches, AMD and launches with shared items keep their options; the NaN guard's own rule is unchanged.
    from prefixattn.autotune.config_space import (FP8_DECODE_NARROW_BLOCK_N, FP8_MID_HEAD_DIM,
                                                  FP8_SWITCHED_DECODE_MAX_REGS, fp8_block_n)

    suffix = dict(kv_fp8=True, block_d=FP8_MID_HEAD_DIM, has_shared=False, is_hip=False, nan_guard=False,
                  model_switches=True)
    lo = LaunchOptions(num_warps=4, num_stages=3)
    assert fp8_block_n(16, 32, **suffix) == FP8_DECODE_NARROW_BLOCK_N
    assert lo.for_kv(**suffix, block_m=16, block_n=32) == LaunchOptions(8, 3, maxnreg=FP8_SWITCHED_DECODE_MAX_REGS)
    assert lo.for_kv(**dict(suffix, model_switches=False), block_m=16, block_n=32).maxnreg == 0
    assert fp8_block_n(16, 32, **dict(suffix, model_switches=False)) == 32
    assert fp8_block_n(128, 64, **suffix) == 32 and lo.for_kv(**suffix, block_m=128, block_n=64).maxnreg == 0
    assert lo.for_kv(**dict(suffix, nan_guard=True), block_m=16, block_n=32).maxnreg == 0
    for other in (dict(has_shared=True), dict(is_hip=True), dict(kv_fp8=False), dict(block_d=64)):
        assert lo.for_kv(**dict(suffix, **other), block_m=16, block_n=32).maxnreg == 0, other
        assert fp8_block_n(16, 32, **dict(suffix, **other)) == 32, other


def test_the_launch_applies_the_fp8_rules_per_work_class():
    from prefixattn.planner.tiles import tiles_from_configs
    from prefixattn.kernels import layout as K

    decode = AttentionConfig(shared=Tiles(64, 32), suffix=Tiles(16, 64), launch=LaunchOptions(8, 3),
                             suffix_launch=LaunchOptions(4, 4))
    chunk = AttentionConfig(shared=Tiles(64, 32), suffix=Tiles(64, 32), launch=LaunchOptions(8, 3))
    tiles = tiles_from_configs(decode=decode, chunk=chunk, head_dim=256, is_hip=False)
    plain = {c: tiles.launch_options(c) for c in (K.CLASS_SHARED, K.CLASS_CHUNK, K.CLASS_DECODE)}
    fp8 = {c: tiles.launch_options(c, kv_fp8=True) for c in plain}
    assert plain[K.CLASS_SHARED] == dict(KV_HEADS=1, BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3)
    assert fp8[K.CLASS_SHARED] == dict(KV_HEADS=1, BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=3)
    assert fp8[K.CLASS_CHUNK] == dict(KV_HEADS=1, BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=3)
    assert plain[K.CLASS_DECODE] == dict(KV_HEADS=1, BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    assert fp8[K.CLASS_DECODE] == dict(KV_HEADS=1, BLOCK_M=16, BLOCK_N=64, num_warps=FP8_SUFFIX_MIN_WARPS, num_stages=3)
    # 32-row decode tiles of a 256-wide head: narrower KV tiles at 4 warps.
    wide = dataclasses.replace(decode, suffix=Tiles(32, 32), suffix_launch=LaunchOptions(8, 4))
    tiles = tiles_from_configs(decode=wide, chunk=chunk, head_dim=256, is_hip=False)
    assert tiles.launch_options(K.CLASS_DECODE, kv_fp8=True) == dict(KV_HEADS=1, BLOCK_M=32, BLOCK_N=16,
                                                                     num_warps=4, num_stages=3)
    # Two KV heads per decode program: the fp8 tile's 16 rows hold 8 positions of each.
    two = tiles_from_configs(decode=dataclasses.replace(wide, suffix=Tiles(32, 32, kv_heads=2)), chunk=chunk,
                             head_dim=256, is_hip=False)
    assert two.launch_options(K.CLASS_DECODE, kv_fp8=True) == dict(KV_HEADS=2, BLOCK_M=32, BLOCK_N=8, num_warps=4,
                                                                   num_stages=3)
