"""Checkpoints: trainable weights, optimizer, data position, RNG, packer carry buffer, step, version.

A checkpoint is a folder `step-<n>` written under a temporary name and renamed into place, so a
crash mid-save never leaves a half checkpoint that resume would pick up.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

_PREFIX = "step-"


class CheckpointDirError(RuntimeError):
    """training.checkpoint.dir cannot be written; the message names the path and what to change."""


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


def save_checkpoint(root: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step}"
    tmp = root / f".tmp-{_PREFIX}{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def load_latest(root: str | Path) -> dict[str, Any] | None:
    found = list_checkpoints(root)
    if not found:
        return None
    # Our own file: it holds Python objects (packer segments, RNG state), hence weights_only=False.
    return torch.load(found[-1] / "state.pt", weights_only=False)
