"""The job's pods, pure: the rollout servers' StatefulSet and the learner Job, with what their pod templates share
(resources, security contexts, volumes, TLS, the model preflight, the shared-memory volume; its cleanup Job is
render_cleanup's)."""

from __future__ import annotations

from typing import Any

from rmsft.jobspec import RolloutMatchingJob
from rmsft.jobspec.rollout import HEALTH_PORT_ENV, TLS_DIR_ENV  # what the pods read
from rmsft_operator.render_meta import (
    COMPLETION_INDEX_ANNOTATION,
    CONFIG_DIR,
    CONFIG_EXIT_CODE,
    CONFIG_KEY,
    GPU_RESOURCE,
    HOSTNAME_TOPOLOGY,
    JOB_LABEL,
    NCCL_ERROR_HANDLING_ENV,
    NODE_RANK_ENV,
    PREFLIGHT_CONTAINER,
    PREFLIGHT_RESOURCES,
    RENDEZVOUS_PORT,
    SERVE_KEY,
    SERVERS_KEY,
    SHARED_WEIGHTS_ENV,
    SHARED_WEIGHTS_HOST_ROOT,
    SHARED_WEIGHTS_MOUNT,
    SHARED_WEIGHTS_VOLUME,
    SHUTDOWN_MARGIN_S,
    SHUTDOWN_TIMEOUT_ENV,
    STARTUP_PROBE_PERIOD,
    TLS_DIR,
    TLS_VOLUME,
    TOKEN_KEY,
    TORCH_RENDEZVOUS_DEFAULT_S,
    TORCHRUN,
    UID,
    WRITABLE_MOUNTS,
    labels,
    names,
    selector,
    workload_meta,
)


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


def container_security() -> dict[str, Any]:
    # A read-only image: what the processes write goes to /tmp (an emptyDir, HOME too: vLLM's, Triton's and
    # inductor's caches), /dev/shm, the checkpoint folder and the mounted volumes.
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}


def _common_env(job: RolloutMatchingJob) -> list[dict[str, Any]]:
    n = names(job.metadata.name)
    return [
        {"name": "RMSFT_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": n["secret"], "key": TOKEN_KEY}}},
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
            volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": vol.claim_name, "readOnly": True}})
        else:
            volumes.append({"name": "model", "hostPath": {"path": vol.host_path, "type": "Directory"}})
        mounts.append({"name": "model", "mountPath": vol.mount_path, "readOnly": True})
    return volumes, mounts


def _with_tls(
    job: RolloutMatchingJob, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]], role: str = "rollout"
) -> None:
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
        volumes.append(
            {
                "name": TLS_VOLUME,
                "secret": {
                    "secretName": tls.secret_name,
                    "defaultMode": 0o440,
                    "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
                },
            }
        )
    else:
        volumes.append(
            {
                "name": TLS_VOLUME,
                "projected": {
                    "defaultMode": 0o440,
                    "sources": [
                        {
                            "secret": {
                                "name": tls.secret_name,
                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                "optional": True,
                            }
                        },
                        {"secret": {"name": tls.secret_name, "items": [{"key": "tls.crt", "path": "tls.crt"}]}},
                    ],
                },
            }
        )
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
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
            {"name": "CUDA_VISIBLE_DEVICES", "value": ""},
        ],
        # A Qwen-VL tokenizer (150k tokens) takes about 0.6 s and 110 MiB. Requests equal to limits: a pod whose
        # containers all have that keeps its Guaranteed QoS class.
        "resources": {"requests": dict(PREFLIGHT_RESOURCES), "limits": dict(PREFLIGHT_RESOURCES)},
        "volumeMounts": [dict(m) for m in mounts if m["mountPath"] in wanted],
        "securityContext": container_security(),
        # `rmsft preflight` writes its message to /dev/termination-log; the log's tail if it could not.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def pod_common(job: RolloutMatchingJob) -> dict[str, Any]:
    p = job.spec.placement
    # Neither rollout servers nor learners call the Kubernetes API: no token in their pods.
    spec: dict[str, Any] = {
        "securityContext": _pod_security(),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
    }
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
    return {
        "labels": {**sch.pod_labels, **labels(job.metadata.name, role)},
        "annotations": {
            **sch.pod_annotations,
            "prometheus.io/scrape": str(job.spec.monitoring.enabled).lower(),
            "prometheus.io/port": str(metrics_port),
        },
    }


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
    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {JOB_LABEL: job_name}}, "topologyKey": HOSTNAME_TOPOLOGY},
            ]
        }
    }


def _with_shared_weights(job: RolloutMatchingJob, namespace: str, pod: dict[str, Any], writer: bool) -> dict[str, Any]:
    """The pod spec as sync.transport needs it: unchanged for grpc; for shm, the job's directory in
    the node's /dev/shm (a hostPath: an emptyDir, even in memory, belongs to one pod), mounted at
    SHARED_WEIGHTS_MOUNT and named by SHARED_WEIGHTS_ENV, and the pod bound to the job's node.
    `writer`: the learner's pod, which writes the update files (the servers only read them). The
    pod's own /dev/shm emptyDir stays as it is."""
    if job.spec.sync.cluster_transport != "shm":
        return pod
    mount = {"name": SHARED_WEIGHTS_VOLUME, "mountPath": SHARED_WEIGHTS_MOUNT}
    volume = {
        "name": SHARED_WEIGHTS_VOLUME,
        "hostPath": {"path": shared_weights_host_path(namespace, job.metadata.name), "type": "DirectoryOrCreate"},
    }
    (container,) = pod["containers"]
    container = {
        **container,
        "env": [*container["env"], {"name": SHARED_WEIGHTS_ENV, "value": SHARED_WEIGHTS_MOUNT}],
        "volumeMounts": [*container["volumeMounts"], mount],
    }
    pod = {
        **pod,
        "affinity": _colocation(job.metadata.name),
        "containers": [container],
        "volumes": [*pod["volumes"], volume],
    }
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
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [dict(mount)],
    }
    return {**pod, "initContainers": [*pod.get("initContainers", []), owner]}


def render_statefulset(
    job: RolloutMatchingJob, namespace: str, uid: str, replicas: int | None = None
) -> dict[str, Any]:
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
    ports = [
        {"name": "grpc", "containerPort": r.port, "protocol": "TCP"},
        {"name": "metrics", "containerPort": r.metrics_port, "protocol": "TCP"},
    ]
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
        "startupProbe": {
            "grpc": {"port": probe_port},
            "periodSeconds": STARTUP_PROBE_PERIOD,
            "failureThreshold": -(-r.startup_timeout_seconds // STARTUP_PROBE_PERIOD),
        },
        "readinessProbe": {"grpc": {"port": probe_port}, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"grpc": {"port": probe_port}, "periodSeconds": 20, "failureThreshold": 6},
        "resources": _resources(r.resources, r.tensor_parallel_size, accelerated),
        "volumeMounts": mounts,
        "securityContext": container_security(),
        # A server that exits at start (e.g. /dev/shm too small for a FULL sync) says why in the
        # pod's status, where the operator reads it into the RolloutReady condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = _with_shared_weights(
        job,
        namespace,
        {**pod_common(job), "containers": [container], "initContainers": [preflight], "volumes": volumes},
        writer=False,
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": workload_meta(job, n["statefulset"], namespace, uid, "rollout"),
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
    _with_checkpoints(job, volumes, mounts)
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
        "args": [
            "train",
            "--config",
            f"{CONFIG_DIR}/{CONFIG_KEY}",
            *(() if job.spec.rollout.colocated else ("--servers-file", f"{CONFIG_DIR}/{SERVERS_KEY}")),
        ],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": lr.metrics_port, "protocol": "TCP"}],
        "resources": _resources(lr.resources, lr.gpus, accelerated),
        "volumeMounts": mounts,
        "securityContext": container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    ranks, pods = lr.ranks(accelerated), lr.nodes
    _with_launcher(job, namespace, container, pods, ranks)
    pod_spec = _with_shared_weights(
        job,
        namespace,
        {
            **pod_common(job),
            "restartPolicy": "Never",
            "containers": [container],
            # After SIGTERM: the step in progress, a checkpoint, exit (rmsft train), then the retry resumes.
            "terminationGracePeriodSeconds": lr.termination_grace_period_seconds,
            "initContainers": [preflight],
            "volumes": volumes,
        },
        writer=True,
    )
    if pods > 1:
        _place_learner_pods(job, pod_spec)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": workload_meta(job, n["job"], namespace, uid, "learner"),
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


def _with_checkpoints(job: RolloutMatchingJob, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> None:
    """The learner saves at the end of every run: its checkpoint dir must be writable by the non-root user. A claim
    persists it; without one an emptyDir keeps the run from failing at its last step (the checkpoint then lives as
    long as the pod; the status says so)."""
    lr = job.spec.learner
    ckpt_dir = job.spec.training.checkpoint.dir.rstrip("/") or "/"
    if lr.checkpoint_claim:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": lr.checkpoint_claim}})
        mounts.append({"name": "checkpoints", "mountPath": ckpt_dir})
    elif not any(ckpt_dir == m or ckpt_dir.startswith(m + "/") for m in WRITABLE_MOUNTS):
        volumes.append({"name": "checkpoints", "emptyDir": {}})
        mounts.append({"name": "checkpoints", "mountPath": ckpt_dir})


def _with_launcher(job: RolloutMatchingJob, namespace: str, container: dict[str, Any], pods: int, ranks: int) -> None:
    """How the learner container starts its ranks: itself (one rank), torchrun standalone (several ranks in one pod)
    or torchrun meeting the other pods at pod 0 (several pods)."""
    lr = job.spec.learner
    if pods > 1:
        # Several pods: torchrun in each meets the others at pod 0 (static rendezvous: its TCP store on pod 0's
        # stable name, which the Indexed Job's hostname and the headless Service give it), each pod's node rank its
        # completion index; WORLD_SIZE = pods x ranks, RANK = node rank x ranks + local rank (`rmsft train` reads them:
        # global rank 0 talks to the rollout servers, every rank gets its share of the batch).
        container["env"] = [
            *container["env"],
            {
                "name": NODE_RANK_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
            },
        ]
        container["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
        # The rendezvous waits as long as the operator's start clock (spec.rollout.startupTimeout) lets a pod take to
        # start (torch's static rendezvous gives up after 600 s, before a pod still pulling its image is late).
        rendezvous_s = max(TORCH_RENDEZVOUS_DEFAULT_S, job.spec.rollout.startup_timeout_seconds)
        container["command"] = [
            *TORCHRUN,
            "--nnodes",
            str(pods),
            "--node-rank",
            f"$({NODE_RANK_ENV})",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            learner_pod_host(job, namespace, 0),
            "--master-port",
            str(RENDEZVOUS_PORT),
            "--rdzv-conf",
            f"timeout={rendezvous_s}",
            "-m",
            "rmsft_cli",
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
        if job.spec.placement.accelerator == "nvidia":
            # The ranks' NCCL group: torch's watchdog fails a collective past the group's timeout (`rmsft train`
            # gives it learner.train.start_checks.collective_timeout_s); 1 aborts the communicator before it ends
            # the rank, so the other ranks' collectives fail at once instead of each waiting out its own timeout,
            # and the container's verdict (75, retried) follows. torchrun's agent sets 1 when the variable is unset
            # (torch's own default is 3: end the process, communicator left); set here so it holds under any
            # launcher and shows in the pod's spec.
            container["env"] = [*container["env"], {"name": NCCL_ERROR_HANDLING_ENV, "value": "1"}]


def _place_learner_pods(job: RolloutMatchingJob, pod_spec: dict[str, Any]) -> None:
    """A learner on several pods: each a stable host name, apart (spread) or in one topology domain as asked."""
    name, lr = job.metadata.name, job.spec.learner
    n = names(name)
    pod_spec["subdomain"] = n["learner_service"]  # hostname <job>-learner-<index>, resolvable in the Service
    mine = {"matchLabels": selector(name, "learner")}
    if lr.spread:
        pod_spec.setdefault("affinity", {})["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": mine, "topologyKey": HOSTNAME_TOPOLOGY}
            ]
        }
    if job.spec.scheduling.learner_topology_key:
        # Every learner pod in the domain of the first one placed (a pod whose required term matches no pod yet
        # may go anywhere when it matches its own term: the first one picks the domain).
        pod_spec.setdefault("affinity", {})["podAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": mine, "topologyKey": job.spec.scheduling.learner_topology_key}
            ]
        }


def _learner_failure_rules(pods: int) -> list[dict[str, Any]]:
    """The learner Job's podFailurePolicy. One pod: a disruption is not counted (the retry resumes from the checkpoint
    saved on SIGTERM) and a refused configuration fails at once. Several pods are one torchrun world: a pod lost for
    any reason (a disruption, an exit that is not 0 in any container) leaves its peers blocked in a collective, so the
    Job fails at once and its condition names the pod, instead of restarting that pod alone into a world that is
    gone."""
    if pods > 1:
        return [
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
        ]
    return [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "learner", "operator": "In", "values": [CONFIG_EXIT_CODE]},
        },
    ]


def torchrun_shutdown_seconds(grace_s: int) -> int:
    """How long torchrun's agent waits for its ranks after SIGTERM: the pod's grace period but a margin, so the
    ranks' step and checkpoint get nearly all of it and the kubelet's SIGKILL never comes first."""
    return max(1, grace_s - SHUTDOWN_MARGIN_S)


def learner_pod_host(job: RolloutMatchingJob, namespace: str, index: int) -> str:
    """The stable DNS name of learner pod `index` of a learner.nodes > 1 job: the Indexed Job names its pods' hosts
    <job>-learner-<index>, and the headless Service makes them resolvable in the namespace."""
    n = names(job.metadata.name)
    return f"{n['job']}-{index}.{n['learner_service']}.{namespace}.svc"
