"""spec.rollout.tls end to end on loopback, as the operator wires it (HF backend: starts in seconds, no vLLM): a real
`rmsft serve` with the Secret's tls.crt/tls.key and RMSFT_HEALTH_PORT, the learner's pool trusting what
`learner.train.server_setup.tls_roots_from_env` reads from the Secret's folder, and the kubelet's plaintext gRPC
probe on the health-only port."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rollout_svc_helpers import generate, prompt_ids

from learner.rollouts.pool import ServerPool
from learner.train.server_setup import TLS_DIR_ENV, server_pool, tls_roots_from_env
from rmsft.jobspec import load_job
from rollout_svc.launcher import RolloutServer, free_port
from rollout_svc.server import HEALTH_PORT_ENV

ROOT = Path(__file__).resolve().parents[2]

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    cn: str, key, issuer_key=None, issuer: x509.Name | None = None, *, ca: bool = False, dns: tuple[str, ...] = ()
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _secret_dir(tmp_path: Path, name: str, files: dict[str, bytes]) -> Path:
    """What the kubelet mounts for a kubernetes.io/tls Secret: tls.crt, tls.key (and ca.crt when the issuer gave
    one)."""
    folder = tmp_path / name
    folder.mkdir()
    for file, data in files.items():
        (folder / file).write_bytes(data)
    return folder


def _health(address: str, channel: grpc.Channel | None = None) -> str:
    ch = channel or grpc.insecure_channel(address)
    with ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _wait_serving(srv: RolloutServer, health_address: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log_tail()
        try:
            if _health(health_address) == "SERVING":
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not SERVING on {health_address}:\n{srv.log_tail()}")


def test_a_tls_server_is_probed_in_plaintext_and_reached_by_name_with_the_secrets_roots(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cert-manager style Secret: a leaf for the server's name issued by a CA, whose certificate is ca.crt.
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("rmsft test CA", ca_key, ca=True)
    leaf = _cert("localhost", leaf_key, ca_key, ca.subject, dns=("localhost",))
    secret = _secret_dir(tmp_path, "tls", {"tls.crt": _pem(leaf), "tls.key": _pem_key(leaf_key), "ca.crt": _pem(ca)})
    health_port = free_port()
    srv = RolloutServer.spawn(
        tiny_model_dir,
        backend="hf",
        auth_token="tok",
        tls_cert=str(secret / "tls.crt"),
        tls_key=str(secret / "tls.key"),
        env={HEALTH_PORT_ENV: str(health_port)},
        log_path=tmp_path / "serve.log",
    )
    try:
        # The kubelet's gRPC probe: plaintext, no token, on the health-only port.
        _wait_serving(srv, f"127.0.0.1:{health_port}")
        assert f"health :{health_port} plaintext" in srv.log_tail(80) and "(TLS)" in srv.log_tail(80)
        # ... which serves nothing but health: no rollout call in plaintext there.
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch, pytest.raises(grpc.RpcError) as refused:
            generate(srv.stub(ch), srv.metadata(), prompt_ids(tiny_tokenizer)[:1], timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The gRPC port itself speaks TLS only: a plaintext client gets nowhere.
        with pytest.raises(grpc.RpcError):
            _health(srv.address)
        # What a server's relay trusts (rollout_svc.servicer: its own tls.crt as the roots) reaches a peer that
        # presents the same certificate, though the CA is not among those roots: the leaf is the trust anchor.
        relay = grpc.secure_channel(
            f"localhost:{srv.port}", grpc.ssl_channel_credentials(root_certificates=(secret / "tls.crt").read_bytes())
        )
        assert _health("", relay) == "SERVING"

        # The learner, as the operator wires it: the Secret's folder named by RMSFT_ROLLOUT_TLS_DIR; ca.crt trusted.
        monkeypatch.setenv(TLS_DIR_ENV, str(secret))
        roots = tls_roots_from_env()
        assert roots == _pem(ca)
        # The learner's own pool (learner.train.server_setup.server_pool, what `rmsft train` builds).
        pool = server_pool(
            load_job(ROOT / "configs" / "local-tiny-vl.yaml"), [f"localhost:{srv.port}"], run_id=None, auth_token="tok"
        )
        try:
            server = pool.servers[0]
            got = generate(server.stub, pool.metadata, prompt_ids(tiny_tokenizer)[:2], max_tokens=4)
            assert len(got.completions) == 2
        finally:
            pool.close()
        # The name is checked: the same server by an address its certificate does not cover is refused.
        wrong = ServerPool([f"127.0.0.1:{srv.port}"], auth_token="tok", root_certificates=roots)
        try:
            with pytest.raises(grpc.RpcError) as unverified:
                generate(wrong.servers[0].stub, wrong.metadata, prompt_ids(tiny_tokenizer)[:1], timeout=10)
            assert unverified.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            wrong.close()
    finally:
        srv.stop()


def test_the_learner_trusts_a_self_signed_tls_crt_and_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _pem(_cert("job-rollout", key, dns=("*.job-rollout.team-a.svc",)))
    monkeypatch.delenv(TLS_DIR_ENV, raising=False)
    assert tls_roots_from_env() is None  # no TLS: plaintext channels
    monkeypatch.setenv(TLS_DIR_ENV, str(_secret_dir(tmp_path, "self", {"tls.crt": cert, "tls.key": _pem_key(key)})))
    assert tls_roots_from_env() == cert
    monkeypatch.setenv(TLS_DIR_ENV, str(_secret_dir(tmp_path, "opaque", {"token": b"x"})))
    with pytest.raises(
        ValueError,
        match="neither ca.crt nor tls.crt .* spec.rollout.tls.secretName must name a Secret of type kubernetes.io/tls",
    ):
        tls_roots_from_env()


def test_a_health_port_without_tls_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = RolloutServer.spawn(
        tiny_model_dir, backend="hf", env={HEALTH_PORT_ENV: str(free_port())}, log_path=tmp_path / "serve.log"
    )
    try:
        assert srv.proc.wait(120) != 0
        assert f"{HEALTH_PORT_ENV} is for a server with TLS" in srv.log_tail()
    finally:
        srv.stop()


def test_an_unreadable_tls_key_is_refused_with_the_flag_not_a_traceback(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tls.crt").write_text("not read: the key is missing")
    srv = RolloutServer.spawn(
        tiny_model_dir,
        backend="hf",
        tls_cert=str(tmp_path / "tls.crt"),
        tls_key=str(tmp_path / "missing.key"),
        log_path=tmp_path / "serve.log",
    )
    try:
        assert srv.proc.wait(120) != 0
        tail = srv.log_tail()
        assert "rmsft serve: cannot read --tls-key/--tls-cert" in tail and "missing.key" in tail, tail
        assert "Traceback" not in tail, tail
    finally:
        srv.stop()
