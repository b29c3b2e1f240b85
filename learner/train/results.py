"""What the training loop reports per step (`StepResult`) and per run (`Summary`).

A step's result holds what every objective has (loss, its parts, rows, rollouts, time) and `figures`, the
objective's own (`StepFigures`: rollout matching's `RolloutMatchingFigures`, GRPO's `GrpoStats`). The progress
bar, TensorBoard, /metrics and the two run summaries (`rmsft local`'s table, `rmsft train`'s closing log lines)
print a step's figures through `StepFigures` alone: an objective's new figure needs no edit to any of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.data.episode import EpisodeStats
from learner.evaluation.held_out import HeldOutFigures
from learner.rollouts.client import Rollout
from learner.tracking import metrics as m

if TYPE_CHECKING:
    from learner.evaluation.held_out import Evaluation
    from learner.train.checkpointer import TrainState


class StepFigures:
    """An objective's own figures of one step, and how they are shown. The base has none: an objective without
    figures of its own hands this."""

    def bar(self) -> str:
        """The progress bar's words for this step after the loss, e.g. "f1 0.52" ("" for none)."""
        return ""

    def scalars(self) -> dict[str, float]:
        """TensorBoard's figures of the step (named "<group>/<name>"); /metrics has each as
        rmsft_learner_objective_figure{name=...} too."""
        return {}

    def gauges(self) -> None:
        """The objective's own Prometheus metrics of the step, past the generic figure gauge (none by default)."""
        return None

    def series(self) -> dict[str, float]:
        """The figures the run's summary follows from the first step that has them to the last (`Summary.series`)."""
        return {}

    @classmethod
    def summary_rows(cls, steps: Sequence[StepFigures]) -> list[tuple[str, str]]:
        """The run summary's rows of these figures, (label, text), from every step's (in order). By default, each
        series' first and last value."""
        return [(f"{name} (first -> last)", f"{v[0]:.4g} -> {v[-1]:.4g}") for name, v in _series(steps).items()]


def _series(steps: Sequence[StepFigures]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for f in steps:
        for k, v in f.series().items():
            out.setdefault(k, []).append(v)
    return out


def publish_figures(figures: StepFigures) -> None:
    """A step's figures on /metrics: each scalar on the generic gauge, then the objective's own gauges."""
    for name, v in figures.scalars().items():
        m.OBJECTIVE_FIGURE.labels(name).set(v)
    figures.gauges()


@dataclass
class RolloutMatchingFigures(StepFigures):
    """A rollout-matching step's own figures: its channel and, on a step that built rows from rollouts, their
    match counts summed over ranks."""

    # "B" (the model's own answers) or "A" (the ground truth; warm start too)
    channel: str
    stats: EpisodeStats | None = None  # None on an M-step that reuses its E-step's rows

    @property
    def sampled(self) -> bool:
        """Fresh rollouts this step (channel B, not an M-step reusing a batch): what its F1 says something of."""
        return self.channel == "B" and self.stats is not None

    def bar(self) -> str:
        return f"f1 {self.stats.f1:.2f}" if self.stats is not None else ""

    def scalars(self) -> dict[str, float]:
        values = {"train/channel_b": float(self.channel == "B")}
        st = self.stats
        if st is not None and self.channel == "B":
            n = max(st.rollouts, 1)
            values.update(
                {
                    "train/f1": st.f1,
                    "train/precision": st.precision,
                    "train/recall": st.recall,
                    "train/dropped": float(st.dropped),
                    "train/truncated": float(st.truncated),
                    "train/truncation_rate": st.truncation_rate,
                    "train/duplicate_rate": st.duplicate_rate,
                    # unmatched objects no explorer supports, out of the prefix (recipe generation 2)
                    "train/dead_anchors": st.dead / n,
                    "train/predicted_per_gt": st.count_ratio,
                    "train/predicted_objects": st.predicted / n,
                    "train/gt_objects": st.gt_objects / n,
                }
            )
        return values

    def series(self) -> dict[str, float]:
        # Rollout F1 of steps that sampled (a channel-A step's empty answers score 0 and say nothing).
        return {"f1": self.stats.f1} if self.stats is not None and self.channel == "B" else {}

    @classmethod
    def summary_rows(cls, steps: Sequence[StepFigures]) -> list[tuple[str, str]]:
        rows = []
        f1 = _series(steps).get("f1")
        if f1:
            rows.append(("rollout F1 (first -> last)", f"{f1[0]:.3f} -> {f1[-1]:.3f}"))
        rates = rollout_rates(steps)
        if rates is not None:
            rows.append(
                (
                    f"training rollouts (mean of {rates['steps']:.0f} rollout-matching steps)",
                    f"truncated {rates['truncation_rate']:.1%}, duplicates {rates['duplicate_rate']:.1%}, "
                    f"{rates['predicted_per_gt']:.2f} predicted per ground-truth object",
                )
            )
        return rows


def rollout_rates(steps: Sequence[StepFigures]) -> dict[str, float] | None:
    """What the training rollouts looked like: the truncation rate, duplicate rate and predicted objects per
    ground-truth object, each the mean over the steps that trained on fresh rollouts (channel B; not the
    ground-truth steps, which generate nothing, nor the M-steps reusing a batch). None without such a step."""
    stats = [
        f.stats
        for f in steps
        if isinstance(f, RolloutMatchingFigures) and f.channel == "B" and f.stats is not None and f.stats.rollouts
    ]
    if not stats:
        return None
    n = len(stats)
    return {
        "steps": float(n),
        "truncation_rate": sum(s.truncation_rate for s in stats) / n,
        "duplicate_rate": sum(s.duplicate_rate for s in stats) / n,
        "predicted_per_gt": sum(s.count_ratio for s in stats) / n,
    }


@dataclass
class GrpoStats(StepFigures):
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

    def bar(self) -> str:
        return f"reward {self.reward_mean:.3f}"

    def series(self) -> dict[str, float]:
        return {"reward": self.reward_mean, "mismatch_kl": self.mismatch_kl}

    @classmethod
    def summary_rows(cls, steps: Sequence[StepFigures]) -> list[tuple[str, str]]:
        series = _series(steps)
        reward, kl = series.get("reward"), series.get("mismatch_kl")
        rows = []
        if reward:
            rows.append(("mean reward (first -> last)", f"{reward[0]:.3f} -> {reward[-1]:.3f}"))
        if kl:  # KL(servers' sampling policy || learner's), per token
            rows.append(("mismatch KL (first -> last, max)", f"{kl[0]:.2e} -> {kl[-1]:.2e}, {max(kl):.2e}"))
        return rows

    def gauges(self) -> None:
        m.REWARD.labels("mean").set(self.reward_mean)
        m.REWARD.labels("std").set(self.reward_std)
        m.REWARD.labels("group_std").set(self.group_reward_std)
        for label, v in self.rewards.items():
            m.REWARD_PART.labels(label).set(v)
        m.ZERO_STD_GROUPS.set(self.zero_std_groups)
        m.CLIP_FRACTION.set(self.clip_fraction)
        m.GRPO_KL.set(self.kl)
        m.MISMATCH_KL.set(self.mismatch_kl)
        m.CORRECTED_FRACTION.set(self.corrected_fraction)
        m.DROPPED_GROUPS.inc(self.dropped_groups)
        m.RESAMPLED_GROUPS.inc(self.resampled_groups)
        m.OVERLONG_ANSWERS.labels("masked").inc(self.overlong_masked)
        m.OVERLONG_ANSWERS.labels("penalised").inc(self.overlong_penalised)
        m.COMPLETION_LENGTH.set(self.completion_length)


@dataclass
class StepResult:
    step: int  # 1-based optimizer step just finished
    weight_version: int  # version the step's rollouts came from
    # This step's fresh rollouts in input order (empty on M-steps). Rank 0 holds the whole global
    # batch's; another rank holds its own share.
    rollouts: list[Rollout]
    record_ids: list[str]  # global raw batch this step trained on (all ranks)
    loss: float  # token-level mean over every rank's rows
    parts: dict[str, float]  # the loss's named parts (the objective's loss_keys past "loss"), over every rank
    rows: int  # packed rows over all ranks
    fill: float  # mean fill of those rows
    seconds: float
    rank: int = 0
    local_record_ids: list[str] = field(default_factory=list)  # this rank's contiguous share
    local_rows: int = 0  # rows this rank trained on
    local_tokens: int = 0
    figures: StepFigures = field(default_factory=StepFigures)  # the objective's own (module doc)


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
    history: list[StepResult] = field(default_factory=list)
    pictures: list[Path] = field(default_factory=list)  # rollouts drawn on their images (vision-language runs)
    # held-out (step, label-aware F1 at eval_iou, label-aware mAP); `held_out` has every figure of each
    evaluations: list[tuple[int, float, float]] = field(default_factory=list)
    eval_iou: float = 0.5  # the IoU threshold of the held-out F1 (training.eval.iou)
    held_out: list[HeldOutFigures] = field(default_factory=list)  # the same evaluations, every figure
    eval_pictures: list[Path] = field(default_factory=list)  # the last held-out answers drawn on their images
    log_dir: Path | None = None  # TensorBoard event files (rank 0)
    exported: Path | None = None  # the Hugging Face folder written at the end (training.export)
    run_id: str = ""  # the learner run whose weight version `weight_version` is

    @classmethod
    def of_run(
        cls, state: TrainState, history: Sequence[StepResult], evaluations: Sequence[Evaluation], **fields: Any
    ) -> Summary:
        """The summary of a run at `state`, from its steps and held-out evaluations; `fields` the rest."""
        losses = [h.loss for h in history]
        return cls(
            steps=state.step,
            first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"),
            losses=losses,
            weight_version=state.version,
            run_id=state.run_id,
            phase_seconds=dict(state.phase_seconds),
            history=list(history),
            evaluations=[(e.step, e.f1, e.map) for e in evaluations],
            held_out=[e.figures() for e in evaluations],
            **fields,
        )

    def series(self, name: str) -> list[float]:
        """The value of the objective's figure `name` at each step that has it (`StepFigures.series`), in order:
        e.g. "f1" (rollout matching's rollout F1), "reward" and "mismatch_kl" (GRPO's)."""
        return _series([h.figures for h in self.history]).get(name, [])

    def objective_rows(self) -> list[tuple[str, str]]:
        """The summary's rows of the objective's figures, (label, text), that both summaries print."""
        rows: list[tuple[str, str]] = []
        for kind in dict.fromkeys(type(h.figures) for h in self.history):  # one kind per run, in practice
            rows += kind.summary_rows([h.figures for h in self.history if type(h.figures) is kind])
        return rows

    @property
    def final_evaluation(self) -> tuple[int, float, float] | None:
        """The last held-out (step, F1, mAP): what the trained model scores."""
        return self.evaluations[-1] if self.evaluations else None

    @property
    def best_evaluation(self) -> tuple[int, float, float] | None:
        """The held-out (step, F1, mAP) of the highest F1 (the earliest on a tie)."""
        return max(self.evaluations, key=lambda e: (e[1], -e[0])) if self.evaluations else None
