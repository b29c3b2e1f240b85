"""Processes rmsft starts die with their starter (rmsft/lifeline.py), and a killed run's shared-memory folder is
told from a live one's (rmsft/run_dir.py). Real processes, real signals, real flock; no vLLM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from rmsft import run_dir

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, **kw)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


# A starter that launches two children with rmsft.lifeline's options, prints their pids, then sleeps: one child
# watches its lifeline (as `rmsft serve` does) and writes a file when it sees its starter go, the other is a plain
# `sleep` that only the parent-death signal can end. The starter launches them from a thread when asked to: then
# only the lifeline ties them to it.
WATCHER = """
import os, sys, time
from rmsft.lifeline import watch_parent
def lost():
    open(sys.argv[1], "w").write("parent gone")
    os._exit(0)
assert watch_parent(lost)
time.sleep(120)
"""
STARTER = """
    import subprocess, sys, threading, time
    from rmsft import lifeline

    def start():
        a = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1]], **lifeline.popen_options(None))
        b = subprocess.Popen(["sleep", "120"], **lifeline.popen_options(None))
        print(a.pid, b.pid, flush=True)

    if sys.argv[2] == "thread":
        t = threading.Thread(target=start)
        t.start()
        t.join()
    else:
        start()
    time.sleep(120)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_children_die_with_their_starter_however_it_ends(tmp_path: Path, how: int) -> None:
    flag = tmp_path / "seen"
    starter = _python(STARTER, str(flag), "main", WATCHER, stdout=subprocess.PIPE, text=True)
    try:
        watcher, sleeper = map(int, starter.stdout.readline().split())
        time.sleep(0.5)  # the watcher's thread is up
        assert psutil.pid_exists(watcher) and psutil.pid_exists(sleeper)
        starter.send_signal(how)
        starter.wait(10)
        assert _gone(watcher, 10)  # its lifeline, or the parent-death signal, whichever is first
        assert _gone(sleeper, 10)  # the parent-death signal: a child that watches nothing
    finally:
        starter.kill()
        starter.wait(10)


def test_a_child_started_off_the_main_thread_still_has_its_lifeline(tmp_path: Path) -> None:
    flag = tmp_path / "seen"
    starter = _python(STARTER, str(flag), "thread", WATCHER, stdout=subprocess.PIPE, text=True)
    sleeper = None
    try:
        watcher, sleeper = map(int, starter.stdout.readline().split())
        time.sleep(0.5)
        # The thread that started them has ended: a parent-death signal tied to it would have fired already.
        assert psutil.pid_exists(watcher) and psutil.pid_exists(sleeper)
        starter.kill()
        starter.wait(10)
        assert _gone(watcher, 10) and flag.read_text() == "parent gone"
    finally:
        starter.kill()
        starter.wait(10)
        if sleeper is not None:  # no parent-death signal off the main thread: the sleeper is ours to end
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(sleeper).kill()


def test_watch_parent_without_a_lifeline_watches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from rmsft.lifeline import ENV, watch_parent

    monkeypatch.delenv(ENV, raising=False)
    assert watch_parent(lambda: None) is False
    monkeypatch.setenv(ENV, "999999")  # not an open descriptor
    assert watch_parent(lambda: None) is False
    assert ENV not in os.environ  # never handed down to this process's children


# -- run directories ---------------------------------------------------------------------------------------------
OWNER = """
    import sys, time
    from rmsft import run_dir
    run = run_dir.create(sys.argv[1])
    run.sub("weights").joinpath("w.bin").write_bytes(b"x" * 10)
    print(run.path, flush=True)
    time.sleep(120)
"""


def test_a_killed_runs_folder_is_removed_and_a_live_runs_never(tmp_path: Path) -> None:
    owners = [_python(OWNER, str(tmp_path), stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        dead_dir, live_dir = (Path(p.stdout.readline().strip()) for p in owners)
        assert dead_dir.name.startswith(f"rmsft-run-{owners[0].pid}-")  # the owner, for a human reading ls
        mine = run_dir.create(tmp_path)  # this process's: live too
        assert run_dir.stale(tmp_path) == []
        owners[0].kill()
        owners[0].wait(10)
        assert run_dir.stale(tmp_path) == [dead_dir]
        assert sorted(run_dir.live(tmp_path)) == sorted([live_dir, mine.path])
        assert run_dir.remove_stale(tmp_path) == [dead_dir]
        assert not dead_dir.exists() and (live_dir / "weights" / "w.bin").exists() and mine.path.exists()
        mine.close()
        assert not mine.path.exists()
    finally:
        for p in owners:
            p.kill()
            p.wait(10)


def test_a_folder_without_its_lock_is_judged_by_the_pid_in_its_name(tmp_path: Path) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(ended.stdout)
    half_made = tmp_path / f"rmsft-run-{os.getpid()}-abc"  # this process is alive: being made, kept
    orphan = tmp_path / f"rmsft-run-{dead_pid}-def"
    other = tmp_path / "rmsft-weights-xyz"  # not a run folder: never touched
    for d in (half_made, orphan, other):
        d.mkdir()
    assert not psutil.pid_exists(dead_pid)
    assert run_dir.remove_stale(tmp_path) == [orphan]
    assert half_made.exists() and other.exists() and not orphan.exists()


def test_rmsft_local_clean_removes_killed_runs_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from rmsft_cli.app import app

    owner = _python(OWNER, str(tmp_path), stdout=subprocess.PIPE, text=True)
    dead = Path(owner.stdout.readline().strip())
    owner.kill()
    owner.wait(10)
    live = run_dir.create(tmp_path)
    monkeypatch.setattr(run_dir, "shm_base", lambda: str(tmp_path))
    res = CliRunner().invoke(app, ["local", "--clean"])
    assert res.exit_code == 0, res.output
    said = "".join(res.output.split())  # the console wraps long paths
    assert f"removed{dead}(itsrunisgone)" in said and f"1ofliverunskept:{live.path}" in said
    assert not dead.exists() and live.path.exists()
    live.close()


# -- rmsft local's own shutdown -----------------------------------------------------------------------------------
def test_sigterm_while_the_servers_start_kills_every_one_and_unwinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM raises `Terminated` in the main thread (its handler put back afterwards), the wait for the servers
    stops, and every server started so far is killed before the error leaves start_servers; a second signal while
    unwinding is ignored."""
    import threading

    import yaml
    from rich.console import Console

    from learner import local
    from rmsft.jobspec import parse_job
    from rollout_svc.launcher import RolloutServer

    spawned: list = []

    class Loading:
        def __init__(self, i: int) -> None:
            self.address, self.killed, self.i = f"127.0.0.1:{9000 + i}", False, i

        def wait_healthy(self, timeout: float, cancel: threading.Event) -> None:
            if self.i == 0:
                return  # ready; the other one is still loading its engine
            cancel.wait(30)
            raise RuntimeError("stopped waiting for rmsft serve")

        def kill(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal while unwinding: ignored
            self.killed = True

    def spawn(model, *, replica_ordinal: int, **kw) -> Loading:
        spawned.append(Loading(replica_ordinal))
        return spawned[-1]

    monkeypatch.setattr(RolloutServer, "spawn", staticmethod(spawn))
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    job = parse_job(doc)
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(local.Terminated) as info, local.stop_on_signals():
        local.start_servers(job, tmp_path, Console(file=open(os.devnull, "w")))  # noqa: SIM115
    timer.join()
    assert info.value.signum == signal.SIGTERM and time.monotonic() - t0 < 10
    assert len(spawned) == 2 and all(s.killed for s in spawned)
    assert signal.getsignal(signal.SIGTERM) == before
