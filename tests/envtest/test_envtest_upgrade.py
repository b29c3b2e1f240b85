"""Issue 62: the operator run against the previous release's CRD (Helm never upgrades crds/), on a real API server,
under the default chart's ServiceAccount: it says so at start, in its log and in a Warning Event, naming what the old
CRD lacks, and keeps running (instead of having every status write refused or pruned). The CRD is vendored from git
history (tests/operator/fixtures/crd_7b46b7c.yaml, commit 7b46b7c); the chart's own is put back afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from controlplane import ControlPlane, free_port

ROOT = Path(__file__).resolve().parents[2]
RELEASE = NS = "rmsft-up"
OLD_CRD = ROOT / "tests/operator/fixtures/crd_7b46b7c.yaml"
CHART_CRD = ROOT / "charts/rmsft/crds/rolloutmatchingjobs.yaml"


def _helm(cp: ControlPlane, *args: str) -> str:
    exe = str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists() else "helm"
    env = {
        **os.environ,
        "KUBECONFIG": str(cp.admin_kubeconfig),
        "HELM_CACHE_HOME": str(cp.dir / "helm-up/cache"),
        "HELM_CONFIG_HOME": str(cp.dir / "helm-up/config"),
        "HELM_DATA_HOME": str(cp.dir / "helm-up/data"),
    }
    proc = subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_operator_against_an_older_crd_logs_and_emits_the_mismatch(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    assert "STATUS: deployed" in _helm(
        cp, "install", RELEASE, str(ROOT / "charts/rmsft"), "--namespace", NS, "--create-namespace"
    )
    proc = None
    try:
        cp.apply_crd(yaml.safe_load(OLD_CRD.read_text()))
        dep = cp.ok("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/{RELEASE}")
        pod = dep["spec"]["template"]["spec"]
        container = pod["containers"][0]
        kubeconfig = cp.write_kubeconfig(
            tmp_path / "kubeconfig", token=cp.token_for(NS, pod["serviceAccountName"]), namespace=NS
        )
        args = [re.sub(r":\d+/healthz$", f":{free_port()}/healthz", a) for a in container["args"]]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")},
            **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e},
            "KUBECONFIG": str(kubeconfig),
            "RMSFT_OPERATOR_METRICS_PORT": str(free_port()),
            "RMSFT_OPERATOR_PROGRESS_TIMEOUT_SECONDS": "0",
        }
        assert env["RMSFT_OPERATOR_NAMESPACE"] == NS  # the chart says where the Event goes
        log = tmp_path / "operator.log"
        with log.open("wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rmsft_cli", *args],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        said = cp.wait_for(
            lambda: "older than this operator" in log.read_text(errors="replace") or proc.poll() is not None,
            60,
            "the operator's log line on the CRD",
        )
        text = log.read_text(errors="replace")
        assert said and proc.poll() is None, text[-4000:]
        assert "status.learnerAttempt" in text and "kubectl apply --server-side -f charts/rmsft/crds" in text

        def event() -> dict | None:
            items = cp.ok("GET", f"/api/v1/namespaces/{NS}/events")["items"]
            return next((e for e in items if e.get("reason") == "CRDVersionMismatch"), None)

        ev = cp.wait_for(event, 30, "the CRDVersionMismatch Event")
        assert ev["type"] == "Warning" and ev["involvedObject"]["name"] == "rolloutmatchingjobs.rmsft.io"
        assert "status.learnerAttempt" in ev["message"] and "docs/upgrade.md" in ev["message"]
        assert "Forbidden" not in text and " 403" not in text  # the CRD read and the Event within the chart's RBAC
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        cp.apply_crd(yaml.safe_load(CHART_CRD.read_text()))  # the session's other tests use the chart's
        _helm(cp, "uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "60s")


def test_the_chart_crd_is_back_after_the_old_one(control_plane: ControlPlane) -> None:
    served = control_plane.ok(
        "GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rolloutmatchingjobs.rmsft.io"
    )
    assert served["spec"]["versions"] == yaml.safe_load(CHART_CRD.read_text())["spec"]["versions"]
