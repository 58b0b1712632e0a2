"""bench/render/suite.py (bench/report.py): the targets are judged per shape from the CSV rows, and the summary
states each one."""

import csv

import pytest

from render import suite

SHARED_MET = "decode32:2048/256/16 [decode/4d/64-16-2/h2:2/d64]"
SHARED_MISSED = "mixed256:256/2048/all [mixed/7p+16d/16-64-all/h2:2/d64]"
SHARED_TIE = "decode256:8192/128/64 [decode/16d/256-16-4/h2:2/d64]"
PLAIN = "decode32:0/2048/1 [decode/4d/0-64-1/h2:2/d64]"
UNIQUE = 1000


def _rows(kv_by_shape, launches=1):
    rows = []
    for shape, by_provider in kv_by_shape.items():
        for provider, kv in by_provider.items():
            for metric, value in (("kv_bytes", kv), ("unique_kv_bytes", UNIQUE), ("kv_over_unique", kv / UNIQUE),
                                  ("launches", launches if provider == "prefixattn" else 2)):
                rows.append(dict(benchmark=suite.TRAFFIC, provider=provider, shape=shape, device="cpu-interpreter",
                                 metric=metric, value=str(value), unit="x", commit="abc", versions="v"))
    return rows


ROWS = _rows({
    SHARED_MET: {"prefixattn": 1000, "prefixattn-nosharing": 1670, "cascade-sglang": 1010, "vllm-triton": 1670},
    # 1.24x unique and a peer below: both shared-batch targets missed.
    SHARED_MISSED: {"prefixattn": 1240, "cascade-sglang": 1080, "vllm-triton": 1910},
    # A peer that reaches the bound too ties: "fewer bytes than every peer" counts as met.
    SHARED_TIE: {"prefixattn": 1000, "cascade-sglang": 1000},
    # No sharing: 1.019x the best peer is within 1.02x.
    PLAIN: {"prefixattn": 1019, "sglang-triton": 1000, "vllm-triton": 1000},
})


def test_targets_per_shape():
    by_shape = {t["shape"]: t for t in suite.traffic_targets(ROWS)}
    met = by_shape[SHARED_MET]
    assert (met["within_unique"], met["below_peers"], met["within_best_peer"], met["met"]) == (True, True, None, True)
    missed = by_shape[SHARED_MISSED]
    assert missed["within_unique"] is False and missed["below_peers"] is False and missed["met"] is False
    assert missed["best_peer"] == "cascade-sglang" and missed["over_best_peer"] == pytest.approx(1240 / 1080)
    assert by_shape[SHARED_TIE]["below_peers"] is True
    plain = by_shape[PLAIN]
    assert (plain["shared"], plain["within_unique"], plain["within_best_peer"], plain["met"]) == (False, None, True,
                                                                                                  True)
    assert all(t["one_launch"] for t in by_shape.values())


def test_plain_batch_over_the_best_peer_is_missed():
    rows = _rows({PLAIN: {"prefixattn": 1030, "sglang-triton": 1000}}, launches=2)
    (t,) = suite.traffic_targets(rows)
    assert t["within_best_peer"] is False and t["met"] is False and t["one_launch"] is False


def test_summary_states_each_target_with_its_shapes(tmp_path):
    text = suite.summary(ROWS)
    assert "met on 2/3" in text  # target 1: the missed mixed batch
    assert "1 and 2 together: 2/3" in text
    assert "<= 1.02x the KV bytes of the best peer: met on 1/1" in text
    assert "one launch per call: met on 4/4" in text
    missed_line = next(line for line in text.splitlines() if line.startswith(f"| {SHARED_MISSED} | 1.24x | "))
    assert missed_line.count("**NOT met**") == 2 and "1.08x (cascade-sglang)" in missed_line
    # write(): summary and plots next to the CSV.
    path = tmp_path / "latest.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    md, pngs = suite.write(path)
    assert md.read_text().startswith("# prefixattn bench")
    assert all(p.exists() and p.suffix == ".png" for p in pngs)


def test_full_size_plan_section():
    shape = "decode256:32768/128/256 [decode/256d/32768-128-all/h32:4/d128]"
    rows = [dict(benchmark=suite.PLAN, provider=provider, shape=shape, device="host-cpu", metric=metric,
                 value=str(value), unit="", commit="abc", versions="v")
            for provider, planned in (("prefixattn", 8500), ("prefixattn-nosharing", 128500))
            for metric, value in (("tile_kv_load_bytes", planned), ("unique_kv_bytes", UNIQUE), ("work_items", 272),
                                  ("shared_nodes", 1), ("plan_us_median", 4213.4), ("rows_per_chunk_tile", 16))]
    line = next(line for line in suite.summary(rows).splitlines() if line.startswith(f"| {shape}"))
    assert line == f"| {shape} | 8.50x | 16 | 272 | 1 | 4,213 | 128.50x |"
