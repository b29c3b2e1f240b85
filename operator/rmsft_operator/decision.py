"""What a pass decided (creates, patches, deletes, events, the status) and the one place its conditions are built."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Patch:
    kind: str
    name: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str
    uid: str  # only this object, never a namesake created since it was observed


@dataclass
class Decision:
    phase: str
    status: dict[str, Any]
    creates: list[dict[str, Any]] = field(default_factory=list)
    patches: list[Patch] = field(default_factory=list)
    deletes: list[Delete] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


MESSAGE_LIMIT = 4096  # the CRD's maxLength of status.message and of a condition's message


def fit_message(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` cut to the CRD's limit, saying how much was cut: a longer one makes the whole status write fail."""
    if len(text) <= limit:
        return text
    keep = limit - len(f" ... [{len(text)} more characters cut]")
    return f"{text[:keep]} ... [{len(text) - keep} more characters cut]"


def condition(
    old: list[dict[str, Any]], ctype: str, ok: bool, reason: str, message: str, generation: int | None, now: str
) -> dict[str, Any]:
    """One condition; its lastTransitionTime kept from `old` while its status stays."""
    status = "True" if ok else "False"
    prev = next((c for c in old if c.get("type") == ctype), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    cond = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": fit_message(message),
        "lastTransitionTime": since or now,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


# (status, reason, message) of one condition
Said = tuple[bool, str, str]


def conditions(
    old: list[dict[str, Any]],
    generation: int | None,
    now: str,
    *,
    rollout: Said,
    learner: Said,
    complete: Said,
    failed: Said,
    progressing: Said | None = None,
    invalid: Said | None = None,
) -> list[dict[str, Any]]:
    """The job's conditions, in one order whatever the state: RolloutReady, LearnerRunning, Progressing (once the
    learner may run), Complete, Failed, InvalidSpec (once the spec was read). Every state of decide (and
    act's refused create) says its words through this."""
    said = [
        ("RolloutReady", rollout),
        ("LearnerRunning", learner),
        ("Progressing", progressing),
        ("Complete", complete),
        ("Failed", failed),
        ("InvalidSpec", invalid),
    ]
    return [condition(old, ctype, *words, generation, now) for ctype, words in said if words is not None]


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
