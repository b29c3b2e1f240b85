"""What the cluster tier changes on the machine it runs on, and how it is put back: the Docker engine
(started when none answers, stopped after), iptables (a snapshot taken before anything starts,
restored at the end), processes in their own process groups, mounts under a folder, network links.

Everything here is undone on failure too: `HostGuard.restore()` runs from the session fixture's
finalizer and from an `atexit` hook."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path


def run(
    *args: str, timeout: float = 120, check: bool = True, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, input=input, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def stop_group(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM a child started with start_new_session=True and its whole group; SIGKILL after `grace`."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )


def unmount_under(root: Path) -> None:
    """Lazily unmount everything mounted at or below `root`, deepest first (kubelet volumes,
    containerd's rootfs and shm mounts outlive the processes that made them)."""
    root = root.resolve()
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    mine = [p for p in points if p == str(root) or p.startswith(str(root) + "/")]
    for point in sorted(set(mine), key=lambda p: p.count("/"), reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


class DockerEngine:
    """The Docker engine the image is built with: the one that answers, or `dockerd` started here
    (and stopped by `stop()`). Its layer cache (/var/lib/docker) carries between runs."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.docker = shutil.which("docker")

    def answers(self) -> bool:
        if not self.docker:
            return False
        try:
            return run(self.docker, "info", "--format", "{{.ServerVersion}}", timeout=20, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def why_not(self) -> str | None:
        """Why no Docker engine can be had here (None when one answers or can be started)."""
        if not self.docker:
            return "no `docker` client on PATH (Debian: apt-get install docker.io; `make cluster-deps` does it)"
        if self.answers():
            return None
        if not shutil.which("dockerd"):
            return "no Docker engine answers and `dockerd` is not installed (apt-get install docker.io)"
        if os.geteuid() != 0:
            return "no Docker engine answers and starting `dockerd` needs root"
        return None

    def ensure(self, timeout: float = 90) -> None:
        if self.answers():
            return
        self.proc = spawn(["dockerd"], self.workdir / "logs" / "dockerd.log")
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dockerd exited ({self.proc.returncode}): "
                    f"{(self.workdir / 'logs' / 'dockerd.log').read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not answer within {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_group(self.proc, grace=20)
        self.proc = None
        # dockerd's own containerd (a child it normally stops itself) and its bridge
        subprocess.run(
            ["pkill", "-f", "containerd --config /var/run/docker/containerd/containerd.toml"], capture_output=True
        )
        subprocess.run(["ip", "link", "del", "docker0"], capture_output=True)


class HostGuard:
    """Snapshot of the host's iptables (v4 and v6) and links taken before the tier starts anything;
    `restore()` puts the tables back exactly, removes links and addresses the tier added, and
    stops what it registered."""

    def __init__(self) -> None:
        self.tables = {tool: self._save(tool) for tool in ("iptables", "ip6tables")}
        self.links = self._links()
        self.lo_addresses: list[str] = []
        self.cleanups: list = []  # callables, run last-in first-out

    @staticmethod
    def _save(tool: str) -> str | None:
        exe = shutil.which(f"{tool}-save")
        if not exe:
            return None
        proc = subprocess.run([exe], capture_output=True, text=True)
        return proc.stdout if proc.returncode == 0 else None

    @staticmethod
    def _links() -> set[str]:
        proc = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
        return {line.split(":")[1].strip().split("@")[0] for line in proc.stdout.splitlines() if ":" in line}

    def add_lo_address(self, cidr: str) -> None:
        have = subprocess.run(["ip", "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout
        if cidr not in have:
            run("ip", "addr", "add", cidr, "dev", "lo")
            self.lo_addresses.append(cidr)

    def restore(self) -> None:
        while self.cleanups:
            with contextlib.suppress(Exception):
                self.cleanups.pop()()
        for cidr in self.lo_addresses:
            subprocess.run(["ip", "addr", "del", cidr, "dev", "lo"], capture_output=True)
        self.lo_addresses = []
        for link in self._links() - self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for tool, saved in self.tables.items():
            if saved is None:
                continue
            # A restore flushes the tables it names and rebuilds them as saved; a table that was not
            # loaded then (often nat or mangle) is not in the dump: empty it by hand.
            subprocess.run([f"{tool}-restore"], input=saved, text=True, capture_output=True)
            present = {line[1:].strip() for line in saved.splitlines() if line.startswith("*")}
            for table in {"filter", "nat", "mangle", "raw"} - present:
                for flag in ("-F", "-X"):
                    subprocess.run([tool, "-t", table, flag], capture_output=True)
