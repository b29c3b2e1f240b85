"""Operator start-up errors are one clear line, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

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


def test_cleanup_image_is_the_operators_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart passes the operator's own image (and pull policy), which the shm cleanup Job runs; unset (an
    operator run outside the chart) it is empty, and each cleanup Job then runs its job's own image."""
    monkeypatch.setenv("RMSFT_OPERATOR_IMAGE", " registry.example/rmsft:1.2.3 ")
    monkeypatch.setenv("RMSFT_OPERATOR_IMAGE_PULL_POLICY", "Always")
    cfg = OperatorConfig.from_env()
    assert (cfg.image, cfg.image_pull_policy) == ("registry.example/rmsft:1.2.3", "Always")
    monkeypatch.delenv("RMSFT_OPERATOR_IMAGE")
    monkeypatch.delenv("RMSFT_OPERATOR_IMAGE_PULL_POLICY")
    cfg = OperatorConfig.from_env()
    assert (cfg.image, cfg.image_pull_policy) == ("", "IfNotPresent")
    monkeypatch.setenv("RMSFT_OPERATOR_IMAGE_PULL_POLICY", "sometimes")
    with pytest.raises(
        SystemExit, match="RMSFT_OPERATOR_IMAGE_PULL_POLICY='sometimes' must be one of Always, IfNotPresent, Never"
    ):
        OperatorConfig.from_env()


@pytest.fixture
def handlers_imported_here() -> Iterator[None]:
    """Importing `rmsft_operator.handlers` reads the operator's environment once (CFG) and registers its handlers in
    kopf's default registry; a later test in this process that runs the operator (`kopf run -m
    rmsft_operator.handlers`, tests/operator/test_operator_kmock.py) with its own environment must import it anew,
    or it runs with this test's defaults (cluster scanning on, which kmock cannot serve)."""
    import kopf

    had = "rmsft_operator.handlers" in sys.modules
    yield
    if not had:
        sys.modules.pop("rmsft_operator.handlers", None)
        kopf.set_default_registry(kopf.OperatorRegistry())


def test_an_operator_without_its_image_says_what_the_cleanup_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, handlers_imported_here: None
) -> None:
    """Outside the chart the operator cannot know its image: it says so at start, and what the cleanup runs."""
    from types import SimpleNamespace

    from rmsft_operator import handlers

    monkeypatch.setattr(handlers, "CFG", OperatorConfig(metrics_port=0, namespace="rmsft-system"))
    monkeypatch.setattr(handlers, "_kube", lambda: None)
    checked: list[tuple[str, str]] = []  # issue 62: the installed CRD is checked at every start, in the own namespace
    monkeypatch.setattr(
        handlers.crd_check,
        "check",
        lambda kube, namespace, own: checked.append((namespace, own["metadata"]["name"])) or "",
    )
    settings = SimpleNamespace(
        persistence=SimpleNamespace(),
        scanning=SimpleNamespace(),
        posting=SimpleNamespace(),
        watching=SimpleNamespace(),
        networking=SimpleNamespace(),
    )
    with caplog.at_level("WARNING", logger="rmsft_operator"):
        handlers.configure(settings)
    assert (
        "RMSFT_OPERATOR_IMAGE is not set (the chart sets it): the cleanup Job of a deleted shm job will run "
        "that job's own image (as UID 1000, no capabilities, on the job's own folder only)" in caplog.text
    )
    caplog.clear()
    monkeypatch.setattr(handlers, "CFG", OperatorConfig(metrics_port=0, image="registry.example/rmsft:1"))
    with caplog.at_level("WARNING", logger="rmsft_operator"):
        handlers.configure(settings)
    assert "RMSFT_OPERATOR_IMAGE" not in caplog.text
    assert checked == [("rmsft-system", "rolloutmatchingjobs.rmsft.io"), ("", "rolloutmatchingjobs.rmsft.io")]


def test_operator_command_needs_a_scope() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rmsft_operator"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RMSFT_OPERATOR_METRICS_PORT": "0"},
    )
    assert proc.returncode != 0
    assert "--namespace NS (repeatable) or --all-namespaces" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_progress_is_parsed_from_prometheus_text() -> None:
    from rmsft_operator.progress import parse_progress

    text = (
        "# TYPE rmsft_learner_global_step gauge\nrmsft_learner_global_step 12.0\n"
        'rmsft_learner_global_step_other 99\nrmsft_learner_weight_version{pod="x"} 3\n'
    )
    assert parse_progress(text) == {"step": 12, "weightVersion": 3}
    assert parse_progress("rmsft_learner_global_step NaN\n") == {}
    assert parse_progress("") == {}


def test_evaluation_is_parsed_once_the_learner_has_evaluated() -> None:
    from rmsft_operator.progress import parse_progress

    base = "rmsft_learner_global_step 40.0\nrmsft_learner_weight_version 40.0\n"
    evaluated = (
        base + "# TYPE rmsft_learner_eval_step gauge\nrmsft_learner_eval_step 40.0\n"
        "rmsft_learner_eval_f1 0.4166666666\nrmsft_learner_eval_map 0.21234567\n"
        "rmsft_learner_eval_map50 0.5\n"
    )
    assert parse_progress(evaluated) == {
        "step": 40,
        "weightVersion": 40,
        "evaluation": {"step": 40, "f1": 0.4167, "mAP": 0.2123, "mAP50": 0.5},
    }
    # The gauges start at 0: no evaluation yet means no `evaluation` at all.
    zero = base + (
        "rmsft_learner_eval_step 0.0\nrmsft_learner_eval_f1 0.0\nrmsft_learner_eval_map 0.0\n"
        "rmsft_learner_eval_map50 0.0\n"
    )
    assert parse_progress(zero) == {"step": 40, "weightVersion": 40}
    assert parse_progress(base) == {"step": 40, "weightVersion": 40}  # an older learner without the gauges
    # A figure that is not finite (mAP of a held-out set without objects) is left out, not sent as NaN.
    nan = base + "rmsft_learner_eval_step 8.0\nrmsft_learner_eval_f1 0.25\nrmsft_learner_eval_map NaN\n"
    assert parse_progress(nan)["evaluation"] == {"step": 8, "f1": 0.25}
