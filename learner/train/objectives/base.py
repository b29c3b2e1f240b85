"""What an objective is to the training loop: the interface every objective implements.

The loop (`learner.train.loop.TrainingLoop._train_step`) runs one optimizer step as

    plan   = objective.plan(step)               what the step needs: a pure function of the step index
    built  = objective.build(plan)              its rows: rollouts (or ground truth) -> targets -> packed rows
    totals = objective.denominators(built)      this rank's normalisers, summed over every rank by the loop
    row_loss, prepare = objective.row_loss(built, totals)   each row's share of the step's loss
    ... forward / backward / optimizer over the rows (the loop's) ...
    outcome = objective.outcome(built, sums)               its rollouts, loss parts and own figures of the step

and logs `objective.line(result)`. The step's `StepResult.figures` (the objective's `StepFigures`) are what the
progress bar, TensorBoard, /metrics and the summaries show of it, with no code of theirs per objective.

An objective holds no reference to the loop: once the loop's parts exist it is handed them, explicitly, as an
`ObjectiveInputs` (`attach`): the feed (prompts, rollouts, the staleness window), the ranks, the packer, the
model, the run state, the phase clock. What it needs of a step comes in as arguments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from learner.core.head import RowHead
from learner.core.packing import PackedRow, Packer
from learner.data.images import ImageStore
from learner.data.order import DataOrder
from learner.data.records import Record
from learner.rollouts.client import Rollout
from learner.train.checkpointer import TrainState
from learner.train.config import CoreConfigs
from learner.train.feed import RolloutFeed
from learner.train.policy import Policy
from learner.train.ranks import Ranks
from learner.train.reporting import PhaseClock
from learner.train.results import StepFigures, StepResult
from learner.train.updater import Updater
from rmsft.jobspec import RolloutMatchingJob

__all__ = ["Built", "Objective", "ObjectiveInputs", "Prepare", "RowLoss", "StepOutcome", "StepPlan"]

# One row's loss and the metrics summed beside it (device tensors), given the row on the device, its logits and
# what `prepare` computed for it before the forward. Its logits are [1, L, V], or for an objective whose
# `chunked_logits` is True and spec.training.loss.logits chunked a `learner.core.head.RowHead` (hidden states and
# the head: the losses of learner/core/ take either).
RowLoss = Callable[[PackedRow, torch.Tensor | RowHead, Any], tuple[torch.Tensor, Mapping[str, torch.Tensor]]]
# What row i needs before its forward (e.g. reference log-probs), given the row on the device.
Prepare = Callable[[int, PackedRow], Any]


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective reads of the run, handed to it by the loop once they exist (`Objective.attach`). Read only:
    an objective never rebinds them."""

    feed: RolloutFeed  # prompts, rollouts, the staleness window
    ranks: Ranks
    state: TrainState  # step, weight version, run id
    order: DataOrder  # which records each E-step's batch holds
    records: Sequence[Record]
    images: ImageStore
    policy: Policy  # tokenizer, processor, vocabulary
    model: torch.nn.Module
    updater: Updater  # how the optimizer steps (plain AdamW or DeepSpeed ZeRO; learner/train/updater.py), autocast
    packer: Packer
    core: CoreConfigs  # the output format and the matching of the run
    phases: PhaseClock  # times the step's phases (the step log's and /metrics' phase seconds)


@dataclass(frozen=True)
class StepPlan:
    """What optimizer step `step` (0-based) needs; a pure function of the step index and the job."""

    step: int
    e_step: int  # the data order's batch the step trains on (= step, unless one E-step feeds several steps)
    batch: tuple[int, ...]  # that batch's record indices (global: every rank's share)
    builds: bool  # the step starts its E-step: it builds rows (the others reuse them)
    samples: bool  # those rows come from fresh rollouts: the engines need the newest weights before the step


@dataclass
class StepOutcome:
    """What a step gave besides its loss, in the objective's words (`Objective.outcome`)."""

    rollouts: list[Rollout]  # the step's fresh rollouts (rank 0: the whole batch's; others: their share), or []
    figures: StepFigures  # the objective's own figures of the step
    parts: dict[str, float] = field(default_factory=dict)  # the loss's named parts, over every rank


@dataclass
class Built:
    """This rank's rows of a step, and what the objective keeps beside them for its loss and figures."""

    rows: list[PackedRow]
    local_ids: list[str]  # record ids of this rank's share of the batch
    extra: dict[str, Any] = field(default_factory=dict)


class Objective(ABC):
    """One training objective (module doc). Construction takes the job only and resolves what can fail before
    anything is paid for; `attach` hands it the run's parts it reads (`ObjectiveInputs`)."""

    name: ClassVar[str]  # spec.trainer's value
    loss_keys: ClassVar[tuple[str, ...]] = ("loss",)  # the device step's sums, "loss" first, summed over ranks
    # Its row loss takes a RowHead (logits only at targets, a chunk at a time) when training.loss.logits is chunked;
    # False: it always gets the full logits tensor, whatever the setting.
    chunked_logits: ClassVar[bool] = False

    def __init__(self, job: RolloutMatchingJob) -> None:
        self.job, self.cfg = job, job.spec.training
        self._inputs: ObjectiveInputs | None = None

    @property
    def inputs(self) -> ObjectiveInputs:
        if self._inputs is None:
            raise RuntimeError(f"objective {self.name!r} has no inputs yet (attach)")
        return self._inputs

    def attach(self, inputs: ObjectiveInputs) -> None:
        """The run's parts this objective reads (feed, ranks, packer, model), once they exist."""
        self._inputs = inputs

    # -- what a step is -------------------------------------------------------------------------------
    def needs_rollouts(self) -> str | None:
        """Why this run needs a rollout source (servers or an in-process engine), or None when no step samples."""
        return f"every {self.name} step samples"

    @abstractmethod
    def make_packer(self) -> Packer:
        """This rank's packer (lives across steps; the checkpoint keeps its carry buffer)."""

    @abstractmethod
    def plan(self, step: int) -> StepPlan:
        """What optimizer step `step` needs (pure: the same answer for the same step, whatever ran before)."""

    @abstractmethod
    def build(self, plan: StepPlan) -> Built:
        """This rank's packed rows of the step."""

    @abstractmethod
    def denominators(self, built: Built) -> list[float]:
        """This rank's share of the step's normalisers (the loop sums them over ranks)."""

    @abstractmethod
    def row_loss(self, built: Built, totals: Sequence[float]) -> tuple[RowLoss, Prepare | None]:
        """Each row's share of the step's loss, normalised by the global `totals`, and what a row needs before
        its forward (None: nothing)."""

    @abstractmethod
    def outcome(self, built: Built, sums: Mapping[str, float]) -> StepOutcome:
        """The step's rollouts, loss parts and the objective's own figures, given the device step's sums (its
        `loss_keys`) over every rank."""

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's objective (what `plan` cannot recompute); {} by default."""
        return {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A checkpoint's `state_dict` of this rank (an empty dict for one written without it)."""
        return None

    # -- reporting ------------------------------------------------------------------------------------
    @abstractmethod
    def line(self, r: StepResult) -> str:
        """Rank 0's one log line of a step."""

    def close(self) -> None:
        """Release what the objective holds (threads)."""
        return None
