"""Decide: a pure function of what was observed, in named stages (`decide` reads them top to bottom): read the spec
as applied, stay final, hold when nothing can be made, plan the children, classify the job's state, then that
state's decision (decide_verdict: finished, another attempt, failed by a start rule or a clock, running), its
conditions said through decision.conditions; what the stages share is decide_state. Table-tested without any API
(tests/operator/test_operator_decide.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import yaml

from rmsft.jobspec import API_GROUP, API_VERSION, KIND, JobSpecError, RolloutMatchingJob, parse_job
from rmsft_operator import render
from rmsft_operator.clocks import SHARED_MEMORY_FORBIDDEN, shared_memory_refusal
from rmsft_operator.decide_state import Pass, State
from rmsft_operator.decide_verdict import failed_or_running, finished, stop_learner
from rmsft_operator.decision import Decision, Patch, condition, fit_message
from rmsft_operator.failures import job_state, parse_time
from rmsft_operator.observe import CHILD_KINDS, Observed, api_kind
from rmsft_operator.progress import learner_final_progress


def decide(obs: Observed, now: str) -> Decision:
    """What to create and patch, and the status to report, from what was observed. Pure. In stages: read the spec
    as applied, stay final, hold (nothing can be made), plan the children, classify the job's state, then the state's
    decision: finished, another attempt, failed by a rule or a clock, or running (scale, resume, say why not)."""
    p = _read(obs, now)
    if isinstance(p, Decision):
        return _finish(obs, p, {})
    return _finish(obs, _decide(p), p.durable)


def _decide(p: Pass) -> Decision:
    if p.obs.status.get("phase") in ("Complete", "Failed"):
        return _stay_final(p)
    held = _hold(p)
    if held is not None:
        return held
    d, desired = _plan_children(p)
    s = _classify(p, desired)
    _carry_status(p, s, d.status)
    return finished(p, s, d) or failed_or_running(p, s, d)


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


def _read(obs: Observed, now: str) -> Pass | Decision:
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
    p = Pass(
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


def _stay_final(p: Pass) -> Decision:
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
            d.deletes.append(stop_learner(p.n, job_obj))
        elif not (job_obj.get("spec") or {}).get("suspend"):
            d.patches.append(Patch("Job", p.n["job"], {"spec": {"suspend": True}}))
    return d


def _hold(p: Pass) -> Decision | None:
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


def _held(p: Pass, reason: str, message: str) -> Decision:
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


def _plan_children(p: Pass) -> tuple[Decision, dict[str, dict[str, Any]]]:
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


def _classify(p: Pass, desired: dict[str, dict[str, Any]]) -> State:
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
    return State(
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


def _carry_status(p: Pass, s: State, status: dict[str, Any]) -> None:
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
