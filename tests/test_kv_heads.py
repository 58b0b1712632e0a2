"""Several KV heads per decode program (a table's ``kv_heads``): the plan's fitted tiles, the launch grid, and the
kernel against the reference with shared prefixes, split-k merges, multi-row decode tiles and the model switches
(interpreter on CPU: small grids)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from prefixattn import attention, plan, prefix_attention
from prefixattn.autotune.buckets import make_bucket
from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles
from prefixattn.autotune.lookup import fixed_config
from prefixattn.autotune.tables import read_table, table_json
from prefixattn.kernels import layout as K
from prefixattn.planner.tiles import fit_kv_heads, tiles_from_configs
from tests.prefix_batches import (MODEL_SWITCH_IDS, MODEL_SWITCHES, check_against_reference, make_batch,
                                  model_switch_call, on_device, random_batch)
from tests.test_attention import CountingKernel


def _config(kv_heads: int, block_m: int = 16, block_n: int = 32) -> AttentionConfig:
    """Small tiles whose decode tile packs ``kv_heads`` KV heads per program."""
    return AttentionConfig(shared=Tiles(16, 16), suffix=Tiles(block_m, block_n, kv_heads=kv_heads),
                           launch=LaunchOptions(num_warps=4, num_stages=2))


@pytest.mark.parametrize("num_qo_heads, num_kv_heads, kv_heads, dtype, seed", [
    (4, 4, 4, torch.float32, 0),  # MHA: all of a token's heads in one program
    (8, 4, 2, torch.float16, 1),  # GQA 2: two KV heads x two query heads per row
    (8, 8, 8, torch.bfloat16, 2),  # MHA, 8 heads, 4 positions of each per step
    (6, 6, 4, torch.float32, 3),  # 4 does not divide 6: the plan takes 2
])
def test_decode_programs_with_several_kv_heads(device, num_qo_heads, num_kv_heads, kv_heads, dtype, seed):
    # Shared prefixes, decode and multi-row requests, split-k pieces (4 SMs): every merge path of the decode class.
    b = on_device(random_batch(seed, num_requests=9, levels=2, block_size=4, num_qo_heads=num_qo_heads,
                               num_kv_heads=num_kv_heads, head_dim=64, dtype=dtype, max_q_len=6, decode_fraction=0.6),
                  device)
    with fixed_config(_config(kv_heads)):
        p = plan(*b.metadata, **b.heads, q_dtype=dtype, sharing="always", num_sms=4, min_split_tokens=4)
    fitted = kv_heads if num_kv_heads % kv_heads == 0 else 2
    assert p.tiles.decode.kv_heads == fitted
    assert K.CLASS_DECODE in p.work_classes and p.shared_nodes and p.work.num_ws_rows > 0
    check_against_reference(b, p)


@pytest.mark.parametrize("plan_kw, attn_kw", MODEL_SWITCHES, ids=MODEL_SWITCH_IDS)
def test_model_switches_with_several_kv_heads(device, plan_kw, attn_kw):
    b = on_device(make_batch(4, q_lens=[1, 1, 2, 1], extra_lens=[9, 2, 13, 30], paths=[("a",), ("a",), ("a",), ()],
                             level_blocks={"a": 3}, block_size=4, num_qo_heads=8, num_kv_heads=4, head_dim=64), device)
    attn_kw = model_switch_call(b, attn_kw, device)
    with fixed_config(_config(4)):
        p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, kv_dtype=b.k_cache.dtype, sharing="always",
                 num_sms=4, min_split_tokens=4, **plan_kw)
    # 2 query heads x 4 KV heads a row: two rows a tile, so the 2-row request is a decode tile too.
    assert p.tiles.decode.kv_heads == 4 and p.tiles.decode.rows(2) == 2
    check_against_reference(b, p, **attn_kw)


def test_grid_has_one_program_per_item_and_head_block(device, monkeypatch):
    b = on_device(make_batch(5, q_lens=[1, 1, 1], extra_lens=[20, 7, 33], paths=[(), (), ()], level_blocks={},
                             block_size=4, num_qo_heads=8, num_kv_heads=8, head_dim=64), device)
    counter = CountingKernel(prefix_attention.prefix_attention_kernel)
    monkeypatch.setattr(prefix_attention, "prefix_attention_kernel", counter)
    for kv_heads in (1, 4):
        with fixed_config(_config(kv_heads)):
            p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, sharing="never", num_sms=132)
        assert p.work_classes == (K.CLASS_DECODE,) and p.num_items == 3
        attention(b.q, b.k_cache, b.v_cache, p)
        assert counter.grids[-1] == (3 * 8 // kv_heads,)
        assert counter.kwargs[-1]["KV_HEADS"] == kv_heads and counter.kwargs[-1]["BLOCK_N"] == 32 // kv_heads


def test_fit_kv_heads():
    tiles = tiles_from_configs(decode=_config(8), chunk=_config(1, 64, 32), head_dim=64)
    assert tiles.decode.kv_heads == 8 and tiles.chunk.kv_heads == 1
    fit = dict(num_kv_heads=8, group=1, nan_guard=False)
    assert fit_kv_heads(tiles, **fit) is tiles  # nothing to change: the same object (the memos key on it)
    assert fit_kv_heads(tiles, **{**fit, "num_kv_heads": 12}).decode.kv_heads == 4  # largest divisor <= 8
    assert fit_kv_heads(tiles, **{**fit, "group": 4}).decode.kv_heads == 4  # 4 x 4 lanes: one row a tile
    assert fit_kv_heads(tiles, **{**fit, "nan_guard": True}).decode.kv_heads == 1  # the redos read one head
    assert fit_kv_heads(tiles, **{**fit, "num_kv_heads": 3}).decode.kv_heads == 1
    wide = tiles_from_configs(decode=_config(8), chunk=_config(1, 64, 32), head_dim=256)
    assert fit_kv_heads(wide, **fit).decode.kv_heads == 1  # KV_HEADS_MAX_BLOCK_D: spills above it
    fitted = fit_kv_heads(tiles, **{**fit, "group": 4})
    assert fitted.decode.rows(4) == 1 and fitted.decode.positions_per_step == 8
    assert fit_kv_heads(tiles, **{**fit, "group": 4}) is fitted  # memoized


def test_nan_guard_plans_one_kv_head_per_program(device):
    b = on_device(make_batch(6, q_lens=[1, 1], extra_lens=[9, 30], paths=[(), ()], level_blocks={}, block_size=4,
                             num_qo_heads=4, num_kv_heads=4, head_dim=64), device)
    with fixed_config(_config(4)):
        p = plan(*b.metadata, **b.heads, q_dtype=b.q.dtype, nan_guard=True)
    assert p.tiles.decode.kv_heads == 1
    check_against_reference(b, p)


def test_table_and_config_round_trip_kv_heads(tmp_path):
    cfg = _config(4)
    assert cfg.short() == "sh16x16_sf16x32h4_w4_s2"
    assert AttentionConfig.from_dict(cfg.to_dict()) == cfg
    assert "kv_heads" not in _config(1).to_dict()["suffix"]  # tables without it read as before
    bucket = make_bucket(head_dim=64, dtype="fp16", group=1, max_q_len=1, kv_len=1024)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table_json({bucket: cfg}, target="sm90")))
    assert read_table(path, "sm90")[bucket].suffix == Tiles(16, 32, kv_heads=4)
    with pytest.raises(ValueError, match="kv_heads: expected a power of two <= block_n"):
        AttentionConfig.from_dict({**cfg.to_dict(), "suffix": {"block_m": 16, "block_n": 32, "kv_heads": 3}})
    with pytest.raises(ValueError, match="config.shared.kv_heads: expected 1"):
        AttentionConfig.from_dict({**cfg.to_dict(), "shared": {"block_m": 16, "block_n": 16, "kv_heads": 2}})


@pytest.mark.parametrize("seed", range(6))
def test_numpy_and_compiled_planners_agree(seed):
    # The split stage prices the decode class at num_kv_heads // kv_heads programs a tile in both back-ends.
    pytest.importorskip("numba", reason="the compiled planner is optional (pip install prefixattn[fast])")
    from prefixattn.autotune.lookup import planning_target
    from tests.test_plan_compiled import _plan_with, assert_same_plans, random_metadata

    rng = np.random.default_rng(seed)
    args, _ = random_metadata(rng, num_requests=int(rng.integers(1, 30)), block_size=16,
                              max_q_len=int(rng.choice([1, 5])), levels=int(rng.integers(0, 3)), table_dtype=np.int32)
    heads = (dict(num_qo_heads=8, num_kv_heads=8), dict(num_qo_heads=8, num_kv_heads=4))[seed % 2]
    opts = dict(block_size=16, head_dim=64, sharing=("auto", "always")[seed // 2 % 2], num_sms=int(rng.integers(1, 9)),
                min_split_tokens=8, **heads)
    with planning_target("sm90"), fixed_config(_config(4)):
        ref, got = _plan_with("numpy", *args, **opts), _plan_with("numba", *args, **opts)
    assert ref.tiles.decode.kv_heads == 4
    assert_same_plans(ref, got, f"seed {seed}")


def test_a_table_packs_kv_heads_in_decode_tiles_only(tmp_path):
    decode, chunk = (make_bucket(head_dim=64, dtype="fp16", max_q_len=q, kv_len=1024) for q in (1, 512))
    table = table_json({decode: _config(4), chunk: _config(4, 64, 32)}, target="sm90")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match="shared, chunk: expected tiles of one KV head per program.*64x32h4"):
        read_table(path, "sm90")
    path.write_text(json.dumps(table_json({decode: _config(4), chunk: _config(1, 64, 32)}, target="sm90")))
    assert read_table(path, "sm90")[decode].suffix.kv_heads == 4
