"""The job spec's `training` section translated into the pure core's configs, in one place.

The core (learner/core/) knows nothing of the job spec: it takes these small configs. Anything the
training loop needs that is derived from the spec is derived here, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from learner.core.clean_prefix import CleanPrefixConfig, DuplicateConfig
from learner.core.codec import OutputFormat, output_format
from learner.core.grpo import GrpoConfig
from learner.core.losses import LossWeights
from learner.core.match import MatchConfig
from learner.core.schedule import is_channel_b
from learner.core.targets import TargetConfig
from rmsft.jobspec import GENERATION_DEFAULTS, DuplicateControl, ExplorerConfig, SyncSpec, SyncTransport, TrainingConfig


@dataclass(frozen=True)
class Recipe:
    """`training.recipe` resolved: which objective, which steps are channel B, how B steps sample and build."""

    generation: int
    channel_b_ratio: float  # 1.0 for generation 1: every step after the warm start is a rollout step
    duplicates: DuplicateConfig | None  # generation 2 only
    clean: CleanPrefixConfig | None  # generation 2 only
    explorers: int  # explorer rollouts per prompt on a B step
    explorer_sampling: dict[str, Any] | None
    unlikelihood: float = 0.0  # weight of the duplicates' unlikelihood term (generation 2)

    def channel_b(self, k: int) -> bool:
        """E-step `k` (counted from the first step after the warm start) is rollout matching."""
        return is_channel_b(k, self.channel_b_ratio)


@dataclass(frozen=True)
class CoreConfigs:
    weights: LossWeights
    matching: MatchConfig
    targets: TargetConfig
    sampling: dict[str, Any]  # the Generate call's sampling parameters (generation 2: the anchor's)
    m_steps: int  # optimizer steps per rollout (1 = no rollout buffer)
    packing: tuple[int, int, float]  # Packer(packing_length, packing_buffer, min_fill)
    # `training.format` with its options; a pixels format still has to be bound per record (`for_image`).
    fmt: OutputFormat
    recipe: Recipe = Recipe(1, 1.0, None, None, 0, None)


def resolved(cfg: TrainingConfig, key: str) -> Any:
    """A generation-dependent field of `training` (rmsft.jobspec.GENERATION_DEFAULTS): its value, or when unset
    its recipe generation's default."""
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    if value is not None:
        return value
    return GENERATION_DEFAULTS[key][cfg.recipe.generation - 1]


def recipe_setup(cfg: TrainingConfig) -> Recipe:
    r = cfg.recipe
    if r.generation == 1:
        return Recipe(1, 1.0, None, None, 0, None)
    dup = r.duplicates or DuplicateControl()
    exp = r.explorers or ExplorerConfig()
    # Explorers are a second Generate call on the step; with rollouts generated ahead (max_staleness > 0) an
    # unset explorers section means none (the spec refuses an explicit count there).
    count = exp.count if (r.explorers is not None or cfg.rollout.max_staleness == 0) else 0
    return Recipe(
        generation=2,
        channel_b_ratio=0.05 if r.channel_b_ratio is None else r.channel_b_ratio,
        duplicates=DuplicateConfig(
            iou=dup.iou,
            center_radius=dup.center_radius,
            clusters=dup.method == "clusters",
            support_iou=exp.support_iou,
            spread=dup.spread,
        ),
        clean=CleanPrefixConfig(
            structure_ce=1.0 if r.structure_ce is None else r.structure_ce,
            supervise_fn_desc=resolved(cfg, "targets.supervise_fn_desc"),
            unlikelihood=dup.unlikelihood > 0,
            recovered_weight=exp.recovered_weight,
            prefix_labels=r.prefix_labels is not False,
            dead_anchors=r.dead_anchors != "keep",
        ),
        explorers=count,
        explorer_sampling={
            "max_tokens": cfg.rollout.max_tokens,
            "temperature": exp.temperature,
            "top_p": exp.top_p,
            "top_k": exp.top_k,
            "repetition_penalty": resolved(cfg, "rollout.repetition_penalty"),
            "n": count,
        }
        if count
        else None,
        unlikelihood=dup.unlikelihood,
    )


def core_configs(cfg: TrainingConfig) -> CoreConfigs:
    dec = cfg.rollout
    recipe = recipe_setup(cfg)
    greedy_anchor = recipe.generation == 2 and (cfg.recipe.anchor or "greedy") == "greedy"
    return CoreConfigs(
        weights=LossWeights(
            ce=cfg.loss.ce,
            soft_ce=resolved(cfg, "loss.coord_soft_ce"),
            w1=resolved(cfg, "loss.coord_w1"),
            gate=cfg.loss.coord_gate,
            sigma=cfg.loss.coord_sigma,
            coord_ce=resolved(cfg, "loss.coord_ce"),
            smooth_l1=resolved(cfg, "loss.smooth_l1"),
            ciou=resolved(cfg, "loss.ciou"),
            unlikelihood=recipe.unlikelihood,
            weighted_mean=resolved(cfg, "loss.normalization") == "weighted",
        ),
        matching=MatchConfig(
            iou_gate=resolved(cfg, "matching.iou_gate"),
            fp_cost=resolved(cfg, "matching.fp_cost"),
            fn_cost=resolved(cfg, "matching.fn_cost"),
        ),
        targets=TargetConfig(supervise_fn_desc=resolved(cfg, "targets.supervise_fn_desc")),
        sampling={
            "max_tokens": dec.max_tokens,
            "temperature": 0.0 if greedy_anchor else dec.temperature,
            "top_p": 1.0 if greedy_anchor else dec.top_p,
            "top_k": -1 if greedy_anchor else dec.top_k,
            "repetition_penalty": resolved(cfg, "rollout.repetition_penalty"),
        },
        m_steps=cfg.buffer.m_steps if cfg.buffer.enabled else 1,
        packing=(cfg.packing_length, cfg.packing_buffer, cfg.packing_min_fill),
        fmt=output_format(cfg.format, coordinates=cfg.format_options.coordinates, polygons=cfg.format_options.polygons),
        recipe=recipe,
    )


@dataclass(frozen=True)
class GrpoSetup:
    """`training.grpo` for the GRPO objective: the loss's config, the Generate call's sampling (n samples per
    prompt, each with its log-probs), the group size and the packer (every sample of a step fits its buffer)."""

    loss: GrpoConfig
    sampling: dict[str, Any]
    n: int
    packing: tuple[int, int, float]


def grpo_setup(cfg: TrainingConfig) -> GrpoSetup:
    """Sampling at `grpo.temperature` alone (top-p, top-k and penalties off, which the job spec enforces): the
    servers report log-probs of that distribution (`logprobs_mode: processed`, rmsft.serve_options) and the loss
    divides the learner's logits by the same temperature, so both sides of the importance ratio are one
    distribution. The packer takes a whole step's samples at once and is drained every step (min_fill 0)."""
    g = cfg.grpo
    return GrpoSetup(
        loss=GrpoConfig(
            clip_eps=g.clip_eps,
            clip_eps_high=g.clip_eps_high,
            kl_coef=g.kl_coef,
            scale_rewards=g.scale_rewards,
            loss_norm=g.loss_norm,
            temperature=g.temperature,
            correction=g.correction,
            correction_low=g.correction_low,
            correction_high=g.correction_high,
        ),
        sampling={"max_tokens": g.max_tokens, "temperature": g.temperature, "n": g.group_size, "logprobs": True},
        n=g.group_size,
        packing=(cfg.packing_length, max(cfg.packing_buffer, cfg.prompts_per_step * g.group_size), 0.0),
    )


def learning_rate(cfg: TrainingConfig, step: int) -> float:
    """`training.lr` at optimizer step `step` (0-based): linear warmup over `warmup_steps`, then constant, or
    with `lr_schedule: cosine` decayed to `lr_min_ratio * lr` at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.lr_min_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def sync_transport(sync: SyncSpec, shared_dir: str) -> SyncTransport:
    """The weight-sync transport this learner uses. `shared_dir`: the shared-weights dir it was given
    (RMSFT_SHARED_WEIGHTS_DIR: set by `rmsft local` unless the job asks for grpc, and by the operator
    in both the learner and the rollout pods of a job that asks for shm); auto is shm exactly when
    there is one. Asking for shm without one is an error, never a silent fallback to grpc."""
    if sync.transport in ("grpc", "nccl"):
        return sync.transport
    if shared_dir:
        return "shm"
    if sync.transport == "shm":
        raise ValueError(
            "spec.sync.transport is 'shm' but this learner has no shared-weights dir (RMSFT_SHARED_WEIGHTS_DIR "
            "is unset): run it under `rmsft local` or the operator, which provide one, or use transport grpc"
        )
    return "grpc"
