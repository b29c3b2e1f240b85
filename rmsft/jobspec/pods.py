"""The pods the operator deploys: their image, placement (node, tolerations, GPU budget), container
resources, the learner pod (spec.learner) and monitoring.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from rmsft.jobspec.base import _DNS_LABEL, QUANTITY_PATTERN, _K8s, duration_seconds


class ImageSpec(_K8s):
    """The container image of the rollout and learner pods (both run the same image)."""

    repository: str = Field("ghcr.io/rmsft/rmsft", min_length=1, description="Image repository, registry included.")
    tag: str = Field("0.1.0", min_length=1, description="Image tag.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="The pods' imagePullPolicy."
    )
    pull_secrets: list[str] = Field(
        default_factory=list,
        description="Names of Secrets in the job's namespace used to pull the image (the pods' imagePullSecrets).",
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
        None, description="Taint effect it matches; unset = every effect."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="With effect NoExecute: how long the pod stays bound after the taint appears."
    )


class PlacementSpec(_K8s):
    """Where the job's pods run, and the node's GPU budget the job must fit."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the rollout and learner pods require (their nodeSelector)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the rollout and learner pods tolerate."
    )
    gpus_per_node: int = Field(8, ge=0, le=64, description="GPU budget of the node the job runs on.")
    accelerator: Literal["nvidia", "none"] = Field(
        "nvidia", description="'none' runs rollout and learner on CPUs (kind, laptops)."
    )


class ResourceSpec(_K8s):
    """Container resources as Kubernetes quantities (cpu, memory, ...). nvidia.com/gpu is set by the operator
    from the spec's GPU counts (rollout.tensorParallelSize, learner.gpus); a value given here is replaced."""

    requests: dict[str, str] = Field(
        default_factory=dict, description="Resource requests, e.g. {cpu: 8, memory: 64Gi}."
    )
    limits: dict[str, str] = Field(default_factory=dict, description="Resource limits, e.g. {memory: 96Gi}.")

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, v: dict[str, str]) -> dict[str, str]:
        for k, q in v.items():
            if not re.match(QUANTITY_PATTERN, str(q)):
                raise ValueError(f"{k}={q!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
        return v


class LearnerSpec(_K8s):
    """The learner: one Job running `rmsft train` under torchrun, one rank per GPU, on one pod or (nodes > 1) an
    Indexed Job of pods whose ranks meet at pod 0."""

    gpus: int = Field(1, ge=0, le=64, description="GPUs for each learner pod (torchrun ranks).")
    nodes: int = Field(
        1,
        ge=1,
        le=64,
        description="Learner pods. Above 1: an Indexed Job of this many pods and a headless Service; "
        "torchrun in each pod meets the others at pod 0 (a static rendezvous on its stable DNS name, the pod's node "
        "rank its completion index), so the world is nodes x ranks per pod. Needs a checkpointClaim every pod can "
        "mount (ReadWriteMany across nodes) and a network transport for weights (sync.transport grpc or auto). A "
        "learner pod that fails fails the job at once, naming the pod (its peers cannot go on without it).",
    )
    ranks_per_pod: int | None = Field(
        None,
        ge=1,
        le=64,
        description="torchrun ranks in each learner pod. Default: learner.gpus (one per GPU), or 1 "
        "when placement.accelerator is 'none'. Set it only on the CPU (accelerator 'none'), to run several gloo "
        "ranks in one pod; with GPUs it must equal learner.gpus.",
    )
    spread: bool = Field(
        True,
        description="With nodes > 1, at most one learner pod per node (required pod anti-affinity on "
        "kubernetes.io/hostname). false lets learner pods share a node (a one-node test cluster).",
    )
    backoff_limit: int = Field(
        2,
        ge=0,
        le=20,
        description="Learner pod failures retried before the job is Failed (a retry resumes from the "
        "newest checkpoint: give the job a checkpointClaim). Disruptions (eviction, drain, preemption) do not count; "
        "a learner that refuses its configuration fails the job at once.",
    )
    metrics_port: int = Field(9090, ge=1024, le=65535, description="Prometheus /metrics port of the learner.")
    checkpoint_claim: str | None = Field(None, description="PVC mounted at training.checkpoint.dir.")
    stall_timeout: int | str = Field(
        "1h",
        description="How long the running learner may go without finishing an optimizer step (the first one "
        "counted from its start) before the job reports it stalled: condition Progressing False, reason "
        "LearnerStalled, a Warning event. Seconds or a duration; cover the slowest step and evaluation.",
    )
    fail_when_stalled: bool = Field(
        False,
        description="A stalled learner fails the job (reason LearnerStalled) and frees its GPUs, instead of "
        "only being reported.",
    )
    shm_size: str = Field("8Gi", pattern=QUANTITY_PATTERN, description="Size of the /dev/shm memory volume.")
    resources: ResourceSpec = Field(
        default_factory=ResourceSpec, description="CPU and memory of the learner container."
    )
    termination_grace_period: int | str = Field(
        "10m",
        description="How long the learner pod has after SIGTERM (an eviction, a drain, a preemption, a "
        "deleted pod) before it is killed: `rmsft train` finishes the step in progress, saves a checkpoint and "
        "exits, and the Job's retry resumes there. Seconds or a duration; cover one step plus one save (Kubernetes' "
        "own default, 30 s, is shorter than one step of a big model).",
    )
    disruption_budget: bool = Field(
        True,
        description="A PodDisruptionBudget (minAvailable: every learner pod, spec.learner.nodes) for the "
        "running learner: an eviction (a "
        "drain, the cluster autoscaler) is refused, so a drain waits for the run to end or for someone to delete "
        "the pod (which stops at a step boundary with a checkpoint, and the Job's retry resumes it). A learner "
        "pod not Ready is never protected. false: evictions go through (the same save and resume).",
    )

    @field_validator("stall_timeout", mode="before")
    @classmethod
    def _stall_timeout(cls, v: Any) -> Any:
        duration_seconds(v, "spec.learner.stallTimeout")
        return v

    @field_validator("termination_grace_period", mode="before")
    @classmethod
    def _termination_grace_period(cls, v: Any) -> Any:
        duration_seconds(v, "spec.learner.terminationGracePeriod")
        return v

    @property
    def termination_grace_period_seconds(self) -> int:
        return duration_seconds(self.termination_grace_period, "spec.learner.terminationGracePeriod")

    @property
    def stall_timeout_seconds(self) -> int:
        return duration_seconds(self.stall_timeout, "spec.learner.stallTimeout")

    def ranks(self, accelerated: bool) -> int:
        """torchrun ranks in each learner pod."""
        if self.ranks_per_pod is not None:
            return self.ranks_per_pod
        return self.gpus if accelerated else 1


# A Kubernetes qualified name with an optional DNS-subdomain prefix (label and annotation keys).
# ([.] rather than an escaped dot: the same text is a CEL string literal in the CRD.)
_QUALIFIED_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# Keys rmsft sets on its pods itself: the selectors, the learner's completion index, the scrape annotations.
RESERVED_KEY_PREFIXES = ("app.kubernetes.io/", "rmsft.io/", "batch.kubernetes.io/", "prometheus.io/")
# Kueue's queue label (kueue.sigs.k8s.io): set by spec.scheduling.queueName on the learner Job and the rollout
# StatefulSet, the workloads Kueue admits; on a pod alone it would make each pod a workload of its own.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _check_keys(where: str, v: dict[str, str], values: bool) -> dict[str, str]:
    for k, val in v.items():
        if len(k) > 253 or not re.match(_QUALIFIED_KEY, k) or len(k.rsplit("/", 1)[-1]) > 63:
            raise ValueError(f"{where} key {k!r} is not a Kubernetes qualified name (prefix/name, name <= 63 chars)")
        if k.startswith(RESERVED_KEY_PREFIXES):
            raise ValueError(
                f"{where} key {k!r} is rmsft's own (keys under {', '.join(RESERVED_KEY_PREFIXES)}): the "
                "operator sets them on its pods"
            )
        if values and (len(val) > 63 or not re.match(_LABEL_VALUE, val)):
            raise ValueError(
                f"{where} value {val!r} of {k!r} is not a label value (<= 63 chars: letters, digits, -_. inside)"
            )
    return v


class SchedulingSpec(_K8s):
    """What shared clusters ask of every pod of the job: a scheduler, labels and annotations (secondary networks,
    cost centres), and where the learner's pods must meet."""

    scheduler_name: str | None = Field(
        None,
        pattern=_DNS_LABEL,
        description="The scheduler of the rollout and learner pods (their schedulerName, "
        "e.g. a gang scheduler); the cluster's default when unset.",
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Labels added to every rollout and learner pod (not to the "
        "objects that own them). Keys under app.kubernetes.io/, rmsft.io/, batch.kubernetes.io/ and prometheus.io/ "
        "are rmsft's.",
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Annotations added to every rollout and learner pod, e.g. "
        "k8s.v1.cni.cncf.io/networks for a secondary network (Multus). The same keys are rmsft's as for podLabels.",
    )
    queue_name: str | None = Field(
        None,
        pattern=_DNS_LABEL,
        max_length=63,
        description="A Kueue LocalQueue in the job's namespace: its label "
        "(kueue.x-k8s.io/queue-name) goes on the learner Job and the rollout StatefulSet, two workloads Kueue admits "
        "one by one. Kueue then owns the learner Job's suspend: the operator never resumes it, the learner starts "
        "when Kueue admits it and waits for the pool itself (up to spec.rollout.startupTimeout), and a job that ends "
        "or fails has its learner Job deleted (which gives back its quota) rather than suspended. Rollout pods that "
        "wait for admission do not count against spec.rollout.startupTimeout.",
    )
    learner_topology_key: str | None = Field(
        None,
        max_length=253,
        description="With spec.learner.nodes > 1: a node label whose value every learner pod's "
        "node must share (required pod affinity on it), e.g. a rack or network-block label, so that the ranks "
        "talk over the fast fabric. One learner pod per node still holds (learner.spread).",
    )

    @field_validator("pod_labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if KUEUE_QUEUE_LABEL in v:
            raise ValueError(
                f"spec.scheduling.podLabels: {KUEUE_QUEUE_LABEL} goes on the job's workloads, not its "
                "pods: set spec.scheduling.queueName"
            )
        return _check_keys("spec.scheduling.podLabels", v, values=True)

    @field_validator("pod_annotations")
    @classmethod
    def _annotations(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_keys("spec.scheduling.podAnnotations", v, values=False)

    @field_validator("learner_topology_key")
    @classmethod
    def _topology_key(cls, v: str | None) -> str | None:
        if v is not None and not re.match(_QUALIFIED_KEY, v):
            raise ValueError(f"spec.scheduling.learnerTopologyKey {v!r} is not a node label key")
        return v


class MonitoringSpec(_K8s):
    """Metrics and logs of the job's pods."""

    enabled: bool = Field(
        True,
        description="Prometheus scraping: the pods' prometheus.io/scrape annotations, and the rollout "
        "servers' /metrics endpoint (off when false).",
    )
    namespace: str = Field("monitoring", pattern=_DNS_LABEL, description="Namespace allowed to scrape.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the rollout servers and the learner (RMSFT_LOG_LEVEL)."
    )
