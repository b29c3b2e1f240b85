"""Pause points: a fault-injection hook with which a test stops a run at an exact moment, not by sleeping and hoping.

A test arms it through the environment of the process it starts:

    RMSFT_TEST_PAUSE_AT=<point>[:<number>]   the point (one of POINTS); with a number, only that occurrence of it
    RMSFT_TEST_PAUSE_MARKER=<file>           written (the process id and the point) when the point is reached

The process writes the marker and then blocks at the point until a signal ends it: the test waits for the marker
and sends SIGINT, SIGTERM or SIGKILL at that moment. The points (the number, when given, is the one named):

- `generate:<weight version>`: the rollout client has sent the Generate calls of a batch and not taken their
  answers (learner.rollouts.client);
- `sync:<weight version>`: an update is going out to the servers: its first tensor is written into the shared
  file, the rest is not (learner.sync.client; transport shm, `rmsft local`'s: with transport grpc the tensors are
  produced on gRPC's thread, where the point raises);
- `checkpoint:<step>`: the step's checkpoint is written into its temporary folder, not yet renamed into place
  (learner.train.checkpoint_files).

A fault point raises instead of blocking (`fail_at`), so that a test makes one rank fail mid-run as a CUDA error or
EIO on the claim would:

    RMSFT_TEST_FAIL_AT=step:<n>[@<rank>]     building step <n>'s training segments (rollout matching) raises
                                            InjectedFault (an OSError, EIO) on learner rank <rank> (RANK; default
                                            every rank)

Unarmed (always outside tests), `pause_at` and `fail_at` cost one environment lookup. A pause point blocks on the
main thread, where Python runs signal handlers, so SIGINT's KeyboardInterrupt (and `rmsft local`'s SIGTERM) unwinds
the run from the point as it would from real work there; a point reached on another thread raises instead of
blocking where no signal could end it.
"""

from __future__ import annotations

import errno
import os
import threading
import time

PAUSE_AT_ENV = "RMSFT_TEST_PAUSE_AT"
MARKER_ENV = "RMSFT_TEST_PAUSE_MARKER"
POINTS = ("generate", "sync", "checkpoint")
FAIL_AT_ENV = "RMSFT_TEST_FAIL_AT"
FAULT_POINTS = ("step",)


class InjectedFault(OSError):
    """The failure RMSFT_TEST_FAIL_AT asked for: an OSError (EIO), a transient failure as rmsft.exit_codes reads it."""


class PausePointError(RuntimeError):
    """The pause-point variables are wrong, or an armed point was reached where it cannot block."""


def _arming() -> tuple[str, int | None] | None:
    """(point, number or None) from RMSFT_TEST_PAUSE_AT, None when it is unset."""
    raw = os.environ.get(PAUSE_AT_ENV, "")
    if not raw:
        return None
    name, _, number = raw.partition(":")
    if name not in POINTS or (number and not number.isdigit()):
        raise PausePointError(
            f"{PAUSE_AT_ENV}={raw!r}: expected one of {', '.join(POINTS)}, optionally followed "
            "by :<number> (e.g. sync:3); unset it outside tests"
        )
    return name, int(number) if number else None


def armed(point: str) -> bool:
    """Whether RMSFT_TEST_PAUSE_AT arms `point` (at some occurrence)."""
    arm = _arming()
    return arm is not None and arm[0] == point


def pause_at(point: str, number: int) -> None:
    """Block here for good (until a signal ends the process or raises on the main thread) when RMSFT_TEST_PAUSE_AT
    arms `point` with this `number` or with none; first write RMSFT_TEST_PAUSE_MARKER. Returns at once otherwise."""
    if point not in POINTS:
        raise ValueError(f"unknown pause point {point!r}; the points are {POINTS}")
    arm = _arming()
    if arm is None or arm[0] != point or arm[1] not in (None, number):
        return
    marker = os.environ.get(MARKER_ENV, "")
    if not marker:
        raise PausePointError(
            f"{PAUSE_AT_ENV} is set but {MARKER_ENV} is not: set it to the file to write when the point is reached"
        )
    if threading.current_thread() is not threading.main_thread():
        raise PausePointError(
            f"pause point {point}:{number} reached on thread {threading.current_thread().name}, "
            "where no signal can interrupt it (points block on the main thread only)"
        )
    tmp = f"{marker}.tmp"
    with open(tmp, "w") as f:  # renamed into place: a test polling for the marker never reads half of it
        f.write(f"{os.getpid()} {point}:{number}\n")
    os.replace(tmp, marker)
    while True:
        time.sleep(3600)  # a signal's handler runs here (and may raise); nothing else ends the wait


def fail_at(point: str, number: int) -> None:
    """Raise InjectedFault when RMSFT_TEST_FAIL_AT arms `point` with this `number` on this rank (module doc)."""
    if point not in FAULT_POINTS:
        raise ValueError(f"unknown fault point {point!r}; the points are {FAULT_POINTS}")
    raw = os.environ.get(FAIL_AT_ENV, "")
    if not raw:
        return
    where, _, rank = raw.partition("@")
    name, _, wanted = where.partition(":")
    if name not in FAULT_POINTS or not wanted.isdigit() or (rank and not rank.isdigit()):
        raise PausePointError(
            f"{FAIL_AT_ENV}={raw!r}: expected <point>:<number>[@<rank>] with a point of "
            f"{', '.join(FAULT_POINTS)} (e.g. step:3@1); unset it outside tests"
        )
    if name == point and int(wanted) == number and (not rank or rank == os.environ.get("RANK", "0")):
        raise InjectedFault(errno.EIO, f"injected fault at {point}:{number} ({FAIL_AT_ENV})")
