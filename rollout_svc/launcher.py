"""Start `rmsft serve` as a subprocess on free loopback ports, wait until it is healthy, stop it.

Used by the tests, the benchmarks and the learner's local mode:

    with RolloutServer.start(model_dir, enable_lora=True) as srv:
        stub = srv.stub()
        ...
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from rmsft.lifeline import popen_options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(options: dict[str, Any]) -> list[str]:
    out = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            out += [flag, str(value)]
    return out


class RolloutServer:
    def __init__(
        self,
        proc: subprocess.Popen | None,
        port: int,
        metrics_port: int,
        log_path: Path,
        token: str = "",
        host: str = "127.0.0.1",
    ):
        self.proc, self.port, self.metrics_port = proc, port, metrics_port
        self._launch: tuple[list[str], dict[str, str]] | None = None
        self.log_path, self.token, self.host = log_path, token, host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def start(
        cls,
        model: str | Path,
        *,
        timeout: float = 300.0,
        port: int | None = None,
        metrics_port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        **options: Any,
    ) -> RolloutServer:
        """Spawn the server and block until its health service says SERVING.

        `options` are `rmsft serve` flags in snake_case (e.g. backend="hf", enable_lora=True).
        Raises RuntimeError with the server's log tail if it exits or times out.
        """
        srv = cls.spawn(model, port=port, metrics_port=metrics_port, env=env, log_path=log_path, **options)
        try:
            srv.wait_healthy(timeout)
        except BaseException:
            srv.stop()
            raise
        return srv

    @classmethod
    def spawn(
        cls,
        model: str | Path,
        *,
        port: int | None = None,
        metrics_port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        **options: Any,
    ) -> RolloutServer:
        """Start the server process and return at once (`wait_healthy` waits for it). The process dies with this
        one, whatever ends this one (rmsft.lifeline)."""
        if port:
            with socket.socket() as s:
                # As the gRPC server binds: a killed server's connections in TIME_WAIT do not hold the port.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError as e:
                    # A health check would reach whoever holds the port and look healthy.
                    raise RuntimeError(f"port {port} is taken: {e}") from e
        port = port or free_port()
        metrics_port = free_port() if metrics_port is None else metrics_port
        opts = {"host": "127.0.0.1", "max_model_len": 2048, **options}
        cmd = [
            sys.executable,
            "-m",
            "rollout_svc",
            "--model",
            str(model),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            *_flags(opts),
        ]
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"rmsft-serve-{port}-", suffix=".log")
            os.close(fd)
            log_path = name
        log_path = Path(log_path)
        full_env = {**os.environ, **(env or {})}
        token = opts.get("auth_token") or full_env.get("RMSFT_AUTH_TOKEN", "")
        srv = cls(None, port, metrics_port, log_path, token=token)
        srv._launch = (cmd, full_env)
        srv._spawn(append=False)
        return srv

    def _spawn(self, *, append: bool) -> None:
        assert self._launch is not None, "set by start(), the only way to a server this side spawns"
        cmd, env = self._launch
        with open(self.log_path, "ab" if append else "wb") as log:
            # A session of its own: a Ctrl-C in the terminal reaches the learner, which stops the servers in
            # order, not all at once. Its own process group, so its engine processes are stopped with it.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen_options(env)
            )

    def restart(self, timeout: float = 300.0, cancel: threading.Event | None = None) -> None:
        """Start the server again after its process ended (a dead engine exits 1): same command, same ports, so
        clients keep its address; its log goes on in the same file. Blocks until it is SERVING again (or
        `cancel` is set)."""
        assert self.proc is not None, "a started server has its process (start() spawns it)"
        if self.proc.poll() is None:
            raise RuntimeError(f"rollout server {self.address} is still running")
        with contextlib.suppress(ProcessLookupError, PermissionError):  # engine processes the old one left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._spawn(append=True)
        try:
            self.wait_healthy(timeout, cancel)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)],
        )

    def stub(self, channel: grpc.Channel | None = None):
        from rmsft_protos import rollout_pb2_grpc

        return rollout_pb2_grpc.RolloutServiceStub(channel or self.channel())

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def health(self, timeout: float = 2.0) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_healthy(self, timeout: float = 300.0, cancel: threading.Event | None = None) -> None:
        assert self.proc is not None, "a started server has its process (start() spawns it)"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise RuntimeError(f"stopped waiting for rmsft serve on {self.address}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"rmsft serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                healthy = self.health() == "SERVING"
            except grpc.RpcError:  # not listening yet: keep polling until the deadline
                healthy = False
            if healthy:
                self._check_identity()
                return
            time.sleep(0.5)
        raise RuntimeError(f"rmsft serve not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def _check_identity(self) -> None:
        """The server that said SERVING on this port is the process started here. A port is chosen free, then bound
        by the server it is given to: meanwhile (a restart on the same port, above all) another run's server can
        take it, and its health would pass for this one's."""
        from rmsft_protos import rollout_pb2

        try:
            with self.channel() as ch:
                pid = self.stub(ch).GetStatus(rollout_pb2.StatusRequest(), metadata=self.metadata(), timeout=10).pid
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise RuntimeError(
                    f"rmsft serve on {self.address} said SERVING, then failed GetStatus: {e.code().name}: {e.details()}"
                ) from e
            pid = None  # this run's token refused: another run's server
        assert self.proc is not None, "a started server has its process (start() spawns it)"
        if pid != self.proc.pid:
            who = f"pid {pid}" if pid else "a server that refused this run's token"
            raise RuntimeError(
                f"port {self.port} is answered by another process ({who}), not by the rmsft serve "
                f"started here (pid {self.proc.pid}), which could not bind it:\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the server drains and shuts its engine down), SIGKILL to its whole process group after
        `timeout`; engine processes left behind by a server that ended are killed too."""
        assert self.proc is not None, "a started server has its process (start() spawns it)"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill()
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL the server's whole process group (its engine runs in child processes of the same group) and
        reap it: for a server not worth a graceful stop, e.g. one still loading when the run is stopped."""
        assert self.proc is not None, "a started server has its process (start() spawns it)"
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> RolloutServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Supervisor:
    """Restarts servers whose process ended while they should be serving (a dead engine exits 1), as Kubernetes
    restarts a pod: same address, so the learner's pool finds it again, sees it on weight version 0 and re-syncs
    it before it gets work. At most `max_restarts` per server over the run (the budget does not refill), so a
    server that cannot start stays down (the learner fails over to the others) instead of looping; a server that
    exited 0 was stopped on purpose and stays down; `report(message)` hears about every event."""

    def __init__(
        self,
        servers: list[RolloutServer],
        *,
        report=print,
        max_restarts: int = 3,
        poll_s: float = 1.0,
        start_timeout: float = 300.0,
    ) -> None:
        self.servers = servers
        self.report = report
        self.max_restarts = max_restarts
        self.restarts = [0] * len(servers)
        self._poll_s, self._start_timeout = poll_s, start_timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rmsft-supervisor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            for i, srv in enumerate(self.servers):
                assert srv.proc is not None, "the supervisor watches started servers"
                code = srv.proc.poll()
                # Exit code 0 is a server stopped on purpose (SIGTERM): not restarted.
                if code in (None, 0) or self._stop.is_set() or self.restarts[i] < 0:
                    continue
                if self.restarts[i] >= self.max_restarts:
                    self.report(
                        f"rollout server {i} ({srv.address}) exited with {code} after {self.restarts[i]} "
                        f"restart(s); leaving it down (log: {srv.log_path})"
                    )
                    self.restarts[i] = -1  # reported once
                    continue
                self.restarts[i] += 1
                self.report(
                    f"rollout server {i} ({srv.address}) exited with {code}: restarting it "
                    f"({self.restarts[i]}/{self.max_restarts}; log: {srv.log_path})"
                )
                try:
                    srv.restart(self._start_timeout, cancel=self._stop)
                except Exception as e:  # reported; the next poll sees it down again
                    self.report(f"rollout server {i} did not come back: {e}")
                else:
                    self.report(f"rollout server {i} ({srv.address}) is serving again")

    def stop(self) -> None:
        """Stop watching (before the servers are stopped on purpose)."""
        self._stop.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
