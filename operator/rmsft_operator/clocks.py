"""The clocks of a running or starting job: which rule or clock fails it now, read from the API's own times so that
a lost status write restarts none of them. Pure; `decide` turns what these say into a Failed decision that frees
the GPUs."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from rmsft.jobspec import RolloutMatchingJob
from rmsft_operator import render
from rmsft_operator.failures import (
    image_failure,
    learner_refused,
    not_admitted,
    parse_time,
    pool_ready_since,
    server_lost,
    startup_failure,
)
from rmsft_operator.observe import Observed

PSA_ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
_HOSTPATH_REFUSED_LEVELS = ("baseline", "restricted")
# Condition reason of an shm job that such a level keeps from starting.
SHARED_MEMORY_FORBIDDEN = "SharedMemoryForbidden"


# Failed reasons that are the learner's own: its LearnerRunning condition says them too (else "Suspended").
LEARNER_REASONS = (
    "LearnerUnschedulable",
    "LearnerStartupTimeout",
    "LearnerNotAdmitted",
    "LearnerCreateRefused",
    "LearnerNotStopped",
)


@dataclass(frozen=True)
class ClockInputs:
    """What the clocks read of the job's classified state."""

    sts: dict[str, Any]
    learner: dict[str, Any]
    want: int
    ready: int
    suspended: bool
    queued: bool
    colocated: bool
    pool_starting: bool
    ran: bool  # a learner pod was seen running, or the Job counted a failed one: start rules are over for it


def clock_failure(
    obs: Observed, job: RolloutMatchingJob, status: dict[str, Any], s: ClockInputs, stalled: str, at: dt.datetime
) -> tuple[str, str] | None:
    """(reason, message) of the first start rule or clock that fails the job now, else None. A rollout pod that cannot
    get its image fails the start; once the learner runs, a replacement server's trouble is the failover's (the other
    servers go on), as in startup_failure. Mid-run, a lost server below a serving one fails the job past twice the
    start's timeout (server_lost): a StatefulSet cannot give it back alone."""
    timeout_s = job.spec.rollout.startup_timeout_seconds
    learner_clock = (
        parse_time(obs.failed_create_since.get("Job"))
        or parse_time((s.learner.get("status") or {}).get("startTime"))
        or parse_time((s.learner.get("metadata") or {}).get("creationTimestamp"))
    )
    pool_ready_now = s.colocated or (s.want > 0 and s.ready >= s.want)
    mid_run = not s.colocated and not s.suspended and bool(status.get("startTime"))
    start_learner_pods = [] if s.ran else obs.learner_pods
    return (
        image_failure(obs.rollout_pods if s.pool_starting else [], start_learner_pods)
        or startup_failure(
            obs.rollout_pods,
            start_learner_pods,
            pool_starting=s.pool_starting,
            timeout_s=timeout_s,
            now=at,
            pool_since=parse_time((s.sts.get("metadata") or {}).get("creationTimestamp")),
            pool_refused=obs.failed_creates.get("StatefulSet"),
            queued=s.queued,
        )
        or (learner_refused(obs.failed_creates.get("Job"), learner_clock, timeout_s, at) if not s.suspended else None)
        or (
            not_admitted(
                job.spec.scheduling.queue_name,
                s.suspended,
                held_since(status, s.learner, obs.rollout_pods, s.want),
                timeout_s,
                at,
            )
            if pool_ready_now
            else None
        )
        or (("LearnerStalled", stalled) if stalled and job.spec.learner.fail_when_stalled else None)
        or (server_lost(obs.rollout_pods, s.want, timeout_s, at) if mid_run else None)
    )


def stall(
    status: dict[str, Any], job: RolloutMatchingJob, suspended: bool, learner_pods: list[dict[str, Any]], now: str
) -> str:
    """Why the running learner counts as stalled (no optimizer step for spec.learner.stallTimeout, the first one
    counted from its start), or "" when it does not. lastStepTime moves with the step the learner is on
    (status.currentStep), so a learner redoing steps below status.step after a resume is progressing."""
    running = not suspended and any((p.get("status") or {}).get("phase") == "Running" for p in learner_pods)
    since = parse_time(status.get("lastStepTime") or status.get("startTime"))
    at = parse_time(now)
    limit = job.spec.learner.stall_timeout_seconds
    if not running or since is None or at is None or (at - since).total_seconds() <= limit:
        return ""
    step = status.get("currentStep", status.get("step"))
    what = f"no optimizer step since step {step}" if step else "no optimizer step since the learner started"
    return (
        f"learner stalled: {what} ({int((at - since).total_seconds())}s, spec.learner.stallTimeout {limit}s); "
        f"its logs say where it waits (kubectl logs job/{render.names(job.metadata.name)['job']})"
    )


def shared_memory_refusal(job: RolloutMatchingJob, namespace: str, labels: dict[str, str] | None) -> str:
    """Why Pod Security admission would refuse this job's pods for their shm volume; '' if it would not.

    Only the namespace's own label is seen: without one the cluster's default level applies, which
    the operator cannot read (pods refused anyway are then named by the FailedCreate condition)."""
    if job.spec.sync.cluster_transport != "shm" or not labels:
        return ""
    level = labels.get(PSA_ENFORCE_LABEL, "")
    if level not in _HOSTPATH_REFUSED_LEVELS:
        return ""
    return (
        f"spec.sync.transport 'shm' needs a hostPath volume (the node's "
        f"{render.shared_weights_host_path(namespace, job.metadata.name)}, shared by the learner and the "
        f"rollout servers), which namespace {namespace}'s Pod Security level forbids "
        f"({PSA_ENFORCE_LABEL}={level}); nothing is created: recreate the job with spec.sync.transport: grpc, "
        f"or set the namespace's label to privileged"
    )


def held_since(
    status: dict[str, Any], learner: dict[str, Any], rollout_pods: list[dict[str, Any]], replicas: int
) -> dt.datetime | None:
    """Since when a queued job's pool has been Ready while its learner Job is held: the later of the pool being Ready
    (the latest Ready transition of its pods, the API's clock; status.startTime when the pods do not say) and the
    Job's last suspension (its Suspended condition: Kueue suspends a Job it preempts, which queues it again), so a
    learner preempted mid-run gets its own wait, and a pool preempted with it and admitted again is timed from its
    new Ready. None before the pool was Ready."""
    ready = pool_ready_since(rollout_pods, replicas) or parse_time(status.get("startTime"))
    if ready is None:
        return None
    held = [
        parse_time(c.get("lastTransitionTime"))
        for c in (learner.get("status") or {}).get("conditions") or []
        if c.get("type") == "Suspended" and c.get("status") == "True"
    ]
    return max([ready, *[t for t in held if t is not None]])
