"""laneserve's module import graph has no cycles, counting every import.

The graph is read with `ast`, so it sees what running the code does not: imports inside
functions and under `if TYPE_CHECKING:` are edges too (a cycle hidden behind a local import
is still a cycle in the design). `from pkg import name` is an edge to `pkg.name` when that
is a module, otherwise to `pkg`; a package's `__init__` is a module of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "laneserve"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (`pkg.__init__` is named `pkg`)."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its text."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node)
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_finder_sees_local_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import X\n"
    )
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_laneserve_has_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


if __name__ == "__main__":  # pragma: no cover - a helper to list them
    for cycle in find_cycles(import_graph()):
        print(" <-> ".join(cycle))
    pytest.main([__file__])
