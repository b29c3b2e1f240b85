"""What the suite's own kills leave in /dev/shm, removed when the run ends (issue 41).

A process killed with SIGKILL (the fault tests kill servers and engines on purpose) cannot remove its shared memory:
vLLM's `psm_*` segments, a rollout server's `rmsft-stage-*` staging files. /dev/shm is memory, so a day of test
runs would hold gigabytes. At the end of a whole run (the controller, after every worker), the files of those kinds made
since the run started that no live process holds (open or mapped) are removed; a file a process still holds (this
run's or another program's) stays."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
from suite_clock import _whole_run

SHM = Path("/dev/shm")
KINDS = ("psm_", "rmsft-stage-")


def held_paths() -> set[str]:
    """Every path a live process has open or mapped (what this user may read of /proc)."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    held.add(os.readlink(fd))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    held.add(parts[5].removesuffix(" (deleted)"))
    return held


def unheld_since(folder: Path, since: float, kinds: tuple[str, ...] = KINDS) -> list[Path]:
    """Files of `kinds` in `folder` changed at `since` or later that no live process holds."""
    held = held_paths()
    found = []
    with contextlib.suppress(OSError):
        for p in folder.iterdir():
            with contextlib.suppress(OSError):
                if p.name.startswith(kinds) and p.is_file() and p.stat().st_mtime >= since and str(p) not in held:
                    found.append(p)
    return sorted(found)


class ShmSweep:
    def __init__(self) -> None:
        self.since = time.time()
        self.removed: list[Path] = []

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # The controller sweeps once, at the end of a whole run (CI's `make test`): not an xdist worker, not a
        # selection or a collection (test_markers collects the suite from inside it).
        if (
            hasattr(session.config, "workerinput")
            or session.config.option.collectonly
            or not _whole_run(session.config)
        ):
            return
        for p in unheld_since(SHM, self.since):
            with contextlib.suppress(OSError):
                p.unlink()
                self.removed.append(p)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.removed:
            terminalreporter.write_line(
                f"removed {len(self.removed)} shared-memory file(s) in {SHM} that processes "
                "this run killed left (tests/shm_sweep.py)"
            )
