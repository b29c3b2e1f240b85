"""What the cluster tier does to a cluster, whatever its backend (the real node here, kind elsewhere):
kubectl and helm as a user runs them, waiting on jobs, reading logs, diagnostics for a failure."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import yaml

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NS = "rmsft-system"
T = TypeVar("T")


class FollowedLogs:
    def __init__(self, proc: subprocess.Popen[bytes], out: IO[bytes]) -> None:
        self.proc, self.out = proc, out

    def wait(self, timeout: float) -> str:
        """The log, once the container ended (the stream closes then); killed and failed at `timeout`."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.out.close()
            raise AssertionError(f"the followed container still ran after {timeout:.0f}s") from None
        with self.out:
            self.out.seek(0)
            return self.out.read().decode(errors="replace")


class Cluster:
    def __init__(self, backend: Any, kubeconfig: Path, tools: dict[str, str]) -> None:
        self.backend = backend
        self.kubeconfig = kubeconfig
        self.tools = tools  # exe -> its path (helm, kubectl)

    # ---- the user's commands --------------------------------------------------------------------

    def _run(
        self, exe: str, args: tuple[str, ...], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.tools[exe], "--kubeconfig", str(self.kubeconfig), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{exe} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run("kubectl", args, check, input, timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return self._run("helm", args, check, None, timeout)

    def get(self, *args: str) -> dict[str, Any] | None:
        proc = self.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def apply(self, doc: dict[str, Any] | list[dict[str, Any]], namespace: str | None = None) -> None:
        docs = doc if isinstance(doc, list) else [doc]
        self.kubectl(*(["-n", namespace] if namespace else []), "apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        got = self.get("pods", "-n", namespace, "-l", selector)
        return got["items"] if got else []

    def logs(self, namespace: str, target: str, *extra: str) -> str:
        return self.kubectl("-n", namespace, "logs", target, *extra, check=False, timeout=60).stdout

    def follow_logs(self, namespace: str, pod: str) -> FollowedLogs:
        """`kubectl logs -f` of a running pod, in the background: its whole log once its container ends, even when
        the pod is deleted then (an eviction)."""
        out = tempfile.TemporaryFile()  # noqa: SIM115 - FollowedLogs.wait closes it
        proc = subprocess.Popen(
            [self.tools["kubectl"], "--kubeconfig", str(self.kubeconfig), "-n", namespace, "logs", "-f", pod],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        return FollowedLogs(proc, out)

    # ---- waiting --------------------------------------------------------------------------------

    def wait(
        self, check: Callable[[], T], timeout: float, what: str, interval: float = 2.0, namespace: str | None = None
    ) -> T:
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting for {what}\n"
                    f"{self.diagnostics(namespace) if namespace else ''}"
                )
            time.sleep(interval)

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        return self.get("rmj", name, "-n", namespace) or {}

    def wait_phase(self, namespace: str, name: str, phases: set[str], timeout: float = 600) -> dict[str, Any]:
        """Wait until the job's status.phase is one of `phases`; Failed or Invalid (unless wanted)
        fail at once with the diagnostics."""

        def check() -> dict[str, Any] | None:
            status = self.job(namespace, name).get("status") or {}
            phase = status.get("phase")
            if phase in phases:
                return status
            if phase in ("Failed", "Invalid"):
                raise AssertionError(
                    f"job {namespace}/{name} ended {phase}: {status.get('message')}\n{self.diagnostics(namespace)}"
                )
            return None

        return self.wait(check, timeout, f"job {namespace}/{name} in {sorted(phases)}", namespace=namespace)

    def diagnostics(self, namespace: str) -> str:
        out = []
        for args in (
            ("-n", namespace, "describe", "rmj"),
            ("-n", namespace, "get", "pods,jobs,statefulsets,events", "-o", "wide"),
            ("-n", namespace, "logs", "-l", "app.kubernetes.io/component=learner", "--tail=60"),
            ("-n", namespace, "logs", "-l", "app.kubernetes.io/component=rollout", "--tail=30"),
            ("-n", OPERATOR_NS, "logs", "deploy/rmsft", "--tail=60"),
        ):
            p = self.kubectl(*args, check=False)
            out.append(f"$ kubectl {' '.join(args)}\n{p.stdout}{p.stderr}")
        return "\n".join(out)[-30000:]
