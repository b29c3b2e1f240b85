"""Process entry: bind ports first (fail fast), report NOT_SERVING, load the engine, serve."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from rmsft_protos import rollout_pb2

from rmsft.lifeline import kill_own_group_later, watch_parent
from rmsft.logs import LogLevelError, configure_logging
from rmsft.weight_wire import decode_chunk
from rollout_engine.config import ServeConfig
from rollout_engine.engine import EngineError
from rollout_svc.malloc_tuning import keep_frame_buffers
from rollout_svc.preflight import TERMINATION_LOG, check_shared_dir, check_staging, write_termination_log

log = logging.getLogger("rollout_svc")
SERVICE_NAME = "rmsft.v1.RolloutService"
# Largest message accepted: a Generate call carrying a server's whole share of prompts with their images (the
# learner cuts chunks at learner.rollouts.requests.MAX_CHUNK_BYTES), or a weight frame (the servicer refuses frames
# over --max-frame-bytes itself, with a clear message).
GENERATE_RECEIVE_BYTES = 64 << 20


def _fail(msg: str) -> None:
    log.error(msg)
    raise SystemExit(f"rmsft serve: {msg}")


def add_rollout_service(servicer, server: grpc.Server) -> None:
    """Register `servicer` like `rollout_pb2_grpc.add_RolloutServiceServicer_to_server`, except
    that UpdateWeights pieces are decoded by `decode_chunk` (payload not copied out of the
    received message). Same method names, same messages on the wire."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=rollout_pb2.GenerateRequest.FromString,
            response_serializer=rollout_pb2.GenerateResponse.SerializeToString,
        ),
        "UpdateWeights": grpc.stream_unary_rpc_method_handler(
            servicer.UpdateWeights,
            request_deserializer=decode_chunk,
            response_serializer=rollout_pb2.UpdateReply.SerializeToString,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus,
            request_deserializer=rollout_pb2.StatusRequest.FromString,
            response_serializer=rollout_pb2.StatusReply.SerializeToString,
        ),
        "JoinWeightGroup": grpc.unary_unary_rpc_method_handler(
            servicer.JoinWeightGroup,
            request_deserializer=rollout_pb2.JoinWeightGroupRequest.FromString,
            response_serializer=rollout_pb2.JoinWeightGroupReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def make_engine(cfg: ServeConfig):
    if cfg.backend == "hf":
        from rollout_engine.hf_engine import HfEngine

        return HfEngine(cfg)
    from rollout_engine.vllm_engine import VllmEngine

    return VllmEngine(cfg)


def preflight(cfg: ServeConfig, termination_log: str = TERMINATION_LOG) -> None:
    """Exit now, before ports or the engine, when the staging dir (or, with transport shm, the
    shared-weights dir) cannot hold a FULL update (the message also goes to the pod's termination
    message, which the operator surfaces)."""
    shared = cfg.resolved_shared_weights_dir()
    if shared:  # transport shm: updates are read where the learner wrote them, not staged here
        problem = check_shared_dir(cfg.model, shared, dtype=cfg.dtype)
    else:
        problem = check_staging(cfg.model, cfg.resolved_staging_dir(), cfg.keep_rollback_copy, dtype=cfg.dtype)
    if problem:
        write_termination_log(f"rmsft serve: {problem}", termination_log)
        _fail(problem)


# How long a server whose starter died may take to stop cleanly before its process group (engine processes
# included) is killed.
ORPHAN_GRACE_S = 10.0


_starter_report = threading.Lock()
_starter_reported = threading.Event()  # set once: by the lifeline's thread or by the shutdown, whichever is first


def _report_starter_gone() -> bool:
    """Say (once) that the starter is gone and arm the group kill; False when that was done already. Under a lock
    held while it logs, so a caller that finds it done knows the line is written (the process may end right after)."""
    with _starter_report:
        if _starter_reported.is_set():
            return False
        _starter_reported.set()
        log.warning("the process that started this server is gone: shutting down")
        kill_own_group_later(ORPHAN_GRACE_S)
        return True


def _starter_gone() -> None:
    """The process that started this server (`rmsft local`, a test) ended without stopping it: stop as on SIGTERM
    (the handler, once installed, shuts down in order; before that, SIGTERM ends the process, which has no engine
    yet), and kill the whole process group if that takes longer than ORPHAN_GRACE_S (an engine still loading)."""
    if _report_starter_gone():
        os.kill(os.getpid(), signal.SIGTERM)


# The plaintext port that serves grpc.health.v1 alone, beside a TLS port: Kubernetes' gRPC probes cannot speak TLS.
# The operator sets it with spec.rollout.tls (render.HEALTH_PORT_ENV); an environment variable, not a serve option,
# so `rmsft serve`'s flags (rollout_engine.config.ServeConfig) stay as they are.
from rmsft.jobspec.rollout import HEALTH_PORT_ENV  # noqa: E402


def _health_port() -> int:
    raw = os.environ.get(HEALTH_PORT_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        _fail(f"{HEALTH_PORT_ENV}={raw!r} is not a port number")
    return int(raw)


def _health_only_server(health_svc: health.HealthServicer, host: str, port: int) -> grpc.Server:
    """grpc.health.v1 and nothing else, in plaintext: what it tells (SERVING or not) is what the TLS port's own
    health service tells, the same servicer object; no rollout call, no token, no weights."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"), options=[("grpc.so_reuseport", 0)]
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_svc, server)
    _listen(server, f"{host}:{port}", None, " for health checks")
    return server


def _listen(server: grpc.Server, address: str, creds: grpc.ServerCredentials | None, what: str = "") -> None:
    """Bind `address` (TLS with `creds`) or exit with why."""
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except (RuntimeError, OSError) as e:
        _fail(f"cannot listen on {address}{what} (port taken?): {e}")
    if not bound:
        _fail(f"cannot listen on {address}{what} (port taken?)")


def _tls_pair(cfg: ServeConfig) -> tuple[bytes, bytes] | None:
    """(key, certificate chain) PEM of --tls-key/--tls-cert, read before anything starts; None without TLS."""
    if not cfg.tls_cert:
        return None
    try:
        with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
            return k.read(), c.read()
    except OSError as e:
        _fail(f"cannot read --tls-key/--tls-cert (in a cluster: the spec.rollout.tls Secret's files): {e}")
    return None


def serve(cfg: ServeConfig) -> int:
    try:
        configure_logging("info", fmt="%(asctime)s %(levelname)s %(name)s: %(message)s")
    except LogLevelError as e:
        raise SystemExit(f"rmsft serve: {e}") from None
    watch_parent(_starter_gone)  # started with a lifeline (rollout_svc.launcher): die with the starter
    starter = os.getppid()
    preflight(cfg)
    from rollout_svc.auth import TokenAuthInterceptor
    from rollout_svc.servicer import RolloutServicer

    tls_pair = _tls_pair(cfg)
    keep_frame_buffers(cfg.max_frame_bytes)  # weight frames: reuse heap buffers, no re-faulting
    token = cfg.resolved_auth_token()
    interceptors = [TokenAuthInterceptor(token)] if token else []
    # Room for one frame plus protobuf overhead, or a whole share of prompts; bigger frames are refused by the
    # servicer with a clear message unless they exceed even this.
    max_msg = max(2 * cfg.max_frame_bytes + (1 << 20), GENERATE_RECEIVE_BYTES)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.max_concurrent_requests + 8, thread_name_prefix="rpc"),
        interceptors=interceptors,
        options=[
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
            ("grpc.max_receive_message_length", max_msg),
            ("grpc.max_send_message_length", 256 << 20),
            # A fixed HTTP/2 receive window of one maximal frame. With BDP probing on (the
            # default) gRPC grows the window while a weight stream runs, and everything the
            # sender pushes into it sits in this process; a fixed window bounds the buffered
            # bytes and, on loopback, streamed no slower in benchmarks/weight_sync.py.
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", cfg.max_frame_bytes),
        ],
        maximum_concurrent_rpcs=cfg.max_concurrent_requests + 8,
    )
    health_svc = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_svc.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_svc, server)

    stop = threading.Event()
    exit_code = [0]

    def broken(reason: str, fatal: bool = False) -> None:
        """NOT_SERVING from now on, so the readiness probe and the learner's failover react; `fatal` (a dead
        engine) also ends the process, so its pod is restarted (`rmsft local` restarts it the same way; meanwhile
        the learner fails over to the others)."""
        for name in ("", SERVICE_NAME):
            health_svc.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if fatal:
            write_termination_log(f"rmsft serve: {reason}")
            exit_code[0] = 1
            stop.set()

    try:
        servicer = RolloutServicer(cfg, on_broken=broken)
    except EngineError as e:
        _fail(str(e))
    add_rollout_service(servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    creds = grpc.ssl_server_credentials([tls_pair]) if tls_pair else None
    _listen(server, address, creds)
    health_port = _health_port()
    if health_port and not cfg.tls_cert:
        _fail(
            f"{HEALTH_PORT_ENV} is for a server with TLS (--tls-cert/--tls-key); without TLS the gRPC port "
            "answers health checks itself"
        )
    health_server = _health_only_server(health_svc, cfg.host, health_port) if health_port else None
    if cfg.metrics_port:
        from rmsft.metrics_http import start_metrics_server

        try:
            start_metrics_server(cfg.metrics_port, addr=cfg.host)  # vLLM's `vllm:*` names kept for Prometheus 2
        except OSError as e:
            _fail(f"cannot serve metrics on port {cfg.metrics_port}: {e}")
    server.start()
    if health_server is not None:
        health_server.start()
    log.info(
        "listening on %s%s (metrics :%s%s), loading %s engine for %s",
        address,
        " (TLS)" if cfg.tls_cert else "",
        cfg.metrics_port,
        f", health :{health_port} plaintext" if health_server else "",
        cfg.backend,
        cfg.model,
    )

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        engine = make_engine(cfg)
    except EngineError as e:
        server.stop(0)
        if health_server is not None:
            health_server.stop(0)
        _fail(str(e))
    servicer.attach(engine)
    for name in ("", SERVICE_NAME):
        health_svc.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("ready: backend=%s lora=%s replica=%d", cfg.backend, cfg.enable_lora, servicer.ordinal)
    stop.wait()
    if os.getppid() != starter:  # re-parented: the starter is gone, and its death signal came before the lifeline
        _report_starter_gone()  # thread read its end of file (the process may exit before that thread runs again)
    if not exit_code[0]:
        servicer.shutting_down()
    log.info("shutting down" if not exit_code[0] else "shutting down: the engine is dead")
    health_svc.enter_graceful_shutdown()
    server.stop(cfg.grace_seconds).wait()
    if health_server is not None:
        health_server.stop(0)
    servicer.close()
    return exit_code[0]


def main(argv: list[str] | None = None, prog: str = "python -m rollout_svc") -> None:
    from rollout_svc.config import parse_config

    cfg = parse_config(argv, prog=prog)
    code = serve(cfg)
    # Everything the server made is released (engine, staging, ports); what is left is the heap of torch, vLLM and
    # gRPC, which the interpreter's last full garbage collection would walk for about 2.5 s on 2 cores at every
    # stop. Frozen objects are skipped by it and freed by the exit itself; exit handlers still run.
    gc.freeze()
    sys.exit(code)
