"""spec as a whole (`JobSpec`): its sections, and the rules that span them (each mirrored by a CEL rule of the
CRD, message for message).
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from rmsft.jobspec.base import _K8s
from rmsft.jobspec.model import ModelSpec
from rmsft.jobspec.objectives import DEFAULT_OBJECTIVE, OBJECTIVES
from rmsft.jobspec.pods import ImageSpec, LearnerSpec, MonitoringSpec, PlacementSpec, SchedulingSpec
from rmsft.jobspec.rollout import RolloutSpec
from rmsft.jobspec.sync import SyncSpec
from rmsft.jobspec.training import TrainingConfig

# training.checkpoint.every_minutes when unset and the job has a checkpoint claim
DEFAULT_CHECKPOINT_MINUTES = 30


class JobSpec(_K8s):
    """What a RolloutMatchingJob runs: the model, the pods (image, placement, rollout pool, learner), the
    training, the weight sync and monitoring."""

    trainer: str = Field(
        DEFAULT_OBJECTIVE,
        description="The learner's training objective: rollout-matching SFT, or GRPO (training.grpo).",
        # The enum is the registry's names, read when the schema is generated (the CRD's too).
        json_schema_extra=lambda schema: schema.update(enum=list(OBJECTIVES)),
    )
    model: ModelSpec
    image: ImageSpec = Field(default_factory=ImageSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    learner: LearnerSpec = Field(default_factory=LearnerSpec)
    training: TrainingConfig = Field(
        ...,
        description="The learner's own config (snake_case keys): data, format, optimizer, steps, rollouts, "
        "matching, losses, evaluation, export.",
    )
    sync: SyncSpec = Field(default_factory=SyncSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)

    @field_validator("trainer")
    @classmethod
    def _known_objective(cls, v: str) -> str:
        if v not in OBJECTIVES:
            raise ValueError(f"spec.trainer {v!r} names no objective (known: {', '.join(sorted(OBJECTIVES))})")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        # Every rule here is also a CEL rule in the CRD (rmsft_operator.crd); the messages match
        # so users see the same text from `kubectl apply` and from `rmsft local`.
        for message in cross_field_errors(self):
            raise ValueError(message)
        return self

    @property
    def checkpoint_minutes(self) -> int:
        """Minutes between time-driven checkpoints (training.checkpoint.every_minutes; 0 = none): unset, 30 with a
        checkpoint claim, where a later attempt finds them, and 0 without one."""
        every = self.training.checkpoint.every_minutes
        if every is not None:
            return every
        return DEFAULT_CHECKPOINT_MINUTES if self.learner.checkpoint_claim else 0

    @property
    def pool_wait_seconds(self) -> float:
        """How long the learner waits at start for every server to be Ready: the pool's startupTimeout (at least one
        request's timeout), at every start. The operator resumes the learner's first pod once the pool is Ready, so
        there the wait ends at once; but a retry's pod (the Job controller's, after an eviction or a transient
        failure) starts while servers may be restarting too, and, queued (spec.scheduling.queueName), Kueue admits
        the learner and the pool one by one, so the learner may start first. A server not Ready after this long is
        NoServerAvailableError, a retryable exit (rmsft.exit_codes)."""
        return max(self.training.rollout.request_timeout_s, float(self.rollout.startup_timeout_seconds))

    @property
    def gpus_needed(self) -> int:
        if self.rollout.colocated:  # the engine shares the learner's devices
            return self.learner.gpus
        assert self.rollout.replicas is not None, "RolloutSpec's validator sets replicas (1 for server mode)"
        return self.rollout.replicas * self.rollout.tensor_parallel_size + self.learner.gpus


# training.loss.logits fused where liger-kernel's kernel cannot run (learner/core/fused.py); auto takes chunked there.
LOGITS_FUSED_CPU = (
    "spec.training.loss.logits 'fused' needs spec.placement.accelerator 'nvidia' (liger-kernel's fused "
    "cross-entropy is a CUDA kernel); set it to chunked or auto"
)
LOGITS_FUSED_ZERO3 = (
    "spec.training.loss.logits 'fused' cannot run under spec.training.deepspeed_stage 3 (the "
    "kernel takes the output head's whole weight, which ZeRO-3 partitions); set it to chunked or "
    "auto"
)


def cross_field_errors(spec: JobSpec) -> list[str]:
    """Rules that span sections; mirrored one-to-one by CEL rules in the CRD."""
    errs: list[str] = []
    # The one-node budget binds shm only (host memory is one node's: the operator puts every pod on one node).
    # Only an explicit shm: auto is grpc in a cluster, and `rmsft local` checks the machine's GPUs itself. Over
    # grpc or nccl the pool and the learner may span nodes; each pod still fits one (below).
    if (
        spec.sync.transport == "shm"
        and spec.placement.accelerator == "nvidia"
        and spec.gpus_needed > spec.placement.gpus_per_node
    ):
        errs.append(
            f"spec.sync.transport 'shm' needs the learner and the whole pool on one node: "
            f"spec.rollout.replicas * spec.rollout.tensorParallelSize + spec.learner.gpus ({spec.gpus_needed}) "
            f"must be <= spec.placement.gpusPerNode ({spec.placement.gpus_per_node})"
        )
    if spec.placement.accelerator == "none" and spec.learner.gpus > 0:
        errs.append("spec.learner.gpus must be 0 when spec.placement.accelerator is 'none'")
    if spec.training.loss.logits == "fused" and spec.placement.accelerator == "none":
        errs.append(LOGITS_FUSED_CPU)
    if spec.training.loss.logits == "fused" and spec.training.deepspeed_stage == 3:
        errs.append(LOGITS_FUSED_ZERO3)
    if spec.sync.transport == "nccl" and spec.sync.mode != "full":
        errs.append(
            "spec.sync.transport 'nccl' carries full weights: spec.sync.mode must be 'full' (adapters go over grpc)"
        )
    # Only shm needs the whole job on one node (above); over the network each pod must fit a node: a server's
    # TP group and the learner's GPUs (per pod) are one pod each.
    if spec.placement.accelerator == "nvidia" and spec.rollout.tensor_parallel_size > spec.placement.gpus_per_node:
        errs.append(
            f"spec.rollout.tensorParallelSize ({spec.rollout.tensor_parallel_size}) must be <= "
            f"spec.placement.gpusPerNode ({spec.placement.gpus_per_node}): a server is one pod"
        )
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
    errs.extend(learner_pods_errors(spec))
    if spec.trainer == "grpo":
        errs.extend(grpo_errors(spec))
    if spec.rollout.colocated:
        errs.extend(colocate_errors(spec))
    return errs


def learner_pods_errors(spec: JobSpec) -> list[str]:
    """How many learner pods and ranks a job can have (mirrored by CEL rules, as `cross_field_errors`)."""
    lr, errs = spec.learner, []
    accelerated = spec.placement.accelerator == "nvidia"
    if accelerated and lr.ranks_per_pod is not None and lr.ranks_per_pod != lr.gpus:
        errs.append(
            f"spec.learner.ranksPerPod ({lr.ranks_per_pod}) must equal spec.learner.gpus ({lr.gpus}) when "
            "spec.placement.accelerator is 'nvidia' (one rank per GPU; leave it unset)"
        )
    if accelerated and lr.gpus > spec.placement.gpus_per_node:
        errs.append(
            f"spec.learner.gpus ({lr.gpus}) must be <= spec.placement.gpusPerNode "
            f"({spec.placement.gpus_per_node}): a learner pod is on one node (with spec.learner.nodes > 1 it "
            "counts GPUs per learner pod)"
        )
    if lr.nodes == 1:
        if spec.scheduling.learner_topology_key:
            errs.append(
                "spec.scheduling.learnerTopologyKey applies to spec.learner.nodes > 1 (the learner's pods "
                "meeting in one topology domain)"
            )
        return errs
    if spec.rollout.colocated:
        errs.append(
            "spec.learner.nodes > 1 is not available with spec.rollout.mode 'colocate' yet (one learner pod "
            "holds the engines); use server mode"
        )
    if spec.sync.transport == "shm":
        errs.append(
            "spec.sync.transport 'shm' cannot reach learner pods on several nodes (host memory is one "
            "node's): with spec.learner.nodes > 1 use grpc or auto"
        )
    if not lr.checkpoint_claim:
        errs.append(
            "spec.learner.nodes > 1 needs spec.learner.checkpointClaim: every learner pod saves its share "
            "of a checkpoint into one folder and resumes from it (a ReadWriteMany claim across nodes)"
        )
    return errs


COLOCATE_STALENESS = (
    "spec.training.rollout.max_staleness must be 0 with spec.rollout.mode 'colocate': the engine "
    "shares the learner's devices, so generation cannot overlap training"
)


COLOCATE_SLEEP_ZERO3 = (
    "spec.rollout.colocate.sleepLevel > 0 cannot be combined with spec.training.deepspeed_stage 3: a sleeping engine "
    "with partitioned training weights has not been proven on a GPU (use stage 0-2, or sleepLevel 0)"
)


def colocate_errors(spec: JobSpec) -> list[str]:
    """What a colocate job cannot have (mirrored by CEL rules, as `cross_field_errors`)."""
    c, errs = spec.rollout.colocate, []
    cpu = spec.placement.accelerator == "none"
    if cpu and c.tensor_parallel_size != 1:
        errs.append(
            "spec.rollout.colocate.tensorParallelSize must be 1 when spec.placement.accelerator is 'none' "
            "(vLLM's CPU backend runs TP > 1 in worker processes of its own, not in the learner's)"
        )
    if not cpu and (spec.learner.gpus < 1 or spec.learner.gpus % c.tensor_parallel_size):
        errs.append(
            f"spec.rollout.colocate.tensorParallelSize ({c.tensor_parallel_size}) must divide "
            f"spec.learner.gpus ({spec.learner.gpus}): the learner's ranks form whole TP groups"
        )
    if c.sleep_level > 0 and (cpu or spec.rollout.engine != "vllm"):
        errs.append(
            "spec.rollout.colocate.sleepLevel > 0 needs spec.placement.accelerator 'nvidia' and "
            "spec.rollout.engine 'vllm' (vLLM's sleep mode is CUDA's; the CPU backend has none)"
        )
    if c.sleep_level > 0 and spec.training.deepspeed_stage == 3:
        errs.append(COLOCATE_SLEEP_ZERO3)
    if cpu and (c.offload_model or c.offload_optimizer):
        errs.append(
            "spec.rollout.colocate.offloadModel and offloadOptimizer move training state off the GPUs; "
            "with spec.placement.accelerator 'none' there is nothing to move (set them false)"
        )
    if spec.rollout.engine == "hf" and c.tensor_parallel_size != 1:
        errs.append(
            "spec.rollout.colocate.tensorParallelSize must be 1 with spec.rollout.engine 'hf' (the HF "
            "engine is the training model itself)"
        )
    if spec.sync.mode == "adapter":
        errs.append(
            "spec.sync.mode 'adapter' is not available with spec.rollout.mode 'colocate': the in-process "
            "engine takes merged weights (use full or auto)"
        )
    if spec.sync.transport != "auto":
        errs.append(
            "spec.sync.transport must stay 'auto' with spec.rollout.mode 'colocate': weights go straight "
            "into the in-process engine, with no transport"
        )
    if spec.training.rollout.max_staleness > 0:
        errs.append(COLOCATE_STALENESS)
    return errs


def grpo_errors(spec: JobSpec) -> list[str]:
    """What a `trainer: grpo` job cannot have (mirrored by CEL rules, as `cross_field_errors`)."""
    t, g = spec.training, spec.training.grpo
    errs: list[str] = []
    if g.max_tokens >= spec.rollout.max_model_len:
        errs.append(
            f"spec.training.grpo.max_tokens ({g.max_tokens}) must be < spec.rollout.maxModelLen "
            f"({spec.rollout.max_model_len})"
        )
    if t.buffer.enabled and t.buffer.m_steps > 1:
        errs.append(
            "spec.training.buffer.m_steps > 1 is not supported by spec.trainer 'grpo': every step samples "
            "fresh groups from the learner's current weights (disable the buffer or set m_steps: 1)"
        )
    if t.warm_start_steps > 0:
        errs.append(
            "spec.training.warm_start_steps applies to spec.trainer 'rollout_matching' only (GRPO has no "
            "ground-truth targets to warm start on)"
        )
    if t.grad_accumulation != 1:
        errs.append(
            "spec.training.grad_accumulation must be 1 with spec.trainer 'grpo': a step trains on every "
            "completion it sampled, in as many packed rows as they fill"
        )
    if g.kl_coef > 0 and t.finetune != "lora":
        errs.append(
            "spec.training.grpo.kl_coef > 0 needs spec.training.finetune: lora (the reference policy is the "
            "base weights, the adapters disabled); with finetune: full set kl_coef: 0"
        )
    d = t.rollout
    if d.top_p != 1.0 or d.top_k > 0 or d.repetition_penalty not in (None, 1.0):
        errs.append(
            "spec.training.rollout.top_p, top_k and repetition_penalty must stay off with spec.trainer "
            "'grpo' (it samples at spec.training.grpo.temperature alone, so that the learner's log-probs "
            "are those of the distribution sampled from)"
        )
    return errs
