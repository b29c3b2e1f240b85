"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver (RBAC, client-cert
and ServiceAccount-token auth, PodSecurity admission at its default), kube-controller-manager and
kube-scheduler, found like controller-runtime's envtest does: in the folder `KUBEBUILDER_ASSETS`
names (`make setup` unpacks ../shared/envtest into .tools/envtest/bin; `setup-envtest` gives the
same layout). There is no kubelet: `create_node` and `set_pod_phase` let a test act as one.

Every child runs in its own session (its own process group) and is killed with its group by
`stop()`, which the fixture calls from a finalizer, an `atexit` hook calls on interpreter exit, and
the kernel calls for us (PR_SET_PDEATHSIG -> SIGKILL) if the Python process dies without either.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from fake_kubelet import FakeKubelet

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.0.0.0/24"
T = TypeVar("T")


class ControlPlaneError(RuntimeError):
    """An API call failed (`ok`, `get`) or the control plane could not start."""


class ControlPlaneDied(ControlPlaneError):
    """A control-plane process exited: `wait_for` stops waiting at once (with its log tail)."""


def missing_binaries(assets: str | os.PathLike[str] | None) -> str | None:
    """Why the control plane cannot start from `assets` (None when it can)."""
    if not assets:
        return (
            "KUBEBUILDER_ASSETS is not set: run `make setup` (unpacks ../shared/envtest into "
            ".tools/envtest/bin) or setup-envtest, then export KUBEBUILDER_ASSETS"
        )
    missing = [b for b in BINARIES if not os.access(Path(assets) / b, os.X_OK)]
    if missing:
        return f"KUBEBUILDER_ASSETS={assets} lacks {', '.join(missing)}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# PKI: one CA signs the serving cert and every client cert; an RSA key pair signs SA tokens.


def _pem_key(key: Any) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: x509.Name,
    key: Any,
    issuer: x509.Name,
    issuer_key: Any,
    *,
    ca: bool = False,
    server_sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        usages = [x509.ExtendedKeyUsageOID.SERVER_AUTH] if server_sans else [x509.ExtendedKeyUsageOID.CLIENT_AUTH]
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_sans:
        b = b.add_extension(x509.SubjectAlternativeName(server_sans), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


# ---------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_DIR_PREFIX = "rmsft-envtest-"


def _sweep_orphaned_dirs() -> None:
    """Removes the temp folders of control planes whose Python process died without `stop()`
    (SIGTERM/SIGKILL: the kernel killed their children, see _die_with_parent, but not the files)."""
    for pid_file in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*/owner.pid"):
        try:
            pid = int(pid_file.read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(pid_file.parent, ignore_errors=True)
        except (OSError, ValueError):
            continue  # alive (or not ours to judge)


try:  # resolved here, in the parent: the child between fork and exec should do as little as possible
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs the child when the thread that started it dies, so a
    killed pytest leaves no control plane behind. (Start the control plane from a thread that
    lives as long as it should, e.g. the main thread, as the session fixture does.)"""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ControlPlane(FakeKubelet):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler as subprocesses.

    `start()` returns once `/readyz` answers 200 and the `default` ServiceAccount exists in the
    `default` namespace (i.e. the controller-manager runs). `stop()` is idempotent.

    The class attributes below are what a control plane for a real kubelet changes
    (tests/cluster/realnode.py): where the API server listens and what it advertises to pods, the
    controllers that run, and the API server's client identity towards kubelets.
    """

    bind_address = "127.0.0.1"
    advertise_address = "127.0.0.1"
    # No lease loop for the `kubernetes` Service's endpoints on loopback.
    endpoint_reconciler = "none"
    # Everything on by default, minus the node lifecycle controller: it would taint (and after
    # 5 min evict from) any fake Node whose heartbeats stop, and a test is a poor kubelet
    # (paused in a debugger, a slow assertion...). With it off a Node stays as the test
    # made it (Ready, no taints: create_node lifts the not-ready taint every new Node gets),
    # deterministically, without a heartbeat thread renewing Leases in kube-node-lease.
    controllers = "*,-node-lifecycle-controller"
    extra_server_ips: tuple[str, ...] = ()

    def __init__(self, assets: str | os.PathLike[str], *, keep_dir: bool = False) -> None:
        why = missing_binaries(assets)
        if why:
            raise ControlPlaneError(why)
        self.assets = Path(assets).resolve()  # the children run in self.dir
        self.keep_dir = keep_dir
        _sweep_orphaned_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX))
        if not keep_dir:  # kept folders (for reading logs later) are never swept
            (self.dir / "owner.pid").write_text(str(os.getpid()))
        self.logs = self.dir / "logs"
        self.logs.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.startup_seconds: float | None = None
        self.crd_errors: dict[str, str] = {}
        self._stopped = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 90, crds: Sequence[dict[str, Any]] = ()) -> ControlPlane:
        """Starts everything. `crds` are created (and Established, and served by discovery) before
        the controller-manager starts, so its garbage collector knows their kinds from its first
        discovery instead of its ~30 s resync; one the server refuses is recorded in
        `crd_errors` (name -> message) and skipped, so the tests that need it fail with that
        message rather than the whole tier failing to start."""
        t0 = time.monotonic()
        atexit.register(self.stop)
        try:
            self._write_pki()
            self._start_etcd()
            self._start_apiserver()
            self.wait_for(lambda: self._readyz(), timeout, "kube-apiserver /readyz")
            for crd in crds:
                try:
                    self.apply_crd(crd)
                except (ControlPlaneError, TimeoutError) as e:
                    self.crd_errors[crd["metadata"]["name"]] = str(e)
            self._start_controller_manager()
            self._start_scheduler()
            self.wait_for(
                lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
                timeout,
                "the default ServiceAccount (kube-controller-manager running)",
            )
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        # Reverse start order, one at a time: the API server's clients first, etcd last (an API
        # server whose etcd went away first spends its whole grace period retrying).
        for _, p in list(self.procs.items())[::-1]:
            self._signal(p, signal.SIGTERM)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
            self._signal(p, signal.SIGKILL)  # anything the binary left in its process group
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)  # start_new_session: the group id is the child's pid

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        try:
            self.procs[name] = subprocess.Popen(
                [str(self.assets / name), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.dir,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise ControlPlaneDied(f"{name} exited with {p.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ---- processes ---------------------------------------------------------------------------

    def _write_pki(self) -> None:
        pki = self.dir / "pki"
        pki.mkdir()
        self.pki = pki
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name("rmsft-envtest-ca")
        ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
        self.ca_file = pki / "ca.crt"
        self.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

        service_ip = next(ipaddress.ip_network(SERVICE_CIDR).hosts())
        sans: list[x509.GeneralName] = [
            x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *self.extra_server_ips)
        ]
        sans += [x509.IPAddress(service_ip), x509.DNSName("localhost")]
        sans += [
            x509.DNSName(n)
            for n in (
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            )
        ]
        srv_key = ec.generate_private_key(ec.SECP256R1())
        srv = _cert(_name("kube-apiserver"), srv_key, ca_name, ca_key, server_sans=sans)
        (pki / "apiserver.crt").write_bytes(srv.public_bytes(serialization.Encoding.PEM))
        (pki / "apiserver.key").write_bytes(_pem_key(srv_key))

        # ServiceAccount token signing key (RSA: what every SA-token consumer supports).
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (pki / "sa.key").write_bytes(_pem_key(sa_key))
        (pki / "sa.pub").write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

        # Client certs: the admin (system:masters) and the two components under their bootstrap
        # RBAC identities, so RBAC is exercised for them as in a real cluster.
        # The API server's own client identity towards kubelets (logs, exec, port-forward).
        for user, org in (
            ("admin", "system:masters"),
            ("system:kube-controller-manager", None),
            ("system:kube-scheduler", None),
            ("kube-apiserver-kubelet-client", "system:masters"),
        ):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _cert(_name(user, org), key, ca_name, ca_key)
            base = user.split(":")[-1]
            (pki / f"{base}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            (pki / f"{base}.key").write_bytes(_pem_key(key))
            self._write_cert_kubeconfig(self.dir / f"{base}.kubeconfig", pki / f"{base}.crt", pki / f"{base}.key")
        self.admin_kubeconfig = self.dir / "admin.kubeconfig"
        self._admin_ctx = ssl.create_default_context(cafile=str(self.ca_file))
        self._admin_ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self._token_ctx = ssl.create_default_context(cafile=str(self.ca_file))

    def _write_cert_kubeconfig(self, path: Path, cert: Path, key: Path) -> None:
        self._write_kubeconfig_doc(path, {"client-certificate": str(cert), "client-key": str(key)}, "default")

    def _write_kubeconfig_doc(self, path: Path, user: dict[str, str], namespace: str) -> Path:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "envtest",
            "preferences": {},
            "clusters": [
                {"name": "envtest", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}
            ],
            "users": [{"name": "envtest-user", "user": user}],
            "contexts": [
                {"name": "envtest", "context": {"cluster": "envtest", "user": "envtest-user", "namespace": namespace}}
            ],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        return path

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                "--name=envtest",
                f"--data-dir={self.dir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=envtest=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
            ],
        )

    def _start_apiserver(self) -> None:
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={self.etcd_url}",
                f"--bind-address={self.bind_address}",
                f"--advertise-address={self.advertise_address}",
                f"--secure-port={self.port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--cert-dir={pki}",
                f"--client-ca-file={self.ca_file}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--endpoint-reconciler-type={self.endpoint_reconciler}",
                "--allow-privileged=true",
                f"--kubelet-client-certificate={pki / 'kube-apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kube-apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",
            ],
        )

    def _start_controller_manager(self) -> None:
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.dir / 'kube-controller-manager.kubeconfig'}",
                f"--authentication-kubeconfig={self.dir / 'kube-controller-manager.kubeconfig'}",
                f"--authorization-kubeconfig={self.dir / 'kube-controller-manager.kubeconfig'}",
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                f"--controllers={self.controllers}",
                "--secure-port=0",  # no health/metrics server: nothing to collide with in parallel runs
                "--v=2",  # the log then shows the GC's discovery resyncs and what it deletes
            ],
        )

    def _start_scheduler(self) -> None:
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={self.dir / 'kube-scheduler.kubeconfig'}",
                f"--authentication-kubeconfig={self.dir / 'kube-scheduler.kubeconfig'}",
                f"--authorization-kubeconfig={self.dir / 'kube-scheduler.kubeconfig'}",
                "--leader-elect=false",
                "--secure-port=0",
            ],
        )

    def _readyz(self) -> bool:
        self._check_alive()
        try:
            status, _ = self.request("GET", "/readyz")
        except (OSError, ssl.SSLError):
            return False
        return status == 200

    # ---- API access --------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str | None = None,
        token: str | None = None,
        timeout: float = 30,
    ) -> tuple[int, Any]:
        """One API call. As the admin (client cert, system:masters) unless `token` is given (then
        as that bearer token and with no client cert). Returns (HTTP status, decoded JSON body, or
        the text when it is not JSON)."""
        data = None
        headers = {"Accept": "application/json"}
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = content_type or (
                "application/merge-patch+json" if method.upper() == "PATCH" else "application/json"
            )
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url + path, data=data, method=method.upper(), headers=headers)
        ctx = self._token_ctx if token else self._admin_ctx
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def ok(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> Any:
        """`request` as the admin that raises unless the status is 2xx; returns the body."""
        status, out = self.request(method, path, body, content_type)
        if not 200 <= status < 300:
            raise ControlPlaneError(f"{method} {path} -> {status}: {out}")
        return out

    def get(self, path: str) -> Any | None:
        """The object at `path`, or None on 404."""
        status, out = self.request("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise ControlPlaneError(f"GET {path} -> {status}: {out}")
        return out

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict:
        status, out = self.request(
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}},
        )
        if status == 409:
            return self.ok("GET", f"/api/v1/namespaces/{name}")
        if status != 201:
            raise ControlPlaneError(f"create namespace {name} -> {status}: {out}")
        return out

    def apply_crd(self, crd: dict, timeout: float = 30) -> dict:
        """Creates (or replaces) a CustomResourceDefinition; returns once it is Established and
        discovery serves each of its versions."""
        name = crd["metadata"]["name"]
        base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        status, out = self.request("POST", base, crd)
        if status == 409:
            current = self.ok("GET", f"{base}/{name}")
            body = {**crd, "metadata": {**crd["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
            out = self.ok("PUT", f"{base}/{name}", body)
        elif status != 201:
            raise ControlPlaneError(f"create CRD {name} -> {status}: {out}")
        self.wait_for(lambda: self.crd_established(name), timeout, f"CRD {name} Established")
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        for version in (v["name"] for v in crd["spec"]["versions"] if v.get("served", True)):
            self.wait_for(
                lambda v=version: any(
                    r["name"] == plural for r in (self.get(f"/apis/{group}/{v}") or {}).get("resources", [])
                ),
                timeout,
                f"{plural}.{group}/{version} in discovery",
            )
        return out

    def crd_established(self, name: str) -> bool:
        crd = self.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conds = (crd or {}).get("status", {}).get("conditions", [])
        return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

    def token_for(self, namespace: str, serviceaccount: str, seconds: int = 3600) -> str:
        """A bound ServiceAccount token from the TokenRequest API."""
        out = self.ok(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{serviceaccount}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": seconds}},
        )
        return out["status"]["token"]

    def write_kubeconfig(
        self, path: str | os.PathLike[str], token: str | None = None, namespace: str = "default"
    ) -> Path:
        """A kubeconfig for a bearer-token user (e.g. from `token_for`), or for the admin when
        `token` is None; `namespace` is the context's default namespace."""
        if token is None:
            user = {"client-certificate": str(self.pki / "admin.crt"), "client-key": str(self.pki / "admin.key")}
        else:
            user = {"token": token}
        return self._write_kubeconfig_doc(Path(path), user, namespace)

    def kubectl(
        self,
        *args: str,
        kubeconfig: str | os.PathLike[str] | None = None,
        check: bool = True,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl (PATH, else .tools/bin) against this control plane (admin by default)."""
        root = Path(__file__).resolve().parents[2]
        exe = shutil.which("kubectl") or str(root / ".tools/bin/kubectl")
        proc = subprocess.run(
            [exe, f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)} -> {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    # ---- waiting -----------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
        """Polls `predicate` until it returns something truthy (returned). Exceptions it raises
        count as "not yet" (the last one is shown on timeout); raises TimeoutError naming `what`,
        or ControlPlaneDied at once if a control-plane process exited."""
        deadline = time.monotonic() + timeout
        last_exc: BaseException | None = None
        while True:
            self._check_alive()
            try:
                value = predicate()
                if value:
                    return value
            except ControlPlaneDied:
                raise
            except Exception as e:  # e.g. a 404 from `ok` while the object is not there yet
                last_exc = e
            if time.monotonic() >= deadline:
                extra = f" (last error: {last_exc!r})" if last_exc else ""
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
            time.sleep(interval)

    def wait_for_gc_ready(
        self,
        api_version: str,
        plural: str,
        kind: str,
        body: dict[str, Any] | None = None,
        namespace: str = "default",
        timeout: float = 90,
    ) -> float:
        """Waits until the controller-manager's garbage collector watches custom resources of
        `api_version` `kind` (a controller-manager that started before the CRD existed learns the
        kind on its ~30 s discovery resync). Returns the seconds it took.

        Proven, not guessed: each round creates a throwaway CR (`body` holds what makes it valid,
        e.g. {"spec": ...}) in `namespace` that owns a ConfigMap, deletes the CR with
        propagationPolicy=Foreground and waits a few seconds for both to be gone. Only the GC
        removes the `foregroundDeletion` finalizer, and only after its informer for that kind saw
        the deletion, so success means the GC's monitor for the kind runs (a plain background
        delete can succeed earlier, through the GC's REST mapper alone, while a CR deleted in that
        window still waits on the GC's retry backoff). Each round uses fresh objects; unfinished
        probes are finished by the GC once it knows the kind, and waited for at the end.
        Call it before an operator watches `namespace` (it would react to the probes), or pick a
        namespace it does not watch."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        base = f"/apis/{api_version}/namespaces/{namespace}/{plural}"
        cms = f"/api/v1/namespaces/{namespace}/configmaps"
        probes: list[str] = []
        while True:
            probe = f"gc-probe-{uuid.uuid4().hex[:8]}"
            probes.append(probe)
            owner = self.ok(
                "POST", base, {**(body or {}), "apiVersion": api_version, "kind": kind, "metadata": {"name": probe}}
            )
            ref = {
                "apiVersion": api_version,
                "kind": kind,
                "name": probe,
                "uid": owner["metadata"]["uid"],
                "blockOwnerDeletion": True,
            }
            self.ok(
                "POST",
                cms,
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": probe, "ownerReferences": [ref]}},
            )
            self.request("PATCH", f"{base}/{probe}", {"metadata": {"finalizers": None}})  # e.g. an operator's
            self.ok(
                "DELETE",
                f"{base}/{probe}",
                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Foreground"},
            )
            round_end = time.monotonic() + min(5.0, max(0.5, deadline - time.monotonic()))
            while time.monotonic() < round_end:
                if self.get(f"{base}/{probe}") is None and self.get(f"{cms}/{probe}") is None:
                    took = time.monotonic() - t0
                    self.wait_for(
                        lambda: all(self.get(f"{base}/{p}") is None for p in probes),
                        max(10.0, deadline - time.monotonic()),
                        "the GC to finish earlier probes",
                    )
                    return took
                time.sleep(0.2)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the garbage collector did not learn {kind} ({api_version}) in {timeout:.0f}s:\n"
                    f"{self.log_tail('kube-controller-manager')}"
                )
