"""What every stage of one decision reads (`Pass`: the observation, the clock, the job as applied) and the job's
state the `classify` stage finds (`State`). Shared by the stages (decide) and the state's decision (decide_verdict)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from rmsft.jobspec import RolloutMatchingJob
from rmsft_operator.decision import Said, condition, conditions
from rmsft_operator.observe import Observed


@dataclass
class Pass:
    """What every stage of one decision reads: the observation, the clock and the job as it is applied."""

    obs: Observed
    now: str
    at: dt.datetime
    job: RolloutMatchingJob
    refused: str = ""  # an edit that cannot be applied in place (step 2): said, not applied
    durable: dict[str, Any] = field(default_factory=dict)  # the CheckpointsDurable condition
    n: dict[str, str] = field(default_factory=dict)
    released: int = 0  # servers given back mid-run by earlier passes (status.releasedRolloutReplicas)

    def cond(self, ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(
            self.obs.status.get("conditions") or [], ctype, ok, reason, message, self.obs.generation, self.now
        )

    def conditions(
        self, *, rollout: Said, learner: Said, complete: Said, failed: Said, progressing: Said | None = None
    ) -> list[dict[str, Any]]:
        """decision.conditions, with this pass's InvalidSpec (an edit refused, or the spec accepted)."""
        invalid = (
            bool(self.refused),
            "ImmutableFieldChanged" if self.refused else "SpecValid",
            self.refused or "spec accepted",
        )
        return conditions(
            self.obs.status.get("conditions") or [],
            self.obs.generation,
            self.now,
            rollout=rollout,
            learner=learner,
            progressing=progressing,
            complete=complete,
            failed=failed,
            invalid=invalid,
        )

    def old_reason(self, ctype: str) -> Any:
        old: list[dict[str, Any]] = self.obs.status.get("conditions") or []
        return next((c for c in old if c.get("type") == ctype), {}).get("reason")


@dataclass
class State:
    """The job's state, classified from its children and pods (stage `classify`)."""

    sts: dict[str, Any]
    learner: dict[str, Any]
    want: int
    ready: int
    succeeded: bool
    failed: bool
    why: str
    suspended: bool
    queued: bool
    colocated: bool
    pool_starting: bool
    seen_running: bool = False  # a learner pod was seen running (_carry_status)
    ran: bool = False  # ... or the Job counted a failed pod
