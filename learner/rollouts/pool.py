"""The learner's view of the rollout pool: one gRPC channel per server, in order, with what the
learner knows about each (reachable? which weight version? LoRA enabled?).

A weight version is the pair (run id, number) (`rmsft.weight_wire.version`): the pool belongs to one
learner run, `run_id` (made when the learner starts, new after every restart), and its current
version is `WeightVersion(run_id, current_version)`. A server is current only when it is up and
holds exactly that pair; one holding another run's weights is stale whatever its number, and is
fenced until this run re-synced it.

The order of `ServerPool.servers` is the order rollouts are split in. State is updated by the rollout
and sync clients from every reply they see, so `GetStatus` is only needed for servers that were down
(has a restarted pod come back?) or never contacted.

Membership can follow a file (`ServersFile`: the operator's ConfigMap key `servers`, mounted in the
learner pod, which the operator rewrites when the pool is scaled). `ServerPool.follow()` re-reads it
when it changed (one `stat` otherwise); the rollout and sync clients call it before each call and
`wait_ready` while it waits. Servers that left are dropped (their share goes to the others); new
ones start with an unknown weight version, so the clients' version fencing keeps them from Generate
work until they were synced to the learner's current version.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from rmsft_protos import rollout_pb2, rollout_pb2_grpc

from learner.rollouts.servers_file import ServersFile, ServersFileError, parse_server_list  # noqa: F401 - re-exported
from learner.tracking.metrics import SERVERS_READY
from rmsft.exit_codes import RETRY_EXIT
from rmsft.weight_wire import WeightVersion, WireError, check_run_id, new_run_id, version_of

log = logging.getLogger("rmsft.learner.servers")
DEFAULT_AUTH_HEADER = "authorization"
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# A restarted pod should be noticed within seconds, not after gRPC's default 120 s reconnect backoff.
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
    # Channels otherwise share subchannels process-wide, so a fresh probe channel would inherit the
    # old one's reconnect backoff.
    ("grpc.use_local_subchannel_pool", 1),
)


class NoServerAvailableError(RuntimeError):
    """No rollout server can take work; the message names every server and its last error."""

    exit_code = RETRY_EXIT  # servers restarting, or not Ready yet at a retry's start: the retry waits for them again


@dataclass
class ServerState:
    """What the learner last saw from one server. Mutated only under `ServerPool.lock`."""

    up: bool = True
    version: int | None = None  # None: never seen a version from this server
    run_id: str | None = None  # the run whose `version` it is (set together with it)
    lora_enabled: bool | None = None
    max_lora_rank: int = 0
    # The server's base weights are no longer the checkpoint's (a FULL update was applied), so a LoRA
    # adapter sent now would sit on top of already-merged weights. None: unknown.
    base_replaced: bool | None = None
    last_error: str = ""
    down_since: float | None = None
    last_probe: float = 0.0

    @property
    def weights(self) -> WeightVersion | None:
        """The weight version last seen on the server, or None (never seen, or unknown since a refusal)."""
        if self.version is None or self.run_id is None:
            return None
        return WeightVersion(self.run_id, self.version)

    def hold(self, weights: WeightVersion | None) -> None:
        self.version, self.run_id = (None, None) if weights is None else (weights.number, weights.run_id)


@dataclass
class RolloutServer:
    """One rollout server: its address, its position in the pool, its stub and its state."""

    index: int
    address: str
    stub: rollout_pb2_grpc.RolloutServiceStub
    channel: grpc.Channel
    state: ServerState = field(default_factory=ServerState)

    @property
    def name(self) -> str:
        return f"#{self.index} {self.address}"


class ServerPool:
    """Ordered rollout servers plus the learner's current weight version.

    `addresses` are `host:port` strings in the order the pool is split in (StatefulSet ordinal order
    on a cluster), or a `ServersFile` the pool reads now and follows (`follow()`). `auth_token` is
    sent as `authorization: Bearer <token>` on every call. `run_id`: the learner run the pool's
    versions belong to (default: a new one, so two pools never share one). `recovery_s`: how long the
    learner waits for a server to come back when none is up (`wait_for_a_server`; spec.rollout.recoveryTimeout):
    a restart or an eviction of the only server is waited out instead of ending the run (0: not waited).
    """

    def __init__(
        self,
        addresses: Sequence[str] | ServersFile,
        *,
        auth_token: str | None = None,
        auth_header: str = DEFAULT_AUTH_HEADER,
        root_certificates: bytes | None = None,
        probe_timeout_s: float = 5.0,
        reprobe_interval_s: float = 2.0,
        run_id: str | None = None,
        recovery_s: float = 0.0,
    ) -> None:
        if recovery_s < 0:
            raise ValueError(f"recovery_s must be >= 0, got {recovery_s}")
        self.recovery_s = recovery_s
        try:
            self._run_id = check_run_id(new_run_id() if run_id is None else run_id, allow_none=False)
        except WireError as e:
            raise ValueError(f"ServerPool: {e}") from None
        self.source = addresses if isinstance(addresses, ServersFile) else None
        if isinstance(addresses, ServersFile):  # (self.source)
            addresses = addresses.read()
        if not addresses:
            raise ValueError("ServerPool needs at least one rollout server address")
        _check_unique(addresses)
        self.lock = threading.RLock()
        self.probe_timeout_s = probe_timeout_s
        self.reprobe_interval_s = reprobe_interval_s
        self.metadata: tuple[tuple[str, str], ...] = ((auth_header, f"Bearer {auth_token}"),) if auth_token else ()
        self._current_number: int | None = None
        self._root_certificates = root_certificates
        self.servers: list[RolloutServer] = []
        for i, address in enumerate(addresses):
            channel = self._channel(address)
            self.servers.append(RolloutServer(i, address, rollout_pb2_grpc.RolloutServiceStub(channel), channel))
        # Threads start on demand, so the bound costs nothing while the pool is small (and it may grow).
        self._probe_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="probe")

    def _channel(self, address: str) -> grpc.Channel:
        if self._root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
            return grpc.secure_channel(address, creds, options=_CHANNEL_OPTIONS)
        return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)

    # -- membership -----------------------------------------------------------------------------
    def set_addresses(self, addresses: Sequence[str]) -> tuple[list[str], list[str]]:
        """Make the pool exactly `addresses`, in that order; returns (added, removed). Servers that
        stay keep their channel and state; new ones start with an unknown weight version, so the
        clients fence them from Generate work until they were synced; the ones that left are closed.
        Call it between rollout/sync calls, not during one: the clients index servers by position."""
        addresses = list(addresses)
        _check_unique(addresses)
        with self.lock:
            old = {s.address: s for s in self.servers}
            added = [a for a in addresses if a not in old]
            servers = []
            for i, address in enumerate(addresses):
                server = old.pop(address, None)
                if server is None:
                    channel = self._channel(address)
                    server = RolloutServer(i, address, rollout_pb2_grpc.RolloutServiceStub(channel), channel)
                server.index = i
                servers.append(server)
            self.servers = servers
            self._publish()
        for gone in old.values():
            gone.channel.close()
        return added, list(old)

    def follow(self) -> bool:
        """Apply the followed `ServersFile` when its content changed; True when membership changed.
        Cheap (one stat) when it did not; a no-op for a fixed address list."""
        if self.source is None:
            return False
        addresses = self.source.poll()
        if addresses is None or addresses == [s.address for s in self.servers]:
            return False
        added, removed = self.set_addresses(addresses)
        log.info("rollout servers now %s (from %s): added %s, removed %s", addresses, self.source.path, added, removed)
        return True

    def follow_or_wait(self, timeout_s: float) -> None:
        """`follow`, then, when the list is empty (the pool was scaled to zero), wait up to
        `timeout_s` for servers to be listed again and come up (what every call site needs)."""
        self.follow()
        if not self.servers:
            self.wait_ready(timeout_s=timeout_s)

    # -- version --------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        """The learner run whose weight versions this pool announces and fences to."""
        return self._run_id

    @property
    def current_version(self) -> int | None:
        """The number of the weight version the learner holds and every rollout must carry (None
        before the first sync); the version itself is `current`."""
        with self.lock:
            return self._current_number

    @property
    def current(self) -> WeightVersion | None:
        """The weight version the learner holds: (this run's id, `current_version`); None before the
        first sync."""
        with self.lock:
            return None if self._current_number is None else WeightVersion(self._run_id, self._current_number)

    def version(self, number: int) -> WeightVersion:
        """Weight version `number` of this pool's run."""
        return WeightVersion(self._run_id, number)

    def set_current_version(self, number: int) -> None:
        with self.lock:
            self._current_number = number
            self._publish()

    # -- state updates (called by the clients) --------------------------------------------------
    def mark_up(self, server: RolloutServer, *, weights: WeightVersion | None = None) -> None:
        """The server answers; `weights`: the version it reported holding (None: unchanged)."""
        with self.lock:
            st = server.state
            st.up, st.down_since, st.last_error = True, None, ""
            if weights is not None:
                st.hold(weights)
            self._publish()

    def mark_down(self, server: RolloutServer, error: str) -> None:
        with self.lock:
            st = server.state
            if st.up:
                st.down_since = time.monotonic()
            st.up = False
            st.last_error = error
            st.last_probe = time.monotonic()
            self._publish()

    def mark_stale(self, server: RolloutServer, weights: WeightVersion | None, error: str = "") -> None:
        """The server answers but holds other weights than the learner (e.g. a restarted pod, or
        another run's weights); `weights`: what it holds, None when unknown."""
        with self.lock:
            server.state.hold(weights)
            if error:
                server.state.last_error = error
            self._publish()

    def holds_current(self, server: RolloutServer) -> bool:
        """The server was last seen holding the learner's current weight version (run id and number)."""
        with self.lock:
            weights = server.state.weights
            return weights is not None and weights == self.current

    def is_current(self, server: RolloutServer) -> bool:
        with self.lock:
            return server.state.up and self.holds_current(server)

    def _publish(self) -> None:
        ready = sum(1 for s in self.servers if self.is_current(s))
        SERVERS_READY.set(ready)

    # -- probing --------------------------------------------------------------------------------
    def status(
        self, server: RolloutServer, timeout_s: float | None = None, *, fresh_channel: bool = False
    ) -> rollout_pb2.StatusReply:
        """GetStatus on one server; updates its state; raises grpc.RpcError when unreachable.

        fresh_channel: probe over a new channel and keep it if the server answers. A channel that
        failed sits in reconnect backoff and would report a restarted server as still down.
        """
        channel = self._channel(server.address) if fresh_channel else server.channel
        stub = rollout_pb2_grpc.RolloutServiceStub(channel) if fresh_channel else server.stub
        try:
            reply = stub.GetStatus(
                rollout_pb2.StatusRequest(), timeout=timeout_s or self.probe_timeout_s, metadata=self.metadata
            )
        except grpc.RpcError as e:
            if fresh_channel:
                channel.close()
            self.mark_down(server, describe_rpc_error(e))
            raise
        if fresh_channel:
            with self.lock:
                old, server.channel, server.stub = server.channel, channel, stub
            old.close()
        with self.lock:
            server.state.lora_enabled = reply.lora_enabled
            server.state.max_lora_rank = reply.max_lora_rank
            # Version 0 is the checkpoint; a later version without an adapter came from a FULL update.
            server.state.base_replaced = reply.weight_version != 0 and not reply.active_adapter
            server.state.last_probe = time.monotonic()
        if reply.ready:
            self.mark_up(server, weights=version_of(reply))
        else:
            self.mark_down(server, "server reports not ready (engine still loading?)")
        return reply

    def refresh(self, servers: Sequence[RolloutServer] | None = None) -> list[rollout_pb2.StatusReply | None]:
        """GetStatus on `servers` (default: all) in parallel; None for servers that did not answer.
        Servers marked down are probed over a fresh channel."""
        targets = list(self.servers if servers is None else servers)

        def one(s: RolloutServer) -> rollout_pb2.StatusReply | None:
            try:
                return self.status(s, fresh_channel=not s.state.up)
            except grpc.RpcError:
                return None

        return list(self._probe_pool.map(one, targets))

    def refresh_due(self) -> None:
        """Re-probe servers that are down or never contacted, at most every `reprobe_interval_s`."""
        now = time.monotonic()
        with self.lock:
            due = [
                s
                for s in self.servers
                if (not s.state.up or s.state.version is None)
                and (s.state.version is None or now - s.state.last_probe >= self.reprobe_interval_s)
            ]
        if due:
            self.refresh(due)

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> list[rollout_pb2.StatusReply]:
        """Block until every listed server answers GetStatus with ready=True (following the servers
        file meanwhile, so a server that left is not waited for); raises NoServerAvailableError
        naming the servers that did not, after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.follow()
            replies = self.refresh()
            if replies and all(r is not None and r.ready for r in replies):
                return [r for r in replies if r is not None]
            if time.monotonic() >= deadline:
                if not self.servers:
                    raise NoServerAvailableError(
                        f"no rollout server listed in {self.source.path if self.source else 'the pool'} after "
                        f"{timeout_s:.0f}s (spec.rollout.replicas is 0?)"
                    )
                raise NoServerAvailableError(
                    f"rollout servers not ready after {timeout_s:.0f}s: " + self.describe_down()
                )
            time.sleep(poll_s)

    def wait_for_a_server(self, what: str, poll_s: float = 1.0) -> bool:
        """With no server up, probe every listed one (following the servers file) until one answers ready, for at
        most `recovery_s`. True when one is up (at once when one already is), False when none came back in time
        (or `recovery_s` is 0): the caller then raises its own error, as without a wait."""
        if self.up_servers():
            return True
        if self.recovery_s <= 0:
            return False
        t0 = time.monotonic()
        log.warning(
            "no rollout server is up for %s (%s): waiting up to %.0fs for one to come back "
            "(spec.rollout.recoveryTimeout)",
            what,
            self.describe_down(),
            self.recovery_s,
        )
        while True:
            self.follow()
            self.refresh()
            up = self.up_servers()
            if up:
                log.warning(
                    "rollout server(s) %s back after %.0fs; going on with %s",
                    ", ".join(s.name for s in up),
                    time.monotonic() - t0,
                    what,
                )
                return True
            if time.monotonic() - t0 >= self.recovery_s:
                return False
            time.sleep(poll_s)

    def up_servers(self) -> list[RolloutServer]:
        with self.lock:
            return [s for s in self.servers if s.state.up]

    def describe_down(self, servers: Sequence[RolloutServer] | None = None) -> str:
        with self.lock:
            items = [s for s in (servers if servers is not None else self.servers)]
            return "; ".join(f"{s.name}: {s.state.last_error or 'no error recorded'}" for s in items)

    def close(self) -> None:
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        for s in self.servers:
            s.channel.close()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_unique(addresses: Sequence[str]) -> None:
    dupes = sorted({a for a in addresses if list(addresses).count(a) > 1})
    if dupes:
        raise ValueError(f"rollout server addresses must be unique, repeated: {dupes}")


def describe_rpc_error(e: grpc.RpcError) -> str:
    """`CODE: details` for an RpcError (grpc errors carry their status in methods, not attributes)."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code is not None else 'UNKNOWN'}: {details}"
