"""Checkpoints: trainable weights, optimizer, data position, RNG, packer carry buffer, step, version.

A checkpoint is a folder `step-<n>` holding `state.pt` (rank 0's: the trainable weights, the plain optimizer, step,
version, the run's record) and one `rank-<r>.pt` per learner rank (that rank's own state: its packer carry buffer,
RNG, objective parts and, under DeepSpeed ZeRO, its optimizer partition; `rank_part`). Each rank writes and reads
only its own part, so no rank ever holds another rank's partition (host memory per rank: its part, not ranks x the
checkpoint). The folder is written under a temporary name (`.tmp-step-<n>`): rank 0 makes it (`begin_save`), every
rank writes its part into it (`write_part`), and only once every rank's part is on disk (the ranks agree after their
writes) does rank 0 write `state.pt` and rename the folder into place (`finish_save`). So a run stopped mid-save (any
signal, SIGKILL included, or a crash, on any rank) never leaves a half checkpoint that a resume would pick up: the
newest complete one is taken. A save interrupted by an exception (SIGINT, `rmsft local`'s SIGTERM, a rank whose
write failed) removes its temporary folder; one left by a killed process is ignored, and removed by the next save.
A folder named like a checkpoint but without its `state.pt` is not one.

Saving a step that is already there (a run resumed at its final step saves it again) swaps the new folder in with
one atomic exchange (Linux's renameat2 RENAME_EXCHANGE) and only then removes the old copy. Where the filesystem
cannot exchange, the old copy is renamed aside (`.old-step-<n>`) before the new one goes in: a process killed between
those two renames leaves the old copy complete under that name, and it is taken as the checkpoint of its step
(`list_checkpoints`) and put back by the next save, never deleted for being a leftover.

Each checkpoint records its run's lineage (`lineage.json`, learner/train/checkpoint_owner.py): pruning deletes only
checkpoints of the saving run's lineage, and a resume refuses another lineage's.

A fresh run (not resumed) in a folder that holds checkpoints moves them into
`earlier-runs/<time>-before-run-<run id>/` first (`set_aside_earlier`; the new run's id names the folder): pruning
keeps the highest step numbers in the folder, so beside an earlier run's checkpoints a new run would delete each of
its own right after writing it, and a later `--resume` would continue the other run. `earlier-runs/` keeps the
newest EARLIER_RUNS_KEPT of those folders (`prune_earlier_runs`), so a job started fresh again and again does not
fill its claim.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from learner.train.checkpoint_owner import LINEAGE_FILE, read_lineage
from rmsft import pause_points
from rmsft.output_folder import exchange as _exchange

log = logging.getLogger("rmsft.learner")

_PREFIX = "step-"
_STATE = "state.pt"
_RANK_PART = "rank-{}.pt"
_TMP = ".tmp-"  # a save in progress, or one a killed process left
_OLD = ".old-"  # a checkpoint being replaced by a save of the same step


class CheckpointDirError(RuntimeError):
    """training.checkpoint.dir cannot be written; the message names the path and what to change."""

    exit_code = 2  # rmsft.exit_codes.CONFIG_EXIT: a refused configuration (a transient errno cause: retried)


def check_checkpoint_dir(root: str | Path) -> None:
    """Create `root` when needed and write + remove a probe file in it, so an unwritable folder (a
    path the non-root learner cannot create, a read-only mount) fails the job at start instead of at
    the final save, after all the training was paid for."""
    root = Path(root)
    probe = root / f".rmsft-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"rmsft")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        raise CheckpointDirError(
            f"the checkpoint folder {root} (spec.training.checkpoint.dir) is not writable: "
            f"{e.strerror or e}{f' ({e.filename})' if e.filename and str(e.filename) != str(root) else ''}; "
            "give the learner a writable volume there (spec.learner.checkpointClaim: a PersistentVolumeClaim "
            "mounted at that path) or point spec.training.checkpoint.dir at a writable path"
        ) from e


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only what training changes (LoRA weights, or everything in full fine-tuning)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in names}


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path, prefix: str) -> int | None:
    rest = path.name[len(prefix) :] if path.name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def _restore_set_aside(root: Path) -> None:
    """Put back a checkpoint a killed re-save had renamed aside (`.old-step-<n>`) when no complete `step-<n>` took
    its place; remove it when one did."""
    for old in root.glob(f"{_OLD}{_PREFIX}*"):
        step = _step_of(old, f"{_OLD}{_PREFIX}")
        final = root / f"{_PREFIX}{step}"
        if step is None or (final / _STATE).is_file() or not (old / _STATE).is_file():
            shutil.rmtree(old, ignore_errors=True)
            continue
        shutil.rmtree(final, ignore_errors=True)  # a `step-<n>` without its state file is not a checkpoint
        old.rename(final)


def rank_part(folder: str | Path, rank: int) -> Path:
    """Learner rank `rank`'s own part of the checkpoint in `folder` (module doc)."""
    return Path(folder) / _RANK_PART.format(rank)


def begin_save(root: str | Path, step: int) -> Path:
    """Rank 0: the empty temporary folder the checkpoint of `step` is written into (what killed saves left is
    removed first, a set-aside copy put back). Returns it; `finish_save` puts it in place."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for left in root.glob(f"{_TMP}{_PREFIX}*"):  # what killed saves left
        shutil.rmtree(left, ignore_errors=True)
    _restore_set_aside(root)
    tmp = root / f"{_TMP}{_PREFIX}{step}"
    tmp.mkdir()
    return tmp


def write_part(path: Path, obj: Any) -> None:
    """Write `obj` to `path` and flush it to disk: on disk before the folder's name says "complete" (after a power
    loss a renamed folder must not hold an empty file)."""
    torch.save(obj, path)
    _fsync_path(path)


def finish_save(
    root: str | Path, step: int, tmp: Path, state: dict[str, Any], keep: int = 2, lineage: dict[str, Any] | None = None
) -> Path:
    """Rank 0, once every rank's part is in `tmp`: write `state` (state.pt) and the lineage, rename `tmp` into place
    as the checkpoint of `step` (module doc: all or nothing), then keep the newest `keep` checkpoints. With `lineage`
    (checkpoint_owner.lineage_of) the checkpoint records it and pruning counts and deletes only checkpoints of that
    lineage: another run's are never touched. Returns the checkpoint's folder."""
    root = Path(root)
    final = root / f"{_PREFIX}{step}"
    try:
        if lineage is not None:
            (tmp / LINEAGE_FILE).write_text(json.dumps(lineage, sort_keys=True))
            _fsync_path(tmp / LINEAGE_FILE)
        write_part(tmp / _STATE, state)
        pause_points.pause_at("checkpoint", step)  # tests: stopped here, the checkpoint is not one yet
        if final.exists():  # a resumed run saving a step again: the old one goes only once the new one is in place
            if _exchange(tmp, final):
                shutil.rmtree(tmp, ignore_errors=True)  # now the old copy
            else:
                replaced = root / f"{_OLD}{_PREFIX}{step}"
                final.rename(replaced)
                tmp.rename(final)
                shutil.rmtree(replaced, ignore_errors=True)
        else:
            tmp.rename(final)
        with contextlib.suppress(OSError):  # the rename itself; some filesystems cannot sync a folder
            _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half is left behind (a killed process leaves it: above)
        raise
    ours = [
        p
        for p in list_checkpoints(root)
        if lineage is None or (read_lineage(p) or {}).get("digest") == lineage["digest"]
    ]
    for old in ours[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(
    root: str | Path, step: int, state: dict[str, Any], keep: int = 2, lineage: dict[str, Any] | None = None
) -> Path:
    """One process's checkpoint: `begin_save` and `finish_save` with no rank parts (the Checkpointer adds them)."""
    return finish_save(root, step, begin_save(root, step), state, keep=keep, lineage=lineage)


EARLIER_RUNS = "earlier-runs"
# How many earlier runs' folders earlier-runs/ keeps (the newest): a job restarted fresh every day for a week would
# otherwise fill its claim with a checkpoint set per start. Each holds at most that run's `checkpoint.keep`.
EARLIER_RUNS_KEPT = 3
_EARLIER_NAME = re.compile(r"^\d{8}T\d{6}Z-before-run-")


def set_aside_earlier(root: str | Path, run_id: str) -> tuple[Path, list[int]] | None:
    """Move the checkpoints in `root` (an earlier run's: called when a run starts without resuming) into
    `root/earlier-runs/<UTC time>-before-run-<run_id>/`, names unchanged (`run_id`: the new run's). Returns that
    folder and their steps, or None when there were none. Nothing is deleted."""
    found = list_checkpoints(root)
    if not found:
        return None
    dest = Path(root) / EARLIER_RUNS / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-before-run-{run_id}"
    dest.mkdir(parents=True)
    steps = []
    for p in found:  # `step-<n>`, or a killed re-save's `.old-step-<n>` that stands for its step
        name = p.name.removeprefix(_OLD)
        p.rename(dest / name)
        steps.append(int(name.removeprefix(_PREFIX)))
    with contextlib.suppress(OSError):
        _fsync_path(Path(root))
    prune_earlier_runs(root)
    return dest, steps


def prune_earlier_runs(root: str | Path, kept: int = EARLIER_RUNS_KEPT) -> list[Path]:
    """Delete all but the newest `kept` of the folders `set_aside_earlier` made in `root/earlier-runs/` (their names
    start with the UTC time they were made, so they sort by it); anything else there is left alone. Returns what was
    deleted."""
    folder = Path(root) / EARLIER_RUNS
    if not folder.is_dir():
        return []
    ours = sorted(p for p in folder.iterdir() if p.is_dir() and _EARLIER_NAME.match(p.name))
    gone = ours[:-kept] if kept > 0 else ours
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    if gone:
        log.warning(
            "deleted %d earlier run(s)' checkpoints from %s (it keeps the newest %d): %s",
            len(gone),
            folder,
            kept,
            ", ".join(p.name for p in gone),
        )
    return gone


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    # Only complete checkpoints: a `step-<n>` folder without its state file is not one (nothing rmsft writes). A
    # copy a killed re-save set aside stands for its step until the next save puts it back (module doc).
    found: dict[int, Path] = {}
    for prefix in (f"{_OLD}{_PREFIX}", _PREFIX):  # `step-<n>` wins over its set-aside copy
        for p in root.glob(f"{prefix}*"):
            step = _step_of(p, prefix)
            if step is not None and p.is_dir() and (p / _STATE).is_file():
                found[step] = p
    return [found[k] for k in sorted(found)]


def load_latest(root: str | Path) -> dict[str, Any] | None:
    found = list_checkpoints(root)
    if not found:
        return None
    # Our own file: it holds Python objects (packer segments, RNG state), hence weights_only=False.
    return torch.load(found[-1] / _STATE, weights_only=False)
