"""The floors import only downward: ops < taskrt < search < bench.

Every module's imports are read from its source (ast), those inside functions included, so a
lazy import of a higher floor counts as much as one at the top.  The command-line entry point
(`taskrt/cli.py`, `taskrt/__main__.py`) reaches every floor by design and is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"ops": 0, "taskrt": 1, "search": 2, "bench": 3}
ENTRY_POINT = {"taskrt/cli.py", "taskrt/__main__.py"}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, at any depth, including
    `importlib.import_module("...")` and `__import__("...")` of a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def modules():
    for package in FLOORS:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative not in ENTRY_POINT:
                yield relative


def higher_floors(relative: str) -> list[str]:
    floor = FLOORS[relative.split("/")[0]]
    source = (ROOT / relative).read_text()
    return [f"{relative}:{line} imports {name}" for line, name in imported_modules(source)
            if FLOORS.get(name.split(".")[0], -1) > floor]


@pytest.mark.parametrize("relative", list(modules()))
def test_no_module_imports_a_higher_floor(relative):
    assert higher_floors(relative) == []


def test_the_check_sees_imports_inside_functions_and_by_name():
    source = ("import numpy\n"
              "def f():\n"
              "    from search import CostModel\n"
              "    import importlib\n"
              "    return importlib.import_module('bench.report')\n"
              "from . import sibling\n")
    assert [name for _, name in imported_modules(source)] == ["numpy", "search", "importlib", "bench.report"]


def test_every_floor_has_modules_and_only_the_entry_point_is_left_out():
    checked = set(modules())
    assert all(any(m.startswith(f"{package}/") for m in checked) for package in FLOORS)
    assert not checked & ENTRY_POINT and all((ROOT / m).is_file() for m in ENTRY_POINT)
