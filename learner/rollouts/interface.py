"""Where the learner's rollouts come from: one interface, two homes (../../docs/architecture.md).

`learner.rollouts.server_home.ServerRollouts` is the pool of rollout servers over gRPC: rank 0 alone holds it
and asks for the whole global batch. `learner.rollouts.colocate.ColocatedRollouts` is an engine inside every
learner rank (spec.rollout.mode: colocate): each rank generates its own share. Both answer `generate` in request order,
with the same seeds, `n` samples and log-probs, and every completion fenced to the weight version asked for;
both take the learner's weights with `sync`. The trainers' loops are the same above this interface.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from learner.rollouts.requests import Rollout, RolloutRequest


@dataclass(frozen=True)
class SourceInfo:
    """What the run record and the start-up log say about the source."""

    mode: str  # "server" | "colocate"
    servers: tuple[str, ...]  # addresses of the pool (empty with colocate)
    sync_mode: str  # how weights reach the engine: full | adapter | ...
    sync_transport: str  # grpc | shm | in-process


class RolloutSource(Protocol):
    # True: every learner rank holds a source and generates its own share of the batch (colocate);
    # False: rank 0's source answers for the whole batch and the training loop scatters the shares (server pool).
    per_rank: bool

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the source can generate (servers up), or raise naming what is missing."""

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: Mapping[str, Any] | Any,
        *,
        weight_version: int | None = None,
    ) -> list[Rollout]:
        """One completion per request and sample, in request order, each produced by `weight_version` of this
        run (None: no fencing)."""

    def sync(self, number: int) -> None:
        """Make the learner's current weights the engine's, as weight version `number` of this run. Raises on
        failure; the version is the engine's only once this returned."""

    def describe(self) -> SourceInfo: ...

    def close(self) -> None: ...
