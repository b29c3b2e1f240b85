"""`rmsft local` restarts a rollout server whose process ended, as Kubernetes restarts its pod: same address,
log continued, a bounded number of times (HF backend: starts in seconds, no vLLM)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from rollout_svc_helpers import generate, prompt_ids

from rollout_svc.launcher import RolloutServer, Supervisor


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _kill(srv: RolloutServer) -> None:
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)


def test_a_server_that_exits_is_restarted_on_its_address(tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path) -> None:
    events: list[str] = []
    log = tmp_path / "serve.log"
    with RolloutServer.start(tiny_model_dir, backend="hf", timeout=120, log_path=log) as srv:
        before = generate(srv.stub(), srv.metadata(), prompt_ids(tiny_tokenizer)[:2])
        address, first_pid = srv.address, srv.proc.pid
        with Supervisor([srv], report=events.append, max_restarts=1, poll_s=0.2, start_timeout=120):
            _kill(srv)
            _wait(lambda: any("serving again" in e for e in events), 150, f"not restarted: {events}")
            assert srv.address == address and srv.proc.pid != first_pid
            assert srv.health() == "SERVING"
            after = generate(srv.stub(), srv.metadata(), prompt_ids(tiny_tokenizer)[:2])
            assert [list(c.token_ids) for c in after.completions] == [list(c.token_ids) for c in before.completions]
            _kill(srv)  # past max_restarts: left down, said once
            _wait(lambda: any("leaving it down" in e for e in events), 20, f"no give-up report: {events}")
            time.sleep(0.6)
            assert srv.proc.poll() is not None
            assert sum("leaving it down" in e for e in events) == 1
    assert "exited with -9: restarting it (1/1" in " ".join(events)
    assert log.read_text().count("listening on") == 2  # one log, both runs


_STARTER = """
import sys, time
from rollout_svc.launcher import RolloutServer
srv = RolloutServer.start(sys.argv[1], backend="hf", timeout=120, log_path=sys.argv[2])
print(srv.proc.pid, srv.port, flush=True)
time.sleep(600)
"""


def test_a_server_whose_starter_is_killed_stops_by_itself(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL gives its starter (`rmsft local`, a test) no chance to stop the server: the server sees its lifeline
    end (rmsft.lifeline), shuts down and frees its port."""
    import socket
    import subprocess
    import sys

    import psutil

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "protos")])}
    log = tmp_path / "serve.log"
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tiny_model_dir), str(log)], env=env, stdout=subprocess.PIPE, text=True
    )
    pid = None
    try:
        pid, port = map(int, starter.stdout.readline().split())
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        starter.kill()
        starter.wait(10)

        def gone() -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        _wait(gone, 30, f"server {pid} still running after its starter was killed:\n{log.read_text()[-2000:]}")
        # Two mechanisms race here by design (rmsft.lifeline): the lifeline pipe's end ("the process that started
        # this server is gone") or the parent-death SIGTERM; either one shuts the server down in order.
        assert "shutting down" in log.read_text(), log.read_text()[-2000:]
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # free again
    finally:
        starter.kill()
        starter.wait(10)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_a_health_check_only_passes_for_the_server_started_here(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 41: a port is chosen free and then bound by the server it is given to; meanwhile (a restart on the same
    port, above all) another run's server can take it. Its SERVING must not pass for this run's server: the starter
    checks the process answering is the one it started (StatusReply.pid), and another run's server (its own
    token) refuses this run's token."""
    import subprocess
    import sys

    with RolloutServer.start(
        tiny_model_dir, backend="hf", timeout=120, log_path=tmp_path / "other.log", auth_token="other-run"
    ) as other:
        assert other.health() == "SERVING"  # the check passes for the server started here
        for token in ("other-run", "this-run"):  # the same token (a user's fixed one), and a per-run one
            # This run's server, started on the port the other took: it cannot bind it (here: a process that
            # does not even try), while the port answers SERVING.
            ours = RolloutServer(None, other.port, 0, tmp_path / f"ours-{token}.log", token=token)
            ours.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            try:
                with pytest.raises(RuntimeError, match=rf"port {other.port} is answered by another process"):
                    ours.wait_healthy(timeout=30)
            finally:
                ours.proc.kill()
                ours.proc.wait(10)
