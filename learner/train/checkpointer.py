"""The training loop's train state and its checkpointer, composed into `learner.train.loop.TrainingLoop`.

`TrainState` is what the loop advances (step, weight version, time by phase) and this run's
identity. The `Checkpointer` saves and restores it with the model, the optimizer (through the
updater) and the packer's carry buffer.

Rank 0 writes model, optimizer, step and version; every rank's packer carry buffer and RNG (and,
under DeepSpeed, its ZeRO optimizer partition) are gathered into the same `state.pt` as
`rank_states`, so one atomic folder holds the whole group's state.

A weight version is (run id, number) (`rmsft.weight_wire.version`). The run id is this learner
process's own, made at start: a resume restores the step, the weights and the version *number*,
never the run id, so the versions it announces next cannot be taken for the ones the run that
wrote the checkpoint announced (with other weights) after it. The checkpoint records the run ids
of the lives that led to it (`run_ids`, oldest first), for the record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from learner.core.packing import Packer
from learner.train.checkpoint_files import (
    list_checkpoints,
    rng_state,
    save_checkpoint,
    set_aside_earlier,
    set_rng_state,
    trainable_state,
)
from learner.train.checkpoint_owner import check_resumable
from learner.train.ranks import Ranks
from learner.train.updater import PlainUpdater, Updater, ZeroUpdater, gathered_weights
from rmsft.jobspec import TrainingConfig
from rmsft.weight_wire import NO_RUN, WeightVersion

log = logging.getLogger("rmsft.learner")


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
    def __init__(self, cfg: TrainingConfig, ranks: Ranks, model: torch.nn.Module, updater: Updater,
                 packer: Packer, state: TrainState, parts: Mapping[str, Stateful] | None = None,
                 lineage: dict[str, Any] | None = None) -> None:
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
        out: dict[str, Any] = {"packer": self.packer.carry(), "rng": rng_state(),
                               **{name: part.state_dict() for name, part in self.parts.items()}}
        if isinstance(self.updater, ZeroUpdater):  # ZeRO partitions the optimizer: every rank holds its own part
            out["zero_optimizer"] = self.updater.optimizer_state()
        return out

    def gathered_trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights as CPU copies, whole under ZeRO-3 too. Collective."""
        with gathered_weights(self.updater, self.model):
            return {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.model).items()}

    def checkpoint(self, model_state: dict[str, torch.Tensor], rank_states: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0's checkpoint: `model_state` from `gathered_trainable_state` (whole weights under ZeRO-3 too),
        `rank_states` every rank's `_rank_state` (its carry buffer, RNG, parts, ZeRO optimizer partition)."""
        s = self.state
        return {
            "step": s.step, "version": s.version, "model": model_state, "rank_states": rank_states,
            "optimizer": self.updater.optimizer_state() if isinstance(self.updater, PlainUpdater) else None,
            "phase_seconds": dict(s.phase_seconds),
            "world_size": self.ranks.world_size, "deepspeed_stage": self.cfg.deepspeed_stage,
            # The record of which runs wrote it (a resumed run never reuses one: it makes its own).
            "run_id": s.run_id, "run_ids": [*(s.resumed.run_ids if s.resumed else ()), s.run_id],
            "extra": dict(self.extra),
        }

    def save(self) -> Path | None:
        """Collective: every rank's packer carry buffer and RNG (and ZeRO optimizer part) go into
        the one checkpoint rank 0 writes. Returns its path on rank 0, None elsewhere."""
        rank_states = self.ranks.gather_to_main(self._rank_state())
        model_state = self.gathered_trainable_state()
        path = None
        with self.ranks.guard("saving the checkpoint (rank 0)"):
            if self.ranks.is_main:
                assert rank_states is not None, "rank 0 gathers every rank's state"
                ckpt = self.checkpoint(model_state, rank_states)
                ck = self.cfg.checkpoint
                path = save_checkpoint(ck.dir, self.state.step, ckpt, keep=ck.keep, lineage=self.lineage)
        self.last_save_t, self.saved_step = time.monotonic(), self.state.step
        return path

    def start_fresh(self) -> None:
        """A run that did not resume: an earlier run's checkpoints in training.checkpoint.dir are moved aside
        (checkpoint_files.set_aside_earlier), so this run's pruning and a later resume see only this run's. Rank 0."""
        if not self.ranks.is_main:
            return
        moved = set_aside_earlier(self.cfg.checkpoint.dir, self.state.run_id)
        if moved is not None:
            where, steps = moved
            log.warning("training.checkpoint.dir %s held checkpoint(s) of an earlier run (step %s): moved to %s; this "
                        "run starts fresh (--resume continues the newest checkpoint instead)", self.cfg.checkpoint.dir,
                        ", ".join(map(str, steps)), where)

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
            # Our own file: it holds Python objects (packer segments, RNG state), hence weights_only=False.
            # Onto the CPU: each tensor then goes where its owner lives (the model's and the optimizer's loads move
            # it), not every rank's copy onto cuda:0 where it was saved.
            ckpt = torch.load(Path(name) / "state.pt", weights_only=False, map_location="cpu")
            self._load(ckpt, name)
        s = self.state
        assert s.resumed is not None, "set by _load"
        log.info("resumed from step %d (weight version %d of run %s); this run is %s", s.step,
                 s.resumed.weights.number, s.resumed.weights.run_id or "(not recorded)", s.run_id)
        return True

    def _load(self, ckpt: dict[str, Any], name: str) -> None:
        saved_ws, ws = ckpt["world_size"], self.ranks.world_size
        if saved_ws != ws:
            raise RuntimeError(f"checkpoint {name} was written by {saved_ws} learner rank(s), this run has {ws}: "
                               "resume with the same number of ranks (each rank's carry buffer and RNG are its own)")
        if ckpt["deepspeed_stage"] != self.cfg.deepspeed_stage:
            raise RuntimeError(f"checkpoint {name} was written with deepspeed_stage {ckpt['deepspeed_stage']}, "
                               f"this run uses {self.cfg.deepspeed_stage}")
        missing = set(trainable_state(self.model)) - set(ckpt["model"])
        if missing:
            raise RuntimeError(f"checkpoint does not match the model: {len(missing)} trainable tensors missing")
        with gathered_weights(self.updater, self.model, modifier_rank=0):  # ZeRO-3: rank 0's load is re-partitioned
            self.model.load_state_dict(ckpt["model"], strict=False)
        rank_states = ckpt["rank_states"]
        mine = rank_states[self.ranks.rank]
        if isinstance(self.updater, PlainUpdater):
            self.updater.load_optimizer_state([ckpt["optimizer"]])
        else:
            self.updater.load_optimizer_state([s["zero_optimizer"] for s in rank_states])
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
