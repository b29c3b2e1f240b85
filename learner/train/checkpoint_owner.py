"""Whose a checkpoint folder is: the lineage each checkpoint records, and the one learner that writes the folder.

**Lineage.** Every checkpoint carries `lineage.json`: the job's name and the settings a resume must not change
(`LINEAGE_FIELDS`: the model, the objective, the data, the answer format, what is trained, the seed and the
batch), with a digest of them. A resume reads the newest checkpoint's lineage first and refuses one written by
another job or with other settings, naming what differs (`check_resumable`): continuing it would train that run's
weights, optimizer and data position under this job's settings, and its pruning would delete the other run's
checkpoints. `spec.training.checkpoint.resume_any` asks for it anyway. Settings outside the digest (steps, the
learning rate, evaluation, logging, checkpoint cadence) may change across a resume. Pruning deletes only
checkpoints of the writer's own lineage (`checkpoint_files.save_checkpoint`).

**One writer.** Rank 0 holds a POSIX lock on `<dir>/.writer.lock` for as long as its run lives (`WriterLock`), and
writes who holds it (host, pid, run id, job, since) into the file. A second learner on the same folder (a
replacement pod beside a dying one that still saves, a second job given the same claim, two `rmsft local` runs)
waits for the lock up to `wait_s` and then stops with `CheckpointFolderBusyError`, naming the holder. The kernel
releases the lock whatever ends the holder (SIGKILL included); POSIX locks (`fcntl.lockf`) rather than `flock`,
because NFS-backed claims honour them across nodes. POSIX locks belong to the process, so a second hold in the
same process (a test's second loop) shares the first one's instead of releasing it on close.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from rmsft.exit_codes import CONFIG_EXIT, RETRY_EXIT
from rmsft.jobspec import RolloutMatchingJob

LINEAGE_FILE = "lineage.json"
WRITER_LOCK = ".writer.lock"
# Settings a resume must keep (dotted paths into the manifest's spec): changing one makes another run.
LINEAGE_FIELDS = (
    "model.path",
    "trainer",
    "training.data.path",
    "training.data.image_root",
    "training.format",
    "training.finetune",
    "training.lora",
    "training.freeze",
    "training.seed",
    "training.prompts_per_step",
)
PATH_LINEAGE_FIELDS = ("model.path", "training.data.path", "training.data.image_root")
# How long a learner waits for the folder's previous writer (e.g. a pod still saving inside its grace period);
# RMSFT_CHECKPOINT_WRITER_WAIT_S sets another.
WRITER_WAIT_S = 300.0


class CheckpointLineageError(RuntimeError):
    """The newest checkpoint belongs to another run (another job, or settings a resume must not change)."""

    exit_code = CONFIG_EXIT  # the same spec meets the same checkpoint: no retry helps


# fcntl.lockf's errors that say the filesystem has no POSIX locks (NFS mounted `nolock` or without its lock
# service, some FUSE and object-store mounts), not that another process holds the lock (EAGAIN / EACCES).
NO_LOCKS_ERRNOS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


class CheckpointFolderLockError(RuntimeError):
    """The checkpoint folder's filesystem has no POSIX locks: the one-writer guarantee cannot be given there."""

    exit_code = CONFIG_EXIT  # the volume the spec names: a retry mounts the same one


class CheckpointFolderBusyError(RuntimeError):
    """Another learner holds the checkpoint folder (its writer lock)."""

    exit_code = RETRY_EXIT  # the holder ends (a pod still saving in its grace period): the retry gets the folder


def _pick(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def lineage_of(job: RolloutMatchingJob) -> dict[str, Any]:
    """This job's lineage: {"job", "fields", "digest"} (module doc)."""
    manifest = job.to_manifest()
    meta = manifest.get("metadata") or {}
    name = f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta.get("name"))
    fields = {f: _pick(manifest.get("spec") or {}, f) for f in LINEAGE_FIELDS}
    blob = json.dumps({"job": name, "fields": fields}, sort_keys=True, default=str).encode()
    return {"job": name, "fields": fields, "digest": hashlib.sha256(blob).hexdigest()[:16]}


def read_lineage(checkpoint: Path) -> dict[str, Any] | None:
    """The lineage a checkpoint folder records; None for one written before checkpoints recorded it."""
    try:
        return json.loads((checkpoint / LINEAGE_FILE).read_text())
    except (OSError, ValueError):
        return None


def check_resumable(checkpoint: Path, mine: dict[str, Any], *, resume_any: bool) -> str | None:
    """Raise CheckpointLineageError when `checkpoint` belongs to another lineage than `mine` (unless `resume_any`);
    returns a warning to log when it cannot be told (no lineage recorded) or is resumed anyway, else None."""
    saved = read_lineage(checkpoint)
    if saved is None:
        return (
            f"checkpoint {checkpoint} records no lineage (written by an older rmsft): resumed without checking "
            "that this job wrote it"
        )
    if saved.get("digest") == mine["digest"]:
        return None
    diffs = []
    if saved.get("job") != mine["job"]:
        diffs.append(f"job {saved.get('job')!r} (this one: {mine['job']!r})")
    theirs = dict(saved.get("fields") or {})
    # An rmsft before job files' paths were read against their folder recorded them as written (relative, read
    # from the working directory): the same folder as this job's absolute path is no other lineage.
    for f in PATH_LINEAGE_FIELDS:
        value, own = theirs.get(f), mine["fields"].get(f)
        if (
            isinstance(value, str)
            and isinstance(own, str)
            and not os.path.isabs(value)
            and os.path.abspath(value) == own
        ):
            theirs[f] = own
    if not diffs and all(theirs.get(f) == mine["fields"].get(f) for f in LINEAGE_FIELDS):
        return None
    diffs += [
        f"spec.{f} {theirs.get(f)!r} (this job: {mine['fields'].get(f)!r})"
        for f in LINEAGE_FIELDS
        if theirs.get(f) != mine["fields"].get(f)
    ]
    what = "; ".join(diffs) or f"lineage {saved.get('digest')} (this job: {mine['digest']})"
    if resume_any:
        return f"checkpoint {checkpoint} belongs to another run ({what}): resumed anyway (checkpoint.resume_any)"
    raise CheckpointLineageError(
        f"checkpoint {checkpoint} belongs to another run: {what}. Resuming it would continue that run's weights, "
        "optimizer and data position under this job's settings. Give this job its own spec.training.checkpoint.dir, "
        "start it fresh (`--no-resume`: the folder's checkpoints are moved to earlier-runs/), or set "
        "spec.training.checkpoint.resume_any: true to continue it anyway"
    )


class WriterLock:
    """The writer lock of one checkpoint folder, held by this process (module doc). `release()` when the run ends."""

    _held: dict[str, tuple[int, int]] = {}  # folder -> (fd, holds) in this process

    def __init__(
        self,
        root: str | Path,
        *,
        run_id: str,
        job: str,
        wait_s: float | None = None,
        poll_s: float = 1.0,
        on_wait: Any = None,
    ) -> None:
        if wait_s is None:
            wait_s = float(os.environ.get("RMSFT_CHECKPOINT_WRITER_WAIT_S") or WRITER_WAIT_S)
        self._holding = False
        self.path = Path(root) / WRITER_LOCK
        self.key = str(self.path.resolve())
        if self.key in WriterLock._held:
            fd, holds = WriterLock._held[self.key]
            WriterLock._held[self.key] = (fd, holds + 1)
            self._holding = True
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in NO_LOCKS_ERRNOS:  # not another holder: this filesystem cannot lock at all
                    os.close(fd)
                    raise CheckpointFolderLockError(
                        f"the checkpoint folder {root} is on a filesystem with no POSIX locks ({exc.strerror}, "
                        f"{errno.errorcode.get(exc.errno, exc.errno)} from fcntl.lockf on {self.path}): the learner "
                        "cannot make sure it is the folder's only writer. Mount the claim with locks (NFS: not "
                        "`nolock`, with the lock service reachable; a FUSE or object-store mount: one that "
                        "supports them) or give spec.learner.checkpointClaim a volume that does, e.g. a "
                        "ReadWriteOnce block volume"
                    ) from None
                if time.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise CheckpointFolderBusyError(
                        f"the checkpoint folder {root} is held by another learner ({holder}) after waiting "
                        f"{wait_s:.0f} s: two learners writing one folder would mix their checkpoints. Stop the other "
                        "one, or give this job its own spec.training.checkpoint.dir"
                    ) from None
                if not told and on_wait is not None:
                    on_wait(
                        f"the checkpoint folder {root} is held by another learner ({_read_holder(fd)}); waiting "
                        f"up to {wait_s:.0f} s for it to finish"
                    )
                    told = True
                time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))  # never past the deadline
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "run_id": run_id,
                    "job": job,
                    "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            ).encode(),
            0,
        )
        WriterLock._held[self.key] = (fd, 1)
        self._holding = True

    def release(self) -> None:
        if not self._holding or self.key not in WriterLock._held:
            return
        self._holding = False
        fd, holds = WriterLock._held[self.key]
        if holds > 1:
            WriterLock._held[self.key] = (fd, holds - 1)
            return
        del WriterLock._held[self.key]
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # the holder's record goes with the hold
        os.close(fd)  # releases the lock

    close = release  # a part the training loop closes with the rest


def _read_holder(fd: int) -> str:
    try:
        rec = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        rec = {}
    if not rec:
        return "holder not recorded"
    return (
        f"host {rec.get('host')}, pid {rec.get('pid')}, run {rec.get('run_id')}, job {rec.get('job')}, "
        f"since {rec.get('since')}"
    )
