"""Act: carry a decision out, idempotently; a create the API server refuses becomes the pass's decision."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from rmsft.jobspec import JobSpecError, parse_spec
from rmsft_operator import render
from rmsft_operator.decision import Decision, Patch, conditions, fit_message, now_rfc3339
from rmsft_operator.failures import parse_time
from rmsft_operator.kube import ApiError, Kube
from rmsft_operator.observe import Observed

log = logging.getLogger("rmsft_operator.reconcile")


@dataclass
class Outcome:
    phase: str
    status: dict[str, Any]
    created: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)


# A create the API server answers with one of these is refused as asked, not failed on the way: repeating it at
# once changes nothing. 400/422: the object itself is invalid (it never will be accepted); 403: a policy says no
# (RBAC, a ResourceQuota, an admission webhook), which an administrator may change.
INVALID_OBJECT = (400, 422)
FORBIDDEN = 403


def refused_create(obs: Observed, decision: Decision, obj: dict[str, Any], exc: ApiError, now: str) -> Decision:
    """The pass's decision once the API server refused to create `obj`. Pure. An invalid object fails the job (the
    next pass, final, scales to zero and suspends whatever was created before it); a forbidden one leaves it
    Pending, retried on every resync (not in a tight loop), with the API's words in its status, its pool scaled to
    zero meanwhile (a StatefulSet created before the refused Job holds GPUs for nothing), for at most
    spec.rollout.startupTimeout from the job's creation (or from its last learner attempt's end,
    status.learnerAttemptTime: a re-created Job): then it is Failed. Both clocks are the API's or written before the
    object went, so no lost status write restarts them. Either way one Warning event, not one per retry, and nothing
    else of the pass is applied."""
    old_conds: list[dict[str, Any]] = obs.status.get("conditions") or []
    gen = obs.generation

    kind, name = obj["kind"], obj["metadata"]["name"]
    invalid = exc.status in INVALID_OBJECT
    reason = "CreateRefused"
    try:
        timeout_s = parse_spec(obs.spec).rollout.startup_timeout_seconds
    except JobSpecError:
        timeout_s = 0
    starts = [t for t in (parse_time(obs.created), parse_time(obs.status.get("learnerAttemptTime"))) if t is not None]
    at = parse_time(now) or dt.datetime.now(dt.UTC)
    expired = not invalid and bool(starts) and (at - max(starts)).total_seconds() >= timeout_s
    message = fit_message(
        f"the API server refused to create {kind} {name}: {exc}; "
        + (
            "the object is invalid as rendered from this spec: fix the spec (or report it) and recreate the job"
            if invalid
            else f"a policy forbids it (RBAC, a ResourceQuota or an admission webhook) and still did after "
            f"spec.rollout.startupTimeout ({timeout_s} s): the job is failed, its pool freed; recreate it once the "
            "policy allows it"
            if expired
            else "a policy forbids it (RBAC, a ResourceQuota or an admission webhook): "
            f"the pool is scaled to zero meanwhile and the operator tries again on every resync, for "
            f"spec.rollout.startupTimeout ({timeout_s} s) from the job's start, until it is allowed"
        )
    )
    final = invalid or expired
    phase = "Failed" if final else "Pending"
    patches = []
    before = decision.creates[: decision.creates.index(obj)] if obj in decision.creates else []
    pool_made = obs.children.get("StatefulSet") is not None or any(render.child_key(o) == "StatefulSet" for o in before)
    if (
        kind != "StatefulSet"
        and pool_made
        and ((obs.children.get("StatefulSet") or {}).get("spec") or {}).get("replicas") != 0
    ):
        patches.append(Patch("StatefulSet", render.names(obs.name)["statefulset"], {"spec": {"replicas": 0}}))
    said = (False, reason, message)
    status = {
        "rolloutReplicas": 0,
        "readyRolloutReplicas": 0,
        "learnerActive": 0,
        "message": message,
        "phase": phase,
        "conditions": conditions(
            old_conds,
            gen,
            now,
            rollout=said,
            learner=said,
            complete=(False, "NotComplete", message),
            failed=(final, reason if final else "NotFailed", message),
        ),
    }
    if final:
        status["completionTime"] = obs.status.get("completionTime") or now
    if gen is not None:
        status["observedGeneration"] = gen
    events = []
    prev = next((c for c in old_conds if c.get("type") == "RolloutReady"), {})
    if prev.get("reason") != reason or obs.status.get("phase") != phase:
        events.append(("Warning", reason, message))
    return Decision(phase, status, patches=patches, events=events)


def act(kube: Kube, obs: Observed, decision: Decision) -> Outcome:
    created: list[str] = []
    for obj in decision.creates:
        try:
            _, was_created = kube.ensure(obj)  # a 409 (created meanwhile) reads the object instead
        except ApiError as exc:
            if exc.status not in (*INVALID_OBJECT, FORBIDDEN):
                raise
            decision = refused_create(obs, decision, obj, exc, now_rfc3339())
            break
        if was_created:
            created.append(f"{obj['kind']}/{obj['metadata']['name']}")
    try:
        # The status first, then what it decided: a decision that frees GPUs (a start failure, a server given back)
        # is written before the pool is scaled down, so a status write that is lost leaves the evidence in place for
        # the next pass instead of undoing the scale-down with the clock restarted.
        if any(obs.status.get(k) != v for k, v in decision.status.items()):
            kube.patch_job_status(obs.namespace, obs.name, decision.status, expected=(404,))
        for p in decision.patches:
            kube.patch(p.kind, obs.namespace, p.name, p.body, expected=(404,))
        # After the status: an attempt is counted before its Job goes, so a lost status write can only count one
        # twice (ending the restarts sooner), never let them run on uncounted.
        for gone in decision.deletes:  # 404: gone already; 409: the uid precondition (a namesake): left alone
            try:
                kube.delete(gone.kind, obs.namespace, gone.name, gone.uid, expected=(404, 409))
            except ApiError as exc:
                if exc.status != 409:
                    raise
                log.info(
                    "%s/%s: %s %s is not the one observed; not deleted", obs.namespace, obs.name, gone.kind, gone.name
                )
    except ApiError as exc:
        if exc.status != 404:
            raise
        # The job (and with it, through the garbage collector, its children) was deleted while
        # this pass ran: nothing left to act on, and nothing that went wrong.
        log.info("%s/%s: %s; the job is being deleted", obs.namespace, obs.name, exc)
        return Outcome(decision.phase, decision.status, created, [])
    return Outcome(decision.phase, decision.status, created, decision.events)
