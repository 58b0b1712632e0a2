"""``prefixattn bench`` (prefixattn/cli/bench.py): the pytest command it builds, and one real run end to end on a
single quick benchmark (CSV, summary, exit code)."""

import argparse
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

from prefixattn.cli import bench as bench_command

REPO = Path(__file__).resolve().parents[2]


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def _command(monkeypatch, tmp_path, *argv):
    seen = {}

    def fake_call(cmd, cwd, env):
        seen.update(cmd=cmd, env=env)
        return 0

    monkeypatch.setenv("PREFIXATTN_BENCH_RESULTS", str(tmp_path / "none.csv"))  # no CSV: nothing to summarize
    monkeypatch.setattr(bench_command.subprocess, "call", fake_call)
    assert bench_command.run(_args(*argv)) == 0
    return seen["cmd"], seen["env"]


def test_default_command_runs_the_cpu_suite_with_a_progress_bar(monkeypatch, tmp_path):
    cmd, env = _command(monkeypatch, tmp_path)
    assert cmd[1:4] == ["-m", "pytest", str(REPO / "bench")]
    assert ["-p", "progress"] == cmd[cmd.index("progress") - 1:cmd.index("progress") + 1]
    assert env["TRITON_INTERPRET"] == "1" and "PREFIXATTN_BENCH_GPU" not in env
    assert "-m" not in cmd[2:]  # bench/pytest.ini's -m "not slow" applies


def test_slow_gpu_and_keyword(monkeypatch, tmp_path):
    cmd, env = _command(monkeypatch, tmp_path, "--slow", "--gpu", "-k", "traffic", "--", "-x")
    assert cmd[-5:] == ["-k", "traffic", "-m", "", "-x"]
    assert env["TRITON_INTERPRET"] == "0" and env["PREFIXATTN_BENCH_GPU"] == "1"


def test_unknown_options_go_to_pytest(monkeypatch):
    from prefixattn import cli

    seen = {}
    monkeypatch.setattr(bench_command, "run", lambda args: seen.setdefault("args", args.pytest_args) and 0)
    assert cli.main(["bench", "-x", "--durations=5", "-k", "merge"]) == 0
    assert seen["args"] == ["-x", "--durations=5"]


def test_finds_the_suite_only_in_a_prefixattn_checkout(tmp_path):
    assert bench_command.find_bench_dir() == REPO / "bench"  # this checkout (editable install or source tree)
    other = tmp_path / "other"  # another project's bench/ folder, or a bare one
    (other / "bench").mkdir(parents=True)
    for name in bench_command.SUITE_FILES:
        (other / "bench" / name).write_text("")
    (other / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert bench_command.find_bench_dir([other, tmp_path]) is None
    (other / "pyproject.toml").write_text('[project]\nname = "prefixattn"\n')
    assert bench_command.find_bench_dir([tmp_path, other]) == other / "bench"


def test_an_install_without_the_checkout_says_what_it_needs(tmp_path):
    # The package as a wheel installs it (no bench/ beside it), run from a folder that is no checkout.
    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "prefixattn", site / "prefixattn", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-m", "prefixattn.cli", "bench", "-k", "merge"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stdout == ""
    message = run.stderr.strip()
    assert len(message.splitlines()) == 1 and message.startswith("prefixattn bench: the benchmark suite (bench/) is "
                                                                  "not part of the installed package")
    assert "source checkout" in message and "from the checkout's root" in message
    assert str(site / "bench") in message and str(work / "bench") in message  # the copy ran, and where it looked


def test_end_to_end_on_one_benchmark(tmp_path):
    out = tmp_path / "latest.csv"
    env = {**os.environ, "PREFIXATTN_BENCH_RESULTS": str(out)}
    run = subprocess.run([sys.executable, "-m", "prefixattn.cli", "bench", "-k", "merge_states_n"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["benchmark", "provider", "shape", "device", "metric", "value", "unit", "commit",
                             "versions"]
    assert {r["benchmark"] for r in rows} == {"merge_states_n"} and len(rows) == 2
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# prefixattn bench") and "merge_states_n" in summary
