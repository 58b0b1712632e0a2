"""The calibrated program costs (prefixattn.autotune.program_cost): the shipped sm90 fit, and how a binary or a
target the sweeps did not measure is priced from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixattn.planner.tiles import ClassTiles
from prefixattn.autotune import program_cost as pc
from prefixattn.autotune.config_space import LaunchOptions
from prefixattn.autotune.targets import get_target

SM90 = get_target("sm90")
W8S3 = LaunchOptions(num_warps=8, num_stages=3)


def test_the_sm90_fit_is_shipped_with_its_errors():
    data = pc.calibration("sm90")
    assert data["target"] == "sm90" and data["binaries"] and all(Path(ROOT / s.split(" (")[0]).exists()
                                                                  for s in data["sources"])
    for name, b in data["binaries"].items():
        kind = name.split()[0]
        assert kind in pc.KINDS and b["tile_us"] > 0 and b["slots_per_sm"] >= 1 and b["rows"] > 0
        assert 0 <= b["rms_error"] <= b["max_error"], name
    assert pc.calibration("gfx90a") == {}  # no measurements there


def test_a_measured_binary_takes_its_fit():
    b = pc.calibration("sm90")["binaries"]["shared 128x64 w8 s3"]
    c = pc.program_cost("shared", 128, 64, W8S3, head_dim=128, dtype="fp16", kv_bytes=2, target=SM90)
    assert c == pc.ProgramCost(fixed_us=b["fixed_us"], tile_us=b["tile_us"], block_n=64,
                               slots_per_sm=b["slots_per_sm"], source="calibrated")
    assert c.fixed_tokens == pytest.approx(b["fixed_us"] / b["tile_us"] * 64)
    # bf16 moves the same bytes; an fp8 cache half of them per tile, head_dim 64 half of them too.
    assert pc.program_cost("shared", 128, 64, W8S3, head_dim=128, dtype="bf16", kv_bytes=2, target=SM90) == c
    fp8 = pc.program_cost("shared", 128, 64, W8S3, head_dim=128, dtype="bf16", kv_bytes=1, target=SM90)
    d64 = pc.program_cost("shared", 128, 64, W8S3, head_dim=64, dtype="fp16", kv_bytes=2, target=SM90)
    assert fp8.tile_us == d64.tile_us == pytest.approx(c.tile_us / 2) and fp8.source == d64.source == "scaled"


def test_an_unmeasured_binary_is_scaled_from_the_nearest_one():
    # 128x128 at 8 warps: no sweep ran it; priced from a measured 128-row shared binary, per KV position of its
    # tile at its own (estimated) occupancy.
    c = pc.program_cost("shared", 128, 128, W8S3, head_dim=128, dtype="fp16", kv_bytes=2, target=SM90)
    ref = pc.calibration("sm90")["binaries"]["shared 128x64 w8 s3"]
    assert c.source == "scaled" and c.block_n == 128
    assert c.tile_us == pytest.approx(ref["tile_us"] * 2 * c.slots_per_sm / ref["slots_per_sm"])


def test_another_gpu_is_priced_by_its_bandwidth_per_sm():
    mi300 = get_target("gfx942")
    c = pc.program_cost("shared", 128, 64, W8S3, head_dim=128, dtype="fp16", kv_bytes=2, target=mi300)
    h = pc.program_cost("shared", 128, 64, W8S3, head_dim=128, dtype="fp16", kv_bytes=2, target=SM90)
    per_sm = (SM90.mem_bw_gbs / SM90.num_sms) / (mi300.mem_bw_gbs / mi300.num_sms)
    assert c.source == "analytic" and c.tile_us == pytest.approx(h.tile_us * per_sm * c.slots_per_sm
                                                                 / h.slots_per_sm, rel=0.5)


def test_class_costs_follow_the_class_tiles():
    from prefixattn.planner.tiles import AttentionTiles

    tiles = AttentionTiles(shared=ClassTiles(128, 64, W8S3), chunk=ClassTiles(128, 64, W8S3),
                           decode=ClassTiles(16, 32, LaunchOptions(num_warps=4, num_stages=3)), block_d=128)
    shared, chunk, decode = pc.class_costs(tiles, head_dim=128, dtype="fp16", kv_bytes=2)
    binaries = pc.calibration("sm90")["binaries"]
    assert shared.tile_us == binaries["shared 128x64 w8 s3"]["tile_us"]
    assert chunk.tile_us == binaries["suffix 128x64 w8 s3"]["tile_us"]
    assert decode.slots_per_sm == binaries["suffix 16x32 w4 s3"]["slots_per_sm"] > shared.slots_per_sm


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_shipped_fit_is_what_the_fit_script_gives():
    """Re-runs bench/fit_program_cost.py (each sweep's commit in a temporary worktree; ~10 minutes on 2 cores)."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_program_cost.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads((ROOT / "prefixattn/autotune/configs/sm90.program_cost.json").read_text())["binaries"]
