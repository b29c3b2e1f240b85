"""kopf handlers: `kopf run -m rmsft_operator.handlers` (or `rmsft operator`).

All triggers funnel into `reconcile.reconcile`. Handler-level retries come from kopf
(TemporaryError with a configurable backoff); single API calls are retried inside `Kube`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf
from prometheus_client import start_http_server

from rmsft.jobspec import API_GROUP, API_VERSION, KIND, PLURAL, JobSpecError, parse_job
from rmsft_operator import crd_check, metrics, reconcile, render
from rmsft_operator.config import OperatorConfig
from rmsft_operator.crd import build_crd
from rmsft_operator.kube import ApiError, Kube, load_client_config
from rmsft_operator.serial import PerKeyRunner

CFG = OperatorConfig.from_env()
log = logging.getLogger("rmsft_operator")
_state: dict[str, Any] = {"kube": None, "metrics_started": False}
_phases: dict[tuple[str, str], str] = {}
_serial = PerKeyRunner()
CHILD_FILTER = {"app.kubernetes.io/managed-by": render.MANAGED_BY}


def _kube() -> Kube:
    if _state["kube"] is None:
        load_client_config()
        _state["kube"] = Kube(CFG)
    return _state["kube"]


def _record_phase(namespace: str, name: str, phase: str | None) -> None:
    if phase is None:
        _phases.pop((namespace, name), None)
    else:
        _phases[(namespace, name)] = phase
    counts: dict[str, int] = {}
    for p in _phases.values():
        counts[p] = counts.get(p, 0) + 1
    for p in ("Pending", "Starting", "Running", "Complete", "Failed", "Invalid"):
        metrics.JOBS.labels(phase=p).set(counts.get(p, 0))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # kopf's own readers (in-cluster token, then $KUBECONFIG at call time). Its default login via
    # the kubernetes client would use the $KUBECONFIG seen when that library was first imported.
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler state in annotations under our own prefix: nothing lands in .status (which the
    # structural schema would prune) and nothing is named after kopf.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    settings.scanning.disabled = not CFG.scanning
    settings.posting.level = logging.INFO
    settings.persistence.consistency_timeout = CFG.consistency_seconds
    settings.watching.server_timeout = CFG.watch_timeout_seconds
    settings.networking.error_backoffs = [
        CFG.retry_backoff_seconds / 4,
        CFG.retry_backoff_seconds / 2,
        CFG.retry_backoff_seconds,
    ]
    if not CFG.image:
        log.warning(
            "RMSFT_OPERATOR_IMAGE is not set (the chart sets it): the cleanup Job of a deleted shm job will "
            "run that job's own image (as UID %d, no capabilities, on the job's own folder only)",
            render.UID,
        )
    if CFG.metrics_port and not _state["metrics_started"]:
        start_http_server(CFG.metrics_port)
        _state["metrics_started"] = True
    # Helm never upgrades crds/: an older CRD refuses or prunes what this operator writes. Said once, here.
    crd_check.check(_kube(), CFG.namespace, build_crd())


def _run_once(body: dict[str, Any], trigger: str) -> reconcile.Outcome:
    meta = body.get("metadata") or {}
    t0 = time.perf_counter()
    try:
        outcome = reconcile.reconcile(_kube(), body, progress_timeout=CFG.progress_timeout_seconds)
    except ApiError as exc:
        metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
        raise kopf.TemporaryError(str(exc), delay=CFG.retry_backoff_seconds) from None
    finally:
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - t0)
    metrics.RECONCILES.labels(trigger=trigger, result="ok").inc()
    namespace = meta.get("namespace", "")
    before = _phases.get((namespace, meta["name"]))
    if outcome.phase != before:  # the operator's log tells each job's story (docs/operator.md, "Logs")
        log.info(
            "%s/%s: phase %s -> %s%s",
            namespace,
            meta["name"],
            before or "-",
            outcome.phase,
            f": {outcome.status['message']}" if outcome.status.get("message") else "",
        )
    _record_phase(namespace, meta["name"], outcome.phase)
    # kopf's posting reads any mapping with apiVersion/kind/metadata (bodies.build_object_reference); its
    # annotations name only its own Body class, which this plain copy of one is not.
    for kind, reason, message in outcome.events:
        kopf.event(body, type=kind, reason=reason, message=message)  # type: ignore[arg-type]
    if outcome.created:
        kopf.info(body, reason="Created", message="created " + ", ".join(outcome.created))  # type: ignore[arg-type]
    return outcome


def _run(body: dict[str, Any], trigger: str, wait: bool = True) -> reconcile.Outcome | None:
    """One pass (plus one more per event that arrived meanwhile); later passes re-read the job."""
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace") or "default", meta["name"]

    def one_pass(index: int) -> reconcile.Outcome | None:
        current = body if index == 0 else _kube().get_job(namespace, name)
        if current is None or (current.get("metadata") or {}).get("deletionTimestamp"):
            return None
        return _run_once(current, trigger if index == 0 else f"{trigger}+")

    return _serial.run((namespace, name), one_pass, wait=wait)


@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec")
def on_job(body: kopf.Body, reason: str, **_: Any) -> None:
    _run(dict(body), trigger=str(reason))


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=CFG.resync_seconds, initial_delay=CFG.resync_seconds)
def resync(body: kopf.Body, **_: Any) -> None:
    _run(dict(body), trigger="resync", wait=False)


@kopf.on.delete(API_GROUP, API_VERSION, PLURAL)
def forget(body: kopf.Body, name: str, namespace: str | None, **_: Any) -> None:
    """Children carry owner references: Kubernetes' garbage collector deletes them. What it cannot
    delete is what an shm job left in its directory in the node's /dev/shm (a hostPath): a short cleanup
    Job on that node empties it (render.render_shm_cleanup). Not optional: kopf's finalizer keeps the job (and
    its pods, which say which node) until this ran."""
    assert namespace is not None, "kopf names the namespace of a namespaced resource (RolloutMatchingJob)"
    try:
        job = parse_job(
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "metadata": {"name": name, "namespace": namespace},
                "spec": dict(body.get("spec") or {}),
            }
        )
    except JobSpecError:  # an invalid spec never got children, nor a directory
        job = None
    if job is not None and job.spec.sync.cluster_transport == "shm":
        nodes = {p["spec"].get("nodeName") for p in _kube().list_pods(namespace, {render.JOB_LABEL: name})} - {None}
        for node in sorted(nodes):  # one node: the job's pods are co-located (required affinity)
            cleanup = render.render_shm_cleanup(job, namespace, node, CFG.image, CFG.image_pull_policy)
            _kube().ensure(cleanup)
            log.info(
                "%s/%s deleted: emptying %s on node %s (Job %s)",
                namespace,
                name,
                render.shared_weights_host_path(namespace, name),
                node,
                cleanup["metadata"]["name"],
            )
    _record_phase(namespace, name, None)


def _on_child(labels: dict[str, str], namespace: str, trigger: str) -> None:
    job_name = labels.get(render.JOB_LABEL)
    if not job_name:
        return
    try:
        parent = _kube().get_job(namespace, job_name)
        if parent is None or (parent.get("metadata") or {}).get("deletionTimestamp"):
            return
        _run(parent, trigger=trigger, wait=False)
    except (ApiError, kopf.TemporaryError) as exc:
        # Events are not retried by kopf; the periodic resync picks the job up again.
        log.warning("reconcile of %s/%s after a %s event failed: %s", namespace, job_name, trigger, exc)


@kopf.on.event("apps", "v1", "statefulsets", labels=CHILD_FILTER)
def on_statefulset(labels: kopf.Labels, namespace: str | None, type: str | None, **_: Any) -> None:
    assert namespace is not None, "kopf names the namespace of a namespaced resource (StatefulSet)"
    if type in ("ADDED", "MODIFIED", None):
        _on_child(dict(labels), namespace, "statefulset")


@kopf.on.event("batch", "v1", "jobs", labels=CHILD_FILTER)
def on_learner_job(labels: kopf.Labels, namespace: str | None, type: str | None, **_: Any) -> None:
    assert namespace is not None, "kopf names the namespace of a namespaced resource (Job)"
    if type in ("ADDED", "MODIFIED", None):
        _on_child(dict(labels), namespace, "job")
