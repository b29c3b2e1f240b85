"""spec.training: the learner's own config (snake_case keys): data, answer format, optimizer and schedule,
checkpoints, evaluation, export, LoRA, rollout decoding and reuse; the recipe and GRPO sections are
their own modules.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rmsft.jobspec.base import _Learner
from rmsft.jobspec.grpo import GrpoTrainingConfig
from rmsft.jobspec.recipe import (
    RECIPE_EXPLORERS_STALENESS,
    RECIPE_SECOND_ONLY,
    LossConfig,
    MatchingConfig,
    RecipeConfig,
    TargetsConfig,
)

TRAIN_COORD_ROWS_QWEN_JSON = (
    "spec.training.lora.coord_rows applies to coordinate-token formats (coordexp, "
    "coordjson): qwen_json has no coordinate tokens"
)


class DataConfig(_Learner):
    """The training records: one JSONL file (docs/data.md has the format)."""

    path: str = Field(..., min_length=1, description="JSONL file of samples (image + objects).")
    image_root: str | None = Field(None, description="Base folder for relative image paths.")

    @field_validator("path")
    @classmethod
    def _jsonl(cls, v: str) -> str:
        if not v.endswith((".jsonl", ".jsonl.gz")):
            raise ValueError(f"{v!r} is not a .jsonl file")
        return v


class FreezeConfig(_Learner):
    """Parts of a vision-language model kept fixed (and never resent by FULL sync). LoRA adapters go on
    the language model only, whatever is frozen here."""

    vision_tower: bool = Field(True, description="The image encoder's blocks and patch embedding.")
    aligner: bool = Field(True, description="The merger that maps image features to the language model.")
    embeddings: bool = Field(False, description="Input embeddings (tied output head included) under finetune: full.")


class CheckpointConfig(_Learner):
    """Learner checkpoints (model, optimizer, data position): what a restarted learner resumes from."""

    dir: str = Field(
        "/checkpoints",
        min_length=1,
        description="Folder of the step-<n> checkpoints (in a cluster: "
        "learner.checkpointClaim mounted here, else a volume that lives as long as the pod).",
    )
    every: int = Field(0, ge=0, description="Save every N optimizer steps (0 = only at the end).")
    every_minutes: int | None = Field(
        None,
        ge=0,
        description="Also save after the first step that ends this many minutes after the last save "
        "(0 = never by time). Unset: 30 with spec.learner.checkpointClaim (a week-long run killed outright, an OOM "
        "or a lost node, loses at most that), 0 without (an emptyDir goes with the pod).",
    )
    keep: int = Field(
        2,
        ge=1,
        description="Newest checkpoints of this run kept; its older ones are deleted (another run's never are).",
    )
    resume_any: bool = Field(
        False,
        description="Resume the newest checkpoint even when another job, or other model, objective, data, "
        "format, trained weights, seed or batch, wrote it (refused by default, naming what differs).",
    )


class EvalConfig(_Learner):
    """Held-out evaluation: greedy answers to records the learner never trains on, from the same server
    pool (same version fencing), scored with F1 at an IoU threshold and COCO mAP."""

    data: str | None = Field(None, description="JSONL of held-out records (training schema); unset = no evaluation.")
    image_root: str | None = Field(None, description="Base folder for its relative image paths.")
    every: int = Field(0, ge=0, description="Evaluate every N optimizer steps (0 = only at the end).")
    max_samples: int = Field(64, ge=1, le=100_000, description="Records evaluated (the file's first N).")
    max_tokens: int | None = Field(None, ge=1, description="Answer length; unset = training.rollout.max_tokens.")
    iou: float = Field(0.5, gt=0.0, le=1.0, description="IoU threshold of the reported F1.")
    pictures: int = Field(4, ge=0, le=64, description="Answers drawn on their images per evaluation (TensorBoard).")

    @field_validator("data")
    @classmethod
    def _jsonl(cls, v: str | None) -> str | None:
        if v is not None and not v.endswith((".jsonl", ".jsonl.gz")):
            raise ValueError(f"{v!r} is not a .jsonl file")
        return v


class ExportConfig(_Learner):
    """The trained model as a Hugging Face folder at the end of the run (what `rmsft export` writes)."""

    enabled: bool = Field(True, description="Write it (a merged model costs the model's size on disk).")
    dir: str | None = Field(None, description="Where; unset = <checkpoint.dir>/export.")
    adapter: bool = Field(False, description="The PEFT adapter alone instead of merged weights (LoRA/DoRA).")


class LoraConfig(_Learner):
    """LoRA adapters on the language model (training.finetune: lora)."""

    r: int = Field(16, ge=1, le=512, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="Scaling numerator: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters (matched by PEFT).",
    )
    use_dora: bool = Field(False, description="DoRA (weight-decomposed LoRA); served as full weights only.")
    coord_rows: bool | None = Field(
        None,
        description="Train the 1000 coordinate tokens' embedding rows (and the tied output head's) beside the "
        "adapter (peft trainable tokens): rmsft prepare-model adds them untrained, and under LoRA alone they would "
        "stay so (the reference trains them). A FULL sync and the export carry them merged; a vLLM LoRA adapter "
        "cannot, so sync.mode adapter falls back to FULL (auto picks FULL). Unset: true with a coordinate-token "
        "format (coordexp, coordjson), false with qwen_json (which has no coordinate tokens).",
    )


class RolloutDecoding(_Learner):
    """How the learner asks for rollouts: sampling, seeds, deadlines, rollouts generated ahead."""

    max_tokens: int = Field(1024, ge=1, description="Longest rollout answer, in tokens (longer: truncated).")
    temperature: float = Field(
        1.0,
        ge=0.0,
        le=10.0,
        description="Sampling temperature of rollouts (recipe generation 2: of a sampled "
        "anchor; the default anchor is greedy).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of rollouts.")
    top_k: int = Field(-1, ge=-1, description="-1 = disabled.")
    repetition_penalty: float | None = Field(
        None,
        gt=0.0,
        description="vLLM repetition penalty (1: off) of the rollouts (generation 2: the anchor's and "
        "the explorers'). Unset: 1.1 (recipe generation 2, the reference's), 1.0 (generation 1; GRPO: off).",
    )
    seed: int = Field(0, ge=0, description="Base seed of rollout sampling (per request: base + step stride + index).")
    generate_batch_size: int | None = Field(
        None,
        ge=1,
        description="Prompts per Generate call (chunk size). Unset: each server gets its whole share in one call "
        "(cut only to bound the message size), which its engine batches continuously.",
    )
    request_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of one Generate call before it is retried on another server."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=4,
        description="Rollouts generated ahead, while the learner trains (learner/train/overlap.py). 0: every rollout "
        "comes from the learner's current weights, generated after the previous sync (synchronous). k >= 1: the next "
        "E-steps' rollouts (at most k) generate on the pool during training; a rollout is trained on only when the "
        "learner's weight version minus the one that generated it is <= k, else it is dropped and regenerated.",
    )
    inflight: bool = Field(
        False,
        description="Weight syncs do not wait for the rollouts generating ahead (needs max_staleness >= 1): "
        "the servers pause them where they are (vLLM pause_generation mode keep), apply the new weights, recompute "
        "their KV and resume them, so an answer may span versions (its tokens' version spans come back with it); "
        "the staleness bound counts it by its oldest tokens' version. FULL syncs over grpc or shm; ADAPTER and "
        "nccl syncs, and the HF backend, drain as without it.",
    )

    @model_validator(mode="after")
    def _inflight(self) -> RolloutDecoding:
        if self.inflight and self.max_staleness < 1:
            raise ValueError(INFLIGHT_STALENESS)
        return self


INFLIGHT_STALENESS = (
    "spec.training.rollout.inflight needs max_staleness >= 1 (with 0 no rollout generates while a sync applies)"
)


class BufferConfig(_Learner):
    """Reuse of one E-step's rollouts over several optimizer steps."""

    enabled: bool = Field(False, description="Reuse each E-step's rollouts for m_steps optimizer steps.")
    m_steps: int = Field(1, ge=1, le=64, description="Optimizer steps per rollout (E-step reuse).")


class FormatOptions(_Learner):
    """Options of `training.format`; each applies to one format and is ignored by the other."""

    coordinates: Literal["relative", "pixels"] = Field(
        "relative",
        description="qwen_json only: integers 0..1000 relative to the image (Qwen3-VL), or pixels "
        "of the processor-resized image (Qwen2.5-VL).",
    )
    polygons: Literal["pairs", "flat"] = Field(
        "pairs",
        description="coordexp only: how a poly is written, as [x, y] pairs or a flat list (both are read).",
    )


Tracker = Literal["tensorboard", "mlflow", "wandb"]
TRACKERS: tuple[Tracker, ...] = ("tensorboard", "mlflow", "wandb")
DEFAULT_TRACKERS: tuple[Tracker, ...] = ("tensorboard",)
REPORT_TO_TWICE = "spec.training.report_to names a tracker more than once"  # the CEL rule says the same


class MlflowConfig(_Learner):
    """Where spec.training.report_to: [mlflow] logs (one MLflow run per learner process)."""

    tracking_uri: str | None = Field(
        None,
        min_length=1,
        description="A tracking server (http://...) or a local file store (file:/path); "
        "unset = file:<checkpoint.dir>/mlruns.",
    )
    experiment: str | None = Field(None, min_length=1, description="Experiment name; unset = the job's name.")


class WandbConfig(_Learner):
    """Where spec.training.report_to: [wandb] logs."""

    project: str | None = Field(None, min_length=1, description="W&B project; unset = the job's name.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: run files on disk only, no network or login (`wandb sync` uploads them "
        "later); online: streams to the W&B server (needs WANDB_API_KEY).",
    )
    dir: str | None = Field(None, min_length=1, description="Where W&B writes its run files; unset = <checkpoint.dir>.")


class TrainingConfig(_Learner):
    data: DataConfig
    format: Literal["coordexp", "coordjson", "qwen_json"] = Field(
        "coordexp",
        description="Answer format: coordexp (coordinate tokens, coordinate losses; the model needs "
        "them, see `rmsft prepare-model`), coordjson (the reference's CoordJSON since 2026-02: "
        '{"objects": [{"desc": ..., "bbox_2d": [<|coord_k|>, ...]}]} with bare coordinate tokens; what a '
        "reference stage-1 checkpoint writes) or qwen_json (Qwen-VL's native JSON list, plain-text integers, "
        "cross-entropy only).",
    )
    format_options: FormatOptions = Field(default_factory=FormatOptions)
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear learning-rate warmup.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant, or cosine decay to lr_min_ratio * lr at the last step."
    )
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Floor of the cosine schedule, as a share of lr.")
    warm_start_steps: int = Field(
        0,
        ge=0,
        description="First steps trained on the ground truth alone (empty rollouts, no generation): "
        "the short SFT-style start a model that has never produced the format needs.",
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradients are clipped to this global norm.")
    steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    prompts_per_step: int = Field(
        8, ge=1, description="Records per optimizer step over all learner ranks (the global batch)."
    )
    grad_accumulation: int = Field(1, ge=1, description="Packed rows (micro-steps) per optimizer step and rank.")
    packing_length: int = Field(
        4096, ge=64, description="Tokens per packed row; a segment (prompt + answer) longer than this is an error."
    )
    packing_buffer: int = Field(
        256, ge=1, description="Segments the packer may hold waiting for a row (beyond it: an error)."
    )
    packing_min_fill: float = Field(
        0.0, ge=0.0, le=1.0, description="A row filled below this share is logged as a warning."
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    deepspeed_stage: int = Field(0, ge=0, le=3, description="0 = no DeepSpeed.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="Where the learner trains: auto = cuda:LOCAL_RANK when CUDA is available, else cpu.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: frozen weights in bf16, trainable weights and optimizer state in fp32.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (less memory).")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa",
        description="Attention kernel of the learner's model; packed rows stay isolated under each.",
    )
    finetune: Literal["lora", "full"] = Field(
        "lora", description="lora: train a LoRA/DoRA adapter (training.lora); full: every unfrozen weight."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    rollout: RolloutDecoding = Field(
        default_factory=RolloutDecoding, description="How rollouts are sampled and requested."
    )
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    matching: MatchingConfig = Field(default_factory=MatchingConfig)
    targets: TargetsConfig = Field(default_factory=TargetsConfig, description="What Y_train supervises.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Weights of the loss terms.")
    recipe: RecipeConfig = Field(default_factory=RecipeConfig, description="Which rollout-matching objective.")
    seed: int = Field(0, ge=0, description="Seed of the data order and of the model's random initialisations.")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    grpo: GrpoTrainingConfig = Field(
        default_factory=GrpoTrainingConfig,
        description="GRPO settings (spec.trainer: grpo).",
    )
    log_dir: str | None = Field(
        None,
        min_length=1,
        description="TensorBoard event files (rank 0); unset = <checkpoint.dir>/tensorboard.",
    )
    report_to: list[Tracker] = Field(
        default_factory=lambda: list(DEFAULT_TRACKERS),
        max_length=len(TRACKERS),
        description="Experiment trackers rank 0 logs the same scalars and the job's config to; [] = none. "
        "mlflow and wandb need `pip install 'rmsft[tracking]'`.",
    )
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="report_to: mlflow settings.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="report_to: wandb settings.")

    @property
    def tensorboard_dir(self) -> str:
        """Where rank 0 writes TensorBoard event files (`log_dir`, else beside the checkpoints)."""
        return self.log_dir or f"{self.checkpoint.dir.rstrip('/')}/tensorboard"

    @property
    def mlflow_uri(self) -> str:
        """Where report_to: mlflow logs (`mlflow.tracking_uri`, else a file store beside the checkpoints)."""
        return self.mlflow.tracking_uri or f"file:{self.checkpoint.dir.rstrip('/')}/mlruns"

    @property
    def wandb_dir(self) -> str:
        """Where report_to: wandb writes its run files (`wandb.dir`, else the checkpoint folder)."""
        return self.wandb.dir or self.checkpoint.dir

    @property
    def tracking_destinations(self) -> list[str]:
        """Where report_to sends the run, in words (`rmsft local` prints it, --dry-run too)."""
        where = {
            "tensorboard": f"TensorBoard in {self.tensorboard_dir} (tensorboard --logdir {self.tensorboard_dir})",
            "mlflow": f"MLflow at {self.mlflow_uri}",
            "wandb": f"W&B ({self.wandb.mode}) in {self.wandb_dir}/wandb",
        }
        return [where[t] for t in self.report_to] or ["no tracker (spec.training.report_to: [])"]

    @field_validator("report_to")
    @classmethod
    def _distinct_trackers(cls, v: list[str]) -> list[str]:
        twice = sorted({t for t in v if v.count(t) > 1})
        if twice:
            raise ValueError(f"{REPORT_TO_TWICE}: {', '.join(twice)}")
        return v

    @property
    def export_dir(self) -> str:
        """Where the end-of-run export goes (`export.dir`, else beside the checkpoints)."""
        return self.export.dir or f"{self.checkpoint.dir.rstrip('/')}/export"

    @model_validator(mode="after")
    def _warmup(self) -> TrainingConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"spec.training.warmup_steps ({self.warmup_steps}) exceeds spec.training.steps ({self.steps})"
            )
        # An option of the other format would be silently ignored: say so instead (CEL rules mirror these).
        if self.format != "qwen_json" and self.format_options.coordinates != "relative":
            raise ValueError("spec.training.format_options.coordinates applies to format qwen_json only")
        if self.format == "qwen_json" and self.lora.coord_rows:
            raise ValueError(TRAIN_COORD_ROWS_QWEN_JSON)
        if self.format != "coordexp" and self.format_options.polygons != "pairs":
            raise ValueError("spec.training.format_options.polygons applies to format coordexp only")
        if self.recipe.generation == 1:
            for name in RecipeConfig.SECOND_ONLY:
                if getattr(self.recipe, name) is not None:
                    raise ValueError(RECIPE_SECOND_ONLY.format(name=name))
        if self.recipe.explorers is not None and self.recipe.explorers.count > 0 and self.rollout.max_staleness > 0:
            raise ValueError(RECIPE_EXPLORERS_STALENESS)
        return self
