"""A real Kubernetes node on this machine (../shared/realnode/README.md has the facts behind each step):
the envtest control plane (tests/envtest/controlplane.py) bound for pods, plus containerd (CRI),
kubelet and kube-proxy v1.32 from ../shared/realnode, pods on a CNI bridge (10.244.0.0/24, no
masquerade: pods reach only this machine), and cluster DNS (dnsmasq fed by the reference
`dns-sync.py`). The API server listens on 0.0.0.0 and advertises 10.250.0.1 (an address on `lo`),
which pods reach directly and through the `kubernetes` Service.

The node's containerd keeps its image store in a folder that outlives the run
(`RMSFT_CLUSTER_STATE`, default /var/lib/rmsft-cluster), so an image already imported is not imported
again (docker save + ctr import of the 4 GB CPU image takes about 90 s). Everything else lives in a
temporary folder and is removed by `down()`, which also unmounts what kubelet and containerd mounted,
kills every shim, and (with host.HostGuard) restores iptables and links."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from host import HostGuard, run, spawn, stop_group, unmount_under

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "envtest"))
from controlplane import ControlPlane, free_port, missing_binaries  # noqa: E402

SHARED = Path(os.environ.get("RMSFT_SHARED", ROOT.parent / "shared"))
REALNODE = SHARED / "realnode"
NODE_NAME = "rmsft-node"
NODE_IP = "10.250.0.1"
POD_CIDR = "10.244.0.0/24"
BRIDGE = "rmsft-br0"
CNI_NETWORK = "rmsft-pods"
# Debian packages: containerd, runc, containernetworking-plugins, iptables, conntrack, dnsmasq-base
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "conntrack", "dnsmasq", "ip")
CNI_BIN = Path("/usr/lib/cni")


class NodeControlPlane(ControlPlane):
    """The envtest control plane as a real node needs it: the API reachable from pods, the
    `kubernetes` Service's endpoints kept by the API server, every controller running."""

    bind_address = "0.0.0.0"
    advertise_address = NODE_IP
    endpoint_reconciler = "lease"
    controllers = "*"
    extra_server_ips = (NODE_IP,)


class RealNode:
    """Cluster backend: a control plane and one real node on this machine."""

    name = "realnode"

    def __init__(self, workdir: Path, assets: str | None, kubectl: str) -> None:
        self.workdir = workdir
        self.assets = assets
        self.kubectl = kubectl
        self.state = Path(os.environ.get("RMSFT_CLUSTER_STATE", "/var/lib/rmsft-cluster"))
        self.node = workdir / "node"
        self.procs: dict[str, subprocess.Popen] = {}
        self.cp: NodeControlPlane | None = None
        self.guard: HostGuard | None = None
        self.bin = workdir / "bin"

    # ---- can it run here ------------------------------------------------------------------------

    def why_not(self) -> str | None:
        if os.geteuid() != 0:
            return "a real node needs root (kubelet, containerd, iptables)"
        why = missing_binaries(self.assets)
        if why:
            return why
        archives = sorted(REALNODE.glob("node-*.tar.xz"))
        if not archives or not (REALNODE / "images-base.tar.xz").exists():
            return f"{REALNODE} lacks node-*.tar.xz (kubelet, kube-proxy) or images-base.tar.xz"
        missing = [t for t in HOST_TOOLS if not shutil.which(t)]
        if missing or not (CNI_BIN / "bridge").exists():
            return (
                f"missing {', '.join(missing) or '/usr/lib/cni/bridge'}: apt-get install containerd runc "
                "containernetworking-plugins iptables conntrack dnsmasq-base (`make cluster-deps`)"
            )
        return None

    @property
    def kubeconfig(self) -> Path:
        assert self.cp is not None
        return self.cp.admin_kubeconfig

    # ---- bring-up -------------------------------------------------------------------------------

    def up(self, guard: HostGuard) -> None:
        self.guard = guard
        archive = sorted(REALNODE.glob("node-*.tar.xz"))[-1]
        self.bin.mkdir(parents=True, exist_ok=True)
        run("tar", "-xJf", str(archive), "-C", str(self.workdir))  # bin/kubelet, bin/kube-proxy
        guard.add_lo_address(f"{NODE_IP}/32")  # no dummy-interface module here: an address on lo
        self.cp = NodeControlPlane(self.assets)
        guard.cleanups.append(self.down)
        self.cp.start(timeout=120)
        self._iptables_forward()
        self._start_containerd()
        self._import_archive(REALNODE / "images-base.tar.xz", "base")  # the pause image
        self._start_kubelet_and_proxy()
        self._start_dns()
        self._wait_node_ready()

    def _iptables_forward(self) -> None:
        # Docker sets the FORWARD policy to DROP and bridged pod traffic passes iptables: let pod
        # traffic through both ways, else pods cannot reach each other (gRPC just times out).
        for flag in ("-s", "-d"):
            if run("iptables", "-C", "FORWARD", flag, "10.244.0.0/16", "-j", "ACCEPT", check=False).returncode:
                run("iptables", "-I", "FORWARD", "1", flag, "10.244.0.0/16", "-j", "ACCEPT")

    @property
    def sock(self) -> Path:
        return self.node / "containerd.sock"

    def _stop_stale_containerd(self) -> None:
        """A containerd left by a run that was killed (its pytest got SIGKILL, or an xdist worker was stopped)
        still holds the image store's lock in self.state: the new one would wait for it for ever. Such a one is
        a node containerd of this tier (its config in another rmsft-cluster-* folder) whose store is ours."""
        import psutil

        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmd = proc.info["cmdline"] or []
            if (
                len(cmd) == 3
                and Path(cmd[0]).name == "containerd"
                and cmd[1] == "--config"
                and "/rmsft-cluster-" in cmd[2]
                and not cmd[2].startswith(str(self.node))
            ):
                try:
                    stale = f'root = "{self.state / "containerd"}"' in Path(cmd[2]).read_text()
                except OSError:  # its folder is gone: judged by the name alone
                    stale = True
                if stale:
                    print(
                        f"realnode: stopping a containerd a killed run left (pid {proc.pid}, {cmd[2]})", file=sys.stderr
                    )
                    proc.kill()
                    psutil.wait_procs([proc], timeout=30)

    def _start_containerd(self) -> None:
        self._stop_stale_containerd()
        (self.node / "cni").mkdir(parents=True, exist_ok=True)
        self.state.mkdir(parents=True, exist_ok=True)
        config = self.node / "containerd.toml"
        config.write_text(f"""version = 2
root = "{self.state / "containerd"}"
state = "{self.node / "containerd-state"}"
[grpc]
  address = "{self.sock}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  # this machine refuses an oom_score_adj below its own (the sandbox pod asks for -998)
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{self.node / "cni"}"
""")
        (self.node / "cni" / "10-rmsft.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": CNI_NETWORK,
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_CIDR}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                }
            )
        )
        self.procs["containerd"] = spawn(["containerd", "--config", str(config)], self.node / "logs" / "containerd.log")
        self._wait(lambda: self.sock.exists(), 30, "containerd's socket", "containerd")
        self._remove_containers()  # a run that died may have left CRI containers in the kept store

    def ctr(
        self, *args: str, timeout: float = 600, check: bool = True, stdin: IO[bytes] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`ctr` against this node's containerd, namespace k8s.io; `stdin` feeds an image stream."""
        cmd = ["ctr", "--address", str(self.sock), "-n", "k8s.io", *args]
        proc = subprocess.run(cmd, stdin=stdin, capture_output=True, timeout=timeout)
        out = subprocess.CompletedProcess(
            cmd, proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
        )
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
        return out

    def _stamp(self, key: str) -> Path:
        return self.state / "imported" / key

    def _import_archive(self, archive: Path, key: str) -> None:
        stamp = self._stamp(key)
        digest = f"{archive.stat().st_size}-{archive.stat().st_mtime_ns}"
        if stamp.exists() and stamp.read_text() == digest and self._has_image("registry.k8s.io/pause:3.10"):
            return
        self._import(["xz", "-dc", str(archive)], timeout=600)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)

    def _import(self, producer: list[str], timeout: float) -> None:
        """`producer | ctr images import`, once more if containerd lost a layer's snapshot under it. A kept
        store holding an older build of the same tag meets a known containerd race (containerd#3787,
        #2382): the import moves the tag first, the old build's snapshots are then referenced by no image,
        and the garbage collector removes a shared parent while the new one is being unpacked on it
        ("parent snapshot ... does not exist: not found"). The second import finds that parent gone
        for good and unpacks it again."""
        for attempt in (1, 2):
            feed = subprocess.Popen(producer, stdout=subprocess.PIPE)
            assert feed.stdout is not None
            try:
                self.ctr("images", "import", "--all-platforms", "-", stdin=feed.stdout, timeout=timeout)
            except RuntimeError as err:
                feed.kill()
                feed.wait()
                if attempt == 2 or "snapshot" not in str(err) or "not found" not in str(err):
                    raise
                print(f"realnode: {err}; importing once more", file=sys.stderr)
                continue
            finally:
                feed.stdout.close()  # ours: a producer must not wait on a reader that is gone
            if feed.wait() != 0:
                raise RuntimeError(f"{' '.join(producer)} failed (exit {feed.returncode})")
            return

    def _has_image(self, ref: str) -> bool:
        names = self.ctr("images", "ls", "-q", check=False).stdout.split()
        return any(n in (ref, f"docker.io/library/{ref}") for n in names)

    def load_image(self, tag: str, image_id: str) -> bool:
        """Import a Docker image into the node's containerd, unless this very image (by ID) is there
        already. Returns whether it imported."""
        stamp = self._stamp(tag.replace("/", "_").replace(":", "_"))
        if stamp.exists() and stamp.read_text() == image_id and self._has_image(tag):
            return False
        self._import(["docker", "save", tag], timeout=900)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(image_id)
        return True

    def _start_kubelet_and_proxy(self) -> None:
        assert self.cp is not None
        kcfg = self.cp.admin_kubeconfig
        config = self.node / "kubelet.yaml"
        config.write_text(f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {self.cp.ca_file}}}
authorization: {{mode: Webhook}}
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{self.sock}
failSwapOn: false
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 0
serializeImagePulls: false
podCIDR: {POD_CIDR}
resolvConf: /etc/resolv.conf
clusterDNS: [{NODE_IP}]
clusterDomain: cluster.local
evictionHard: {{memory.available: "200Mi", nodefs.available: "1%", imagefs.available: "1%"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
enforceNodeAllocatable: []
""")
        self.procs["kubelet"] = spawn(
            [
                str(self.bin / "kubelet"),
                "--config",
                str(config),
                "--kubeconfig",
                str(kcfg),
                "--hostname-override",
                NODE_NAME,
                "--node-ip",
                NODE_IP,
                "--root-dir",
                str(self.node / "kubelet"),
                "--cert-dir",
                str(self.node / "kubelet-pki"),
                "-v=1",
            ],
            self.node / "logs" / "kubelet.log",
        )
        self.procs["kube-proxy"] = spawn(
            [
                str(self.bin / "kube-proxy"),
                "--kubeconfig",
                str(kcfg),
                "--hostname-override",
                NODE_NAME,
                "--cluster-cidr",
                "10.244.0.0/16",
                "--proxy-mode",
                "iptables",
                "--conntrack-max-per-core",
                "0",
                "--metrics-bind-address",
                f"127.0.0.1:{free_port()}",
                "--healthz-bind-address",
                f"127.0.0.1:{free_port()}",
                "-v=1",
            ],
            self.node / "logs" / "kube-proxy.log",
        )

    def _start_dns(self) -> None:
        """dnsmasq on NODE_IP:53 answers cluster names from a hosts file that dns-sync.py keeps
        current from the API; other cluster.local/svc names get NXDOMAIN (gRPC's resolver stops at a
        REFUSED answer while walking the search domains); no upstream: pods reach nothing outside."""
        assert self.cp is not None
        hosts = self.node / "dns-hosts"
        hosts.write_text("")
        names = ("kubernetes.default.svc.cluster.local", "kubernetes.default.svc", "kubernetes.default", "kubernetes")
        records = [f"--host-record={n},10.0.0.1" for n in names]
        self.procs["dnsmasq"] = spawn(
            [
                "dnsmasq",
                "--no-daemon",
                "--keep-in-foreground",
                f"--listen-address={NODE_IP}",
                "--bind-interfaces",
                "--port=53",
                "--no-resolv",
                "--no-hosts",
                "--local=/cluster.local/",
                "--local=/svc/",
                f"--addn-hosts={hosts}",
                *records,
            ],
            self.node / "logs" / "dnsmasq.log",
        )
        time.sleep(0.5)
        if self.procs["dnsmasq"].poll() is not None:
            raise RuntimeError(f"dnsmasq did not start: {(self.node / 'logs' / 'dnsmasq.log').read_text()[-1000:]}")
        self.procs["dns-sync"] = spawn(
            [
                sys.executable,
                str(REALNODE / "dns-sync.py"),
                self.kubectl,
                str(self.cp.admin_kubeconfig),
                str(hosts),
                str(self.procs["dnsmasq"].pid),
            ],
            self.node / "logs" / "dns-sync.log",
        )

    def _wait(self, ok, timeout: float, what: str, proc: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if proc and self.procs[proc].poll() is not None:
                raise RuntimeError(f"{proc} exited while waiting for {what}:\n{self.log_tail(proc)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n{self.log_tail(proc) if proc else ''}")
            time.sleep(0.5)

    def _wait_node_ready(self) -> None:
        assert self.cp is not None

        def ready() -> bool:
            node = self.cp.get(f"/api/v1/nodes/{NODE_NAME}")
            conds = {c["type"]: c["status"] for c in (node or {}).get("status", {}).get("conditions", [])}
            return conds.get("Ready") == "True"

        self._wait(ready, 120, f"node {NODE_NAME} Ready", "kubelet")
        self.check_alive()
        # kube-proxy has written the `kubernetes` Service's rules: pods can reach the API server
        self._wait(
            lambda: "KUBE-SVC" in (run("iptables-save", "-t", "nat", check=False).stdout or ""),
            60,
            "kube-proxy's Service rules",
            "kube-proxy",
        )

    def check_alive(self) -> None:
        """Every node process still runs (a dead kube-proxy or dnsmasq fails later in obscure ways)."""
        dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(
                "node processes exited: "
                + "; ".join(f"{name} ({code}):\n{self.log_tail(name)}" for name, code in dead.items())
            )

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.node / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # ---- the node's file system, as a test sees it ----------------------------------------------

    def node_exists(self, path: str) -> bool:
        return Path(path).exists()

    def node_holds_anything(self, path: str) -> bool:
        """`path` is there and not an empty directory."""
        p = Path(path)
        return p.exists() and (not p.is_dir() or any(p.iterdir()))

    def node_mkdir(self, path: str, uid: int = 1000) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        os.chown(path, uid, uid)

    def node_rmtree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    # ---- tear-down ------------------------------------------------------------------------------

    def _remove_containers(self) -> None:
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "-s", "KILL", task, check=False)
        time.sleep(0.5)
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "rm", "-f", task, check=False)
        containers = self.ctr("containers", "ls", "-q", check=False).stdout.split()
        if containers:
            self.ctr("containers", "rm", *containers, check=False)

    def down(self) -> None:
        """Stop everything this node started and remove what it left on the host (idempotent)."""
        for name in ("dns-sync", "dnsmasq", "kube-proxy", "kubelet"):
            if name in self.procs:
                stop_group(self.procs.pop(name))
        if "containerd" in self.procs:
            with contextlib.suppress(Exception):
                self._remove_containers()
            stop_group(self.procs.pop("containerd"))
        # shims that outlived containerd (their command line names this node's socket)
        subprocess.run(["pkill", "-KILL", "-f", f"containerd-shim-runc-v2 .*-address {self.sock}"], capture_output=True)
        if (self.bin / "kube-proxy").exists():  # kube-proxy's own rules (HostGuard restores the rest)
            subprocess.run([str(self.bin / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60)
        if self.cp is not None:
            self.cp.stop()
        unmount_under(self.node)
        unmount_under(self.state / "containerd")
        for ns in Path("/var/run/netns").glob("cni-*"):
            subprocess.run(["ip", "netns", "delete", ns.name], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        shutil.rmtree(f"/var/lib/cni/networks/{CNI_NETWORK}", ignore_errors=True)  # host-local IPAM leases
        shutil.rmtree(self.node, ignore_errors=True)
