"""Observe: what exists for one RolloutMatchingJob (the job, its children, its pods, pod-creation failures, the
learner's progress). Only reads; `decide` makes the pass's choices from what this returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rmsft.jobspec import JobSpecError, LearnerSpec, parse_spec
from rmsft_operator import render
from rmsft_operator.failures import job_finished
from rmsft_operator.kube import Kube
from rmsft_operator.progress import learner_progress

# The children of a job, in creation order: kinds, except the two PodDisruptionBudgets (render.child_key).
CHILD_KINDS = (
    "Secret",
    "ConfigMap",
    "Service",
    "NetworkPolicy",
    "PoolDisruptionBudget",
    "StatefulSet",
    "LearnerDisruptionBudget",
    "LearnerNetworkPolicy",
    "LearnerService",
    "Job",
)
_CHILD_NAME = {
    "Secret": "secret",
    "ConfigMap": "config",
    "Service": "service",
    "NetworkPolicy": "networkpolicy",
    "PoolDisruptionBudget": "pool_budget",
    "StatefulSet": "statefulset",
    "LearnerDisruptionBudget": "learner_budget",
    "LearnerNetworkPolicy": "learner_networkpolicy",
    "LearnerService": "learner_service",
    "Job": "job",
}


def api_kind(child: str) -> str:
    """The API kind of a child key of CHILD_KINDS."""
    if child == "LearnerService":
        return "Service"
    if child == "LearnerNetworkPolicy":
        return "NetworkPolicy"
    return "PodDisruptionBudget" if child.endswith("DisruptionBudget") else child


# Pod Security admission: the namespace label that sets the enforced level, and the levels whose


@dataclass(frozen=True)
class Observed:
    """Everything one pass looked at (plain API dicts)."""

    name: str
    namespace: str
    uid: str
    generation: int | None
    spec: Any
    status: dict[str, Any]
    children: dict[str, dict[str, Any] | None]  # kind -> live object, None when absent
    rollout_pods: list[dict[str, Any]] = field(default_factory=list)
    learner_pods: list[dict[str, Any]] = field(default_factory=list)
    # kind ("StatefulSet" | "Job") -> message of the newest FailedCreate event of that child
    failed_creates: dict[str, str] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)  # rmsft_operator.progress.parse_progress
    # Labels of the job's namespace, read only for a job that asks for sync.transport shm (None:
    # not read, or not readable).
    namespace_labels: dict[str, str] | None = None
    # kind -> name of an object that has a child's name but is not this job's (no controller reference to its
    # uid): never patched, never counted as a child (`children` has None for it); the job waits, saying so.
    foreign: dict[str, str] = field(default_factory=dict)
    # kind -> the first time of the FailedCreate events counted in `failed_creates` (the API's clock of the refusal)
    failed_create_since: dict[str, str] = field(default_factory=dict)
    created: str | None = None  # the job's metadata.creationTimestamp


def observe(kube: Kube, body: dict[str, Any], progress_timeout: float = 0.0) -> Observed:
    meta = body.get("metadata") or {}
    name, namespace = meta["name"], meta.get("namespace") or "default"
    n = render.names(name)
    spec_field = body.get("spec")
    raw_spec = spec_field if isinstance(spec_field, dict) else {}
    # The learner's Service exists only for learner.nodes > 1: for any other job an object of that name is no
    # concern of this job's (not read, never a conflict).
    several = int((raw_spec.get("learner") or {}).get("nodes") or 1) > 1
    # The token Secret is never read (the chart grants Secrets `create` only, so no Secret of the namespace is
    # readable by the operator): it is the first child made, so the job's own ConfigMap, made after it, says it is
    # there.
    found = {
        kind: kube.get(api_kind(kind), namespace, n[_CHILD_NAME[kind]])
        if kind not in ("Secret", "LearnerService") or (kind == "LearnerService" and several)
        else None
        for kind in CHILD_KINDS
    }
    uid = meta.get("uid") or ""
    foreign = {
        kind: obj["metadata"]["name"] for kind, obj in found.items() if obj is not None and not owned_by(obj, uid)
    }
    children = {kind: None if kind in foreign else obj for kind, obj in found.items()}
    if children["ConfigMap"] is not None:
        children["Secret"] = secret_stand_in(n["secret"], namespace)
    sts, learner = children["StatefulSet"], children["Job"]
    rollout_pods = kube.list_pods(namespace, render.selector(name, "rollout")) if sts else []
    learner_pods = kube.list_pods(namespace, render.selector(name, "learner")) if learner else []

    failed_creates, failed_create_since = _failed_creates(kube, namespace, n, sts, learner, rollout_pods, learner_pods)

    progress: dict[str, Any] = {}
    if learner and not (learner.get("spec") or {}).get("suspend") and progress_timeout > 0:
        spec = spec_field if isinstance(spec_field, dict) else {}
        port = (spec.get("learner") or {}).get("metricsPort") or LearnerSpec().metrics_port
        progress = learner_progress(learner_pods, int(port), progress_timeout)

    # The namespace's Pod Security level decides whether an shm job's hostPath volume is admitted;
    # other jobs cost no extra call (and need no right on namespaces).
    namespace_labels = kube.namespace_labels(namespace) if _asks_for_shm(body.get("spec")) else None

    return Observed(
        name=name,
        namespace=namespace,
        uid=uid,
        generation=meta.get("generation"),
        spec=body.get("spec"),
        status=body.get("status") or {},
        children=children,
        rollout_pods=rollout_pods,
        learner_pods=learner_pods,
        failed_creates=failed_creates,
        progress=progress,
        namespace_labels=namespace_labels,
        foreign=foreign,
        failed_create_since=failed_create_since,
        created=meta.get("creationTimestamp"),
    )


def _failed_creates(
    kube: Kube,
    namespace: str,
    n: dict[str, str],
    sts: dict[str, Any] | None,
    learner: dict[str, Any] | None,
    rollout_pods: list[dict[str, Any]],
    learner_pods: list[dict[str, Any]],
) -> tuple[dict[str, str], dict[str, str]]:
    """Pods that could not even be created (Pod Security admission, quota...) exist only as FailedCreate events on
    their controller: looked for only when pods are missing. Per kind, the newest event's message and the first
    event's time (the API's clock of the refusal)."""
    missing = []
    if sts and len(rollout_pods) < int((sts.get("spec") or {}).get("replicas") or 0):
        missing.append(("StatefulSet", n["statefulset"]))
    if (
        learner
        and not (learner.get("spec") or {}).get("suspend")
        and len(learner_pods) < int((learner.get("spec") or {}).get("parallelism") or 1)
        and not job_finished(learner)
    ):
        missing.append(("Job", n["job"]))
    failed_creates: dict[str, str] = {}
    failed_create_since: dict[str, str] = {}
    if missing:
        events = kube.list_events(namespace, "reason=FailedCreate")
        for kind, child in missing:
            mine = [
                e
                for e in events
                if (e.get("involvedObject") or {}).get("kind") == kind
                and (e.get("involvedObject") or {}).get("name") == child
                and e.get("reason") == "FailedCreate"
            ]
            if mine:
                newest = max(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
                failed_creates[kind] = str(newest.get("message") or "FailedCreate")
                first = [
                    t for e in mine if (t := e.get("firstTimestamp") or e.get("eventTime") or e.get("lastTimestamp"))
                ]
                if first:
                    failed_create_since[kind] = min(first)
    return failed_creates, failed_create_since


def secret_stand_in(name: str, namespace: str) -> dict[str, Any]:
    """What `observe` records for the job's token Secret, which it never reads: its name, nothing of its content."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}}


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """`obj` is a child of the job with `uid`: its controller reference names that uid (render.owner_reference)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def _asks_for_shm(spec: Any) -> bool:
    try:
        return parse_spec(spec).sync.cluster_transport == "shm"
    except JobSpecError:
        return False  # decide reports the invalid spec; nothing will be created
