"""Server mode behind the rollout interface (`learner.rollouts.source`); the other home, the engine inside
every rank (spec.rollout.mode: colocate), is `learner.colocate.colocated_rollouts`.

`ServerRollouts` wraps what server mode always had: the ordered pool, the rollout client (ordering,
failover, fencing) and the weight-sync client (FULL/ADAPTER over gRPC or shared memory). Only rank 0 builds
it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from learner.rollouts.client import RolloutClient
from learner.rollouts.pool import ServerPool, ServersFile
from learner.rollouts.requests import Rollout, RolloutRequest
from learner.rollouts.source import SourceInfo
from learner.sync.client import WeightSyncClient
from learner.sync.weights import checkpoint_name_map
from learner.train.config import sync_transport
from rmsft.jobspec import RolloutMatchingJob
from rmsft.weight_wire import shared_dir_from_env

log = logging.getLogger("rmsft.learner")


class ServerRollouts:
    """The server pool behind the rollout interface (rank 0's). `pool`, `client` and `sync_client` stay
    reachable for what only server mode has (re-syncing one server, membership, transports)."""

    per_rank = False

    def __init__(self, job: RolloutMatchingJob, addresses: Sequence[str] | ServersFile, model: Any, *,
                 run_id: str, auth_token: str | None, checkpoint_dir: str | Path, vision_language: bool,
                 zero3: bool, fence_resync: Callable[[Callable], Callable] | None = None) -> None:
        followed = addresses if isinstance(addresses, ServersFile) else list(addresses)
        self.pool = ServerPool(followed, auth_token=auth_token, run_id=run_id)
        sync, cfg = job.spec.sync, job.spec.training
        self.sync_client = WeightSyncClient(
            self.pool, model, mode=sync.mode, fallback_to_full=sync.fallback_to_full,
            frame_bytes=sync.frame_bytes, timeout_s=sync.timeout_seconds,
            # FULL weights go out in the serving dtype (spec.model.dtype; auto = the checkpoint's)
            dtype=job.spec.model.dtype, checkpoint_dir=checkpoint_dir,
            # Vision-language: checkpoint names (what vLLM reloads), and only what training can
            # change (a frozen vision tower is never resent).
            name_map=checkpoint_name_map(model) if vision_language else None, changed_only=vision_language,
            transport=sync_transport(sync, shared_dir_from_env()), shared_dir=shared_dir_from_env(),
        )  # fmt: skip
        if zero3:
            self.sync_client.export_blocked = ("ZeRO-3 partitions the weights across learner ranks; "
                                               "the next step's collective sync brings the server up")
        self.client = RolloutClient(
            self.pool, timeout_s=cfg.rollout.request_timeout_s,
            generate_batch_size=cfg.rollout.generate_batch_size or 0,
            # `fence_resync` wraps the re-sync of one server (e.g. refused while the learner's weights move).
            resync=fence_resync(self.sync_client.resync_server) if fence_resync else self.sync_client.resync_server,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        self.pool.wait_ready(timeout_s=timeout_s)

    def generate(self, requests: Sequence[RolloutRequest], sampling: Mapping[str, Any] | Any, *,
                 weight_version: int | None = None) -> list[Rollout]:
        return self.client.generate(requests, sampling, weight_version=weight_version)

    def sync(self, version: int) -> None:
        self.sync_client.sync(version)  # counts bytes and sets the version gauge itself

    def describe(self) -> SourceInfo:
        return SourceInfo("server", tuple(s.address for s in self.pool.servers), self.sync_client.mode,
                          self.sync_client.transport)

    def abort(self) -> None:
        """End a generate call in flight now: its RPCs are cancelled with the servers' channels (it then raises).
        For shutting down; the source takes no calls after it."""
        self.pool.close()

    def close(self) -> None:
        self.client.close()
        self.pool.close()
