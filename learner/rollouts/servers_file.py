"""The rollout server list as a file that may change during a run: the operator's ConfigMap key
`servers`, mounted in the learner pod at /etc/rmsft/servers and rewritten when the pool is scaled.
`learner.rollouts.pool.ServerPool` follows it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("rmsft.learner.servers")


class ServersFileError(ValueError):
    """The rollout server list file is missing, unreadable, empty or malformed; the message names it."""


def parse_server_list(text: str, source: str) -> list[str]:
    """`host:port` entries in order: one per line (commas separate too), blank lines and `#`
    comments skipped. Raises ServersFileError naming `source`, the line and the bad entry."""
    out: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for item in line.split("#", 1)[0].split(","):
            address = item.strip()
            if not address:
                continue
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ServersFileError(f"{source}:{lineno}: {address!r} is not host:port")
            out.append(address)
    dupes = sorted({a for a in out if out.count(a) > 1})
    if dupes:
        raise ServersFileError(f"{source}: rollout server addresses must be unique, repeated: {dupes}")
    return out


class ServersFile:
    """The ordered rollout server list in a file that may change during the run: the operator's
    ConfigMap key `servers` mounted at /etc/rmsft/servers (StatefulSet ordinal order, rewritten when
    the pool is scaled; the kubelet swaps the mounted file atomically within about a minute).

    `read()` parses it now. `poll()` returns the new list only when the file changed since the last
    read; when it did not, the cost is one `os.stat`, so it can run before every rollout phase.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, ...] | None = None
        self._addresses: list[str] | None = None
        self._problem = ""  # last problem logged by poll(), so a lasting one is logged once

    def _stat(self) -> tuple[int, ...]:
        # stat follows the `..data` symlink the kubelet swaps, so a ConfigMap update changes inode
        # and mtime even when the new content has the same size.
        st = os.stat(self.path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def read(self, *, allow_empty: bool = False) -> list[str]:
        """The addresses in the file, in order. ServersFileError when it is missing, unreadable,
        malformed, or (unless `allow_empty`) lists no server."""
        try:
            stamp = self._stat()  # before reading: a change in between is seen by the next poll
            text = self.path.read_text()
        except FileNotFoundError:
            raise ServersFileError(f"rollout server list {self.path} does not exist") from None
        except OSError as e:
            raise ServersFileError(f"cannot read rollout server list {self.path}: {e.strerror or e}") from None
        addresses = parse_server_list(text, str(self.path))
        if not addresses and not allow_empty:
            raise ServersFileError(f"rollout server list {self.path} is empty (expected one host:port per line)")
        self._stamp, self._addresses = stamp, addresses
        return list(addresses)

    def poll(self) -> list[str] | None:
        """The new list when the file's content changed since the last read (an empty list when the
        pool was scaled to zero), else None. A file that is missing or malformed (mid-rewrite, or
        edited by hand) is not a change: the current list stays and a warning is logged."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            before = self._addresses
            addresses = self.read(allow_empty=True)
        except (OSError, ServersFileError) as e:
            problem = f"{e}; keeping the current rollout servers"
            if problem != self._problem:
                log.warning("%s", problem)
                self._problem = problem
            return None
        self._problem = ""
        return None if addresses == before else addresses
