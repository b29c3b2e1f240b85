"""Pure functions: a validated RolloutMatchingJob -> the Kubernetes objects that run it.

No API calls here, so every object can be validated offline (tests run kubernetes-validate on
all of them) and the reconciler stays a thin create/patch loop.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

import yaml

from rmsft.jobspec import RolloutMatchingJob
from rmsft.jobspec.rollout import HEALTH_PORT_ENV
from rmsft.serve_options import serve_options
from rmsft_operator.render_cleanup import SHM_CLEANUP_MOUNT, render_shm_cleanup
from rmsft_operator.render_meta import (
    COMPLETION_INDEX_ANNOTATION,
    CONFIG_DIR,
    CONFIG_EXIT_CODE,
    CONFIG_KEY,
    JOB_LABEL,
    MANAGED_BY,
    PREFLIGHT_CONTAINER,
    PREFLIGHT_RESOURCES,
    RENDEZVOUS_PORT,
    ROLE_LABEL,
    SERVE_KEY,
    SERVERS_KEY,
    SHARED_WEIGHTS_ENV,
    SHARED_WEIGHTS_MOUNT,
    SHARED_WEIGHTS_VOLUME,
    SHUTDOWN_MARGIN_S,
    SHUTDOWN_TIMEOUT_ENV,
    SPEC_HASH_ANNOTATION,
    TLS_DIR,
    TLS_VOLUME,
    TOKEN_KEY,
    UID,
    immutable_view,
    labels,
    names,
    object_meta,
    owner_reference,
    selector,
    server_addresses,
    spec_hash,
)
from rmsft_operator.render_pods import (
    render_job,
    render_statefulset,
    shared_weights_host_path,
    torchrun_shutdown_seconds,
)

# The module callers name (reconcile, handlers, tests): the builders of render_meta, render_pods and render_cleanup
# with its own.
__all__ = [
    "HEALTH_PORT_ENV",
    "COMPLETION_INDEX_ANNOTATION",
    "CONFIG_DIR",
    "CONFIG_EXIT_CODE",
    "CONFIG_KEY",
    "JOB_LABEL",
    "MANAGED_BY",
    "PREFLIGHT_CONTAINER",
    "PREFLIGHT_RESOURCES",
    "RENDEZVOUS_PORT",
    "ROLE_LABEL",
    "SERVERS_KEY",
    "SERVE_KEY",
    "SHARED_WEIGHTS_ENV",
    "SHARED_WEIGHTS_MOUNT",
    "SHARED_WEIGHTS_VOLUME",
    "SHM_CLEANUP_MOUNT",
    "SHUTDOWN_MARGIN_S",
    "SHUTDOWN_TIMEOUT_ENV",
    "SPEC_HASH_ANNOTATION",
    "TLS_DIR",
    "TLS_VOLUME",
    "TOKEN_KEY",
    "UID",
    "object_meta",
    "checkpoint_cadence",
    "child_key",
    "immutable_view",
    "labels",
    "names",
    "owner_reference",
    "relay_targets",
    "render_all",
    "render_configmap",
    "render_disruption_budget",
    "render_job",
    "render_learner_networkpolicy",
    "render_learner_service",
    "render_networkpolicy",
    "render_secret",
    "render_service",
    "render_shm_cleanup",
    "render_statefulset",
    "selector",
    "serve_config",
    "server_addresses",
    "shared_weights_host_path",
    "spec_hash",
    "torchrun_shutdown_seconds",
]


def render_secret(job: RolloutMatchingJob, namespace: str, uid: str, token: str | None = None) -> dict[str, Any]:
    token = token or secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(job, names(job.metadata.name)["secret"], namespace, uid, "auth"),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def serve_config(job: RolloutMatchingJob, namespace: str) -> dict[str, Any]:
    """Flags of `rmsft serve --config` (rollout_engine.config.ServeConfig keys) for this job's pods."""
    r = job.spec.rollout
    opts = serve_options(job, gpus=job.spec.placement.accelerator == "nvidia")
    return {
        "model": job.spec.model.path,
        **{k: v for k, v in opts.items() if v is not None},
        "port": r.port,
        "metrics_port": r.metrics_port if job.spec.monitoring.enabled else 0,
        "staging_dir": "/dev/shm",
        # Weight updates are relayed to this job's servers only: their exact host:port names (server_addresses'),
        # every ordinal the pool may have (spec.rollout.replicas' maximum), so a resized pool needs no new flags and no
        # pattern can reach past the job's own StatefulSet.
        "relay_allow": ",".join(relay_targets(job, namespace)),
        # spec.rollout.tls: the Secret's files (the server trusts its own tls.crt for its relays).
        **({"tls_cert": f"{TLS_DIR}/tls.crt", "tls_key": f"{TLS_DIR}/tls.key"} if r.tls else {}),
    }


def _max_replicas() -> int:
    """spec.rollout.replicas' maximum, from the spec's own field (its `le`)."""
    from rmsft.jobspec.rollout import RolloutSpec

    return int(next(m.le for m in RolloutSpec.model_fields["replicas"].metadata if getattr(m, "le", None)))


def relay_targets(job: RolloutMatchingJob, namespace: str) -> list[str]:
    """The exact host:port of every rollout server the job's pool may ever have (ordinals 0 to the spec's maximum - 1):
    the only peers its servers relay weight updates to."""
    n = names(job.metadata.name)
    return [
        f"{n['statefulset']}-{i}.{n['service']}.{namespace}.svc:{job.spec.rollout.port}" for i in range(_max_replicas())
    ]


def render_configmap(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    manifest = job.to_manifest()
    manifest["metadata"]["namespace"] = namespace
    meta = object_meta(job, names(job.metadata.name)["config"], namespace, uid, "config")
    meta["annotations"] = {SPEC_HASH_ANNOTATION: spec_hash(manifest["spec"])}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {
            CONFIG_KEY: yaml.safe_dump(manifest, sort_keys=False),
            SERVE_KEY: yaml.safe_dump(serve_config(job, namespace), sort_keys=False),
            # The learner reads this file (not an env var frozen at creation) and follows it: the
            # reconcile rewrites it when the pool is scaled, the kubelet refreshes the mount.
            SERVERS_KEY: "\n".join(server_addresses(job, namespace)),
        },
    }


def _headless_service(
    job: RolloutMatchingJob, namespace: str, uid: str, role: str, name: str, ports: list[dict[str, Any]]
) -> dict[str, Any]:
    """A headless Service over the job's `role` pods: DNS names for each pod, published before any is Ready (the
    learner resolves every server ordinal up front and waits on gRPC health itself; learner pods have no readiness
    probe, and their names must resolve as soon as they have addresses)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, name, namespace, uid, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(job.metadata.name, role),
            "ports": ports,
        },
    }


def render_service(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    r = job.spec.rollout
    return _headless_service(
        job,
        namespace,
        uid,
        "rollout",
        names(job.metadata.name)["service"],
        [
            {"name": "grpc", "port": r.port, "targetPort": "grpc", "protocol": "TCP"},
            {"name": "metrics", "port": r.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
        ],
    )


def checkpoint_cadence(job: RolloutMatchingJob) -> str:
    """When the learner saves, as the CheckpointsDurable condition says it at admission: a job with no periodic
    checkpoint keeps nothing of a pod killed outright (an OOM, a lost node) but what it saved at the end or on
    SIGTERM."""
    ck, minutes = job.spec.training.checkpoint, job.spec.checkpoint_minutes
    when = [f"every {ck.every} steps"] if ck.every else []
    when += [f"every {minutes} minutes"] if minutes else []
    if when:
        return f"saved {' and '.join(when)}, at the end and on SIGTERM"
    return (
        "no periodic checkpoint (spec.training.checkpoint.every and every_minutes are 0): saved only at the end "
        "and on SIGTERM, so a learner killed outright (an OOM, a lost node) starts again from step 0"
    )


def render_learner_service(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    """learner.nodes > 1: the headless Service that gives each learner pod a DNS name (pod 0's is the rendezvous)."""
    return _headless_service(
        job,
        namespace,
        uid,
        "learner",
        names(job.metadata.name)["learner_service"],
        [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"}],
    )


def _ingress_policy(
    job: RolloutMatchingJob, namespace: str, uid: str, key: str, component: str, ingress: list[dict[str, Any]]
) -> dict[str, Any]:
    """A NetworkPolicy named `names(job)[key]` on the job's `component` pods: only `ingress` reaches them."""
    name = job.metadata.name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, names(name)[key], namespace, uid, component),
        "spec": {
            "podSelector": {"matchLabels": selector(name, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def render_networkpolicy(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    name = job.metadata.name
    r = job.spec.rollout
    return _ingress_policy(
        job,
        namespace,
        uid,
        "networkpolicy",
        "rollout",
        [
            {  # gRPC (Generate, UpdateWeights, health) only from this job's learner pod, and from
                # its other rollout pods: an update is relayed server to server (rollout_svc/relay.py)
                "from": [
                    {"podSelector": {"matchLabels": selector(name, "learner")}},
                    {"podSelector": {"matchLabels": selector(name, "rollout")}},
                ],
                "ports": [{"protocol": "TCP", "port": r.port}],
            },
            *(
                [
                    {  # transport nccl: the weight-transfer group's own connections (its rendezvous on the learner,
                        # then rank to rank on ports NCCL or gloo pick), from the same pods only
                        "from": [
                            {"podSelector": {"matchLabels": selector(name, "learner")}},
                            {"podSelector": {"matchLabels": selector(name, "rollout")}},
                        ],
                    }
                ]
                if job.spec.sync.cluster_transport == "nccl"
                else []
            ),
            {  # metrics from the monitoring namespace
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": job.spec.monitoring.namespace}
                        }
                    }
                ],
                "ports": [{"protocol": "TCP", "port": r.metrics_port}],
            },
        ],
    )


def render_learner_networkpolicy(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    """Ingress to the learner pods: torchrun's rendezvous store (RENDEZVOUS_PORT) and the ranks' collectives (ports
    NCCL or gloo pick) from the job's own learner pods only; with transport nccl, the weight-transfer group's store
    and connections from the job's own rollout pods only (that group's traffic is not encrypted, TLS or not:
    docs/operator.md, "Network"); /metrics from anywhere (the operator reads the learner's progress there, and
    Prometheus). Nothing else reaches a learner pod."""
    name = job.metadata.name
    own_learners = {"podSelector": {"matchLabels": selector(name, "learner")}}
    nccl = job.spec.sync.cluster_transport == "nccl" and not job.spec.rollout.colocated
    return _ingress_policy(
        job,
        namespace,
        uid,
        "learner_networkpolicy",
        "learner",
        [
            {"from": [own_learners]},  # rendezvous + collectives, any port, the job's learner pods only
            *([{"from": [{"podSelector": {"matchLabels": selector(name, "rollout")}}]}] if nccl else []),
            {"ports": [{"protocol": "TCP", "port": job.spec.learner.metrics_port}]},
        ],
    )


def render_disruption_budget(job: RolloutMatchingJob, namespace: str, uid: str, role: str) -> dict[str, Any]:
    """The PodDisruptionBudget of the rollout pool (`role` rollout: maxUnavailable 1, one server evicted at a time)
    or of the learner (`learner`: minAvailable = its pods, any eviction refused). A Job's pods can only be budgeted
    with an integer minAvailable (the disruption controller cannot scale a Job), the StatefulSet's with
    maxUnavailable.
    unhealthyPodEvictionPolicy AlwaysAllow: a pod that is not Ready (crash-looping, still loading) never holds up
    a drain."""
    pool = role == "rollout"
    n = names(job.metadata.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(job, n["pool_budget" if pool else "learner_budget"], namespace, uid, role),
        "spec": {
            # The learner's pods are one world (spec.learner.nodes): evicting any of them stops them all.
            **({"maxUnavailable": 1} if pool else {"minAvailable": job.spec.learner.nodes}),
            "selector": {"matchLabels": selector(job.metadata.name, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def child_key(obj: dict[str, Any]) -> str:
    """Which of a job's children `obj` is: its kind, except the two PodDisruptionBudgets and the learner's Service
    (reconcile.CHILD_KINDS)."""
    role = (obj.get("metadata") or {}).get("labels", {}).get(ROLE_LABEL)
    if obj["kind"] == "Service":
        return "LearnerService" if role == "learner" else "Service"
    if obj["kind"] == "NetworkPolicy":
        return "LearnerNetworkPolicy" if role == "learner" else "NetworkPolicy"
    if obj["kind"] != "PodDisruptionBudget":
        return obj["kind"]
    return "PoolDisruptionBudget" if role == "rollout" else "LearnerDisruptionBudget"


def render_all(job: RolloutMatchingJob, namespace: str, uid: str, token: str | None = None) -> list[dict[str, Any]]:
    """Every child in creation order (config before the pods that mount it, a budget before the pods it covers).
    A colocate job has no rollout pool: no StatefulSet, Service, NetworkPolicy or pool budget, only the learner
    Job (its GPUs hold the engine too)."""
    pool = (
        []
        if job.spec.rollout.colocated
        else [
            render_service(job, namespace, uid),
            render_networkpolicy(job, namespace, uid),
            *([render_disruption_budget(job, namespace, uid, "rollout")] if job.spec.rollout.disruption_budget else []),
            render_statefulset(job, namespace, uid),
        ]
    )
    learner_budget = (
        [render_disruption_budget(job, namespace, uid, "learner")] if job.spec.learner.disruption_budget else []
    )
    learner_service = [render_learner_service(job, namespace, uid)] if job.spec.learner.nodes > 1 else []
    return [
        render_secret(job, namespace, uid, token),
        render_configmap(job, namespace, uid),
        *pool,
        *learner_budget,
        render_learner_networkpolicy(job, namespace, uid),
        *learner_service,
        render_job(job, namespace, uid),
    ]
