"""The envtest tier: tests against a real kube-apiserver/etcd/controller-manager/scheduler, found through
KUBEBUILDER_ASSETS (controller-runtime's convention; `make test` and .ci/run point it at .tools/envtest/bin, which
`make setup` unpacks from ../shared/envtest). Skipped with the reason when the binaries are not there (in CI a
failure: tests/tiers.py). One control plane for all of tests/envtest (about 7-10 s to start), stopped after its last
test. RMSFT_ENVTEST_KEEP=1 keeps its folder (logs) afterwards."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CRD_FILE = ROOT / "charts/rmsft/crds/rolloutmatchingjobs.yaml"
sys.path.insert(0, str(HERE))

from controlplane import ControlPlane, missing_binaries  # noqa: E402
from tiers import unavailable  # noqa: E402

_LAST_ITEM = pytest.StashKey[str]()
_RUNNING: list[ControlPlane] = []


def _ours(item: pytest.Item) -> bool:
    return Path(str(item.path)).resolve().is_relative_to(HERE)


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as each item is collected, before any pytest_collection_modifyitems: pytest's own `-m`
    # selection runs in that hook, so `-m envtest` / `-m "not envtest"` see this marker.
    if _ours(item):
        item.add_marker(pytest.mark.envtest)


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection and any reordering: the order seen here is the run order
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session: the last one under tests/envtest stops the control plane.
    ours = [item for item in items if _ours(item)]
    if ours:
        config.stash[_LAST_ITEM] = ours[-1].nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stops the control plane right after the last envtest test (its module fixtures are torn
    down by then) instead of at the end of the session: the rest of the suite (vLLM tests on 2
    cores) does not share the machine with an idle API server (~3% of a core, ~470 MiB)."""
    result = yield
    if item.config.stash.get(_LAST_ITEM, None) == item.nodeid:
        while _RUNNING:
            _RUNNING.pop().stop()
    return result


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver (RBAC, PodSecurity at its default) + kube-controller-manager (node
    lifecycle controller off) + kube-scheduler on loopback ports, as the admin by default."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    why = missing_binaries(assets)
    if why:
        unavailable("envtest", why)
    cp = ControlPlane(assets, keep_dir=bool(os.environ.get("RMSFT_ENVTEST_KEEP")))
    request.addfinalizer(cp.stop)  # registered before start: runs even if a test (or start) fails
    _RUNNING.append(cp)
    # The chart's CRD goes in before the controller-manager starts: its garbage collector then
    # knows RolloutMatchingJob at once (instead of after its ~30 s discovery resync).
    cp.start(crds=[yaml.safe_load(CRD_FILE.read_text())])
    print(f"\n[envtest] control plane up in {cp.startup_seconds:.1f}s at {cp.url} (logs: {cp.logs})")
    yield cp


@pytest.fixture(scope="session")
def rmj_crd(control_plane: ControlPlane) -> dict[str, Any]:
    """The chart's RolloutMatchingJob CRD, Established (the control plane created it at start;
    applied again here so that a CRD the server refuses fails the test with the server's message)."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    control_plane.apply_crd(crd)
    return crd


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (without waiting)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    control_plane.create_namespace(name)
    yield name
    control_plane.request("DELETE", f"/api/v1/namespaces/{name}")
