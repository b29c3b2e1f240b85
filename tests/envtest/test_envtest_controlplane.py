"""The envtest fixture itself: the control plane's controllers run, and the fake-kubelet helpers
(`create_node`, `set_pod_phase`, `delete_pod`, `reap_terminating_pods`) drive real StatefulSet and
Job controllers the way the operator tests need; `wait_for_gc_ready` and `token_for` work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from controlplane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-node-0"


def _node(cp: ControlPlane) -> dict[str, Any]:
    node = cp.get(f"/api/v1/nodes/{NODE}")
    return node or cp.create_node(NODE, gpus=8)


def _pod_spec(gpus: int = 1) -> dict[str, Any]:
    return {
        "containers": [
            {
                "name": "main",
                "image": "busybox:1.36",
                "command": ["true"],
                "resources": {"limits": {"nvidia.com/gpu": gpus}},
            }
        ],
        "restartPolicy": "Never",
    }


def test_fake_node_is_ready_and_schedulable(control_plane: ControlPlane) -> None:
    node = _node(control_plane)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert not node["spec"].get("taints")


def test_statefulset_pods_scheduled_ready_and_scaled_down(control_plane: ControlPlane, namespace: str) -> None:
    cp = control_plane
    _node(cp)
    labels = {"app": "pool"}
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "pool"},
        "spec": {
            "replicas": 2,
            "serviceName": "pool",
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {**_pod_spec(), "restartPolicy": "Always"}},
        },
    }
    cp.ok("POST", f"/apis/apps/v1/namespaces/{namespace}/statefulsets", sts)
    pods = cp.wait_for(
        lambda: (
            [p for p in cp.pods(namespace, "app=pool") if p["spec"].get("nodeName") == NODE]
            if len(cp.pods(namespace, "app=pool")) == 2
            else None
        ),
        60,
        "2 pods bound to the fake node",
    )
    assert len(pods) == 2
    for p in pods:
        out = cp.set_pod_phase(namespace, p["metadata"]["name"], "Running")
        assert out["status"]["podIP"] and out["status"]["containerStatuses"][0]["ready"] is True
    cp.wait_for(
        lambda: (
            cp.ok("GET", f"/apis/apps/v1/namespaces/{namespace}/statefulsets/pool")["status"].get("readyReplicas") == 2
        ),
        30,
        "StatefulSet readyReplicas == 2",
    )

    # Scale to zero: the controller deletes with a grace period; the fake kubelet finishes it.
    cp.ok("PATCH", f"/apis/apps/v1/namespaces/{namespace}/statefulsets/pool/scale", {"spec": {"replicas": 0}})
    # Bound to a node, they stay Terminating until a kubelet (here: the test) finishes the deletion.
    cp.wait_for(
        lambda: sum(bool(p["metadata"].get("deletionTimestamp")) for p in cp.pods(namespace, "app=pool")) == 2,
        30,
        "both pods Terminating",
    )
    assert sorted(cp.reap_terminating_pods(namespace)) == ["pool-0", "pool-1"]
    cp.wait_for(lambda: not cp.pods(namespace, "app=pool"), 10, "the pods gone")


def test_job_completes_when_its_pod_succeeds(control_plane: ControlPlane, namespace: str) -> None:
    cp = control_plane
    _node(cp)
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "learner"},
        "spec": {"backoffLimit": 0, "template": {"spec": _pod_spec(2)}},
    }
    cp.ok("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    pod = cp.wait_for(
        lambda: next((p for p in cp.pods(namespace, "job-name=learner") if p["spec"].get("nodeName")), None),
        60,
        "the learner pod bound",
    )
    name = pod["metadata"]["name"]
    cp.set_pod_phase(namespace, name, "Running")
    cp.set_pod_phase(namespace, name, "Succeeded")

    def complete() -> bool:
        conds = cp.ok("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs/learner")["status"].get("conditions", [])
        return any(c["type"] == "Complete" and c["status"] == "True" for c in conds)

    cp.wait_for(complete, 30, "the Job Complete")
    assert cp.delete_pod(namespace, name) == 200
    cp.wait_for(lambda: cp.get(f"/api/v1/namespaces/{namespace}/pods/{name}") is None, 10, "the pod deleted")


def test_gc_ready_then_children_of_deleted_job_are_collected(
    control_plane: ControlPlane, rmj_crd: dict, namespace: str
) -> None:
    cp = control_plane
    spec = yaml.safe_load((ROOT / "configs/job.yaml").read_text())["spec"]
    took = cp.wait_for_gc_ready(
        "rmsft.io/v1alpha1", "rolloutmatchingjobs", "RolloutMatchingJob", {"spec": spec}, namespace=namespace
    )
    print(f"garbage collector ready for RolloutMatchingJob after {took:.1f}s")
    assert (
        cp.wait_for_gc_ready(
            "rmsft.io/v1alpha1", "rolloutmatchingjobs", "RolloutMatchingJob", {"spec": spec}, namespace=namespace
        )
        < 5
    )  # known now: one round
    base = f"/apis/rmsft.io/v1alpha1/namespaces/{namespace}/rolloutmatchingjobs"
    owner = cp.ok(
        "POST",
        base,
        {"apiVersion": "rmsft.io/v1alpha1", "kind": "RolloutMatchingJob", "metadata": {"name": "owner"}, "spec": spec},
    )
    ref = {
        "apiVersion": "rmsft.io/v1alpha1",
        "kind": "RolloutMatchingJob",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    cp.ok(
        "POST",
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner-config", "ownerReferences": [ref]}},
    )
    cp.ok("DELETE", f"{base}/owner")
    cp.wait_for(
        lambda: cp.get(f"/api/v1/namespaces/{namespace}/configmaps/owner-config") is None,
        10,
        "the garbage collector to delete the child ConfigMap",
    )


def test_serviceaccount_token_and_kubeconfig(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> None:
    cp = control_plane
    cp.wait_for(lambda: cp.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default"), 30, "default SA")
    token = cp.token_for(namespace, "default")
    status, review = cp.request(
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        token=token,
    )
    assert status == 201 and review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:default"
    kubeconfig = cp.write_kubeconfig(tmp_path / "kubeconfig", token=token, namespace=namespace)
    assert cp.kubectl("auth", "can-i", "list", "pods", kubeconfig=kubeconfig, check=False).stdout.strip() == "no"
    assert cp.kubectl("auth", "can-i", "list", "pods", "-n", namespace).stdout.strip() == "yes"  # admin
