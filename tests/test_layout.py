"""The repo layout must never shadow stdlib `operator`, and the pure core must stay pure."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _stdlib_operator_file() -> str:
    import operator

    return operator.__file__


def test_operator_folder_is_not_a_package() -> None:
    assert (ROOT / "operator").is_dir()
    assert not (ROOT / "operator" / "__init__.py").exists()


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-c", "import operator, sys; print(operator.__file__); operator.itemgetter"],
        # `python -m` puts the cwd first on sys.path, the riskiest case.
        [sys.executable, "-m", "operator"],
    ],
    ids=["python-c", "python-m"],
)
def test_import_operator_from_repo_root_is_stdlib(argv: list[str]) -> None:
    if argv[-1] == "operator":
        # `python -m operator` would try to run the stdlib module as a script (no __main__ code);
        # instead check what `-m` resolution finds, with the repo root first on sys.path.
        argv = [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, '.'); import importlib.util as u; print(u.find_spec('operator').origin)",
        ]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert out == _stdlib_operator_file(), out
    assert str(ROOT / "operator") not in out


def test_import_operator_under_pytest_is_stdlib() -> None:
    import operator

    assert Path(operator.__file__).parent != ROOT
    assert hasattr(operator, "attrgetter")
    import rmsft_operator

    assert Path(rmsft_operator.__file__).parent == ROOT / "operator" / "rmsft_operator"


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        (
            "learner/core",
            {
                "grpc",
                "vllm",
                "kubernetes",
                "kopf",
                "rollout_svc",
                "rollout_engine",
                "rmsft_protos",
                "socket",
                "requests",
                "subprocess",
                "urllib",
            },
        ),
        (
            "operator/rmsft_operator",
            {"torch", "vllm", "learner", "rollout_svc", "rollout_engine", "transformers", "peft"},
        ),
    ],
)
def test_forbidden_imports(folder: str, forbidden: set[str]) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no python files under {folder}"
    bad = {str(f.relative_to(ROOT)): sorted(_imported_modules(f) & forbidden) for f in files}
    assert not {k: v for k, v in bad.items() if v}
