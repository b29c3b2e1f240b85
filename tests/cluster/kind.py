"""Cluster backend: kind (Kubernetes in Docker), where its node image and the base images can be
pulled. The same tests as on the real node (tests/cluster/test_cluster.py) run on it; only bring-up,
image loading and the node's file system differ. RMSFT_KIND_CLUSTER names the cluster (default
rmsft-e2e; created if absent, deleted afterwards unless RMSFT_KIND_KEEP=1)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from host import HostGuard, run


class Kind:
    name = "kind"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cluster = os.environ.get("RMSFT_KIND_CLUSTER", "rmsft-e2e")
        self.created = False
        self._kubeconfig = workdir / "kind.kubeconfig"

    def why_not(self) -> str | None:
        if not shutil.which("kind"):
            return "`kind` is not installed"
        return None

    @property
    def kubeconfig(self) -> Path:
        return self._kubeconfig

    @property
    def node(self) -> str:
        return f"{self.cluster}-control-plane"

    def up(self, guard: HostGuard) -> None:
        if self.cluster not in run("kind", "get", "clusters").stdout.split():
            run("kind", "create", "cluster", "--name", self.cluster, "--wait", "120s", timeout=600)
            self.created = True
        guard.cleanups.append(self.down)
        self._kubeconfig.write_text(run("kind", "get", "kubeconfig", "--name", self.cluster).stdout)

    def load_image(self, tag: str, image_id: str) -> bool:
        run("kind", "load", "docker-image", tag, "--name", self.cluster, timeout=900)
        return True

    def node_exists(self, path: str) -> bool:
        return run("docker", "exec", self.node, "test", "-e", path, check=False).returncode == 0

    def node_holds_anything(self, path: str) -> bool:
        """`path` is there and not an empty directory."""
        empty = f'[ ! -e {path} ] || {{ [ -d {path} ] && [ -z "$(ls -A {path})" ]; }}'
        return run("docker", "exec", self.node, "sh", "-c", empty, check=False).returncode != 0

    def node_mkdir(self, path: str, uid: int = 1000) -> None:
        run("docker", "exec", self.node, "sh", "-c", f"mkdir -p {path} && chown {uid}:{uid} {path}")

    def node_rmtree(self, path: str) -> None:
        run("docker", "exec", self.node, "rm", "-rf", path, check=False)

    def down(self) -> None:
        if self.created and os.environ.get("RMSFT_KIND_KEEP") != "1":
            run("kind", "delete", "cluster", "--name", self.cluster, check=False, timeout=300)
            self.created = False
