"""A run's files in shared memory, owned by the process that made them, so that a dead run's are found and removed.

`rmsft local` keeps everything its run puts in /dev/shm (the shared-weights directory of transport shm, each
server's staging directory) in one directory, `rmsft-run-<owner pid>-<random>`, with a lock file in it that the
owner holds (`flock`) for as long as it lives. Whatever ends the owner (SIGKILL included) releases the lock, so:

- a directory whose lock can be taken belongs to a dead run: `remove_stale` removes it (the next `rmsft local`
  does, and `rmsft local --clean`);
- a directory whose lock is held belongs to a live run and is never touched; so is one that has no lock file yet
  (being made) while the process named in it lives.

The lock, not the pid, decides: a pid can be reused, a lock is released exactly when its last holder ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PREFIX = "rmsft-run-"
LOCK_NAME = ".owner.lock"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


def shm_base() -> str:
    """Where run directories go: /dev/shm when this machine has a writable one, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass
class RunDir:
    """A run directory held by this process (`close` removes it and releases the lock)."""

    path: Path
    _lock_fd: int

    def sub(self, name: str) -> Path:
        """A directory of the run's, made on first use."""
        p = self.path / name
        p.mkdir(exist_ok=True)
        return p

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)  # released only once the files are gone


def create(base: str | Path | None = None) -> RunDir:
    """A new run directory under `base` (default `shm_base()`), locked by this process."""
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=str(base or shm_base())))
    # Locked under another name, then renamed: a cleaner never finds the lock file unlocked while this process
    # lives (it would take it for a dead run's). Not inherited by exec'd children.
    tmp = path / f"{LOCK_NAME}.new"
    fd = os.open(tmp, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp, path / LOCK_NAME)
    return RunDir(path, fd)


@contextlib.contextmanager
def owned(base: str | Path | None = None) -> Iterator[RunDir]:
    run = create(base)
    try:
        yield run
    finally:
        run.close()


def pid_alive(pid: int) -> bool:
    """A process `pid` exists (another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _take_if_dead(path: Path) -> int | None:
    """The run directory's lock, taken (an fd to close), when its owner is dead; None while it may live."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        # No lock file: being made by a live owner, or left by one that died in between.
        if pid_alive(int(m.group(1))):
            return None
        try:
            fd = os.open(path, os.O_RDONLY)  # a lock on the directory itself, against a second cleaner
        except OSError:
            return None
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def stale(base: str | Path | None = None) -> list[Path]:
    """Run directories under `base` whose owner is dead (nothing is taken or removed)."""
    out = []
    for path in sorted(Path(base or shm_base()).glob(f"{PREFIX}*")):
        fd = _take_if_dead(path)
        if fd is not None:
            os.close(fd)
            out.append(path)
    return out


def remove_stale(base: str | Path | None = None) -> list[Path]:
    """Remove the run directories under `base` whose owner is dead; returns them. A live run's are never touched:
    each is removed while this process holds its lock, which a live owner would hold."""
    removed = []
    for path in sorted(Path(base or shm_base()).glob(f"{PREFIX}*")):
        fd = _take_if_dead(path)
        if fd is None:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        if not path.exists():
            removed.append(path)
    return removed


def live(base: str | Path | None = None) -> list[Path]:
    """Run directories under `base` that belong to a live run (or one being made)."""
    dead = set(stale(base))
    return [p for p in sorted(Path(base or shm_base()).glob(f"{PREFIX}*")) if _NAME.match(p.name) and p not in dead]
