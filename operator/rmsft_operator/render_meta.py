"""What every rendered object of a job shares: the operator's constants (labels, keys, ports, the pods' paths) and the
names, labels and owner reference of a job's children. Pure."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rmsft.exit_codes import CONFIG_EXIT
from rmsft.jobspec import API_GROUP, API_VERSION, KIND, RolloutMatchingJob
from rmsft.jobspec.pods import KUEUE_QUEUE_LABEL  # Kueue's, on the workloads it admits

MANAGED_BY = "rmsft-operator"
JOB_LABEL = "rmsft.io/job"
ROLE_LABEL = "app.kubernetes.io/component"
SPEC_HASH_ANNOTATION = "rmsft.io/spec-hash"
CONFIG_KEY = "job.yaml"
SERVE_KEY = "serve.yaml"
SERVERS_KEY = "servers"
CONFIG_DIR = "/etc/rmsft"
TOKEN_KEY = "token"
GPU_RESOURCE = "nvidia.com/gpu"
UID = 1000
# Memory/emptyDir mounts every rollout and learner pod has (writable by the non-root user).
WRITABLE_MOUNTS = ("/dev/shm", "/tmp")
# spec.sync.transport shm: the learner writes each update once, as a file in a node-local memory
# directory that every rollout server of the job mounts too; gRPC carries only a header naming it.
SHARED_WEIGHTS_ENV = "RMSFT_SHARED_WEIGHTS_DIR"  # read by `rmsft train` and `rmsft serve`
SHARED_WEIGHTS_VOLUME = "shared-weights"
SHARED_WEIGHTS_MOUNT = "/rmsft-shared"
CONFIG_EXIT_CODE = CONFIG_EXIT  # `rmsft train` refusing its configuration (rmsft.exit_codes): no retry can help
# Several learner ranks in a pod: torchrun under `rmsft torchrun` (rmsft.launch), whose exit code is the ranks'
# verdict rather than torchrun's 1, under tini (PID 1: it passes SIGTERM on and reaps what the ranks leave).
TORCHRUN = ("tini", "--", "rmsft", "torchrun")
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torch.distributed.launcher.api.LaunchConfig reads it
# torch's ProcessGroupNCCL reads it: what its watchdog does with a collective past the group's timeout
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
SHUTDOWN_MARGIN_S = 10  # of the grace period, left after torchrun's SIGKILL for the wrapper to exit
TORCH_RENDEZVOUS_DEFAULT_S = 600  # torch's static rendezvous timeout (static_tcp_rendezvous._default_timeout_seconds)
SHARED_WEIGHTS_HOST_ROOT = "/dev/shm/rmsft"  # on the node; one directory per job below it
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
STARTUP_PROBE_PERIOD = 10  # seconds between the rollout server's startup probes
# The init container of every rollout and learner pod that checks the model folder against training.format
# (`rmsft preflight`) before the pod's container loads the model; the operator fails the job when it fails.
PREFLIGHT_CONTAINER = "preflight"
PREFLIGHT_RESOURCES = {"cpu": "250m", "memory": "512Mi"}
# spec.learner.nodes > 1: torchrun's static rendezvous on learner pod 0 (its TCP store), and where each pod reads its
# node rank (the Indexed Job's completion index).
RENDEZVOUS_PORT = 29500
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
NODE_RANK_ENV = "RMSFT_NODE_RANK"
# spec.rollout.tls: the kubernetes.io/tls Secret, mounted read-only in the rollout and learner containers (beside
# the ConfigMap's folder, not inside it: a mount point cannot be made in a read-only ConfigMap volume).
TLS_VOLUME = "rollout-tls"
TLS_DIR = "/etc/rmsft-tls"


def names(job_name: str) -> dict[str, str]:
    return {
        "secret": f"{job_name}-token",
        "config": f"{job_name}-config",
        "service": f"{job_name}-rollout",
        "statefulset": f"{job_name}-rollout",
        "job": f"{job_name}-learner",
        "networkpolicy": f"{job_name}-rollout",
        "pool_budget": f"{job_name}-rollout",
        "learner_budget": f"{job_name}-learner",
        "learner_service": f"{job_name}-learner",  # learner.nodes > 1: the pods' DNS names (pod 0: the rendezvous)
        "learner_networkpolicy": f"{job_name}-learner",
    }


def labels(job_name: str, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rmsft",
        "app.kubernetes.io/instance": job_name,
        ROLE_LABEL: role,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        JOB_LABEL: job_name,
    }


def selector(job_name: str, role: str) -> dict[str, str]:
    return {JOB_LABEL: job_name, ROLE_LABEL: role}


def owner_reference(job_name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": job_name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def server_addresses(job: RolloutMatchingJob, namespace: str) -> list[str]:
    """Stable per-ordinal DNS names of the rollout servers (headless Service)."""
    n = names(job.metadata.name)
    port = job.spec.rollout.port
    assert job.spec.rollout.replicas is not None, "RolloutSpec's validator sets replicas"
    return [f"{n['statefulset']}-{i}.{n['service']}.{namespace}.svc:{port}" for i in range(job.spec.rollout.replicas)]


def immutable_view(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without the fields that may change in place (only rollout.replicas)."""
    view = json.loads(json.dumps(spec))
    view.get("rollout", {}).pop("replicas", None)
    return view


def spec_hash(spec: dict[str, Any]) -> str:
    blob = json.dumps(immutable_view(spec), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def object_meta(job: RolloutMatchingJob, name: str, namespace: str, uid: str, role: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(job.metadata.name, role),
        "ownerReferences": [owner_reference(job.metadata.name, uid)],
    }


def workload_meta(job: RolloutMatchingJob, name: str, namespace: str, uid: str, role: str) -> dict[str, Any]:
    """The metadata of a workload a queue admits (the rollout StatefulSet, the learner Job): `object_meta`, with Kueue's
    queue label when spec.scheduling.queueName names one. Nothing else of the job carries it (the shm cleanup Job
    is rmsft's housekeeping, not the user's work)."""
    meta = object_meta(job, name, namespace, uid, role)
    if job.spec.scheduling.queue_name:
        meta["labels"][KUEUE_QUEUE_LABEL] = job.spec.scheduling.queue_name
    return meta
