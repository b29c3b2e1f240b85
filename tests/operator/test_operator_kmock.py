"""The real kopf operator (KopfRunner, `kopf run -m rmsft_operator.handlers`) against kmock, a
Kubernetes API emulator on a real HTTP port. Kubelet and the Job/StatefulSet controllers do not
exist here, so the tests play their part by patching child `status` the way they would."""

from __future__ import annotations

import copy
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kmock_cluster import NAMESPACE, KmockCluster, wait_for
from rmsft_operator import render

ROOT = Path(__file__).resolve().parents[2]
CR_PATH = f"/apis/rmsft.io/v1alpha1/namespaces/{NAMESPACE}/rolloutmatchingjobs"
KINDS = {  # kind -> (API prefix, plural)
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Job": ("/apis/batch/v1", "jobs"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
}
# How many of each kind a server-mode job has: one, and two budgets (the pool's and the learner's).
EACH = {**{kind: 1 for kind in KINDS}, "PodDisruptionBudget": 2, "NetworkPolicy": 2}  # the pool's and the learner's


@pytest.fixture(scope="module")
def operator(cluster: KmockCluster, operator_env: dict[str, str]) -> Iterator[Any]:
    from kopf.testing import KopfRunner

    cluster.create_namespace(NAMESPACE)
    args = ["run", "--standalone", "--namespace", NAMESPACE, "-m", "rmsft_operator.handlers"]
    with KopfRunner(args, timeout=30) as runner:
        wait_for(
            lambda: ("watch", "rmsft.io", "rolloutmatchingjobs") in cluster.emulator.operator_access,
            what="operator watching",
        )
        yield runner
    # The operator survived every scenario (no crash loop) and stopped cleanly.
    assert runner.exception is None, runner.output[-3000:]
    assert runner.exit_code == 0


def _method(request: Any) -> str:
    return str(getattr(request.method, "value", request.method)).upper()


def _manifest(name: str, **spec_overrides: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    doc["metadata"] = {
        "name": name,
        "namespace": NAMESPACE,
        "uid": f"uid-{name}",
        "generation": 1,
        "resourceVersion": "1",
    }
    for dotted, value in spec_overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return doc


def _create(cluster: KmockCluster, doc: dict[str, Any]) -> None:
    status, body = cluster.request("POST", CR_PATH, doc)
    assert status in (200, 201), body


def _cr(cluster: KmockCluster, name: str) -> dict[str, Any]:
    status, body = cluster.request("GET", f"{CR_PATH}/{name}")
    assert status == 200, body
    return body


def _child(cluster: KmockCluster, kind: str, name: str) -> dict[str, Any] | None:
    prefix, plural = KINDS[kind]
    status, body = cluster.request("GET", f"{prefix}/namespaces/{NAMESPACE}/{plural}/{name}")
    return body if status == 200 else None


def _children(cluster: KmockCluster, job: str) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for kind, (prefix, plural) in KINDS.items():
        items = cluster.items(prefix, NAMESPACE, plural)
        out[kind] = [o for o in items if (o["metadata"].get("labels") or {}).get(render.JOB_LABEL) == job]
    return out


def _condition(cr: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == ctype)


def _patch_status(cluster: KmockCluster, kind: str, name: str, status: dict[str, Any]) -> None:
    prefix, plural = KINDS[kind]
    code, body = cluster.request(
        "PATCH",
        f"{prefix}/namespaces/{NAMESPACE}/{plural}/{name}/status",
        {"status": status},
        "application/merge-patch+json",
    )
    assert code == 200, body


def _phase(cluster: KmockCluster, name: str) -> str | None:
    return (_cr(cluster, name).get("status") or {}).get("phase")


def _all_children_present(cluster: KmockCluster, job: str) -> bool:
    kids = _children(cluster, job)
    return all(len(kids[k]) == EACH[k] for k in KINDS)


def _start_pool(cluster: KmockCluster, name: str, replicas: int) -> None:
    n = render.names(name)
    wait_for(lambda: _all_children_present(cluster, name), what=f"children of {name}")
    _patch_status(
        cluster,
        "StatefulSet",
        n["statefulset"],
        {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas},
    )
    wait_for(lambda: _child(cluster, "Job", n["job"])["spec"]["suspend"] is False, what="learner resumed")
    # The Job controller's view of a learner pod that runs and is Ready (LearnerRunning needs it).
    _patch_status(cluster, "Job", n["job"], {"active": 1, "ready": 1})


def test_create_renders_owned_children_and_suspended_learner(cluster: KmockCluster, operator: Any) -> None:
    _create(cluster, _manifest("alpha"))
    wait_for(lambda: _all_children_present(cluster, "alpha"), what="all children")
    kids = _children(cluster, "alpha")
    for kind, objs in kids.items():
        refs = objs[0]["metadata"].get("ownerReferences") or []
        assert [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in refs] == [
            ("RolloutMatchingJob", "alpha", "uid-alpha", True)
        ], kind
    learner = kids["Job"][0]
    assert learner["spec"]["suspend"] is True
    sts = kids["StatefulSet"][0]
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["template"]["spec"]["containers"][0]["args"][:1] == ["serve"]
    cfg = yaml.safe_load(kids["ConfigMap"][0]["data"]["job.yaml"])
    assert cfg["spec"]["training"]["lr"] == pytest.approx(1e-4)  # training passed through
    assert len(kids["ConfigMap"][0]["data"]["servers"].splitlines()) == 2
    cr = wait_for(
        lambda: (c := _cr(cluster, "alpha")).get("status", {}).get("phase") == "Pending" and c, what="phase Pending"
    )
    assert _condition(cr, "RolloutReady")["status"] == "False"
    assert _condition(cr, "LearnerRunning")["reason"] == "Suspended"
    assert cr["status"]["observedGeneration"] == 1


def test_pool_ready_resumes_learner_then_complete_scales_pool_to_zero(cluster: KmockCluster, operator: Any) -> None:
    _create(cluster, _manifest("bravo"))
    n = render.names("bravo")
    wait_for(lambda: _all_children_present(cluster, "bravo"), what="children")
    # Only part of the pool Ready: the learner must stay suspended.
    _patch_status(cluster, "StatefulSet", n["statefulset"], {"replicas": 2, "readyReplicas": 1})
    wait_for(lambda: _cr(cluster, "bravo")["status"].get("readyRolloutReplicas") == 1, what="1 ready")
    assert _child(cluster, "Job", n["job"])["spec"]["suspend"] is True

    _start_pool(cluster, "bravo", 2)
    cr = wait_for(lambda: (c := _cr(cluster, "bravo"))["status"].get("phase") == "Running" and c, what="Running")
    assert _condition(cr, "RolloutReady")["status"] == "True"
    assert _condition(cr, "LearnerRunning")["status"] == "True"

    _patch_status(
        cluster,
        "Job",
        n["job"],
        {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True", "reason": "Completed"}]},
    )
    cr = wait_for(lambda: (c := _cr(cluster, "bravo"))["status"].get("phase") == "Complete" and c, what="Complete")
    assert _condition(cr, "Complete")["status"] == "True"
    assert _child(cluster, "StatefulSet", n["statefulset"])["spec"]["replicas"] == 0


def test_learner_failure_marks_failed_and_frees_gpus(cluster: KmockCluster, operator: Any) -> None:
    _create(cluster, _manifest("charlie"))
    n = render.names("charlie")
    _start_pool(cluster, "charlie", 2)
    _patch_status(
        cluster,
        "Job",
        n["job"],
        {
            "failed": 1,
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                }
            ],
        },
    )
    cr = wait_for(lambda: (c := _cr(cluster, "charlie"))["status"].get("phase") == "Failed" and c, what="Failed")
    failed = _condition(cr, "Failed")
    assert failed["status"] == "True" and "BackoffLimitExceeded" in failed["message"]
    wait_for(
        lambda: _child(cluster, "StatefulSet", n["statefulset"])["spec"]["replicas"] == 0, what="pool scaled to zero"
    )
    # A Warning event was posted for the transition.
    wait_for(
        lambda: any(
            e.get("reason") == "PhaseFailed" and e["type"] == "Warning" and e["involvedObject"]["name"] == "charlie"
            for e in cluster.items("/api/v1", NAMESPACE, "events")
        ),
        what="PhaseFailed event",
    )


def test_replicas_edit_scales_statefulset_other_edits_refused(cluster: KmockCluster, operator: Any) -> None:
    _create(cluster, _manifest("delta"))
    n = render.names("delta")
    wait_for(lambda: _all_children_present(cluster, "delta"), what="children")
    sts_before = _child(cluster, "StatefulSet", n["statefulset"])

    code, body = cluster.request(
        "PATCH",
        f"{CR_PATH}/delta",
        {"metadata": {"generation": 2}, "spec": {"rollout": {"replicas": 3}}},
        "application/merge-patch+json",
    )
    assert code == 200, body
    wait_for(
        lambda: _child(cluster, "StatefulSet", n["statefulset"])["spec"]["replicas"] == 3,
        what="StatefulSet scaled to 3",
    )
    wait_for(
        lambda: len(_child(cluster, "ConfigMap", n["config"])["data"]["servers"].splitlines()) == 3,
        what="server list updated",
    )

    code, body = cluster.request(
        "PATCH",
        f"{CR_PATH}/delta",
        {"metadata": {"generation": 3}, "spec": {"training": {"lr": 0.5}, "rollout": {"maxModelLen": 2048}}},
        "application/merge-patch+json",
    )
    assert code == 200, body
    cr = wait_for(
        lambda: (c := _cr(cluster, "delta")) and _condition(c, "InvalidSpec")["status"] == "True" and c,
        what="edit refused",
    )
    cond = _condition(cr, "InvalidSpec")
    assert cond["reason"] == "ImmutableFieldChanged"
    assert "spec.training.lr" in cond["message"] and "spec.rollout.maxModelLen" in cond["message"]
    sts_after = _child(cluster, "StatefulSet", n["statefulset"])
    assert sts_after["spec"]["template"] == sts_before["spec"]["template"]
    applied = yaml.safe_load(_child(cluster, "ConfigMap", n["config"])["data"]["job.yaml"])
    assert applied["spec"]["training"]["lr"] == pytest.approx(1e-4)


def test_invalid_spec_reports_condition_and_creates_nothing(cluster: KmockCluster, operator: Any) -> None:
    # kmock enforces no CRD schema: the operator's own validation is the last line of defence.
    doc = _manifest(
        "echo",
        **{"placement.accelerator": "nvidia", "placement.gpusPerNode": 8, "rollout.replicas": 1, "learner.gpus": 9},
    )
    _create(cluster, doc)
    cr = wait_for(lambda: (c := _cr(cluster, "echo")).get("status", {}).get("phase") == "Invalid" and c, what="Invalid")
    cond = _condition(cr, "InvalidSpec")
    assert cond["status"] == "True" and "spec.placement.gpusPerNode" in cond["message"]
    assert not any(_children(cluster, "echo").values())


def test_api_errors_are_retried_without_duplicates(cluster: KmockCluster, operator: Any) -> None:
    def first(n: int) -> Any:
        """A criterion matching the first `n` distinct requests it sees (by identity)."""
        seen: list[Any] = []

        def match(request: Any) -> bool:
            if all(request is not r for r in seen) and len(seen) < n:
                seen.append(request)
            return any(request is r for r in seen)

        return match

    def inject() -> None:
        em = cluster.emulator
        # A create whose response is lost (kmock stores it, answers 500), a conflict, a flaky read.
        em["post", kmock.resource("apps/v1/statefulsets"), kmock.namespace(NAMESPACE)][first(1)] << 500
        em["post", kmock.resource("batch/v1/jobs"), kmock.namespace(NAMESPACE)][first(1)] << 409
        em["get", kmock.resource("v1/configmaps"), kmock.name("foxtrot-config")][first(2)] << 500

    cluster.call(inject)
    _create(cluster, _manifest("foxtrot"))
    n = render.names("foxtrot")
    wait_for(lambda: _all_children_present(cluster, "foxtrot"), what="children despite errors")
    _start_pool(cluster, "foxtrot", 2)
    wait_for(lambda: _phase(cluster, "foxtrot") == "Running", what="Running")
    kids = _children(cluster, "foxtrot")
    assert {k: len(v) for k, v in kids.items()} == EACH
    assert _child(cluster, "Job", n["job"])["spec"]["suspend"] is False
    metrics = _operator_metrics()
    assert metrics.get('rmsft_operator_errors_total{code="500"}', 0) >= 1
    assert metrics.get("rmsft_operator_api_retries_total", 0) >= 1


def test_delete_leaves_only_owned_objects(cluster: KmockCluster, operator: Any) -> None:
    _create(cluster, _manifest("golf"))
    wait_for(lambda: _all_children_present(cluster, "golf"), what="children")
    code, body = cluster.request("DELETE", f"{CR_PATH}/golf")
    assert code == 200, body
    wait_for(lambda: cluster.request("GET", f"{CR_PATH}/golf")[0] == 404, what="CR gone")
    # kmock has no garbage collector: what remains must all be collectable via owner references
    # to the deleted job, i.e. nothing was left that Kubernetes would not clean up.
    leftovers = _children(cluster, "golf")
    assert sum(len(v) for v in leftovers.values()) == sum(EACH.values())
    for kind, objs in leftovers.items():
        for obj in objs:
            refs = obj["metadata"].get("ownerReferences") or []
            assert any(r["uid"] == "uid-golf" and r["kind"] == "RolloutMatchingJob" for r in refs), kind
    for kind, (prefix, plural) in KINDS.items():
        for obj in cluster.items(prefix, NAMESPACE, plural):
            assert obj["metadata"].get("ownerReferences"), f"{kind} {obj['metadata']['name']} has no owner"


def _reconciled(cluster: KmockCluster, name: str) -> dict[str, list[dict[str, Any]]]:
    """A job of this test's own, created and reconciled (its children made): no test reads another's objects."""
    _create(cluster, _manifest(name))
    wait_for(lambda: _all_children_present(cluster, name), what=f"{name}'s children")
    return _children(cluster, name)


def test_operator_exports_its_metrics(cluster: KmockCluster, operator: Any) -> None:
    _reconciled(cluster, "india")
    metrics = _operator_metrics()
    assert any(k.startswith("rmsft_operator_reconciles_total{") for k in metrics)
    assert "rmsft_operator_reconcile_duration_seconds_count" in metrics
    assert any(k.startswith("rmsft_operator_jobs{") for k in metrics)
    # get-before-create answers 404 for every new child: an answer, not an error (the dashboard
    # plots this counter).
    assert 'rmsft_operator_errors_total{code="404"}' not in metrics


def _operator_metrics() -> dict[str, float]:
    import os

    port = os.environ["RMSFT_OPERATOR_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_rendered_children_match_offline_rendering(cluster: KmockCluster, operator: Any) -> None:
    """What the operator sent equals `render` output (so offline schema checks cover it)."""
    from rmsft.jobspec import parse_job

    kids = _reconciled(cluster, "juliet")
    doc = copy.deepcopy(_manifest("juliet"))
    job = parse_job(doc)
    token_b64 = kids["Secret"][0]["data"]["token"]
    import base64

    expected = render.render_all(job, NAMESPACE, "uid-juliet", base64.b64decode(token_b64).decode())
    for obj in expected:
        live = next(o for o in kids[obj["kind"]] if o["metadata"]["name"] == obj["metadata"]["name"])
        for key in ("spec", "data"):
            if key in obj:
                assert json.loads(json.dumps(live[key])) == obj[key], (obj["kind"], key)


def test_chart_rbac_allows_every_call_the_operator_made(cluster: KmockCluster, operator: Any, tmp_path: Path) -> None:
    """Least privilege that still works: each (verb, resource) the real operator used against the
    API in this module is granted by the chart's namespaced rules."""
    from test_operator_chart import template

    _reconciled(cluster, "kilo")  # the calls a job's creation makes, whatever ran before
    objs = template({"rbac": {"watchNamespaces": [NAMESPACE]}}, tmp_path)  # the default: Roles, no cluster rights
    role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == NAMESPACE)
    crd_reader = next(o for o in objs if o["kind"] == "ClusterRole")  # the one cluster-wide right: its own CRD
    granted = {
        (verb, group, res)
        for rule in [*role["rules"], *crd_reader["rules"]]
        for group in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }
    used = set(cluster.emulator.operator_access)
    assert ("create", "apps", "statefulsets") in used and ("patch", "rmsft.io", "rolloutmatchingjobs/status") in used
    missing = sorted(used - granted)
    assert not missing, f"the chart's Role lacks permissions the operator used: {missing}"


def test_learner_progress_fills_step_column(cluster: KmockCluster, operator: Any) -> None:
    """status.step / weightVersion / evaluation come from the learner pod's own /metrics endpoint."""
    import http.server
    import threading

    from kmock_cluster import free_port

    body = (
        b"# HELP rmsft_learner_global_step Optimizer steps done\n# TYPE rmsft_learner_global_step gauge\n"
        b"rmsft_learner_global_step 7.0\nrmsft_learner_weight_version 8.0\n"
        b"rmsft_learner_eval_step 5.0\nrmsft_learner_eval_f1 0.5\nrmsft_learner_eval_map 0.25\n"
        b"rmsft_learner_eval_map50 0.75\n"
    )

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _create(cluster, _manifest("hotel", **{"learner.metricsPort": port}))
        _start_pool(cluster, "hotel", 2)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "hotel-learner-abcde",
                "namespace": NAMESPACE,
                "labels": render.labels("hotel", "learner"),
            },
            "spec": {"containers": [{"name": "learner", "image": "rmsft:cpu"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }
        code, out = cluster.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
        assert code in (200, 201), out
        cr = wait_for(lambda: (c := _cr(cluster, "hotel"))["status"].get("step") == 7 and c, what="step 7")
        assert cr["status"]["weightVersion"] == 8
        assert cr["status"]["evaluation"] == {"step": 5, "f1": 0.5, "mAP": 0.25, "mAP50": 0.75}
    finally:
        server.shutdown()
