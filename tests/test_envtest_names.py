"""The envtest operator tests share one API server and one namespace for a module: a job name two tests apply can
meet the first test's job still being deleted (`_finish` does not wait), and the second apply then edits it instead
of creating it (CI of f24713b failed so). Each test's jobs get names of their own."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "tests/envtest/test_envtest_operator.py"
# Names two tests may share, and why it is safe.
SHARED = {"hotel": "one of its two tests applies it in a namespace of its own (baseline-team)"}


def _names_by_test() -> dict[str, set[str]]:
    tree = ast.parse(MODULE.read_text())
    used: dict[str, set[str]] = defaultdict(set)
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "_manifest"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                used[node.args[0].value].add(fn.name)
    return used


def test_no_two_envtest_tests_apply_a_job_of_the_same_name() -> None:
    used = _names_by_test()
    assert len(used) >= 10  # the parse found the tests' jobs
    shared = {name: sorted(tests) for name, tests in used.items() if len(tests) > 1 and name not in SHARED}
    assert not shared, f"job names applied by more than one test (give each test its own): {shared}"
