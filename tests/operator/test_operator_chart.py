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
    "operator": {
        "logLevel": "debug",
        "resyncSeconds": 10,
        "nodeSelector": {"role": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}
                    ]
                }
            }
        },
        "podAnnotations": {"team": "ml"},
    },
    "rbac": {"watchNamespaces": ["team-a", "team-b"]},
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "podMonitor": {"enabled": True, "interval": "10s"},
    },
    "dashboards": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "rmsft"}},
}
# Prometheus Operator kinds have no built-in schema: checked structurally below instead.
NON_CORE = {"ServiceMonitor", "PodMonitor"}


def helm_binary() -> str:
    """The real helm (scripts/setup.sh installs it into .tools/bin). Missing helm is a failure:
    CI installs it, and a skipped chart test would hide a broken chart."""
    found = shutil.which("helm") or (str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists() else None)
    if not found:
        pytest.fail("helm not found on PATH or in .tools/bin: run `bash scripts/setup.sh` (or `make setup`)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/rmsft-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/rmsft-helm/config",
        "HELM_DATA_HOME": "/tmp/rmsft-helm/data",
    }
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


# What a ClusterRole must never grant by default: reading Secrets, or making or changing workloads anywhere.
WORKLOADS = {
    ("", "pods"),
    ("apps", "statefulsets"),
    ("apps", "deployments"),
    ("batch", "jobs"),
    ("", "secrets"),
    ("", "configmaps"),
    ("", "services"),
}


def _grants(rule: dict, group: str, resource: str, verbs: set[str]) -> bool:
    return (
        (group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
        and (resource in rule.get("resources", []) or "*" in rule.get("resources", []))
        and bool(verbs & set(rule.get("verbs", [])) or "*" in rule.get("verbs", []))
    )


def test_default_install_grants_rights_in_the_release_namespace_only(default_objects: list[dict]) -> None:
    """Issue 62: least privilege by default. A Role in the release namespace and nowhere else; the one ClusterRole
    reads this chart's own CRD (by name) and nothing else: none can read a Secret or create a workload."""
    roles = [o for o in default_objects if o["kind"] == "Role"]
    assert [(r["metadata"]["namespace"]) for r in roles] == ["rmsft-system"]
    bindings = [o for o in default_objects if o["kind"] == "RoleBinding"]
    assert [b["metadata"]["namespace"] for b in bindings] == ["rmsft-system"]
    (cluster_role,) = [o for o in default_objects if o["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": ["rolloutmatchingjobs.rmsft.io"],
            "verbs": ["get"],
        }
    ]
    for rule in cluster_role["rules"]:
        assert not _grants(rule, "", "secrets", {"get", "list", "watch"}), rule
        for group, resource in WORKLOADS:
            assert not _grants(rule, group, resource, {"create", "patch", "update", "delete"}), rule
    for rule in roles[0]["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        # Secrets: create only (the job's own token, made once, never read back): no Secret is readable.
        assert not _grants(rule, "", "secrets", {"get", "list", "watch"}), rule
        # Children go away by owner references; the deletes are of the learner Job of a job whose learner runs on
        # several pods, between two attempts (issue 45), and of a replacement learner pod that cannot start mid-run
        # (issue 62), each only the job's own, by uid (reconcile.Delete).
        assert "delete" not in rule["verbs"] or (rule["apiGroups"], rule["resources"]) in (
            (["batch"], ["jobs"]),
            ([""], ["pods"]),
        ), rule
    assert any(_grants(r, "", "secrets", {"create"}) for r in roles[0]["rules"])
    kinds = _kinds(default_objects)
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    dep = next(o for o in default_objects if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["operator", "--namespace=rmsft-system"] and "--all-namespaces" not in c["args"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["RMSFT_OPERATOR_SCANNING"] == "false"  # no cluster-wide listing without a ClusterRole
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # The shm cleanup Job runs the operator's own image (config.OperatorConfig.image), not a job author's.
    assert env["RMSFT_OPERATOR_IMAGE"] == c["image"] == f"ghcr.io/rmsft/rmsft:{_app_version()}"
    assert env["RMSFT_OPERATOR_IMAGE_PULL_POLICY"] == c["imagePullPolicy"] == "IfNotPresent"


def test_listed_namespaces_get_roles_beside_the_release_namespace(full_objects: list[dict]) -> None:
    kinds = _kinds(full_objects)
    assert "ClusterRoleBinding" in kinds  # the CRD reader only
    assert [o["metadata"]["name"] for o in full_objects if o["kind"] == "ClusterRole"] == ["rmsft-crd"]
    roles = {o["metadata"]["namespace"] for o in full_objects if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"] for o in full_objects if o["kind"] == "RoleBinding"}
    assert roles == bindings == {"rmsft-system", "team-a", "team-b"}
    dep = next(o for o in full_objects if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert [a for a in c["args"] if a.startswith("--namespace")] == [
        "--namespace=rmsft-system",
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert "--all-namespaces" not in c["args"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["RMSFT_OPERATOR_SCANNING"] == "false"
    assert c["image"] == "ghcr.io/rmsft/rmsft:1.2.3"
    assert env["RMSFT_OPERATOR_IMAGE"] == c["image"] and env["RMSFT_OPERATOR_IMAGE_PULL_POLICY"] == "Always"


def test_cluster_wide_is_an_explicit_opt_in(tmp_path: Path) -> None:
    objs = template({"rbac": {"clusterWide": True}}, tmp_path)
    assert "Role" not in _kinds(objs)
    wide = next(o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "rmsft")
    assert any(_grants(r, "apps", "statefulsets", {"create"}) for r in wide["rules"])
    dep = next(o for o in objs if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["operator", "--all-namespaces"]
    assert {e["name"]: e["value"] for e in c["env"]}["RMSFT_OPERATOR_SCANNING"] == "true"
    for obj in objs:
        if obj["kind"] not in NON_CORE:
            kubernetes_validate.validate(obj, "1.32", strict=True)


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


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("operator.replicas=2", "/operator/replicas"),
        ("rbac.namespaced=true", "rbac.namespaced is gone"),  # issue 62: the default now; says what to set
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("metrics.podMonitor.interval=often", "/metrics/podMonitor/interval"),
        ("unknownKey=1", "unknownKey"),
    ],
)
def test_values_schema_rejects_bad_values(setting: str, named: str) -> None:
    proc = helm("template", "rmsft", str(CHART), "--set", setting, check=False)
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr
