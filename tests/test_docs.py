"""The user documentation runs as written: every code block of README.md and docs/ is executed or checked here.

- ``python`` blocks run in this process (kernels in the Triton interpreter, tiny sizes), each on its own globals.
- ``bash`` blocks run in a scratch folder, with ``prefixattn`` meaning this checkout's command line.
- A block preceded by ``<!-- doc-test: not run: REASON -->`` (a GPU, an engine, minutes of CPU) is not run: its run
  test is skipped with that reason, and the check test still compiles it, resolves every ``prefixattn`` name it
  imports or names in a string, parses every ``prefixattn`` command line with the real argument parser, and finds
  every script, test file and module a command names.
- ``text`` blocks are diagrams or output (no command lines allowed in them).

Also: no link leaves the repository except to a public URL, every in-repository link and anchor resolves, the
documentation holds no dated notes, and docs/performance.md and the README's headline table equal what
bench/perf_page.py renders from the committed GPU results.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "prefixattn" / "sim" / "README.md",
               ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
MARK = re.compile(r"<!--\s*doc-test:\s*not run:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
LANGUAGES = {"python", "bash", "text"}
#: Longest a runnable bash block may take (they are one CLI call each: ~5 s, most of it importing torch).
BASH_TIMEOUT_S = 120
#: Words that begin a command line: a text block holding one is a command that escaped the tests.
COMMANDS = ("prefixattn ", "python ", "pytest ", "bash ", "pip ", "vllm ", "$ ")


def blocks(path: Path) -> list[dict]:
    """Every fenced code block of a markdown file: language, source, first line, and the not-run reason if any."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.search(prev)
        out.append(dict(path=path, line=start + 1, lang=m.group(1), source="\n".join(body) + "\n",
                        reason=mark.group(1) if mark else None))
        i += 1
    return out


ALL = [b for path in DOCS if path.exists() for b in blocks(path)]


def _id(b) -> str:
    return f"{b['path'].relative_to(ROOT)}:{b['line']}"


def _pick(*langs, run=None):
    return [pytest.param(b, id=_id(b)) for b in ALL
            if b["lang"] in langs and (run is None or (b["reason"] is None) == run)]


def test_every_block_is_known_and_docs_exist():
    assert (ROOT / "docs").is_dir() and ALL, "expected docs/ and code blocks in the documentation"
    unknown = [f"{_id(b)} ({b['lang'] or 'no language'})" for b in ALL if b["lang"] not in LANGUAGES]
    assert not unknown, f"expected blocks in {sorted(LANGUAGES)}, got {unknown}"


# ---------------------------------------------------------------------------------------------------------------
# python


def _module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets) \
                    and isinstance(node.value, ast.List):  # names a module imports on first use (PEP 562)
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` (a module, or a module and one attribute) exists in this checkout, else what is missing."""
    if _module_file(dotted):
        return None
    module, _, attr = dotted.rpartition(".")
    path = _module_file(module)
    if path is None:
        return f"module {module}"
    if attr not in _top_level_names(path) and _module_file(f"{module}.{attr}") is None:
        return f"{attr} in {module}"
    return None


def _own(name: str) -> bool:
    return name.split(".")[0] == "prefixattn"


def check_python_names(source: str) -> list[str]:
    """What a block imports or names (a dotted string such as a ``scheduler_cls``) from this repository and that
    does not exist."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and _own(node.module):
            missing += [m for a in node.names if (m := _resolve(f"{node.module}.{a.name}"))]
        elif isinstance(node, ast.Import):
            missing += [m for a in node.names if _own(a.name) and (m := _resolve(a.name))]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _own(node.value) \
                and re.fullmatch(r"[\w.]+\.\w+", node.value):
            missing += [m for m in [_resolve(node.value)] if m]
    return missing


@pytest.mark.parametrize("block", _pick("python"))
def test_python_block_compiles_and_names_exist(block):
    compile(block["source"], _id(block), "exec")
    assert not check_python_names(block["source"]), f"{_id(block)}: not in this checkout"


@pytest.mark.parametrize("block", _pick("python", run=True))
def test_python_block_runs(block, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it here
    code = compile(block["source"], _id(block), "exec")
    environ = dict(os.environ)  # a block may set variables (PREFIXATTN_PLANNER, ...): restored afterwards
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, {"__name__": "__doc_block__"})
    finally:
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.parametrize("block", _pick("python", run=False))
def test_python_block_not_run(block):
    pytest.skip(f"{_id(block)} not run: {block['reason']}")


# ---------------------------------------------------------------------------------------------------------------
# bash


def _commands(source: str) -> list[list[str]]:
    """The block's command lines as words (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", source)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value command
            words = words[1:]
        if words:
            out.append(words)
    return out


def check_command(words: list[str]) -> str | None:
    """None if the command line's target exists here (and a ``prefixattn`` line parses), else what is wrong."""
    from prefixattn import cli

    if words[0] == "prefixattn":
        parser = cli.build_parser()
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                args, unknown = parser.parse_known_args(words[1:])
        except SystemExit:
            return f"`{' '.join(words)}` does not parse: {err.getvalue().strip()}"
        if unknown and args._passthrough is None:
            return f"`{' '.join(words)}`: unrecognized arguments {unknown}"
        return None
    files = [w for w in words if re.search(r"\.(sh|py)$|^(tests|bench)/", w) and "=" not in w]
    if words[:2] == ["python", "-m"] or words[0].endswith("python") and words[1:2] == ["-m"]:
        module = words[2]
        if _own(module) or module.startswith(("bench.", "scripts.")):
            path = module.replace(".", "/")  # a package runs its __main__.py (python -m prefixattn.cli)
            files.append(path + "/__main__.py" if (ROOT / path).is_dir() else path + ".py")
    missing = [f for f in files if not (ROOT / f.split("::")[0]).exists()]
    return f"`{' '.join(words)}`: no {missing} in the repository" if missing else None


@pytest.mark.parametrize("block", _pick("bash"))
def test_bash_block_parses(block):
    syntax = subprocess.run(["bash", "-n"], input=block["source"], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{_id(block)}: {syntax.stderr}"
    problems = [p for words in _commands(block["source"]) if (p := check_command(words))]
    assert not problems, f"{_id(block)}: {problems}"


@pytest.mark.parametrize("block", _pick("bash", run=True))
def test_bash_block_runs(block, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # a user's shell: tests/conftest.py set it for this process only
    prelude = f'prefixattn() {{ "{sys.executable}" -m prefixattn.cli "$@"; }}\nset -euo pipefail\n'
    done = subprocess.run(["bash", "-c", prelude + block["source"]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=BASH_TIMEOUT_S)
    assert done.returncode == 0, f"{_id(block)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("block", _pick("bash", run=False))
def test_bash_block_not_run(block):
    pytest.skip(f"{_id(block)} not run: {block['reason']}")


# ---------------------------------------------------------------------------------------------------------------
# text


@pytest.mark.parametrize("block", _pick("text"))
def test_text_block_holds_no_command(block):
    commands = [ln for ln in block["source"].splitlines() if ln.lstrip().startswith(COMMANDS)]
    assert not commands, f"{_id(block)}: command lines in a text block escape these tests: {commands}"


# ---------------------------------------------------------------------------------------------------------------
# links, dates, generated pages

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text)))
    return out


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_in_the_repository(path):
    bad = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"https?://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_relative_to(ROOT) or not dest.exists():
            bad.append(f"{target} (not a file of this repository)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{path.relative_to(ROOT)}: {bad}"


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dated_notes(path):
    text = path.read_text()
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    issues = re.findall(r"^#+ .*\bissue \d+", text, flags=re.M | re.I)
    assert not dates and not issues, f"{path.relative_to(ROOT)}: dated notes {dates}, issue headings {issues}"


def test_readme_is_short_and_starts_with_what_a_newcomer_needs():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md: expected at most 250 lines, got {len(lines)}"
    first = "\n".join(lines[:100])
    for needed in ("## Install", "## Quick start", "--attention-backend PREFIXATTN"):
        assert needed in first, f"README.md: expected {needed!r} in the first 100 lines"
    assert "bash scripts/bench.sh" in "\n".join(lines) and "bash scripts/test.sh" in "\n".join(lines)


def test_performance_page_and_readme_table_are_current():
    spec = importlib.util.spec_from_file_location("perf_page", ROOT / "bench" / "perf_page.py")
    perf_page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf_page)
    runs = perf_page.load_runs()
    assert perf_page.HEADLINE_RUN in runs, ("bench/render/performance.py: HEADLINE_RUN names no CSV in "
                                            "bench/results/gpu/")
    assert not perf_page.stale(runs), "run `python bench/perf_page.py --write` and commit the result"
