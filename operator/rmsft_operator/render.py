"""Pure functions: a validated RolloutMatchingJob -> the Kubernetes objects that run it.

No API calls here, so every object can be validated offline (tests run kubernetes-validate on
all of them) and the reconciler stays a thin create/patch loop.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from typing import Any

import yaml

from rmsft.exit_codes import CONFIG_EXIT
from rmsft.jobspec import API_GROUP, API_VERSION, KIND, RolloutMatchingJob
from rmsft.serve_options import serve_options

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
from rmsft.jobspec.pods import KUEUE_QUEUE_LABEL  # noqa: E402  (Kueue's, on the workloads it admits)
from rmsft.jobspec.rollout import HEALTH_PORT_ENV, TLS_DIR_ENV  # noqa: E402  (what the pods read)


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
    return [
        f"{n['statefulset']}-{i}.{n['service']}.{namespace}.svc:{port}"
        for i in range(job.spec.rollout.replicas)
    ]


def immutable_view(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without the fields that may change in place (only rollout.replicas)."""
    view = json.loads(json.dumps(spec))
    view.get("rollout", {}).pop("replicas", None)
    return view


def spec_hash(spec: dict[str, Any]) -> str:
    blob = json.dumps(immutable_view(spec), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _meta(job: RolloutMatchingJob, name: str, namespace: str, uid: str, role: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(job.metadata.name, role),
        "ownerReferences": [owner_reference(job.metadata.name, uid)],
    }


def _workload_meta(job: RolloutMatchingJob, name: str, namespace: str, uid: str, role: str) -> dict[str, Any]:
    """The metadata of a workload a queue admits (the rollout StatefulSet, the learner Job): `_meta`, with Kueue's
    queue label when spec.scheduling.queueName names one. Nothing else of the job carries it (the shm cleanup Job
    is rmsft's housekeeping, not the user's work)."""
    meta = _meta(job, name, namespace, uid, role)
    if job.spec.scheduling.queue_name:
        meta["labels"][KUEUE_QUEUE_LABEL] = job.spec.scheduling.queue_name
    return meta


def render_secret(job: RolloutMatchingJob, namespace: str, uid: str, token: str | None = None) -> dict[str, Any]:
    token = token or secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, names(job.metadata.name)["secret"], namespace, uid, "auth"),
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
    return [f"{n['statefulset']}-{i}.{n['service']}.{namespace}.svc:{job.spec.rollout.port}"
            for i in range(_max_replicas())]


def render_configmap(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    manifest = job.to_manifest()
    manifest["metadata"]["namespace"] = namespace
    meta = _meta(job, names(job.metadata.name)["config"], namespace, uid, "config")
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


def _headless_service(job: RolloutMatchingJob, namespace: str, uid: str, role: str, name: str,
                      ports: list[dict[str, Any]]) -> dict[str, Any]:
    """A headless Service over the job's `role` pods: DNS names for each pod, published before any is Ready (the
    learner resolves every server ordinal up front and waits on gRPC health itself; learner pods have no readiness
    probe, and their names must resolve as soon as they have addresses)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, name, namespace, uid, role),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": selector(job.metadata.name, role), "ports": ports},
    }


def render_service(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    r = job.spec.rollout
    return _headless_service(job, namespace, uid, "rollout", names(job.metadata.name)["service"], [
        {"name": "grpc", "port": r.port, "targetPort": "grpc", "protocol": "TCP"},
        {"name": "metrics", "port": r.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
    ])


def _resources(res: Any, gpus: int, accelerated: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if res.requests:
        out["requests"] = dict(res.requests)
    if res.limits:
        out["limits"] = dict(res.limits)
    if accelerated and gpus > 0:
        out.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)
        out.setdefault("requests", {})[GPU_RESOURCE] = str(gpus)
    return out


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "fsGroup": UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    # A read-only image: what the processes write goes to /tmp (an emptyDir, HOME too: vLLM's, Triton's and
    # inductor's caches), /dev/shm, the checkpoint folder and the mounted volumes.
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}


def _common_env(job: RolloutMatchingJob) -> list[dict[str, Any]]:
    n = names(job.metadata.name)
    return [
        {"name": "RMSFT_AUTH_TOKEN",
         "valueFrom": {"secretKeyRef": {"name": n["secret"], "key": TOKEN_KEY}}},
        {"name": "RMSFT_LOG_LEVEL", "value": job.spec.monitoring.log_level},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "HOME", "value": "/tmp"},
    ]


def _volumes(job: RolloutMatchingJob, shm_size: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    n = names(job.metadata.name)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": n["config"]}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    vol = job.spec.model.volume
    if vol is not None and (vol.claim_name or vol.host_path):
        if vol.claim_name:
            volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": vol.claim_name,
                                                                        "readOnly": True}})
        else:
            volumes.append({"name": "model", "hostPath": {"path": vol.host_path, "type": "Directory"}})
        mounts.append({"name": "model", "mountPath": vol.mount_path, "readOnly": True})
    return volumes, mounts


def _with_tls(job: RolloutMatchingJob, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]],
              role: str = "rollout") -> None:
    """spec.rollout.tls: the Secret's keys, by name (`items`: never the whole Secret, whatever else it holds), mounted
    read-only in the pod's main container (`mounts`; the preflight init container gets only the mounts it needs).
    The servers get tls.crt and tls.key (the private key only where it is used); the learner only what it trusts:
    ca.crt when the Secret has one (optional) and tls.crt. Mode 0440 with the pods' fsGroup: readable by the
    non-root user, by no other. The operator never reads the Secret (no RBAC on Secrets' contents needed): the
    kubelet mounts it; a missing one holds the pod in ContainerCreating (a FailedMount event) until the startup
    timeout fails the job."""
    tls = job.spec.rollout.tls
    if tls is None:
        return
    if role == "rollout":
        volumes.append({"name": TLS_VOLUME, "secret": {"secretName": tls.secret_name, "defaultMode": 0o440, "items": [
            {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}})
    else:
        volumes.append({"name": TLS_VOLUME, "projected": {"defaultMode": 0o440, "sources": [
            {"secret": {"name": tls.secret_name, "items": [{"key": "ca.crt", "path": "ca.crt"}], "optional": True}},
            {"secret": {"name": tls.secret_name, "items": [{"key": "tls.crt", "path": "tls.crt"}]}}]}})
    mounts.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})


def _preflight_container(job: RolloutMatchingJob, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """`rmsft preflight` on the job's manifest: reads the model folder's tokenizer files (JSON, under a
    second) and exits 2 with the fix when the model does not fit training.format, e.g. a stock checkpoint
    with coordexp, before the pod's container loads the model on its GPUs. Same image and mounts (the
    config and the model volume), no GPU: an init container's requests count only towards the pod's
    largest single request, and it loads nothing on a device. NVIDIA_VISIBLE_DEVICES=void keeps the NVIDIA
    runtime from handing it the node's GPUs anyway (images built on CUDA bases ask for all of them)."""
    wanted = {CONFIG_DIR, "/tmp"} | ({job.spec.model.volume.mount_path} if job.spec.model.volume else set())
    return {
        "name": PREFLIGHT_CONTAINER,
        "image": job.spec.image.ref,
        "imagePullPolicy": job.spec.image.pull_policy,
        "args": ["preflight", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                {"name": "CUDA_VISIBLE_DEVICES", "value": ""}],
        # A Qwen-VL tokenizer (150k tokens) takes about 0.6 s and 110 MiB. Requests equal to limits: a pod whose
        # containers all have that keeps its Guaranteed QoS class.
        "resources": {"requests": dict(PREFLIGHT_RESOURCES), "limits": dict(PREFLIGHT_RESOURCES)},
        "volumeMounts": [dict(m) for m in mounts if m["mountPath"] in wanted],
        "securityContext": _container_security(),
        # `rmsft preflight` writes its message to /dev/termination-log; the log's tail if it could not.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _pod_common(job: RolloutMatchingJob) -> dict[str, Any]:
    p = job.spec.placement
    # Neither rollout servers nor learners call the Kubernetes API: no token in their pods.
    spec: dict[str, Any] = {"securityContext": _pod_security(), "enableServiceLinks": False,
                            "automountServiceAccountToken": False}
    if p.node_selector:
        spec["nodeSelector"] = dict(p.node_selector)
    if p.tolerations:
        spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in p.tolerations]
    if job.spec.image.pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in job.spec.image.pull_secrets]
    if job.spec.scheduling.scheduler_name:
        spec["schedulerName"] = job.spec.scheduling.scheduler_name
    return spec


def _pod_meta(job: RolloutMatchingJob, role: str, metrics_port: int) -> dict[str, Any]:
    """A rollout or learner pod template's metadata: rmsft's labels and scrape annotations, and the user's
    (spec.scheduling.podLabels / podAnnotations, whose keys cannot be rmsft's: the spec refuses them)."""
    sch = job.spec.scheduling
    return {"labels": {**sch.pod_labels, **labels(job.metadata.name, role)},
            "annotations": {**sch.pod_annotations,
                            "prometheus.io/scrape": str(job.spec.monitoring.enabled).lower(),
                            "prometheus.io/port": str(metrics_port)}}


def shared_weights_host_path(namespace: str, job_name: str) -> str:
    """The job's directory on the node (both parts are DNS labels, without dots: one per job)."""
    return f"{SHARED_WEIGHTS_HOST_ROOT}/{namespace}.{job_name}"


def _colocation(job_name: str) -> dict[str, Any]:
    """Every pod of the job on one node: a file in the node's memory is seen on that node only.

    One required term on both pod templates, matching any pod of the job (server or learner). The
    first pod can schedule because the scheduler lets a pod whose required term matches no pod
    yet go anywhere when the pod matches its own term; every later pod follows it: the other
    servers, the learner (created suspended and resumed only once the pool is Ready, so the
    servers are placed by then), a server added by a scale-up, a new server next to a learner
    still running after the pool was scaled to zero. A preferred term would let servers spill onto
    a second node when the first is full, where they could not open the learner's files; required
    leaves such a pod Pending instead, and the RolloutReady condition quotes the scheduler.
    """
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {JOB_LABEL: job_name}}, "topologyKey": HOSTNAME_TOPOLOGY},
    ]}}


def _with_shared_weights(job: RolloutMatchingJob, namespace: str, pod: dict[str, Any], writer: bool) -> dict[str, Any]:
    """The pod spec as sync.transport needs it: unchanged for grpc; for shm, the job's directory in
    the node's /dev/shm (a hostPath: an emptyDir, even in memory, belongs to one pod), mounted at
    SHARED_WEIGHTS_MOUNT and named by SHARED_WEIGHTS_ENV, and the pod bound to the job's node.
    `writer`: the learner's pod, which writes the update files (the servers only read them). The
    pod's own /dev/shm emptyDir stays as it is."""
    if job.spec.sync.cluster_transport != "shm":
        return pod
    mount = {"name": SHARED_WEIGHTS_VOLUME, "mountPath": SHARED_WEIGHTS_MOUNT}
    volume = {"name": SHARED_WEIGHTS_VOLUME, "hostPath": {
        "path": shared_weights_host_path(namespace, job.metadata.name), "type": "DirectoryOrCreate"}}
    (container,) = pod["containers"]
    container = {**container, "env": [*container["env"], {"name": SHARED_WEIGHTS_ENV, "value": SHARED_WEIGHTS_MOUNT}],
                 "volumeMounts": [*container["volumeMounts"], mount]}
    pod = {**pod, "affinity": _colocation(job.metadata.name), "containers": [container],
           "volumes": [*pod["volumes"], volume]}
    if not writer:
        return pod  # a directory made by the kubelet (root, 0755) or by the learner (below) is readable
    # The kubelet creates a missing hostPath directory as root with mode 0755, and fsGroup does not
    # reach hostPath volumes: without this the non-root learner could not write its files there.
    owner = {
        "name": "shared-weights-owner",
        "image": job.spec.image.ref,
        "imagePullPolicy": job.spec.image.pull_policy,
        "command": ["sh", "-c", f"chown {UID}:{UID} {SHARED_WEIGHTS_MOUNT} && chmod 0770 {SHARED_WEIGHTS_MOUNT}"],
        # Root, with only the two capabilities chown/chmod of a directory need (FOWNER: it is no
        # longer root's once an earlier learner pod of the job ran this). The hostPath volume
        # already needs a namespace at Pod Security level privileged, which admits it.
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
                            "readOnlyRootFilesystem": True},
        "volumeMounts": [dict(mount)],
    }
    return {**pod, "initContainers": [*pod.get("initContainers", []), owner]}


SHM_CLEANUP_MOUNT = "/shared-weights"  # the job's own folder, in the cleanup container


def render_shm_cleanup(job: RolloutMatchingJob, namespace: str, node: str, image: str = "",
                       pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """A Job that empties the job's shared-weights directory (/dev/shm/rmsft/<ns>.<job>) on `node`,
    created when an shm job is deleted: nothing else can, since the kubelet never removes a hostPath
    directory and the operator cannot reach a node's files. No owner reference (its owner is going
    away); `ttlSecondsAfterFinished: 0` has Kubernetes delete it, and its pod, once it has run.

    `image`: the operator's own (RMSFT_OPERATOR_IMAGE, which the chart sets); empty, for an operator
    run outside the chart, the job's own image, which grants nothing more: the learner pod already
    ran that image on that folder, and the privilege below comes from the pod's security context,
    whatever the image.

    Least privilege: the learner's non-root user (UID: the folder is the learner's, chowned to it with
    mode 0770 by the shared-weights-owner init container), no capability, a read-only image, and only
    the job's own folder mounted (never the node's whole /dev/shm/rmsft, where the other jobs' folders
    are). It removes everything inside the folder and leaves the folder itself, empty: removing it
    would need write access on its root-owned parent, that is root (or DAC_OVERRIDE) with the parent
    mounted, which is what this Job must not have. An empty directory in tmpfs holds no pages (an
    inode's worth of kernel memory); it goes with the node's next reboot, and a job created again
    under the same name and namespace reuses it."""
    if not image:
        image, pull_policy = job.spec.image.ref, job.spec.image.pull_policy
    volume = {"name": SHARED_WEIGHTS_VOLUME, "hostPath": {
        # Directory, not DirectoryOrCreate: a folder that is not there has nothing to remove, and
        # creating it would leave a root-owned one behind (the pod then never starts; the deadline
        # below ends the Job and the TTL deletes it).
        "path": shared_weights_host_path(namespace, job.metadata.name), "type": "Directory"}}
    container = {
        "name": "remove",
        "image": image,
        "imagePullPolicy": pull_policy,
        # Everything in the folder, not the folder (the mount point itself cannot go anyway). The
        # learner's files and subfolders are its user's: the folder's write bit is all it takes.
        "command": ["find", SHM_CLEANUP_MOUNT, "-mindepth", "1", "-delete"],
        "securityContext": _container_security(),
        "volumeMounts": [{"name": SHARED_WEIGHTS_VOLUME, "mountPath": SHM_CLEANUP_MOUNT}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
    }
    # No fsGroup: it would add nothing (a hostPath volume is never chowned to it) and the user's own
    # group is the folder's group already.
    security = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                "seccompProfile": {"type": "RuntimeDefault"}}
    pod = {**_pod_common(job), "securityContext": security,
           "restartPolicy": "Never", "nodeName": node, "containers": [container], "volumes": [volume]}
    pod.pop("nodeSelector", None)  # nodeName places it; the job's selector chose that node already
    meta = {"name": f"{job.metadata.name}-shm-cleanup", "namespace": namespace,
            "labels": labels(job.metadata.name, "shm-cleanup")}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 2, "ttlSecondsAfterFinished": 0, "activeDeadlineSeconds": 300,
                     "template": {"metadata": {"labels": labels(job.metadata.name, "shm-cleanup")}, "spec": pod}}}


def render_statefulset(job: RolloutMatchingJob, namespace: str, uid: str,
                       replicas: int | None = None) -> dict[str, Any]:
    name = job.metadata.name
    n = names(name)
    r = job.spec.rollout
    accelerated = job.spec.placement.accelerator == "nvidia"
    volumes, mounts = _volumes(job, r.shm_size)
    preflight = _preflight_container(job, mounts)
    _with_tls(job, volumes, mounts)
    # The kubelet's gRPC probes cannot speak TLS (nor present a token). With spec.rollout.tls the server also
    # answers grpc.health.v1, and nothing else, in plaintext on tls.healthPort, and the probes go there: the
    # same health state as on the TLS port, no rollout call, no weights; the NetworkPolicy opens that port to no
    # pod (the kubelet probes from its node). An exec probe would need a client in the image and start a Python
    # process per probe, every 5 s.
    probe_port = r.tls.health_port if r.tls else r.port
    env = _common_env(job)
    ports = [{"name": "grpc", "containerPort": r.port, "protocol": "TCP"},
             {"name": "metrics", "containerPort": r.metrics_port, "protocol": "TCP"}]
    if r.tls:
        env = [*env, {"name": HEALTH_PORT_ENV, "value": str(r.tls.health_port)}]
        ports.append({"name": "health", "containerPort": r.tls.health_port, "protocol": "TCP"})
    container = {
        "name": "rollout",
        "image": job.spec.image.ref,
        "imagePullPolicy": job.spec.image.pull_policy,
        # Engine, ports and limits come from the serve config rendered from the job spec.
        "args": ["serve", "--config", f"{CONFIG_DIR}/{SERVE_KEY}"],
        "env": env,
        "ports": ports,
        # Engine load takes minutes on big models: the startup probe holds liveness off until then, for as
        # long as spec.rollout.startupTimeout allows (the kubelet must not restart a server the operator
        # still waits for; past it the operator fails the job anyway).
        "startupProbe": {"grpc": {"port": probe_port}, "periodSeconds": STARTUP_PROBE_PERIOD,
                         "failureThreshold": -(-r.startup_timeout_seconds // STARTUP_PROBE_PERIOD)},
        "readinessProbe": {"grpc": {"port": probe_port}, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"grpc": {"port": probe_port}, "periodSeconds": 20, "failureThreshold": 6},
        "resources": _resources(r.resources, r.tensor_parallel_size, accelerated),
        "volumeMounts": mounts,
        "securityContext": _container_security(),
        # A server that exits at start (e.g. /dev/shm too small for a FULL sync) says why in the
        # pod's status, where the operator reads it into the RolloutReady condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = _with_shared_weights(job, namespace, {**_pod_common(job), "containers": [container],
                                                     "initContainers": [preflight],
                                                     "volumes": volumes}, writer=False)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _workload_meta(job, n["statefulset"], namespace, uid, "rollout"),
        "spec": {
            "replicas": r.replicas if replicas is None else replicas,
            "serviceName": n["service"],
            # Servers are independent: start them all at once instead of one by one.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(name, "rollout")},
            "template": {"metadata": _pod_meta(job, "rollout", r.metrics_port), "spec": pod_spec},
        },
    }


def render_job(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    name = job.metadata.name
    n = names(name)
    lr = job.spec.learner
    accelerated = job.spec.placement.accelerator == "nvidia"
    volumes, mounts = _volumes(job, lr.shm_size)
    # The learner saves at the end of every run: its checkpoint dir must be writable by the
    # non-root user. A claim persists it; without one an emptyDir keeps the run from failing at
    # its last step (the checkpoint then lives as long as the pod; the status says so).
    ckpt_dir = job.spec.training.checkpoint.dir.rstrip("/") or "/"
    if lr.checkpoint_claim:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": lr.checkpoint_claim}})
        mounts.append({"name": "checkpoints", "mountPath": ckpt_dir})
    elif not any(ckpt_dir == m or ckpt_dir.startswith(m + "/") for m in WRITABLE_MOUNTS):
        volumes.append({"name": "checkpoints", "emptyDir": {}})
        mounts.append({"name": "checkpoints", "mountPath": ckpt_dir})
    preflight = _preflight_container(job, mounts)
    env = _common_env(job)
    if job.spec.rollout.tls and not job.spec.rollout.colocated:
        _with_tls(job, volumes, mounts, "learner")
        # What the learner trusts: ca.crt of the Secret, or its tls.crt (self-signed) when it has none. It reaches
        # the servers by the names the certificate must cover (server_addresses), so gRPC's own host name check of
        # each channel is the server name check.
        env = [*env, {"name": TLS_DIR_ENV, "value": TLS_DIR}]
    container: dict[str, Any] = {
        "name": "learner",
        "image": job.spec.image.ref,
        "imagePullPolicy": job.spec.image.pull_policy,
        # Colocate: the rollout engine runs in the learner's own ranks, there are no servers to follow.
        "args": ["train", "--config", f"{CONFIG_DIR}/{CONFIG_KEY}",
                 *(() if job.spec.rollout.colocated else ("--servers-file", f"{CONFIG_DIR}/{SERVERS_KEY}"))],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": lr.metrics_port, "protocol": "TCP"}],
        "resources": _resources(lr.resources, lr.gpus, accelerated),
        "volumeMounts": mounts,
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    ranks = lr.ranks(accelerated)
    pods = lr.nodes
    if pods > 1:
        # Several pods: torchrun in each meets the others at pod 0 (static rendezvous: its TCP store on pod 0's
        # stable name, which the Indexed Job's hostname and the headless Service give it), each pod's node rank its
        # completion index; WORLD_SIZE = pods x ranks, RANK = node rank x ranks + local rank (`rmsft train` reads them:
        # global rank 0 talks to the rollout servers, every rank gets its share of the batch).
        container["env"] = [*container["env"], {"name": NODE_RANK_ENV, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}}]
        container["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
        # The rendezvous waits as long as the operator's start clock (spec.rollout.startupTimeout) lets a pod take to
        # start (torch's static rendezvous gives up after 600 s, before a pod still pulling its image is late).
        rendezvous_s = max(TORCH_RENDEZVOUS_DEFAULT_S, job.spec.rollout.startup_timeout_seconds)
        container["command"] = [
            *TORCHRUN, "--nnodes", str(pods), "--node-rank", f"$({NODE_RANK_ENV})",
            "--nproc-per-node", str(ranks), "--master-addr", learner_pod_host(job, namespace, 0),
            "--master-port", str(RENDEZVOUS_PORT), "--rdzv-conf", f"timeout={rendezvous_s}", "-m", "rmsft_cli",
        ]
    elif ranks > 1:
        # One learner rank per GPU (or ranksPerPod gloo ranks on the CPU): torchrun starts them and sets
        # WORLD_SIZE/RANK/LOCAL_RANK, which `rmsft train` reads (rank 0 talks to the rollout servers, the others get
        # their share).
        container["command"] = [*TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), "-m", "rmsft_cli"]
    if pods > 1 or ranks > 1:
        # After SIGTERM torchrun's agent gives its ranks this long to finish the step and save before it SIGKILLs
        # them (torch's default: 30 s); the rest of the grace period is the wrapper's, to read the ranks' verdict.
        shutdown_s = torchrun_shutdown_seconds(lr.termination_grace_period_seconds)
        container["env"] = [*container["env"], {"name": SHUTDOWN_TIMEOUT_ENV, "value": str(shutdown_s)}]
    pod_spec = _with_shared_weights(job, namespace, {
        **_pod_common(job), "restartPolicy": "Never", "containers": [container],
        # After SIGTERM: the step in progress, a checkpoint, exit (rmsft train), then the retry resumes.
        "terminationGracePeriodSeconds": lr.termination_grace_period_seconds,
        "initContainers": [preflight], "volumes": volumes}, writer=True)
    if pods > 1:
        pod_spec["subdomain"] = n["learner_service"]  # hostname <job>-learner-<index>, resolvable in the Service
        mine = {"matchLabels": selector(name, "learner")}
        if lr.spread:
            pod_spec.setdefault("affinity", {})["podAntiAffinity"] = {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": mine, "topologyKey": HOSTNAME_TOPOLOGY}]}
        if job.spec.scheduling.learner_topology_key:
            # Every learner pod in the domain of the first one placed (a pod whose required term matches no pod yet
            # may go anywhere when it matches its own term: the first one picks the domain).
            pod_spec.setdefault("affinity", {})["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": mine, "topologyKey": job.spec.scheduling.learner_topology_key}]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _workload_meta(job, n["job"], namespace, uid, "learner"),
        "spec": {
            # Created suspended: the operator resumes it once every rollout server is Ready; or, with
            # spec.scheduling.queueName, Kueue resumes it when it admits it (the learner then waits for the pool).
            "suspend": True,
            "backoffLimit": lr.backoff_limit,
            # A pod lost to a disruption (an eviction, a drain, a preemption: the pod gets a DisruptionTarget
            # condition) does not count against backoffLimit: its retry resumes from the checkpoint it saved on
            # SIGTERM. A learner that refused its configuration (exit 2: the same spec fails the same way) fails the
            # job at once instead of retrying.
            "podFailurePolicy": {"rules": _learner_failure_rules(pods)},
            "completions": pods,
            "parallelism": pods,
            **({"completionMode": "Indexed"} if pods > 1 else {}),
            "template": {"metadata": _pod_meta(job, "learner", lr.metrics_port), "spec": pod_spec},
        },
    }


def _learner_failure_rules(pods: int) -> list[dict[str, Any]]:
    """The learner Job's podFailurePolicy. One pod: a disruption is not counted (the retry resumes from the checkpoint
    saved on SIGTERM) and a refused configuration fails at once. Several pods are one torchrun world: a pod lost for
    any reason (a disruption, an exit that is not 0 in any container) leaves its peers blocked in a collective, so the
    Job fails at once and its condition names the pod, instead of restarting that pod alone into a world that is
    gone."""
    if pods > 1:
        return [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}}]
    return [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": "learner", "operator": "In",
                                                  "values": [CONFIG_EXIT_CODE]}}]


def checkpoint_cadence(job: RolloutMatchingJob) -> str:
    """When the learner saves, as the CheckpointsDurable condition says it at admission: a job with no periodic
    checkpoint keeps nothing of a pod killed outright (an OOM, a lost node) but what it saved at the end or on
    SIGTERM."""
    ck, minutes = job.spec.training.checkpoint, job.spec.checkpoint_minutes
    when = [f"every {ck.every} steps"] if ck.every else []
    when += [f"every {minutes} minutes"] if minutes else []
    if when:
        return f"saved {' and '.join(when)}, at the end and on SIGTERM"
    return ("no periodic checkpoint (spec.training.checkpoint.every and every_minutes are 0): saved only at the end "
            "and on SIGTERM, so a learner killed outright (an OOM, a lost node) starts again from step 0")


def torchrun_shutdown_seconds(grace_s: int) -> int:
    """How long torchrun's agent waits for its ranks after SIGTERM: the pod's grace period but a margin, so the
    ranks' step and checkpoint get nearly all of it and the kubelet's SIGKILL never comes first."""
    return max(1, grace_s - SHUTDOWN_MARGIN_S)


def learner_pod_host(job: RolloutMatchingJob, namespace: str, index: int) -> str:
    """The stable DNS name of learner pod `index` of a learner.nodes > 1 job: the Indexed Job names its pods' hosts
    <job>-learner-<index>, and the headless Service makes them resolvable in the namespace."""
    n = names(job.metadata.name)
    return f"{n['job']}-{index}.{n['learner_service']}.{namespace}.svc"


def render_learner_service(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    """learner.nodes > 1: the headless Service that gives each learner pod a DNS name (pod 0's is the rendezvous)."""
    return _headless_service(job, namespace, uid, "learner", names(job.metadata.name)["learner_service"], [
        {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"}])


def _ingress_policy(job: RolloutMatchingJob, namespace: str, uid: str, key: str, component: str,
                    ingress: list[dict[str, Any]]) -> dict[str, Any]:
    """A NetworkPolicy named `names(job)[key]` on the job's `component` pods: only `ingress` reaches them."""
    name = job.metadata.name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, names(name)[key], namespace, uid, component),
        "spec": {"podSelector": {"matchLabels": selector(name, component)}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }


def render_networkpolicy(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    name = job.metadata.name
    r = job.spec.rollout
    return _ingress_policy(job, namespace, uid, "networkpolicy", "rollout", [
                {   # gRPC (Generate, UpdateWeights, health) only from this job's learner pod, and from
                    # its other rollout pods: an update is relayed server to server (rollout_svc/relay.py)
                    "from": [{"podSelector": {"matchLabels": selector(name, "learner")}},
                             {"podSelector": {"matchLabels": selector(name, "rollout")}}],
                    "ports": [{"protocol": "TCP", "port": r.port}],
                },
                *([{  # transport nccl: the weight-transfer group's own connections (its rendezvous on the learner,
                    # then rank to rank on ports NCCL or gloo pick), from the same pods only
                    "from": [{"podSelector": {"matchLabels": selector(name, "learner")}},
                             {"podSelector": {"matchLabels": selector(name, "rollout")}}],
                }] if job.spec.sync.cluster_transport == "nccl" else []),
                {   # metrics from the monitoring namespace
                    "from": [{"namespaceSelector": {"matchLabels": {
                        "kubernetes.io/metadata.name": job.spec.monitoring.namespace}}}],
                    "ports": [{"protocol": "TCP", "port": r.metrics_port}],
                },
    ])


def render_learner_networkpolicy(job: RolloutMatchingJob, namespace: str, uid: str) -> dict[str, Any]:
    """Ingress to the learner pods: torchrun's rendezvous store (RENDEZVOUS_PORT) and the ranks' collectives (ports
    NCCL or gloo pick) from the job's own learner pods only; with transport nccl, the weight-transfer group's store
    and connections from the job's own rollout pods only (that group's traffic is not encrypted, TLS or not:
    docs/operator.md, "Network"); /metrics from anywhere (the operator reads the learner's progress there, and
    Prometheus). Nothing else reaches a learner pod."""
    name = job.metadata.name
    own_learners = {"podSelector": {"matchLabels": selector(name, "learner")}}
    nccl = job.spec.sync.cluster_transport == "nccl" and not job.spec.rollout.colocated
    return _ingress_policy(job, namespace, uid, "learner_networkpolicy", "learner", [
        {"from": [own_learners]},  # rendezvous + collectives, any port, the job's learner pods only
        *([{"from": [{"podSelector": {"matchLabels": selector(name, "rollout")}}]}] if nccl else []),
        {"ports": [{"protocol": "TCP", "port": job.spec.learner.metrics_port}]},
    ])


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
        "metadata": _meta(job, n["pool_budget" if pool else "learner_budget"], namespace, uid, role),
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
    pool = [] if job.spec.rollout.colocated else [
        render_service(job, namespace, uid),
        render_networkpolicy(job, namespace, uid),
        *([render_disruption_budget(job, namespace, uid, "rollout")] if job.spec.rollout.disruption_budget else []),
        render_statefulset(job, namespace, uid),
    ]
    learner_budget = [render_disruption_budget(job, namespace, uid, "learner")] \
        if job.spec.learner.disruption_budget else []
    learner_service = [render_learner_service(job, namespace, uid)] if job.spec.learner.nodes > 1 else []
    return [render_secret(job, namespace, uid, token), render_configmap(job, namespace, uid), *pool,
            *learner_budget, render_learner_networkpolicy(job, namespace, uid), *learner_service,
            render_job(job, namespace, uid)]
