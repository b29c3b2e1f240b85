"""spec.training.recipe: which rollout-matching objective trains, and the matching, target and loss settings
whose defaults depend on its generation (`GENERATION_DEFAULTS`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from rmsft.jobspec.base import _Learner

RECIPE_EXPLORERS_STALENESS = (
    "spec.training.recipe.explorers.count must be 0 with spec.training.rollout.max_staleness > 0 (explorers are "
    "generated on their step, not ahead)"
)
RECIPE_SECOND_ONLY = "spec.training.recipe: {name} applies to recipe generation 2 only"


# Defaults that depend on `training.recipe.generation` (first, second): a field left unset takes its
# generation's value (learner/train/config.py resolves them; docs/method.md has why each differs).
GENERATION_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "matching.iou_gate": (0.3, 0.5),
    "matching.fp_cost": (0.5, 1.0),
    "matching.fn_cost": (2.0, 1.2),
    "targets.supervise_fn_desc": (False, True),
    "loss.coord_soft_ce": (1.0, 0.1),
    "loss.coord_w1": (1.0, 0.02),
    "loss.coord_ce": (0.0, 0.02),
    "loss.smooth_l1": (0.0, 1.0),
    "loss.ciou": (0.0, 0.5),
    "loss.normalization": ("count", "weighted"),
    "rollout.repetition_penalty": (1.0, 1.1),
}


def _by_generation(key: str) -> str:
    first, second = (str(v).lower() if isinstance(v, bool) else v for v in GENERATION_DEFAULTS[key])
    return f" Unset: {second} (recipe generation 2), {first} (generation 1)."


class MatchingConfig(_Learner):
    """Hungarian matching of predicted to ground-truth objects (geometry only: labels are not compared)."""

    iou_gate: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Pairs below this IoU are never matched." + _by_generation("matching.iou_gate"),
    )
    fp_cost: float | None = Field(
        None, ge=0.0, description="Cost of leaving a prediction unmatched." + _by_generation("matching.fp_cost")
    )
    fn_cost: float | None = Field(
        None,
        ge=0.0,
        description="Cost of leaving a ground-truth object unmatched." + _by_generation("matching.fn_cost"),
    )


class TargetsConfig(_Learner):
    supervise_fn_desc: bool | None = Field(
        None,
        description="Cross-entropy on the labels of appended missed objects. The first generation leaves them out "
        "(a model that can name objects is not blamed for a miss's name); the second supervises them."
        + _by_generation("targets.supervise_fn_desc"),
    )


class LossConfig(_Learner):
    ce: float = Field(1.0, ge=0.0, description="Weight of the token cross-entropy.")
    coord_soft_ce: float | None = Field(
        None,
        ge=0.0,
        description="Soft cross-entropy of coordinate tokens against a Gaussian over bins."
        + _by_generation("loss.coord_soft_ce"),
    )
    coord_w1: float | None = Field(
        None,
        ge=0.0,
        description="W1 distance between the predicted and target bin distributions." + _by_generation("loss.coord_w1"),
    )
    coord_gate: float = Field(
        1.0, ge=0.0, description="logsumexp(all logits) - logsumexp(coordinate logits) at coordinate positions."
    )
    coord_sigma: float = Field(2.0, gt=0.0, description="Width (bins) of the soft cross-entropy's Gaussian.")
    coord_ce: float | None = Field(
        None, ge=0.0, description="Hard cross-entropy of the target bin's token." + _by_generation("loss.coord_ce")
    )
    smooth_l1: float | None = Field(
        None,
        ge=0.0,
        description="SmoothL1 between a box's expected coordinates (sum_k p(k) k / 999) and the "
        "ground truth, for matched and appended boxes." + _by_generation("loss.smooth_l1"),
    )
    ciou: float | None = Field(
        None,
        ge=0.0,
        description="1 - CIoU of the same expected box and the ground truth." + _by_generation("loss.ciou"),
    )
    normalization: Literal["weighted", "count"] | None = Field(
        None,
        description="How each term is averaged over a step: weighted = sum(w * loss) / sum(w) (the reference's; "
        "an object's weight, e.g. an explorer-recovered one's, then reweights the step instead of adding loss), "
        "count = sum(w * loss) / number of positions." + _by_generation("loss.normalization"),
    )
    logits: Literal["auto", "fused", "chunked", "full"] = Field(
        "auto",
        description="How the loss gets its logits (every objective, GRPO's log-probs and its reference "
        "policy's too): chunked = only at target positions, logits_chunk of them at a time, the output head "
        "applied per chunk and recomputed in backward (a prompt's and its image's positions get none, and one "
        "chunk's logits exist at a time); fused = as chunked, but the token cross-entropy and GRPO's log-probs (at "
        "grpo.temperature 1) in liger-kernel's fused linear cross-entropy kernel (CUDA; the GPU image has it), the "
        "coordinate and unlikelihood terms chunked; refused on a CPU job, under deepspeed_stage 3, or where "
        "the learner has no CUDA or no liger-kernel (set chunked there); auto = fused where it can run, else "
        "chunked; full = the model's logits over the whole packed row [L, vocabulary]. Same loss and gradients "
        "(learner/core/head.py, learner/core/fused.py).",
    )
    logits_chunk: int = Field(
        1024,
        ge=1,
        le=65536,
        description="chunked (and fused's chunked terms): target positions whose logits are "
        "made at once (memory: "
        "logits_chunk x vocabulary x about 12 bytes while the loss runs).",
    )


class DuplicateControl(_Learner):
    """Recipe generation 2: duplicates of another object of the same answer are taken out of the kept prefix."""

    iou: float = Field(0.9, gt=0.0, le=1.0, description="Same normalized label and IoU at least this: a duplicate.")
    center_radius: float = Field(
        0.8,
        ge=0.0,
        description="Or same label and centres closer than this times sqrt(the smaller box's area), "
        "on the 1000-bin grid (0: IoU alone).",
    )
    method: Literal["clusters", "greedy"] = Field(
        "clusters",
        description="clusters (the reference's): duplicate-like objects are joined into clusters; a "
        "cluster stays whole when two or more members are held by an explorer or when it is spread wide (a row of "
        "like objects), else its best-supported member stays and the others are duplicates. greedy: each object "
        "against the earlier kept ones, in answer order.",
    )
    spread: float = Field(
        2.5,
        gt=0.0,
        description="clusters: a cluster whose members' centres lie farther apart than this times "
        "center_radius times sqrt(the largest member's area) is a row, kept whole.",
    )
    unlikelihood: float = Field(
        1.0, ge=0.0, description="Weight of -log(1 - p) on the token that started each duplicate (0: removal only)."
    )


class ExplorerConfig(_Learner):
    """Recipe generation 2: sampled answers beside the anchor. Ground-truth objects the anchor missed and an explorer
    found get `recovered_weight` on their label and coordinate terms. Each explorer is one more rollout per prompt."""

    count: int = Field(1, ge=0, le=8, description="Explorers per prompt on rollout-matching steps (0: anchor only).")
    temperature: float = Field(0.7, gt=0.0, le=10.0, description="Sampling temperature of the explorers.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling of the explorers.")
    top_k: int = Field(64, ge=-1, description="Top-k of the explorers (-1: off).")
    recovered_weight: float = Field(
        2.0, gt=0.0, description="Weight of an object the anchor missed and an explorer found."
    )
    support_iou: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="An explorer's object at this IoU or more supports an anchor object: keeps "
        "an unmatched one in the prefix (dead anchors) and counts for duplicate exemptions (same label there).",
    )


class RecipeConfig(_Learner):
    """Which rollout-matching objective trains (docs/method.md). Generation 2 (the default) alternates channel A
    (teacher forcing on the ground truth) and channel B (rollout matching with a clean prefix: duplicates removed
    and penalised, structure and closure supervised, box losses); generation 1 trains every step after the warm
    start on the model's own answer with unmatched predictions kept and no cost on extra ones."""

    generation: Literal[1, 2] = Field(2, description="2: two channels, clean prefix (default). 1: the first objective.")
    channel_b_ratio: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Generation 2: share of optimizer steps after the warm start that are rollout matching "
        "(channel B, chosen deterministically: step s is B when floor((s+1) r) > floor(s r)); the rest teacher-force "
        "the ground truth (channel A). Unset: 0.05.",
    )
    anchor: Literal["greedy", "sampled"] | None = Field(
        None,
        description="Generation 2: the answer a B step trains on is greedy (temperature 0; unset) or sampled "
        "with training.rollout's temperature.",
    )
    structure_ce: float | None = Field(
        None,
        ge=0.0,
        description="Generation 2: cross-entropy weight on the kept prefix's structure tokens (keys, "
        "brackets, punctuation). Unset: 1.0.",
    )
    prefix_labels: bool | None = Field(
        None,
        description="Generation 2: cross-entropy (at structure_ce) on the labels of the kept prefix's objects, "
        "as the reference's code trains them; false: the labels the model wrote get no loss. Unset: true.",
    )
    dead_anchors: Literal["remove", "keep"] | None = Field(
        None,
        description="Generation 2: unmatched objects of the answer that no explorer supports (dead anchors; "
        "see explorers.support_iou): remove them from the prefix, so that closing is trained right after the last "
        "supported object (the reference's default), or keep them with no loss on their content. With no explorer "
        "(explorers.count 0) every unmatched object is dead. Unset: remove.",
    )
    duplicates: DuplicateControl | None = Field(None, description="Generation 2: duplicate control (unset: defaults).")
    explorers: ExplorerConfig | None = Field(None, description="Generation 2: explorer rollouts (unset: defaults).")

    SECOND_ONLY: ClassVar[tuple[str, ...]] = (
        "channel_b_ratio",
        "anchor",
        "structure_ce",
        "prefix_labels",
        "dead_anchors",
        "duplicates",
        "explorers",
    )
