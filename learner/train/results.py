"""What the training loop reports per step (`StepResult`, with `GrpoStats` for a GRPO step) and per run (`Summary`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.data.episode import EpisodeStats
from learner.evaluation.held_out import HeldOutFigures
from learner.rollouts.client import Rollout

if TYPE_CHECKING:
    from learner.evaluation.held_out import Evaluation
    from learner.train.checkpointer import TrainState


@dataclass
class GrpoStats:
    """One GRPO step's figures over every rank's completions (the loss-side ones token-weighted like the loss)."""

    reward_mean: float
    reward_std: float  # over every completion of the step
    group_reward_std: float  # each group's std (unbiased), averaged over the groups
    zero_std_groups: float  # share of groups whose rewards were all equal: no signal, zero advantages
    rewards: dict[str, float]  # each reward of the sum, unweighted, averaged over the completions
    clip_fraction: float  # completion tokens whose importance ratio was clipped
    ratio_mean: float  # mean importance ratio (1.0 when the learner and the servers agree)
    kl: float  # k3 estimate of KL(policy || reference); 0 without kl_coef
    completion_length: float  # mean completion tokens
    truncated: float  # share of completions cut by max_tokens
    completions: int
    groups: int
    # Train/inference mismatch (learner/core/grpo.py): k3 of KL(servers' policy || learner's) per completion token,
    # the correction's mean importance weight (1 with correction none) and the share of tokens it truncated/masked.
    mismatch_kl: float = 0.0
    is_weight_mean: float = 1.0
    corrected_fraction: float = 0.0
    # Sampling rules: groups left out of the loss as flat (dynamic_sampling), extra groups sampled to replace flat
    # ones (resample), answers cut at the budget that were masked or penalised (overlong).
    dropped_groups: int = 0
    resampled_groups: int = 0
    overlong_masked: int = 0
    overlong_penalised: int = 0

    def scalars(self) -> dict[str, float]:
        out = {f"grpo/{k}": float(v) for k, v in vars(self).items() if k != "rewards"}
        out.update({f"grpo/reward/{k}": v for k, v in self.rewards.items()})
        return out


@dataclass
class StepResult:
    step: int  # 1-based optimizer step just finished
    weight_version: int  # version the step's rollouts came from
    # This step's fresh rollouts in input order (empty on M-steps). Rank 0 holds the whole global
    # batch's; another rank holds its own share.
    rollouts: list[Rollout]
    record_ids: list[str]  # global raw batch this step trained on (all ranks)
    loss: float  # token-level mean over every rank's rows
    parts: dict[str, float]
    stats: EpisodeStats | None  # match counts summed over ranks; None on M-steps that reuse a batch
    rows: int  # packed rows over all ranks
    fill: float  # mean fill of those rows
    seconds: float
    rank: int = 0
    local_record_ids: list[str] = field(default_factory=list)  # this rank's contiguous share
    local_rows: int = 0  # rows this rank trained on
    local_tokens: int = 0
    grpo: GrpoStats | None = None  # spec.trainer: grpo
    # Rollout matching's channel: "B" (the model's own answers) or "A" (the ground truth; warm start too); None for
    # an objective without channels (GRPO), which logs no train/channel_b.
    channel: str | None = None


@dataclass
class Summary:
    steps: int
    first_loss: float
    last_loss: float
    losses: list[float]
    weight_version: int
    phase_seconds: dict[str, float]
    wall_seconds: float
    retries: int = 0
    f1: list[float] = field(default_factory=list)  # rollout matching: the rollout F1 of each step that sampled
    history: list[StepResult] = field(default_factory=list)
    pictures: list[Path] = field(default_factory=list)  # rollouts drawn on their images (vision-language runs)
    # held-out (step, label-aware F1 at eval_iou, label-aware mAP); `held_out` has every figure of each
    evaluations: list[tuple[int, float, float]] = field(default_factory=list)
    eval_iou: float = 0.5  # the IoU threshold of the held-out F1 (training.eval.iou)
    held_out: list[HeldOutFigures] = field(default_factory=list)  # the same evaluations, every figure
    eval_pictures: list[Path] = field(default_factory=list)  # the last held-out answers drawn on their images
    log_dir: Path | None = None  # TensorBoard event files (rank 0)
    exported: Path | None = None  # the Hugging Face folder written at the end (training.export)
    rewards: list[float] = field(default_factory=list)  # GRPO: mean reward of each step
    mismatch_kl: list[float] = field(default_factory=list)  # GRPO: KL(servers' policy || learner's) of each step
    run_id: str = ""  # the learner run whose weight version `weight_version` is

    @classmethod
    def of_run(cls, state: TrainState, history: Sequence[StepResult], evaluations: Sequence[Evaluation],
               **fields: Any) -> Summary:
        """The summary of a run at `state`, from its steps and held-out evaluations; `fields` the rest."""
        losses = [h.loss for h in history]
        return cls(steps=state.step, first_loss=losses[0] if losses else float("nan"),
                   last_loss=losses[-1] if losses else float("nan"), losses=losses, weight_version=state.version,
                   run_id=state.run_id, phase_seconds=dict(state.phase_seconds), history=list(history),
                   evaluations=[(e.step, e.f1, e.map) for e in evaluations],
                   held_out=[e.figures() for e in evaluations], **fields)

    def rollout_rates(self) -> dict[str, float] | None:
        """What the training rollouts looked like: the truncation rate, duplicate rate and predicted objects per
        ground-truth object, each the mean over the steps that trained on fresh rollouts (channel B; not the
        ground-truth steps, which generate nothing, nor the M-steps reusing a batch). None without such a step."""
        stats = [h.stats for h in self.history if h.channel == "B" and h.stats is not None and h.stats.rollouts]
        if not stats:
            return None
        n = len(stats)
        return {"steps": float(n), "truncation_rate": sum(s.truncation_rate for s in stats) / n,
                "duplicate_rate": sum(s.duplicate_rate for s in stats) / n,
                "predicted_per_gt": sum(s.count_ratio for s in stats) / n}

    @property
    def final_evaluation(self) -> tuple[int, float, float] | None:
        """The last held-out (step, F1, mAP): what the trained model scores."""
        return self.evaluations[-1] if self.evaluations else None

    @property
    def best_evaluation(self) -> tuple[int, float, float] | None:
        """The held-out (step, F1, mAP) of the highest F1 (the earliest on a tie)."""
        return max(self.evaluations, key=lambda e: (e[1], -e[0])) if self.evaluations else None

