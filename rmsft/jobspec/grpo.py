"""spec.training.grpo: the GRPO objective's group sampling, clipped objective and rewards (`spec.trainer: grpo`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rmsft.jobspec.base import _Learner


class RewardEntry(_Learner):
    """One GRPO reward: a built-in name (`detection`, `text_match`), an entry point of the group `rmsft.rewards`,
    or an import path `package.module:callable`; its params, and its weight in the sum (learner/rewards/scoring.py)."""

    name: str = Field(..., min_length=1, description="Built-in, entry point of rmsft.rewards, or package.module:attr.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of this reward in the sum.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments the reward is built with.")


class GrpoTrainingConfig(_Learner):
    """GRPO (`spec.trainer: grpo`): `group_size` sampled completions per prompt, scored by `rewards`, group-normalised
    advantages, the clipped objective. Sampling uses `temperature` and `max_tokens` from here (top-p, top-k and
    repetition penalty stay off: the learner's log-probs must be those of the distribution sampled from);
    `training.rollout` supplies the seed, the chunking and the request timeout. Ignored by rollout_matching."""

    # Not `n`: YAML 1.1 readers (kubectl, helm: go-yaml) take a bare `n` key for the boolean false.
    group_size: int = Field(8, ge=2, le=64, description="Completions sampled per prompt (n, the group).")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature of the completions.")
    max_tokens: int = Field(512, ge=1, description="Longest completion, in tokens.")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="Lower clip of the importance ratio: 1 - clip_eps.")
    clip_eps_high: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="Upper clip: 1 + clip_eps_high (DAPO's clip-higher); unset = clip_eps.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="Weight of the KL to the reference policy (the base weights, adapters "
        "disabled); 0 = no reference forward.",
    )
    scale_rewards: bool = Field(True, description="Divide each group's centred rewards by their std.")
    loss_norm: Literal["token", "sequence"] = Field(
        "token",
        description="token: mean over every completion token of the step; sequence: mean of each "
        "completion's token mean.",
    )
    rewards: list[RewardEntry] = Field(
        default_factory=lambda: [RewardEntry(name="detection")],
        min_length=1,
        max_length=16,
        description="Rewards summed with their weights (default: the detection reward).",
    )
    reward_workers: int = Field(4, ge=1, le=64, description="Threads scoring completions.")
    # Train/inference mismatch (learner/core/grpo.py's module doc has the formulas and the peers' names).
    correction: Literal["none", "tis", "mis", "icepop"] = Field(
        "none",
        description="Importance correction of the gap between the servers' and the learner's log-probs: "
        "none (the PPO clip against the servers' log-probs), tis (token-level truncated IS), mis (sequence-level "
        "masked IS), icepop (token-level masking of both tails).",
    )
    correction_low: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Lower bound of the learner/server probability ratio kept (mis: the "
        "answer's, icepop: the token's); unset: mis 0, icepop 0.5. Not for tis.",
    )
    correction_high: float | None = Field(
        None,
        gt=1.0,
        le=1000.0,
        description="Upper bound: tis truncates the ratio there, mis and icepop drop what "
        "passes it; unset: tis 2, mis 2, icepop 5.",
    )
    # Sampling rules (learner/train/objectives/grpo.py).
    dynamic_sampling: Literal["off", "drop", "resample"] = Field(
        "off",
        description="Groups whose rewards are all equal (no signal): off (kept, zero advantage), drop (left "
        "out of the loss and its normaliser), resample (sampled again with new seeds, up to "
        "dynamic_sampling_rounds times, then dropped).",
    )
    dynamic_sampling_rounds: int = Field(
        1,
        ge=1,
        le=8,
        description="dynamic_sampling resample: most extra sampling rounds of a step's flat groups.",
    )
    overlong: Literal["off", "mask", "penalty"] = Field(
        "off",
        description="Answers cut at max_tokens: off (trained as they are), mask (their tokens left out of the "
        "loss; they still count in their group's advantage), penalty (DAPO's soft overlong punishment added to the "
        "reward of answers longer than max_tokens - overlong_buffer).",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="overlong penalty: the last tokens of the budget over which the penalty ramps from 0 "
        "to overlong_penalty; unset: max_tokens // 4. Must be < max_tokens.",
    )
    overlong_penalty: float = Field(
        1.0,
        gt=0.0,
        le=100.0,
        description="overlong penalty: the penalty at max_tokens (subtracted from the reward).",
    )

    @model_validator(mode="after")
    def _bands(self) -> GrpoTrainingConfig:
        errs = grpo_config_errors(self)
        if errs:
            raise ValueError("; ".join(errs))
        return self


# Mirrored by CEL rules on spec.training.grpo (operator/rmsft_operator/crd.py LOCAL_RULES).
CORRECTION_NONE_BOUNDS = "spec.training.grpo.correction_low / correction_high need a correction (tis, mis or icepop)"
CORRECTION_TIS_LOW = (
    "spec.training.grpo.correction tis truncates from above only: set correction_high, not correction_low"
)
OVERLONG_BUFFER = "spec.training.grpo.overlong_buffer must be < max_tokens"


def grpo_config_errors(g: GrpoTrainingConfig) -> list[str]:
    """What `spec.training.grpo` cannot hold across its own fields."""
    errs = []
    if g.correction == "none" and (g.correction_low is not None or g.correction_high is not None):
        errs.append(CORRECTION_NONE_BOUNDS)
    if g.correction == "tis" and g.correction_low is not None:
        errs.append(CORRECTION_TIS_LOW)
    if g.overlong_buffer is not None and g.overlong_buffer >= g.max_tokens:
        errs.append(OVERLONG_BUFFER)
    return errs
