"""The real operator process on a real control plane, under the chart's ServiceAccount.

`helm install` puts the chart in; the operator then runs here as a subprocess with exactly the
args and env of the chart's Deployment (only its ports and timings shortened) and a TokenRequest
token of the chart's ServiceAccount, so every call it makes goes through the API server's RBAC.
The test is the kubelet: a fake GPU Node, pod status patched Running/Ready/Succeeded/Failed. The
StatefulSet, Job and garbage-collection controllers and the scheduler are the real ones.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import ControlPlane, free_port
from rmsft_operator import render
from rmsft_operator.kube import RESOURCES

ROOT = Path(__file__).resolve().parents[2]
RELEASE, OP_NS, JOBS_NS = "rmsft-lc", "rmsft-lc", "team-a"
PSA_NAMESPACES = ("restricted-team", "baseline-team")
RMJ = "/apis/rmsft.io/v1alpha1"
GPU_LABEL = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
KINDS = RESOURCES  # kind -> (API prefix, plural), as the operator addresses them


class Operator:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, metrics_port: int) -> None:
        self.proc, self.log, self.metrics_port = proc, log, metrics_port

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def resync_passes(self) -> float:
        """Resync passes the operator finished (its rmsft_operator_reconciles_total counter), over every job."""
        return sum(
            v
            for k, v in self.metrics().items()
            if k.startswith("rmsft_operator_reconciles_total{") and 'trigger="resync' in k
        )

    def wait_passes(self, cp: ControlPlane, per_job: int) -> None:
        """Wait until every job the API server holds has had `per_job` more resync passes (counted over all of
        them: the counter has no job label), instead of sleeping for what the resync period should allow."""
        jobs = len(cp.ok("GET", f"{RMJ}/rolloutmatchingjobs")["items"])
        start = self.resync_passes()
        cp.wait_for(
            lambda: self.resync_passes() >= start + per_job * max(jobs, 1),
            60,
            f"{per_job} more resync passes of {jobs} jobs",
        )


def _helm(cp: ControlPlane, *args: str) -> str:
    exe = str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists() else "helm"
    env = {
        **os.environ,
        "KUBECONFIG": str(cp.admin_kubeconfig),
        "HELM_CACHE_HOME": str(cp.dir / "helm-lc/cache"),
        "HELM_CONFIG_HOME": str(cp.dir / "helm-lc/config"),
        "HELM_DATA_HOME": str(cp.dir / "helm-lc/data"),
    }
    proc = subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _manifest(name: str, path: str = "configs/job.yaml", **edits: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / path).read_text())  # by default the reference 6 + 2 GPU job
    doc["metadata"] = {"name": name, "namespace": JOBS_NS}
    for dotted, value in edits.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return doc


def _static_claim(cp: ControlPlane, name: str) -> None:
    """A PVC bound (by the real PV controller) to a hostPath PV: the reference job mounts two."""
    pv = f"{JOBS_NS}-{name}"
    cp.ok(
        "POST",
        "/api/v1/persistentvolumes",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "10Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": f"/srv/{pv}"},
                "claimRef": {"namespace": JOBS_NS, "name": name},
            },
        },
    )
    cp.ok(
        "POST",
        f"/api/v1/namespaces/{JOBS_NS}/persistentvolumeclaims",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "10Gi"}},
            },
        },
    )


@pytest.fixture(scope="module")
def operator(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    cp = control_plane
    # The default chart with the jobs' namespaces listed (made before the install, which makes a Role in each): Roles
    # in the release namespace and in those, nothing wider (issue 62).
    cp.create_namespace(JOBS_NS)
    for ns in PSA_NAMESPACES:  # the Pod Security tests' namespaces, at the level they test
        cp.create_namespace(ns, labels={"pod-security.kubernetes.io/enforce": "baseline"})
    out = _helm(
        cp,
        "install",
        RELEASE,
        str(ROOT / "charts/rmsft"),
        "--namespace",
        OP_NS,
        "--create-namespace",
        "--set",
        f"rbac.watchNamespaces={{{','.join([JOBS_NS, *PSA_NAMESPACES])}}}",
    )
    assert "STATUS: deployed" in out
    cp.wait_for(lambda: cp.crd_established("rolloutmatchingjobs.rmsft.io"), 30, "CRD Established")
    for i in range(3):
        cp.create_node(f"gpu-{i}", gpus=8, labels=GPU_LABEL)
    for claim in ("models", "checkpoints"):
        _static_claim(cp, claim)
    # The GC must know the new kind before deletion is tested (and before the operator runs, since
    # the probe creates and deletes jobs).
    probe_spec = {"spec": _manifest("probe", **{"rollout.replicas": 0})["spec"]}
    cp.create_namespace("gc-probe")
    took = cp.wait_for_gc_ready(
        "rmsft.io/v1alpha1", "rolloutmatchingjobs", "RolloutMatchingJob", probe_spec, namespace="gc-probe"
    )
    print(f"\n[envtest] garbage collector knows RolloutMatchingJob after {took:.1f}s")

    # Run what the chart's Deployment runs, as its ServiceAccount.
    dep = cp.ok("GET", f"/apis/apps/v1/namespaces/{OP_NS}/deployments/{RELEASE}")
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    token = cp.token_for(OP_NS, pod["serviceAccountName"])
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = cp.write_kubeconfig(work / "kubeconfig", token=token, namespace=OP_NS)
    metrics_port = free_port()
    args = [re.sub(r":\d+/healthz$", f":{free_port()}/healthz", a) for a in container["args"]]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")},
        **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e},
        "KUBECONFIG": str(kubeconfig),
        # shortened timings; the pod IPs are fake, so no progress scraping
        "RMSFT_OPERATOR_RESYNC_SECONDS": "2",
        "RMSFT_OPERATOR_RETRY_BACKOFF_SECONDS": "1",
        "RMSFT_OPERATOR_METRICS_PORT": str(metrics_port),
        "RMSFT_OPERATOR_PROGRESS_TIMEOUT_SECONDS": "0",
    }
    log = work / "operator.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rmsft_cli", *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    op = Operator(proc, log, metrics_port)
    try:
        cp.wait_for(
            lambda: "Initial authentication has finished" in op.output() or proc.poll() is not None,
            60,
            "the operator logged in",
        )
        assert proc.poll() is None, op.output()[-4000:]
        yield op
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"[envtest] operator log: {log}")
    assert proc.returncode in (0, -15), op.output()[-4000:]


# ------------------------------------------------------------------------------------ helpers


def _cr(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.ok("GET", f"{RMJ}/namespaces/{JOBS_NS}/rolloutmatchingjobs/{name}")


def _cond(cr: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def _wait_cr(cp: ControlPlane, op: Operator, name: str, pred: Any, what: str, timeout: float = 60) -> dict[str, Any]:
    try:
        return cp.wait_for(lambda: (c := _cr(cp, name)) and pred(c) and c, timeout, f"{name}: {what}")
    except TimeoutError as exc:
        raise AssertionError(
            f"{exc}\nstatus: {_cr(cp, name).get('status')}\noperator:\n{op.output()[-3000:]}"
        ) from None


def _child(cp: ControlPlane, kind: str, name: str) -> dict[str, Any] | None:
    prefix, plural = KINDS[kind]
    return cp.get(f"{prefix}/namespaces/{JOBS_NS}/{plural}/{name}")


def _apply(cp: ControlPlane, doc: dict[str, Any]) -> None:
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))


def _pods(cp: ControlPlane, job: str, role: str) -> list[dict[str, Any]]:
    return cp.pods(JOBS_NS, f"rmsft.io/job={job},app.kubernetes.io/component={role}")


def _bound(pods: list[dict[str, Any]], n: int) -> list[dict[str, Any]] | None:
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return live if len(live) == n and all(p["spec"].get("nodeName") for p in live) else None


def _start_pool(cp: ControlPlane, op: Operator, name: str, n: int) -> None:
    pods = cp.wait_for(lambda: _bound(_pods(cp, name, "rollout"), n), 60, f"{n} rollout pods scheduled")
    for p in pods:
        cp.set_pod_phase(JOBS_NS, p["metadata"]["name"], "Running")
    _wait_cr(cp, op, name, lambda c: (c.get("status") or {}).get("readyRolloutReplicas") == n, f"{n} ready")


def _learner_pod(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.wait_for(lambda: (_bound(_pods(cp, name, "learner"), 1) or [None])[0], 60, "learner pod scheduled")


def _finish(cp: ControlPlane, name: str) -> None:
    """Deletes the job and lets pods that were deleted with a grace period go (no kubelet)."""
    cp.kubectl("delete", "rolloutmatchingjob", name, "-n", JOBS_NS, "--wait=false")
    cp.reap_terminating_pods(JOBS_NS)


# -------------------------------------------------------------------------------------- tests


def test_children_owner_references_and_suspended_learner(control_plane: ControlPlane, operator: Operator) -> None:
    cp = control_plane
    _apply(cp, _manifest("alpha"))
    uid = _cr(cp, "alpha")["metadata"]["uid"]
    kids = cp.wait_for(
        lambda: (
            (
                k := {
                    (kind, s): _child(cp, kind, f"alpha-{s}")
                    for kind, s in (
                        ("Secret", "token"),
                        ("ConfigMap", "config"),
                        ("Service", "rollout"),
                        ("NetworkPolicy", "rollout"),
                        ("PodDisruptionBudget", "rollout"),
                        ("StatefulSet", "rollout"),
                        ("PodDisruptionBudget", "learner"),
                        ("Job", "learner"),
                    )
                }
            )
            and all(k.values())
            and k
        ),
        60,
        "all eight children",
    )
    # The real API server admitted both disruption budgets as rendered (policy/v1, unhealthyPodEvictionPolicy).
    assert kids[("PodDisruptionBudget", "rollout")]["spec"]["maxUnavailable"] == 1
    assert kids[("PodDisruptionBudget", "learner")]["spec"]["minAvailable"] == 1
    kids = {kind: obj for (kind, _), obj in kids.items() if kind != "PodDisruptionBudget"} | {
        f"PodDisruptionBudget/{s}": obj for (kind, s), obj in kids.items() if kind == "PodDisruptionBudget"
    }
    for kind, obj in kids.items():
        refs = obj["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == [
            ("RolloutMatchingJob", "alpha", uid, True)
        ], kind
    assert kids["Job"]["spec"]["suspend"] is True
    # The real StatefulSet controller made 6 pods and the scheduler put them on the fake GPU nodes.
    pods = cp.wait_for(lambda: _bound(_pods(cp, "alpha", "rollout"), 6), 60, "6 rollout pods scheduled")
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1" for p in pods)
    assert all(p["spec"]["automountServiceAccountToken"] is False for p in pods)
    # The reference job syncs through shm: Pod Security admission (privileged here, the default)
    # let the hostPath pods through, and the real scheduler put all six on one of the three nodes.
    assert len({p["spec"]["nodeName"] for p in pods}) == 1, [p["spec"]["nodeName"] for p in pods]
    shared = next(v for v in pods[0]["spec"]["volumes"] if v["name"] == render.SHARED_WEIGHTS_VOLUME)
    assert shared["hostPath"]["path"] == f"/dev/shm/rmsft/{JOBS_NS}.alpha"
    assert not _pods(cp, "alpha", "learner")  # suspended: no learner pod yet
    cr = _wait_cr(cp, operator, "alpha", lambda c: (c.get("status") or {}).get("phase") == "Pending", "Pending")
    assert _cond(cr, "LearnerRunning")["reason"] == "Suspended"
    events = cp.ok("GET", f"/api/v1/namespaces/{JOBS_NS}/events")["items"]
    assert not any(
        e["reason"] == "CheckpointsEphemeral" and e["involvedObject"]["name"] == "alpha" for e in events
    )  # the reference job has a checkpoint claim


def test_pool_ready_resumes_learner_then_complete_scales_pool_to_zero(
    control_plane: ControlPlane, operator: Operator
) -> None:
    cp = control_plane
    _start_pool(cp, operator, "alpha", 6)
    # The Job controller creates the learner pod only now; until it runs, LearnerRunning is False.
    learner = _learner_pod(cp, "alpha")
    cr = _wait_cr(
        cp,
        operator,
        "alpha",
        lambda c: _cond(c, "LearnerRunning").get("reason") == "PodPending",
        "learner resumed, pod pending",
    )
    assert cr["status"]["phase"] == "Starting" and _cond(cr, "LearnerRunning")["status"] == "False"
    assert _child(cp, "Job", "alpha-learner")["spec"]["suspend"] is False
    args = learner["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--servers-file", "/etc/rmsft/servers"]
    # shm: the learner followed the pool to its node (the last 2 of its 8 GPUs).
    pool_nodes = {p["spec"]["nodeName"] for p in _pods(cp, "alpha", "rollout")}
    assert pool_nodes == {learner["spec"]["nodeName"]}, (pool_nodes, learner["spec"]["nodeName"])

    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Running")
    cr = _wait_cr(cp, operator, "alpha", lambda c: c["status"]["phase"] == "Running", "Running")
    assert _cond(cr, "LearnerRunning")["status"] == "True" and _cond(cr, "RolloutReady")["status"] == "True"

    # The learner's last word (its termination message) carries its final step: /metrics is gone by now, and
    # this operator does not even read it (RMSFT_OPERATOR_PROGRESS_TIMEOUT_SECONDS=0).
    started = cp.ok("GET", f"/api/v1/namespaces/{JOBS_NS}/pods/{learner['metadata']['name']}")["status"]["startTime"]
    cp.set_pod_phase(
        JOBS_NS,
        learner["metadata"]["name"],
        "Succeeded",
        container_state={
            "terminated": {
                "exitCode": 0,
                "reason": "Completed",
                "message": "rmsft train: finished at step 24, weight version 24\n",
                "startedAt": started,
                "finishedAt": started,
            }
        },
    )
    cr = _wait_cr(cp, operator, "alpha", lambda c: c["status"]["phase"] == "Complete", "Complete")
    assert _cond(cr, "Complete")["status"] == "True"
    assert (cr["status"].get("step"), cr["status"].get("weightVersion")) == (24, 24), cr["status"]
    row = cp.kubectl("get", "rmj", "alpha", "-n", JOBS_NS).stdout.splitlines()
    assert dict(zip(row[0].split(), row[1].split(), strict=True))["STEP"] == "24", row
    cp.wait_for(lambda: _child(cp, "StatefulSet", "alpha-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    cp.wait_for(
        lambda: cp.reap_terminating_pods(JOBS_NS) is not None and not _pods(cp, "alpha", "rollout"),
        60,
        "rollout pods gone",
    )


def test_learner_failure_marks_failed(control_plane: ControlPlane, operator: Operator) -> None:
    cp = control_plane
    _apply(cp, _manifest("bravo", **{"learner.backoffLimit": 0}))
    _start_pool(cp, operator, "bravo", 6)
    learner = _learner_pod(cp, "bravo")
    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Failed", exit_code=2)
    cr = _wait_cr(cp, operator, "bravo", lambda c: c["status"]["phase"] == "Failed", "Failed")
    assert _cond(cr, "Failed")["status"] == "True" and "learner failed" in cr["status"]["message"]
    cp.wait_for(lambda: _child(cp, "StatefulSet", "bravo-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    events = cp.ok("GET", f"/api/v1/namespaces/{JOBS_NS}/events")["items"]
    assert any(
        e["reason"] == "PhaseFailed" and e["type"] == "Warning" and e["involvedObject"]["name"] == "bravo"
        for e in events
    )
    _finish(cp, "bravo")


def test_every_operator_dashboard_panel_returns_data_from_the_operator(
    control_plane: ControlPlane, operator: Operator, tmp_path: Path
) -> None:
    """charts/rmsft/dashboards/operator.json against a real Prometheus (tests/promql.py) scraping this operator's
    /metrics every second while it reconciles a new job: every panel query (a range query over the window, as a
    panel runs it) must give a series with a number; tests/test_dashboards_prometheus.py does the same for the
    learner's and the servers' dashboards."""
    from promql import Prometheus, dashboard, empty_panels, series_with_data

    cp = control_plane
    prom = Prometheus(tmp_path)
    try:
        prom.set_targets([(f"127.0.0.1:{operator.metrics_port}", {"namespace": OP_NS, "pod": f"{RELEASE}-0"})])
        prom.wait(lambda: list(prom.targets_up().values()) == ["up"], 30, "the operator's /metrics up")
        start = time.time()
        _apply(cp, _manifest("dashop", **{"rollout.replicas": 0}))  # children created and reconciles, in the window
        cp.wait_for(lambda: _child(cp, "StatefulSet", "dashop-rollout"), 60, "dashop's StatefulSet")
        operator.wait_passes(cp, 2)
        passed = time.time()  # every rate() needs two samples after the job's first reconciles: three scrapes
        prom.wait(lambda: prom.scrapes_since(passed) >= 3, 30, "three scrapes of the operator after its reconciles")
        end = time.time()
        chosen, empty = empty_panels(prom, dashboard("operator"), start, end)
        assert len(chosen) >= 7, chosen
        assert not empty, "operator panels that draw nothing while it reconciles a job:\n" + "\n".join(empty)
        # The API-errors panel draws 0 (its `or vector(0)`) in a run with no error, not "no data", and no code.
        errors = next(p.expr for p in chosen if "rmsft_operator_errors_total" in p.expr)
        series = series_with_data(prom, errors, start, end)
        assert [s["metric"] for s in series] == [{"code": "none"}], series
        assert {float(v) for s in series for _, v in s["values"]} == {0.0}, series
    finally:
        prom.stop()
        _finish(cp, "dashop")


def test_scale_down_before_the_learner_starts_hands_it_only_live_servers(
    control_plane: ControlPlane, operator: Operator
) -> None:
    cp = control_plane
    _apply(cp, _manifest("charlie", **{"rollout.replicas": 3}))
    cp.wait_for(lambda: _bound(_pods(cp, "charlie", "rollout"), 3), 60, "3 rollout pods")
    doc = _manifest("charlie", **{"rollout.replicas": 2})
    _apply(cp, doc)
    cp.wait_for(lambda: _child(cp, "StatefulSet", "charlie-rollout")["spec"]["replicas"] == 2, 30, "scaled to 2")
    cp.reap_terminating_pods(JOBS_NS)
    _start_pool(cp, operator, "charlie", 2)
    learner = _learner_pod(cp, "charlie")
    servers = _child(cp, "ConfigMap", "charlie-config")["data"]["servers"].splitlines()
    assert servers == [f"charlie-rollout-{i}.charlie-rollout.{JOBS_NS}.svc:50051" for i in range(2)]
    # ...and the learner reads exactly that file: mounted from the ConfigMap, named in its args,
    # with no frozen copy of the list anywhere in its pod.
    c = learner["spec"]["containers"][0]
    assert any(m["mountPath"] == "/etc/rmsft" for m in c["volumeMounts"])
    assert c["args"][-1] == "/etc/rmsft/servers"
    assert "charlie-rollout-2" not in yaml.safe_dump(learner["spec"])
    _finish(cp, "charlie")


def test_immutable_edit_is_refused_by_the_api_server(control_plane: ControlPlane, operator: Operator) -> None:
    cp = control_plane
    _apply(cp, _manifest("delta", **{"rollout.replicas": 1}))
    doc = _manifest("delta", **{"rollout.replicas": 1, "training.lr": 0.5})
    proc = cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0 and "spec.training" in proc.stderr and "immutable" in proc.stderr, proc.stderr
    doc = _manifest("delta", **{"rollout.replicas": 1, "rollout.kvCacheBytes": 1 << 30})
    proc = cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0 and "spec.rollout.kvCacheBytes" in proc.stderr, proc.stderr
    _finish(cp, "delta")


def test_pods_refused_by_pod_security_are_named_in_a_condition(control_plane: ControlPlane, operator: Operator) -> None:
    cp = control_plane
    ns = "restricted-team"
    cp.create_namespace(ns, labels={"pod-security.kubernetes.io/enforce": "baseline"})
    # grpc: this is about pods refused at creation (for the model's hostPath), which shm would not reach.
    doc = _manifest(
        "echo",
        **{
            "model.volume": {"hostPath": "/srv/models", "mountPath": "/models"},
            "learner.checkpointClaim": None,
            "sync.transport": "grpc",
        },
    )
    doc["spec"]["learner"].pop("checkpointClaim")
    doc["metadata"]["namespace"] = ns
    _apply(cp, doc)
    cr = _wait_cr_ns(
        cp,
        operator,
        ns,
        "echo",
        lambda c: _cond(c, "RolloutReady").get("reason") == "FailedCreate",
        "FailedCreate condition",
    )
    msg = _cond(cr, "RolloutReady")["message"]
    assert "PodSecurity" in msg and "hostPath" in msg, msg
    assert "PodSecurity" in cr["status"]["message"]
    events = cp.ok("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    assert any(e["reason"] == "CheckpointsEphemeral" and e["involvedObject"]["name"] == "echo" for e in events)
    cp.kubectl("delete", "rolloutmatchingjob", "echo", "-n", ns, "--wait=false")


def test_shm_in_a_namespace_that_forbids_hostpath_gets_a_condition_not_children(
    control_plane: ControlPlane, operator: Operator
) -> None:
    cp = control_plane
    ns = "baseline-team"
    cp.create_namespace(ns, labels={"pod-security.kubernetes.io/enforce": "baseline"})
    doc = _manifest("hotel")  # the reference job: sync.transport shm
    for section, key in (("model", "volume"), ("learner", "checkpointClaim")):
        doc["spec"][section].pop(key)  # no claims in this namespace
    doc["metadata"]["namespace"] = ns
    _apply(cp, doc)
    cr = _wait_cr_ns(
        cp,
        operator,
        ns,
        "hotel",
        lambda c: _cond(c, "RolloutReady").get("reason") == "SharedMemoryForbidden",
        "a SharedMemoryForbidden condition",
    )
    msg = _cond(cr, "RolloutReady")["message"]
    assert "spec.sync.transport" in msg and "pod-security.kubernetes.io/enforce=baseline" in msg, msg
    assert cr["status"]["phase"] == "Pending" and cr["status"]["message"] == msg
    assert _cond(cr, "LearnerRunning")["reason"] == "SharedMemoryForbidden"
    cp.wait_for(
        lambda: any(
            e["reason"] == "SharedMemoryForbidden" and e["type"] == "Warning" and e["involvedObject"]["name"] == "hotel"
            for e in cp.ok("GET", f"/api/v1/namespaces/{ns}/events")["items"]
        ),
        30,
        "a SharedMemoryForbidden Warning event",
    )
    for kind, child in (("StatefulSet", "hotel-rollout"), ("Job", "hotel-learner"), ("ConfigMap", "hotel-config")):
        prefix, plural = KINDS[kind]
        assert cp.get(f"{prefix}/namespaces/{ns}/{plural}/{child}") is None, f"{kind} created"
    # The level is read on every pass: relabelled, the namespace admits the pods, all on one node.
    cp.ok(
        "PATCH",
        f"/api/v1/namespaces/{ns}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
    )
    pods = cp.wait_for(
        lambda: _bound(cp.pods(ns, "rmsft.io/job=hotel,app.kubernetes.io/component=rollout"), 6),
        60,
        "6 rollout pods scheduled after the relabel",
    )
    assert len({p["spec"]["nodeName"] for p in pods}) == 1
    _wait_cr_ns(
        cp,
        operator,
        ns,
        "hotel",
        lambda c: _cond(c, "RolloutReady").get("reason") == "PoolNotReady",
        "the normal conditions back",
    )
    cp.kubectl("delete", "rolloutmatchingjob", "hotel", "-n", ns, "--wait=false")
    # 120 s: deleting an shm job first runs the operator's clean-up of the node's /dev/shm directory
    # (kopf's finalizer), then the garbage collector; 60 s was too short on 2 loaded cores in CI.
    cp.wait_for(
        lambda: (
            cp.reap_terminating_pods(ns) is not None
            and not cp.pods(ns, "rmsft.io/job=hotel,app.kubernetes.io/component=rollout")
        ),
        120,
        "the pool's pods gone (their GPUs free for the next tests)",
    )


def _wait_cr_ns(
    cp: ControlPlane, op: Operator, ns: str, name: str, pred: Any, what: str, timeout: float = 60
) -> dict[str, Any]:
    path = f"{RMJ}/namespaces/{ns}/rolloutmatchingjobs/{name}"
    try:
        return cp.wait_for(lambda: (c := cp.ok("GET", path)) and pred(c) and c, timeout, f"{name}: {what}")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nstatus: {cp.ok('GET', path).get('status')}\n{op.output()[-3000:]}") from None


def test_a_server_that_exits_at_start_is_named_in_a_condition(control_plane: ControlPlane, operator: Operator) -> None:
    cp = control_plane
    _apply(cp, _manifest("foxtrot", **{"rollout.replicas": 1}))
    pod = cp.wait_for(lambda: (_bound(_pods(cp, "foxtrot", "rollout"), 1) or [None])[0], 60, "rollout pod")
    said = (
        "staging dir /dev/shm has 8.0 GiB; a FULL weight sync of this model needs about 16.4 GiB: "
        "raise spec.rollout.shmSize to at least 17Gi"
    )
    cp.set_pod_phase(
        JOBS_NS,
        pod["metadata"]["name"],
        "Running",
        ready=False,
        container_state={
            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}
        },
    )
    # lastState is where the kubelet keeps the exit message of the previous run
    live = cp.ok("GET", f"/api/v1/namespaces/{JOBS_NS}/pods/{pod['metadata']['name']}")
    statuses = copy.deepcopy(live["status"]["containerStatuses"])
    statuses[0]["lastState"] = {
        "terminated": {
            "exitCode": 2,
            "reason": "Error",
            "message": said,
            "startedAt": live["status"]["startTime"],
            "finishedAt": live["status"]["startTime"],
        }
    }
    cp.ok(
        "PATCH",
        f"/api/v1/namespaces/{JOBS_NS}/pods/{pod['metadata']['name']}/status",
        {"status": {"containerStatuses": statuses}},
    )
    # The operator may reconcile between the two pod status writes (CI did): wait for the condition that
    # carries the previous run's exit message, not just for the CrashLoopBackOff reason.
    cr = _wait_cr(
        cp,
        operator,
        "foxtrot",
        lambda c: "spec.rollout.shmSize" in (_cond(c, "RolloutReady").get("message") or ""),
        "a CrashLoopBackOff condition naming the container's exit message",
    )
    assert _cond(cr, "RolloutReady")["reason"] == "CrashLoopBackOff"
    _finish(cp, "foxtrot")


def _events_of(cp: ControlPlane, name: str) -> list[dict[str, Any]]:
    return [
        e for e in cp.ok("GET", f"/api/v1/namespaces/{JOBS_NS}/events")["items"] if e["involvedObject"]["name"] == name
    ]


def test_a_server_with_an_invalid_configuration_fails_the_job_and_frees_the_pool(
    control_plane: ControlPlane, operator: Operator
) -> None:
    cp = control_plane
    _apply(cp, _manifest("india", **{"rollout.replicas": 1, "model.path": "/models/missing"}))
    pod = cp.wait_for(lambda: (_bound(_pods(cp, "india", "rollout"), 1) or [None])[0], 60, "rollout pod")
    name = pod["metadata"]["name"]
    cp.set_pod_phase(
        JOBS_NS,
        name,
        "Running",
        ready=False,
        container_state={
            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}
        },
    )
    # What the kubelet keeps of the previous run: with FallbackToLogsOnError, the tail of its log.
    live = cp.ok("GET", f"/api/v1/namespaces/{JOBS_NS}/pods/{name}")
    statuses = copy.deepcopy(live["status"]["containerStatuses"])
    statuses[0]["restartCount"] = 1
    statuses[0]["lastState"] = {
        "terminated": {
            "exitCode": 1,
            "reason": "Error",
            "startedAt": live["status"]["startTime"],
            "finishedAt": live["status"]["startTime"],
            "message": "INFO rollout_svc: starting\nrmsft serve: invalid configuration:\n"
            "  model folder /models/missing does not exist\n",
        }
    }
    cp.ok("PATCH", f"/api/v1/namespaces/{JOBS_NS}/pods/{name}/status", {"status": {"containerStatuses": statuses}})
    cr = _wait_cr(cp, operator, "india", lambda c: c["status"].get("phase") == "Failed", "Failed")
    assert _cond(cr, "Failed")["reason"] == "RolloutInvalidConfig"
    assert "model folder /models/missing does not exist" in cr["status"]["message"], cr["status"]
    assert "INFO rollout_svc" not in cr["status"]["message"]
    cp.wait_for(lambda: _child(cp, "StatefulSet", "india-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    cp.wait_for(
        lambda: any(
            e["type"] == "Warning" and "model folder /models/missing" in e["message"] for e in _events_of(cp, "india")
        ),
        30,
        "a Warning event with the server's words",
    )
    assert _child(cp, "Job", "india-learner")["spec"]["suspend"] is True
    # Failed is final: the next passes (resync every 2 s) keep the pool at zero.
    operator.wait_passes(cp, 2)
    assert _cr(cp, "india")["status"]["phase"] == "Failed"
    assert _child(cp, "StatefulSet", "india-rollout")["spec"]["replicas"] == 0
    _finish(cp, "india")


def test_a_model_the_preflight_refuses_fails_the_job_before_any_server_starts(
    control_plane: ControlPlane, operator: Operator
) -> None:
    cp = control_plane
    _apply(cp, _manifest("kilo", **{"rollout.replicas": 1}))
    (pod,) = cp.wait_for(lambda: _bound(_pods(cp, "kilo", "rollout"), 1), 60, "rollout pod")
    name = pod["metadata"]["name"]
    live = cp.ok("GET", f"/api/v1/namespaces/{JOBS_NS}/pods/{name}")
    (init,) = live["spec"]["initContainers"]
    assert init["name"] == render.PREFLIGHT_CONTAINER
    said = (
        "rmsft preflight: the model in /models/Qwen3-VL-2B-Instruct (spec.model.path) does not fit "
        "training.format coordexp: its tokenizer has none of the 1000 coordinate tokens. Fix: run "
        "`rmsft prepare-model /models/Qwen3-VL-2B-Instruct DST` and set spec.model.path to DST, or set "
        "spec.training.format: qwen_json"
    )
    # What the kubelet reports of a pod whose init container exited 2: Init:CrashLoopBackOff, the exit kept in
    # lastState, the rollout container never started.
    cp.ok(
        "PATCH",
        f"/api/v1/namespaces/{JOBS_NS}/pods/{name}/status",
        {
            "status": {
                "phase": "Pending",
                "initContainerStatuses": [
                    {
                        "name": init["name"],
                        "image": init["image"],
                        "imageID": "",
                        "ready": False,
                        "restartCount": 1,
                        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 2,
                                "reason": "Error",
                                "message": said,
                                "startedAt": "2026-11-23T10:00:00Z",
                                "finishedAt": "2026-11-23T10:00:01Z",
                            }
                        },
                    }
                ],
                "containerStatuses": [
                    {
                        "name": "rollout",
                        "image": init["image"],
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"waiting": {"reason": "PodInitializing"}},
                    }
                ],
            }
        },
    )
    cr = _wait_cr(cp, operator, "kilo", lambda c: c["status"].get("phase") == "Failed", "Failed")
    assert _cond(cr, "Failed")["reason"] == "ModelPreflightFailed"
    assert f"rollout pod {name}" in cr["status"]["message"] and "rmsft prepare-model" in cr["status"]["message"]
    cp.wait_for(lambda: _child(cp, "StatefulSet", "kilo-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    assert _child(cp, "Job", "kilo-learner")["spec"]["suspend"] is True
    cp.wait_for(
        lambda: any(e["type"] == "Warning" and "rmsft prepare-model" in e["message"] for e in _events_of(cp, "kilo")),
        30,
        "a Warning event with the preflight's words",
    )
    _finish(cp, "kilo")


def test_a_learner_the_scheduler_cannot_place_fails_the_job_after_the_startup_timeout(
    control_plane: ControlPlane, operator: Operator
) -> None:
    cp = control_plane
    _apply(
        cp,
        _manifest(
            "juliet",
            **{
                "rollout.replicas": 1,
                "rollout.startupTimeout": "20s",
                "learner.resources": {"requests": {"cpu": "500"}},
            },
        ),
    )
    _start_pool(cp, operator, "juliet", 1)
    # The real scheduler finds no node with 500 CPUs: PodScheduled False, Unschedulable.
    cp.wait_for(
        lambda: any(
            c.get("reason") == "Unschedulable"
            for p in _pods(cp, "juliet", "learner")
            for c in p.get("status", {}).get("conditions", [])
        ),
        60,
        "learner Unschedulable",
    )
    cr = _wait_cr(cp, operator, "juliet", lambda c: c["status"].get("phase") == "Failed", "Failed", timeout=90)
    assert _cond(cr, "Failed")["reason"] == "LearnerUnschedulable"
    assert "Insufficient cpu" in cr["status"]["message"] and "startupTimeout (20 s)" in cr["status"]["message"]
    cp.wait_for(lambda: _child(cp, "StatefulSet", "juliet-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    assert _child(cp, "Job", "juliet-learner")["spec"]["suspend"] is True  # its pending pod goes with it
    cp.wait_for(lambda: not _pods(cp, "juliet", "learner"), 60, "the learner's pending pod removed")
    _finish(cp, "juliet")


def test_a_grpo_job_runs_through_like_a_rollout_matching_one(control_plane: ControlPlane, operator: Operator) -> None:
    # spec.trainer: grpo (configs/job-grpo-6v2.yaml): the same six children and lifecycle; the learner's
    # `rmsft train` picks the GRPO trainer from the spec, the servers report processed log-probs.
    cp = control_plane
    _apply(cp, _manifest("grpo", "configs/job-grpo-6v2.yaml"))
    kids = cp.wait_for(
        lambda: (
            (
                k := {
                    kind: _child(cp, kind, f"grpo-{s}")
                    for kind, s in (
                        ("Secret", "token"),
                        ("ConfigMap", "config"),
                        ("Service", "rollout"),
                        ("NetworkPolicy", "rollout"),
                        ("StatefulSet", "rollout"),
                        ("Job", "learner"),
                    )
                }
            )
            and all(k.values())
            and k
        ),
        60,
        "all six children",
    )
    assert kids["Job"]["spec"]["suspend"] is True
    assert yaml.safe_load(kids["ConfigMap"]["data"]["serve.yaml"])["logprobs_mode"] == "processed"
    assert yaml.safe_load(kids["ConfigMap"]["data"]["job.yaml"])["spec"]["trainer"] == "grpo"
    _start_pool(cp, operator, "grpo", 6)
    learner = _learner_pod(cp, "grpo")
    c = learner["spec"]["containers"][0]
    assert c["args"][:1] == ["train"] and c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Running")
    _wait_cr(cp, operator, "grpo", lambda c: c["status"]["phase"] == "Running", "Running")
    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Succeeded")
    _wait_cr(cp, operator, "grpo", lambda c: c["status"]["phase"] == "Complete", "Complete")
    cp.wait_for(lambda: _child(cp, "StatefulSet", "grpo-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    _finish(cp, "grpo")


def test_a_colocate_job_runs_with_only_its_learner(control_plane: ControlPlane, operator: Operator) -> None:
    # spec.rollout.mode: colocate: the engine lives in the learner's 4 GPUs; no pool, nothing to wait for.
    cp = control_plane
    doc = _manifest(
        "hotel",
        **{
            "rollout": {"mode": "colocate", "maxModelLen": 8192, "colocate": {"tensorParallelSize": 2}},
            "learner.gpus": 4,
            "sync": {"mode": "full"},
        },
    )
    _apply(cp, doc)
    learner = _learner_pod(cp, "hotel")  # scheduled without any rollout pod: the Job was resumed at once
    c = learner["spec"]["containers"][0]
    assert "--servers-file" not in c["args"] and c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    for kind, child in (
        ("StatefulSet", "hotel-rollout"),
        ("Service", "hotel-rollout"),
        ("NetworkPolicy", "hotel-rollout"),
    ):
        assert _child(cp, kind, child) is None, kind
    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Running")
    cr = _wait_cr(cp, operator, "hotel", lambda c: c["status"]["phase"] == "Running", "Running")
    assert _cond(cr, "RolloutReady")["reason"] == "Colocated"
    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Succeeded")
    _wait_cr(cp, operator, "hotel", lambda c: c["status"]["phase"] == "Complete", "Complete")
    _finish(cp, "hotel")


def test_a_learner_on_two_pods_is_placed_apart_named_and_restarted_as_one(
    control_plane: ControlPlane, operator: Operator
) -> None:
    """Issue 45, learner.nodes 2 (2 GPUs per pod, weights over grpc) on the real API server, Job controller and
    scheduler: the headless Service, an Indexed Job whose 2 pods the scheduler puts on 2 nodes (anti-affinity), each
    named <job>-learner-<index> under the Service with its index in the annotation the node rank is read from; the
    job runs once both run; pod 1 failing (exit 1) fails the Job's attempt at once by its podFailurePolicy, named in
    the status; the operator deletes the failed Job once its pods have stopped and creates attempt 2 while the pool
    runs on; after backoffLimit (2) restarts the job is Failed naming the pod, its pool scaled to 0."""
    cp = control_plane
    _apply(
        cp,
        _manifest(
            "oscar", **{"learner.nodes": 2, "learner.backoffLimit": 2, "sync.transport": "grpc", "rollout.replicas": 2}
        ),
    )
    uid = _cr(cp, "oscar")["metadata"]["uid"]
    svc = cp.wait_for(lambda: _child(cp, "Service", "oscar-learner"), 60, "the learner's Service")
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["ownerReferences"][0]["uid"] == uid
    _start_pool(cp, operator, "oscar", 2)
    pods = cp.wait_for(lambda: _bound(_pods(cp, "oscar", "learner"), 2), 60, "2 learner pods scheduled")
    by_index = {p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]: p for p in pods}
    assert sorted(by_index) == ["0", "1"]
    assert [(by_index[i]["spec"]["hostname"], by_index[i]["spec"]["subdomain"]) for i in ("0", "1")] == [
        ("oscar-learner-0", "oscar-learner"),
        ("oscar-learner-1", "oscar-learner"),
    ]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2  # one learner pod per node
    for p in pods:
        cp.set_pod_phase(JOBS_NS, p["metadata"]["name"], "Running")
    _wait_cr(cp, operator, "oscar", lambda c: c["status"]["phase"] == "Running", "Running")
    # Attempt 1: pod 1 lost. The Job controller fails the Job (FailureTarget) and stops pod 0 (no kubelet here: the
    # test lets it go); once the Job is Failed the operator deletes it and creates attempt 2, whose pods start together.
    old_job = _child(cp, "Job", "oscar-learner")
    lost = by_index["1"]["metadata"]["name"]
    cp.set_pod_phase(JOBS_NS, lost, "Failed", exit_code=1)
    cr = _wait_cr(
        cp, operator, "oscar", lambda c: lost in (c.get("status") or {}).get("message", ""), "attempt 1's failure named"
    )
    assert cr["status"]["phase"] == "Running" and "attempt 1 of 3 failed" in cr["status"]["message"]
    cp.wait_for(
        lambda: (
            cp.reap_terminating_pods(JOBS_NS),
            (j := _child(cp, "Job", "oscar-learner")) and j["metadata"]["uid"] != old_job["metadata"]["uid"] and j,
        )[1],
        90,
        "attempt 2's Job",
    )
    cr = _wait_cr(cp, operator, "oscar", lambda c: c["status"].get("learnerAttempt") == 2, "attempt 2 counted")
    assert _child(cp, "StatefulSet", "oscar-rollout")["spec"]["replicas"] == 2  # the pool ran on
    pods = cp.wait_for(
        lambda: _bound(
            [p for p in _pods(cp, "oscar", "learner") if p["status"].get("phase") not in ("Failed", "Succeeded")], 2
        ),
        60,
        "attempt 2's pods",
    )
    # Attempts 2 and 3 (backoffLimit 2) fail the same way: then the job is Failed, naming the pod, the pool at 0.
    for attempt in (2, 3):
        lost = pods[0]["metadata"]["name"]
        for p in pods:
            cp.set_pod_phase(JOBS_NS, p["metadata"]["name"], "Running")
        cp.set_pod_phase(JOBS_NS, lost, "Failed", exit_code=1)
        if attempt == 3:
            break
        cp.wait_for(
            lambda: (cp.reap_terminating_pods(JOBS_NS), _cr(cp, "oscar")["status"].get("learnerAttempt") == 3)[1],
            90,
            "attempt 3 counted",
        )
        pods = cp.wait_for(
            lambda: _bound(
                [p for p in _pods(cp, "oscar", "learner") if p["status"].get("phase") not in ("Failed", "Succeeded")], 2
            ),
            60,
            "attempt 3's pods",
        )
    cp.reap_terminating_pods(JOBS_NS)
    cr = _wait_cr(cp, operator, "oscar", lambda c: c["status"]["phase"] == "Failed", "Failed")
    assert lost in cr["status"]["message"], cr["status"]["message"]
    cp.wait_for(lambda: _child(cp, "StatefulSet", "oscar-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    _finish(cp, "oscar")


def test_scheduling_pass_throughs_reach_the_pods_the_controllers_make(
    control_plane: ControlPlane, operator: Operator
) -> None:
    """Issue 45, item 3: spec.scheduling's pod labels and annotations on the pods the real StatefulSet and Job
    controllers create (not only on the templates); a schedulerName the cluster does not run leaves them unbound."""
    cp = control_plane
    _apply(
        cp,
        _manifest(
            "lima",
            **{
                "rollout.replicas": 1,
                "scheduling": {
                    "podLabels": {"team": "vision"},
                    "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "roce-net"},
                },
            },
        ),
    )
    pods = cp.wait_for(lambda: _bound(_pods(cp, "lima", "rollout"), 1), 60, "the rollout pod scheduled")
    assert pods[0]["metadata"]["labels"]["team"] == "vision"
    assert pods[0]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-net"
    _finish(cp, "lima")
    _apply(cp, _manifest("mike", **{"rollout.replicas": 1, "scheduling": {"schedulerName": "gang-scheduler"}}))
    pod = cp.wait_for(lambda: (p := _pods(cp, "mike", "rollout")) and p[0], 60, "the rollout pod created")
    assert pod["spec"]["schedulerName"] == "gang-scheduler" and not pod["spec"].get("nodeName")
    _finish(cp, "mike")


def test_a_queued_job_waits_for_kueue_to_admit_its_learner(control_plane: ControlPlane, operator: Operator) -> None:
    """Issue 45, item 3: spec.scheduling.queueName on the real API server, with the test in Kueue's place (this
    cluster runs no Kueue): the queue label on the StatefulSet and the learner Job the API server stores; the pool
    Ready, the operator leaves the Job suspended and says it waits for Kueue; once "admitted" (resumed as Kueue does)
    the Job controller's learner pod runs and the job completes, its pool scaled to zero. A second job whose learner
    is never admitted fails after its startup timeout, its learner Job deleted."""
    cp = control_plane
    _apply(
        cp,
        _manifest("papa", **{"rollout.replicas": 1, "sync.transport": "grpc", "scheduling": {"queueName": "gpu-team"}}),
    )
    cp.wait_for(lambda: _child(cp, "Job", "papa-learner") is not None, 30, "the learner Job created")
    for kind, child in (("StatefulSet", "papa-rollout"), ("Job", "papa-learner")):
        assert _child(cp, kind, child)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-team", kind
    _start_pool(cp, operator, "papa", 1)
    cr = _wait_cr(
        cp, operator, "papa", lambda c: _cond(c, "LearnerRunning").get("reason") == "Queued", "the learner queued"
    )
    assert "LocalQueue gpu-team" in _cond(cr, "LearnerRunning")["message"] and cr["status"].get("startTime")
    operator.wait_passes(cp, 2)  # more passes: still suspended, still no learner pod
    assert _child(cp, "Job", "papa-learner")["spec"]["suspend"] is True and not _pods(cp, "papa", "learner")

    cp.ok("PATCH", f"/apis/batch/v1/namespaces/{JOBS_NS}/jobs/papa-learner", {"spec": {"suspend": False}})  # Kueue
    learner = _learner_pod(cp, "papa")
    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Running")
    _wait_cr(cp, operator, "papa", lambda c: c["status"]["phase"] == "Running", "Running")
    cp.set_pod_phase(JOBS_NS, learner["metadata"]["name"], "Succeeded")
    _wait_cr(cp, operator, "papa", lambda c: c["status"]["phase"] == "Complete", "Complete")
    cp.wait_for(lambda: _child(cp, "StatefulSet", "papa-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    assert _child(cp, "Job", "papa-learner") is not None  # a learner Job that ended is kept
    _finish(cp, "papa")

    # Kueue never admits the learner: once the pool has idled for the startup timeout the job fails naming the
    # queue, and its learner Job is deleted (suspending it would not hold: Kueue owns suspend), the pool at zero.
    _apply(
        cp,
        _manifest(
            "quebec",
            **{
                "rollout.replicas": 1,
                "sync.transport": "grpc",
                "rollout.startupTimeout": "20s",
                "scheduling": {"queueName": "gpu-team"},
            },
        ),
    )
    _start_pool(cp, operator, "quebec", 1)
    cr = _wait_cr(cp, operator, "quebec", lambda c: c["status"].get("phase") == "Failed", "Failed", timeout=90)
    assert _cond(cr, "Failed")["reason"] == "LearnerNotAdmitted" and "LocalQueue gpu-team" in cr["status"]["message"]
    cp.wait_for(lambda: _child(cp, "Job", "quebec-learner") is None, 30, "the learner Job deleted")
    cp.wait_for(lambda: _child(cp, "StatefulSet", "quebec-rollout")["spec"]["replicas"] == 0, 30, "pool scaled to 0")
    _finish(cp, "quebec")


def test_delete_garbage_collects_every_child(control_plane: ControlPlane, operator: Operator) -> None:
    """Deleting a job deletes its children; an shm job's (the reference job's transport) also gets the Job that
    empties its folder on its node, whose pod the API server admits: the operator's own image (the chart's, not the
    job author's), as the learner's non-root user, with no capability, on the job's own folder only (issue 41)."""
    cp = control_plane
    # A job image that is not the chart's, so the cleanup's image shows whose it is.
    _apply(cp, _manifest("golf", **{"rollout.replicas": 1, "image.tag": "job-author-0.9"}))
    cp.wait_for(lambda: _child(cp, "Job", "golf-learner"), 60, "children")
    names = [
        ("Secret", "golf-token"),
        ("ConfigMap", "golf-config"),
        ("Service", "golf-rollout"),
        ("NetworkPolicy", "golf-rollout"),
        ("PodDisruptionBudget", "golf-rollout"),
        ("StatefulSet", "golf-rollout"),
        ("PodDisruptionBudget", "golf-learner"),
        ("Job", "golf-learner"),
    ]
    cp.wait_for(
        lambda: all(_child(cp, kind, name) is not None for kind, name in names), 60, "every child made"
    )  # all of them exist before the deletion, so none is missed below
    # ... and its pod placed: the operator learns the node to clean from the job's pods.
    cp.wait_for(lambda: _bound(_pods(cp, "golf", "rollout"), 1), 60, "the rollout pod scheduled")
    cp.kubectl("delete", "rolloutmatchingjob", "golf", "-n", JOBS_NS, "--wait=false")

    def gone() -> bool:
        cp.reap_terminating_pods(JOBS_NS)
        return (
            cp.get(f"{RMJ}/namespaces/{JOBS_NS}/rolloutmatchingjobs/golf") is None
            and all(_child(cp, kind, name) is None for kind, name in names)
            and not _pods(cp, "golf", "rollout")
        )

    t0 = time.monotonic()
    cp.wait_for(gone, 90, "the job and all its children garbage-collected")
    print(f"\n[envtest] job + children collected in {time.monotonic() - t0:.1f}s")

    (cleanup,) = cp.wait_for(
        lambda: cp.pods(JOBS_NS, "rmsft.io/job=golf,app.kubernetes.io/component=shm-cleanup"),
        60,
        "the shm cleanup Job's pod created",
    )
    pod = cleanup["spec"]
    chart_image = cp.ok("GET", f"/apis/apps/v1/namespaces/{OP_NS}/deployments/{RELEASE}")["spec"]["template"]["spec"][
        "containers"
    ][0]["image"]
    (c,) = pod["containers"]
    assert c["image"] == chart_image != "ghcr.io/rmsft/rmsft:job-author-0.9", c["image"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsNonRoot"]) == (1000, True)
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v] == [f"/dev/shm/rmsft/{JOBS_NS}.golf"]


def _own_ns_manifest(name: str, **edits: Any) -> dict[str, Any]:
    """A job for the release namespace: a hostPath model, no claims (those live in team-a), gRPC."""
    doc = _manifest(
        name,
        **{
            "model.volume": {"hostPath": "/srv/models", "mountPath": "/models"},
            "sync.transport": "grpc",
            "rollout.replicas": 1,
            **edits,
        },
    )
    doc["spec"]["learner"].pop("checkpointClaim", None)
    doc["metadata"]["namespace"] = OP_NS
    return doc


def _op_child(cp: ControlPlane, kind: str, name: str) -> dict[str, Any] | None:
    prefix, plural = KINDS[kind]
    return cp.get(f"{prefix}/namespaces/{OP_NS}/{plural}/{name}")


def test_the_default_chart_reconciles_a_job_in_its_namespace_and_can_read_no_secret(
    control_plane: ControlPlane, operator: Operator
) -> None:
    """Issue 62: under the default chart (Roles in the release namespace and the listed ones, nothing cluster-wide but
    its CRD) the operator reconciles a job in its own namespace, and its ServiceAccount reads no Secret anywhere (its
    own job's token included: it creates it, never reads it), and nothing in a namespace it was not given."""
    cp = control_plane
    _apply(cp, _own_ns_manifest("lima"))
    cr = _wait_cr_ns(
        cp,
        operator,
        OP_NS,
        "lima",
        lambda c: c.get("status", {}).get("phase") in ("Pending", "Starting"),
        "reconciled in the release namespace",
    )
    assert _cond(cr, "RolloutReady")["status"] == "False"
    for kind, name in (
        ("Secret", "lima-token"),
        ("ConfigMap", "lima-config"),
        ("StatefulSet", "lima-rollout"),
        ("NetworkPolicy", "lima-learner"),
        ("Job", "lima-learner"),
    ):
        assert cp.wait_for(lambda k=kind, n=name: _op_child(cp, k, n), 30, f"{kind} {name}"), (kind, name)
    token = cp.token_for(OP_NS, RELEASE)
    for path in (
        f"/api/v1/namespaces/{OP_NS}/secrets/lima-token",
        f"/api/v1/namespaces/{JOBS_NS}/secrets",
        "/api/v1/namespaces/default/secrets",
        "/api/v1/secrets",
    ):
        status, _ = cp.request("GET", path, token=token)
        assert status == 403, path
    for path in (
        "/apis/apps/v1/namespaces/default/statefulsets",
        "/apis/rmsft.io/v1alpha1/rolloutmatchingjobs",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    ):
        status, _ = cp.request("GET", path, token=token)
        assert status == 403, path
    status, _ = cp.request(
        "GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rolloutmatchingjobs.rmsft.io", token=token
    )
    assert status == 200  # its own CRD, by name: the version check at start
    cp.kubectl("delete", "rolloutmatchingjob", "lima", "-n", OP_NS, "--wait=false")


def test_operator_worked_under_rbac_with_zero_denials(control_plane: ControlPlane, operator: Operator) -> None:
    text = operator.output()
    # A 403 status, not the milliseconds of a log timestamp such as "11:02:52,403".
    denials = [line for line in text.splitlines() if re.search(r"(?<![\d,.:])403(?!\d)|[Ff]orbidden", line)]
    assert not denials, "\n".join(denials[:20])
    metrics = operator.metrics()
    assert not any(k.startswith("rmsft_operator_errors_total") for k in metrics), {
        k: v for k, v in metrics.items() if "errors" in k
    }
    assert operator.proc.poll() is None, "the operator died"


def test_a_resourcequota_that_refuses_the_learner_job_fails_the_job_with_its_pool_at_zero(
    control_plane: ControlPlane, operator: Operator
) -> None:
    """Issue 62 (b): a ResourceQuota on count/jobs.batch refuses the learner Job (403) after the StatefulSet was made.
    Before, the pool stayed at full size and the create was retried for ever. Now the pool is scaled to zero at once
    and, spec.rollout.startupTimeout after the job's creation, the job is Failed (CreateRefused), its pool at 0.
    (After the zero-denials test: this one makes the operator hear a 403 on purpose.)"""
    cp = control_plane
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-jobs", "namespace": OP_NS},
        "spec": {"hard": {"count/jobs.batch": "0"}},
    }
    cp.ok("POST", f"/api/v1/namespaces/{OP_NS}/resourcequotas", quota)
    try:
        _apply(cp, _own_ns_manifest("mike", **{"rollout.startupTimeout": 20}))
        cp.wait_for(lambda: _op_child(cp, "StatefulSet", "mike-rollout"), 30, "the pool made before the Job")
        cr = _wait_cr_ns(
            cp,
            operator,
            OP_NS,
            "mike",
            lambda c: _cond(c, "RolloutReady").get("reason") == "CreateRefused",
            "the refusal said",
            timeout=30,
        )
        assert "exceeded quota" in cr["status"]["message"] or "forbidden" in cr["status"]["message"].lower()
        cp.wait_for(
            lambda: _op_child(cp, "StatefulSet", "mike-rollout")["spec"]["replicas"] == 0,
            30,
            "the pool scaled to zero while the Job is refused",
        )
        failed = _wait_cr_ns(
            cp,
            operator,
            OP_NS,
            "mike",
            lambda c: c["status"].get("phase") == "Failed",
            "Failed after spec.rollout.startupTimeout",
            timeout=60,
        )
        assert _cond(failed, "Failed")["reason"] == "CreateRefused" and failed["status"]["rolloutReplicas"] == 0
        assert _op_child(cp, "StatefulSet", "mike-rollout")["spec"]["replicas"] == 0
        assert _op_child(cp, "Job", "mike-learner") is None
    finally:
        cp.request("DELETE", f"/api/v1/namespaces/{OP_NS}/resourcequotas/no-jobs")
        cp.kubectl("delete", "rolloutmatchingjob", "mike", "-n", OP_NS, "--wait=false", check=False)
