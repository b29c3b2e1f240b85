"""Writing a whole output folder (a model folder, an export) so that it is never seen half written.

`staged_folder(dst)` hands out a temporary sibling of `dst` to write into and renames it into place
only when the block ends without an error; on an error the temporary folder is removed and `dst`
is left as it was. A sibling, so the final rename stays on one filesystem (atomic). Torch-free.

Replacing an existing `dst` swaps the two folders in one atomic exchange (Linux's renameat2
RENAME_EXCHANGE) and only then removes the old one; where the filesystem cannot exchange, the old
folder is renamed aside first. What a killed writer leaves (an export is gigabytes) is dealt with by
the next write of the same folder: its temporary folder is removed, and a folder it had renamed aside
is put back when `dst` is missing (the previous complete folder, not the unfinished new one).
Leftovers are named `.<name>.tmp-<pid>-<hex>` and `.<name>.old-<pid>-<hex>`; a live writer's are kept.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from rmsft.run_dir import pid_alive


class OutputFolderError(RuntimeError):
    """The output folder cannot be written (exists and is not empty, not a folder, no permission, ...)."""


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_output_folder(dst: str | Path, *, overwrite: bool, flag: str = "--overwrite") -> None:
    """Refuse, before any work is done, an output path that is a file or a folder with files in it
    (unless `overwrite`: it is replaced once the new folder is complete)."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise OutputFolderError(f"{dst} exists and is not a folder")
    if dst.is_dir() and not overwrite and not is_empty_dir(dst):
        raise OutputFolderError(
            f"{dst} exists and is not empty; choose a new or empty folder, or pass {flag} to replace it"
        )


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (renameat2 RENAME_EXCHANGE). False where the kernel, the C library or the
    filesystem cannot (the caller then renames in two steps); another failure raises OSError."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _writer_alive(pid: int) -> bool:
    """The writer that named a leftover still runs. This process's own pid is a previous incarnation's (a
    restarted container often gets the same pid): this process has no write in progress when it sweeps."""
    return pid != os.getpid() and pid_alive(pid)


def sweep_leftovers(dst: str | Path) -> list[Path]:
    """Deal with what killed writers of `dst` left beside it (module doc); returns the paths removed or put back."""
    dst = Path(dst)
    parent = dst.absolute().parent
    if not parent.is_dir():
        return []
    pattern = re.compile(rf"^\.{re.escape(dst.name)}\.(tmp|old)-(\d+)-[0-9a-f]+$")
    found = sorted(
        (m.group(1), int(m.group(2)), p) for p in parent.iterdir() if (m := pattern.match(p.name)) is not None
    )
    done = []
    for kind, pid, path in found:
        if _writer_alive(pid):
            continue
        if kind == "old" and not dst.exists():
            path.rename(dst)  # the complete folder a killed replace had renamed aside
        else:
            shutil.rmtree(path, ignore_errors=True)
        done.append(path)
    return done


def _reason(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


@contextmanager
def staged_folder(dst: str | Path, *, overwrite: bool, flag: str = "--overwrite") -> Iterator[Path]:
    """Yield an empty temporary sibling of `dst`; on success it becomes `dst` (an existing `dst` is
    replaced when `overwrite`, else refused). On any error the temporary folder is removed."""
    dst = Path(dst)
    with suppress(OSError):
        sweep_leftovers(dst)
    check_output_folder(dst, overwrite=overwrite, flag=flag)
    parent = dst.absolute().parent
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = parent / f".{dst.name}.tmp-{tag}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise OutputFolderError(f"cannot write the output folder {dst}: {_reason(exc)}") from None
    try:
        yield tmp
        old = parent / f".{dst.name}.old-{tag}"
        try:
            if dst.exists():
                # Checked again here: something may have written into dst while we worked.
                check_output_folder(dst, overwrite=overwrite, flag=flag)
                if exchange(tmp, dst):  # one atomic step: dst is the new folder, tmp the old one
                    shutil.rmtree(tmp, ignore_errors=True)
                    return
                dst.rename(old)  # then the new folder goes in with one rename
            tmp.rename(dst)
        except OSError as exc:
            if old.exists() and not dst.exists():
                old.rename(dst)  # put the previous folder back
            raise OutputFolderError(f"cannot move the finished folder into place at {dst}: {_reason(exc)}") from None
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        with suppress(OSError):
            shutil.rmtree(tmp)
        raise
