"""The shipped starts are the ones their digests name: a changed or truncated file is caught here, not as other
figures in a stranger's README run or benchmark (the README start; the dense start of the benchmark's crowd and row
settings, studies/method/dense_start.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "tiny-vl-grid-model"


@pytest.mark.parametrize("name", ["tiny-vl-grid-model", "tiny-vl-dense-model"])
def test_shipped_tiny_model_matches_its_digests(name: str) -> None:
    model = ROOT / "assets" / name
    listed = dict(
        reversed(line.split(maxsplit=1))
        for line in (ROOT / "assets" / f"{name}.sha256").read_text().splitlines()
        if line.strip()
    )
    assert "model.safetensors" in listed and "tokenizer.json" in listed
    assert sorted(p.name for p in model.iterdir()) == sorted(listed)
    for file, digest in listed.items():
        assert hashlib.sha256((model / file).read_bytes()).hexdigest() == digest, file


def test_readme_job_starts_from_the_shipped_model() -> None:
    from rmsft.jobspec import load_job

    # a job file's relative paths are its folder's (rmsft.jobspec.resolve_paths)
    job = load_job(ROOT / "configs" / "local-tiny-vl.yaml")
    assert Path(job.spec.model.path) == MODEL
    assert (MODEL / "config.json").is_file()
