"""The relay: a server forwards the weight stream it receives to the next servers of the header's
`relay_to`, so the learner sends an update once whatever the pool's size (transport grpc).

How it forwards: from its own staging file, as that file fills (the `StageObserver` of
`rollout_svc.staging`), not from the frames it receives. So a slow or dead server downstream never
holds the stream this server receives, and the memory is the staging file it needs anyway plus the
frames in flight. Each piece is re-encoded from the staged bytes (one copy) with the learner's
names and offsets; the trailer carries the learner's digest unchanged, so every server checks the
bytes it got against what the learner hashed, and a relay that corrupted them is refused downstream.

Who gets it: the first server of `relay_to`, with the rest of the list (it relays in turn). When
that one cannot be reached, refuses before relaying (busy, not ready) or dies mid-stream, its
outcome is recorded and the next one is tried with the rest, from the start of the staged bytes,
so one dead server cuts nobody else off. A server that answered reports its own relay's outcomes
(in its reply, or in trailing metadata when it refused the update itself), so nobody is sent twice.
When this server's own stream is bad (refused, broken off), forwarding stops: the downstream calls
are cancelled (they apply nothing) and the servers not reached are reported as such.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
from rmsft_protos import rollout_pb2

from rmsft.weight_wire import TensorSpec, encode_piece, set_version, update_weights_raw, version_of
from rmsft.weight_wire.outcomes import outcome_of_error, relayed_from_error

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.enable_retries", 0),
    ("grpc.use_local_subchannel_pool", 1),
)
_BUSY_RETRIES = 20  # a server still finishing a broken-off stream from a dead relay answers ABORTED
_BUSY_WAIT_S = 0.25


@dataclass
class _Piece:
    name: str
    spec: TensorSpec
    offset: int
    dest: int
    size: int


class _StreamBroken(Exception):
    """This server's own stream went bad: forwarding it must stop (downstream applies nothing)."""


class Relay:
    """Forwards one update to `header.relay_to`; a `StageObserver` for `Stager.stage`.

    `metadata`: what to send on each call (the pool's auth token); `root_certificates`: PEM roots
    for TLS channels to the peers (None = plaintext); `deadline`: absolute `time.monotonic()` by
    which every outcome must be known (the learner's own deadline, less a margin).
    """

    def __init__(
        self,
        header: rollout_pb2.WeightHeader,
        *,
        metadata: Sequence[tuple[str, str]] = (),
        root_certificates: bytes | None = None,
        deadline: float | None = None,
    ) -> None:
        self.targets = list(header.relay_to)
        self._header = header
        self._metadata = tuple(metadata)
        self._roots = root_certificates
        self._deadline = deadline if deadline is not None else time.monotonic() + 600.0
        self._cond = threading.Condition()
        self._pieces: list[_Piece] = []
        self._trailer: rollout_pb2.WeightTrailer | None = None
        self._broken: str | None = None
        self._mm: mmap.mmap | None = None
        self._outcomes: list[rollout_pb2.RelayOutcome] = []
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    # -- StageObserver ----------------------------------------------------------------------------
    def opened(self, header: rollout_pb2.WeightHeader, data_path: str) -> None:
        if header.total_bytes:
            with open(data_path, "rb") as f:  # the map outlives the path (the stager may remove it)
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._thread = threading.Thread(target=self._run, name="weight-relay", daemon=True)
        self._thread.start()

    def piece(self, name: str, spec: TensorSpec, offset: int, dest: int, size: int) -> None:
        with self._cond:
            self._pieces.append(_Piece(name, spec, offset, dest, size))
            self._cond.notify_all()

    def finished(self, trailer: rollout_pb2.WeightTrailer) -> None:
        with self._cond:
            self._trailer = trailer
            self._cond.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._cond:
            self._broken = f"{type(error).__name__}: {error}"
            self._cond.notify_all()

    # -- results ----------------------------------------------------------------------------------
    def wait(self) -> list[rollout_pb2.RelayOutcome]:
        """Every target's outcome, in `relay_to` order, once known (or the deadline passed); [] when
        nothing was forwarded (the update was refused before staging began)."""
        if self._thread is None:  # never opened: refused before staging, nothing was forwarded;
            return []  # saying nothing lets the caller try the next servers itself
        self._done.wait(max(0.0, self._deadline - time.monotonic()) + 5.0)
        with self._cond:
            got = {o.address for o in self._outcomes}
            missing = [
                self._not_reached(a, "no answer before the learner's deadline") for a in self.targets if a not in got
            ]
            return list(self._outcomes) + missing

    def close(self) -> None:
        self.failed(RuntimeError("relay closed"))
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a request still holds a view: the GC closes it
                self._mm.close()
            self._mm = None

    @staticmethod
    def _not_reached(address: str, why: str) -> rollout_pb2.RelayOutcome:
        return rollout_pb2.RelayOutcome(
            address=address, code=grpc.StatusCode.UNAVAILABLE.value[0], message=f"not relayed to: {why}"
        )

    # -- forwarding -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            i = 0
            while i < len(self.targets):
                address, rest = self.targets[i], self.targets[i + 1 :]
                answered = self._forward(address, rest)
                with self._cond:
                    self._outcomes.extend(answered)
                    if self._broken is not None:
                        break
                covered = {o.address for o in answered}
                # Continue after the last server this attempt accounted for.
                i += 1
                while i < len(self.targets) and self.targets[i] in covered:
                    i += 1
        finally:
            self._done.set()

    def _forward(self, address: str, rest: list[str]) -> list[rollout_pb2.RelayOutcome]:
        """Forward the stream to `address` (relaying to `rest`); its outcome and the ones it relayed."""
        for attempt in range(_BUSY_RETRIES + 1):
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                return [self._not_reached(address, "the learner's deadline passed")]
            channel = self._channel(address)
            try:
                call = update_weights_raw(channel)
                reply = call(self._requests(rest), timeout=remaining, metadata=self._metadata)
                # What it holds now, run id and number (rmsft.weight_wire.version), as it answered.
                ok = set_version(rollout_pb2.RelayOutcome(address=address, code=0), version_of(reply))
                return [ok, *reply.relayed]
            except grpc.RpcError as e:
                with self._cond:
                    broken = self._broken
                if broken is not None:
                    return [
                        rollout_pb2.RelayOutcome(
                            address=address,
                            code=grpc.StatusCode.CANCELLED.value[0],
                            message=f"relay stopped: the stream was refused upstream ({broken})",
                        )
                    ]
                if e.code() == grpc.StatusCode.ABORTED and attempt < _BUSY_RETRIES:
                    time.sleep(_BUSY_WAIT_S)  # e.g. still ending a stream from a relay that died
                    continue
                log.warning("relay to %s failed: %s", address, e.details() if hasattr(e, "details") else e)
                return [outcome_of_error(address, e), *relayed_from_error(e)]
            finally:
                channel.close()
        raise AssertionError("unreachable")

    def _channel(self, address: str) -> grpc.Channel:
        if self._roots is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=self._roots)
            return grpc.secure_channel(address, creds, options=_CHANNEL_OPTIONS)
        return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)

    def _requests(self, rest: list[str]) -> Iterator[bytes]:
        header = rollout_pb2.WeightHeader()
        header.CopyFrom(self._header)
        del header.relay_to[:]
        header.relay_to.extend(rest)
        yield rollout_pb2.WeightChunk(header=header).SerializeToString()
        sent = 0
        while True:
            with self._cond:
                while sent >= len(self._pieces) and self._trailer is None and self._broken is None:
                    self._cond.wait()
                if self._broken is not None:
                    raise _StreamBroken(self._broken)  # grpc cancels the call: nothing is applied there
                batch = self._pieces[sent:]
                trailer = self._trailer
            for p in batch:
                payload: memoryview | bytes = b""
                if p.size:
                    assert self._mm is not None, "a piece with bytes: `opened` mapped the file (total_bytes > 0)"
                    payload = memoryview(self._mm)[p.dest : p.dest + p.size]
                try:
                    request = encode_piece(p.name, p.spec, p.offset, payload)
                finally:
                    del payload
                yield request
            sent += len(batch)
            if trailer is not None and sent == len(self._pieces):
                yield rollout_pb2.WeightChunk(trailer=trailer).SerializeToString()
                return


def relay_deadline(time_remaining: float | None, hops: int) -> float:
    """Absolute deadline for a relay: the caller's remaining time less a margin per hop, so each
    server still answers its caller in time with what it knows."""
    budget = 600.0 if time_remaining is None else time_remaining
    return time.monotonic() + max(0.5, budget - 1.0 - 0.5 * hops)


__all__ = ["Relay", "relay_deadline"]
