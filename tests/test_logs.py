"""`RMSFT_LOG_LEVEL` (the operator renders spec.monitoring.logLevel into it) sets the log level of
every rmsft process: `rmsft serve`, `rmsft train`, `rmsft local` (and the servers it starts), and
`rmsft operator` (where `--verbose` still wins)."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rmsft.logs import ENV, LogLevelError, configure_logging, resolve_level
from rmsft_cli.app import app

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def root_logger():
    """The entry points set the root logger's level; put it back for the other tests."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    root.setLevel(level)
    root.handlers[:] = handlers


def test_resolution_order_and_bad_values(monkeypatch: pytest.MonkeyPatch, root_logger) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_level("warning") == logging.WARNING
    monkeypatch.setenv(ENV, "")
    assert resolve_level("info") == logging.INFO  # empty = unset
    monkeypatch.setenv(ENV, "DEBUG")
    assert resolve_level("info") == logging.DEBUG
    assert resolve_level("info", override="error") == logging.ERROR
    assert configure_logging("info") == logging.DEBUG and root_logger.level == logging.DEBUG
    monkeypatch.setenv(ENV, "verbose")
    with pytest.raises(LogLevelError, match=r"RMSFT_LOG_LEVEL must be one of debug, info, warning, error .*'verbose'"):
        configure_logging("info")


# -- rmsft serve -----------------------------------------------------------------------------------
def _huge_model(folder: Path) -> Path:
    """A header-only safetensors model too big for any staging dir: `rmsft serve` stops in its
    preflight, after logging is configured and before any port or engine."""
    folder.mkdir()
    raw = json.dumps({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 42]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


def _serve(tmp_path: Path, level: str) -> subprocess.CompletedProcess:
    model = tmp_path / "huge" if (tmp_path / "huge").exists() else _huge_model(tmp_path / "huge")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rmsft_cli",
            "serve",
            "--model",
            str(model),
            "--backend",
            "hf",
            "--staging-dir",
            str(tmp_path),
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, ENV: level},
    )


def test_serve_honours_the_level(tmp_path: Path) -> None:
    debug = _serve(tmp_path, "debug")
    assert "staging preflight:" in debug.stderr  # a DEBUG line of the server
    info = _serve(tmp_path, "info")
    assert "staging preflight:" not in info.stderr and "ERROR" in info.stderr
    quiet = _serve(tmp_path, "error")
    assert "ERROR" in quiet.stderr
    bad = _serve(tmp_path, "loud")
    assert bad.returncode != 0 and "rmsft serve: RMSFT_LOG_LEVEL must be one of" in bad.stderr
    assert "staging dir" not in bad.stderr  # stopped before doing anything else


# -- rmsft train -------------------------------------------------------------------------------------
def _job(tmp_path: Path) -> Path:
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("level", "expected"), [("debug", logging.DEBUG), ("error", logging.ERROR), ("", logging.INFO)]
)
def test_train_honours_the_level(tmp_path: Path, root_logger, level: str, expected: int) -> None:
    res = CliRunner().invoke(
        app, ["train", "--config", str(_job(tmp_path)), "--servers-file", str(tmp_path / "absent")], env={ENV: level}
    )
    assert res.exit_code == 2  # stops at the missing servers file, after logging was set up
    assert root_logger.level == expected


def test_train_rejects_a_bad_level(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "train", "--config", str(_job(tmp_path)), "--servers", "x:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, ENV: "chatty"},
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "RMSFT_LOG_LEVEL must be one of debug, info, warning, error" in " ".join(res.stderr.split())


# -- rmsft local -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("level", "expected"), [("info", logging.INFO), ("", logging.WARNING)])
def test_local_honours_the_level(tmp_path: Path, root_logger, level: str, expected: int) -> None:
    res = CliRunner().invoke(app, ["local", str(tmp_path / "absent.yaml")], env={ENV: level})
    assert res.exit_code == 2
    assert root_logger.level == expected


def test_local_starts_servers_at_the_jobs_log_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from learner.local import start_servers
    from rmsft.jobspec import parse_job
    from rollout_svc.launcher import RolloutServer

    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["spec"]["monitoring"] = {"logLevel": "debug"}
    started = []

    def fake_start(model, **kw):
        started.append(kw)
        return type("S", (), {"address": f"127.0.0.1:{len(started)}", "wait_healthy": lambda self, *a: None})()

    monkeypatch.setattr(RolloutServer, "spawn", staticmethod(fake_start))
    start_servers(parse_job(doc), tmp_path, Console(file=open(os.devnull, "w")))  # noqa: SIM115
    assert [kw["env"][ENV] for kw in started] == ["debug"] * 2


# -- rmsft operator ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("level", "verbose", "expected"),
    [
        ("warning", False, logging.WARNING),
        ("", False, logging.INFO),
        ("error", True, logging.DEBUG),
    ],
)
def test_operator_honours_the_level_and_verbose_wins(
    monkeypatch: pytest.MonkeyPatch, root_logger, level: str, verbose: bool, expected: int
) -> None:
    import kopf
    from rmsft_operator.__main__ import run

    monkeypatch.setenv(ENV, level)
    monkeypatch.setattr(kopf, "run", lambda **kw: None)
    run(["default"], False, None, verbose)
    assert root_logger.level == expected
    monkeypatch.setenv(ENV, "shouty")
    with pytest.raises(SystemExit, match="rmsft operator: RMSFT_LOG_LEVEL must be one of"):
        run(["default"], False, None, False)


def test_nothing_reads_rmsft_learner_gpus() -> None:
    """The operator used to set RMSFT_LEARNER_GPUS on the learner; no process ever read it (the
    rank count comes from torchrun's WORLD_SIZE), so it can go without replacement."""
    sources = [p for d in ("rmsft", "learner", "rollout_svc", "operator") for p in (ROOT / d).rglob("*.py")]
    # render.py is where the operator wrote it (a writer, not a reader), if it still does.
    readers = [
        str(p.relative_to(ROOT)) for p in sources if "RMSFT_LEARNER_GPUS" in p.read_text() and p.name != "render.py"
    ]
    assert not readers


def test_local_waits_for_servers_as_long_as_the_jobs_startup_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rmsft local` waited a fixed 300 s for its servers, whatever spec.rollout.startupTimeout said; a real-width
    model's engine loads for minutes on a busy CPU machine (benchmarks/real_width.py)."""
    from rich.console import Console

    from learner.local import start_servers
    from rmsft.jobspec import parse_job
    from rollout_svc.launcher import RolloutServer

    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["spec"]["rollout"]["startupTimeout"] = "17m"
    waits: list[float] = []

    def fake_start(model, **kw):
        return type("S", (), {"address": "127.0.0.1:1", "wait_healthy": lambda self, t, *a: waits.append(t)})()

    monkeypatch.setattr(RolloutServer, "spawn", staticmethod(fake_start))
    start_servers(parse_job(doc), tmp_path, Console(file=open(os.devnull, "w")))  # noqa: SIM115
    assert waits == [17 * 60.0] * 2
