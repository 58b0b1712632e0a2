"""`prefixattn tune` plumbing with a fake timing function (no GPU here), and the shipped-table builder."""

import argparse

import pytest

from prefixattn.autotune import lookup
from prefixattn.autotune.buckets import make_bucket
from prefixattn.autotune.tables import TABLE_FORMAT, read_table
from prefixattn.autotune.targets import TARGETS
from prefixattn.autotune.tuning_cache import TuningCache, cache_path
from prefixattn.cli import tune as tune_command
from prefixattn.tuning import launch_limits, table_builder, tuner


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXATTN_TUNING_DIR", str(tmp_path / "tuning"))
    monkeypatch.delenv(lookup.FIXED_ENV, raising=False)
    lookup.clear_caches()
    yield
    lookup.clear_caches()


def test_tune_times_top_k_candidates_and_caches_the_fastest():
    target = TARGETS["sm90"]
    buckets = [make_bucket(head_dim=128, dtype="fp16", group=4, q_rows=256, max_q_len=1, kv_len=2048),
               make_bucket(head_dim=64, dtype="bf16", group=1, q_rows=16, max_q_len=512, kv_len=8192)]
    timed = []
    # The fake clock makes the LAST candidate of each bucket the fastest (the cost model's favourite is not).
    def fake_time(bucket, cfg):
        cands = tuner.candidates(bucket, target, 3)
        timed.append((bucket, cfg))
        if cfg == cands[1]:
            raise RuntimeError("out of resources")  # a config the device cannot run is skipped
        return 10.0 - cands.index(cfg)

    ticks = []
    cache = TuningCache(cache_path("sm90"))
    won = tuner.tune(buckets, target, fake_time, cache, top_k=3, progress=ticks.append)
    # The decode bucket's first candidate also with 2 and 4 KV heads per decode program (group 4 x 4 = 16 lanes).
    decode = tuner.candidates(buckets[0], target, 3)
    assert [c.suffix.kv_heads for c in decode] == [1, 1, 1, 2, 4] and decode[3].shared == decode[0].shared
    assert len(timed) == 8 and len(ticks) == 8
    for b in buckets:
        cands = tuner.candidates(b, target, 3)
        assert won[b][0] == cands[-1] and won[b][1] == 10.0 - (len(cands) - 1)
    reloaded = TuningCache(cache_path("sm90"))
    assert {b: e.config for b, e in reloaded.entries.items()} == {b: w[0] for b, w in won.items()}
    sel = lookup.select_config(head_dim=128, dtype="fp16", group=4, q_rows=256, max_q_len=1, kv_len=2048,
                               target="sm90")
    assert (sel.source, sel.config) == ("user-cache", won[buckets[0]][0])


def test_tune_cli_dry_run_and_no_gpu(capsys):
    parser = argparse.ArgumentParser()
    tune_command.add_arguments(parser)
    assert tune_command.run(parser.parse_args(["--dry-run", "--target", "gfx942", "--groups", "4", "--q-rows", "64",
                                               "--max-q-lens", "1", "--kv-lens", "1024", "--top-k", "2"])) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # The key, the top 2, and the first with 2 and 4 KV heads per decode program.
    assert len(lines) == 2 and all(line.startswith("d128-") and len(line.split()) == 5 for line in lines)
    assert tune_command.run(parser.parse_args([])) == 2  # no GPU under the interpreter
    assert "no GPU" in capsys.readouterr().err
    assert tune_command.run(parser.parse_args(["--dtypes", "fp8"])) == 2


def test_progress_bar_reaches_the_total(capsys):
    import io

    stream = io.StringIO()
    bar = tune_command.ProgressBar(3, stream=stream)
    for _ in range(3):
        bar.update("x")
    assert "3/3" in stream.getvalue() and stream.getvalue().endswith("\n")


def test_best_cover_skips_excluded_configs():
    target = TARGETS["gfx950"]
    first = table_builder.best_cover(target, 128, "fp16", "decode")
    second = table_builder.best_cover(target, 128, "fp16", "decode", frozenset({first.short()}))
    assert first is not None and second is not None and second != first


def test_the_builder_writes_each_class_its_tile(tmp_path):
    target = TARGETS["sm90"]
    table = table_builder.build_table(target, head_dims=(128,), dtypes=("bf16",), exclude={(128, "bf16"): {"x"}})
    assert table["format"] == TABLE_FORMAT and table["excluded_after_compile_check"] == {"d128-bf16": ["x"]}
    rows = read_table(table_builder.write_table(table, tmp_path), "sm90")
    assert len(rows) == len(table["shared"]) == len(table["decode"]) + len(table["chunk"]) > 0
    for mode in table_builder.GRID_MAX_Q_LEN:
        cfg = table_builder.best_cover(target, 128, "bf16", mode, frozenset({"x"}))
        for bucket in table_builder.grid(128, "bf16", mode):
            row = rows[bucket]
            assert (row.shared, row.launch_for(True), row.suffix, row.launch_for(False)) == (
                cfg.shared, cfg.launch_for(True), cfg.suffix, cfg.launch_for(False)), (mode, bucket)
    assert table_builder.exclusions_from_table(tmp_path / "sm90.json") == {(128, "bf16"): {"x"}}


def test_shipped_builder_prefers_wide_shared_tiles_and_light_decode_launches():
    from prefixattn.autotune.config_space import part_registers

    cfg = table_builder.best_cover(TARGETS["sm90"], 128, "bf16", "decode")
    assert cfg.shared.block_n >= 64 and cfg.launch.num_stages >= 3
    sl = cfg.launch_for(False)
    assert sl.num_stages >= 3
    assert part_registers(cfg.suffix, 128, "bf16", sl.num_warps, TARGETS["sm90"]) <= \
        launch_limits.DECODE_SUFFIX_MAX_REGS
    # Decode suffix-only launches at 4 warps, so 4 programs share an SM (<= 128 registers measured: 16x32 tiles, 126
    # on sm_90).
    assert sl.num_warps == launch_limits.DECODE_SUFFIX_WARPS


def test_suffix_launch_ties_break_toward_default_knobs():
    # gfx942 decode: suffix-only launch options the model cannot tell apart (LDS-bound, one program per CU) go to
    # Triton's defaults (4 warps, num_stages 2), not to the first name in sort order (2 warps, num_stages 1).
    cfg = table_builder.best_cover(TARGETS["gfx942"], 128, "bf16", "decode")
    sl = cfg.launch_for(False)
    assert (sl.num_warps, sl.num_stages) == (4, 2)
