"""The floors import only downward, and no module imports itself back through others.

Floors, lowest first: the kernels (taskrt.ops), the runtime's rooms in the order below, the package
face (`taskrt/__init__.py`, what `import taskrt as tr` gives), the search, the benchmarks.  A module
imports only from its own floor or lower ones.  Every module's imports are read from its source
(ast), those inside functions included, so a lazy import of a higher floor counts as much as one at
the top.  The command-line entry point (`taskrt/cli.py`, `taskrt/__main__.py`) reaches every floor
by design and is left out.  The repository's ops/, search/ and bench/ folders are installed as
taskrt.ops, taskrt.search and taskrt.bench (pyproject's package-dir).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"ops": "taskrt.ops", "taskrt": "taskrt", "search": "taskrt.search", "bench": "taskrt.bench"}
# the order written once: here and in docs/design.md's layout
FLOORS = ["taskrt.ops", "taskrt.graph", "taskrt.gpu", "taskrt.data", "taskrt.planning", "taskrt.observing",
          "taskrt.transport", "taskrt.machines", "taskrt.execution", "taskrt.training", "taskrt",
          "taskrt.search", "taskrt.bench"]
ENTRY_POINT = {"taskrt.cli", "taskrt.__main__"}


def module_files() -> dict[str, Path]:
    """{module name as installed: its file} of every module of the project."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = module_files()


def imported_modules(source: str, known=MODULES) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, at any depth, including
    `importlib.import_module("...")` and `__import__("...")` of a literal name; `from p import m`
    counts as importing `p.m` where that is a module of `known`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.append((node.lineno, child if child in known else node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return list(dict.fromkeys(found))


def floor_of(module: str) -> int | None:
    """The floor of `module`: that of the longest floor name it is or lies in; None outside the project."""
    floors = [f for f in FLOORS if module == f or module.startswith(f + ".")]
    return FLOORS.index(max(floors, key=len)) if floors else None


def project_module(name: str) -> str | None:
    """The project module an import of `name` loads (its nearest enclosing module), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def higher_floors(module: str) -> list[str]:
    floor = floor_of(module)
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(MODULES[module].read_text())
            if (floor_of(name) or -1) > floor]


CHECKED = [m for m in MODULES if m not in ENTRY_POINT]


@pytest.mark.parametrize("module", CHECKED)
def test_no_module_imports_a_higher_floor(module):
    assert higher_floors(module) == []


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for module in CHECKED:
        graph.add_node(module)
        for _, name in imported_modules(MODULES[module].read_text()):
            target = project_module(name)
            # importing one's own package (its face) is not a circle of rooms
            if target and target != module and not module.startswith(target + "."):
                graph.add_edge(module, target)
    return graph


def test_no_import_circle():
    circles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert circles == []


def test_the_check_sees_imports_inside_functions_by_name_and_modules_imported_from_packages():
    source = ("import numpy\n"
              "def f():\n"
              "    from taskrt.search import CostModel\n"
              "    from taskrt import search\n"
              "    import importlib\n"
              "    return importlib.import_module('taskrt.bench.report')\n"
              "from . import sibling\n")
    assert [name for _, name in imported_modules(source)] == [
        "numpy", "taskrt.search", "taskrt.search", "importlib", "taskrt.bench.report"]
    assert [floor_of(n) for n in ("taskrt.ops.rect", "taskrt.training.fit", "taskrt", "taskrt.bench.gpu")] == [
        0, FLOORS.index("taskrt.training"), FLOORS.index("taskrt"), len(FLOORS) - 1]
    assert floor_of("numpy") is None


def test_the_circle_check_finds_a_circle():
    graph = import_graph()
    graph.add_edge("taskrt.ops.rect", "taskrt.training.trainer")  # the trainer reaches the kernels
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))


def test_every_room_is_a_floor_and_the_face_holds_no_room_of_its_own():
    rooms = {p.name for p in (ROOT / "taskrt").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert {f"taskrt.{r}" for r in rooms} == set(FLOORS) - {"taskrt", "taskrt.ops", "taskrt.search", "taskrt.bench"}
    assert len(rooms) <= 10
    face = {m for m in MODULES if floor_of(m) == FLOORS.index("taskrt")}
    assert face == {"taskrt", "taskrt.cli", "taskrt.__main__", "taskrt.dashboard"}
    assert all((ROOT / "taskrt" / r / "__init__.py").read_text().startswith('"""') for r in rooms)


def test_the_layout_in_the_design_page_lists_the_floors_in_this_order():
    design = (ROOT / "docs" / "design.md").read_text()
    table = design[design.index("The floors, lowest first"):].split("\n\n")[1]  # the paragraph, then the table
    floors = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert floors == FLOORS
