"""What an objective is to the training loop: the interface every objective implements.

The loop (`learner.train.loop.TrainingLoop._train_step`) runs one optimizer step as

    plan   = objective.plan(step)               what the step needs: a pure function of the step index
    built  = objective.build(plan)              its rows: rollouts (or ground truth) -> targets -> packed rows
    totals = objective.denominators(built)      this rank's normalisers, summed over every rank by the loop
    row_loss, prepare = objective.row_loss(built, totals)   each row's share of the step's loss
    ... forward / backward / optimizer over the rows (the loop's) ...
    figures = objective.figures(plan, built, sums)          the objective's fields of the step's result

and publishes `objective.line(result)` and `objective.gauges(result)`. An objective is bound to one loop
(`bind`) once the loop's parts exist, and reads only the parts `LoopParts` names: the feed (prompts, rollouts,
the staleness window), the ranks, the packer, the model, the run state. It never calls back into the loop's step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from learner.core.head import RowHead
from learner.core.packing import PackedRow, Packer
from learner.data.images import ImageStore
from learner.data.order import DataOrder
from learner.data.records import Record
from learner.train.checkpointer import TrainState
from learner.train.config import CoreConfigs
from learner.train.feed import RolloutFeed
from learner.train.policy import Policy
from learner.train.ranks import Ranks
from learner.train.results import StepResult, Summary
from learner.train.updater import StepStrategy
from rmsft.jobspec import RolloutMatchingJob

__all__ = ["Built", "LoopParts", "Objective", "Prepare", "RowLoss", "StepPlan"]

# One row's loss and the metrics summed beside it (device tensors), given the row on the device, its logits and
# what `prepare` computed for it before the forward. Its logits are [1, L, V], or for an objective whose
# `chunked_logits` is True and spec.training.loss.logits chunked a `learner.core.head.RowHead` (hidden states and
# the head: the losses of learner/core/ take either).
RowLoss = Callable[[PackedRow, torch.Tensor | RowHead, Any], tuple[torch.Tensor, Mapping[str, torch.Tensor]]]
# What row i needs before its forward (e.g. reference log-probs), given the row on the device.
Prepare = Callable[[int, PackedRow], Any]


class LoopParts(Protocol):
    """What an objective reads of the loop it is bound to (`learner.train.loop.TrainingLoop` has them all). Read
    only (properties here): an objective never rebinds them."""

    @property
    def feed(self) -> RolloutFeed: ...  # prompts, rollouts, the staleness window
    @property
    def ranks(self) -> Ranks: ...
    @property
    def state(self) -> TrainState: ...  # step, weight version, run id
    @property
    def order(self) -> DataOrder: ...  # which records each E-step's batch holds
    @property
    def records(self) -> Sequence[Record]: ...
    @property
    def images(self) -> ImageStore: ...
    @property
    def policy(self) -> Policy: ...  # tokenizer, processor, vocabulary
    @property
    def model(self) -> torch.nn.Module: ...
    # How the optimizer steps: plain AdamW or DeepSpeed ZeRO (learner/train/updater.py); its autocast. None once
    # the loop is closed.
    @property
    def updater(self) -> StepStrategy | None: ...
    @property
    def packer(self) -> Packer: ...
    @property
    def core(self) -> CoreConfigs: ...  # the output format and the matching of the run

    def phase(self, name: str) -> AbstractContextManager[None]: ...
    def add_phase(self, name: str, seconds: float) -> None: ...


@dataclass(frozen=True)
class StepPlan:
    """What optimizer step `step` (0-based) needs; a pure function of the step index and the job."""

    step: int
    e_step: int  # the data order's batch the step trains on (= step, unless one E-step feeds several steps)
    batch: tuple[int, ...]  # that batch's record indices (global: every rank's share)
    builds: bool  # the step starts its E-step: it builds rows (the others reuse them)
    samples: bool  # those rows come from fresh rollouts: the engines need the newest weights before the step


@dataclass
class Built:
    """This rank's rows of a step, and what the objective keeps beside them for its loss and figures."""

    rows: list[PackedRow]
    local_ids: list[str]  # record ids of this rank's share of the batch
    extra: dict[str, Any] = field(default_factory=dict)


class Objective(ABC):
    """One training objective (module doc). Construction takes the job only and resolves what can fail before
    anything is paid for; `bind` attaches it to the loop whose parts it reads."""

    name: ClassVar[str]  # spec.trainer's value
    loss_keys: ClassVar[tuple[str, ...]] = ("loss",)  # the device step's sums, "loss" first, summed over ranks
    # Its row loss takes a RowHead (logits only at targets, a chunk at a time) when training.loss.logits is chunked;
    # False: it always gets the full logits tensor, whatever the setting.
    chunked_logits: ClassVar[bool] = False

    def __init__(self, job: RolloutMatchingJob) -> None:
        self.job, self.cfg = job, job.spec.training
        self._loop: LoopParts | None = None

    @property
    def loop(self) -> LoopParts:
        if self._loop is None:
            raise RuntimeError(f"objective {self.name!r} is not bound to a training loop yet")
        return self._loop

    def bind(self, loop: LoopParts) -> None:
        """Attach to the loop, once its parts (feed, ranks, packer, model) exist."""
        self._loop = loop

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
    def figures(self, plan: StepPlan, built: Built, sums: Mapping[str, float]) -> dict[str, Any]:
        """The objective's fields of the step's `StepResult` (rollouts, parts, stats, ...), given the device
        step's sums over every rank."""

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

    def gauges(self, r: StepResult) -> None:
        """The objective's own Prometheus gauges of a step (the loop sets the step, its time, fill and loss)."""
        return None

    def scalars(self, r: StepResult) -> dict[str, float]:
        """The objective's own TensorBoard figures of a step (the loop writes the loss, its parts, fill, rows,
        time, learning rate and sync bytes); {} by default."""
        return {}

    def summarise(self, summary: Summary) -> None:
        """The objective's own fields of the run's summary."""
        return None

    def close(self) -> None:
        """Release what the objective holds (threads)."""
        return None
