"""``prefixattn bench``: run the benchmark suite (``pytest bench/``) and summarize ``bench/results/latest.csv``.

The suite is not part of the wheel: it runs from a source checkout of prefixattn, found beside this package's source
(an editable install, or a checkout on ``sys.path``) or in the current directory (a regular install run from a
checkout's root). Without one the command says so and exits with status 2.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

HELP = "run the benchmark suite (pytest bench/) and print a summary of bench/results/latest.csv"
#: Options ``prefixattn bench`` does not know go to pytest (``prefixattn bench -x --durations=20``).
PASSTHROUGH = "pytest_args"
#: Files of the suite's folder that a folder merely named ``bench/`` would not have.
SUITE_FILES = ("conftest.py", "pytest.ini", "report.py")
#: What the checkout's pyproject.toml declares (another project's ``bench/`` is not this suite).
PROJECT_NAME_LINE = 'name = "prefixattn"'


def checkout_roots() -> tuple[Path, ...]:
    """Where a checkout may be: the folder above this package's source, then the current directory."""
    return Path(__file__).resolve().parents[2], Path.cwd()


def find_bench_dir(roots=None) -> Path | None:
    """``bench/`` of the first root in ``roots`` (default :func:`checkout_roots`) that is a prefixattn checkout, or
    None."""
    for root in checkout_roots() if roots is None else roots:
        bench = Path(root) / "bench"
        pyproject = Path(root) / "pyproject.toml"
        if all((bench / name).is_file() for name in SUITE_FILES) and pyproject.is_file() \
                and PROJECT_NAME_LINE in pyproject.read_text().splitlines():
            return bench
    return None


def no_checkout_message(roots) -> str:
    looked = ", ".join(str(Path(r) / "bench") for r in dict.fromkeys(roots))
    return ("prefixattn bench: the benchmark suite (bench/) is not part of the installed package; it runs from a "
            "source checkout of prefixattn: clone the repository, install it with pip install -e '.[bench]' and run "
            f"prefixattn bench from the checkout's root (the folder with pyproject.toml and bench/). Looked in: {looked}")


def add_arguments(parser) -> None:
    parser.add_argument("-k", dest="keyword", default=None, help="only benchmarks matching this pytest -k expression")
    parser.add_argument("--gpu", action="store_true",
                        help="time compiled kernels on the GPU instead of running the CPU interpreter")
    parser.add_argument("--slow", action="store_true",
                        help="also run the benchmarks marked slow (the whole traffic grid, every compile-check "
                             "variant); the default run takes ~10 minutes on 2 CPU cores")
    parser.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest")


def summarize(csv_path: Path) -> str:
    """A markdown table of every row, grouped as the CSV lists them."""
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    lines = ["| benchmark | provider | shape | metric | value | unit |", "|---|---|---|---|---|---|"]
    for r in rows:
        value = float(r["value"])
        shown = f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
        lines.append(f"| {r['benchmark']} | {r['provider']} | {r['shape']} | {r['metric']} | {shown} | {r['unit']} |")
    device = rows[0]["device"] if rows else "?"
    return f"device: {device}\n\n" + "\n".join(lines)


def run(args) -> int:
    roots = checkout_roots()
    bench = find_bench_dir(roots)
    if bench is None:
        print(no_checkout_message(roots), file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0" if args.gpu else "1"
    if args.gpu:
        env["PREFIXATTN_BENCH_GPU"] = "1"
    # bench/ on the path for the progress-bar plugin (bench/progress.py); pytest puts it there for the tests anyway.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(bench), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", str(bench), "-q", "-p", "no:cacheprovider", "-p", "progress"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    if args.slow:
        cmd += ["-m", ""]  # overrides bench/pytest.ini's -m "not slow" (the last -m wins); gpu tests still skip
    cmd += list(args.pytest_args)
    code = subprocess.call(cmd, cwd=bench.parent, env=env)
    latest = Path(env.get("PREFIXATTN_BENCH_RESULTS") or bench / "results" / "latest.csv")  # see bench/conftest.py
    report = bench / "report.py"
    if latest.exists() and report.exists():
        # The suite's own report (bench/report.py, over bench/render/suite.py): traffic headline, targets,
        # per-benchmark tables, PNG plots.
        spec = importlib.util.spec_from_file_location("prefixattn_bench_report", report)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        md, pngs = module.write(latest)
        print(md.read_text())
        print(f"\nfull results: {latest}\nsummary: {md}\nplots: {', '.join(str(p) for p in pngs) or 'none'}")
    elif latest.exists():
        summary = summarize(latest)
        (bench / "results" / "summary.md").write_text(summary + "\n")
        print(summary)
        print(f"\nfull results: {latest}\nsummary: {bench / 'results' / 'summary.md'}")
    return code
