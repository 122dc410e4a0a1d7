"""The package's shape: no import cycles between modules, small folders and files, every room documented."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import tomllib

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULES_PER_FOLDER = 20
MAX_MODULE_LINES = 450
SOURCE_DIRS = ("engine", "scheduler", "cluster", "replicas", "deploy")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_between_modules_counting_imports_inside_functions() -> None:
    # grimp reads every import statement, those inside functions and TYPE_CHECKING blocks too.
    graph = grimp.build_graph("tandem", include_external_packages=False)
    assert "tandem.deploy.cli.serve_command" in graph.find_modules_directly_imported_by(
        "tandem.deploy.cli.main"
    ), "grimp no longer sees imports inside functions; this test would prove nothing"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def _folders() -> list[Path]:
    return sorted({p.parent for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")})


def test_no_folder_over_twenty_modules_and_no_module_over_450_lines() -> None:
    crowded = {
        str(f.relative_to(ROOT)): n
        for f in _folders()
        if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER
    }
    assert crowded == {}
    long = {
        str(p.relative_to(ROOT)): n
        for d in (*SOURCE_DIRS, "llm.py")
        for p in ([ROOT / d] if d.endswith(".py") else (ROOT / d).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_every_package_is_shipped_and_says_what_it_holds() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for folder in _folders():
        init = folder / "__init__.py"
        name = ".".join(("tandem", *folder.relative_to(ROOT).parts))
        assert init.exists(), f"{folder.relative_to(ROOT)} has no __init__.py"
        assert name in listed, f"{name} is not in pyproject's packages, so a wheel would lack it"
        if folder.parent.name == "deploy":  # deploy's rooms: a newcomer reads the tree by these lines
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and len(doc.splitlines()) == 1, f"{name} needs a one-line docstring"
