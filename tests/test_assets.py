"""The shipped README start is the one its digests name: a changed or truncated file is caught here, not as
other figures in a stranger's README run."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "tiny-vl-grid-model"


def test_shipped_tiny_model_matches_its_digests() -> None:
    listed = dict(reversed(line.split(maxsplit=1)) for line in
                  (ROOT / "assets" / "tiny-vl-grid-model.sha256").read_text().splitlines() if line.strip())
    assert "model.safetensors" in listed and "tokenizer.json" in listed
    assert sorted(p.name for p in MODEL.iterdir()) == sorted(listed)
    for name, digest in listed.items():
        assert hashlib.sha256((MODEL / name).read_bytes()).hexdigest() == digest, name


def test_readme_job_starts_from_the_shipped_model() -> None:
    job = next(d for d in yaml.safe_load_all((ROOT / "configs" / "local-tiny-vl.yaml").read_text()) if d)
    assert (ROOT / job["spec"]["model"]["path"]).resolve() == MODEL
    assert (MODEL / "config.json").is_file()
