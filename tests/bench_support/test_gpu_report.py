"""bench/gpu_report.py: the README's fair tables and "where prefixattn loses" come from the GPU check's CSV rows."""

import csv

import gpu_report


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
    kernels = {r["shape"]: r for r in gpu_report.kernel_rows(rows)}
    assert kernels["decode256:2048/256/16"]["best_name"] == "flashinfer-decode-tc-fa3"
    table = "\n".join(gpu_report.kernel_table(rows))
    assert "| decode256:2048/256/16 | 100.0 | 150.0 (flashinfer-decode-tc-fa3) | 1.50x | 2.00x / 1.43x |" in table
    losses = gpu_report.losses(rows)
    assert losses == ["- mixed256:8192/128/64: prefixattn 900.0 us vs FlashInfer flashinfer-split 600.0 us (1.50x "
                      "slower)"]
    model = "\n".join(gpu_report.model_table(rows))
    assert "(graph) | 12.00 |" in model and "15.00 (flashinfer-decode)" in model and "| 1.25x |" in model


def test_readme_section_from_a_csv(tmp_path, capsys):
    path = tmp_path / "r.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(_rows()[0]))
        w.writeheader()
        w.writerows(_rows())
    assert gpu_report.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Performance (measured on NVIDIA H100 80GB HBM3, commit abc1234)")
    assert "Where prefixattn loses:" in out and "mixed256:8192/128/64" in out
