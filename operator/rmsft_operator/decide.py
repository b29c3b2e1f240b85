"""Decide: a pure function of what was observed."""

from __future__ import annotations

import datetime as dt
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
from rmsft_operator.decision import Decision, Delete, Patch, condition, fit_message
from rmsft_operator.failures import (
    attempt_not_stopping,
    disrupted,
    image_failure,
    job_state,
    learner_refused,
    lost_servers,
    not_admitted,
    parse_time,
    pod_problem,
    pool_ready_since,
    preflight_failure,
    refused_configuration,
    server_lost,
    startup_failure,
    stuck_learner_pod,
)
from rmsft_operator.observe import CHILD_KINDS, Observed, api_kind
from rmsft_operator.progress import learner_final_progress

PSA_ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
_HOSTPATH_REFUSED_LEVELS = ("baseline", "restricted")
# Condition reason of an shm job that such a level keeps from starting.
SHARED_MEMORY_FORBIDDEN = "SharedMemoryForbidden"


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


def _stalled(status: dict[str, Any], job: RolloutMatchingJob, suspended: bool, learner_pods: list[dict[str, Any]],
             now: str) -> str:
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
    return (f"learner stalled: {what} ({int((at - since).total_seconds())}s, spec.learner.stallTimeout {limit}s); "
            f"its logs say where it waits (kubectl logs job/{render.names(job.metadata.name)['job']})")


def shared_memory_refusal(job: RolloutMatchingJob, namespace: str, labels: dict[str, str] | None) -> str:
    """Why Pod Security admission would refuse this job's pods for their shm volume; '' if it would not.

    Only the namespace's own label is seen: without one the cluster's default level applies, which
    the operator cannot read (pods refused anyway are then named by the FailedCreate condition)."""
    if job.spec.sync.cluster_transport != "shm" or not labels:
        return ""
    level = labels.get(PSA_ENFORCE_LABEL, "")
    if level not in _HOSTPATH_REFUSED_LEVELS:
        return ""
    return (f"spec.sync.transport 'shm' needs a hostPath volume (the node's "
            f"{render.shared_weights_host_path(namespace, job.metadata.name)}, shared by the learner and the "
            f"rollout servers), which namespace {namespace}'s Pod Security level forbids "
            f"({PSA_ENFORCE_LABEL}={level}); nothing is created: recreate the job with spec.sync.transport: grpc, "
            f"or set the namespace's label to privileged")


def _by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {render.child_key(o): o for o in objs}


def decide(obs: Observed, now: str) -> Decision:
    """What to create and patch, and the status to report, from what was observed. Pure."""
    old_status = obs.status
    old_conds: list[dict[str, Any]] = old_status.get("conditions") or []
    gen = obs.generation

    def cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(old_conds, ctype, ok, reason, message, gen, now)

    durable: list[dict[str, Any]] = []  # the CheckpointsDurable condition, once the spec is read

    def finish(d: Decision) -> Decision:
        conds = d.status.get("conditions")
        if durable and isinstance(conds, list) and not any(c.get("type") == "CheckpointsDurable" for c in conds):
            conds.append(durable[0])
        if "message" in d.status:
            d.status["message"] = fit_message(str(d.status["message"]))
        d.status["phase"] = d.phase
        if gen is not None:
            d.status["observedGeneration"] = gen
        if d.phase != old_status.get("phase"):
            kind = "Warning" if d.phase in ("Failed", "Invalid") else "Normal"
            d.events.append((kind, f"Phase{d.phase}", d.status.get("message") or f"phase {d.phase}"))
        return d

    # 1. Validate. An API server without the CRD's validation may let anything through.
    try:
        job = parse_job({"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                         "metadata": {"name": obs.name, "namespace": obs.namespace}, "spec": obs.spec})
    except JobSpecError as exc:
        msg = "; ".join(exc.errors)
        return finish(Decision("Invalid", {"conditions": [cond("InvalidSpec", True, "SpecInvalid", msg)],
                                           "message": msg}))

    n = render.names(obs.name)
    # Where the checkpoints live, said where users look (kubectl describe, the conditions): without a claim, a
    # learner pod lost (evicted, its node gone) takes them along, and its retry starts again from step 0.
    claim, ck_dir = job.spec.learner.checkpoint_claim, job.spec.training.checkpoint.dir
    cadence = render.checkpoint_cadence(job)  # a job that saves only at the end says so here too (issue 60)
    durable.append(cond("CheckpointsDurable", bool(claim), "OnClaim" if claim else "NoCheckpointClaim",
                        f"checkpoints in {ck_dir} on PersistentVolumeClaim {claim}; {cadence}" if claim else
                        f"no spec.learner.checkpointClaim: checkpoints in {ck_dir} live in an emptyDir of the learner "
                        f"pod and are lost with it; its retry starts again from step 0; {cadence}"))
    # 1b. Final is final: a Complete or Failed job never runs again, whatever happens to its children later (its
    # learner Job deleted by hand or by a TTL, the pool edited): nothing is created, the pool stays at zero, the
    # status stays as it was written.
    if old_status.get("phase") in ("Complete", "Failed"):
        d = Decision(old_status["phase"], {k: v for k, v in old_status.items() if k != "observedGeneration"})
        sts = obs.children.get("StatefulSet")
        if sts is not None and (sts.get("spec") or {}).get("replicas") != 0:
            d.patches.append(Patch("StatefulSet", n["statefulset"], {"spec": {"replicas": 0}}))
        job_obj = obs.children.get("Job")
        if job_obj is not None and not any(job_state(job_obj)[:2]):  # a Job of a final job that has not ended
            if job.spec.scheduling.queue_name:  # queued or running under Kueue: only deleting it stops it
                d.deletes.append(_stop_learner(n, job_obj))
            elif not (job_obj.get("spec") or {}).get("suspend"):
                d.patches.append(Patch("Job", n["job"], {"spec": {"suspend": True}}))
        return finish(d)

    # 2. Edits that cannot be applied in place are refused; the job keeps running as applied.
    refused = ""
    cm = obs.children.get("ConfigMap")
    if cm is not None:
        applied_hash = ((cm.get("metadata") or {}).get("annotations") or {}).get(render.SPEC_HASH_ANNOTATION)
        new_spec = job.to_manifest()["spec"]
        if applied_hash and applied_hash != render.spec_hash(new_spec):
            # Read back through the model: a key added to the schema after the job was applied (as
            # spec.sync.transport was) is its default on both sides, not an edit.
            applied = parse_job(yaml.safe_load(cm["data"][render.CONFIG_KEY]))
            changed = _diff_paths(render.immutable_view(applied.to_manifest()["spec"]),
                                  render.immutable_view(new_spec))
            if changed:
                refused = (f"{', '.join(changed)} cannot change once the job exists (only "
                           f"spec.rollout.replicas can); revert the edit, or delete and recreate the job")
                replicas = job.spec.rollout.replicas
                job = applied
                job.spec.rollout.replicas = replicas

    def held(reason: str, message: str) -> Decision:
        """Pending with nothing created, saying why (the Warning event once, not on every pass)."""
        status = {"rolloutReplicas": job.spec.rollout.replicas, "readyRolloutReplicas": 0, "learnerActive": 0,
                  "message": message, "conditions": [
                      cond("RolloutReady", False, reason, message),
                      cond("LearnerRunning", False, reason, message),
                      cond("Complete", False, "NotComplete", message),
                      cond("Failed", False, "NotFailed", message),
                      cond("InvalidSpec", bool(refused), "ImmutableFieldChanged" if refused else "SpecValid",
                           refused or "spec accepted"),
                  ]}
        d = Decision("Pending", status)
        prev = next((c for c in old_conds if c.get("type") == "RolloutReady"), {})
        if prev.get("reason") != reason:
            d.events.append(("Warning", reason, message))
        return finish(d)

    # 3. An shm job in a namespace whose Pod Security level refuses its hostPath volume: every pod
    # would be refused at creation. Create nothing and say why; the labels are read again on every
    # pass, so relabelling the namespace lets the next pass go on. A job whose pool and learner Job
    # exist already (the namespace was relabelled later) goes on as usual: a pod refused then is
    # named by FailedCreate below.
    forbidden = shared_memory_refusal(job, obs.namespace, obs.namespace_labels)
    if forbidden and (obs.children.get("StatefulSet") is None or obs.children.get("Job") is None):
        return held(SHARED_MEMORY_FORBIDDEN, forbidden)

    # 3b. An object with a child's name that another owner made (or that someone made by hand): the operator
    # acts only on what it owns, so it neither adopts nor replaces it. Nothing is created; every pass looks again,
    # so once it is deleted or renamed the job goes on.
    if obs.foreign:
        named = ", ".join(f"{api_kind(kind)} {name}" for kind, name in sorted(obs.foreign.items()))
        return held("NameConflict", f"{named} already exists in namespace {obs.namespace} and is not this job's (no "
                    f"controller reference to it): rmsft does not adopt or replace objects it did not create; delete "
                    f"or rename it, or recreate the job under another name")

    # 3c. Servers given back mid-run (5c) stay given back: the pool and the learner's server list are rendered
    # without them, so no pass scales them up again and the learner stops probing them.
    assert job.spec.rollout.replicas is not None, "RolloutSpec's validator sets replicas (0 for colocate, else >= 1)"
    released = 0 if job.spec.rollout.colocated else max(0, min(int(old_status.get("releasedRolloutReplicas") or 0),
                                                               job.spec.rollout.replicas - 1))
    if released:
        job = job.model_copy(deep=True)
        assert job.spec.rollout.replicas is not None, "a copy of the spec above"
        job.spec.rollout.replicas -= released

    # 4. Children: create what is missing (the token Secret is never rewritten).
    desired = _by_kind(render.render_all(job, obs.namespace, obs.uid))
    d = Decision("Pending", {})
    d.creates = [desired[k] for k in CHILD_KINDS if k in desired and obs.children.get(k) is None]
    if cm is not None:
        # Pool resized: the learner follows the server list. The servers' flags (serve.yaml) are never rewritten
        # (docs/upgrade.md): they were written, once, for the job's image, which its pods keep across an operator
        # upgrade; an older `rmsft serve` refuses a key it does not know, so adding one would crash-loop the next
        # server that restarts.
        data, applied_data = desired["ConfigMap"]["data"], cm.get("data") or {}
        resized = {k: data[k] for k in (render.SERVERS_KEY,) if applied_data.get(k) != data[k]}
        if resized:
            d.patches.append(Patch("ConfigMap", n["config"], {"data": resized}))
    if obs.children.get("Job") is None and not job.spec.learner.checkpoint_claim:
        d.events.append(("Warning", "CheckpointsEphemeral", durable[0]["message"]))

    colocated = job.spec.rollout.colocated  # no pool: the engine is in the learner's ranks
    sts = obs.children.get("StatefulSet") or desired.get("StatefulSet") or {}
    learner = obs.children.get("Job") or desired["Job"]
    want = job.spec.rollout.replicas
    assert want is not None, "RolloutSpec's validator sets replicas"
    succeeded, failed, why = job_state(learner)
    ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
    status = d.status
    status.update({"rolloutReplicas": want, "readyRolloutReplicas": ready,
                   "learnerActive": int((learner.get("status") or {}).get("active") or 0)})
    for key in ("startTime", "completionTime", "step", "weightVersion", "evaluation", "lastStepTime", "currentStep",
                "learnerStartTime", "learnerAttemptTime", "learnerDisruptions"):
        if key in old_status:
            status[key] = old_status[key]
    status.update(_monotonic_progress(old_status, obs.progress, learner_final_progress(obs.learner_pods)))
    # The stall clock (spec.learner.stallTimeout) reads the step the learner is on, not the highest one reported: after
    # a resume from a checkpoint it redoes steps below status.step, and each of them is progress.
    on_step = obs.progress.get("step")
    if isinstance(on_step, int) and on_step != old_status.get("currentStep"):
        status["currentStep"] = on_step
        status["lastStepTime"] = now
    if status.get("step") is not None and status.get("step") != old_status.get("step"):
        status["lastStepTime"] = now
    evaluation, old_eval = obs.progress.get("evaluation"), old_status.get("evaluation")
    if isinstance(evaluation, dict) and isinstance(old_eval, dict):
        # The status is written as a merge patch: a figure the new evaluation lacks (not finite, e.g. mAP
        # of a held-out set without objects) would keep the old evaluation's value next to the new step.
        # null removes it; the next pass no longer sees it in the old status, so nothing churns.
        status["evaluation"] = {**{k: None for k in old_eval if k not in evaluation}, **evaluation}
    invalid = cond("InvalidSpec", bool(refused), "ImmutableFieldChanged" if refused else "SpecValid",
                   refused or "spec accepted")

    # 5. Terminal states free the GPUs: the pool is scaled to zero. A learner Job that failed because its
    # pod's model preflight failed is reported with the preflight's words (5b), not as a learner failure.
    suspended = bool((learner.get("spec") or {}).get("suspend"))
    # spec.scheduling.queueName: Kueue owns the learner Job's suspend (it resumes it on admission and would resume it
    # again were the operator to suspend it): the operator never touches it, and stops a learner by deleting its Job.
    queued = bool(job.spec.scheduling.queue_name)
    at = parse_time(now) or dt.datetime.now(dt.UTC)
    # Start rules hold at the start only. The pool starts until the learner was let go (queued: until it was first
    # Ready, as Kueue may start the learner before it); the learner starts until a pod of it was first seen running
    # (status.learnerStartTime; also read from what no lost status write can take back: a step reported, a pod the
    # Job controller counted failed, a later attempt). After that a pod's trouble (a replacement server's preflight
    # killed, a replacement learner's pull refused or its GPUs taken) is a fault the job survives, retried.
    pool_starting = not colocated and (not status.get("startTime") if queued else suspended)
    if not suspended and any((p.get("status") or {}).get("phase") == "Running" for p in obs.learner_pods):
        status.setdefault("learnerStartTime", now)
    seen_running = bool(status.get("learnerStartTime")) or status.get("step") is not None \
        or int(old_status.get("learnerAttempt") or 1) > 1
    ran = seen_running or int((learner.get("status") or {}).get("failed") or 0) >= 1
    start_learner_pods = [] if ran else obs.learner_pods
    # A learner pod whose preflight refused the model never ran, though the Job counts it failed: the preflight's
    # verdict holds until a learner pod was seen running.
    preflight = preflight_failure(obs.rollout_pods if pool_starting or colocated else [],
                                  [] if seen_running else obs.learner_pods)
    # 5a. A learner on several pods is one torchrun world: one lost pod fails the Job's attempt as a whole (its
    # podFailurePolicy). Unless the learner refused its configuration (every attempt would), the next attempt
    # resumes from the newest checkpoint on the claim, up to spec.learner.backoffLimit restarts (a disruption, the
    # pod's DisruptionTarget, is not counted): the failed Job is deleted once the Job controller has stopped its pods
    # (condition Failed, not only FailureTarget: no pod of the old world may still hold the rendezvous name or the
    # checkpoint folder), and the next pass creates it again. Pods that never stop (a lost node) fail the job after
    # their grace period (failures.attempt_not_stopping).
    not_stopping = None
    if job.spec.learner.nodes > 1:
        attempt = int(old_status.get("learnerAttempt") or 1)
        status["learnerAttempt"] = attempt
        if failed and not preflight and not refused_configuration(obs.learner_pods):
            not_stopping = attempt_not_stopping(learner, obs.learner_pods,
                                                job.spec.learner.termination_grace_period_seconds, at)
            gone = disrupted(learner, obs.learner_pods)
            if not not_stopping and (attempt <= job.spec.learner.backoff_limit or gone):
                return finish(_next_attempt(d, job, learner, attempt, why, ready, cond, invalid, now, gone))
    if succeeded or (failed and not preflight and not not_stopping):
        if not colocated and (sts.get("spec") or {}).get("replicas") != 0:
            d.patches.append(Patch("StatefulSet", n["statefulset"], {"spec": {"replicas": 0}}))
        status["rolloutReplicas"] = 0
        status.setdefault("completionTime", now)
        d.phase = "Complete" if succeeded else "Failed"
        status["message"] = "learner finished" if succeeded else f"learner failed: {why}"
        status["conditions"] = [
            cond("Complete", succeeded, "LearnerSucceeded" if succeeded else "NotComplete", status["message"]),
            cond("Failed", failed, "LearnerFailed" if failed else "NotFailed", status["message"]),
            cond("LearnerRunning", False, "LearnerFinished", status["message"]),
            cond("RolloutReady", False, "PoolScaledDown",
                 "no rollout pool (colocate)" if colocated else "rollout pool scaled to zero"),
            invalid,
        ]
        return finish(d)

    # 5b. A start that cannot succeed fails the job and frees what it holds (the pool scaled to zero, the
    # learner Job suspended, which removes a pod that waits for a node), instead of crash-looping forever.
    stalled = _stalled(status, job, suspended, obs.learner_pods, now)
    # A rollout pod that cannot get its image fails the start; once the learner runs, a replacement server's
    # trouble is the failover's (the other servers go on), as in startup_failure.
    timeout_s = job.spec.rollout.startup_timeout_seconds
    learner_clock = parse_time(obs.failed_create_since.get("Job")) or parse_time(
        (learner.get("status") or {}).get("startTime")) or parse_time((learner.get("metadata") or {}).get(
            "creationTimestamp"))
    pool_ready_now = colocated or (want > 0 and ready >= want)
    mid_run = not colocated and not suspended and bool(status.get("startTime"))
    failure = preflight or not_stopping or image_failure(obs.rollout_pods if pool_starting else [],
                                                         start_learner_pods) \
        or startup_failure(
        obs.rollout_pods, start_learner_pods, pool_starting=pool_starting, timeout_s=timeout_s, now=at,
        pool_since=parse_time((sts.get("metadata") or {}).get("creationTimestamp")),
        pool_refused=obs.failed_creates.get("StatefulSet"), queued=queued) \
        or (learner_refused(obs.failed_creates.get("Job"), learner_clock, timeout_s, at) if not suspended else None) \
        or (not_admitted(job.spec.scheduling.queue_name, suspended, _held_since(status, learner, obs.rollout_pods,
                                                                                want), timeout_s, at)
            if pool_ready_now else None) \
        or (("LearnerStalled", stalled) if stalled and job.spec.learner.fail_when_stalled else None) \
        or (server_lost(obs.rollout_pods, want, timeout_s, at) if mid_run else None)
    # Mid-run, a replacement learner pod that cannot start (not placed: a preemptor took its GPUs; placed but not
    # started: an expired registry token) is retried after the start's own clock: the pod deleted, which the Job
    # controller counts against spec.learner.backoffLimit and replaces; the attempts bound it, not a verdict now.
    retry = stuck_learner_pod(obs.learner_pods, timeout_s, at) if ran and not failure and not suspended else None
    if retry:
        pod_meta = retry[2].get("metadata") or {}
        d.deletes.append(Delete("Pod", pod_meta.get("name", ""), pod_meta.get("uid", "")))
        d.events.append(("Warning", "LearnerPodRetried", f"{retry[1]}; mid-run: the pod is deleted and the learner "
                         f"Job retries it (counted against spec.learner.backoffLimit "
                         f"{job.spec.learner.backoff_limit})"))

    if failure:
        reason, message = failure
        if not colocated and (sts.get("spec") or {}).get("replicas") != 0:
            d.patches.append(Patch("StatefulSet", n["statefulset"], {"spec": {"replicas": 0}}))
        if queued and not failed and (learner_obj := obs.children.get("Job")) is not None:
            d.deletes.append(_stop_learner(n, learner_obj))
        elif not suspended and not failed:
            d.patches.append(Patch("Job", n["job"], {"spec": {"suspend": True}}))
        status["rolloutReplicas"] = 0
        status.setdefault("completionTime", now)
        status["message"] = message
        learner_reason = reason if reason in ("LearnerUnschedulable", "LearnerStartupTimeout", "LearnerNotAdmitted",
                                              "LearnerCreateRefused", "LearnerNotStopped") else "Suspended"
        status["conditions"] = [
            cond("Complete", False, "NotComplete", message),
            cond("Failed", True, reason, message),
            cond("LearnerRunning", False, learner_reason, message),
            cond("RolloutReady", False, "PoolScaledDown",
                 "no rollout pool (colocate)" if colocated else "rollout pool scaled to zero"),
            invalid,
        ]
        d.phase = "Failed"
        return finish(d)

    # 5c. Mid-run, a server that has not been Ready for the startup timeout (a replacement or added server that
    # crash-loops, cannot be scheduled or never loads) holds its GPUs while the others serve: said (condition, one
    # event), and given back when the pool can give it back (its highest ordinals, never the last server). One
    # below a serving server is kept for one more timeout; past twice the timeout it fails the job (5b, ServerLost).
    lost = lost_servers(obs.rollout_pods, want, timeout_s, at) if mid_run else None
    if lost:
        release, lost_msg = lost
        want -= release
        released += release
        prev = next((c for c in old_conds if c.get("type") == "RolloutReady"), {})
        if release or prev.get("reason") != "ServerLost":
            d.events.append(("Warning", "ServerLost", lost_msg))
    if released:
        status.update(rolloutReplicas=want, releasedRolloutReplicas=released)

    # 6. Scale the pool to the spec; resume the learner once every server is Ready.
    if not colocated and (sts.get("spec") or {}).get("replicas") != want:
        d.patches.append(Patch("StatefulSet", n["statefulset"], {"spec": {"replicas": want}}))
    pool_ready = colocated or (want > 0 and ready >= want)
    if pool_ready and suspended and not queued:
        d.patches.append(Patch("Job", n["job"], {"spec": {"suspend": False}}))
        suspended = False
        status["startTime"] = now
    elif pool_ready and queued and not status.get("startTime"):
        status["startTime"] = now  # the pool's start is over; Kueue decides when the learner runs

    # 7. Conditions: say what holds the job up, in words a person can act on.
    pool_msg = "rollouts run inside the learner (colocate)" if colocated else f"{ready}/{want} rollout servers Ready"
    pool_reason = "Colocated" if colocated else "PoolReady" if pool_ready else "PoolNotReady"
    if released:
        pool_msg += f" ({released} given back mid-run: not Ready for spec.rollout.startupTimeout)"
    if lost:
        pool_reason, pool_msg = "ServerLost", f"{pool_msg}; {lost[1]}"
    elif not pool_ready:
        problem = pod_problem(obs.rollout_pods)
        if "StatefulSet" in obs.failed_creates:
            problem = ("FailedCreate", f"rollout pods cannot be created: {obs.failed_creates['StatefulSet']}")
        if problem:
            pool_reason, pool_msg = problem[0], f"{pool_msg}; {problem[1]}"
    learner_ready = int((learner.get("status") or {}).get("ready") or 0)
    learner_running = not suspended and (learner_ready >= 1 or any(
        (p.get("status") or {}).get("phase") == "Running" for p in obs.learner_pods))
    if suspended and queued:
        learner_reason, learner_msg = "Queued", (f"learner Job waits for Kueue to admit it (LocalQueue "
                                                 f"{job.spec.scheduling.queue_name})")
    elif suspended:
        learner_reason, learner_msg = "Suspended", "learner waits for the rollout pool"
    elif learner_running:
        learner_reason, learner_msg = "Running", "learner pod running"
    else:
        learner_reason, learner_msg = "PodPending", "learner Job resumed; its pod is not running yet"
        problem = pod_problem(obs.learner_pods)
        if "Job" in obs.failed_creates:
            problem = ("FailedCreate", f"learner pod cannot be created: {obs.failed_creates['Job']}")
        if problem:
            learner_reason, learner_msg = problem[0], f"{learner_msg}; {problem[1]}"
    if stalled:
        progressing = cond("Progressing", False, "LearnerStalled", stalled)
        prev = next((c for c in old_conds if c.get("type") == "Progressing"), {})
        if prev.get("reason") != "LearnerStalled":  # once, when it stalls, not on every pass
            d.events.append(("Warning", "LearnerStalled", stalled))
    elif learner_running:
        progressing = cond("Progressing", True, "StepsAdvancing", f"step {status.get('step', 0)}")
    else:
        progressing = cond("Progressing", False, "NotStarted", learner_msg)
    status["conditions"] = [
        cond("RolloutReady", pool_ready, pool_reason, pool_msg),
        cond("LearnerRunning", learner_running, learner_reason, learner_msg),
        progressing,
        cond("Complete", False, "NotComplete", learner_msg),
        cond("Failed", False, "NotFailed", learner_msg),
        invalid,
    ]
    status["message"] = refused or f"{pool_msg}; {learner_msg}"
    if learner_running:
        d.phase = "Running"
    elif not suspended or ready:
        d.phase = "Starting"
    else:
        d.phase = "Pending"
    return finish(d)


def _held_since(status: dict[str, Any], learner: dict[str, Any], rollout_pods: list[dict[str, Any]],
                replicas: int) -> dt.datetime | None:
    """Since when a queued job's pool has been Ready while its learner Job is held: the later of the pool being Ready
    (the latest Ready transition of its pods, the API's clock; status.startTime when the pods do not say) and the
    Job's last suspension (its Suspended condition: Kueue suspends a Job it preempts, which queues it again), so a
    learner preempted mid-run gets its own wait, and a pool preempted with it and admitted again is timed from its
    new Ready. None before the pool was Ready."""
    ready = pool_ready_since(rollout_pods, replicas) or parse_time(status.get("startTime"))
    if ready is None:
        return None
    held = [parse_time(c.get("lastTransitionTime")) for c in (learner.get("status") or {}).get("conditions") or []
            if c.get("type") == "Suspended" and c.get("status") == "True"]
    return max([ready, *[t for t in held if t is not None]])


def _stop_learner(n: dict[str, str], job_obj: dict[str, Any]) -> Delete:
    """A queued job's learner stopped: its Job deleted (with its pods, and its Kueue Workload, which frees the
    queue's quota); suspending it would be undone by Kueue."""
    return Delete("Job", n["job"], (job_obj.get("metadata") or {}).get("uid", ""))


def _next_attempt(d: Decision, job: RolloutMatchingJob, learner: dict[str, Any], attempt: int, why: str, ready: int,
                  cond: Any, invalid: dict[str, Any], now: str, disruption: bool = False) -> Decision:
    """Step 5a's decision: a failed attempt of a learner on several pods, another one allowed. The pool keeps
    running (the next attempt re-syncs it); the Job is deleted once its pods have stopped. A disruption (a pod's
    DisruptionTarget: evicted, drained, preempted) is no fault of the run: the attempt is run again, not counted
    (status.learnerDisruptions counts those)."""
    limit = job.spec.learner.backoff_limit + 1
    conds = {c.get("type"): c for c in (learner.get("status") or {}).get("conditions") or []
             if c.get("status") == "True"}
    nxt = attempt if disruption else attempt + 1
    head = f"learner attempt {attempt} of {limit} " + ("disrupted (not counted)" if disruption else "failed") + \
        f": {why}"
    if "Failed" in conds:
        d.deletes.append(Delete("Job", render.names(job.metadata.name)["job"], learner["metadata"]["uid"]))
        d.status["learnerAttempt"] = nxt
        # When this attempt's Job went: the clock of a refused re-create (refused_create), written in the same status
        # write that comes before the delete (act), so the delete never happens without it.
        d.status["learnerAttemptTime"] = now
        if disruption:
            d.status["learnerDisruptions"] = int(d.status.get("learnerDisruptions") or 0) + 1
        message = f"{head}; attempt {nxt} " + ("runs again" if disruption else "resumes") + \
            " from the newest checkpoint"
        d.events.append(("Warning", "LearnerRestarted", message))
    else:
        message = f"{head}; its other pods are stopping, then attempt {nxt} starts"
    message = fit_message(message)
    want = job.spec.rollout.replicas
    assert want is not None, "RolloutSpec's validator sets replicas"
    pool_ready = job.spec.rollout.colocated or ready >= want
    d.status["message"] = message
    d.status["conditions"] = [
        cond("RolloutReady", pool_ready, "PoolReady" if pool_ready else "PoolNotReady", f"{ready}/{want} rollout "
             "servers Ready"),
        cond("LearnerRunning", False, "AttemptFailed", message),
        cond("Progressing", False, "AttemptFailed", message),
        cond("Complete", False, "NotComplete", message),
        cond("Failed", False, "NotFailed", message),
        invalid,
    ]
    d.phase = "Running"
    return d
