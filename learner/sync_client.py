"""Pushes the learner's weights to the rollout servers (`UpdateWeights` client streams).

`WeightSyncClient.sync(version)` streams FULL (merged, HF names) or ADAPTER (PEFT LoRA tensors +
adapter_config.json) weights to every reachable server in parallel and returns only when each of
them acknowledged `version`; a server that rejects the stream fails the sync (after one switch to
FULL when `fallback_to_full` is on and ADAPTER was rejected). A server that is unreachable is marked
down and left out: the rollout client re-syncs it (`resync_server`) before it gets work again.

FULL is a stream: its header comes from the model's metadata, then `learner.weight_export.full_export`
merges one LoRA layer at a time as the frames are sent, in the servers' serving dtype, so a sync
holds one layer's worth of extra memory on the training device, not a merged copy of the model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grpc
from rmsft_protos import rollout_pb2

from learner.fanout import Fanout
from learner.metrics import WEIGHT_SYNC_BYTES, WEIGHT_VERSION
from learner.servers import RolloutServer, ServerPool, describe_rpc_error
from learner.weight_export import (
    adapter_named_tensors,
    adapter_unsupported_reason,
    full_export,
    serving_dtype,
)
from rmsft.weights_wire import ADAPTER, DEFAULT_FRAME_BYTES, FULL
from rmsft.wire_encode import encode_planned_stream, encode_weight_stream, update_weights_raw

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("rmsft.learner.sync")

Mode = Literal["full", "adapter", "auto"]
_WIRE_MODE = {"full": FULL, "adapter": ADAPTER}
# The server never got (or cannot answer about) the stream: leave it to the re-sync path.
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class WeightSyncError(RuntimeError):
    """A weight update was rejected, or no server acknowledged it."""


@dataclass
class SyncReport:
    version: int
    mode: str  # "full" | "adapter": what was finally sent
    acked: dict[str, rollout_pb2.UpdateReply] = field(default_factory=dict)  # address -> reply
    unreachable: dict[str, str] = field(default_factory=dict)  # address -> error
    rejected: dict[str, str] = field(default_factory=dict)  # address -> error
    tensor_bytes: int = 0  # per server
    seconds: float = 0.0
    fell_back: bool = False


class WeightSyncClient:
    """Weight sync of one training model to a `ServerPool`.

    mode: "full" | "adapter" | "auto" (adapter when every target server runs LoRA and vLLM can load
    the model's adapter type, else full). fallback_to_full: after an adapter update fails, send FULL
    for the rest of the run. dtype: what FULL weights are sent in, the servers' serving dtype
    (`spec.model.dtype`: "bfloat16" | "float16" | "float32" | "auto" = the checkpoint's dtype, read
    from `checkpoint_dir`'s config.json; or a torch dtype; None = as trained, no cast). Floating
    tensors are cast one at a time as they are streamed (e.g. train fp32, serve bf16: half the
    bytes). name_map: extra renaming of FULL names (e.g. a VLM whose checkpoint names differ from
    its in-memory names). changed_only: FULL sends only the tensors training can change (a frozen vision
    tower is never resent; the servers keep what they have).
    """

    def __init__(
        self,
        pool: ServerPool,
        model: Any,
        *,
        mode: Mode = "full",
        fallback_to_full: bool = True,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        timeout_s: float = 600.0,
        dtype: torch.dtype | str | None = None,
        checkpoint_dir: str | Path | None = None,
        name_map: Callable[[str], str] | None = None,
        changed_only: bool = False,
    ) -> None:
        if mode not in ("full", "adapter", "auto"):
            raise ValueError(f"sync mode must be 'full', 'adapter' or 'auto', got {mode!r}")
        self.pool = pool
        self.model = model
        self.mode: Mode = mode
        self.fallback_to_full = fallback_to_full
        self.frame_bytes = frame_bytes
        self.timeout_s = timeout_s
        # Resolved now: an unknown dtype or an unreadable checkpoint fails at start, not at step 1.
        self.dtype: torch.dtype | None = serving_dtype(dtype, checkpoint_dir)
        self.name_map = name_map
        self.changed_only = changed_only  # FULL sends only what training can change (weight_export.changed_keys)
        self.forced_full_reason: str | None = None  # set once the run switched to FULL for good
        # A FULL stream merges/unmerges LoRA layers of the live model while it is sent: one stream
        # at a time, held until its producer has stopped (see _push).
        self._export_lock = threading.Lock()
        # Why `resync_server` (rank 0 alone, mid-rollout) cannot export the model, or None: under
        # ZeRO-3 only the trainer's collective sync sees whole parameters.
        self.export_blocked: str | None = None
        self._threads_lock = threading.Lock()
        self._threads_for = max(1, len(pool.servers))
        self._threads = ThreadPoolExecutor(max_workers=self._threads_for, thread_name_prefix="sync")
        if mode == "adapter":
            why = adapter_unsupported_reason(model)
            if why is not None:
                if not fallback_to_full:
                    raise ValueError(f"sync mode 'adapter' is impossible: {why} (use 'full' or 'auto')")
                self._force_full(f"adapter sync impossible: {why}")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _executor(self, n: int) -> ThreadPoolExecutor:
        """An executor with a thread per target server: every stream of a Fanout must run at once
        (the encoder blocks on the slowest consumer), and the pool may have grown (servers file)."""
        with self._threads_lock:
            if n > self._threads_for:
                old, self._threads = self._threads, ThreadPoolExecutor(max_workers=n, thread_name_prefix="sync")
                self._threads_for = n
                old.shutdown(wait=False)
            return self._threads

    # -- mode -----------------------------------------------------------------------------------
    def _force_full(self, why: str) -> None:
        if self.forced_full_reason is None:
            log.warning("weight sync switches to FULL for the rest of the run: %s", why)
            self.forced_full_reason = why

    def resolve_mode(self, servers: Sequence[RolloutServer]) -> tuple[str, str]:
        """("full" | "adapter", why) for a sync to `servers`."""
        if self.forced_full_reason is not None:
            return "full", self.forced_full_reason
        if self.mode == "full":
            return "full", "configured"
        unknown = [s for s in servers if s.state.lora_enabled is None or s.state.base_replaced is None]
        if unknown:
            self.pool.refresh(unknown)
        if self.mode == "adapter":
            replaced = [s.name for s in servers if s.state.base_replaced]
            if not replaced:
                return "adapter", "configured"
            why = f"{replaced} serve FULL-updated weights, an adapter would apply on top of them"
            if not self.fallback_to_full:
                raise WeightSyncError(f"ADAPTER sync impossible: {why} (restart them or use FULL)")
            self._force_full(why)
            return "full", why
        no_lora = [s.name for s in servers if not s.state.lora_enabled]
        if no_lora:
            return "full", f"auto: servers without LoRA enabled: {no_lora}"
        replaced = [s.name for s in servers if s.state.base_replaced]
        if replaced:
            return "full", f"auto: {replaced} serve FULL-updated weights, an adapter would apply on top of them"
        ranks = [s.state.max_lora_rank for s in servers if s.state.max_lora_rank]
        why = adapter_unsupported_reason(self.model, min(ranks) if ranks else 0)
        if why is not None:
            return "full", f"auto: {why}"
        return "adapter", "auto: servers run LoRA and the adapter is LoRA"

    # -- sync -----------------------------------------------------------------------------------
    def sync(self, version: int, servers: Sequence[RolloutServer] | None = None) -> SyncReport:
        """Push the model's current weights as `version` to `servers` (default: every server that
        is up, after applying a changed server list and re-probing the ones that were down).
        Returns when all reachable targets acknowledged; raises WeightSyncError when one rejected
        the update or none acknowledged."""
        t0 = time.perf_counter()
        if servers is None:
            self.pool.follow_or_wait(self.timeout_s)  # servers that left are not waited for; new ones get this version
            self.pool.refresh_due()
            servers = self.pool.up_servers()
        if not servers:
            raise WeightSyncError(
                f"no rollout server is reachable for weight version {version}: " + self.pool.describe_down()
            )
        mode, why = self.resolve_mode(servers)
        report = self._push(version, mode, servers)
        if report.rejected and mode == "adapter" and self.fallback_to_full:
            self._force_full(f"adapter update rejected: {report.rejected}")
            retry = [s for s in servers if s.address not in report.unreachable]
            report = self._push(version, "full", retry, previous=report)
            report.fell_back = True
        if report.rejected:
            raise WeightSyncError(
                f"weight version {version} ({report.mode}) was rejected by: "
                + "; ".join(f"{a}: {e}" for a, e in report.rejected.items())
            )
        if not report.acked:
            raise WeightSyncError(
                f"no rollout server acknowledged weight version {version}: "
                + "; ".join(f"{a}: {e}" for a, e in report.unreachable.items())
            )
        self.pool.set_current_version(version)
        WEIGHT_VERSION.set(version)
        report.seconds = time.perf_counter() - t0  # the loop times its "sync" phase itself
        log.info(
            "weight version %d synced (%s, %s) to %d server(s) in %.2fs%s",
            version, report.mode, why, len(report.acked), report.seconds,
            f"; unreachable: {sorted(report.unreachable)}" if report.unreachable else "",
        )  # fmt: skip
        return report

    def resync_server(self, server: RolloutServer) -> None:
        """Bring one server (e.g. a restarted pod on base weights) to the pool's current version.
        The rollout client's `resync` callback; the model must still hold that version's weights."""
        version = self.pool.current_version
        if version is None:
            raise WeightSyncError(f"cannot re-sync {server.name}: no weight version was synced yet")
        if self.pool.status(server).weight_version == version:
            return
        if self.export_blocked:
            raise WeightSyncError(f"cannot re-sync {server.name} now: {self.export_blocked}")
        mode, _ = self.resolve_mode([server])
        report = self._push(version, mode, [server])
        if report.rejected and mode == "adapter" and self.fallback_to_full:
            self._force_full(f"adapter update rejected: {report.rejected}")
            report = self._push(version, "full", [server], previous=report)
        if not report.acked:
            errors = {**report.unreachable, **report.rejected}
            raise WeightSyncError(f"re-sync of {server.name} to weight version {version} failed: {errors}")

    def _encode(self, version: int, mode: str) -> tuple[Any, Any]:
        """(header, request iterator) of one stream. FULL is planned from the model's metadata and
        its tensors produced while the requests are pulled (one LoRA layer merged at a time)."""
        if mode == "adapter":
            tensors, config_json = adapter_named_tensors(self.model)
            return encode_weight_stream(
                tensors, version=version, mode=ADAPTER, adapter_config_json=config_json, frame_bytes=self.frame_bytes
            )
        export = full_export(self.model, dtype=self.dtype, name_map=self.name_map,
                             changed_only=self.changed_only)
        return encode_planned_stream(export.specs, export, version=version, mode=FULL, frame_bytes=self.frame_bytes)

    def _push(
        self, version: int, mode: str, servers: Sequence[RolloutServer], previous: SyncReport | None = None
    ) -> SyncReport:
        with self._export_lock:
            # Serialized once (payload copied once, see rmsft.wire_encode), fed to every server; the
            # header is built here, in the caller, so a bad tensor name or dtype raises a clear error
            # now instead of a cancelled RPC from gRPC's thread.
            header, requests = self._encode(version, mode)
            source = _StoppableSource(requests)
            try:
                return self._send(version, mode, servers, header.total_bytes, source, previous)
            finally:
                # When every call has ended early (a server failed, a timeout) the fan-out thread may
                # still be inside the producer, merging a LoRA layer: wait for it, then close the
                # stream, so the model is not touched once the sync returned to the training loop.
                source.stop()

    def _send(
        self, version: int, mode: str, servers: Sequence[RolloutServer], tensor_bytes: int,
        source: _StoppableSource, previous: SyncReport | None,
    ) -> SyncReport:  # fmt: skip
        fan = Fanout(source, len(servers))

        def send(i: int, server: RolloutServer) -> tuple[str, Any]:
            try:
                call = update_weights_raw(server.channel)
                reply = call(fan.consumer(i), timeout=self.timeout_s, metadata=self.pool.metadata)
            except grpc.RpcError as e:
                if fan.error is not None:
                    raise WeightSyncError(f"encoding weight version {version} failed: {fan.error}") from fan.error
                return ("unreachable" if e.code() in _UNREACHABLE else "rejected"), describe_rpc_error(e)
            finally:
                fan.close(i)  # a failed call must not hold the other servers' streams back
            if reply.version != version:
                return "rejected", f"acknowledged version {reply.version}, expected {version}"
            return "acked", reply

        report = SyncReport(version=version, mode=mode, tensor_bytes=tensor_bytes)
        if previous is not None:
            report.unreachable.update(previous.unreachable)
        threads = self._executor(len(servers))
        futures = [threads.submit(send, i, s) for i, s in enumerate(servers)]
        for server, fut in zip(servers, futures, strict=True):
            outcome, detail = fut.result()
            if outcome == "acked":
                report.acked[server.address] = detail
                self.pool.mark_up(server, version=version)
                with self.pool.lock:
                    server.state.base_replaced = mode == "full"
                WEIGHT_SYNC_BYTES.labels(mode=mode).inc(tensor_bytes)
            elif outcome == "unreachable":
                report.unreachable[server.address] = detail
                self.pool.mark_down(server, f"weight sync: {detail}")
            else:
                report.rejected[server.address] = detail
                # Its old version is still serving (atomic apply); fence it until it is current.
                self.pool.mark_stale(server, None, f"weight sync rejected: {detail}")
        return report


class _StoppableSource:
    """The request iterator handed to the fan-out thread, stoppable from the syncing thread:
    `stop()` waits for a `next()` in progress and closes the iterator, after which `next()` ends
    the stream without calling it."""

    def __init__(self, requests: Any) -> None:
        self._requests = requests
        self._lock = threading.Lock()
        self._stopped = False

    def __iter__(self) -> _StoppableSource:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._stopped:
                raise StopIteration
            return next(self._requests)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            close = getattr(self._requests, "close", None)
            if close is not None:
                close()
