from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kmock_cluster import FAST_ENV, NAMESPACE, KmockCluster, free_port


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
