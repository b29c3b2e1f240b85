"""The cluster tier: the CPU image built from this Dockerfile, a cluster (a real node on this machine,
or kind where its images can be pulled), `helm install` of the chart, then jobs applied with kubectl and
faults done to real pods (tests/cluster/test_cluster.py).

Backend: RMSFT_CLUSTER_BACKEND = realnode | kind | auto (default: the real node when it can run here,
else kind). The tier skips, with the reason, only where no Docker engine can be had (or neither
backend can run). Set up once per session; torn down after its last test, on failure too: pods,
node processes, mounts, iptables, the Docker engine it started. Bring-up times go to the terminal
summary (`cluster tier: ...`). RMSFT_CLUSTER_KEEP=1 keeps its folder (logs) in /tmp."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cluster import OPERATOR_NS, Cluster  # noqa: E402
from host import DockerEngine, HostGuard, run  # noqa: E402
from image import build_image  # noqa: E402
from kind import Kind  # noqa: E402
from realnode import REALNODE, RealNode  # noqa: E402
from tiers import unavailable  # noqa: E402

IMAGE = "rmsft:cpu"
TIMINGS: dict[str, float] = {}
_LAST_ITEM = pytest.StashKey[str]()
_TEARDOWN: list = []


def _ours(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(HERE)


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as each item is collected, before any pytest_collection_modifyitems: pytest's own `-m`
    # selection runs in that hook, so `-m cluster` / `-m "not cluster"` see these markers.
    if _ours(item):
        item.add_marker(pytest.mark.cluster)
        item.add_marker(pytest.mark.slow)
        # the first test also pays for the image build (cold: minutes) and the node's bring-up
        item.add_marker(pytest.mark.timeout(3600))


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection and any reordering: the order seen here is the run order
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _ours(item)]
    if ours:
        config.stash[_LAST_ITEM] = ours[-1].nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Tears the cluster down right after the tier's last test, not at the end of the session: the
    rest of the suite does not share 2 cores with an idle node, API server and Docker engine."""
    result = yield
    if item.config.stash.get(_LAST_ITEM, None) == item.nodeid:
        while _TEARDOWN:
            _TEARDOWN.pop()()
        # on this test's teardown report: the suite's clock (tests/suite_clock.py) prints them from the
        # process that reports, which under xdist is not this one
        item.user_properties.append(("tier timings", {"cluster": dict(TIMINGS)}))
    return result


def pytest_terminal_summary(terminalreporter) -> None:
    if TIMINGS:
        terminalreporter.write_line("cluster tier: " + ", ".join(f"{k} {v:.0f}s" for k, v in TIMINGS.items()))


def _backend(workdir: Path, kubectl: str):
    choice = os.environ.get("RMSFT_CLUSTER_BACKEND", "auto")
    real = RealNode(workdir, os.environ.get("KUBEBUILDER_ASSETS"), kubectl)
    kind = Kind(workdir)
    reasons = {}
    for backend in [real] if choice == "realnode" else [kind] if choice == "kind" else [real, kind]:
        why = backend.why_not()
        if why is None:
            return backend, None
        reasons[backend.name] = why
    return None, "; ".join(f"{k}: {v}" for k, v in reasons.items())


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    # From PATH, as the other tiers and the user take them (`make test` puts .tools/bin first on it).
    tools = {exe: shutil.which(exe) for exe in ("helm", "kubectl")}
    missing = [exe for exe, path in tools.items() if path is None]
    if missing:
        unavailable("cluster", f"{' and '.join(missing)} not on PATH: run `make setup` (it puts them in .tools/bin)")
    keep = os.environ.get("RMSFT_CLUSTER_KEEP") == "1"
    workdir = Path(tempfile.mkdtemp(prefix="rmsft-cluster-"))
    engine = DockerEngine(workdir)
    why = engine.why_not()
    if why:
        shutil.rmtree(workdir, ignore_errors=True)
        unavailable("cluster", f"no Docker engine: {why}")
    backend, why = _backend(workdir, str(tools["kubectl"]))
    if backend is None:
        shutil.rmtree(workdir, ignore_errors=True)
        unavailable("cluster", f"no cluster backend can run here: {why}")

    guard = HostGuard()  # before anything starts: restores iptables and links at the end
    done = False

    def teardown() -> None:
        nonlocal done
        if done:
            return
        done = True
        t0 = time.monotonic()
        guard.restore()
        TIMINGS["teardown"] = time.monotonic() - t0
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)

    atexit.register(teardown)
    _TEARDOWN.append(teardown)
    guard.cleanups.append(engine.stop)  # registered first: stopped last
    try:
        t0 = time.monotonic()
        engine.ensure()
        if backend.name == "realnode" and run("docker", "image", "inspect", "python:3.11-slim", check=False).returncode:
            # no registry here: the base image is the stand-in ../shared/realnode ships
            run("sh", "-c", f"xz -dc {REALNODE / 'images-base.tar.xz'} | docker load", timeout=300)
        TIMINGS["docker engine"] = time.monotonic() - t0
        image_id, TIMINGS["image build"] = build_image(IMAGE, "cpu", log=workdir / "docker-build.log")
        t0 = time.monotonic()
        backend.up(guard)
        TIMINGS[f"{backend.name} up"] = time.monotonic() - t0
        t0 = time.monotonic()
        imported = backend.load_image(IMAGE, image_id)
        TIMINGS["image load" if imported else "image load (cached)"] = time.monotonic() - t0
        c = Cluster(backend, backend.kubeconfig, {k: str(v) for k, v in tools.items()})
        t0 = time.monotonic()
        # The README's command, with the locally built image. rbac.clusterWide: the tests make a namespace of their
        # own per case (the default chart watches the release namespace and rbac.watchNamespaces only).
        c.helm(
            "upgrade",
            "--install",
            "rmsft",
            "charts/rmsft",
            "--namespace",
            OPERATOR_NS,
            "--create-namespace",
            "--set",
            "image.repository=rmsft",
            "--set",
            "image.tag=cpu",
            "--set",
            "image.pullPolicy=Never",
            "--set",
            "operator.resyncSeconds=10",
            "--set",
            "rbac.clusterWide=true",
            "--wait",
            "--timeout",
            "5m",
        )
        TIMINGS["helm install"] = time.monotonic() - t0
    except BaseException:
        teardown()
        raise
    yield c
    teardown()
