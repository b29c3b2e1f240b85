"""spec.training.grpo: the GRPO trainer's group sampling, clipped objective and rewards (`spec.trainer: grpo`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

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
        None, gt=0.0, le=10.0, description="Upper clip: 1 + clip_eps_high (DAPO's clip-higher); unset = clip_eps.",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, le=100.0, description="Weight of the KL to the reference policy (the base weights, adapters "
        "disabled); 0 = no reference forward.",
    )
    scale_rewards: bool = Field(True, description="Divide each group's centred rewards by their std.")
    loss_norm: Literal["token", "sequence"] = Field(
        "token", description="token: mean over every completion token of the step; sequence: mean of each "
        "completion's token mean.",
    )
    rewards: list[RewardEntry] = Field(
        default_factory=lambda: [RewardEntry(name="detection")], min_length=1, max_length=16,
        description="Rewards summed with their weights (default: the detection reward).",
    )
    reward_workers: int = Field(4, ge=1, le=64, description="Threads scoring completions.")
