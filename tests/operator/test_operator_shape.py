"""Issue 65: the operator stays readable: no function in operator/ past FUNCTION_LIMIT lines (decide is named
stages, not one block), no module past MODULE_LIMIT lines (a module holds one idea). Read with `ast`, so a
docstring or a nested helper counts as part of the function that holds it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "operator"
FUNCTION_LIMIT = 80
MODULE_LIMIT = 600


def _sources() -> list[Path]:
    found = sorted(ROOT.rglob("*.py"))
    assert found, f"no Python source under {ROOT}"
    return found


def test_no_operator_function_is_longer_than_the_limit() -> None:
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LIMIT:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], f"functions past {FUNCTION_LIMIT} lines (split them into named steps): {long}"


def test_no_operator_module_is_longer_than_the_limit() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in _sources()
        if (n := len(path.read_text().splitlines())) > MODULE_LIMIT
    ]
    assert long == [], f"modules past {MODULE_LIMIT} lines (split them by idea): {long}"
