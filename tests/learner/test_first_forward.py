"""The CPU learner's first training forward equals the same forward done again (docs/development.md, "The CPU
learner's first forward"): `scripts/first_forward_check.py` on the cluster tier's tiny job, three runs of one step
each, every run's step-1 logits equal their recomputation to the bit.

Without `learner.train.policy.warm_cpu_math_kernels` a run differed in 5 of 14 runs on 2 cores, so this test then
fails with a probability of about 0.74 (1 - (9/14)^3); with it, none of 16 runs differed. A race cannot be caught
every time; the script with more `--runs` is the stronger check."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_training_forward_equals_itself_done_again() -> None:
    p = subprocess.run(
        [sys.executable, "scripts/first_forward_check.py", "configs/job-kind-cpu.yaml", "--runs", "3", "--steps", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    runs = re.findall(r"^run \d+: (equal|DIFFERS) +step 1: (\S+)/(\S+)$", p.stdout, re.M)
    assert len(runs) == 3, p.stdout
    assert all(r == ("equal", "0.0e+00", "0.0e+00") for r in runs), p.stdout
    assert "RESULT runs=3 differing=0" in p.stdout, p.stdout
