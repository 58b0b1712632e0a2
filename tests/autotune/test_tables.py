"""The tile-table format (prefixattn.autotune.tables): rows by work class, written and read back, and what it refuses."""

import json
from pathlib import Path

import pytest

from prefixattn.autotune import lookup
from prefixattn.autotune.buckets import make_bucket
from prefixattn.autotune.config_space import AttentionConfig, LaunchOptions, Tiles
from prefixattn.autotune.tables import (TABLE_FORMAT, read_table, table_json, table_rows, tile_name,
                                        write_table)
from prefixattn.autotune.targets import TARGETS

W8S3 = LaunchOptions(num_warps=8, num_stages=3)
W4S3 = LaunchOptions(num_warps=4, num_stages=3)
DECODE = make_bucket(head_dim=128, dtype="bf16", group=4, q_rows=16, max_q_len=1, kv_len=1024)
CHUNK = make_bucket(head_dim=128, dtype="bf16", group=4, q_rows=16, max_q_len=512, kv_len=1024)
ROWS = {DECODE: AttentionConfig(Tiles(128, 64), Tiles(16, 32), W8S3, W4S3),
        CHUNK: AttentionConfig(Tiles(128, 32), Tiles(128, 64), W8S3)}


def test_rows_are_written_under_the_work_classes_and_read_back(tmp_path):
    table = table_json(ROWS, target="sm90", source="by hand")
    assert table["format"] == TABLE_FORMAT and table["source"] == "by hand"
    assert table["shared"] == {DECODE.key(): "128x64_w8_s3", CHUNK.key(): "128x32_w8_s3"}
    assert table["decode"] == {DECODE.key(): "16x32_w4_s3"} and table["chunk"] == {CHUNK.key(): "128x64_w8_s3"}
    assert table["tiles"]["16x32_w4_s3"] == {"block_m": 16, "block_n": 32, "launch": W4S3.to_dict()}
    assert set(table["tiles"]) == {"128x64_w8_s3", "128x32_w8_s3", "16x32_w4_s3"}
    assert read_table(write_table(table, tmp_path / "sm90.json"), "sm90") == ROWS


def test_a_suffix_launch_equal_to_the_shared_one_reads_back_as_none():
    explicit = {CHUNK: AttentionConfig(Tiles(128, 32), Tiles(128, 64), W8S3, W8S3)}
    row = table_rows(table_json(explicit, target="sm90"), "sm90")[CHUNK]
    assert row.suffix_launch is None and row.launch_for(False) == W8S3 and row.short() == explicit[CHUNK].short()


def test_hip_knobs_are_part_of_a_tile_name():
    hip = LaunchOptions(num_warps=4, num_stages=2, waves_per_eu=2, matrix_instr_nonkdim=16)
    assert tile_name(Tiles(64, 32), hip) == "64x32_w4_s2_wpe2_nk16_kp1"
    rows = {DECODE: AttentionConfig(Tiles(64, 32), Tiles(16, 32), hip)}
    assert table_rows(table_json(rows, target="gfx942"), "gfx942") == rows


def test_read_table_names_the_file_of_an_old_format_table(tmp_path):
    old = tmp_path / "sm90.json"
    old.write_text(json.dumps({"format": 1, "target": "sm90", "configs": {}, "buckets": {}}))
    with pytest.raises(ValueError) as raised:
        read_table(old, "sm90")
    assert str(raised.value).startswith(f"{old}: expected a format-2 tile table") and "got format 1" in str(raised.value)


def _table(**change):
    table = table_json(ROWS, target="sm90")
    for key, value in change.items():
        if value is None:
            del table[key]
        else:
            table[key] = value
    return table


@pytest.mark.parametrize("table, fragment", [
    (_table(target="sm80"), "target 'sm90', got one for 'sm80'"),
    (_table(chunk=None), "got no chunk"),
    (_table(configs={}), "unknown configs"),
    (_table(decode={DECODE.key(): "16x64_w4_s3"}), "expected the name of a tile in tiles, got '16x64_w4_s3'"),
    (_table(decode={}), "in one only"),
    (_table(decode={CHUNK.key(): "16x32_w4_s3"}), "decode: expected buckets of one query token"),
    (_table(shared={"d128-bf16-g4": "128x64_w8_s3"}), "bucket key: expected the form"),
    (_table(shared={"d0128-bf16-g4-q16-l1-kv1024": "128x64_w8_s3", CHUNK.key(): "128x32_w8_s3"}),
     "expected bucket keys as Bucket.key"),
    (_table(tiles={**_table()["tiles"], "32x32_w4_s3": {"block_m": 32, "block_n": 32, "launch": W4S3.to_dict()}}),
     "unnamed 32x32_w4_s3"),
    (_table(tiles={**_table()["tiles"], "16x32_w4_s3": {"block_m": 16, "block_n": 64, "launch": W4S3.to_dict()}}),
     "expected the name to say what the tile holds, '16x64_w4_s3'"),
    (_table(tiles={**_table()["tiles"], "16x32_w4_s3": {"block_m": 16, "block_n": 32}}), "tiles.16x32_w4_s3: expected"),
    (_table(tiles={**_table()["tiles"], "16x32_w4_s3": {"block_m": 16, "block_n": 32,
                                                         "launch": {**W4S3.to_dict(), "maxnreg": 128}}}),
     "maxnreg: expected none"),
    (_table(tiles={**_table()["tiles"], "16x32_w4_s3": {"block_m": 12, "block_n": 32, "launch": W4S3.to_dict()}}),
     "tiles.16x32_w4_s3.block_m: expected a power of two"),
    ([], "a JSON object"),
])
def test_a_malformed_table_raises_naming_what_is_wrong(tmp_path, table, fragment):
    path = tmp_path / "sm90.json"
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError) as raised:
        read_table(path, "sm90")
    assert str(raised.value).startswith(f"{path}: ") and fragment in str(raised.value), str(raised.value)


def test_unreadable_json_raises_naming_the_file(tmp_path):
    path = tmp_path / "sm90.json"
    path.write_text("{not json")
    with pytest.raises(ValueError) as raised:
        read_table(path, "sm90")
    assert str(raised.value).startswith(f"{path}: expected a format-2 tile table as JSON")


def test_every_shipped_table_reads_as_format_2():
    configs = Path(lookup.__file__).parent / "configs"
    tables = [p for p in sorted(configs.glob("*.json")) if not p.name.endswith(".program_cost.json")]
    assert {p.name for p in tables} >= {f"{t}.json" for t in TARGETS} | {"sm90.measured.json"}
    for path in tables:
        raw = json.loads(path.read_text())
        rows = read_table(path, raw["target"])
        assert rows and raw["format"] == TABLE_FORMAT, path.name
