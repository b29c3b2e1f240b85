"""Every shipped example job parses with the learner's spec (the one the CRD is generated from)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rmsft.jobspec import parse_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "configs").glob("*.yaml"))


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"job.yaml", "job-3v1.yaml", "job-kind-cpu.yaml", "local-tiny.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses(path: Path) -> None:
    job = parse_job(yaml.safe_load(path.read_text()))
    assert job.spec.training.steps > 0
