"""Server mode behind the rollout interface (`learner.rollouts.interface`); the other home, the engine inside
every rank (spec.rollout.mode: colocate), is `learner.rollouts.colocate`.

`ServerRollouts` wraps what server mode always had: the ordered pool, the rollout client (ordering,
failover, fencing) and the weight sender (FULL/ADAPTER over gRPC or shared memory). The sender is given,
built by the caller on the same pool (`learner.train.server_setup.build_server_rollouts`), so this room does
not depend on the weight-sync package that sits above it. Only rank 0 builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from learner.rollouts.client import RolloutClient
from learner.rollouts.interface import SourceInfo
from learner.rollouts.pool import RolloutServer, ServerPool
from learner.rollouts.requests import Rollout, RolloutRequest


class WeightSender(Protocol):
    """What the server home needs of the weight-sync client (`learner.sync.client.WeightSyncClient`)."""

    @property
    def mode(self) -> str: ...  # full | adapter | auto
    @property
    def transport(self) -> str: ...  # grpc | shm | nccl

    def sync(self, number: int) -> Any:
        """Push the learner's current weights as version `number` of this run to every server that is up; raise
        on failure."""

    def resync_server(self, server: RolloutServer) -> None:
        """Bring one server to the pool's current weight version (the rollout client's failover callback)."""

    def close(self) -> None:
        """Free what the sender holds between syncs (transport nccl: its end of the weight-transfer group)."""


class ServerRollouts:
    """The server pool behind the rollout interface (rank 0's). `pool`, `client` and `sync_client` stay
    reachable for what only server mode has (re-syncing one server, membership, transports)."""

    per_rank = False

    def __init__(
        self,
        pool: ServerPool,
        sync_client: WeightSender,
        *,
        timeout_s: float,
        generate_batch_size: int,
        fence_resync: Callable[[Callable], Callable] | None = None,
    ) -> None:
        self.pool, self.sync_client = pool, sync_client
        self.client = RolloutClient(
            pool,
            timeout_s=timeout_s,
            generate_batch_size=generate_batch_size,
            # `fence_resync` wraps the re-sync of one server (e.g. refused while the learner's weights move).
            resync=fence_resync(sync_client.resync_server) if fence_resync else sync_client.resync_server,
        )

    def wait_ready(self, timeout_s: float) -> None:
        self.pool.wait_ready(timeout_s=timeout_s)

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: Mapping[str, Any] | Any,
        *,
        weight_version: int | None = None,
    ) -> list[Rollout]:
        return self.client.generate(requests, sampling, weight_version=weight_version)

    def sync(self, number: int) -> None:
        self.sync_client.sync(number)  # counts bytes and sets the version gauge itself

    def describe(self) -> SourceInfo:
        return SourceInfo(
            "server", tuple(s.address for s in self.pool.servers), self.sync_client.mode, self.sync_client.transport
        )

    def abort(self) -> None:
        """End a generate call in flight now: its RPCs are cancelled with the servers' channels (it then raises).
        For shutting down; the source takes no calls after it."""
        self.pool.close()

    def close(self) -> None:
        self.client.close()
        self.sync_client.close()
        self.pool.close()
