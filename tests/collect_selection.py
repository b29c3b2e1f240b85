"""Runs pytest's collection (`--collect-only`, the project's addopts and testpaths, from the repo root
as `make test` does) once without `-m` and once per given marker expression, in this one process:
test modules are imported once, so each further collection costs about a second, not a fresh
interpreter's imports. Writes OUT_JSON: {"": {"exit": code, "items": {nodeid: [marker names]}},
EXPR: {"exit": code, "items": {...}}, ...}; the marker names are the ones an item carries once every
collection hook has run. Usage: python tests/collect_selection.py OUT_JSON [EXPR ...]."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class _Recorder:
    def __init__(self) -> None:
        self.items: dict[str, list[str]] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # After pytest_collection_modifyitems (where `-m` deselects): what a run would execute.
        self.items = {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in session.items}


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/collect_selection.py OUT_JSON [EXPR ...]")
    out = Path(sys.argv[1]).resolve()
    os.chdir(ROOT)  # pytest takes its ini file and testpaths from the invocation folder
    result = {}
    for expr in ["", *sys.argv[2:]]:
        recorder = _Recorder()
        # no cache plugin: a collection run has nothing to remember and must not write .pytest_cache
        args = ["--collect-only", "-q", "-p", "no:cacheprovider"]
        code = pytest.main(args + (["-m", expr] if expr else []), plugins=[recorder])
        result[expr] = {"exit": int(code), "items": recorder.items}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
