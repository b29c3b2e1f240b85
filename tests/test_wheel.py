"""The wheel users install, installed as they install it: `pip wheel .`, then `pip install` of that
wheel (not editable) into a fresh virtual environment, and every module of the source tree imported
from there, from a folder outside the checkout. A subpackage missing from the wheel (rmsft.weight_wire
once was: every pod died at import) fails here, not on a cluster.

The fresh environment sees this environment's third-party packages through a path file (torch and
vLLM are not reinstalled), but not this checkout: the editable install's finder lives in a .pth file
of the dev environment's site-packages, which a plain path entry does not execute."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {
    "rmsft": ROOT / "rmsft",
    "rmsft_cli": ROOT / "rmsft_cli",
    "rmsft_dev": ROOT / "rmsft_dev",
    "learner": ROOT / "learner",
    "rollout_svc": ROOT / "rollout_svc",
    "rollout_engine": ROOT / "rollout_engine",
    "rmsft_operator": ROOT / "operator" / "rmsft_operator",
    "rmsft_protos": ROOT / "protos" / "rmsft_protos",
}

pytestmark = pytest.mark.slow


def source_modules() -> list[str]:
    mods = []
    for top, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [top, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods.append(".".join(parts))
    return mods


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the sources, as the Dockerfile does: a checkout's leftover build/ folder
    would otherwise put into the wheel what the package list no longer names."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for top in ("rmsft", "rmsft_cli", "rmsft_dev", "learner", "rollout_svc", "rollout_engine", "operator", "protos"):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (whl,) = out.glob("rmsft-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "dev-env-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return venv


def test_the_wheel_holds_every_package_and_the_proto(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for mod in source_modules():
        path = mod.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, f"{mod} is missing from {wheel.name}"
    assert "rmsft_protos/rollout.proto" in names
    assert not any(n.startswith(("operator/", "tests/")) for n in names)  # `import operator` stays stdlib


def test_every_module_imports_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        out[m] = importlib.import_module(m).__file__\n"
        "    except Exception as e:\n"
        "        out[m] = 'ERROR ' + type(e).__name__ + ': ' + str(e)\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [str(installed / "bin" / "python"), "-c", code, *source_modules()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = {m: f for m, f in files.items() if f.startswith("ERROR")}
    assert not errors, errors
    outside = {m: f for m, f in files.items() if not f.startswith(str(installed))}
    assert not outside, f"imported from outside the installed wheel: {outside}"


def test_the_console_script_and_the_vllm_plugin_are_installed(installed: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(installed / "bin" / "rmsft"), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "local" in proc.stdout, proc.stderr[-2000:]
    code = (
        "from importlib.metadata import entry_points; "
        "print([e.value for e in entry_points(group='vllm.general_plugins') if e.dist.name == 'rmsft'])"
    )
    out = subprocess.run(
        [str(installed / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert "register" in out, out
