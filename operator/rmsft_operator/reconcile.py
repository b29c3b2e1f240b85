"""One level-triggered reconcile pass over a RolloutMatchingJob.

Every trigger (create/update/resume of the job, an event on a child StatefulSet or Job, the
periodic resync) runs the same pass: read the current state, create what is missing, scale the
pool, resume the learner when the pool is Ready, write the status. Each step is idempotent, so a
pass interrupted by an API error is simply run again.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from rmsft.jobspec import API_GROUP, API_VERSION, KIND, JobSpecError, parse_job
from rmsft_operator import render
from rmsft_operator.kube import Kube
from rmsft_operator.progress import learner_progress

log = logging.getLogger("rmsft_operator.reconcile")

# (type, reason, message) for kubernetes Events; the handlers module posts them through kopf.
EventSink = Callable[[dict[str, Any], str, str, str], None]


@dataclass
class Outcome:
    phase: str
    status: dict[str, Any]
    created: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(old: list[dict[str, Any]], ctype: str, ok: bool, reason: str, message: str,
               generation: int | None) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = next((c for c in old if c.get("type") == ctype), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else None
    cond = {"type": ctype, "status": status, "reason": reason, "message": message[:4000],
            "lastTransitionTime": since or _now()}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _diff_paths(old: Any, new: Any, prefix: str = "spec") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _diff_paths(old.get(key), new.get(key), f"{prefix}.{key}")
        return out
    return [] if old == new else [prefix]


def _job_state(learner: dict[str, Any]) -> tuple[bool, bool, str]:
    """(succeeded, failed, failure reason) of a batch/v1 Job."""
    st = learner.get("status") or {}
    conds = {c.get("type"): c for c in st.get("conditions") or [] if c.get("status") == "True"}
    if "Failed" in conds:
        c = conds["Failed"]
        return False, True, f"{c.get('reason', 'Failed')}: {c.get('message', '')}".strip(": ")
    succeeded = "Complete" in conds or int(st.get("succeeded") or 0) >= 1
    return succeeded, False, ""


def reconcile(kube: Kube, body: dict[str, Any], progress_timeout: float = 0.0) -> Outcome:
    meta = body.get("metadata") or {}
    name, namespace, uid = meta["name"], meta.get("namespace") or "default", meta.get("uid") or ""
    generation = meta.get("generation")
    old_status = body.get("status") or {}
    old_conds = old_status.get("conditions") or []
    old_phase = old_status.get("phase")

    def finish(phase: str, status: dict[str, Any], created: list[str] | None = None) -> Outcome:
        status = {**status, "phase": phase}
        if generation is not None:
            status["observedGeneration"] = generation
        out = Outcome(phase, status, created or [])
        if phase != old_phase:
            kind = "Warning" if phase in ("Failed", "Invalid") else "Normal"
            out.events.append((kind, f"Phase{phase}", status.get("message") or f"phase {phase}"))
        # Unchanged status is not rewritten: every write is a watch event for every client.
        if any(old_status.get(k) != v for k, v in status.items()):
            kube.patch_job_status(namespace, name, status)
        return out

    # 1. Validate. kmock or an old API server may not have enforced the CRD: check here too.
    try:
        job = parse_job({"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                         "metadata": {"name": name, "namespace": namespace}, "spec": body.get("spec")})
    except JobSpecError as exc:
        msg = "; ".join(exc.errors)
        conds = [_condition(old_conds, "InvalidSpec", True, "SpecInvalid", msg, generation)]
        return finish("Invalid", {"conditions": conds, "message": msg})

    n = render.names(name)
    # 2. Edits that cannot be applied in place are refused; the job keeps running as applied.
    refused = ""
    cm = kube.get("ConfigMap", namespace, n["config"])
    if cm is not None:
        applied_hash = (cm.get("metadata", {}).get("annotations") or {}).get(render.SPEC_HASH_ANNOTATION)
        new_spec = job.to_manifest()["spec"]
        if applied_hash and applied_hash != render.spec_hash(new_spec):
            applied = yaml.safe_load(cm["data"][render.CONFIG_KEY])
            changed = _diff_paths(render.immutable_view(applied["spec"]), render.immutable_view(new_spec))
            refused = (f"{', '.join(changed) or 'spec'} cannot change once the job exists (only "
                       f"spec.rollout.replicas can); revert the edit, or delete and recreate the job")
            replicas = job.spec.rollout.replicas
            job = parse_job(applied)
            job.spec.rollout.replicas = replicas

    # 3. Children: create what is missing (never overwrite the token).
    created: list[str] = []
    if cm is None:
        desired = render.render_all(job, namespace, uid)
    else:
        desired = [o for o in render.render_all(job, namespace, uid) if o["kind"] != "ConfigMap"]
        servers = "\n".join(render.server_addresses(job, namespace))
        if (cm.get("data") or {}).get("servers") != servers:  # pool resized: learner reads the list
            kube.patch("ConfigMap", namespace, n["config"], {"data": {"servers": servers}})
    live: dict[str, dict[str, Any]] = {}
    for obj in desired:
        got, was_created = kube.ensure(obj)
        live[obj["kind"]] = got
        if was_created:
            created.append(f"{obj['kind']}/{obj['metadata']['name']}")

    sts, learner = live["StatefulSet"], live["Job"]
    want = job.spec.rollout.replicas
    succeeded, failed, why = _job_state(learner)
    ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
    status: dict[str, Any] = {"rolloutReplicas": want, "readyRolloutReplicas": ready,
                              "learnerActive": int((learner.get("status") or {}).get("active") or 0)}
    for key in ("startTime", "completionTime", "step", "weightVersion"):
        if key in old_status:
            status[key] = old_status[key]
    invalid = _condition(old_conds, "InvalidSpec", bool(refused),
                         "ImmutableFieldChanged" if refused else "SpecValid", refused or "spec accepted",
                         generation)

    # 4. Terminal states free the GPUs: the pool is scaled to zero.
    if succeeded or failed:
        if (sts.get("spec") or {}).get("replicas") != 0:
            kube.patch("StatefulSet", namespace, n["statefulset"], {"spec": {"replicas": 0}})
        status["rolloutReplicas"] = 0
        status.setdefault("completionTime", _now())
        phase = "Complete" if succeeded else "Failed"
        status["message"] = "learner finished" if succeeded else f"learner failed: {why}"
        conds = [
            _condition(old_conds, "Complete", succeeded, "LearnerSucceeded" if succeeded else "NotComplete",
                       status["message"], generation),
            _condition(old_conds, "Failed", failed, "LearnerFailed" if failed else "NotFailed",
                       status["message"], generation),
            _condition(old_conds, "LearnerRunning", False, "LearnerFinished", status["message"], generation),
            _condition(old_conds, "RolloutReady", False, "PoolScaledDown", "rollout pool scaled to zero",
                       generation),
            invalid,
        ]
        return finish(phase, {**status, "conditions": conds}, created)

    # 5. Scale the pool to the spec, resume the learner once every server is Ready.
    if (sts.get("spec") or {}).get("replicas") != want:
        kube.patch("StatefulSet", namespace, n["statefulset"], {"spec": {"replicas": want}})
    pool_ready = want > 0 and ready >= want
    suspended = bool((learner.get("spec") or {}).get("suspend"))
    if pool_ready and suspended:
        kube.patch("Job", namespace, n["job"], {"spec": {"suspend": False}})
        suspended = False
        status["startTime"] = _now()
    if not suspended and progress_timeout > 0:
        pods = kube.list_pods(namespace, render.selector(name, "learner"))
        status.update(learner_progress(pods, job.spec.learner.metrics_port, progress_timeout))
    pool_msg = f"{ready}/{want} rollout servers Ready"
    learner_msg = "learner waits for the rollout pool" if suspended else "learner Job resumed"
    conds = [
        _condition(old_conds, "RolloutReady", pool_ready, "PoolReady" if pool_ready else "PoolNotReady",
                   pool_msg, generation),
        _condition(old_conds, "LearnerRunning", not suspended, "Resumed" if not suspended else "Suspended",
                   learner_msg, generation),
        _condition(old_conds, "Complete", False, "NotComplete", learner_msg, generation),
        _condition(old_conds, "Failed", False, "NotFailed", learner_msg, generation),
        invalid,
    ]
    status["message"] = refused or f"{pool_msg}; {learner_msg}"
    phase = "Running" if not suspended else ("Starting" if ready or want == 0 else "Pending")
    return finish(phase, {**status, "conditions": conds}, created)
