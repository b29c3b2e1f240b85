"""Pushes the learner's weights to the rollout servers (`UpdateWeights`, the contract in
`rmsft.weight_wire`).

`WeightSyncClient.sync(number)` sends FULL (merged, HF names) or ADAPTER (PEFT LoRA tensors +
adapter_config.json) weights to every reachable server and returns only when each of them
acknowledged `version` of the pool's run: a weight version is the pair (run id, number)
(`rmsft.weight_wire.version`), every update announces both, and an answer naming another pair
is no acknowledgement. The learner produces and sends an update once whatever the pool's size:
over grpc to the first server, which relays it to the others; over shm written once into
node-local shared memory that every server reads; over nccl broadcast once to every server's engine
workers through a weight-transfer group (`learner.sync.group`: FULL only; adapters, re-syncs and a group
that cannot be used go over grpc). A sync's result is one outcome per server; a
server that rejects the update fails the sync (after one switch to FULL when `fallback_to_full` is
on and ADAPTER was rejected) and is fenced (its old version still serves, and no rollout goes to
it until it is current). A server that is unreachable is marked down and left out: the rollout
client re-syncs it (`resync_server`) before it gets work again.

FULL is a stream: its header comes from the model's metadata, then `learner.sync.weights.full_export`
merges one LoRA layer at a time as the frames are sent, in the servers' serving dtype, so a sync
holds one layer's worth of extra memory on the training device, not a merged copy of the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grpc
from rmsft_protos import rollout_pb2

from learner.rollouts.pool import RolloutServer, ServerPool
from learner.sync.group import GroupUnusable, WeightGroup
from learner.sync.weights import (
    adapter_named_tensors,
    adapter_unsupported_reason,
    full_export,
    serving_dtype,
)
from learner.tracking.metrics import WEIGHT_SYNC_BYTES, WEIGHT_VERSION
from rmsft import pause_points
from rmsft.weight_wire import (
    ADAPTER,
    DEFAULT_FRAME_BYTES,
    FULL,
    SharedSpaceError,
    SharedUpdate,
    encode_planned_stream,
    set_version,
    stream_header_and_specs,
    update_weights_raw,
    version_of,
)
from rmsft.weight_wire.outcomes import outcome_of_error, relayed_from_error

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("rmsft.learner.sync")

Mode = Literal["full", "adapter", "auto"]
Transport = Literal["grpc", "shm", "nccl"]
_WIRE_MODE = {"full": FULL, "adapter": ADAPTER}
# The server never got (or cannot answer about) the stream: leave it to the re-sync path.
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


class WeightSyncError(RuntimeError):
    """A weight update was rejected, or no server acknowledged it."""


@dataclass
class SyncReport:
    number: int  # the weight version's number; with `run_id`, the version
    mode: str  # "full" | "adapter": what was finally sent
    run_id: str = ""  # the run whose version number `number` is (the pool's)
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
    tower is never resent; the servers keep what they have). transport: "grpc" (the stream goes to
    the first server, which relays it to the others), "shm" (written once into `shared_dir`, a
    node-local shared-memory dir every server reads; gRPC carries only header and digest) or "nccl" (FULL
    broadcast over a weight-transfer group of `group_backend`: "nccl" on GPUs, "rmsft_gloo" on the CPU;
    `group_timeout_s` bounds its rendezvous and each broadcast; `group_bucket_bytes` packs its tensors into
    buckets of that size, one broadcast each, 0 one per tensor).
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
        transport: Transport = "grpc",
        shared_dir: str = "",
        group_backend: str = "rmsft_gloo",
        group_timeout_s: float = 120.0,
        group_bucket_bytes: int = 0,
        keep_generating: bool = False,
    ) -> None:
        if mode not in ("full", "adapter", "auto"):
            raise ValueError(f"sync mode must be 'full', 'adapter' or 'auto', got {mode!r}")
        # spec.training.rollout.inflight: FULL updates over grpc or shm ask the servers to apply under their
        # running Generate calls (WeightHeader.keep_generating); ADAPTER and nccl updates always drain.
        self.keep_generating = keep_generating
        if transport not in ("grpc", "shm", "nccl"):
            raise ValueError(f"sync transport must be 'grpc', 'shm' or 'nccl', got {transport!r}")
        self.group: WeightGroup | None = None
        if transport == "nccl":
            from rmsft.weight_wire.transfer import check_backend

            check_backend(group_backend)
            self.group = WeightGroup(
                group_backend, timeout_s=group_timeout_s, metadata=pool.metadata, bucket_bytes=group_bucket_bytes
            )
        if transport == "shm" and not (shared_dir and Path(shared_dir).is_dir()):
            raise ValueError(
                f"sync transport 'shm' needs a shared-weights dir the servers read too (RMSFT_SHARED_WEIGHTS_DIR); "
                f"{shared_dir or 'none'} is not a directory"
            )
        self.transport: Transport = transport
        self.shared_dir = shared_dir
        if transport == "shm":
            # Files a learner killed before any server opened them (a restarted learner of this job
            # comes here first); servers that still read one keep it open, only its name goes.
            for stale in SharedUpdate.leftovers(shared_dir):
                log.warning("removing %s, left by an earlier learner", stale)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
        self.pool = pool
        self.model = model
        self.mode: Mode = mode
        self.fallback_to_full = fallback_to_full
        self.frame_bytes = frame_bytes
        self.timeout_s = timeout_s
        # Resolved now: an unknown dtype or an unreadable checkpoint fails at start, not at step 1.
        self.dtype: torch.dtype | None = serving_dtype(dtype, checkpoint_dir)
        self.name_map = name_map
        self.changed_only = changed_only  # FULL sends only what training can change (learner.sync.weights.changed_keys)
        self.forced_full_reason: str | None = None  # set once the run switched to FULL for good
        # A FULL stream merges/unmerges LoRA layers of the live model while it is sent: one stream
        # at a time, held until its producer has stopped (see _push).
        self._export_lock = threading.Lock()
        # Why `resync_server` (rank 0 alone, mid-rollout) cannot export the model, or None: under
        # ZeRO-3 only the training loop's collective sync sees whole parameters.
        self.export_blocked: str | None = None
        if mode == "adapter":
            why = adapter_unsupported_reason(model)
            if why is not None:
                if not fallback_to_full:
                    raise ValueError(f"sync mode 'adapter' is impossible: {why} (use 'full' or 'auto')")
                self._force_full(f"adapter sync impossible: {why}")

    def close(self) -> None:
        """Leave the weight-transfer group (transport nccl); the servers leave it at their next join."""
        if self.group is not None:
            self.group.drop()

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
        unsupported = adapter_unsupported_reason(self.model, min(ranks) if ranks else 0)
        if unsupported is not None:
            return "full", f"auto: {unsupported}"
        return "adapter", "auto: servers run LoRA and the adapter is LoRA"

    # -- sync -----------------------------------------------------------------------------------
    def sync(self, number: int, servers: Sequence[RolloutServer] | None = None) -> SyncReport:
        """Push the model's current weights as version `number` to `servers` (default: every server that
        is up, after applying a changed server list and re-probing the ones that were down).
        Returns when all reachable targets acknowledged; raises WeightSyncError when one rejected
        the update or none acknowledged."""
        t0 = time.perf_counter()
        if servers is None:
            self.pool.follow_or_wait(self.timeout_s)  # servers that left are not waited for; new ones get this version
            self.pool.refresh_due()
            servers = self.pool.up_servers()
            if not servers and self.pool.wait_for_a_server(f"weight version {number}"):
                servers = self.pool.up_servers()
        if not servers:
            raise WeightSyncError(
                f"no rollout server is reachable for weight version {number}: " + self.pool.describe_down()
            )
        mode, why = self.resolve_mode(servers)
        report = self._push(number, mode, servers)
        if not report.acked and not report.rejected and self.pool.wait_for_a_server(f"weight version {number}"):
            # Every target was unreachable (the only server restarting): once one is back, to it.
            servers = self.pool.up_servers()
            mode, why = self.resolve_mode(servers)
            report = self._push(number, mode, servers)
        if report.rejected and mode == "adapter" and self.fallback_to_full:
            self._force_full(f"adapter update rejected: {report.rejected}")
            retry = [s for s in servers if s.address not in report.unreachable]
            report = self._push(number, "full", retry, previous=report)
            report.fell_back = True
        if report.rejected:
            raise WeightSyncError(
                f"weight version {number} ({report.mode}) was rejected by: "
                + "; ".join(f"{a}: {e}" for a, e in report.rejected.items())
            )
        if not report.acked:
            raise WeightSyncError(
                f"no rollout server acknowledged weight version {number}: "
                + "; ".join(f"{a}: {e}" for a, e in report.unreachable.items())
            )
        self.pool.set_current_version(number)
        WEIGHT_VERSION.set(number)
        report.seconds = time.perf_counter() - t0  # the loop times its "sync" phase itself
        log.info(
            "weight version %s synced (%s, %s) to %d server(s) in %.2fs%s",
            self.pool.version(number).describe(),
            report.mode,
            why,
            len(report.acked),
            report.seconds,
            f"; unreachable: {sorted(report.unreachable)}" if report.unreachable else "",
        )
        return report

    def resync_server(self, server: RolloutServer) -> None:
        """Bring one server (e.g. a restarted pod on base weights, or one holding another run's
        weights) to the pool's current version. The rollout client's `resync` callback; the model
        must still hold that version's weights."""
        current = self.pool.current
        if current is None:
            raise WeightSyncError(f"cannot re-sync {server.name}: no weight version was synced yet")
        number = current.number
        if version_of(self.pool.status(server)) == current:  # this run's version: the number alone is not enough
            return
        if self.export_blocked:
            raise WeightSyncError(f"cannot re-sync {server.name} now: {self.export_blocked}")
        mode, _ = self.resolve_mode([server])
        # Over gRPC whatever the transport: the group's other members are not part of this one's catching up.
        report = self._push(number, mode, [server], over_group=False)
        if report.rejected and mode == "adapter" and self.fallback_to_full:
            self._force_full(f"adapter update rejected: {report.rejected}")
            report = self._push(number, "full", [server], previous=report, over_group=False)
        if not report.acked:
            errors = {**report.unreachable, **report.rejected}
            raise WeightSyncError(f"re-sync of {server.name} to weight version {current.describe()} failed: {errors}")

    def _update_parts(self, mode: str, number: int) -> tuple[list, Any, str]:
        """(specs, lazy tensors, adapter config JSON) of the update. FULL is planned from the model's
        metadata and its tensors produced as they are consumed (one LoRA layer merged at a time)."""
        lazy: Iterable[tuple[str, torch.Tensor]]
        if mode == "adapter":
            tensors, config_json = adapter_named_tensors(self.model)
            _, planned = stream_header_and_specs(tensors, number=0, mode=ADAPTER, adapter_config_json=config_json)
            specs, lazy = [(n, spec) for n, _, spec in planned], [(n, t) for n, t, _ in planned]
        else:
            export = full_export(self.model, dtype=self.dtype, name_map=self.name_map, changed_only=self.changed_only)
            specs, lazy, config_json = export.specs, export, ""
        if pause_points.armed("sync"):  # tests: stopped mid-update (rmsft.pause_points)
            lazy = _pausing_after_first(lazy, number)
        return specs, lazy, config_json

    def _push(
        self,
        number: int,
        mode: str,
        servers: Sequence[RolloutServer],
        previous: SyncReport | None = None,
        over_group: bool = True,
    ) -> SyncReport:
        # One update at a time: a FULL export merges/unmerges LoRA layers of the live model while it runs.
        with self._export_lock:
            replies: dict[str, rollout_pb2.UpdateReply] = {}  # the servers the learner called itself
            grouped = None
            if self.group is not None and over_group and mode == "full":
                grouped = self._push_group(number, servers, replies)
            if grouped is not None:
                outcomes, total = grouped
            elif self.transport == "shm":
                outcomes, total = self._push_shared(number, mode, servers, replies)
            else:
                outcomes, total = self._push_relayed(number, mode, servers, replies)
        want = self.pool.version(number)
        report = SyncReport(number=number, mode=mode, run_id=want.run_id, tensor_bytes=total)
        if previous is not None:
            report.unreachable.update(previous.unreachable)
        for server in servers:
            o = outcomes.get(server.address)
            if o is None:
                o = rollout_pb2.RelayOutcome(
                    address=server.address, code=grpc.StatusCode.UNAVAILABLE.value[0], message="no outcome reported"
                )
            code = _STATUS_BY_VALUE.get(o.code, grpc.StatusCode.UNKNOWN)
            got = version_of(o)
            if code == grpc.StatusCode.OK and got == want:
                report.acked[server.address] = replies.get(server.address) or set_version(
                    rollout_pb2.UpdateReply(), got
                )
                self.pool.mark_up(server, weights=want)
                with self.pool.lock:
                    server.state.base_replaced = mode == "full"
                WEIGHT_SYNC_BYTES.labels(mode=mode).inc(total)
            elif code == grpc.StatusCode.OK:
                detail = f"acknowledged version {got.describe()}, expected {want.describe()}"
                report.rejected[server.address] = detail
                self.pool.mark_stale(server, None, f"weight sync rejected: {detail}")
            elif code in _UNREACHABLE:
                detail = f"{code.name}: {o.message}"
                report.unreachable[server.address] = detail
                self.pool.mark_down(server, f"weight sync: {detail}")
            else:
                detail = f"{code.name}: {o.message}"
                report.rejected[server.address] = detail
                # Its old version is still serving (atomic apply); fence it until it is current.
                self.pool.mark_stale(server, None, f"weight sync rejected: {detail}")
        return report

    def _push_relayed(
        self, number: int, mode: str, servers: Sequence[RolloutServer], replies: dict[str, rollout_pb2.UpdateReply]
    ) -> tuple[dict[str, rollout_pb2.RelayOutcome], int]:
        """Transport grpc: the stream goes to the first server, which relays it down the list
        (rollout_svc/relay.py), so the learner encodes and sends it once whatever the pool's size.
        A head that cannot be reached, or that refused before relaying, is recorded and the next
        server becomes the head of the rest (the update is produced again: only on failures)."""
        outcomes: dict[str, rollout_pb2.RelayOutcome] = {}
        pending = list(servers)
        total = 0
        while pending:
            head, rest = pending[0], pending[1:]
            specs, tensors, config_json = self._update_parts(mode, number)
            # The header is built here, in the caller, so a bad tensor name or dtype raises a clear
            # error now instead of a cancelled RPC from gRPC's thread.
            header, requests = encode_planned_stream(
                specs,
                tensors,
                number=number,
                run_id=self.pool.run_id,
                mode=_WIRE_MODE[mode],
                adapter_config_json=config_json,
                frame_bytes=self.frame_bytes,
                relay_to=[s.address for s in rest],
            )
            total = header.total_bytes
            header.keep_generating = self.keep_generating and mode == "full"  # serialized at the first frame
            source = _StoppableSource(requests)
            try:
                reply = update_weights_raw(head.channel)(source, timeout=self.timeout_s, metadata=self.pool.metadata)
                replies[head.address] = reply
                got = [_outcome(head.address, reply), *reply.relayed]
            except grpc.RpcError as e:
                if source.error is not None:
                    raise WeightSyncError(f"encoding weight version {number} failed: {source.error}") from source.error
                got = [outcome_of_error(head.address, e), *relayed_from_error(e)]
            finally:
                # When the call ended early (a refusal, a timeout) gRPC's thread may still be inside the
                # producer, merging a LoRA layer: wait for it, then close the stream, so the model is not
                # touched once the sync returned to the training loop.
                source.stop()
            for o in got:
                outcomes.setdefault(o.address, o)
            pending = [s for s in rest if s.address not in outcomes]
        return outcomes, total

    def _push_group(
        self, number: int, servers: Sequence[RolloutServer], replies: dict[str, rollout_pb2.UpdateReply]
    ) -> tuple[dict[str, rollout_pb2.RelayOutcome], int] | None:
        """Transport nccl: the update over the weight-transfer group, built first when the targets or a member's
        group changed; None when the group cannot be used now (the caller sends over gRPC; the log says why)."""
        group = self.group
        assert group is not None
        replied = self.pool.refresh(servers)  # in parallel; None for a server that did not answer
        silent = [s.name for s, r in zip(servers, replied, strict=True) if r is None]
        if silent:
            log.warning("weight version %s goes over gRPC: %s did not answer", number, ", ".join(silent))
            return None
        statuses = {s.address: r for s, r in zip(servers, replied, strict=True) if r is not None}  # all (silent: out)
        try:
            if not group.current_for(servers, statuses):
                group.build(servers, statuses)
            specs, tensors, _ = self._update_parts("full", number)
            outcomes = group.push(
                servers,
                number=number,
                run_id=self.pool.run_id,
                specs=specs,
                tensors=tensors,
                timeout_s=self.timeout_s,
                replies=replies,
            )
        except GroupUnusable as e:
            log.warning("weight version %s goes over gRPC: %s", number, e)
            return None
        if group.failure is not None:
            self._group_failed(number, servers, group.failure)
        return outcomes, sum(spec.nbytes for _, spec in specs)

    def _group_failed(self, number: int, servers: Sequence[RolloutServer], failure: Any) -> None:
        """An update over the group broke (learner.sync.group.GroupFailure): nobody claims version `number`. The
        members cut off are down until they answer again (in no group then, so the rollout client re-syncs them
        over gRPC first); the others said what they hold, the previous whole version, and keep serving it. The
        next full sync builds a new group of the servers then up."""
        cut = {s.address for s in failure.cut_off}
        for server in failure.cut_off:
            self.pool.mark_down(server, f"cut off from the weight-transfer group at weight version {number}")
        others = []
        for server in servers:
            o = failure.outcomes.get(server.address)
            if server.address in cut or o is None:
                continue
            code = _STATUS_BY_VALUE.get(o.code, grpc.StatusCode.UNKNOWN)
            if code == grpc.StatusCode.OK:  # it read the COMMIT before the update broke: whole, but not the pool's
                self.pool.mark_stale(server, None, f"holds weight version {number} of an update that broke")
                others.append(f"{server.name}: holds version {number} whole")
            else:
                from rmsft.weight_wire.transfer import NOTHING_LOADED

                if NOTHING_LOADED not in o.message:  # dead, or partly replaced (it exits): down until it answers
                    self.pool.mark_down(server, f"weight sync: {code.name}: {o.message}")
                others.append(f"{server.name}: {code.name}: {o.message}")
        said = ", ".join(s.name for s in failure.cut_off) or "none"
        raise WeightSyncError(
            f"weight version {number} over the weight-transfer group failed ({failure.reason}): no server took it. "
            f"Cut off (missed the group's deadline of {self.group.timeout_s if self.group else 0:g}s; each re-syncs "
            f"over gRPC when it answers again): {said}. The others: " + ("; ".join(others) or "none")
        )

    def _push_shared(
        self, number: int, mode: str, servers: Sequence[RolloutServer], replies: dict[str, rollout_pb2.UpdateReply]
    ) -> tuple[dict[str, rollout_pb2.RelayOutcome], int]:
        """Transport shm: the update is written once into the shared-weights dir while every server
        holds a call open on its header; the trailer (the digest) ends the calls, and the file is
        removed once all of them answered, or on any failure."""
        specs, tensors, config_json = self._update_parts(mode, number)
        try:
            update = SharedUpdate.create(
                self.shared_dir,
                specs,
                number=number,
                run_id=self.pool.run_id,
                mode=_WIRE_MODE[mode],
                adapter_config_json=config_json,
            )
        except SharedSpaceError as e:
            raise WeightSyncError(
                f"RESOURCE_EXHAUSTED: {e}; nothing was sent (free memory there, or use spec.sync.transport: grpc)"
            ) from e
        update.header.keep_generating = self.keep_generating and mode == "full"
        done = threading.Event()
        digest: list[bytes] = []

        def requests() -> Any:
            yield rollout_pb2.WeightChunk(header=update.header).SerializeToString()
            done.wait()
            if not digest:  # the write failed or was interrupted: the call was cancelled, nothing is applied
                return
            yield rollout_pb2.WeightChunk(trailer=rollout_pb2.WeightTrailer(digest=digest[0])).SerializeToString()

        results: list[rollout_pb2.RelayOutcome] = []
        try:
            calls = [
                update_weights_raw(s.channel).future(requests(), timeout=self.timeout_s, metadata=self.pool.metadata)
                for s in servers
            ]
            try:
                # Write only once every server has the file open (or has already refused): from then on,
                # if this process dies mid-write, each of them sees its call end and removes the file.
                for call in calls:
                    call.initial_metadata()
                digest.append(update.write(tensors, self.frame_bytes))
            except Exception as e:
                raise WeightSyncError(f"writing weight version {number} to {update.path} failed: {e}") from e
            finally:
                if not digest:  # abandoned (a failure, or a signal stopping the run): every server applies nothing
                    for call in calls:
                        call.cancel()
                done.set()
                for server, call in zip(servers, calls, strict=True):
                    try:
                        reply = call.result()
                        replies[server.address] = reply
                        results.append(_outcome(server.address, reply))
                    except grpc.RpcError as e:
                        results.append(outcome_of_error(server.address, e))
                    except grpc.FutureCancelledError:  # abandoned above
                        results.append(
                            rollout_pb2.RelayOutcome(
                                address=server.address,
                                code=grpc.StatusCode.CANCELLED.value[0],
                                message="the update was not written",
                            )
                        )
        finally:
            update.remove()
        return {o.address: o for o in results}, update.header.total_bytes


def _pausing_after_first(tensors: Any, number: int) -> Any:
    """`tensors`, with the sync pause point (rmsft.pause_points) reached when the one after the first is asked for:
    the first is out (written into the shared file, or streamed), the rest not."""
    for i, item in enumerate(tensors):
        if i == 1:
            pause_points.pause_at("sync", number)
        yield item


def _outcome(address: str, reply: rollout_pb2.UpdateReply) -> rollout_pb2.RelayOutcome:
    """A server's OK answer as an outcome: the weight version (run id and number) it holds now."""
    return set_version(rollout_pb2.RelayOutcome(address=address), version_of(reply))


class _StoppableSource:
    """The request iterator handed to the fan-out thread, stoppable from the syncing thread:
    `stop()` waits for a `next()` in progress and closes the iterator, after which `next()` ends
    the stream without calling it."""

    def __init__(self, requests: Any) -> None:
        self._requests = requests
        self._lock = threading.Lock()
        self._stopped = False
        self.error: BaseException | None = None  # what broke the producer, if anything

    def __iter__(self) -> _StoppableSource:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._stopped:
                raise StopIteration
            try:
                return next(self._requests)
            except StopIteration:
                raise
            except BaseException as e:  # gRPC only sees a cancelled call; the sync reports this
                self.error = e
                raise

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            close = getattr(self._requests, "close", None)
            if close is not None:
                close()
