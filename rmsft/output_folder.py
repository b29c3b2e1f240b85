"""Writing a whole output folder (a model folder, an export) so that it is never seen half written.

`staged_folder(dst)` hands out a temporary sibling of `dst` to write into and renames it into place
only when the block ends without an error; on an error the temporary folder is removed and `dst`
is left as it was. A sibling, so the final rename stays on one filesystem (atomic). Torch-free.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


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


def _reason(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


@contextmanager
def staged_folder(dst: str | Path, *, overwrite: bool, flag: str = "--overwrite") -> Iterator[Path]:
    """Yield an empty temporary sibling of `dst`; on success it becomes `dst` (an existing `dst` is
    replaced when `overwrite`, else refused). On any error the temporary folder is removed."""
    dst = Path(dst)
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
