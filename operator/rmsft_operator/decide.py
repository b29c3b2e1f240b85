"""Decide: a pure function of what was observed, in named stages (`decide` reads them top to bottom): read the spec
as applied, stay final, hold when nothing can be made, plan the children, classify the job's state, then that
state's decision (finished, another attempt, failed by a start rule or a clock, running), its conditions said
through decision.conditions. Table-tested without any API (tests/operator/test_operator_decide.py)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import yaml

from rmsft.jobspec import (
    API_GROUP,
    API_VERSION,
    KIND,
    JobSpecError,
    RolloutMatchingJob,
    parse_job,
)
from rmsft_operator import render
from rmsft_operator.clocks import (
    LEARNER_REASONS,
    SHARED_MEMORY_FORBIDDEN,
    ClockInputs,
    clock_failure,
    shared_memory_refusal,
    stall,
)
from rmsft_operator.decision import Decision, Delete, Patch, Said, condition, conditions, fit_message
from rmsft_operator.failures import (
    attempt_not_stopping,
    disrupted,
    job_state,
    lost_servers,
    parse_time,
    pod_problem,
    preflight_failure,
    refused_configuration,
    stuck_learner_pod,
)
from rmsft_operator.observe import CHILD_KINDS, Observed, api_kind
from rmsft_operator.progress import learner_final_progress


@dataclass
class _Pass:
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
class _State:
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


def decide(obs: Observed, now: str) -> Decision:
    """What to create and patch, and the status to report, from what was observed. Pure. In stages: read the spec
    as applied, stay final, hold (nothing can be made), plan the children, classify the job's state, then the state's
    decision: finished, another attempt, failed by a rule or a clock, or running (scale, resume, say why not)."""
    p = _read(obs, now)
    if isinstance(p, Decision):
        return _finish(obs, p, {})
    return _finish(obs, _decide(p), p.durable)


def _decide(p: _Pass) -> Decision:
    if p.obs.status.get("phase") in ("Complete", "Failed"):
        return _stay_final(p)
    held = _hold(p)
    if held is not None:
        return held
    d, desired = _plan_children(p)
    s = _classify(p, desired)
    _carry_status(p, s, d.status)
    return _finished(p, s, d) or _failed_or_running(p, s, d)


def _finish(obs: Observed, d: Decision, durable: dict[str, Any]) -> Decision:
    """The status every decision ends with: CheckpointsDurable, the message cut to the CRD's limit, the phase, the
    generation seen; and one event when the phase changes."""
    conds = d.status.get("conditions")
    if durable and isinstance(conds, list) and not any(c.get("type") == "CheckpointsDurable" for c in conds):
        conds.append(durable)
    if "message" in d.status:
        d.status["message"] = fit_message(str(d.status["message"]))
    d.status["phase"] = d.phase
    if obs.generation is not None:
        d.status["observedGeneration"] = obs.generation
    if d.phase != obs.status.get("phase"):
        kind = "Warning" if d.phase in ("Failed", "Invalid") else "Normal"
        d.events.append((kind, f"Phase{d.phase}", d.status.get("message") or f"phase {d.phase}"))
    return d


# ------------------------------------------------------------------------------------- read the spec as applied


def _read(obs: Observed, now: str) -> _Pass | Decision:
    """1. Validate (an API server without the CRD's validation may let anything through); 2. refuse the edits that
    cannot be applied in place (the job keeps running as applied); 3c. servers given back mid-run stay given back."""
    try:
        job = parse_job(
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "metadata": {"name": obs.name, "namespace": obs.namespace},
                "spec": obs.spec,
            }
        )
    except JobSpecError as exc:
        msg = "; ".join(exc.errors)
        invalid = condition(
            obs.status.get("conditions") or [], "InvalidSpec", True, "SpecInvalid", msg, obs.generation, now
        )
        return Decision("Invalid", {"conditions": [invalid], "message": msg})
    job, refused = _applied(obs, job)
    released = _released(obs, job)
    p = _Pass(
        obs,
        now,
        parse_time(now) or dt.datetime.now(dt.UTC),
        _without(job, released),
        refused,
        n=render.names(obs.name),
        released=released,
    )
    # Where the checkpoints live, said where users look (kubectl describe, the conditions): without a claim, a
    # learner pod lost (evicted, its node gone) takes them along, and its retry starts again from step 0.
    claim, ck_dir = job.spec.learner.checkpoint_claim, job.spec.training.checkpoint.dir
    cadence = render.checkpoint_cadence(job)  # a job that saves only at the end says so here too (issue 60)
    p.durable = p.cond(
        "CheckpointsDurable",
        bool(claim),
        "OnClaim" if claim else "NoCheckpointClaim",
        f"checkpoints in {ck_dir} on PersistentVolumeClaim {claim}; {cadence}"
        if claim
        else f"no spec.learner.checkpointClaim: checkpoints in {ck_dir} live in an emptyDir of the learner "
        f"pod and are lost with it; its retry starts again from step 0; {cadence}",
    )
    return p


def _applied(obs: Observed, job: RolloutMatchingJob) -> tuple[RolloutMatchingJob, str]:
    """The job as applied (its ConfigMap's copy) with the new spec.rollout.replicas, and why other edits are refused;
    the job as given when nothing is refused."""
    cm = obs.children.get("ConfigMap")
    if cm is None:
        return job, ""
    applied_hash = ((cm.get("metadata") or {}).get("annotations") or {}).get(render.SPEC_HASH_ANNOTATION)
    new_spec = job.to_manifest()["spec"]
    if not applied_hash or applied_hash == render.spec_hash(new_spec):
        return job, ""
    # Read back through the model: a key added to the schema after the job was applied (as spec.sync.transport was)
    # is its default on both sides, not an edit.
    applied = parse_job(yaml.safe_load(cm["data"][render.CONFIG_KEY]))
    changed = _diff_paths(render.immutable_view(applied.to_manifest()["spec"]), render.immutable_view(new_spec))
    if not changed:
        return job, ""
    applied.spec.rollout.replicas = job.spec.rollout.replicas
    return applied, (
        f"{', '.join(changed)} cannot change once the job exists (only spec.rollout.replicas can); "
        "revert the edit, or delete and recreate the job"
    )


def _released(obs: Observed, job: RolloutMatchingJob) -> int:
    """3c. Servers given back mid-run (5c) stay given back: the pool and the learner's server list are rendered
    without them, so no pass scales them up again and the learner stops probing them."""
    assert job.spec.rollout.replicas is not None, "RolloutSpec's validator sets replicas (0 for colocate, else >= 1)"
    return (
        0
        if job.spec.rollout.colocated
        else max(0, min(int(obs.status.get("releasedRolloutReplicas") or 0), job.spec.rollout.replicas - 1))
    )


def _without(job: RolloutMatchingJob, released: int) -> RolloutMatchingJob:
    if not released:
        return job
    job = job.model_copy(deep=True)
    assert job.spec.rollout.replicas is not None, "a copy of the spec above"
    job.spec.rollout.replicas -= released
    return job


# ------------------------------------------------------------------------------------- states with nothing to make


def _stay_final(p: _Pass) -> Decision:
    """1b. Final is final: a Complete or Failed job never runs again, whatever happens to its children later (its
    learner Job deleted by hand or by a TTL, the pool edited): nothing is created, the pool stays at zero, the
    status stays as it was written."""
    old = p.obs.status
    d = Decision(old["phase"], {k: v for k, v in old.items() if k != "observedGeneration"})
    sts = p.obs.children.get("StatefulSet")
    if sts is not None and (sts.get("spec") or {}).get("replicas") != 0:
        d.patches.append(Patch("StatefulSet", p.n["statefulset"], {"spec": {"replicas": 0}}))
    job_obj = p.obs.children.get("Job")
    if job_obj is not None and not any(job_state(job_obj)[:2]):  # a Job of a final job that has not ended
        if p.job.spec.scheduling.queue_name:  # queued or running under Kueue: only deleting it stops it
            d.deletes.append(_stop_learner(p.n, job_obj))
        elif not (job_obj.get("spec") or {}).get("suspend"):
            d.patches.append(Patch("Job", p.n["job"], {"spec": {"suspend": True}}))
    return d


def _hold(p: _Pass) -> Decision | None:
    """3. An shm job in a namespace whose Pod Security level refuses its hostPath volume: every pod would be refused
    at creation. Create nothing and say why; the labels are read again on every pass, so relabelling the namespace
    lets the next pass go on. A job whose pool and learner Job exist already (the namespace was relabelled later)
    goes on as usual: a pod refused then is named by FailedCreate. 3b. An object with a child's name that another
    owner made (or that someone made by hand): the operator acts only on what it owns, so it neither adopts nor
    replaces it. Nothing is created; every pass looks again, so once it is deleted or renamed the job goes on."""
    obs = p.obs
    forbidden = shared_memory_refusal(p.job, obs.namespace, obs.namespace_labels)
    if forbidden and (obs.children.get("StatefulSet") is None or obs.children.get("Job") is None):
        return _held(p, SHARED_MEMORY_FORBIDDEN, forbidden)
    if obs.foreign:
        named = ", ".join(f"{api_kind(kind)} {name}" for kind, name in sorted(obs.foreign.items()))
        return _held(
            p,
            "NameConflict",
            f"{named} already exists in namespace {obs.namespace} and is not this job's "
            "(no controller reference to it): rmsft does not adopt or replace objects it did not create; "
            "delete or rename it, or recreate the job under another name",
        )
    return None


def _held(p: _Pass, reason: str, message: str) -> Decision:
    """Pending with nothing created, saying why (the Warning event once, not on every pass)."""
    said = (False, reason, message)
    status = {
        "rolloutReplicas": p.job.spec.rollout.replicas,
        "readyRolloutReplicas": 0,
        "learnerActive": 0,
        "message": message,
        "conditions": p.conditions(
            rollout=said, learner=said, complete=(False, "NotComplete", message), failed=(False, "NotFailed", message)
        ),
    }
    d = Decision("Pending", status)
    if p.old_reason("RolloutReady") != reason:
        d.events.append(("Warning", reason, message))
    return d


# ------------------------------------------------------------------------------------- plan the children


def _plan_children(p: _Pass) -> tuple[Decision, dict[str, dict[str, Any]]]:
    """4. Children: create what is missing (the token Secret is never rewritten)."""
    desired = _by_kind(render.render_all(p.job, p.obs.namespace, p.obs.uid))
    d = Decision("Pending", {})
    d.creates = [desired[k] for k in CHILD_KINDS if k in desired and p.obs.children.get(k) is None]
    cm = p.obs.children.get("ConfigMap")
    if cm is not None:
        # Pool resized: the learner follows the server list. The servers' flags (serve.yaml) are never rewritten
        # (docs/upgrade.md): they were written, once, for the job's image, which its pods keep across an operator
        # upgrade; an older `rmsft serve` refuses a key it does not know, so adding one would crash-loop the next
        # server that restarts.
        data, applied_data = desired["ConfigMap"]["data"], cm.get("data") or {}
        resized = {k: data[k] for k in (render.SERVERS_KEY,) if applied_data.get(k) != data[k]}
        if resized:
            d.patches.append(Patch("ConfigMap", p.n["config"], {"data": resized}))
    if p.obs.children.get("Job") is None and not p.job.spec.learner.checkpoint_claim:
        d.events.append(("Warning", "CheckpointsEphemeral", p.durable["message"]))
    return d, desired


# ------------------------------------------------------------------------------------- classify the job's state


def _classify(p: _Pass, desired: dict[str, dict[str, Any]]) -> _State:
    """Where the job is: its pool (wanted, Ready), its learner Job (finished, suspended), whether it is queued, and
    whether it is still starting. Start rules hold at the start only. The pool starts until the learner was let go
    (queued: until it was first Ready, as Kueue may start the learner before it); the learner starts until a pod of
    it was first seen running (status.learnerStartTime; also read from what no lost status write can take back: a
    step reported, a pod the Job controller counted failed, a later attempt). After that a pod's trouble (a
    replacement server's preflight killed, a replacement learner's pull refused or its GPUs taken) is a fault the
    job survives, retried."""
    obs, job = p.obs, p.job
    sts = obs.children.get("StatefulSet") or desired.get("StatefulSet") or {}
    learner = obs.children.get("Job") or desired["Job"]
    want = job.spec.rollout.replicas
    assert want is not None, "RolloutSpec's validator sets replicas"
    succeeded, failed, why = job_state(learner)
    suspended = bool((learner.get("spec") or {}).get("suspend"))
    # spec.scheduling.queueName: Kueue owns the learner Job's suspend (it resumes it on admission and would resume it
    # again were the operator to suspend it): the operator never touches it, and stops a learner by deleting its Job.
    queued = bool(job.spec.scheduling.queue_name)
    colocated = job.spec.rollout.colocated  # no pool: the engine is in the learner's ranks
    return _State(
        sts=sts,
        learner=learner,
        want=want,
        ready=int((sts.get("status") or {}).get("readyReplicas") or 0),
        succeeded=succeeded,
        failed=failed,
        why=why,
        suspended=suspended,
        queued=queued,
        colocated=colocated,
        pool_starting=not colocated and (not obs.status.get("startTime") if queued else suspended),
    )


def _carry_status(p: _Pass, s: _State, status: dict[str, Any]) -> None:
    """The status this pass starts from: the pool's and the learner's counts, what earlier passes recorded, and the
    learner's progress (never going back)."""
    obs, old, now = p.obs, p.obs.status, p.now
    status.update(
        {
            "rolloutReplicas": s.want,
            "readyRolloutReplicas": s.ready,
            "learnerActive": int((s.learner.get("status") or {}).get("active") or 0),
        }
    )
    for key in (
        "startTime",
        "completionTime",
        "step",
        "weightVersion",
        "evaluation",
        "lastStepTime",
        "currentStep",
        "learnerStartTime",
        "learnerAttemptTime",
        "learnerDisruptions",
    ):
        if key in old:
            status[key] = old[key]
    status.update(_monotonic_progress(old, obs.progress, learner_final_progress(obs.learner_pods)))
    # The stall clock (spec.learner.stallTimeout) reads the step the learner is on, not the highest one reported: after
    # a resume from a checkpoint it redoes steps below status.step, and each of them is progress.
    on_step = obs.progress.get("step")
    if isinstance(on_step, int) and on_step != old.get("currentStep"):
        status["currentStep"] = on_step
        status["lastStepTime"] = now
    if status.get("step") is not None and status.get("step") != old.get("step"):
        status["lastStepTime"] = now
    evaluation, old_eval = obs.progress.get("evaluation"), old.get("evaluation")
    if isinstance(evaluation, dict) and isinstance(old_eval, dict):
        # The status is written as a merge patch: a figure the new evaluation lacks (not finite, e.g. mAP of a
        # held-out set without objects) would keep the old evaluation's value next to the new step. null removes it;
        # the next pass no longer sees it in the old status, so nothing churns.
        status["evaluation"] = {**{k: None for k in old_eval if k not in evaluation}, **evaluation}
    if not s.suspended and any((pod.get("status") or {}).get("phase") == "Running" for pod in obs.learner_pods):
        status.setdefault("learnerStartTime", now)
    if p.job.spec.learner.nodes > 1:
        status["learnerAttempt"] = int(old.get("learnerAttempt") or 1)
    s.seen_running = (
        bool(status.get("learnerStartTime"))
        or status.get("step") is not None
        or int(old.get("learnerAttempt") or 1) > 1
    )
    s.ran = s.seen_running or int((s.learner.get("status") or {}).get("failed") or 0) >= 1


# ------------------------------------------------------------------------------------- the state's decision


def _finished(p: _Pass, s: _State, d: Decision) -> Decision | None:
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


def _preflight(p: _Pass, s: _State) -> tuple[str, str] | None:
    """A model preflight's refusal. A learner pod whose preflight refused the model never ran, though the Job counts
    it failed: the preflight's verdict holds until a learner pod was seen running."""
    return preflight_failure(
        p.obs.rollout_pods if s.pool_starting or s.colocated else [], [] if s.seen_running else p.obs.learner_pods
    )


def _not_stopping(p: _Pass, s: _State) -> tuple[str, str] | None:
    if not (s.failed and p.job.spec.learner.nodes > 1) or _preflight(p, s) or refused_configuration(p.obs.learner_pods):
        return None
    return attempt_not_stopping(
        s.learner, p.obs.learner_pods, p.job.spec.learner.termination_grace_period_seconds, p.at
    )


def _scale_to_zero(p: _Pass, s: _State, d: Decision) -> None:
    if not s.colocated and (s.sts.get("spec") or {}).get("replicas") != 0:
        d.patches.append(Patch("StatefulSet", p.n["statefulset"], {"spec": {"replicas": 0}}))
    d.status["rolloutReplicas"] = 0


def _failed_or_running(p: _Pass, s: _State, d: Decision) -> Decision:
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


def _clock_inputs(s: _State) -> ClockInputs:
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


def _failed(p: _Pass, s: _State, d: Decision, reason: str, message: str) -> Decision:
    _scale_to_zero(p, s, d)
    if s.queued and not s.failed and (learner_obj := p.obs.children.get("Job")) is not None:
        d.deletes.append(_stop_learner(p.n, learner_obj))
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


def _running(p: _Pass, s: _State, d: Decision, stalled: str) -> Decision:
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


def _pool_said(p: _Pass, s: _State, want: int, released: int, pool_ready: bool, lost: str) -> Said:
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


def _learner_said(p: _Pass, s: _State) -> Said:
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


def _stop_learner(n: dict[str, str], job_obj: dict[str, Any]) -> Delete:
    """A queued job's learner stopped: its Job deleted (with its pods, and its Kueue Workload, which frees the
    queue's quota); suspending it would be undone by Kueue."""
    return Delete("Job", n["job"], (job_obj.get("metadata") or {}).get("uid", ""))


def _next_attempt(p: _Pass, s: _State, d: Decision, attempt: int, disruption: bool) -> Decision:
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


# ------------------------------------------------------------------------------------- helpers


def _diff_paths(old: Any, new: Any, prefix: str = "spec") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _diff_paths(old.get(key), new.get(key), f"{prefix}.{key}")
        return out
    return [] if old == new else [prefix]


def _monotonic_progress(old: dict[str, Any], scraped: dict[str, Any], final: dict[str, int]) -> dict[str, Any]:
    """Progress to report: the newest of what was reported before, what /metrics says now and the finished
    learner's own last word. Step and weight version never go back: a restarted learner reports 0 until it
    finished its first step after resuming, yet the steps before it were done."""
    out = dict(scraped)
    for key in ("step", "weightVersion"):
        seen = [v for v in (old.get(key), scraped.get(key), final.get(key)) if isinstance(v, int)]
        if seen:
            out[key] = max(seen)
    return out


def _by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {render.child_key(o): o for o in objs}
