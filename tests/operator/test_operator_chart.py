"""The Helm chart, checked with a real `helm` binary: lint, template with default and with
all-features values, every rendered object validated against the Kubernetes 1.32 schemas."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/rmsft"
ALL_FEATURES = {
    "image": {"tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {"logLevel": "debug", "resyncSeconds": 10, "nodeSelector": {"role": "system"},
                 "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [
                         {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
                 "podAnnotations": {"team": "ml"}},
    "rbac": {"namespaced": True, "watchNamespaces": ["team-a", "team-b"]},
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "podMonitor": {"enabled": True, "interval": "10s"}},
    "dashboards": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "rmsft"}},
}
# Prometheus Operator kinds have no built-in schema: checked structurally below instead.
NON_CORE = {"ServiceMonitor", "PodMonitor"}


def helm_binary() -> str:
    """The real helm (scripts/setup.sh installs it into .tools/bin). Missing helm is a failure:
    CI installs it, and a skipped chart test would hide a broken chart."""
    found = shutil.which("helm") or (str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists()
                                     else None)
    if not found:
        pytest.fail("helm not found on PATH or in .tools/bin: run `bash scripts/setup.sh` (or `make setup`)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/rmsft-helm/cache", "HELM_CONFIG_HOME": "/tmp/rmsft-helm/config",
           "HELM_DATA_HOME": "/tmp/rmsft-helm/data"}
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def template(values: dict[str, Any] | None, tmp_path: Path, namespace: str = "rmsft-system") -> list[dict]:
    args = ["template", "rmsft", str(CHART), "--namespace", namespace, "--include-crds"]
    if values is not None:
        vf = tmp_path / "values.yaml"
        vf.write_text(yaml.safe_dump(values))
        args += ["-f", str(vf)]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


@pytest.fixture(scope="module")
def default_objects(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return template(None, tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="module")
def full_objects(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return template(ALL_FEATURES, tmp_path_factory.mktemp("full"))


def _app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def _kinds(objs: list[dict]) -> list[str]:
    return sorted(o["kind"] for o in objs)


@pytest.mark.parametrize("values", [None, ALL_FEATURES], ids=["default", "all-features"])
def test_helm_lint_is_clean(values: dict | None, tmp_path: Path) -> None:
    args = ["lint", str(CHART), "--strict"]
    if values is not None:
        vf = tmp_path / "values.yaml"
        vf.write_text(yaml.safe_dump(values))
        args += ["-f", str(vf)]
    out = helm(*args).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize("which", ["default_objects", "full_objects"])
def test_rendered_objects_validate_against_kubernetes_1_32(which: str, request: pytest.FixtureRequest) -> None:
    objs = request.getfixturevalue(which)
    assert "CustomResourceDefinition" in _kinds(objs) and "Deployment" in _kinds(objs)
    for obj in objs:
        if obj["kind"] in NON_CORE:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(obj, "1.32", strict=True)


def test_default_install_is_cluster_wide_least_privilege(default_objects: list[dict]) -> None:
    kinds = _kinds(default_objects)
    assert "ClusterRole" in kinds and "Role" not in kinds
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    role = next(o for o in default_objects if o["kind"] == "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        # Children go away by owner references; the deletes are of the learner Job of a job whose learner runs on
        # several pods, between two attempts (issue 45), and of a replacement learner pod that cannot start mid-run
        # (issue 62), each only the job's own, by uid (reconcile.Delete).
        assert "delete" not in rule["verbs"] or (rule["apiGroups"], rule["resources"]) in (
            (["batch"], ["jobs"]), ([""], ["pods"])), rule
    dep = next(o for o in default_objects if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["operator", "--all-namespaces"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # The shm cleanup Job runs the operator's own image (config.OperatorConfig.image), not a job author's.
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["RMSFT_OPERATOR_IMAGE"] == c["image"] == f"ghcr.io/rmsft/rmsft:{_app_version()}"
    assert env["RMSFT_OPERATOR_IMAGE_PULL_POLICY"] == c["imagePullPolicy"] == "IfNotPresent"


def test_namespaced_option_grants_roles_only_where_jobs_live(full_objects: list[dict]) -> None:
    kinds = _kinds(full_objects)
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = {o["metadata"]["namespace"] for o in full_objects if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"] for o in full_objects if o["kind"] == "RoleBinding"}
    assert roles == bindings == {"team-a", "team-b"}
    dep = next(o for o in full_objects if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in c["args"] and "--namespace=team-b" in c["args"]
    assert "--all-namespaces" not in c["args"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["RMSFT_OPERATOR_SCANNING"] == "false"  # no cluster-wide listing without a ClusterRole
    assert c["image"] == "ghcr.io/rmsft/rmsft:1.2.3"
    assert env["RMSFT_OPERATOR_IMAGE"] == c["image"] and env["RMSFT_OPERATOR_IMAGE_PULL_POLICY"] == "Always"


def test_monitors_and_dashboards(full_objects: list[dict]) -> None:
    pm = next(o for o in full_objects if o["kind"] == "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "rmsft-operator"}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    sm = next(o for o in full_objects if o["kind"] == "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    boards = [o for o in full_objects if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]]
    assert {b["metadata"]["namespace"] for b in boards} == {"monitoring"}
    shipped = {p.name for p in (CHART / "dashboards").glob("*.json")}
    assert {k for b in boards for k in b["data"]} == shipped
    import json

    for b in boards:
        for text in b["data"].values():
            assert json.loads(text)["panels"]


def test_crd_in_chart_is_the_generated_one(default_objects: list[dict]) -> None:
    from rmsft_operator.crd import build_crd

    crd = next(o for o in default_objects if o["kind"] == "CustomResourceDefinition")
    assert crd == build_crd()


@pytest.mark.parametrize(("setting", "named"), [
    ("operator.replicas=2", "/operator/replicas"),
    ("rbac.namespaced=true", "/rbac/watchNamespaces"),  # namespaced mode needs namespaces
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("metrics.podMonitor.interval=often", "/metrics/podMonitor/interval"),
    ("unknownKey=1", "unknownKey"),
])
def test_values_schema_rejects_bad_values(setting: str, named: str) -> None:
    proc = helm("template", "rmsft", str(CHART), "--set", setting, check=False)
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr
