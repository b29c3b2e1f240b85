"""Processes rmsft starts die with the process that started them, whatever ends it (SIGINT, SIGTERM, SIGHUP,
SIGKILL, a crash).

Two mechanisms, because neither covers everything alone:

- **A lifeline pipe.** The starting process makes one pipe and keeps its write end; only it holds that end (it is
  not inherited across exec, and a child forked without exec closes its copy), so when the process ends, however
  it ends, the kernel closes it and every child reading the other end sees end-of-file. A child given the read end
  (`child_options`: `pass_fds` plus `RMSFT_LIFELINE_FD` in its environment) calls `watch_parent` early; a thread
  of its own then reacts within milliseconds (`rmsft serve`: a graceful stop, and its whole process group,
  engine processes included, killed if that takes longer than a grace period).
- **The parent-death signal** (Linux `prctl(PR_SET_PDEATHSIG)`), set in the child between fork and exec
  (`child_options`' `preexec_fn`) or by a process on itself (`die_with_parent`): the kernel signals the child when
  its parent ends, even if the child is too busy for its watcher thread. Linux sends it when the parent *thread*
  that forked the child ends, so it is only set for children started from the main thread, which lives as long
  as the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

ENV = "RMSFT_LIFELINE_FD"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = logging.getLogger("rmsft.lifeline")

_lock = threading.Lock()
_pipe: tuple[int, int] | None = None
_prctl: Callable[..., int] | None = None


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up before any fork: the child between fork and exec only calls it."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def _drop_write_end_in_child() -> None:
    # A child forked without exec (a DataLoader worker, a multiprocessing fork) must not keep the lifeline alive.
    global _pipe
    if _pipe is not None:
        with contextlib.suppress(OSError):
            os.close(_pipe[1])
        _pipe = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_write_end_in_child)


def _read_end() -> int:
    """This process's lifeline: the read end handed to children (the write end is held, never written)."""
    global _pipe
    with _lock:
        if _pipe is None:
            _pipe = os.pipe()  # both ends non-inheritable: a child gets the read end only through pass_fds
        return _pipe[0]


def child_options(death_signal: int = signal.SIGTERM) -> dict[str, Any]:
    """`subprocess.Popen` keyword arguments that tie a child to this process: `pass_fds` (the lifeline's read end),
    `env_update` (to merge into the child's environment; not a Popen argument) and, when called on the main thread
    of a Linux process, a `preexec_fn` setting `death_signal` as the child's parent-death signal."""
    fd = _read_end()
    opts: dict[str, Any] = {"pass_fds": (fd,), "env_update": {ENV: str(fd)}}
    prctl = _load_prctl()
    if prctl is not None and threading.current_thread() is threading.main_thread():
        parent = os.getpid()

        def set_death_signal() -> None:  # between fork and exec: nothing but the system call
            prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
            if os.getppid() != parent:  # the parent ended before the call: the signal would never come
                os.kill(os.getpid(), int(death_signal))

        opts["preexec_fn"] = set_death_signal
    return opts


def popen_options(env: dict[str, str] | None, death_signal: int = signal.SIGTERM) -> dict[str, Any]:
    """`child_options` as Popen arguments: `env` (default: this process's environment) with the lifeline added."""
    opts = child_options(death_signal)
    opts["env"] = {**(os.environ if env is None else env), **opts.pop("env_update")}
    return opts


def die_with_parent(death_signal: int = signal.SIGTERM) -> bool:
    """This process gets `death_signal` when its parent ends (Linux; False elsewhere). For processes whose start
    rmsft does not control, e.g. torchrun's ranks. A parent already gone gets the signal sent now."""
    prctl = _load_prctl()
    if prctl is None:
        return False
    parent = os.getppid()
    if prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), int(death_signal))
    return True


def watch_parent(on_lost: Callable[[], None]) -> bool:
    """In a child started with `child_options`: call `on_lost()` on a thread of its own as soon as the process that
    started it has ended. False (nothing watched) when this process was given no lifeline. The variable is taken
    out of the environment, so that this process's own children do not look for a descriptor they lack."""
    raw = os.environ.pop(ENV, "")
    if not raw:
        return False
    try:
        fd = int(raw)
        os.fstat(fd)
    except (ValueError, OSError):
        log.warning("%s=%r is not an open descriptor: not watching the parent process", ENV, raw)
        return False

    def watch() -> None:
        while True:
            try:
                data = os.read(fd, 1)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:  # end-of-file: every write end is closed, the parent is gone
                break
        on_lost()

    threading.Thread(target=watch, name="rmsft-lifeline", daemon=True).start()
    return True


def kill_own_group_later(grace_s: float) -> threading.Timer:
    """SIGKILL this process's whole process group after `grace_s` (only when this process leads it, as
    `rmsft serve` started by `rmsft local` does: its own session, its engine processes in it); a clean exit before
    then ends the timer with the process."""

    def kill() -> None:
        pgid = os.getpgrp()
        if pgid == os.getpid():
            os.killpg(pgid, signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    timer = threading.Timer(grace_s, kill)
    timer.daemon = True
    timer.start()
    return timer
