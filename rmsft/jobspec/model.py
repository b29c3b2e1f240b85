"""spec.model: the model to train and serve, the volume it lives on, and how its images become tokens."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rmsft.jobspec.base import _K8s


class ModelVolume(_K8s):
    """Where the weights live in the cluster: a PVC or a host path, mounted read-only."""

    claim_name: str | None = Field(None, description="PersistentVolumeClaim holding the model.")
    host_path: str | None = Field(None, description="Host directory holding the model (single node).")
    mount_path: str = Field("/models", pattern=r"^/", description="Where the volume is mounted.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelVolume:
        if self.claim_name and self.host_path:
            raise ValueError("set only one of claimName and hostPath")
        return self


class VisionSpec(_K8s):
    """How images become tokens, for the learner's processor and every server's alike (the prompt ids
    they render must agree). Unset pixel bounds keep the processor's own."""

    min_pixels: int | None = Field(None, ge=1, le=1 << 30, description="Smallest resized image area, pixels.")
    max_pixels: int | None = Field(None, ge=1, le=1 << 30, description="Largest resized image area, pixels.")
    max_images_per_prompt: int = Field(4, ge=0, le=64, description="Images one prompt may carry (vLLM's limit).")
    max_image_pixels: int = Field(
        50_000_000,
        ge=1,
        le=1 << 34,
        description="Largest source image (width x height) a record or a request may carry; larger ones are refused.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> VisionSpec:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"minPixels ({self.min_pixels}) exceeds maxPixels ({self.max_pixels})")
        return self


class ModelSpec(_K8s):
    """The model to train and serve: a Hugging Face folder the learner and every rollout server load."""

    path: str = Field(..., min_length=1, description="Model directory (HF layout) as seen in the pods.")
    volume: ModelVolume | None = Field(None, description="Volume that holds the model; none = baked in image.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights' dtype: what the servers serve in and FULL weight updates are sent in, and "
        "the learner's weights under training.precision fp32 (bf16 decides its own); auto = the checkpoint's "
        "(config.json).",
    )
    vision: VisionSpec = Field(default_factory=VisionSpec, description="Image processing (vision-language models).")
