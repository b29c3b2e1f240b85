"""Operator start-up errors are one clear line, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rmsft_operator.config import OperatorConfig


def test_timings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RMSFT_OPERATOR_RESYNC_SECONDS", "2.5")
    monkeypatch.setenv("RMSFT_OPERATOR_SCANNING", "false")
    cfg = OperatorConfig.from_env()
    assert cfg.resync_seconds == 2.5 and cfg.scanning is False
    assert OperatorConfig().resync_seconds == 30.0


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_bad_timing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("RMSFT_OPERATOR_RETRY_BACKOFF_SECONDS", value)
    with pytest.raises(SystemExit, match="RMSFT_OPERATOR_RETRY_BACKOFF_SECONDS"):
        OperatorConfig.from_env()


def test_operator_command_needs_a_scope() -> None:
    proc = subprocess.run([sys.executable, "-m", "rmsft_operator"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "RMSFT_OPERATOR_METRICS_PORT": "0"})
    assert proc.returncode != 0
    assert "--namespace NS (repeatable) or --all-namespaces" in proc.stderr
    assert "Traceback" not in proc.stderr
