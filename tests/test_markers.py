"""Every pytest marker (pyproject's `markers`, each named in the README) selects with `-m` exactly the
tests it names and `not` of it exactly the rest, however it is attached: a decorator, a module's
`pytestmark`, or a tier's conftest hook (which must run before pytest's own `-m` selection). The
expected tests come from the folders and the test sources, not from pytest's markers. One collection
process for all expressions (tests/collect_selection.py): about 15-20 s of CPU, no test is run."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The tiers that are a folder: every test under it carries the marker, and no test elsewhere does.
FOLDER_TIERS = {"cluster": "tests/cluster/", "envtest": "tests/envtest/", "gpu": "tests/gpu/"}
# Folders whose conftest marks all their tests slow (the cluster tier's bring-up alone takes minutes).
SLOW_FOLDERS = ("tests/cluster/",)


def _markers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [line.split(":", 1)[0].strip() for line in config["tool"]["pytest"]["ini_options"]["markers"]]


def _readme_expressions() -> list[str]:
    """The `-m` expressions the README shows, quoted (`PYTEST_ARGS="-m 'not vllm'"`) or one word (`-m cluster`)."""
    # marker names, `not`/`and`/`or` and parentheses only: `python3 -m http.server` is not one
    found = re.findall(r"""(?<![\w-])-m\s+(?:(["'])([\w\s()]+)\1|(\w+)(?![\w.]))""", README.read_text())
    return list(dict.fromkeys(quoted or word for _, quoted, word in found))


MARKERS = _markers()
README_EXPRESSIONS = _readme_expressions()


def _mark_names(tree: ast.AST) -> set[str]:
    """NAME of every `pytest.mark.NAME` in the tree (decorators, `pytestmark`, aliases like
    `slow = pytest.mark.slow`), comments and strings left out."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    }


def _module_marks(tree: ast.Module) -> set[str]:
    """Markers a module's top-level `pytestmark` puts on all its tests."""
    return {
        name
        for stmt in tree.body
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets)
        for name in _mark_names(stmt.value)
    }


def _sources() -> dict[str, tuple[set[str], set[str]]]:
    """test file (relative path, as in node ids) -> (markers its source applies, its module-wide markers)."""
    out = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        out[path.relative_to(ROOT).as_posix()] = (_mark_names(tree), _module_marks(tree))
    return out


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.fixture(scope="module")
def collections(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    exprs = sorted({*MARKERS, *(f"not {m}" for m in MARKERS), *README_EXPRESSIONS})
    out = tmp_path_factory.mktemp("markers") / "collections.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "collect_selection.py"), str(out), *exprs],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result[""]["exit"] == 0, "collection without -m failed:\n" + proc.stdout[-3000:]
    return result


def _carrying(collections: dict[str, dict[str, Any]], marker: str) -> set[str]:
    return {nodeid for nodeid, marks in collections[""]["items"].items() if marker in marks}


def test_the_readme_names_every_marker_and_shows_how_to_skip_and_pick_the_cluster_tier() -> None:
    text = README.read_text()
    assert MARKERS, "no markers in pyproject's [tool.pytest.ini_options]"
    assert [m for m in MARKERS if f"`{m}`" not in text] == []
    assert {"not cluster", "cluster"} <= set(README_EXPRESSIONS)


@pytest.mark.parametrize("marker", MARKERS)
def test_marker_selects_exactly_what_it_names(collections: dict[str, dict[str, Any]], marker: str) -> None:
    every = set(collections[""]["items"])
    carrying = _carrying(collections, marker)
    if marker in FOLDER_TIERS:
        folder = FOLDER_TIERS[marker]
        expected = {nodeid for nodeid in every if nodeid.startswith(folder)}
        assert expected, f"no tests collected under {folder}"
        assert carrying == expected
    else:
        sources = _sources()
        declared = {f for f, (marks, _) in sources.items() if marker in marks}
        if marker == "slow":
            declared |= {f for f in sources if f.startswith(SLOW_FOLDERS)}
        assert declared, f"no test source applies pytest.mark.{marker}"
        assert {_file(nodeid) for nodeid in carrying} == declared
        module_wide = {f for f, (_, marks) in sources.items() if marker in marks}
        assert {nodeid for nodeid in every if _file(nodeid) in module_wide} <= carrying

    selected = set(collections[marker]["items"])
    # exit 5 is "no tests collected": `-m` that selects nothing fails `make test` too
    assert collections[marker]["exit"] == collections[f"not {marker}"]["exit"] == 0
    assert sorted(carrying - selected) == [], f"-m {marker} misses tests that carry it"
    assert sorted(selected - carrying) == [], f"-m {marker} picks tests that do not carry it"
    unselected = set(collections[f"not {marker}"]["items"])
    assert unselected == every - carrying, f"-m 'not {marker}' is not the rest of the suite"


def _evaluate(expr: str, marks: set[str]) -> bool:
    """A `-m` expression (names, `not`, `and`, `or`, parentheses) over an item's markers."""

    def walk(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in marks
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not walk(node.operand)
        if isinstance(node, ast.BoolOp):
            values = [walk(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        raise ValueError(f"README: -m {expr!r} is not a marker expression this test can read")

    return walk(ast.parse(expr, mode="eval").body)


@pytest.mark.parametrize("expr", README_EXPRESSIONS)
def test_readme_expression_selects_what_its_markers_name(collections: dict[str, dict[str, Any]], expr: str) -> None:
    carrying = {m: _carrying(collections, m) for m in MARKERS}
    marks_of = {nodeid: {m for m in MARKERS if nodeid in carrying[m]} for nodeid in collections[""]["items"]}
    expected = {nodeid for nodeid, marks in marks_of.items() if _evaluate(expr, marks)}
    assert expected
    assert set(collections[expr]["items"]) == expected
    assert collections[expr]["exit"] == 0
