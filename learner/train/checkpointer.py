"""The training loop's train state and its checkpointer, composed into `learner.train.loop.TrainingLoop`.

`TrainState` is what the loop advances (step, weight version, time by phase) and this run's
identity. The `Checkpointer` saves and restores it with the model, the optimizer (through the
updater) and the packer's carry buffer.

Rank 0 writes model, optimizer, step and version (`state.pt`); every rank writes its own packer carry
buffer, RNG, parts and, under DeepSpeed, its ZeRO optimizer partition (`rank-<r>.pt`) into the same
folder, and reads back only its own, its optimizer partition onto its own device. Rank 0 puts the
folder in place only after every rank's part is written (learner/train/checkpoint_files.py), so one
atomic folder holds the whole group's state and no rank holds another's partition.

A weight version is (run id, number) (`rmsft.weight_wire.version`). The run id is this learner
process's own, made at start: a resume restores the step, the weights and the version *number*,
never the run id, so the versions it announces next cannot be taken for the ones the run that
wrote the checkpoint announced (with other weights) after it. The checkpoint records the run ids
of the lives that led to it (`run_ids`, oldest first), for the record.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from learner.core.packing import Packer
from learner.train.checkpoint_files import (
    begin_save,
    finish_save,
    list_checkpoints,
    rank_part,
    rng_state,
    set_aside_earlier,
    set_rng_state,
    trainable_state,
    write_part,
)
from learner.train.checkpoint_owner import check_resumable
from learner.train.ranks import Ranks
from learner.train.updater import PlainUpdater, Updater, ZeroUpdater, gathered_weights
from rmsft.exit_codes import CONFIG_EXIT
from rmsft.jobspec import TrainingConfig
from rmsft.weight_wire import NO_RUN, WeightVersion

log = logging.getLogger("rmsft.learner")


class CheckpointMismatchError(RuntimeError):
    """The newest checkpoint cannot be continued by this run (its layout, ranks, ZeRO stage or model)."""

    exit_code = CONFIG_EXIT  # the same spec meets the same checkpoint: no retry helps


# state.pt's "layout": each rank's state in its own rank-<r>.pt (checkpoint_files); the one-file layout had none.
PER_RANK_LAYOUT = "per-rank"


class Stateful(Protocol):
    """A part whose state a checkpoint keeps, per rank (`Checkpointer(parts=...)`)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from: its step, its weight version (the run that wrote it and the
    number), and the runs that led to it, oldest first (the writer last; empty for a checkpoint
    written before runs had ids)."""

    step: int
    weights: WeightVersion
    run_ids: tuple[str, ...]


@dataclass
class TrainState:
    """What one training run advances. `version` is the number of the learner's weight version: the
    one owner of it (the sync client is told which version to push; rollouts must carry it), within
    the run `run_id` (this process's, set at start; the version itself is `weights`). `resumed`: the
    checkpoint this run resumed from (None when it started fresh)."""

    step: int = 0
    version: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    run_id: str = NO_RUN
    resumed: Resumed | None = None

    @property
    def weights(self) -> WeightVersion:
        """The learner's current weight version (this run's id and `version`)."""
        return WeightVersion(self.run_id, self.version)


class Checkpointer:
    def __init__(
        self,
        cfg: TrainingConfig,
        ranks: Ranks,
        model: torch.nn.Module,
        updater: Updater,
        packer: Packer,
        state: TrainState,
        parts: Mapping[str, Stateful] | None = None,
        lineage: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.ranks, self.model, self.packer, self.state = cfg, ranks, model, packer, state
        # This run's lineage (checkpoint_owner.lineage_of): recorded in each checkpoint, checked on resume; pruning
        # deletes only its own. None: not recorded, nothing refused (tests that build a Checkpointer bare).
        self.lineage = lineage
        self.updater = updater  # how the optimizer steps (learner/train/updater.py): its optimizer state is saved
        # Each rank's further parts with a state of their own (the objective's), saved and restored per rank.
        self.parts: dict[str, Stateful] = dict(parts or {})
        # Rank 0's further state for the next checkpoint (the rollouts generated ahead), and what the loaded one had.
        self.extra: dict[str, Any] = {}
        self.loaded_extra: dict[str, Any] = {}
        self.last_save_t = time.monotonic()  # training.checkpoint.every_minutes' clock: the last save, or the start
        self.saved_step: int | None = None  # the step of this process's last save

    def due(self, step: int, every: int, seconds: float) -> bool:
        """Whether step `step` saves: every `every` steps (training.checkpoint.every; 0: never by steps), or once
        `seconds` passed since the last save (every_minutes; 0: never by time)."""
        return (bool(every) and step % every == 0) or (bool(seconds) and self.time_to_save(seconds))

    def time_to_save(self, seconds: float) -> bool:
        """training.checkpoint.every_minutes: whether `seconds` have passed since the last save, agreed by every rank
        (the save is collective; the ranks' clocks are their own): one small all-reduce per step on several ranks."""
        due = time.monotonic() - self.last_save_t >= seconds
        return self.ranks.max([1.0 if due else 0.0])[0] > 0 if self.ranks.enabled else due

    def _rank_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "packer": self.packer.carry(),
            "rng": rng_state(),
            **{name: part.state_dict() for name, part in self.parts.items()},
        }
        if isinstance(self.updater, ZeroUpdater):  # ZeRO partitions the optimizer: every rank holds its own part
            out["zero_optimizer"] = self.updater.optimizer_state()
        return out

    def gathered_trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights as CPU copies, whole under ZeRO-3 too. Collective."""
        with gathered_weights(self.updater, self.model):
            return {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.model).items()}

    def checkpoint(self, model_state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Rank 0's `state.pt`: `model_state` from `gathered_trainable_state` (whole weights under ZeRO-3 too) and
        the run's record; each rank's own state is its part (`_rank_state`, `rank-<r>.pt`)."""
        s = self.state
        return {
            "step": s.step,
            "version": s.version,
            "model": model_state,
            "layout": PER_RANK_LAYOUT,
            "optimizer": self.updater.optimizer_state() if isinstance(self.updater, PlainUpdater) else None,
            "phase_seconds": dict(s.phase_seconds),
            "world_size": self.ranks.world_size,
            "deepspeed_stage": self.cfg.deepspeed_stage,
            # The record of which runs wrote it (a resumed run never reuses one: it makes its own).
            "run_id": s.run_id,
            "run_ids": [*(s.resumed.run_ids if s.resumed else ()), s.run_id],
            "extra": dict(self.extra),
        }

    def save(self) -> Path | None:
        """Collective: every rank writes its packer carry buffer, RNG, parts (and ZeRO optimizer partition) as its
        own part; rank 0 writes the model and puts the checkpoint in place once every part is on disk. Returns its
        path on rank 0, None elsewhere."""
        model_state = self.gathered_trainable_state()
        ck, step = self.cfg.checkpoint, self.state.step
        tmp = None
        with self.ranks.guard("preparing the checkpoint folder (rank 0)"):
            if self.ranks.is_main:
                tmp = str(begin_save(ck.dir, step))
        tmp = self.ranks.broadcast_from_main(tmp)
        assert tmp is not None, "rank 0 made the folder"
        path = None
        try:
            with self.ranks.guard("writing its part of the checkpoint"):
                write_part(rank_part(tmp, self.ranks.rank), self._rank_state())
            # Past the guard every rank's part is on disk (it is collective): only now may the folder become final.
            with self.ranks.guard("saving the checkpoint (rank 0)"):
                if self.ranks.is_main:
                    path = finish_save(
                        ck.dir, step, Path(tmp), self.checkpoint(model_state), keep=ck.keep, lineage=self.lineage
                    )
        except BaseException:
            if self.ranks.is_main:  # a rank's part failed: no checkpoint of this step, and nothing half left
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.last_save_t, self.saved_step = time.monotonic(), step
        return path

    def start_fresh(self) -> None:
        """A run that did not resume: an earlier run's checkpoints in training.checkpoint.dir are moved aside
        (checkpoint_files.set_aside_earlier), so this run's pruning and a later resume see only this run's. Rank 0."""
        if not self.ranks.is_main:
            return
        moved = set_aside_earlier(self.cfg.checkpoint.dir, self.state.run_id)
        if moved is not None:
            where, steps = moved
            log.warning(
                "training.checkpoint.dir %s held checkpoint(s) of an earlier run (step %s): moved to %s; this "
                "run starts fresh (--resume continues the newest checkpoint instead)",
                self.cfg.checkpoint.dir,
                ", ".join(map(str, steps)),
                where,
            )

    def resume(self) -> bool:
        """Load the newest checkpoint in training.checkpoint.dir; False when there is none.
        Collective; every rank reads the folder rank 0 picked (one pod: a shared filesystem)."""
        name = None
        with self.ranks.guard("looking for a checkpoint (rank 0)"):
            if self.ranks.is_main:
                found = list_checkpoints(self.cfg.checkpoint.dir)
                name = str(found[-1]) if found else None
                if found and self.lineage is not None:  # another run's checkpoint: refused before it is loaded
                    warning = check_resumable(found[-1], self.lineage, resume_any=self.cfg.checkpoint.resume_any)
                    if warning:
                        log.warning("%s", warning)
        name = self.ranks.broadcast_from_main(name)
        if name is None:
            return False
        with self.ranks.guard(f"loading checkpoint {name}"):
            # Our own files: they hold Python objects (packer segments, RNG state), hence weights_only=False.
            # Memory-mapped onto the CPU: the model's load copies each tensor where the model lives, no anonymous
            # host copy of the file. Then this rank's own part: its optimizer partition onto this rank's device.
            ckpt = torch.load(Path(name) / "state.pt", weights_only=False, mmap=True, map_location="cpu")
            self._check_loadable(ckpt, name)
            mine = torch.load(rank_part(name, self.ranks.rank), weights_only=False, mmap=True, map_location="cpu")
            if "zero_optimizer" in mine:
                mine["zero_optimizer"] = _to_device(mine["zero_optimizer"], self.updater.device)
            self._load(ckpt, mine)
        s = self.state
        assert s.resumed is not None, "set by _load"
        log.info(
            "resumed from step %d (weight version %d of run %s); this run is %s",
            s.step,
            s.resumed.weights.number,
            s.resumed.weights.run_id or "(not recorded)",
            s.run_id,
        )
        return True

    def _check_loadable(self, ckpt: dict[str, Any], name: str) -> None:
        """Refuse a checkpoint this run cannot continue, before any rank reads its part."""
        if ckpt.get("layout") != PER_RANK_LAYOUT:
            raise CheckpointMismatchError(
                f"checkpoint {name} is in the one-file layout of earlier rmsft releases (every rank's state in "
                "state.pt); this release keeps each rank's part in its own file (rank-<r>.pt) and cannot resume it: "
                "finish the run with the release that wrote it, or export its weights (`rmsft export`) and start "
                "fresh from them"
            )
        saved_ws, ws = ckpt["world_size"], self.ranks.world_size
        if saved_ws != ws:
            raise CheckpointMismatchError(
                f"checkpoint {name} was written by {saved_ws} learner rank(s), this run has {ws}: resume with the "
                "same number of ranks (each rank's carry buffer, RNG and optimizer partition are its own)"
            )
        if ckpt["deepspeed_stage"] != self.cfg.deepspeed_stage:
            raise CheckpointMismatchError(
                f"checkpoint {name} was written with deepspeed_stage {ckpt['deepspeed_stage']}, "
                f"this run uses {self.cfg.deepspeed_stage}"
            )
        missing = set(trainable_state(self.model)) - set(ckpt["model"])
        if missing:
            raise CheckpointMismatchError(
                f"checkpoint does not match the model: {len(missing)} trainable tensors missing"
            )

    def _load(self, ckpt: dict[str, Any], mine: dict[str, Any]) -> None:
        """`ckpt`: rank 0's state.pt; `mine`: this rank's own part."""
        with gathered_weights(self.updater, self.model, modifier_rank=0):  # ZeRO-3: rank 0's load is re-partitioned
            self.model.load_state_dict(ckpt["model"], strict=False)
        if isinstance(self.updater, PlainUpdater):
            self.updater.load_optimizer_state(ckpt["optimizer"])
        else:
            self.updater.load_optimizer_state(mine["zero_optimizer"])
        set_rng_state(mine["rng"])
        self.packer.restore(mine["packer"])
        for part_name, part in self.parts.items():
            part.load_state_dict(mine[part_name])
        s = self.state
        s.resumed = Resumed(ckpt["step"], WeightVersion(ckpt["run_id"], ckpt["version"]), tuple(ckpt["run_ids"]))
        # The numbers go on from the checkpoint's (the run id makes them new); never back below one this
        # run announced already, so no number of this run ever names two sets of weights.
        s.step, s.version = ckpt["step"], max(ckpt["version"], s.version)
        s.phase_seconds = dict(ckpt["phase_seconds"])
        self.loaded_extra = dict(ckpt["extra"])


def _to_device(obj: Any, device: torch.device) -> Any:
    """`obj` (a ZeRO optimizer state: dicts, lists, tensors and plain values) with its partitions on `device`.
    Scalars stay on the CPU: AdamW keeps its `step` counts there unless capturable or fused (a step count on the GPU
    would be read back to the host every step)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if obj.dim() > 0 else obj
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj
