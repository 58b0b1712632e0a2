"""bench/render/gpu.py (bench/gpu_report.py): the README's fair tables and "where prefixattn loses" come from the GPU
check's CSV rows."""

import csv
import subprocess
import sys
from pathlib import Path

from render import gpu


def _row(benchmark, provider, shape, metric, value):
    return dict(benchmark=benchmark, provider=provider, shape=shape, device="NVIDIA H100 80GB HBM3", metric=metric,
                value=str(value), unit="us", commit="abc1234", versions="v")


def _rows():
    t, m = "attention_gpu_time", "model_step"
    rows = []
    for shape, ours, best, name in (("decode256:2048/256/16 [x]", 100.0, 150.0, "flashinfer-decode-tc-fa3"),
                                    ("mixed256:8192/128/64 [y]", 900.0, 600.0, "flashinfer-split")):
        rows += [_row(t, "floor", shape, "floor_overlapped_us", 50.0), _row(t, "floor", shape, "floor_serial_us", 70.0),
                 _row(t, "prefixattn", shape, "graph_flushed_us_median", ours),
                 _row(t, "flashinfer-best", shape, "graph_flushed_us_median", best),
                 _row(t, name, shape, "is_flashinfer_best", 1.0), _row(t, "gpu-state", shape, "sm_clock_mhz", 1980)]
    step = "decode step 132: 263 requests, 263 tokens"
    rows += [_row(m, "prefixattn", step, "step_us_median", 12000.0), _row(m, "prefixattn", step, "graph", 1.0),
             _row(m, "flashinfer-best", step, "step_us_median", 15000.0),
             _row(m, "flashinfer-decode", step, "is_flashinfer_best", 1.0),
             _row(m, "prefixattn", step, "attention_share", 0.4)]
    return rows


def test_fair_table_and_losses():
    rows = _rows()
    kernels = {r["shape"]: r for r in gpu.kernel_rows(rows)}
    assert kernels["decode256:2048/256/16"]["best_name"] == "flashinfer-decode-tc-fa3"
    table = "\n".join(gpu.kernel_table(rows))
    assert "| decode256:2048/256/16 | 100.0 | 150.0 (flashinfer-decode-tc-fa3) | 1.50x | 2.00x / 1.43x |" in table
    losses = gpu.losses(rows)
    assert losses == ["- mixed256:8192/128/64: prefixattn 900.0 us vs FlashInfer flashinfer-split 600.0 us (1.50x "
                      "slower)"]
    model = "\n".join(gpu.model_table(rows))
    assert "(graph) | 12.00 |" in model and "15.00 (flashinfer-decode)" in model and "| 1.25x |" in model


def test_readme_section_from_a_csv(tmp_path, capsys):
    path = tmp_path / "r.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(_rows()[0]))
        w.writeheader()
        w.writerows(_rows())
    assert gpu.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Performance (measured on NVIDIA H100 80GB HBM3, commit abc1234)")
    assert "Where prefixattn loses:" in out and "mixed256:8192/128/64" in out


def test_floors_l2_flags_classes_not_run_and_bytes_tables():
    t, shape = "attention_gpu_time", "decode256:8192/128/64 [x]"
    rows = _rows() + [
        _row(t, "floor", shape, "floor_memory_us", 40.0), _row(t, "floor", shape, "floor_compute_us", 20.0),
        _row(t, "floor", shape, "best_unique_gbps", 4500.0), _row(t, "flashinfer-decode", shape,
                                                                  "is_best_unique_rate", 1.0),
        _row(t, "flashinfer-decode", shape, "under_hbm_floor", 1.0),
        _row(t, "prefixattn", shape, "under_hbm_floor", 0.0),
        _row(t, "prefixattn", shape, "graph_flushed_us_median", 80.0),
        _row(t, "prefixattn", shape, "class_shared_us_median", 30.0),
        _row(t, "prefixattn", shape, "class_decode_us_median", 55.0),
        _row(t, "prefixattn", shape, "modeled_class_decode_us", 61.5),
        _row(t, "prefixattn", shape, "classes_sum_us", 85.0),
        dict(_row(t, "flashinfer-pod", shape, "not_run", 1.0), unit="reason: needs both decode and prefill requests"),
        dict(_row(t, "flashinfer-pod", "y", "not_run", 1.0), unit="reason: needs both decode and prefill requests"),
        _row("hbm_bytes", "floor", shape, "unique_bytes", 1e9), _row("hbm_bytes", "prefixattn", shape,
                                                                    "tile_kv_load_bytes", 2e9),
        _row("hbm_bytes", "prefixattn", shape, "dram_read_bytes", 1.1e9),
        _row("hbm_bytes", "prefixattn", shape, "kernels", 2)]
    floor = "\n".join(gpu.floor_table(rows))
    # The cost model's class time in parentheses where the run has it.
    assert ("| decode256:8192/128/64 | 40.0 / 20.0 | 4,500 (flashinfer-decode) | flashinfer-decode | shared 30.0, "
            "decode 55.0 (61.5) | 1.06x |") in floor
    assert gpu.not_run(rows) == ["- `flashinfer-pod` on 2 shapes: needs both decode and prefill requests"]
    assert "| decode256:8192/128/64 | prefixattn | 1,100.0 | 1.10x | 0.0 | 2 | 2.00x |" in "\n".join(
        gpu.bytes_table(rows))
    summary = gpu.summary(rows, device="NVIDIA H200", commit="abc1234", versions="v", seconds=1.0, skips=[])
    assert summary.index("## Where prefixattn loses") < summary.index("## Attention kernels")


def test_a_second_calls_tagged_csv_joins_its_run(tmp_path):
    from render import performance

    for name, metric in (("nvidia-h200-abc1234", "step_us_median"), ("nvidia-h200-abc1234-extra", "wall_s")):
        with (tmp_path / f"{name}.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(_rows()[0]))
            w.writeheader()
            w.writerow(_row("whole_batch" if metric == "wall_s" else "model_step", "prefixattn", "s", metric, 1.0))
    runs = performance.load_runs(tmp_path)
    assert list(runs) == ["nvidia-h200-abc1234"]
    assert [r["metric"] for r in runs["nvidia-h200-abc1234"]] == ["step_us_median", "wall_s"]


def test_the_documented_commands_are_the_renderers(tmp_path):
    """bench/gpu_report.py and bench/report.py, the commands the docs and the generated pages name, run the renderers
    of bench/render/ from any working directory."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    path = tmp_path / "latest.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(_rows()[0]))
        w.writeheader()
        w.writerows(_rows())
    readme = subprocess.run([sys.executable, str(bench / "gpu_report.py"), str(path)], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout
    assert readme == gpu.readme_section(_rows(), source=str(path))
    subprocess.run([sys.executable, str(bench / "report.py"), str(path)], cwd=tmp_path, capture_output=True,
                   check=True)
    assert (tmp_path / "summary.md").read_text().startswith("# prefixattn bench")


def test_model_step_classes_show_the_modeled_times_beside_the_measured():
    m, step = "model_step", "batchllm-case1 decode step 132: 263 requests, 263 tokens"
    rows = [_row(m, "prefixattn", step, "layer_us", 290.9), _row(m, "prefixattn", step, "modeled_step_us", 277.6),
            _row(m, "prefixattn", step, "class_shared_layer_us", 80.0),
            _row(m, "prefixattn", step, "class_decode_layer_us", 205.0),
            _row(m, "prefixattn", step, "modeled_class_decode_us", 201.0)]
    assert gpu.model_class_lines(rows) == [f"- {step}: one layer 290.9 us (277.6); alone: shared 80.0 us, decode "
                                           "205.0 us (201.0)"]


def test_kv_heads_table_lists_the_decode_steps_that_packed_heads():
    t, shape = "attention_gpu_time", "decode256:0/256/1 [d]"
    rows = _rows() + [_row(t, "prefixattn", shape, "graph_flushed_us_median", 290.0),
                      _row(t, "prefixattn-kv-heads", shape, "graph_flushed_us_median", 250.0),
                      _row(t, "prefixattn-kv-heads", shape, "kv_heads", 16)]
    assert gpu.kv_heads_table(rows)[2:] == ["| decode256:0/256/1 | 290.0 | 250.0 | 16 | 1.16x |"]
    assert gpu.kv_heads_table(_rows()) == []  # nowhere packed: no table


def test_pdl_table_lists_the_steps_whose_launches_were_chained():
    t, shape = "attention_gpu_time", "mixed256:256/2048/all [m]"
    rows = _rows() + [_row(t, "prefixattn", shape, "graph_flushed_us_median", 3467.0),
                      _row(t, "prefixattn-pdl", shape, "graph_flushed_us_median", 3300.0),
                      _row(t, "prefixattn-pdl", shape, "modeled_pdl_us", 3100.0)]
    assert gpu.pdl_table(rows)[2:] == ["| mixed256:256/2048/all | 3,467.0 | 3,300.0 (3,100.0) | 1.05x |"]
    assert gpu.pdl_table(_rows()) == []  # chained nowhere: no table


def test_hopper_table_puts_the_hopper_build_beside_the_portable_one():
    t, shape = "attention_gpu_time", "decode256:2048/256/all [s]"
    rows = _rows() + [_row(t, "prefixattn", shape, "graph_flushed_us_median", 300.0),
                      _row(t, "prefixattn", shape, "class_shared_us_median", 120.0),
                      _row(t, "prefixattn-hopper", shape, "graph_flushed_us_median", 250.0),
                      _row(t, "prefixattn-hopper", shape, "class_shared_us_median", 80.0),
                      _row(t, "prefixattn", shape, "class_chunk_us_median", 60.0),
                      _row(t, "prefixattn-hopper", shape, "class_chunk_us_median", 40.0)]
    assert gpu.hopper_table(rows)[2:] == [
        "| decode256:2048/256/all | 300.0 | 250.0 | 1.20x | 120.0 | 80.0 | 1.50x | 60.0 | 40.0 | 1.50x |"]
    assert gpu.hopper_table(_rows()) == []  # it ran nowhere: no table


def test_class_rate_table_puts_the_hopper_build_beside_fa3():
    c, shape = "class_rate", "dense causal 16384 tokens, pages in order"
    rows = [_row(c, "prefixattn", shape, "attention_tflops", 342.0),
            _row(c, "prefixattn-hopper", shape, "attention_tflops", 519.3),
            _row(c, "flashinfer-prefill-fa3", shape, "attention_tflops", 577.0),
            _row(c, "flashinfer-prefill-fa2", shape, "attention_tflops", 380.0)]
    assert gpu.class_rate_table(rows)[2:] == [
        f"| {shape} | 342.0 | 519.3 | 577.0 | 380.0 | 0.59x | 0.90x | 0.90x |"]
    without = [r for r in rows if r["provider"] != "prefixattn-hopper"]  # not run: its cell is a dash
    assert gpu.class_rate_table(without)[2:] == [f"| {shape} | 342.0 | - | 577.0 | 380.0 | 0.59x | - | 0.90x |"]


def test_mla_table_puts_the_kept_prefix_beside_typhoon():
    m, shape = "mla", "mla-h128-b1024-s8192-o128"
    rows = [_row(m, p, shape, "graph_flushed_us_median", us) for p, us in (
        ("prefixattn", 900.0), ("prefixattn-nosharing", 1800.0), ("flashinfer-mla", 2000.0), ("typhoon-mla", 1000.0),
        ("prefixattn-naive", 1250.0), ("prefixattn-naive-kept", 800.0))] + [_row(m, "floor", shape, "floor_memory_us",
                                                                                   450.0)]
    assert gpu.mla_table(rows)[2:] == [
        f"| {shape} | 900.0 | 1,800.0 | 2,000.0 | 1,000.0 | 1,250.0 | 800.0 | 2.22x | 1.11x | 0.80x | 1.25x | 2.00x "
        "| 2.00x | - | yes |"]
