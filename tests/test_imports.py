"""The import graph: every import stays within the floors docs/design.md allows, and no
modules import each other in a circle.

Unit tier (no processes, no torch). Every module of the package is parsed with `ast`; every
`import` counts, those inside functions and methods included (an import moved into a function
hides a cycle from Python, not from this test). The floors are read from the "Floors and
imports" block of docs/design.md, the folders' package names from pyproject.toml's
`package-dir`, so neither is restated here.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


@cache
def package_dirs() -> dict[str, Path]:
    """{package name: folder}, from pyproject.toml (`meshplan` -> planner/, ...)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {pkg: ROOT / folder for pkg, folder in setup["package-dir"].items()}


@cache
def modules() -> dict[str, Path]:
    """{module name: file} of every module of every package (`meshplan.ir.cluster`, ...)."""
    out = {}
    for pkg, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            out[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return out


def package_of(module: str) -> str:
    """The package (floor) a module belongs to: the longest package name prefixing it."""
    return max((p for p in package_dirs() if module == p or module.startswith(p + ".")), key=len)


@cache
def floors() -> dict[str, set[str]]:
    """{package: the packages it may import}, read from docs/design.md's floors block.

    Each entry starts at a line beginning with a folder (`cost_model/`) and says, at the end
    of one of its lines, `imports nothing`, `imports everything` or `imports a, b/c`.
    """
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Floors and imports", 1)[1].split("```")[1]
    by_folder = {
        folder.relative_to(ROOT).as_posix() + "/": p for p, folder in package_dirs().items()
    }
    allowed: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        start = re.match(r"^(\S+/)\s", line)
        if start:
            assert start.group(1) in by_folder, f"design.md names an unknown folder {line!r}"
            current = by_folder[start.group(1)]
        said = re.search(r"\bimports (.+)$", line)
        if said and current is not None:
            what = said.group(1).strip()
            if what == "everything":
                allowed[current] = set(package_dirs()) - {current}
            elif what == "nothing":
                allowed[current] = set()
            else:
                allowed[current] = {by_folder[f.strip().rstrip("/") + "/"] for f in what.split(",")}
    return allowed


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The meshplan modules an import statement loads (its package's module for a name)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module if modules()[module].stem == "__init__" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            full = f"{base}.{node.module}" if node.module else base
        else:
            full = node.module or ""
        # `from pkg import submodule` loads the submodule; `from mod import name` the module.
        names = [
            f"{full}.{a.name}" if f"{full}.{a.name}" in modules() else full for a in node.names
        ]
    out = []
    for name in names:
        while name and name not in modules():
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


@cache
def import_graph() -> nx.DiGraph:
    """Module -> module, one edge per import (attribute `lines`: where it is written)."""
    graph = nx.DiGraph()
    for module, path in modules().items():
        graph.add_node(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, node):
                    if not graph.has_edge(module, target):
                        graph.add_edge(module, target, lines=set())
                    graph.edges[module, target]["lines"].add(node.lineno)
    return graph


def _where(graph: nx.DiGraph, a: str, b: str) -> str:
    lines = ", ".join(str(n) for n in sorted(graph.edges[a, b]["lines"]))
    return f"{modules()[a].relative_to(ROOT)}:{lines} imports {b}"


def test_every_package_has_a_floor():
    assert set(floors()) == set(package_dirs()), "docs/design.md's floors block misses a folder"


def test_the_floors_are_not_circular():
    packages = nx.DiGraph([(a, b) for a, bs in floors().items() for b in bs if b != a])
    cycles = list(nx.simple_cycles(packages))
    assert not cycles, f"docs/design.md's floors import each other: {cycles}"


def test_no_module_imports_above_its_floor():
    graph = import_graph()
    upward = [
        _where(graph, a, b)
        for a, b in graph.edges
        if package_of(a) != package_of(b) and package_of(b) not in floors()[package_of(a)]
    ]
    assert not upward, "imports above the floor (docs/design.md):\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = import_graph()
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(graph))
    detail = [
        _where(graph, a, b)
        for c in nx.simple_cycles(graph)
        for a, b in zip(c, [*c[1:], c[0]], strict=True)
    ]
    assert not cycles, "import cycles:\n" + "\n".join(cycles) + "\n\n" + "\n".join(detail)
