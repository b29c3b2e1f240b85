"""Operator latency: time from RolloutMatchingJob creation to all six children present, for 1 job
and for N jobs created at once, with the real kopf operator (in-process, KopfRunner) against
kmock, the Kubernetes API emulator on a real HTTP port (the API these tests run with).

    python benchmarks/operator.py            # 1 job, then 20 at once
    python benchmarks/operator.py --many 50

kmock answers each request in ~10 ms on a 2-core machine, far slower than an API server, so the
absolute numbers are an upper bound; the ratio N-jobs/1-job shows how reconciles overlap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/operator"))

from kmock_cluster import KmockCluster  # noqa: E402

NS = "bench"
CR_PATH = f"/apis/rmsft.io/v1alpha1/namespaces/{NS}/rolloutmatchingjobs"
CHILDREN = [("/api/v1", "secrets"), ("/api/v1", "configmaps"), ("/api/v1", "services"),
            ("/apis/networking.k8s.io/v1", "networkpolicies"), ("/apis/apps/v1", "statefulsets"),
            ("/apis/batch/v1", "jobs")]


def manifest(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1,
                       "resourceVersion": "1"}
    return doc


def children_by_job(cluster: KmockCluster) -> dict[str, int]:
    counts: dict[str, int] = {}
    for prefix, plural in CHILDREN:
        for obj in cluster.items(prefix, NS, plural):
            job = (obj["metadata"].get("labels") or {}).get("rmsft.io/job")
            if job:
                counts[job] = counts.get(job, 0) + 1
    return counts


def measure(cluster: KmockCluster, names: list[str], timeout: float) -> tuple[float, list[float]]:
    """Create all jobs concurrently; return (wall time until the last is complete, per-job latencies)."""
    created: dict[str, float] = {}

    def create(name: str) -> None:
        created[name] = time.perf_counter()
        status, body = cluster.request("POST", CR_PATH, manifest(name))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--many", type=int, default=20, help="jobs created at once in the second round")
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()

    cluster = KmockCluster().start()
    cluster.create_namespace(NS)
    kubeconfig = cluster.write_kubeconfig(Path(tempfile.mkdtemp()) / "config", NS)
    os.environ.update({
        "KUBECONFIG": str(kubeconfig), "RMSFT_OPERATOR_SCANNING": "false",
        "RMSFT_OPERATOR_RESYNC_SECONDS": "30", "RMSFT_OPERATOR_CONSISTENCY_SECONDS": "0.2",
        "RMSFT_OPERATOR_METRICS_PORT": "0", "RMSFT_OPERATOR_API_BACKOFF_SECONDS": "0.05",
    })
    import logging

    from kopf.testing import KopfRunner

    logging.disable(logging.INFO)
    cmd = ["run", "--standalone", "--namespace", NS, "-m", "rmsft_operator.handlers"]
    lines: list[str] = []  # KopfRunner captures stdout inside the block: print afterwards
    print(f"starting the operator; 1 job, then {args.many} at once ...", file=sys.stderr, flush=True)
    with KopfRunner(cmd, timeout=60) as runner:
        deadline = time.monotonic() + 30
        while ("watch", "rmsft.io", "rolloutmatchingjobs") not in cluster.emulator.operator_access:
            if time.monotonic() > deadline:
                raise SystemExit("operator did not start watching")
            time.sleep(0.05)
        t = time.perf_counter()
        for _ in range(20):
            cluster.request("GET", f"/apis/apps/v1/namespaces/{NS}/statefulsets")
        api_ms = (time.perf_counter() - t) / 20 * 1000
        lines.append(f"API round trip (kmock list): {api_ms:.1f} ms")

        one_wall, one = measure(cluster, ["single-0"], args.timeout)
        lines.append(f"1 job: all children after {one[0]:.2f} s")
        many_names = [f"many-{i:02d}" for i in range(args.many)]
        many_wall, many = measure(cluster, many_names, args.timeout)
        p50 = statistics.median(many)
        lines.append(f"{args.many} jobs at once: all done after {many_wall:.2f} s; per job p50 {p50:.2f} s, "
                     f"max {max(many):.2f} s, min {min(many):.2f} s")
        lines.append(f"ratio: {args.many} jobs wall / 1 job = {many_wall / one_wall:.2f} "
                     f"(serial would be ~{args.many}); throughput {args.many / many_wall:.2f} jobs/s")
    print("\n".join(lines))
    if runner.exception is not None:
        raise SystemExit(f"operator crashed: {runner.exception!r}")
    cluster.stop()
    print(f"RESULT api_ms={api_ms:.1f} one_job_s={one[0]:.3f} jobs={args.many} many_wall_s={many_wall:.3f} "
          f"many_p50_s={p50:.3f} many_max_s={max(many):.3f} ratio={many_wall / one_wall:.2f} "
          f"jobs_per_s={args.many / many_wall:.2f}")


if __name__ == "__main__":
    main()
