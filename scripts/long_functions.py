"""List every function longer than the project's limit (docs/design.md, "Developing": no function over 80 lines
outside the kernels), longest first, as ``path:line  length  name``.

    python scripts/long_functions.py                 # the whole repository, prefixattn/kernels/ excluded
    python scripts/long_functions.py prefixattn/sim  # some files or folders only
    python scripts/long_functions.py --check         # exit status 1 when any function is over the limit

A function's length counts its lines from ``def`` to its last line, decorators and its docstring excluded (comments
included): the rule is about how much logic a reader holds at once, and the project's numpy-style docstrings (a
parameter section per argument, as ``prefixattn.plan``'s) are documentation, not logic. A nested function is listed on
its own and also counts toward the function around it (its docstring too). Kernels
(``@triton.jit`` code in prefixattn/kernels/) are exempt: a kernel is one program, not split for the reader.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The limit of the project rules ("no function over ~80 lines outside kernels").
MAX_LINES = 80
#: Folders never scanned: the kernels (exempt), virtual environments, caches.
EXCLUDED = ("prefixattn/kernels", ".venv", ".git", "build", "__pycache__", ".pytest_cache", ".hypothesis")


def _excluded(path: Path) -> bool:
    rel = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else path.as_posix()
    if rel.split("/")[0].startswith(".venv"):  # every engine suite's venv (.venv-vllm, .venv-sglang, ...)
        return True
    return any(rel == e or rel.startswith(e + "/") or f"/{e}/" in f"/{rel}/" for e in EXCLUDED)


def python_files(paths) -> list[Path]:
    """The ``.py`` files under ``paths`` (files or folders), excluded folders left out, sorted."""
    files = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise ValueError(f"paths: expected existing files or folders, got {str(p)!r}")
        candidates = [p] if p.is_file() else sorted(p.rglob("*.py"))
        files += [f for f in candidates if f.suffix == ".py" and not _excluded(f)]
    return sorted(set(files))


def _docstring_lines(fn) -> int:
    """Lines of ``fn``'s docstring (0 without one)."""
    first = fn.body[0] if fn.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def long_functions(path: Path, max_lines: int = MAX_LINES) -> list[tuple[int, int, str]]:
    """``(line, length, qualified name)`` of every function in ``path`` longer than ``max_lines`` lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = child.end_lineno - child.lineno + 1 - _docstring_lines(child)
                if length > max_lines:
                    found.append((child.lineno, length, prefix + child.name))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=[str(ROOT)], help="files or folders (default: the repository)")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES, help="limit (default %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit status 1 when any function is over the limit")
    args = parser.parse_args(argv)
    if args.max_lines < 1:
        parser.error(f"--max-lines: expected a positive int, got {args.max_lines}")
    try:
        files = python_files(args.paths)
    except ValueError as e:
        parser.error(str(e))
    rows = []
    for f in files:
        shown = f.resolve().relative_to(ROOT) if f.resolve().is_relative_to(ROOT) else f
        rows += [(length, f"{shown}:{line}", name) for line, length, name in long_functions(f, args.max_lines)]
    for length, where, name in sorted(rows, key=lambda r: (-r[0], r[1])):
        print(f"{where:60s} {length:5d}  {name}")
    print(f"{len(rows)} functions over {args.max_lines} lines in {len(files)} files (prefixattn/kernels/ exempt)")
    return 1 if args.check and rows else 0


if __name__ == "__main__":
    sys.exit(main())
