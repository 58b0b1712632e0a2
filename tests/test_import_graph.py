"""Which module of prefixattn imports which (docs/design.md, "Which module may import which"), read from the source.

Every ``import`` and ``from ... import`` statement counts, at module level or inside a function (an import inside a
function hides a cycle, it does not break it); relative imports are resolved; ``import prefixattn.a.b`` and
``from prefixattn.a import b`` are edges to the module ``prefixattn.a.b`` (when ``b`` is a module, else to
``prefixattn.a``). The checks: no import cycle, and the layering rules that are cheap to state.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "prefixattn"
#: The integration glue (vLLM, SGLang, Ray).
INTEGRATIONS = ROOT / PACKAGE / "integrations"


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(folder: Path, base: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``folder`` (a package's ``__init__.py`` under its own name)."""
    return {_module_name(p, base): p for p in sorted(folder.rglob("*.py"))}


def _imported_names(path: Path, module: str) -> list[str]:
    """Every dotted name ``module`` imports, relative imports resolved, at module level or in a function:
    ``a.b`` for ``import a.b``, ``a.b`` and ``a`` for ``from a import b``."""
    return [name for names in _imports(path, module) for name in names]


def _imports(path: Path, module: str) -> list[tuple[str, ...]]:
    """One tuple per imported name: ``(a.b,)`` for ``import a.b``; ``(a.b, a)`` for ``from a import b`` (``b`` a
    module of ``a``, or a name ``a`` defines)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name,) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module
            if base != "__future__":
                out += [(f"{base}.{alias.name}", base) for alias in node.names]
    return out


def _resolve(name: str, known: dict) -> str | None:
    """The longest known module that ``name`` starts with (``prefixattn.a.b.C`` -> ``prefixattn.a.b``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def _edges(path: Path, module: str, known: dict) -> set[str]:
    """The prefixattn modules ``module`` imports: ``from a import b`` is an edge to ``a.b`` when that is a module,
    else to ``a``."""
    targets = set()
    for names in _imports(path, module):
        if names[0].split(".")[0] != PACKAGE:
            continue
        target = _resolve(names[0], known)
        if target is not None and target != module:
            targets.add(target)
    return targets


def import_graph() -> dict[str, set[str]]:
    """``{module: the prefixattn modules it imports}`` over every module of ``prefixattn/``."""
    known = _modules(ROOT / PACKAGE, ROOT)
    return {module: _edges(path, module, known) for module, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted, the list sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out)


def _third_party(path: Path, module: str) -> set[str]:
    """Top-level names ``module`` imports that are neither the standard library nor prefixattn."""
    return {name.split(".")[0] for name in _imported_names(path, module)
            if name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != PACKAGE}


def test_the_graph_finds_a_cycle_and_every_kind_of_import(tmp_path):
    pkg = tmp_path / "prefixattn"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    import prefixattn.sub.c\n")
    (pkg / "sub" / "c.py").write_text("from prefixattn.sub import a\nfrom ..sub.d import g\n")
    (pkg / "sub" / "d.py").write_text("g = 1\n")
    (pkg / "sub" / "e.py").write_text("from prefixattn.sub.d import g\n")
    known = _modules(pkg, tmp_path)
    graph = {m: _edges(p, m, known) for m, p in known.items()}
    assert graph["prefixattn.sub.e"] == {"prefixattn.sub.d"}  # a name of d: an edge to d, not to the package
    assert "prefixattn.sub.d" in graph["prefixattn.sub.c"]  # relative, two levels up
    assert "prefixattn.sub.c" in graph["prefixattn.sub.b"]  # inside a function
    assert ["prefixattn.sub.a", "prefixattn.sub.b", "prefixattn.sub.c"] in cycles(graph)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (each line: the modules of one cycle):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_kernels_import_only_triton_and_each_other():
    for module, path in _modules(ROOT / PACKAGE / "kernels", ROOT).items():
        inside = {n for n in _imported_names(path, module) if n.split(".")[0] == PACKAGE}
        assert all(n.startswith(f"{PACKAGE}.kernels") for n in inside), (module, inside)
        assert _third_party(path, module) <= {"triton"}, module
    layout = ROOT / PACKAGE / "kernels" / "layout.py"
    assert _imported_names(layout, f"{PACKAGE}.kernels.layout") == [], "kernels/layout.py imports nothing"


def test_lcp_tree_and_scheduling_import_neither_torch_nor_triton():
    for folder in ("lcp_tree", "scheduling"):
        for module, path in _modules(ROOT / PACKAGE / folder, ROOT).items():
            assert not _third_party(path, module) & {"torch", "triton"}, module


def test_the_cost_rule_imports_nothing():
    """The simulator imports it (docs/design.md): no torch, no planner module behind it."""
    path = ROOT / PACKAGE / "planner" / "cost_rule.py"
    assert _imported_names(path, f"{PACKAGE}.planner.cost_rule") == []
    init = ROOT / PACKAGE / "planner" / "__init__.py"
    assert _imported_names(init, f"{PACKAGE}.planner") == []


def test_integrations_never_import_the_kernels():
    modules = _modules(INTEGRATIONS, ROOT)
    assert f"{PACKAGE}.integrations.vllm.backend" in modules
    for module, path in modules.items():
        kernels = [n for n in _imported_names(path, module) if n == f"{PACKAGE}.kernels"
                   or n.startswith(f"{PACKAGE}.kernels.") or ".kernels." in f".{n}."]
        assert not kernels, (module, kernels)


def test_autotune_imports_neither_the_tools_nor_sim_nor_cli_nor_integrations():
    graph = import_graph()
    above = (f"{PACKAGE}.tuning", f"{PACKAGE}.sim", f"{PACKAGE}.cli", f"{PACKAGE}.integrations")
    wrong = {m: sorted(t for t in targets if t.startswith(above))
             for m, targets in graph.items() if m.startswith(f"{PACKAGE}.autotune")}
    assert not any(wrong.values()), {m: t for m, t in wrong.items() if t}


def test_only_the_command_line_imports_the_offline_tools():
    """What a launch or a plan reads lives in autotune/; the tools that make and check it (tuning/) sit above every
    run-time module."""
    tools = f"{PACKAGE}.tuning"
    graph = import_graph()
    assert f"{tools}.compile_check" in graph
    wrong = {m: sorted(t for t in targets if t == tools or t.startswith(f"{tools}."))
             for m, targets in graph.items()
             if not m.startswith((f"{tools}.", f"{PACKAGE}.cli.")) and m not in (tools, f"{PACKAGE}.cli")}
    assert not any(wrong.values()), {m: t for m, t in wrong.items() if t}


def test_only_the_command_line_imports_the_command_line():
    cli = f"{PACKAGE}.cli"
    graph = import_graph()
    wrong = {m: sorted(t for t in targets if t == cli or t.startswith(f"{cli}."))
             for m, targets in graph.items() if m != cli and not m.startswith(f"{cli}.")}
    assert not any(wrong.values()), {m: t for m, t in wrong.items() if t}
