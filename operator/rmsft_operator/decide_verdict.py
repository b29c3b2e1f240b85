"""Decide, step 5: the classified state's decision. Finished (the pool scaled to zero), another attempt of a learner
on several pods, failed by a start rule or a clock (what the job holds freed), or running (the pool scaled to the
spec, servers lost mid-run given back, the learner resumed, what holds the job up said). Pure; called by decide."""

from __future__ import annotations

from typing import Any

from rmsft_operator.clocks import LEARNER_REASONS, ClockInputs, clock_failure, stall
from rmsft_operator.decide_state import Pass, State
from rmsft_operator.decision import Decision, Delete, Patch, Said, fit_message
from rmsft_operator.failures import (
    attempt_not_stopping,
    disrupted,
    lost_servers,
    pod_problem,
    preflight_failure,
    refused_configuration,
    stuck_learner_pod,
)


def finished(p: Pass, s: State, d: Decision) -> Decision | None:
    """5. Terminal states free the GPUs: the pool is scaled to zero. A learner Job that failed because its pod's model
    preflight failed is reported with the preflight's words (5b), not as a learner failure. 5a. A learner on several
    pods is one torchrun world: one lost pod fails the Job's attempt as a whole (its podFailurePolicy). Unless the
    learner refused its configuration (every attempt would), the next attempt resumes from the newest checkpoint on
    the claim, up to spec.learner.backoffLimit restarts (a disruption, the pod's DisruptionTarget, is not counted):
    the failed Job is deleted once the Job controller has stopped its pods (condition Failed, not only FailureTarget:
    no pod of the old world may still hold the rendezvous name or the checkpoint folder), and the next pass creates
    it again. Pods that never stop (a lost node) fail the job after their grace period (attempt_not_stopping)."""
    job, status = p.job, d.status
    if (
        s.failed
        and job.spec.learner.nodes > 1
        and not _preflight(p, s)
        and not refused_configuration(p.obs.learner_pods)
        and not _not_stopping(p, s)
    ):
        attempt = int(status["learnerAttempt"])
        gone = disrupted(s.learner, p.obs.learner_pods)
        if attempt <= job.spec.learner.backoff_limit or gone:
            return _next_attempt(p, s, d, attempt, gone)
    if not (s.succeeded or (s.failed and not _preflight(p, s) and not _not_stopping(p, s))):
        return None
    _scale_to_zero(p, s, d)
    status.setdefault("completionTime", p.now)
    d.phase = "Complete" if s.succeeded else "Failed"
    status["message"] = message = "learner finished" if s.succeeded else f"learner failed: {s.why}"
    status["conditions"] = p.conditions(
        complete=(s.succeeded, "LearnerSucceeded" if s.succeeded else "NotComplete", message),
        failed=(s.failed, "LearnerFailed" if s.failed else "NotFailed", message),
        learner=(False, "LearnerFinished", message),
        rollout=(
            False,
            "PoolScaledDown",
            "no rollout pool (colocate)" if s.colocated else "rollout pool scaled to zero",
        ),
    )
    return d


def _preflight(p: Pass, s: State) -> tuple[str, str] | None:
    """A model preflight's refusal. A learner pod whose preflight refused the model never ran, though the Job counts
    it failed: the preflight's verdict holds until a learner pod was seen running."""
    return preflight_failure(
        p.obs.rollout_pods if s.pool_starting or s.colocated else [], [] if s.seen_running else p.obs.learner_pods
    )


def _not_stopping(p: Pass, s: State) -> tuple[str, str] | None:
    if not (s.failed and p.job.spec.learner.nodes > 1) or _preflight(p, s) or refused_configuration(p.obs.learner_pods):
        return None
    return attempt_not_stopping(
        s.learner, p.obs.learner_pods, p.job.spec.learner.termination_grace_period_seconds, p.at
    )


def _scale_to_zero(p: Pass, s: State, d: Decision) -> None:
    if not s.colocated and (s.sts.get("spec") or {}).get("replicas") != 0:
        d.patches.append(Patch("StatefulSet", p.n["statefulset"], {"spec": {"replicas": 0}}))
    d.status["rolloutReplicas"] = 0


def failed_or_running(p: Pass, s: State, d: Decision) -> Decision:
    """5b. A start that cannot succeed, or GPUs held past a clock, fails the job and frees what it holds (the pool
    scaled to zero, the learner Job suspended, which removes a pod that waits for a node), instead of holding them
    forever. Mid-run, a replacement learner pod that cannot start (not placed: a preemptor took its GPUs; placed but
    not started: an expired registry token) is retried after the start's own clock: the pod deleted, which the Job
    controller counts against spec.learner.backoffLimit and replaces; the attempts bound it, not a verdict now."""
    stalled = stall(d.status, p.job, s.suspended, p.obs.learner_pods, p.now)
    failure = (
        _preflight(p, s)
        or _not_stopping(p, s)
        or clock_failure(p.obs, p.job, d.status, _clock_inputs(s), stalled, p.at)
    )
    retry = (
        stuck_learner_pod(p.obs.learner_pods, p.job.spec.rollout.startup_timeout_seconds, p.at)
        if s.ran and not failure and not s.suspended
        else None
    )
    if retry:
        pod_meta = retry[2].get("metadata") or {}
        d.deletes.append(Delete("Pod", pod_meta.get("name", ""), pod_meta.get("uid", "")))
        d.events.append(
            (
                "Warning",
                "LearnerPodRetried",
                f"{retry[1]}; mid-run: the pod is deleted and the learner "
                f"Job retries it (counted against spec.learner.backoffLimit "
                f"{p.job.spec.learner.backoff_limit})",
            )
        )
    if failure:
        return _failed(p, s, d, *failure)
    return _running(p, s, d, stalled)


def _clock_inputs(s: State) -> ClockInputs:
    return ClockInputs(
        sts=s.sts,
        learner=s.learner,
        want=s.want,
        ready=s.ready,
        suspended=s.suspended,
        queued=s.queued,
        colocated=s.colocated,
        pool_starting=s.pool_starting,
        ran=s.ran,
    )


def _failed(p: Pass, s: State, d: Decision, reason: str, message: str) -> Decision:
    _scale_to_zero(p, s, d)
    if s.queued and not s.failed and (learner_obj := p.obs.children.get("Job")) is not None:
        d.deletes.append(stop_learner(p.n, learner_obj))
    elif not s.suspended and not s.failed:
        d.patches.append(Patch("Job", p.n["job"], {"spec": {"suspend": True}}))
    d.status.setdefault("completionTime", p.now)
    d.status["message"] = message
    learner_reason = reason if reason in LEARNER_REASONS else "Suspended"
    d.status["conditions"] = p.conditions(
        complete=(False, "NotComplete", message),
        failed=(True, reason, message),
        learner=(False, learner_reason, message),
        rollout=(
            False,
            "PoolScaledDown",
            "no rollout pool (colocate)" if s.colocated else "rollout pool scaled to zero",
        ),
    )
    d.phase = "Failed"
    return d


def _running(p: Pass, s: State, d: Decision, stalled: str) -> Decision:
    """5c. Mid-run, a server that has not been Ready for the startup timeout (a replacement or added server that
    crash-loops, cannot be scheduled or never loads) holds its GPUs while the others serve: said (condition, one
    event), and given back when the pool can give it back (its highest ordinals, never the last server). One below a
    serving server is kept for one more timeout; past twice the timeout it fails the job (5b, ServerLost). 6. Scale
    the pool to the spec; resume the learner once every server is Ready. 7. Say what holds the job up."""
    status, want, released = d.status, s.want, p.released
    mid_run = not s.colocated and not s.suspended and bool(status.get("startTime"))
    lost = lost_servers(p.obs.rollout_pods, want, p.job.spec.rollout.startup_timeout_seconds, p.at) if mid_run else None
    if lost:
        want -= lost[0]
        released += lost[0]
        if lost[0] or p.old_reason("RolloutReady") != "ServerLost":
            d.events.append(("Warning", "ServerLost", lost[1]))
    if released:
        status.update(rolloutReplicas=want, releasedRolloutReplicas=released)
    if not s.colocated and (s.sts.get("spec") or {}).get("replicas") != want:
        d.patches.append(Patch("StatefulSet", p.n["statefulset"], {"spec": {"replicas": want}}))
    pool_ready = s.colocated or (want > 0 and s.ready >= want)
    if pool_ready and s.suspended and not s.queued:
        d.patches.append(Patch("Job", p.n["job"], {"spec": {"suspend": False}}))
        s.suspended = False
        status["startTime"] = p.now
    elif pool_ready and s.queued and not status.get("startTime"):
        status["startTime"] = p.now  # the pool's start is over; Kueue decides when the learner runs
    pool = _pool_said(p, s, want, released, pool_ready, lost[1] if lost else "")
    learner = _learner_said(p, s)
    running = learner[0]
    if stalled:
        progressing: Said = (False, "LearnerStalled", stalled)
        if p.old_reason("Progressing") != "LearnerStalled":  # once, when it stalls, not on every pass
            d.events.append(("Warning", "LearnerStalled", stalled))
    elif running:
        progressing = (True, "StepsAdvancing", f"step {status.get('step', 0)}")
    else:
        progressing = (False, "NotStarted", learner[2])
    status["conditions"] = p.conditions(
        rollout=pool,
        learner=learner,
        progressing=progressing,
        complete=(False, "NotComplete", learner[2]),
        failed=(False, "NotFailed", learner[2]),
    )
    status["message"] = p.refused or f"{pool[2]}; {learner[2]}"
    d.phase = "Running" if running else "Starting" if not s.suspended or s.ready else "Pending"
    return d


def _pool_said(p: Pass, s: State, want: int, released: int, pool_ready: bool, lost: str) -> Said:
    """RolloutReady: how many servers are Ready, and what holds the others up, in words a person can act on."""
    if s.colocated:
        return True, "Colocated", "rollouts run inside the learner (colocate)"
    msg = f"{s.ready}/{want} rollout servers Ready"
    reason = "PoolReady" if pool_ready else "PoolNotReady"
    if released:
        msg += f" ({released} given back mid-run: not Ready for spec.rollout.startupTimeout)"
    if lost:
        return pool_ready, "ServerLost", f"{msg}; {lost}"
    if not pool_ready:
        problem = pod_problem(p.obs.rollout_pods)
        if "StatefulSet" in p.obs.failed_creates:
            problem = ("FailedCreate", f"rollout pods cannot be created: {p.obs.failed_creates['StatefulSet']}")
        if problem:
            reason, msg = problem[0], f"{msg}; {problem[1]}"
    return pool_ready, reason, msg


def _learner_said(p: Pass, s: State) -> Said:
    """LearnerRunning: whether a learner pod runs, and what it waits for."""
    learner_ready = int((s.learner.get("status") or {}).get("ready") or 0)
    running = not s.suspended and (
        learner_ready >= 1 or any((pod.get("status") or {}).get("phase") == "Running" for pod in p.obs.learner_pods)
    )
    if s.suspended and s.queued:
        return (
            False,
            "Queued",
            (f"learner Job waits for Kueue to admit it (LocalQueue {p.job.spec.scheduling.queue_name})"),
        )
    if s.suspended:
        return False, "Suspended", "learner waits for the rollout pool"
    if running:
        return True, "Running", "learner pod running"
    msg = "learner Job resumed; its pod is not running yet"
    problem = pod_problem(p.obs.learner_pods)
    if "Job" in p.obs.failed_creates:
        problem = ("FailedCreate", f"learner pod cannot be created: {p.obs.failed_creates['Job']}")
    if problem:
        return False, problem[0], f"{msg}; {problem[1]}"
    return False, "PodPending", msg


def stop_learner(n: dict[str, str], job_obj: dict[str, Any]) -> Delete:
    """A queued job's learner stopped: its Job deleted (with its pods, and its Kueue Workload, which frees the
    queue's quota); suspending it would be undone by Kueue."""
    return Delete("Job", n["job"], (job_obj.get("metadata") or {}).get("uid", ""))


def _next_attempt(p: Pass, s: State, d: Decision, attempt: int, disruption: bool) -> Decision:
    """Step 5a's decision: a failed attempt of a learner on several pods, another one allowed. The pool keeps
    running (the next attempt re-syncs it); the Job is deleted once its pods have stopped. A disruption (a pod's
    DisruptionTarget: evicted, drained, preempted) is no fault of the run: the attempt is run again, not counted
    (status.learnerDisruptions counts those)."""
    limit = p.job.spec.learner.backoff_limit + 1
    conds = {
        c.get("type"): c for c in (s.learner.get("status") or {}).get("conditions") or [] if c.get("status") == "True"
    }
    nxt = attempt if disruption else attempt + 1
    head = (
        f"learner attempt {attempt} of {limit} "
        + ("disrupted (not counted)" if disruption else "failed")
        + f": {s.why}"
    )
    if "Failed" in conds:
        d.deletes.append(Delete("Job", p.n["job"], s.learner["metadata"]["uid"]))
        d.status["learnerAttempt"] = nxt
        # When this attempt's Job went: the clock of a refused re-create (refused_create), written in the same status
        # write that comes before the delete (act), so the delete never happens without it.
        d.status["learnerAttemptTime"] = p.now
        if disruption:
            d.status["learnerDisruptions"] = int(d.status.get("learnerDisruptions") or 0) + 1
        message = (
            f"{head}; attempt {nxt} " + ("runs again" if disruption else "resumes") + " from the newest checkpoint"
        )
        d.events.append(("Warning", "LearnerRestarted", message))
    else:
        message = f"{head}; its other pods are stopping, then attempt {nxt} starts"
    message = fit_message(message)
    pool_ready = s.colocated or s.ready >= s.want
    d.status["message"] = message
    failed: Said = (False, "AttemptFailed", message)
    d.status["conditions"] = p.conditions(
        rollout=(
            pool_ready,
            "PoolReady" if pool_ready else "PoolNotReady",
            f"{s.ready}/{s.want} rollout servers Ready",
        ),
        learner=failed,
        progressing=failed,
        complete=(False, "NotComplete", message),
        failed=(False, "NotFailed", message),
    )
    d.phase = "Running"
    return d
