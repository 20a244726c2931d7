"""The service's shape, checked on its source: every SQL statement is in the data layer
(``db.py``), no function is over 80 lines and no route over 30, and every route is a
module-level function of ``veoptim/service/routes/``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

SERVICE = REPO / "veoptim" / "service"
DATA_LAYER = SERVICE / "db.py"
SQL = re.compile(
    r"\b(SELECT\s|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|CREATE\s+(TABLE|INDEX)|PRAGMA\s)",
    re.I,
)
MAX_FUNCTION, MAX_ROUTE = 80, 30


def sql_in(source: str) -> list[int]:
    """The lines of the string constants in ``source`` that hold SQL."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.search(node.value)
    ]


def long_functions(source: str, limit: int) -> list[str]:
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def service_files() -> list[Path]:
    return sorted(SERVICE.rglob("*.py"))


def test_every_sql_statement_of_the_service_is_in_the_data_layer():
    found = {
        str(p.relative_to(REPO)): sql_in(p.read_text()) for p in service_files() if p != DATA_LAYER
    }
    assert {path: lines for path, lines in found.items() if lines} == {}
    assert len(sql_in(DATA_LAYER.read_text())) > 30  # the check reads what it looks for


def test_no_function_of_the_service_is_over_80_lines_and_no_route_over_30():
    found = {
        str(p.relative_to(REPO)): long_functions(p.read_text(), MAX_FUNCTION)
        for p in service_files()
    }
    assert {path: names for path, names in found.items() if names} == {}
    routes = sorted((SERVICE / "routes").glob("*.py"))
    assert len(routes) >= 5
    found = {str(p.relative_to(REPO)): long_functions(p.read_text(), MAX_ROUTE) for p in routes}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_checks_see_sql_and_a_long_function():
    """Negative controls of both source checks."""
    assert sql_in('x = 1\ndb.run("SELECT * FROM futures WHERE id = ?")\n') == [2]
    assert sql_in('"UPDATE sessions SET finished = 1"') == [1]
    assert sql_in('"a selection of models, updated later"') == []
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION) == ["f (86 lines)"]
    assert long_functions("def g():\n    return 1\n", MAX_FUNCTION) == []
