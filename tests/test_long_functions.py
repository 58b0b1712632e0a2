"""scripts/long_functions.py: functions over the line limit are listed with file:line and length, kernels exempt."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("long_functions", ROOT / "scripts" / "long_functions.py")
long_functions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(long_functions)


def _function(name: str, lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_lists_functions_over_the_limit_with_line_and_length(tmp_path):
    inner = "".join(f"    {line}\n" for line in _function("inner", 85).splitlines())
    outer = "def outer():\n" + inner + "".join(f"    y = {i}\n" for i in range(4))  # 1 + 85 + 4 lines
    src = tmp_path / "m.py"
    src.write_text("import os\n\n" + _function("short", 80) + "\n\nclass C:\n" + _function("long", 81, "    ") + outer)
    found = long_functions.long_functions(src, max_lines=80)
    assert [(name, length) for _, length, name in found] == [("C.long", 81), ("outer", 90), ("outer.inner", 85)]
    assert found[0][0] == src.read_text().splitlines().index("    def long():") + 1


def test_docstrings_do_not_count(tmp_path):
    doc = '    """One line.\n\n    Parameters\n    ----------\n    x : int\n    """\n'  # 6 lines
    src = tmp_path / "m.py"
    src.write_text(_function("documented", 81).replace("():\n", "():\n" + doc, 1) + _function("long", 81))
    found = long_functions.long_functions(src, max_lines=80)
    assert [(name, length) for _, length, name in found] == [("documented", 81), ("long", 81)]
    assert long_functions.long_functions(src, max_lines=81) == []


def test_kernels_are_exempt_and_check_sets_the_exit_status(tmp_path, capsys):
    assert not any("prefixattn/kernels/" in str(f) for f in long_functions.python_files([ROOT / "prefixattn"]))
    src = tmp_path / "m.py"
    src.write_text(_function("long", 81))
    assert long_functions.main([str(src), "--check"]) == 1
    assert "m.py:1" in capsys.readouterr().out
    assert long_functions.main([str(src), "--check", "--max-lines", "81"]) == 0
    with pytest.raises(SystemExit):
        long_functions.main([str(tmp_path / "missing.py")])
