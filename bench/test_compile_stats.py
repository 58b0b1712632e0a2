"""Ahead-of-time compile statistics of the default configs per GPU target (no GPU needed): registers, spills,
shared memory / LDS, matrix instructions in the shared-node part, compile time.

Runs ``prefixattn compile-check`` in a subprocess (a kernel defined under TRITON_INTERPRET=1 cannot be compiled).
The default run covers head_dim 128, fp16, both modes (decode and chunked-prefill configs) on the four CI targets;
the ``slow`` variant covers every head size and dtype. Rows are reported, never asserted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TARGETS = "sm80,sm90,gfx90a,gfx942"


def _run_check(tmp_path, extra):
    out = tmp_path / "compile_check.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-m", "prefixattn.cli", "compile-check", "--targets", TARGETS, "--quiet",
           "--json", str(out), *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if not out.exists():
        pytest.fail(f"compile-check wrote no report (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(out.read_text()), run.returncode


def _report(results, data, exit_code):
    for r in data["records"]:
        shape = f"{r['variant']}/{r['dtype']}/d{r['head_dim']}/{r['config_name']}"
        device = f"aot:{r['target']}"
        bench = f"compile_{r['kernel']}"
        add = lambda metric, value, unit: results.add(bench, "prefixattn", shape, metric, value, unit,  # noqa: E731
                                                      device=device)
        add("compile_ok", int(bool(r.get("ok"))), "bool")
        if not r.get("ok"):
            continue
        add("registers", r["registers"], "regs/thread")
        if r.get("agprs") is not None:
            add("agprs", r["agprs"], "regs/thread")
        add("spills", r["spills"], "bytes" if r["target"].startswith("sm") else "regs+scratch bytes")
        add("shared_memory", r["shared_bytes"], "bytes")
        add("matrix_instructions", sum(r["matrix_instrs"].values()), "count")
        if r.get("shared_part_matrix") is not None:
            add("shared_part_matrix", int(r["shared_part_matrix"]), "bool")
        add("compile_time", r["compile_s"], "s")
    s = data["summary"]
    results.add("compile_check", "prefixattn", TARGETS, "failed_compiles", s["failed"], "count", device="aot")
    results.add("compile_check", "prefixattn", TARGETS, "wall_time", s["wall_s"], "s", device="aot")
    results.add("compile_check", "prefixattn", TARGETS, "exit_code", exit_code, "code", device="aot")


@pytest.mark.compile
def test_compile_stats_head_dim_128(results, tmp_path):
    data, code = _run_check(tmp_path, ["--head-dims", "128", "--dtypes", "fp16", "--lse", "on"])
    _report(results, data, code)


@pytest.mark.compile
@pytest.mark.slow
def test_compile_stats_all(results, tmp_path):
    data, code = _run_check(tmp_path, [])
    _report(results, data, code)
