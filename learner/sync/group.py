"""Transport nccl: full weights go from the learner's rank 0 to every server's engine workers over one
weight-transfer group (vLLM's weight-transfer API; `rmsft.weight_wire.transfer` has the backends), driven over
rmsft's own gRPC channel.

Control path, per full sync:
1. **Membership.** The group is the servers the sync targets, in order; the learner is rank 0 and server k's
   workers take the next `tensor_parallel_size` ranks. Each server reports the group it is in (`GetStatus`'s
   `weight_group`): a restarted server is in none, so the learner builds a new group (`JoinWeightGroup` on every
   member while it hosts the rendezvous) whenever the targets or any member's report changed.
2. **Ready.** An `UpdateWeights` stream per server whose header lists the tensors (`transfer_group`): each server
   checks the listing against its model, waits for its running calls to finish and says ready (initial
   metadata). Only when every member is ready does the learner send the trailer ("go") and broadcast; otherwise it
   ends the streams (nothing applied anywhere) and the sync goes over gRPC instead.
3. **Broadcast.** As the export produces the tensors (one LoRA layer merged at a time, as for gRPC), packed into
   buckets of `bucket_bytes` (spec.sync.bucketMegabytes), one broadcast per bucket; every member unpacks by the
   header's listing with the bucket size it agreed at the join (its JoinWeightGroupReply echoes it; a member that
   answers another size is not taken into the group). 0: one broadcast per tensor. Each server applies, takes the
   header's (run id, number) as its version and answers.

A member lost mid-broadcast fails its collective after the group's timeout; the learner's broadcast fails with it
(the collective timeout is the bound, never a hang), the group is dropped, the servers that applied say so, and
the rest are re-synced over gRPC (`WeightSyncClient.resync_server`) once back. The next full sync builds a new
group from the servers then up. Adapters, re-syncs of one server and the fallback go over gRPC.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from rmsft_protos import rollout_pb2, rollout_pb2_grpc

from learner.rollouts.pool import RolloutServer
from rmsft.weight_wire import FULL, TensorSpec, update_weights_raw
from rmsft.weight_wire.outcomes import GROUP_READY_METADATA, outcome_of_error

log = logging.getLogger("rmsft.learner.sync")


class GroupUnusable(RuntimeError):
    """The group could not be built or used for this sync; the caller sends over gRPC instead."""


def address_toward(server_address: str) -> str:
    """This host's address on the route to `server_address` (host:port): the one the servers can reach the
    rendezvous at. A UDP connect sends nothing; it only picks the interface."""
    host = server_address.rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class WeightGroup:
    """The learner's side of the weight-transfer group. `backend`: rmsft.weight_wire.transfer's NCCL or GLOO.
    `timeout_s` bounds the rendezvous and each broadcast; `metadata`: the pool's call metadata (auth);
    `bucket_bytes`: the bucket size of every update over the group (0: one broadcast per tensor)."""

    def __init__(
        self,
        backend: str,
        *,
        timeout_s: float,
        metadata: Sequence[tuple[str, str]] = (),
        address: str | None = None,
        bucket_bytes: int = 0,
    ) -> None:
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.metadata = tuple(metadata)
        self.address = address  # None: the route toward the first member decides
        self.id = ""
        self.members: tuple[str, ...] = ()
        self.sender: Any = None
        self.ranks: dict[str, range] = {}  # member address -> its group ranks
        self.failure: GroupFailure | None = None  # how the last push broke, None when it did not
        self.builds = 0  # groups built in this run (the log and tests read it)
        self.updates = 0  # updates broadcast over a group in this run

    # -- membership ---------------------------------------------------------------------------------
    def current_for(self, servers: Sequence[RolloutServer], statuses: dict[str, rollout_pb2.StatusReply]) -> bool:
        """Whether the group as built serves a sync to `servers` as they report now."""
        return (
            bool(self.id)
            and tuple(s.address for s in servers) == self.members
            and all(statuses[s.address].weight_group == self.id for s in servers)
        )

    def build(self, servers: Sequence[RolloutServer], statuses: dict[str, rollout_pb2.StatusReply]) -> None:
        """A new group of the learner and `servers`. Raises GroupUnusable naming the servers that did not join."""
        from rmsft.weight_wire.transfer import make_sender

        self.drop()
        other = [
            f"{s.name} ({statuses[s.address].weight_transfer or 'started without --weight-transfer'})"
            for s in servers
            if statuses[s.address].weight_transfer != self.backend
        ]
        if other:  # a member that cannot join would hold the others in the rendezvous until its timeout
            raise GroupUnusable(
                f"weight-transfer group not formed: not every server joins {self.backend} groups: " + ", ".join(other)
            )
        group_id = uuid.uuid4().hex[:12]
        sizes = [max(1, statuses[s.address].tensor_parallel_size) for s in servers]
        world = 1 + sum(sizes)
        address = self.address or address_toward(servers[0].address)
        sender = make_sender(self.backend, world, self.timeout_s, address=address, bucket_bytes=self.bucket_bytes)
        calls = []
        ranks: dict[str, range] = {}
        offset = 1
        for server, size in zip(servers, sizes, strict=True):
            request = rollout_pb2.JoinWeightGroupRequest(
                group_id=group_id,
                master_address=address,
                master_port=sender.port,
                world_size=world,
                rank_offset=offset,
                timeout_s=self.timeout_s,
                bucket_bytes=self.bucket_bytes,
            )
            ranks[server.address] = range(offset, offset + size)
            calls.append(
                rollout_pb2_grpc.RolloutServiceStub(server.channel).JoinWeightGroup.future(
                    request, timeout=self.timeout_s + 30, metadata=self.metadata
                )
            )
            offset += size
        joined: list[BaseException | None] = [None]

        def join() -> None:
            try:
                sender.join()
            except BaseException as e:  # reported below with the servers' answers
                joined[0] = e

        t = threading.Thread(target=join, name="rmsft-weight-group-join", daemon=True)
        t.start()
        failed = {}
        for server, call in zip(servers, calls, strict=True):
            try:
                reply = call.result()
            except grpc.RpcError as e:
                failed[server.address] = f"{e.code().name}: {e.details()}"
                continue
            if reply.bucket_bytes != self.bucket_bytes:  # it would cut the broadcasts apart differently
                failed[server.address] = (
                    f"it unpacks buckets of {reply.bucket_bytes} bytes, the learner sends "
                    f"{self.bucket_bytes} (a server image older than spec.sync.bucketMegabytes "
                    "answers 0)"
                )
        # Every server's join has ended (joined or failed), so none is held in the rendezvous any more; the learner's
        # own end ends with them (or at its timeout).
        t.join(self.timeout_s + 30)
        if joined[0] is not None and not failed:
            failed["learner"] = str(joined[0])
        if failed or t.is_alive():
            sender.close()
            why = "; ".join(f"{a}: {m}" for a, m in failed.items()) if failed else "the learner's join timed out"
            raise GroupUnusable(f"weight-transfer group not formed: {why}")
        self.id, self.members, self.sender = group_id, tuple(s.address for s in servers), sender
        self.ranks = ranks
        self.builds += 1
        log.info(
            "weight-transfer group %s (%s): the learner and %d server(s), %d ranks, buckets of %d bytes",
            group_id,
            self.backend,
            len(servers),
            world,
            self.bucket_bytes,
        )

    def drop(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.id, self.members, self.sender, self.ranks = "", (), None, {}

    # -- one update -----------------------------------------------------------------------------------
    def push(
        self,
        servers: Sequence[RolloutServer],
        *,
        number: int,
        run_id: str,
        specs: Sequence[tuple[str, TensorSpec]],
        tensors: Iterable[tuple[str, Any]],
        timeout_s: float,
        replies: dict[str, rollout_pb2.UpdateReply] | None = None,
    ) -> dict[str, rollout_pb2.RelayOutcome]:
        """Send one FULL update over the group to `servers` (its members, in order). Returns each server's outcome
        (and puts each OK reply in `replies`); raises GroupUnusable when a member was not ready (nothing was sent to
        anyone)."""
        self.failure = None
        header = rollout_pb2.WeightHeader(
            version=number,
            run_id=run_id,
            mode=FULL,
            tensor_count=len(specs),
            total_bytes=sum(spec.nbytes for _, spec in specs),
            transfer_group=rollout_pb2.TransferGroup(
                group_id=self.id,
                tensors=[
                    rollout_pb2.SharedTensor(name=n, dtype=spec.dtype, shape=list(spec.shape)) for n, spec in specs
                ],
            ),
        )
        first = rollout_pb2.WeightChunk(header=header).SerializeToString()
        go_chunk = rollout_pb2.WeightChunk(trailer=rollout_pb2.WeightTrailer()).SerializeToString()
        decided = threading.Event()
        go: list[bool] = []

        def requests() -> Any:
            yield first
            decided.wait()
            if go:
                yield go_chunk

        calls = [
            update_weights_raw(s.channel).future(requests(), timeout=timeout_s, metadata=self.metadata) for s in servers
        ]
        refused = {}
        ready = False
        try:
            for server, call in zip(servers, calls, strict=True):
                metadata = call.initial_metadata() or ()
                if not set(GROUP_READY_METADATA) <= set(metadata):
                    refused[server.address] = call
            ready = not refused
        finally:  # the go only when every member said ready; anything else ends every stream with nothing applied
            if ready:
                go.append(True)
            decided.set()
        if refused:
            reasons = []
            for address, call in refused.items():
                try:
                    call.result()
                    reasons.append(f"{address}: answered without saying ready")
                except grpc.RpcError as e:
                    reasons.append(f"{address}: {e.code().name}: {e.details()}")
            for call in calls:
                call.cancel()
            self.drop()
            raise GroupUnusable("not every member was ready, nothing was sent: " + "; ".join(reasons))
        try:
            self.sender.send(tensors)
            self.updates += 1
        except Exception as e:  # a member late or lost mid-broadcast or at the finish: cut off, nothing committed
            self.failure = self._cut_off(servers, calls, e, replies)
            return self.failure.outcomes
        outcomes = {}
        for server, call in zip(servers, calls, strict=True):
            try:
                reply = call.result()
                if replies is not None:
                    replies[server.address] = reply
                outcomes[server.address] = rollout_pb2.RelayOutcome(
                    address=server.address, version=reply.version, run_id=reply.run_id
                )
            except grpc.RpcError as e:
                outcomes[server.address] = outcome_of_error(server.address, e)
        return outcomes

    def _cut_off(
        self,
        servers: Sequence[RolloutServer],
        calls: list[Any],
        error: Exception,
        replies: dict[str, rollout_pb2.UpdateReply] | None,
    ) -> GroupFailure:
        """The update broke (`error`): the group is closed (its members still in an op fail), the members it
        names late, and those whose call does not answer within the deadline, are cut off (their calls
        cancelled); every other member answers what it holds (nothing applied: the previous version)."""
        from rmsft.weight_wire.transfer import MembersLate

        late_ranks = set(error.ranks) if isinstance(error, MembersLate) else set()
        log.warning(
            "weight-transfer group %s failed mid-update (%s); it is rebuilt at the next full sync", self.id, error
        )
        ranks = self.ranks
        self.drop()
        failure = GroupFailure(str(error))
        deadline = time.monotonic() + self.timeout_s
        for server, call in zip(servers, calls, strict=True):
            if late_ranks & set(ranks.get(server.address, ())):
                call.cancel()  # a stopped member answers nothing; a stalled one is not waited for twice
                failure.cut_off.append(server)
                continue
            try:
                reply = call.result(timeout=max(0.0, deadline - time.monotonic()))
                if replies is not None:
                    replies[server.address] = reply
                failure.outcomes[server.address] = rollout_pb2.RelayOutcome(
                    address=server.address, version=reply.version, run_id=reply.run_id
                )
            except grpc.FutureTimeoutError:
                call.cancel()
                failure.cut_off.append(server)
            except grpc.RpcError as e:
                failure.outcomes[server.address] = outcome_of_error(server.address, e)
        for server in failure.cut_off:
            failure.outcomes[server.address] = rollout_pb2.RelayOutcome(
                address=server.address,
                code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
                message=f"cut off: it missed the weight-transfer group's deadline of {self.timeout_s:g}s",
            )
        return failure


@dataclass
class GroupFailure:
    """An update over the group that broke: why, the members cut off, and every member's outcome."""

    reason: str
    cut_off: list[RolloutServer] = field(default_factory=list)
    outcomes: dict[str, rollout_pb2.RelayOutcome] = field(default_factory=dict)
