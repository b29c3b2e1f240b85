"""Startup checks of `rmsft serve`: fail in seconds, before the engine loads, what would otherwise
fail at the first weight sync, after the whole pool started and the learner paid for a step.

Staging space. A FULL update is received into one file in the staging dir (`/dev/shm` in pods,
`--staging-dir`), and after it was applied that file stays as the rollback copy (on by default,
`--keep-rollback-copy`) until the next FULL update has been applied (rollout_svc/staging.py,
`RolloutServicer._apply_full`). So from the second FULL update on, the staging dir holds the update
being received plus the previous one: twice the model's weight bytes. The bytes are the checkpoint's
tensors in the dtype the engine serves in: a FULL stream is accepted only with every floating tensor
in the serving dtype and every other tensor in its checkpoint dtype (the rule: rmsft/serving_dtype.py).

Transport shm (a shared-weights dir is set): the servers stage nothing of their own; the shared
dir holds the update being written and the previous one (`check_shared_dir`).

FULL updates are always accepted today; a server that ever refuses them (adapter-only) would not
need this check.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

from rmsft.serving_dtype import safetensors_headers, served_spec, serving_dtype_name
from rmsft.weight_wire import DTYPE_SIZES, TensorSpec

log = logging.getLogger("rollout_svc.preflight")

GIB = 1 << 30
# Kubernetes shows this file's content in the container's terminated state (the operator reads it
# into the job's conditions); outside a pod it does not exist and nothing is written.
TERMINATION_LOG = "/dev/termination-log"
SHM = "/dev/shm"


def weight_bytes(model_dir: str | Path, dtype: str | None = None) -> int | None:
    """Bytes of every tensor in the model folder's *.safetensors files as a FULL update carries them
    to an engine started with `--dtype dtype` (None: as stored), from the headers alone; None when
    there is no safetensors file (the engine reports that)."""
    headers = safetensors_headers(model_dir)
    if not headers:
        return None
    serve = None if dtype is None else serving_dtype_name(dtype, model_dir)
    total = 0
    for f, header in headers:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            kind = info.get("dtype")
            if kind not in DTYPE_SIZES:
                raise ValueError(f"{f}: tensor {name!r} has dtype {kind!r}, which rmsft cannot stream")
            total += served_spec(TensorSpec(kind, tuple(int(d) for d in info.get("shape", ()))), serve).nbytes
    return total


def staging_copies(keep_rollback_copy: bool) -> int:
    """How many model-sized copies the staging dir holds at most (see the module docstring)."""
    return 2 if keep_rollback_copy else 1


def staging_problem(weight_bytes: int, fs_bytes: int, staging_dir: str, *, copies: int = 2) -> str | None:
    """The message when `copies` x `weight_bytes` do not fit a staging filesystem of `fs_bytes`,
    else None. Pure, for the tests."""
    need = copies * weight_bytes
    if need <= fs_bytes:
        return None
    what = "the update + a rollback copy" if copies == 2 else "the update"
    message = (
        f"staging dir {staging_dir} has {fs_bytes / GIB:.1f} GiB; a FULL weight sync of this model needs about "
        f"{need / GIB:.1f} GiB ({what}): raise spec.rollout.shmSize to at least {max(1, math.ceil(need / GIB))}Gi"
    )
    if os.path.normpath(staging_dir) != SHM:  # outside a pod the spec key alone would not help
        message += " (or point --staging-dir at a bigger filesystem)"
    return message


def filesystem_bytes(path: str, statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> int:
    """Total size of the filesystem holding `path` (a memory emptyDir: its sizeLimit)."""
    st = statvfs(path)
    return st.f_blocks * st.f_frsize


def _weight_bytes_or_problem(model_dir: str, dtype: str | None) -> int | str | None:
    """The FULL update's bytes; else the problem reading them, or None (no safetensors: nothing to check)."""
    try:
        return weight_bytes(model_dir, dtype)
    except (OSError, ValueError) as e:
        return f"cannot read the weights' sizes in {model_dir}: {e}"


def check_staging(
    model_dir: str,
    staging_dir: str,
    keep_rollback_copy: bool = True,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    dtype: str | None = None,
) -> str | None:
    """What keeps FULL updates of `model_dir`, in the serving dtype `dtype` (`--dtype`; None = the
    tensors as stored, which is what a caller that does not know the dtype gets), from being staged
    in `staging_dir`, or None."""
    if not os.path.isdir(staging_dir):
        return f"staging dir {staging_dir} does not exist (--staging-dir)"
    if not os.access(staging_dir, os.W_OK | os.X_OK):
        return f"staging dir {staging_dir} is not writable by this user (--staging-dir)"
    wb = _weight_bytes_or_problem(model_dir, dtype)
    if not isinstance(wb, int):
        return wb
    size = filesystem_bytes(staging_dir, statvfs)
    copies = staging_copies(keep_rollback_copy)
    log.debug("staging preflight: %d weight bytes x %d copies, %s holds %d bytes", wb, copies, staging_dir, size)
    return staging_problem(wb, size, staging_dir, copies=copies)


def check_shared_dir(
    model_dir: str,
    shared_dir: str,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    dtype: str | None = None,
) -> str | None:
    """Transport shm: what keeps FULL updates of `model_dir` from passing through `shared_dir`, or
    None. The servers stage nothing of their own then; the shared filesystem holds the update the
    learner is writing plus the previous one, which the servers keep open as their rollback copy."""
    if not os.path.isdir(shared_dir) or not os.access(shared_dir, os.R_OK | os.X_OK):
        return (
            f"shared-weights dir {shared_dir} does not exist or is not readable (--shared-weights-dir / "
            "RMSFT_SHARED_WEIGHTS_DIR)"
        )
    wb = _weight_bytes_or_problem(model_dir, dtype)
    if not isinstance(wb, int):
        return wb
    size = filesystem_bytes(shared_dir, statvfs)
    if 2 * wb <= size:
        return None
    return (
        f"shared-weights dir {shared_dir} has {size / GIB:.1f} GiB; transport shm needs about "
        f"{2 * wb / GIB:.1f} GiB there (the update being written + the previous one, which the servers keep "
        "as their rollback copy): give the node more shared memory or use spec.sync.transport: grpc"
    )


def write_termination_log(message: str, path: str = TERMINATION_LOG) -> bool:
    """Write `message` where Kubernetes reads a container's termination message; False (nothing
    written, nothing created) outside a pod or when the file is not writable."""
    if not os.path.isfile(path) or not os.access(path, os.W_OK):
        return False
    try:
        with open(path, "w") as f:
            f.write(message + "\n")
    except OSError:
        return False
    return True
