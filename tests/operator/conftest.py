from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kmock_cluster import KmockCluster  # noqa: E402

NAMESPACE = "rmsft-test"
# Short timings so the real kopf operator reacts within a second (defaults are minutes-scale).
FAST_ENV = {
    "RMSFT_OPERATOR_RESYNC_SECONDS": "1",
    "RMSFT_OPERATOR_RETRY_BACKOFF_SECONDS": "0.5",
    "RMSFT_OPERATOR_API_RETRIES": "3",
    "RMSFT_OPERATOR_API_BACKOFF_SECONDS": "0.05",
    # kmock never bumps resourceVersion, so kopf would wait the whole consistency timeout after
    # each of its own patches.
    "RMSFT_OPERATOR_CONSISTENCY_SECONDS": "0.2",
    "RMSFT_OPERATOR_WATCH_TIMEOUT_SECONDS": "60",
    # kmock cannot list cluster-scoped namespaces: watch the exact namespace instead of scanning.
    "RMSFT_OPERATOR_SCANNING": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, IndexError, AssertionError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[KmockCluster]:
    c = KmockCluster().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def operator_env(cluster: KmockCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config", NAMESPACE)
    env = {**FAST_ENV, "KUBECONFIG": str(kubeconfig), "RMSFT_OPERATOR_METRICS_PORT": str(free_port())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
