"""`helm install` of charts/rmsft with the pinned helm against a real API server, with default and
with all-features values (those of tests/operator/test_operator_chart.py): the install succeeds,
the CRD is Established, the operator's Deployment, ServiceAccount and RBAC exist, and the
ServiceAccount's real rights (a TokenRequest token, checked by the server's RBAC) are what the
chart promises: by default (issue 62) the release namespace (and the listed ones) only, no Secret readable, nothing
cluster-wide but its own CRD by name; no delete but of batch Jobs and pods (the learner Job of a job whose learner runs
on several pods, between two attempts; a replacement learner pod that cannot start)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from controlplane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/rmsft"
RELEASE, NAMESPACE = "rmsft", "rmsft-system"
CRD_NAME = "rolloutmatchingjobs.rmsft.io"


def _all_features() -> dict[str, Any]:
    """ALL_FEATURES of tests/operator/test_operator_chart.py (one source), loaded under a private name."""
    spec = importlib.util.spec_from_file_location("_rmsft_chart_values", ROOT / "tests/operator/test_operator_chart.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ALL_FEATURES


ALL_FEATURES = _all_features()


def _monitoring_crd(kind: str, plural: str) -> dict[str, Any]:
    """A minimal stand-in for a Prometheus Operator CRD (any spec accepted): enough for the
    chart's ServiceMonitor/PodMonitor to be created, which is all the chart is responsible for."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                        }
                    },
                }
            ],
        },
    }


def _helm(cp: ControlPlane, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("helm") or str(ROOT / ".tools/bin/helm")
    if not os.access(exe, os.X_OK):
        pytest.fail("helm not found on PATH or in .tools/bin: run `make setup`")
    env = {
        **os.environ,
        "KUBECONFIG": str(cp.admin_kubeconfig),
        "HELM_CACHE_HOME": str(cp.dir / "helm/cache"),
        "HELM_CONFIG_HOME": str(cp.dir / "helm/config"),
        "HELM_DATA_HOME": str(cp.dir / "helm/data"),
    }
    proc = subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=180)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def install(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Any]:
    """Returns install(values) -> helm's output; uninstalls the release afterwards (CRDs stay, as
    with any helm chart: later tests of the session may use the CRD)."""
    installed: list[str] = []

    def run(values: dict[str, Any] | None) -> str:
        args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace"]
        if values is not None:
            vf = tmp_path / "values.yaml"
            vf.write_text(yaml.safe_dump(values))
            args += ["-f", str(vf)]
        out = _helm(control_plane, *args).stdout
        installed.append(RELEASE)
        return out

    yield run
    for release in installed:
        _helm(control_plane, "uninstall", release, "--namespace", NAMESPACE, "--wait", "--timeout", "60s", check=False)


def _assert_crd_served_from_chart(cp: ControlPlane) -> None:
    """The CRD is Established and is the chart's (the session's control plane created it from the
    same file before the controller-manager started; helm leaves an existing CRD alone)."""
    cp.wait_for(lambda: cp.crd_established(CRD_NAME), 30, f"CRD {CRD_NAME} Established")
    served = cp.ok("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    chart = yaml.safe_load((CHART / "crds/rolloutmatchingjobs.yaml").read_text())
    assert served["spec"]["versions"] == chart["spec"]["versions"]
    assert served["spec"]["names"] == {**chart["spec"]["names"], "listKind": served["spec"]["names"]["listKind"]}


def _exists(cp: ControlPlane, path: str) -> bool:
    return cp.get(path) is not None


def _can(cp: ControlPlane, token: str, path: str) -> int:
    status, _ = cp.request("GET", path, token=token)
    return status


def test_default_install(control_plane: ControlPlane, install: Any) -> None:
    out = install(None)
    assert "STATUS: deployed" in out, out
    cp = control_plane
    _assert_crd_served_from_chart(cp)
    assert _exists(cp, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}")
    assert _exists(cp, f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{RELEASE}")
    assert _exists(cp, f"/api/v1/namespaces/{NAMESPACE}/services/{RELEASE}-metrics")
    assert _exists(cp, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles/{RELEASE}")
    assert not _exists(cp, f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{RELEASE}")  # cluster-wide: opt-in
    binding = cp.get(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{RELEASE}-crd")
    assert binding and binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    dashboards = cp.ok("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps?labelSelector=grafana_dashboard%3D1")
    assert len(dashboards["items"]) == 4

    # The controller-manager acts on it: a ReplicaSet for the Deployment (PodSecurity admission,
    # at its default, lets the operator pod through; with no node it stays Pending).
    cp.wait_for(
        lambda: cp.ok("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/replicasets")["items"],
        30,
        "the operator Deployment's ReplicaSet",
    )

    # The operator's own identity, checked by the server's RBAC: its namespace only, no Secret readable.
    token = cp.token_for(NAMESPACE, RELEASE)
    assert _can(cp, token, f"/apis/rmsft.io/v1alpha1/namespaces/{NAMESPACE}/rolloutmatchingjobs") == 200
    assert _can(cp, token, f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets") == 200
    assert _can(cp, token, f"/api/v1/namespaces/{NAMESPACE}") == 200  # a job's Pod Security level (shm)
    assert _can(cp, token, "/apis/rmsft.io/v1alpha1/rolloutmatchingjobs") == 403  # not every namespace
    assert _can(cp, token, "/apis/apps/v1/namespaces/default/statefulsets") == 403
    assert _can(cp, token, "/api/v1/namespaces") == 403  # no kopf cluster scanning
    assert _can(cp, token, "/api/v1/namespaces/default") == 403
    for where in (NAMESPACE, "default"):  # create only: not even a Secret of its own namespace is readable
        assert _can(cp, token, f"/api/v1/namespaces/{where}/secrets") == 403
        assert _can(cp, token, f"/api/v1/namespaces/{where}/secrets/any") == 403
    assert _can(cp, token, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}") == 200
    assert _can(cp, token, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions") == 403  # that one only
    status, body = cp.request(
        "POST",
        "/apis/apps/v1/namespaces/default/statefulsets",
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x"}},
        token=token,
    )
    assert status == 403, body  # no workload outside its namespace
    status, body = cp.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/configmaps/kube-root-ca.crt", token=token)
    assert status == 403, body
    status, body = cp.request("DELETE", f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/any", token=token)
    assert status == 403, body


def test_all_features_install(control_plane: ControlPlane, install: Any) -> None:
    cp = control_plane
    # What the cluster provides before this chart: the Prometheus Operator CRDs for the
    # ServiceMonitor/PodMonitor, and the namespaces the values name (helm creates only its own).
    for kind, plural in (("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors")):
        cp.apply_crd(_monitoring_crd(kind, plural))
    watched = ALL_FEATURES["rbac"]["watchNamespaces"]
    for ns in [*watched, ALL_FEATURES["dashboards"]["namespace"]]:
        cp.create_namespace(ns)

    out = install(ALL_FEATURES)
    assert "STATUS: deployed" in out, out
    _assert_crd_served_from_chart(cp)
    dep = cp.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}")
    assert dep is not None
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":1.2.3")
    sa = cp.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{RELEASE}")
    assert sa and ALL_FEATURES["serviceAccount"]["annotations"].items() <= sa["metadata"]["annotations"].items()
    assert not _exists(cp, f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{RELEASE}")
    assert not _exists(cp, f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{RELEASE}")
    for ns in [NAMESPACE, *watched]:
        assert _exists(cp, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{RELEASE}")
        assert _exists(cp, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/{RELEASE}")
    assert _exists(cp, f"/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}/servicemonitors/{RELEASE}-operator")
    assert _exists(cp, f"/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}/podmonitors/{RELEASE}-jobs")
    dashboards = cp.ok("GET", "/api/v1/namespaces/monitoring/configmaps?labelSelector=grafana_dashboard%3D1")
    assert len(dashboards["items"]) == 4

    # Namespaced mode for real: rights in the watched namespaces, none elsewhere, none cluster-wide.
    token = cp.token_for(NAMESPACE, RELEASE)
    for ns in watched:
        assert _can(cp, token, f"/apis/rmsft.io/v1alpha1/namespaces/{ns}/rolloutmatchingjobs") == 200
        assert _can(cp, token, f"/apis/batch/v1/namespaces/{ns}/jobs") == 200
        # A Role's `namespaces: get` reaches its own namespace object: the Pod Security level of an
        # shm job's namespace can be read without any cluster-wide right.
        assert _can(cp, token, f"/api/v1/namespaces/{ns}") == 200
    assert _can(cp, token, "/api/v1/namespaces/default") == 403
    assert _can(cp, token, "/apis/rmsft.io/v1alpha1/namespaces/default/rolloutmatchingjobs") == 403
    assert _can(cp, token, "/apis/rmsft.io/v1alpha1/rolloutmatchingjobs") == 403
    assert _can(cp, token, "/api/v1/namespaces") == 403
