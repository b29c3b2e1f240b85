"""Operator latency: time from RolloutMatchingJob creation to all six children present, with the
real kopf operator (in-process, KopfRunner), measured in one run against two APIs:

- a real Kubernetes v1.32 control plane (kube-apiserver + etcd + controller-manager + scheduler
  from KUBEBUILDER_ASSETS, as the envtest test tier starts it): 10 jobs applied one after another
  (median), then N at once;
- kmock, the Kubernetes API emulator the kmock test tier uses: 1 job, then N at once.

    python benchmarks/operator.py            # N = 20
    python benchmarks/operator.py --many 50
    python benchmarks/operator.py --no-real  # kmock only (no KUBEBUILDER_ASSETS)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/operator"))
sys.path.insert(0, str(ROOT / "tests/envtest"))

from kmock_cluster import KmockCluster  # noqa: E402

NS = "bench"
CR_PATH = f"/apis/rmsft.io/v1alpha1/namespaces/{NS}/rolloutmatchingjobs"
CHILDREN = [
    ("/api/v1", "secrets"),
    ("/api/v1", "configmaps"),
    ("/api/v1", "services"),
    ("/apis/networking.k8s.io/v1", "networkpolicies"),
    ("/apis/apps/v1", "statefulsets"),
    ("/apis/batch/v1", "jobs"),
]


def manifest(name: str, real: bool = False) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    if not real:  # kmock fills in nothing a real API server would
        doc["metadata"].update({"uid": f"uid-{name}", "generation": 1, "resourceVersion": "1"})
    return doc


class RealApi:
    """The two calls `measure` needs, on the envtest ControlPlane (as the admin)."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return self.cp.request(method, path, body)

    def items(self, prefix: str, namespace: str, plural: str) -> list[dict[str, Any]]:
        return self.cp.ok("GET", f"{prefix}/namespaces/{namespace}/{plural}")["items"]


def children_by_job(cluster: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for prefix, plural in CHILDREN:
        for obj in cluster.items(prefix, NS, plural):
            job = (obj["metadata"].get("labels") or {}).get("rmsft.io/job")
            if job:
                counts[job] = counts.get(job, 0) + 1
    return counts


def measure(cluster: Any, names: list[str], timeout: float, real: bool = False) -> tuple[float, list[float]]:
    """Create all jobs concurrently; return (wall time until the last is complete, per-job latencies)."""
    created: dict[str, float] = {}

    def create(name: str) -> None:
        created[name] = time.perf_counter()
        status, body = cluster.request("POST", CR_PATH, manifest(name, real))
        assert status in (200, 201), body

    t0 = time.perf_counter()
    threads = [threading.Thread(target=create, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done: dict[str, float] = {}
    while len(done) < len(names):
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"timed out: {len(done)}/{len(names)} jobs have all children")
        counts = children_by_job(cluster)
        now = time.perf_counter()
        for n in names:
            if n not in done and counts.get(n, 0) == len(CHILDREN):
                done[n] = now - created[n]
        time.sleep(0.05)
    return time.perf_counter() - t0, [done[n] for n in names]


def round_trip_ms(cluster: Any) -> float:
    t = time.perf_counter()
    for _ in range(20):
        cluster.request("GET", f"/apis/apps/v1/namespaces/{NS}/statefulsets")
    return (time.perf_counter() - t) / 20 * 1000


def run_operator(until_watching: Any) -> Any:
    """The operator in this process; a fresh API client each time (the handlers cache one)."""
    from kopf.testing import KopfRunner
    from rmsft_operator import handlers

    handlers._state["kube"] = None
    cmd = ["run", "--standalone", "--namespace", NS, "-m", "rmsft_operator.handlers"]
    runner = KopfRunner(cmd, timeout=60)
    runner.__enter__()
    deadline = time.monotonic() + 30
    while not until_watching():
        if time.monotonic() > deadline:
            raise SystemExit("operator did not start watching")
        time.sleep(0.05)
    return runner


def bench_real(many: int, timeout: float, lines: list[str]) -> dict[str, float]:
    from controlplane import ControlPlane, missing_binaries

    assets = os.environ.get("KUBEBUILDER_ASSETS")
    why = missing_binaries(assets)
    if why:
        lines.append(f"real API server: skipped ({why})")
        return {}
    cp = ControlPlane(assets).start()
    try:
        cp.apply_crd(yaml.safe_load((ROOT / "charts/rmsft/crds/rolloutmatchingjobs.yaml").read_text()))
        cp.create_namespace(NS)
        os.environ["KUBECONFIG"] = str(cp.admin_kubeconfig)
        os.environ["RMSFT_OPERATOR_SCANNING"] = "true"
        api = RealApi(cp)
        # the first job doubles as the "is it watching" probe: wait for its children
        runner = run_operator(lambda: True)
        try:
            measure(api, ["warmup"], timeout, real=True)
            api_ms = round_trip_ms(api)
            singles = [measure(api, [f"single-{i}"], timeout, real=True)[1][0] for i in range(10)]
            many_wall, many_lat = measure(api, [f"many-{i:02d}" for i in range(many)], timeout, real=True)
        finally:
            runner.__exit__(None, None, None)
    finally:
        cp.stop()
    med = statistics.median(singles)
    lines.append(
        f"real API server: round trip {api_ms:.1f} ms; 1 job, median of 10: {med:.3f} s "
        f"(min {min(singles):.3f}, max {max(singles):.3f}); {many} at once: all done after "
        f"{many_wall:.2f} s, p50 {statistics.median(many_lat):.2f} s"
    )
    return {
        "real_api_ms": api_ms,
        "real_one_job_median_s": med,
        "real_one_job_max_s": max(singles),
        "real_many_wall_s": many_wall,
        "real_many_p50_s": statistics.median(many_lat),
    }


def bench_kmock(many: int, timeout: float, lines: list[str]) -> dict[str, float]:
    cluster = KmockCluster().start()
    cluster.create_namespace(NS)
    kubeconfig = cluster.write_kubeconfig(Path(tempfile.mkdtemp()) / "config", NS)
    # kmock never bumps resourceVersion (kopf would wait out its consistency timeout) and cannot
    # list cluster-scoped namespaces (no scanning).
    os.environ.update(
        {"KUBECONFIG": str(kubeconfig), "RMSFT_OPERATOR_SCANNING": "false", "RMSFT_OPERATOR_CONSISTENCY_SECONDS": "0.2"}
    )
    runner = run_operator(lambda: ("watch", "rmsft.io", "rolloutmatchingjobs") in cluster.emulator.operator_access)
    try:
        api_ms = round_trip_ms(cluster)
        _, one = measure(cluster, ["single-0"], timeout)
        many_wall, lat = measure(cluster, [f"many-{i:02d}" for i in range(many)], timeout)
    finally:
        runner.__exit__(None, None, None)
        cluster.stop()
    if runner.exception is not None:
        raise SystemExit(f"operator crashed: {runner.exception!r}")
    p50 = statistics.median(lat)
    lines.append(
        f"kmock: round trip {api_ms:.1f} ms; 1 job: all children after {one[0]:.2f} s; {many} at once: "
        f"all done after {many_wall:.2f} s, per job p50 {p50:.2f} s, max {max(lat):.2f} s"
    )
    return {
        "api_ms": api_ms,
        "one_job_s": one[0],
        "many_wall_s": many_wall,
        "many_p50_s": p50,
        "many_max_s": max(lat),
        "ratio": many_wall / one[0],
        "jobs_per_s": many / many_wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--many", type=int, default=20, help="jobs created at once in the second round")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--no-real", action="store_true", help="skip the real API server (kmock only)")
    p.add_argument("--api", choices=["real", "kmock"], help=argparse.SUPPRESS)  # one round (a child process)
    args = p.parse_args()

    if args.api is None:
        # Each round in its own process: kopf and the API client keep process-wide state.
        results: dict[str, str] = {}
        for api in ([] if args.no_real else ["real"]) + ["kmock"]:
            print(f"{api}: running ...", file=sys.stderr, flush=True)
            proc = subprocess.run(
                [sys.executable, __file__, "--api", api, "--many", str(args.many), "--timeout", str(args.timeout)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise SystemExit(f"{api} round failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            for line in proc.stdout.splitlines():
                if line.startswith("PART "):
                    results.update(kv.split("=", 1) for kv in line.split()[1:])
                else:
                    print(line)
        print("RESULT " + " ".join(f"{k}={v}" for k, v in results.items()) + f" jobs={args.many}")
        return

    import logging

    logging.disable(logging.INFO)
    os.environ.update(
        {
            "RMSFT_OPERATOR_RESYNC_SECONDS": "30",
            "RMSFT_OPERATOR_METRICS_PORT": "0",
            "RMSFT_OPERATOR_API_BACKOFF_SECONDS": "0.05",
            "RMSFT_OPERATOR_PROGRESS_TIMEOUT_SECONDS": "0",
        }
    )
    lines: list[str] = []  # KopfRunner captures stdout inside its block: print afterwards
    if args.api == "real":
        part = bench_real(args.many, args.timeout, lines)
    else:
        part = {f"kmock_{k}": v for k, v in bench_kmock(args.many, args.timeout, lines).items()}
    print("\n".join(lines))
    print("PART " + " ".join(f"{k}={v:.3f}" for k, v in part.items()))


if __name__ == "__main__":
    main()
