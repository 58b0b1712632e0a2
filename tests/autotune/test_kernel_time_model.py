"""The plan-level kernel-time model (prefixattn.autotune.cost_model.launch_time / cascade_time): properties that
must hold whatever the constants, on synthetic launches and on a few full-size plans (host only, no kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from prefixattn.autotune import cost_model as cm
from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles
from prefixattn.autotune.targets import TARGETS
from prefixattn.kernels import layout as K

SM90 = TARGETS["sm90"]
CFG = AttentionConfig(Tiles(128, 64), Tiles(16, 32), LaunchOptions(8, 3), LaunchOptions(4, 3))
COMMON = dict(head_dim=128, dtype="bf16", group=4, num_kv_heads=8)


def _ranges(kind, kv_len, rows=None, units=None, states=None) -> cm.Ranges:
    kind, kv_len = np.asarray(kind, np.int64), np.asarray(kv_len, np.int64)
    n = kind.size
    rows = np.ones(n, np.int64) if rows is None else np.asarray(rows, np.int64)
    units = np.zeros(n, np.int64) if units is None else np.asarray(units, np.int64)
    states = np.ones(n, np.int64) if states is None else np.asarray(states, np.int64)
    return cm.Ranges(kind=kind, kv_len=kv_len, rows=rows, units=units, states=states)


def _decode_step(requests=64, prefix=4096, own=256, rows_per_tile=32):
    """One shared node (its M tiles of rows_per_tile requests) and one suffix tile per request."""
    tiles = -(-requests // rows_per_tile)
    kind = [K.KIND_SHARED] * tiles + [K.KIND_SUFFIX] * requests
    kv = [prefix] * tiles + [own] * requests
    rows = [rows_per_tile] * tiles + [1] * requests
    return _ranges(kind, kv, rows=rows, units=[rows_per_tile] * tiles + [1] * requests,
                   states=[2] * (tiles + requests))


def test_modeled_time_is_at_least_the_floor_and_grows_with_work():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 300))
        r = _ranges(rng.integers(0, 2, n), rng.integers(1, 20000, n), rows=rng.integers(1, 32, n))
        t = cm.launch_time(r, CFG, SM90, **COMMON)
        assert t.floor > 0 and t.seconds >= t.floor + t.overhead
        assert t.seconds >= cm.roofline_floor(bytes_moved=t.bytes, flops=t.flops, target=SM90) + t.overhead
        assert t.seconds >= t.critical_program
        # More KV in every range: never faster.
        longer = cm.launch_time(cm.Ranges(r.kind, r.kv_len * 2, r.rows, r.units, r.states), CFG, SM90, **COMMON)
        assert longer.seconds >= t.seconds and longer.bytes > t.bytes


def test_tiles_in_flight_and_the_merge_scheme_only_help():
    r = _decode_step()
    after = cm.launch_time(r, CFG, SM90, **COMMON)
    one_tile = cm.launch_time(r, CFG, SM90, structure=cm.KernelStructure(pipelined=False), **COMMON)
    serial = cm.launch_time(r, CFG, SM90, structure=cm.KernelStructure(merge="serial"), **COMMON)
    assert one_tile.seconds >= after.seconds and one_tile.critical_round_trips > after.critical_round_trips
    assert serial.seconds >= after.seconds
    # The serial scheme reports to and merges each of a shared tile's 32 units in turn; the vector one does each
    # once (64 tiles of 4096 keys, 2 in flight with 64-key tiles: 32 loop round trips).
    assert after.critical_round_trips == pytest.approx(32 + 1 + 1)
    assert serial.critical_round_trips == pytest.approx(32 + 32 + 32)


def test_critical_path_dominates_when_split_badly():
    # One 65,536-token range among 200 short ones: enough items (x 8 KV heads > 132 SMs) that the program-count
    # rule splits nothing.
    r = _ranges([K.KIND_SUFFIX] * 201, [65536] + [256] * 200)
    split = dict(block_n_shared=64, block_n_suffix=32, num_kv_heads=8, num_sms=SM90.num_sms, min_split_tokens=256)
    bad = cm.launch_time(cm.resplit(r, "program_count", **split), CFG, SM90, **COMMON)
    good = cm.launch_time(cm.resplit(r, "critical_path", **split), CFG, SM90, **COMMON)
    # Badly split, the launch is its longest program (plus the launch overhead) and far above its floor.
    assert bad.seconds == pytest.approx(bad.critical_program + bad.overhead)
    assert bad.seconds > 3 * bad.floor
    assert good.seconds < bad.seconds / 3 and good.critical_program < bad.critical_program / 5


def test_resplit_keeps_tokens_and_adds_states():
    r = _decode_step(requests=8, prefix=8192, own=100)
    split = dict(block_n_shared=64, block_n_suffix=32, num_kv_heads=8, num_sms=SM90.num_sms, min_split_tokens=256)
    pieces, _, _ = cm.split_counts(r, "critical_path", **split)
    s = cm.resplit(r, "critical_path", **split)
    assert s.kv_len.sum() == r.kv_len.sum() and s.kind.size == pieces.sum() > r.kind.size
    assert (s.states == np.repeat(r.states + pieces - 1, pieces)).all()
    with pytest.raises(ValueError, match="split: expected one of"):
        cm.KernelStructure(split="programs")


def test_cascade_pays_three_launches_and_never_beats_its_own_floor():
    r = _decode_step()
    launches = cm.cascade_time(r, CFG, SM90, min_split_tokens=256, **COMMON)
    assert len(launches) == 3 and all(t.seconds >= t.floor + t.overhead for t in launches)
    # Without shared nodes and without splitting: one launch, no merge.
    plain = cm.cascade_time(_ranges([K.KIND_SUFFIX] * 4000, [512] * 4000), CFG, SM90, min_split_tokens=256,
                            **COMMON)
    assert len(plain) == 1


def test_planned_work_round_trips_through_the_model():
    # A full-size plan (host only): re-splitting the unsplit plan (num_sms=1) with the critical-path rule gives the
    # planned pieces, and the fused launch is modeled at or above the batch's distinct-KV floor.
    from bench.shapes import DTYPES, build_batch, fig8_shapes
    from prefixattn import plan
    from prefixattn.autotune.lookup import planning_target
    from prefixattn.planner import MIN_SPLIT_TOKENS

    shape = next(s for s in fig8_shapes(scaled=False, gqa=True) if s.paper == "decode256:8192/128/64")
    batch = build_batch(shape, metadata_only=True)
    kwargs = dict(block_size=shape.block_size, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                  head_dim=shape.head_dim, q_dtype=DTYPES[shape.dtype], num_blocks=batch.num_blocks)
    with planning_target("sm90"):
        planned = plan(batch.qo_indptr, batch.kv_lens, batch.block_table, num_sms=SM90.num_sms, **kwargs)
        whole = cm.ranges_from_plan(plan(batch.qo_indptr, batch.kv_lens, batch.block_table, num_sms=1, **kwargs))
    cfg = cm.config_from_tiles(planned.tiles)
    again = cm.resplit(whole, "critical_path", block_n_shared=cfg.shared.block_n, block_n_suffix=cfg.suffix.block_n,
                       num_kv_heads=shape.num_kv_heads, num_sms=SM90.num_sms, min_split_tokens=MIN_SPLIT_TOKENS)
    r = cm.ranges_from_plan(planned)
    assert sorted(again.kv_len.tolist()) == sorted(r.kv_len.tolist())
    assert (r.units[r.kind == K.KIND_SHARED] == planned.tiles.rows_per_shared_tile(8)).all(), "one unit per decode"
    t = cm.launch_time(r, cfg, SM90, head_dim=shape.head_dim, dtype="fp16", num_kv_heads=shape.num_kv_heads,
                       group=shape.num_qo_heads // shape.num_kv_heads)
    assert t.seconds >= cm.roofline_floor(bytes_moved=batch.unique_kv_bytes(), flops=0.0, target=SM90)
