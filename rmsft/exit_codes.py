"""What `rmsft train`'s exit code says, as the learner Job's podFailurePolicy reads it (operator/rmsft_operator/
render.py), and the verdict of several ranks under torchrun (`rmsft torchrun`).

- 0: the run finished.
- CONFIG_EXIT (2): a refused configuration (the spec, a model that does not fit training.format, a checkpoint of
  another job): the same spec fails the same way, so the Job fails at once, without a retry that reloads the model.
- RETRY_EXIT (75, EX_TEMPFAIL): a failure a retry may not meet again (a CUDA error, EIO on the claim, the process
  group's rendezvous, every rollout server gone longer than spec.rollout.recoveryTimeout, another learner still
  holding the checkpoint folder): counted against spec.learner.backoffLimit, and the retry resumes.
- STOPPED_EXIT (143, 128 + SIGTERM): stopped by SIGTERM (an eviction, a drain, a preemption) after the step in
  progress, its checkpoint written; the retry resumes from it.

An exception class says which it is with a class attribute `exit_code`; without one, a ValueError is a value the spec
gave (refused) and anything else is retryable. Torch-free: the operator imports it."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path

CONFIG_EXIT = 2
RETRY_EXIT = 75
STOPPED_EXIT = 143

# `rmsft torchrun` names a folder here; every rank's `rmsft` process writes its exit code into it (rank-<RANK>) as
# it ends, and the wrapper returns their verdict rather than torchrun's own 1.
EXIT_DIR_ENV = "RMSFT_RANK_EXIT_DIR"


# An OSError with one of these behind a refusal (a model folder that cannot be read, say) is the storage failing,
# not the spec: EIO, a stale or timed-out network mount. A retry may read it.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.ENOMEM})


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a learner that ends with `exc` (module doc)."""
    code = getattr(exc, "exit_code", None)
    if not isinstance(code, int):
        code = CONFIG_EXIT if isinstance(exc, ValueError) else RETRY_EXIT
    cause = exc.__cause__
    if code == CONFIG_EXIT and isinstance(cause, OSError) and cause.errno in TRANSIENT_ERRNOS:
        return RETRY_EXIT
    return code


def verdict(codes: Mapping[int, int], launcher_code: int) -> int:
    """One exit code for a container of several ranks: `codes` are the ranks' own (rank -> code; a rank killed
    before it could say is missing), `launcher_code` torchrun's. A refusal anywhere is the job's refusal; else the
    first failure that is not a stop (torchrun SIGTERMs the survivors of a failed rank, who may then exit 143:
    the failure is the cause, not their stop); else a stop; else torchrun's own code (0 when every rank finished,
    or its 1 when ranks died without saying why: retryable)."""
    ranked = [codes[r] for r in sorted(codes)]
    if CONFIG_EXIT in ranked:
        return CONFIG_EXIT
    failed = [c for c in ranked if c not in (0, STOPPED_EXIT)]
    if failed:
        return failed[0]
    if STOPPED_EXIT in ranked:
        return STOPPED_EXIT
    if launcher_code < 0:  # torchrun itself killed by a signal (Popen's -N)
        return 128 - launcher_code
    return launcher_code


def record_rank_exit(code: int) -> None:
    """Under `rmsft torchrun`: leave this rank's exit code where the wrapper reads it (nothing otherwise)."""
    folder = os.environ.get(EXIT_DIR_ENV, "")
    if not folder:
        return
    rank = os.environ.get("RANK", "0")
    path = Path(folder) / f"rank-{rank}"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{code}\n")
        os.replace(tmp, path)  # whole or absent: the wrapper never reads half a number
    except OSError:
        pass  # the wrapper then falls back to torchrun's code; the exit itself must not fail


def read_rank_exits(folder: str | Path) -> dict[int, int]:
    """rank -> exit code of every rank that recorded one in `folder`."""
    out: dict[int, int] = {}
    for path in Path(folder).glob("rank-*"):
        rank = path.name.removeprefix("rank-")
        if not rank.isdigit() or path.suffix:
            continue
        try:
            out[int(rank)] = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
    return out
