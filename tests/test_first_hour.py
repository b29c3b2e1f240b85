"""A newcomer's first hour at the terminal (issue 64): sizes need their unit, refusals name the fix that applies,
wrong files are named with the command for them, help and output are wrapped one way, `rmsft local --dry-run`
says what it would start. Each test fails without its fix; none starts a model or vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rmsft.memory_plan import GiB, parse_bytes

ROOT = Path(__file__).resolve().parent.parent


def _rmsft(*args: str, cwd: Path = ROOT, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "rmsft_cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, env=env)


# 2: units ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["80", "80.5", " 96 "])
def test_a_typed_size_without_a_unit_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"--gpu-memory .* has no unit: write .*GiB .*accepted forms: 80GiB"):
        parse_bytes(text, what="--gpu-memory")
    # a Kubernetes quantity (a pod's memory limit) still reads plain bytes
    assert parse_bytes(text) == int(float(text))


@pytest.mark.parametrize("text", ["0GiB", "0Gi", "0.0G", "0"])
def test_a_typed_size_of_zero_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--gpu-memory"):
        parse_bytes(text, what="--gpu-memory")


def test_typed_sizes_with_units_read_as_before() -> None:
    assert parse_bytes("80GiB", what="--gpu-memory") == parse_bytes("80Gi", what="x") == 80 * GiB
    assert parse_bytes("96G", what="--gpu-memory") == 96 * 10**9
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes("1e999GiB", what="--gpu-memory")  # no OverflowError


def test_plan_refuses_gpu_memory_without_a_unit_in_one_line() -> None:
    job = str(ROOT / "configs" / "job.yaml")
    for value, expected in (("80", "'80' has no unit: write 80GiB"), ("0GiB", "must be more than zero")):
        res = _rmsft("plan", job, "--gpu-memory", value)
        assert res.returncode == 2, res.stdout
        assert expected in res.stderr and "KV cache" not in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
