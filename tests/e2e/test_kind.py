"""End to end on a real cluster (kind): build the CPU image, load it into kind, install the chart,
apply configs/job-kind-cpu.yaml and wait until the job is Complete.

Needs Docker, kind, helm and kubectl. Skips (with the reason) when any is missing or Docker is
not reachable. Run it with:

    PATH="$PWD/.tools/bin:$PATH" python -m pytest tests/e2e -m kind -s

Environment: RMSFT_KIND_CLUSTER (default rmsft-e2e; created if absent and deleted afterwards
unless RMSFT_KIND_KEEP=1), RMSFT_KIND_TIMEOUT (seconds to wait for Complete, default 2400).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = os.environ.get("RMSFT_KIND_CLUSTER", "rmsft-e2e")
TIMEOUT = float(os.environ.get("RMSFT_KIND_TIMEOUT", "2400"))
IMAGE = "rmsft:cpu"
JOB_NS = "rmsft-e2e"
OPERATOR_NS = "rmsft-system"

pytestmark = [pytest.mark.kind, pytest.mark.slow]


def _tool(name: str) -> str | None:
    local = ROOT / ".tools/bin" / name
    return shutil.which(name) or (str(local) if local.exists() else None)


def _why_not() -> str | None:
    for name in ("docker", "kind", "helm", "kubectl"):
        if _tool(name) is None:
            return f"`{name}` is not installed (needs docker, kind, helm, kubectl)"
    probe = subprocess.run([_tool("docker"), "info"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"Docker engine not reachable: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def run(*args: str, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = _tool(args[0]) or args[0]
    print("+", " ".join(args), flush=True)
    proc = subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def kind_cluster() -> Iterator[str]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    existing = run("kind", "get", "clusters").stdout.split()
    created = CLUSTER not in existing
    if created:
        run("kind", "create", "cluster", "--name", CLUSTER, "--wait", "120s", timeout=600)
    run("kubectl", "config", "use-context", f"kind-{CLUSTER}")
    yield CLUSTER
    if created and os.environ.get("RMSFT_KIND_KEEP") != "1":
        run("kind", "delete", "cluster", "--name", CLUSTER, check=False, timeout=300)


def _diagnostics() -> str:
    out = []
    for args in (("kubectl", "-n", JOB_NS, "describe", "rmj"),
                 ("kubectl", "-n", JOB_NS, "get", "pods,jobs,statefulsets", "-o", "wide"),
                 ("kubectl", "-n", JOB_NS, "logs", "-l", "app.kubernetes.io/component=learner", "--tail=80"),
                 ("kubectl", "-n", OPERATOR_NS, "logs", "deploy/rmsft", "--tail=80")):
        p = run(*args, check=False)
        out.append(f"$ {' '.join(args)}\n{p.stdout}{p.stderr}")
    return "\n".join(out)


def test_cpu_job_runs_to_complete_on_kind(kind_cluster: str) -> None:
    run("docker", "build", "--build-arg", "VARIANT=cpu", "-t", IMAGE, ".", timeout=3600)
    run("kind", "load", "docker-image", IMAGE, "--name", kind_cluster, timeout=900)
    run("helm", "upgrade", "--install", "rmsft", "charts/rmsft", "--namespace", OPERATOR_NS,
        "--create-namespace", "--set", "image.repository=rmsft", "--set", "image.tag=cpu",
        "--set", "image.pullPolicy=Never", "--set", "operator.resyncSeconds=10", "--wait", "--timeout", "5m")
    try:
        run("kubectl", "create", "namespace", JOB_NS, check=False)
        run("kubectl", "-n", JOB_NS, "apply", "-f", "configs/job-kind-cpu.yaml")
        deadline = time.monotonic() + TIMEOUT
        phase = None
        while time.monotonic() < deadline:
            got = run("kubectl", "-n", JOB_NS, "get", "rmj", "tiny-cpu", "-o", "json", check=False)
            if got.returncode == 0:
                status = json.loads(got.stdout).get("status") or {}
                if status.get("phase") != phase:
                    phase = status.get("phase")
                    print(f"phase={phase} ready={status.get('readyRolloutReplicas')} {status.get('message')}",
                          flush=True)
                if phase == "Complete":
                    break
                if phase in ("Failed", "Invalid"):
                    pytest.fail(f"job ended {phase}: {status.get('message')}\n{_diagnostics()}")
            time.sleep(10)
        else:
            pytest.fail(f"job not Complete after {TIMEOUT:.0f}s (phase {phase})\n{_diagnostics()}")
        sts = json.loads(run("kubectl", "-n", JOB_NS, "get", "statefulset", "tiny-cpu-rollout",
                             "-o", "json").stdout)
        assert sts["spec"]["replicas"] == 0  # pool released after completion
    finally:
        run("kubectl", "-n", JOB_NS, "delete", "rmj", "tiny-cpu", "--wait=true", check=False)
        run("helm", "uninstall", "rmsft", "--namespace", OPERATOR_NS, check=False)
