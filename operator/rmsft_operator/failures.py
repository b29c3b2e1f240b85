"""Why a RolloutMatchingJob cannot go on, read from its pods and its learner Job: a container stuck in a way
that needs a person, a failed model preflight, a rollout server that says its configuration is invalid or
restarts without ever becoming Ready, the startup deadline, and a start failure that stays (Failed is final).

Pure functions of plain API dicts and a clock, called by `reconcile` (table-tested through `decide` in
tests/operator/test_operator_decide.py). The rules return (reason, message) or None, the message in the pod's
(or the scheduler's) own words.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from rmsft_operator import render

# Container states that will not fix themselves: worth naming in a condition.
_STUCK_WAITING = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
}
_MAX_HINT = 600
# What `rmsft serve` says (rollout_engine.config.ServeConfig.validate) when its configuration cannot work, e.g. a
# model folder that does not exist: restarting the container changes nothing. Its exit code (1) is the one of
# every other failure, so the words are what tell it apart.
SERVE_INVALID_CONFIG = "rmsft serve: invalid configuration"
SERVE_SAYS = "rmsft serve:"
# Restarts of a rollout container before the pool was ever Ready that make it a crash loop (the kubelet's
# back-off between them is 10 s, 20 s, 40 s...: a few minutes, well inside any startup timeout).
CRASH_LOOP_RESTARTS = 3
# Failed-condition reasons of a job whose start could not succeed. Such a job stays Failed (its pool at zero,
# its learner suspended) until it is deleted, as one whose learner failed does.
STARTUP_FAILURES = (
    "ModelPreflightFailed",
    "ImageUnavailable",
    "RolloutInvalidConfig",
    "RolloutCrashLoop",
    "RolloutStartupTimeout",
    "LearnerUnschedulable",
    "LearnerStartupTimeout",
)
# The kubelet's waiting reasons for an image it will never get with this spec (imagePullPolicy Never and the
# image not on the node; a name that is not an image reference).
_IMAGE_NEVER = {"ErrImageNeverPull", "InvalidImageName"}
# A pull error in these words is the registry's answer (the image or tag is not there, or not for these
# credentials), not network trouble: retrying the same pull gets the same answer. Other pull errors (a timeout,
# a rate limit) wait for the start deadline.
_PULL_REFUSED = (
    "not found",
    "manifest unknown",
    "name unknown",
    "repository does not exist",
    "pull access denied",
    "unauthorized",
    "authorization failed",
    "403 forbidden",
)
# What `rmsft preflight` (the pods' init container, render.PREFLIGHT_CONTAINER) starts its message with.
PREFLIGHT_SAYS = "rmsft preflight:"


def job_finished(learner: dict[str, Any]) -> bool:
    """Whether the learner's batch/v1 Job succeeded or failed (either way, no pod of it will come)."""
    succeeded, failed, _ = job_state(learner)
    return succeeded or failed


def job_state(learner: dict[str, Any]) -> tuple[bool, bool, str]:
    """(succeeded, failed, failure reason) of a batch/v1 Job."""
    st = learner.get("status") or {}
    conds = {c.get("type"): c for c in st.get("conditions") or [] if c.get("status") == "True"}
    # FailureTarget: the Job controller has decided (a podFailurePolicy FailJob rule, the backoff limit) and is
    # terminating the Job's other pods; Failed follows once they are gone, which for a learner pod still in a
    # collective whose peer is lost can be its whole grace period. The decision is what counts.
    c = conds.get("Failed") or conds.get("FailureTarget")
    if c is not None:
        return False, True, f"{c.get('reason', 'Failed')}: {c.get('message', '')}".strip(": ")
    succeeded = "Complete" in conds or int(st.get("succeeded") or 0) >= 1
    return succeeded, False, ""


def refused_configuration(pods: list[dict[str, Any]]) -> str | None:
    """The name of a learner pod whose learner container exited with render.CONFIG_EXIT_CODE (`rmsft train` refused
    its configuration: every attempt would), else None."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            done = (cs.get("state") or {}).get("terminated") or {}
            if cs.get("name") == "learner" and done.get("exitCode") == render.CONFIG_EXIT_CODE:
                return str((pod.get("metadata") or {}).get("name", "?"))
    return None


def pod_problem(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) of the first pod that is stuck in a way that needs a person, else None."""
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        pname = (pod.get("metadata") or {}).get("name", "?")
        st = pod.get("status") or {}
        for c in st.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return "Unschedulable", f"pod {pname} cannot be scheduled: {c.get('message', '')}".strip()
        for cs in st.get("containerStatuses") or []:
            state, last = cs.get("state") or {}, cs.get("lastState") or {}
            waiting = state.get("waiting") or {}
            terminated = state.get("terminated") or last.get("terminated") or {}
            said = (terminated.get("message") or "").strip()
            if waiting.get("reason") in _STUCK_WAITING:
                detail = said or waiting.get("message") or ""
                return waiting["reason"], f"pod {pname}: {waiting['reason']}: {detail}".strip(": ")[:_MAX_HINT]
            if (state.get("terminated") or {}).get("exitCode") not in (None, 0):
                code = state["terminated"]["exitCode"]
                return "ContainerFailed", f"pod {pname} exited with code {code}: {said}".strip(": ")[:_MAX_HINT]
    return None


def parse_time(text: Any) -> dt.datetime | None:
    """An API timestamp (RFC 3339, `Z` for UTC) as a datetime; None when absent or unreadable."""
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def _pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _server_says(message: str) -> str:
    """The server's own words from a termination message (the file it wrote, or the kubelet's copy of its log
    tail): from its last `rmsft serve:` line on, else the last non-empty line."""
    message = message.strip()
    at = message.rfind(SERVE_SAYS)
    if at >= 0:
        return message[at:][:_MAX_HINT]
    lines = [line for line in message.splitlines() if line.strip()]
    return lines[-1].strip()[:_MAX_HINT] if lines else ""


def _span(seconds: int) -> str:
    return f"{seconds // 60} min" if seconds % 60 == 0 and seconds >= 60 else f"{seconds} s"


# A container the kernel's OOM killer (or a SIGKILL) ended said nothing about the model: it is the node's memory, a
# fault to retry, never the preflight's verdict.
_KILLED_EXIT = 137


def _killed(ended: dict[str, Any]) -> bool:
    return ended.get("reason") == "OOMKilled" or ended.get("exitCode") == _KILLED_EXIT


def preflight_failure(rollout_pods: list[dict[str, Any]], learner_pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """("ModelPreflightFailed", message) when the model preflight init container of a rollout or learner pod
    exited non-zero, else None. Pure. Its verdict (the model folder does not fit the job, e.g. a stock
    checkpoint with training.format coordexp) holds for every pod of the job and no restart changes it, so
    the job fails at once, before any container loaded the model. The message is the preflight's own words,
    prefixed with the pod's name."""
    for role, pods in (("rollout", rollout_pods), ("learner", learner_pods)):
        for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
            if (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
                if cs.get("name") != render.PREFLIGHT_CONTAINER:
                    continue
                ended = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
                if ended.get("exitCode") in (None, 0) or _killed(ended):
                    continue
                said = str(ended.get("message") or "").strip()
                at = said.rfind(PREFLIGHT_SAYS)
                why = said[at:] if at >= 0 else _server_says(said) or ended.get("reason") or "no message"
                pname = (pod.get("metadata") or {}).get("name", "?")
                return "ModelPreflightFailed", (
                    f"{role} pod {pname}: model preflight failed (exit code {ended['exitCode']}): {why}"
                )[: _MAX_HINT * 2]
    return None


def image_failure(rollout_pods: list[dict[str, Any]], learner_pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """("ImageUnavailable", message) when a container (init containers included) of any of the job's pods waits
    for an image it cannot have (`_IMAGE_NEVER`, or a pull the registry refused: `_PULL_REFUSED`), else None. Pure.
    No restart gets it, so the job fails at once, whatever the start deadline, with the kubelet's words."""
    for role, pods in (("rollout", rollout_pods), ("learner", learner_pods)):
        for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
            if (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            st = pod.get("status") or {}
            for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                reason, said = waiting.get("reason"), str(waiting.get("message") or "").strip()
                if reason in _IMAGE_NEVER or (
                    reason in ("ErrImagePull", "ImagePullBackOff") and any(w in said.lower() for w in _PULL_REFUSED)
                ):
                    pname = (pod.get("metadata") or {}).get("name", "?")
                    return "ImageUnavailable", (
                        f"{role} pod {pname}: container {cs.get('name', '?')} cannot get "
                        f"image {cs.get('image') or '?'}: {reason}: {said}"
                    ).strip(": ")[:_MAX_HINT]
    return None


def _gated(pod: dict[str, Any]) -> bool:
    """The pod waits behind a scheduling gate (Kueue's, before admission): not yet asking for a node."""
    return bool((pod.get("spec") or {}).get("schedulingGates")) or any(
        c.get("type") == "PodScheduled" and c.get("reason") == "SchedulingGated"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _scheduled_since(pod: dict[str, Any]) -> dt.datetime | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "True":
            return parse_time(c.get("lastTransitionTime"))
    return None


def not_admitted(
    queue: str | None, suspended: bool, pool_ready_since: dt.datetime | None, timeout_s: int, now: dt.datetime
) -> tuple[str, str] | None:
    """("LearnerNotAdmitted", message) when a queued job's pool has been Ready for `timeout_s` while Kueue still holds
    its learner Job: Kueue admits the two workloads one by one, and the pool's GPUs would idle for as long as the
    learner waits in the queue. Pure."""
    if (
        not queue
        or not suspended
        or pool_ready_since is None
        or now - pool_ready_since < dt.timedelta(seconds=timeout_s)
    ):
        return None
    return "LearnerNotAdmitted", (
        f"the learner Job was not admitted by Kueue (LocalQueue {queue}) within "
        f"spec.rollout.startupTimeout ({_span(timeout_s)}) of the rollout pool being Ready, "
        "whose GPUs idled meanwhile: give the LocalQueue room for both workloads (the pool "
        "and the learner), or a gang scheduler (spec.scheduling.schedulerName)"
    )


def startup_failure(
    rollout_pods: list[dict[str, Any]],
    learner_pods: list[dict[str, Any]],
    pool_starting: bool,
    timeout_s: int,
    now: dt.datetime,
    pool_since: dt.datetime | None = None,
    pool_refused: str | None = None,
    queued: bool = False,
) -> tuple[str, str] | None:
    """(reason, message) when the job cannot start and should fail now, else None. Pure.

    While the pool is starting (the learner still waits for it): a rollout server that said its configuration
    is invalid, one that restarted CRASH_LOOP_RESTARTS times without being Ready, a pod not Ready `timeout_s`
    after the pool was made (`pool_since`, the StatefulSet's creation: the clock is the job's, so a pod deleted
    and made again does not restart it; the pod's own creation when not given), whether unschedulable, not
    pulled or still loading, or pods the API refused to create (`pool_refused`, the FailedCreate words) that long.
    At any time: a learner pod the scheduler could not place for `timeout_s`, or one placed that long ago whose
    containers never started (a volume that does not attach or mount, an image still pulling, a missing
    ConfigMap key). The message is the server's (or scheduler's, or kubelet's) own words, prefixed with the pod's
    name.

    `queued` (spec.scheduling.queueName): waiting for Kueue to admit the pool is not a failure to start, so the
    job's clock (`pool_since`) does not apply; a rollout pod's own clock starts when it is placed, after admission
    (Kueue's waitForPodsReady bounds what follows)."""
    limit = dt.timedelta(seconds=timeout_s)
    # Queued: Kueue admits the pool's workload as a whole, so the first placement of any of its pods is the
    # admission; a pod of an admitted pool that is still not placed (no room for it: a partial placement) is timed
    # from then, not left without a clock.
    placed = [t for p in rollout_pods if (t := _scheduled_since(p)) is not None]
    admitted = min(placed) if placed else None
    if queued:
        pool_since = None
    if pool_starting and pool_refused and pool_since is not None and now - pool_since >= limit:
        return "RolloutStartupTimeout", (
            f"rollout pool not Ready within spec.rollout.startupTimeout "
            f"({_span(timeout_s)}): rollout pods cannot be created: {pool_refused}"
        )[:_MAX_HINT]
    if pool_starting:
        for pod in sorted(rollout_pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
            if _pod_ready(pod) or (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            pname = (pod.get("metadata") or {}).get("name", "?")
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                ended = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
                said = str(ended.get("message") or "")
                if SERVE_INVALID_CONFIG in said:
                    return "RolloutInvalidConfig", f"rollout pod {pname}: {said[said.rfind(SERVE_INVALID_CONFIG) :]}"[
                        :_MAX_HINT
                    ]
                restarts = int(cs.get("restartCount") or 0)
                if restarts >= CRASH_LOOP_RESTARTS:
                    code = ended.get("exitCode")
                    why = _server_says(said) or ended.get("reason") or "no message"
                    return "RolloutCrashLoop", (
                        f"rollout pod {pname} restarted {restarts} times without becoming "
                        f"Ready (last exit code {code}): {why}"
                    )[:_MAX_HINT]
            created = (
                (_scheduled_since(pod) or (admitted if not _gated(pod) else None))
                if queued
                else pool_since or parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
            )
            if created is not None and now - created >= limit:
                problem = pod_problem([pod])
                detail = problem[1] if problem else f"pod {pname} is still starting"
                return "RolloutStartupTimeout", (
                    f"rollout pool not Ready within spec.rollout.startupTimeout ({_span(timeout_s)}): {detail}"
                )[:_MAX_HINT]
    stuck = stuck_learner_pod(learner_pods, timeout_s, now)
    return stuck[:2] if stuck else None


def stuck_learner_pod(
    learner_pods: list[dict[str, Any]], timeout_s: int, now: dt.datetime
) -> tuple[str, str, dict[str, Any]] | None:
    """(reason, message, pod) of a learner pod the scheduler could not place for `timeout_s`, or one placed that long
    ago whose containers never started; None when there is none. Pure. At the start this fails the job
    (startup_failure); mid-run the same pod is a replacement, retried instead (reconcile)."""
    limit = dt.timedelta(seconds=timeout_s)
    for pod in sorted(learner_pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        st = pod.get("status") or {}
        if st.get("phase") in ("Succeeded", "Failed") or (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for c in st.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                since = parse_time(c.get("lastTransitionTime")) or parse_time(
                    (pod.get("metadata") or {}).get("creationTimestamp")
                )
                if since is not None and now - since >= limit:
                    pname = (pod.get("metadata") or {}).get("name", "?")
                    return (
                        "LearnerUnschedulable",
                        (
                            f"learner pod {pname} not scheduled within "
                            f"spec.rollout.startupTimeout ({_span(timeout_s)}): "
                            f"{c.get('message', '')}"
                        ).strip()[:_MAX_HINT],
                        pod,
                    )
        placed = _scheduled_since(pod)
        if st.get("phase") == "Pending" and placed is not None and now - placed >= limit:
            pname = (pod.get("metadata") or {}).get("name", "?")
            problem = pod_problem([pod])
            waits = [
                f"{cs.get('name', '?')}: {w.get('reason')}{': ' + w['message'] if w.get('message') else ''}"
                for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]
                if (w := (cs.get("state") or {}).get("waiting") or {}).get("reason")
            ]
            detail = problem[1] if problem else "; ".join(waits) or "its containers were never started"
            return (
                "LearnerStartupTimeout",
                (
                    f"learner pod {pname} placed on a node but not started within "
                    f"spec.rollout.startupTimeout ({_span(timeout_s)}): {detail} (a volume "
                    "that does not attach or mount shows in `kubectl describe pod "
                    f"{pname}`)"
                )[:_MAX_HINT],
                pod,
            )
    return None


def _ordinal(pod: dict[str, Any]) -> int | None:
    tail = str((pod.get("metadata") or {}).get("name", "")).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _not_ready_since(pod: dict[str, Any]) -> dt.datetime | None:
    """Since when a pod is not Ready: its Ready condition's last change, else (never placed, no condition yet)
    its creation."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") != "True" and c.get("lastTransitionTime"):
            return parse_time(c["lastTransitionTime"])
    return parse_time((pod.get("metadata") or {}).get("creationTimestamp"))


def _lost(
    rollout_pods: list[dict[str, Any]], replicas: int, limit: dt.timedelta, now: dt.datetime
) -> dict[int, tuple[str, dt.datetime]]:
    """ordinal -> (what its pod says, since when it is not Ready) of the rollout pods of the first `replicas`
    ordinals not Ready for `limit`."""
    by_ordinal = {
        o: p
        for p in rollout_pods
        if (o := _ordinal(p)) is not None and o < replicas and not (p.get("metadata") or {}).get("deletionTimestamp")
    }
    lost: dict[int, tuple[str, dt.datetime]] = {}
    for o, pod in sorted(by_ordinal.items()):
        since = _not_ready_since(pod)
        if _pod_ready(pod) or since is None or now - since < limit:
            continue
        problem = pod_problem([pod])
        pname = (pod.get("metadata") or {}).get("name", "?")
        lost[o] = (problem[1] if problem else f"pod {pname} is still starting", since)
    return lost


def _releasable(lost: set[int], replicas: int) -> int:
    """How many of the pool's highest ordinals are lost (a StatefulSet removes pods from the top), never the last
    server."""
    release = 0
    while replicas - release - 1 in lost and replicas - release > 1:
        release += 1
    return release


def lost_servers(
    rollout_pods: list[dict[str, Any]], replicas: int, timeout_s: int, now: dt.datetime
) -> tuple[int, str] | None:
    """Mid-run (the pool was Ready and the learner runs): (release, message) when a rollout pod of the first
    `replicas` ordinals has not been Ready for `timeout_s` (spec.rollout.startupTimeout, the time a server has to
    start at the beginning too): a replacement or added server that crash-loops, cannot be scheduled or never
    finishes loading. It holds its GPUs while the others serve. `release`: how many of them the pool can give
    back now, the lost ones among its highest ordinals (a StatefulSet removes pods from the top), never the last
    server (with none up the learner fails the run after spec.rollout.recoveryTimeout, which frees the pool).
    Lost pods below a serving one are named and kept for one more timeout (server_lost ends that). Pure."""
    lost = _lost(rollout_pods, replicas, dt.timedelta(seconds=timeout_s), now)
    if not lost:
        return None
    release = _releasable(set(lost), replicas)
    kept = sorted(set(lost) - set(range(replicas - release, replicas)))
    said = "; ".join(lost[o][0] for o in sorted(lost))
    message = f"rollout server(s) not Ready for spec.rollout.startupTimeout ({_span(timeout_s)}) mid-run: {said}"
    if release:
        message += f"; the top {release} given back (the pool scaled to {replicas - release})"
    if kept:
        below = replicas - release - 1 not in lost  # a serving server above them, not only the last one left
        message += (
            f"; kept ordinal(s) {', '.join(map(str, kept))}: a StatefulSet gives back only its highest "
            "ordinals and the last server stays (delete the pod to retry it, or lower "
            "spec.rollout.replicas)"
            + (f"; not Ready for {_span(2 * timeout_s)}, the job fails and its pool is freed" if below else "")
        )
    return release, message[:_MAX_HINT]


def server_lost(
    rollout_pods: list[dict[str, Any]], replicas: int, timeout_s: int, now: dt.datetime
) -> tuple[str, str] | None:
    """Mid-run: ("ServerLost", message) when a rollout server below a serving one (which a StatefulSet cannot give
    back alone: it removes pods from the top) has not been Ready for twice `timeout_s`, from its pod's Ready
    condition (the API's clock: no lost status write restarts it; deleting the pod, the retry lost_servers asks
    for, does). Kept for one timeout past the start's own, it is not coming back, and its GPUs would be held to the
    end of the run: the job fails and frees the pool, as every other clock ends. Pure."""
    lost = _lost(rollout_pods, replicas, dt.timedelta(seconds=timeout_s), now)
    release = _releasable(set(lost), replicas)  # the top, given back this pass (lost_servers)
    if replicas - release - 1 in lost:  # only the last server is left: the learner's recoveryTimeout ends that
        return None
    kept = [
        o
        for o, (_, since) in sorted(lost.items())
        if o < replicas - release and now - since >= dt.timedelta(seconds=2 * timeout_s)
    ]
    if not kept:
        return None
    which = "; ".join(
        f"ordinal {o} not Ready since {lost[o][1].strftime('%Y-%m-%dT%H:%M:%SZ')}: {lost[o][0]}" for o in kept
    )
    return "ServerLost", (
        f"rollout server(s) lost mid-run below a Ready one for twice spec.rollout.startupTimeout "
        f"({_span(2 * timeout_s)}): {which}. A StatefulSet gives back only its highest ordinals, so "
        "its GPUs would be held to the end of the run: the job is failed and its pool freed. Read "
        "the pod's logs (kubectl logs --previous), fix the cause, and recreate the job (it resumes "
        "from the newest checkpoint on spec.learner.checkpointClaim)"
    )[: _MAX_HINT * 2]


def pool_ready_since(rollout_pods: list[dict[str, Any]], replicas: int) -> dt.datetime | None:
    """Since when all `replicas` rollout pods have been Ready: the latest Ready transition among them (the API's
    clock, which no lost status write moves); None when the pool is not Ready now."""
    times = []
    for pod in rollout_pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp") or not _pod_ready(pod):
            continue
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") == "True":
                times.append(parse_time(c.get("lastTransitionTime")))
    if len(times) < replicas or replicas < 1 or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


def learner_refused(
    refused: str | None, since: dt.datetime | None, timeout_s: int, now: dt.datetime
) -> tuple[str, str] | None:
    """("LearnerCreateRefused", message) when the learner Job's pods have been refused at creation (a namespace
    ResourceQuota, Pod Security admission, a webhook: the FailedCreate words `refused`) for `timeout_s` since `since`
    (the first such refusal, else the Job's start: the API's clocks). The pool's GPUs are held meanwhile. Pure."""
    if not refused or since is None or now - since < dt.timedelta(seconds=timeout_s):
        return None
    return "LearnerCreateRefused", (
        f"learner pod cannot be created for spec.rollout.startupTimeout ({_span(timeout_s)}): {refused}"
    )[:_MAX_HINT]


# How long past a learner pod's grace period the Job controller may take to see it gone (the kubelet's last status
# report): a pod still there after that is on a node that no longer answers.
STOP_MARGIN_S = 300


def attempt_not_stopping(
    learner: dict[str, Any], learner_pods: list[dict[str, Any]], grace_s: int, now: dt.datetime
) -> tuple[str, str] | None:
    """("LearnerNotStopped", message) when a learner Job on several pods was decided failed (FailureTarget) longer
    than its pods' grace period plus STOP_MARGIN_S ago and is still not Failed: the Job controller writes Failed only
    once every pod is terminal, and a pod on a lost node stays Terminating (it may even still run, cut off, writing
    to the checkpoint folder, so no next attempt may start beside it). Pure."""
    conds = {
        c.get("type"): c for c in (learner.get("status") or {}).get("conditions") or [] if c.get("status") == "True"
    }
    target = conds.get("FailureTarget")
    if target is None or "Failed" in conds:
        return None
    since = parse_time(target.get("lastTransitionTime"))
    limit = grace_s + STOP_MARGIN_S
    if since is None or (now - since).total_seconds() < limit:
        return None
    left = sorted(
        (p.get("metadata") or {}).get("name", "?")
        for p in learner_pods
        if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    )
    return "LearnerNotStopped", (
        f"the failed learner attempt's pods did not stop within spec.learner."
        f"terminationGracePeriod + {STOP_MARGIN_S} s ({_span(limit)}): "
        f"{', '.join(left) or 'a pod'} still terminating (a node that no longer answers?); "
        "no next attempt may start beside it, so the job is failed and its pool freed: "
        "`kubectl get pods -o wide` names the node"
    )[:_MAX_HINT]


def disrupted(learner: dict[str, Any], learner_pods: list[dict[str, Any]]) -> bool:
    """A learner Job on several pods failed because one of its pods was disrupted (evicted, drained, preempted: the
    pod's DisruptionTarget condition, which the Job's first podFailurePolicy rule matches): no fault of the run."""
    conds = [
        c
        for c in (learner.get("status") or {}).get("conditions") or []
        if c.get("status") == "True" and c.get("type") in ("Failed", "FailureTarget")
    ]
    if any("DisruptionTarget" in str(c.get("message") or "") for c in conds):
        return True
    return any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        for p in learner_pods
        for c in (p.get("status") or {}).get("conditions") or []
    )
