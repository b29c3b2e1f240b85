"""`reconcile.decide` as a table: observed state in, actions and status out. No API, milliseconds."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from rmsft_operator import render
from rmsft_operator.kube import ApiError
from rmsft_operator.progress import learner_final_progress
from rmsft_operator.reconcile import (
    CHILD_KINDS,
    PSA_ENFORCE_LABEL,
    Decision,
    Delete,
    Observed,
    Patch,
    act,
    decide,
    observe,
    shared_memory_refusal,
)

from rmsft.jobspec import parse_job
from rmsft.model_check import coordexp_fix
from rmsft.termination import final_progress_message, parse_final_progress

ROOT = Path(__file__).resolve().parents[2]
NS, NAME, UID, NOW = "team-a", "demo", "uid-1", "2026-11-23T10:00:00Z"
N = render.names(NAME)


def _spec(**edits: Any) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())["spec"]
    for dotted, value in edits.items():
        node = spec
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return spec


def _children(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    job = parse_job(
        {
            "apiVersion": "rmsft.io/v1alpha1",
            "kind": "RolloutMatchingJob",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": spec,
        }
    )
    return {render.child_key(o): o for o in render.render_all(job, NS, UID, token="t")}


def _pod(role: str, name: str, phase: str = "Pending", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": render.labels(NAME, role)}, "status": {"phase": phase, **status}}


@dataclass
class World:
    """A readable way to write an observed state: start from 'all children exist', then edit."""

    spec: dict[str, Any] = field(default_factory=_spec)
    ready: int = 0  # StatefulSet readyReplicas
    suspended: bool = True  # learner Job
    job_status: dict[str, Any] = field(default_factory=dict)
    exists: tuple[str, ...] = CHILD_KINDS
    applied_spec: dict[str, Any] | None = None  # what the ConfigMap holds (default: spec)
    rollout_pods: list[dict[str, Any]] = field(default_factory=list)
    learner_pods: list[dict[str, Any]] = field(default_factory=list)
    failed_creates: dict[str, str] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    namespace_labels: dict[str, str] | None = None  # read by observe for shm jobs only
    pool_created: str | None = None  # the StatefulSet's creationTimestamp (the job's start clock)
    failed_create_since: dict[str, str] = field(default_factory=dict)  # first FailedCreate event time, by kind
    job_started: str | None = None  # the learner Job's status.startTime (the Job controller's)

    def observed(self) -> Observed:
        kids: dict[str, dict[str, Any] | None] = {k: None for k in CHILD_KINDS}
        applied = _children(self.applied_spec or self.spec)
        for kind in self.exists:
            if kind in applied:  # (the learner's Service is rendered for learner.nodes > 1 only)
                kids[kind] = copy.deepcopy(applied[kind])
        if kids["StatefulSet"]:
            kids["StatefulSet"]["status"] = {"readyReplicas": self.ready}
            if self.pool_created:
                kids["StatefulSet"]["metadata"]["creationTimestamp"] = self.pool_created
        if kids["Job"]:
            kids["Job"]["spec"]["suspend"] = self.suspended
            kids["Job"]["status"] = dict(self.job_status)
            if self.job_started:
                kids["Job"]["status"]["startTime"] = self.job_started
            kids["Job"]["metadata"]["uid"] = "job-uid-1"
        return Observed(
            NAME,
            NS,
            UID,
            1,
            copy.deepcopy(self.spec),
            self.status,
            kids,
            self.rollout_pods,
            self.learner_pods,
            self.failed_creates,
            namespace_labels=self.namespace_labels,
            failed_create_since=self.failed_create_since,
        )


def _cond(d: Decision, ctype: str) -> dict[str, Any]:
    return next(c for c in d.status["conditions"] if c["type"] == ctype)


def test_new_job_creates_every_child_in_order_and_warns_about_ephemeral_checkpoints() -> None:
    d = decide(World(exists=()).observed(), NOW)
    assert [render.child_key(o) for o in d.creates] == [k for k in CHILD_KINDS if k != "LearnerService"]
    assert d.creates[-1]["spec"]["suspend"] is True and d.patches == []
    assert d.phase == "Pending"
    assert _cond(d, "LearnerRunning")["reason"] == "Suspended"
    assert any(e[1] == "CheckpointsEphemeral" for e in d.events)


def test_a_learner_on_several_pods_gets_its_service_before_its_job() -> None:
    """Issue 45: learner.nodes 2 adds the learner's headless Service (the pods' DNS names, pod 0's the rendezvous),
    created before the Job whose pods need it, and nothing else changes."""
    spec = _spec(
        **{"learner.nodes": 2, "learner.spread": False, "learner.checkpointClaim": "ck", "sync.transport": "grpc"}
    )
    d = decide(World(spec=spec, exists=()).observed(), NOW)
    assert [render.child_key(o) for o in d.creates] == list(CHILD_KINDS)
    service = d.creates[-2]
    assert service["kind"] == "Service" and service["metadata"]["name"] == N["learner_service"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert d.creates[-1]["spec"]["completionMode"] == "Indexed" and d.creates[-1]["spec"]["suspend"] is True
    assert d.events[-1][:2] == ("Normal", "PhasePending")


def test_a_claim_means_no_ephemeral_checkpoint_warning() -> None:
    d = decide(World(spec=_spec(**{"learner.checkpointClaim": "pvc"}), exists=()).observed(), NOW)
    assert not any(e[1] == "CheckpointsEphemeral" for e in d.events)


@pytest.mark.parametrize(
    "world",
    [
        World(),
        World(
            ready=2,
            suspended=False,
            job_status={"active": 1, "ready": 1},
            learner_pods=[_pod("learner", "l-1", "Running")],
        ),
        World(ready=2, suspended=False, job_status={"succeeded": 1}),
    ],
    ids=["pending", "running", "complete"],
)
def test_where_the_checkpoints_live_is_a_condition_in_every_phase(world: World) -> None:
    """Issue 41: a job whose checkpoints are not on a claim says so where users look (the Warning event once at
    creation, and a condition for as long as the job lives); with a claim it says which."""
    d = decide(world.observed(), NOW)
    durable = _cond(d, "CheckpointsDurable")
    assert (durable["status"], durable["reason"]) == ("False", "NoCheckpointClaim")
    assert "lost with it" in durable["message"] and "step 0" in durable["message"]
    claimed = decide(replace(world, spec=_spec(**{"learner.checkpointClaim": "ckpt-pvc"})).observed(), NOW)
    durable = _cond(claimed, "CheckpointsDurable")
    assert (durable["status"], durable["reason"]) == ("True", "OnClaim") and "ckpt-pvc" in durable["message"]


# (id, world, phase, RolloutReady reason, LearnerRunning (status, reason), patches)
TABLE: list[tuple[str, World, str, str, tuple[str, str], list[Patch]]] = [
    ("nothing-ready", World(), "Pending", "PoolNotReady", ("False", "Suspended"), []),
    ("part-ready", World(ready=1), "Starting", "PoolNotReady", ("False", "Suspended"), []),
    (
        "pool-ready-resumes-learner",
        World(ready=2),
        "Starting",
        "PoolReady",
        ("False", "PodPending"),
        [Patch("Job", N["job"], {"spec": {"suspend": False}})],
    ),
    (
        "learner-pod-pending",
        World(ready=2, suspended=False, learner_pods=[_pod("learner", "l-1")]),
        "Starting",
        "PoolReady",
        ("False", "PodPending"),
        [],
    ),
    (
        "learner-pod-running",
        World(
            ready=2,
            suspended=False,
            job_status={"active": 1, "ready": 1},
            learner_pods=[_pod("learner", "l-1", "Running")],
        ),
        "Running",
        "PoolReady",
        ("True", "Running"),
        [],
    ),
    (
        "learner-unschedulable",
        World(
            ready=2,
            suspended=False,
            learner_pods=[
                _pod(
                    "learner",
                    "l-1",
                    conditions=[
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
                        }
                    ],
                )
            ],
        ),
        "Starting",
        "PoolReady",
        ("False", "Unschedulable"),
        [],
    ),
    (
        "learner-pods-refused",
        World(
            ready=2, suspended=False, failed_creates={"Job": 'pods "demo-learner-x" is forbidden: violates PodSecurity'}
        ),
        "Starting",
        "PoolReady",
        ("False", "FailedCreate"),
        [],
    ),
    (
        "rollout-pods-refused",
        World(failed_creates={"StatefulSet": 'violates PodSecurity "baseline:latest"'}),
        "Pending",
        "FailedCreate",
        ("False", "Suspended"),
        [],
    ),
    (
        "rollout-crashloop",
        World(
            rollout_pods=[
                _pod(
                    "rollout",
                    "demo-rollout-0",
                    "Running",
                    containerStatuses=[
                        {
                            "name": "rollout",
                            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                            "lastState": {
                                "terminated": {
                                    "exitCode": 2,
                                    "message": "staging dir /dev/shm has 64.0 MiB; raise "
                                    "spec.rollout.shmSize to at least 1Gi",
                                }
                            },
                        }
                    ],
                )
            ]
        ),
        "Pending",
        "CrashLoopBackOff",
        ("False", "Suspended"),
        [],
    ),
    (
        "scaled-down-before-learner",
        World(spec=_spec(**{"rollout.replicas": 1}), applied_spec=_spec()),
        "Pending",
        "PoolNotReady",
        ("False", "Suspended"),
        [
            Patch(
                "ConfigMap", N["config"], {"data": {"servers": f"{N['statefulset']}-0.{N['service']}.{NS}.svc:50051"}}
            ),
            Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 1}}),
        ],
    ),
]


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_decide_table(case: tuple[str, World, str, str, tuple[str, str], list[Patch]]) -> None:
    _, world, phase, pool_reason, (running, learner_reason), patches = case
    d = decide(world.observed(), NOW)
    assert d.creates == []
    assert d.phase == phase and d.status["phase"] == phase
    assert _cond(d, "RolloutReady")["reason"] == pool_reason
    lr = _cond(d, "LearnerRunning")
    assert (lr["status"], lr["reason"]) == (running, learner_reason)
    assert d.patches == patches
    assert _cond(d, "InvalidSpec")["status"] == "False"


def test_conditions_carry_what_a_person_needs() -> None:
    crash = next(c[1] for c in TABLE if c[0] == "rollout-crashloop")
    msg = _cond(decide(crash.observed(), NOW), "RolloutReady")["message"]
    assert "demo-rollout-0" in msg and "spec.rollout.shmSize" in msg
    refused = next(c[1] for c in TABLE if c[0] == "rollout-pods-refused")
    d = decide(refused.observed(), NOW)
    assert "PodSecurity" in _cond(d, "RolloutReady")["message"] and "PodSecurity" in d.status["message"]
    sched = next(c[1] for c in TABLE if c[0] == "learner-unschedulable")
    assert "Insufficient nvidia.com/gpu" in _cond(decide(sched.observed(), NOW), "LearnerRunning")["message"]


@pytest.mark.parametrize(
    "conditions,phase,message",
    [
        ([{"type": "Complete", "status": "True"}], "Complete", "learner finished"),
        (
            [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "backoff"}],
            "Failed",
            "learner failed: BackoffLimitExceeded: backoff",
        ),
        # The Job controller's decision, before its other pods are gone (a learner on several pods, issue 45: pod 0
        # may sit in a collective for its grace period while Failed waits for it)
        (
            [
                {
                    "type": "FailureTarget",
                    "status": "True",
                    "reason": "PodFailurePolicy",
                    "message": "Container learner for pod team-a/demo-learner-1-x9 failed with exit code 1 "
                    "matching FailJob rule at index 1",
                }
            ],
            "Failed",
            "learner failed: PodFailurePolicy: Container learner for pod team-a/demo-learner-1-x9 "
            "failed with exit code 1 matching FailJob rule at index 1",
        ),
    ],
)
def test_terminal_learner_frees_the_pool(conditions: list[dict[str, Any]], phase: str, message: str) -> None:
    d = decide(World(ready=2, suspended=False, job_status={"conditions": conditions}).observed(), NOW)
    assert d.phase == phase and d.status["message"] == message
    assert d.patches == [Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}})]
    assert d.status["rolloutReplicas"] == 0 and d.status["completionTime"] == NOW
    assert _cond(d, "LearnerRunning")["status"] == "False"
    assert d.events[-1][0] == ("Warning" if phase == "Failed" else "Normal")


_GANG = {
    "learner.nodes": 2,
    "learner.spread": False,
    "learner.checkpointClaim": "ck",
    "sync.transport": "grpc",
    "learner.backoffLimit": 2,
}
_LOST = "Container learner for pod team-a/demo-learner-1-x9 failed with exit code 1 matching FailJob rule at index 1"


def _gang_failed(*kinds: str, attempt: int = 1, pods: list[dict[str, Any]] | None = None) -> Decision:
    conditions = [{"type": k, "status": "True", "reason": "PodFailurePolicy", "message": _LOST} for k in kinds]
    world = World(
        spec=_spec(**_GANG),
        ready=2,
        suspended=False,
        job_status={"conditions": conditions},
        status={"phase": "Running", "learnerAttempt": attempt},
        learner_pods=pods or [],
    )
    return decide(world.observed(), NOW)


def test_a_failed_attempt_of_a_learner_on_several_pods_is_restarted_once_its_pods_have_stopped() -> None:
    """Issue 45: pod 1 of a 2-pod learner lost. While the Job controller stops the other pod (FailureTarget), the job
    says so and waits; once the Job is Failed, the operator deletes it (by uid) and counts the attempt, so the next pass
    creates it again and its pods resume together from the newest checkpoint. The pool keeps running throughout."""
    stopping = _gang_failed("FailureTarget")
    assert stopping.phase == "Running" and stopping.deletes == [] and stopping.patches == []
    assert stopping.status["learnerAttempt"] == 1
    assert "attempt 1 of 3 failed" in stopping.status["message"] and "demo-learner-1-x9" in stopping.status["message"]
    assert _cond(stopping, "LearnerRunning")["reason"] == "AttemptFailed"
    stopped = _gang_failed("FailureTarget", "Failed")
    assert stopped.phase == "Running" and stopped.patches == []  # the pool is not scaled down
    assert stopped.deletes == [Delete("Job", N["job"], "job-uid-1")]
    assert stopped.status["learnerAttempt"] == 2
    assert "attempt 2 resumes from the newest checkpoint" in stopped.status["message"]
    assert [e[1] for e in stopped.events] == ["LearnerRestarted"]
    # the next pass: the Job is gone, so it is created again (suspended, resumed at once: the pool is Ready)
    again = decide(
        World(
            spec=_spec(**_GANG),
            ready=2,
            exists=tuple(k for k in CHILD_KINDS if k != "Job"),
            status={"phase": "Running", "learnerAttempt": 2},
        ).observed(),
        NOW,
    )
    assert [o["kind"] for o in again.creates] == ["Job"] and again.status["learnerAttempt"] == 2
    assert Patch("Job", N["job"], {"spec": {"suspend": False}}) in again.patches


def test_a_learner_on_several_pods_fails_the_job_when_its_attempts_are_spent_or_it_refused_its_configuration() -> None:
    spent = _gang_failed("FailureTarget", "Failed", attempt=3)  # backoffLimit 2: three attempts
    assert spent.phase == "Failed" and spent.deletes == []
    assert "demo-learner-1-x9" in spent.status["message"]
    assert Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}}) in spent.patches
    refused = _pod(
        "learner",
        "demo-learner-0-ab",
        "Failed",
        containerStatuses=[{"name": "learner", "state": {"terminated": {"exitCode": 2}}}],
    )
    config = _gang_failed("FailureTarget", "Failed", pods=[refused])
    assert config.phase == "Failed" and config.deletes == []


@pytest.mark.parametrize("phase", ["Complete", "Failed"])
def test_a_final_job_never_runs_again(phase: str) -> None:
    """Issue 41: the learner Job of a finished job deleted (by hand, by a TTL): nothing is created again, the pool stays
    at zero, the status stays. Before, the Job was recreated, the pool scaled up and the run started over."""
    done = decide(
        World(
            ready=2,
            suspended=False,
            job_status={
                "conditions": [{"type": phase, "status": "True", "reason": "BackoffLimitExceeded", "message": "m"}]
            },
        ).observed(),
        NOW,
    )
    assert done.phase == phase
    gone = World(
        ready=0,
        exists=tuple(k for k in CHILD_KINDS if k != "Job"),
        status=done.status,
        spec=_spec(**{"rollout.replicas": 2}),
    )
    d = decide(gone.observed(), "2026-11-23T12:00:00Z")
    assert d.phase == phase and d.creates == [] and d.status == done.status
    assert d.patches == [Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}})]  # the render's 2
    assert not any(e[1].startswith("Phase") for e in d.events)


def test_every_status_message_fits_the_crd() -> None:
    from rmsft_operator.reconcile import MESSAGE_LIMIT, fit_message

    long = "x" * 10_000
    d = decide(
        World(
            ready=2,
            suspended=False,
            job_status={
                "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": long}]
            },
        ).observed(),
        NOW,
    )
    assert MESSAGE_LIMIT - 5 <= len(d.status["message"]) <= MESSAGE_LIMIT
    assert d.status["message"].endswith("more characters cut]")
    assert all(len(c["message"]) <= MESSAGE_LIMIT for c in d.status["conditions"])
    cut = fit_message("y" * 5000)
    assert MESSAGE_LIMIT - 5 <= len(cut) <= MESSAGE_LIMIT and cut.startswith("y" * 4000)
    assert int(cut.rsplit("[", 1)[1].split()[0]) == 5000 - cut.index(" ... [")  # the count is what was cut
    assert fit_message("short") == "short"


def test_a_learner_with_no_step_for_its_stall_timeout_is_reported_and_failed_only_if_asked() -> None:
    """Issue 41: a running learner that finishes no optimizer step for spec.learner.stallTimeout (a hung collective,
    a server that never answers) holds its GPUs with no clock: it is reported (condition Progressing False, a
    Warning event once) and, with spec.learner.failWhenStalled, failed with the pool freed."""
    pods = [_pod("learner", "l-1", "Running")]
    spec = _spec(**{"learner.stallTimeout": "30m"})
    running = World(spec=spec, ready=2, suspended=False, job_status={"active": 1, "ready": 1}, learner_pods=pods)
    first = decide(replace(running.observed(), progress={"step": 5}), NOW)
    assert first.status["lastStepTime"] == NOW and _cond(first, "Progressing")["status"] == "True"
    quiet = replace(running.observed(), status=first.status, progress={"step": 5})
    assert _cond(decide(quiet, "2026-11-23T10:29:00Z"), "Progressing")["status"] == "True"  # inside its 30 min
    late = decide(quiet, "2026-11-23T10:31:00Z")
    prog = _cond(late, "Progressing")
    assert (prog["status"], prog["reason"], late.phase) == ("False", "LearnerStalled", "Running")
    assert "no optimizer step since step 5 (1860s, spec.learner.stallTimeout 1800s)" in prog["message"]
    assert [e[:2] for e in late.events] == [("Warning", "LearnerStalled")] and late.patches == []
    again = decide(replace(quiet, status=late.status), "2026-11-23T10:40:00Z")
    assert not any(e[1] == "LearnerStalled" for e in again.events)  # once, not on every pass
    moved = decide(replace(quiet, status=late.status, progress={"step": 6}), "2026-11-23T10:41:00Z")
    assert _cond(moved, "Progressing")["status"] == "True" and moved.status["lastStepTime"] == "2026-11-23T10:41:00Z"
    # Asked to fail: Failed, the pool scaled to zero, the learner Job suspended (its pod removed).
    failing = World(
        spec=_spec(**{"learner.stallTimeout": "30m", "learner.failWhenStalled": True}),
        ready=2,
        suspended=False,
        job_status={"active": 1, "ready": 1},
        learner_pods=pods,
    )
    obs = replace(failing.observed(), status=first.status, progress={"step": 5})
    failed = decide(obs, "2026-11-23T10:31:00Z")
    assert failed.phase == "Failed" and _cond(failed, "Failed")["reason"] == "LearnerStalled"
    assert Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}}) in failed.patches
    assert Patch("Job", N["job"], {"spec": {"suspend": True}}) in failed.patches


def test_immutable_edit_is_refused_and_the_applied_spec_keeps_running() -> None:
    world = World(spec=_spec(**{"training.lr": 0.5, "rollout.replicas": 3}), applied_spec=_spec())
    d = decide(world.observed(), NOW)
    inv = _cond(d, "InvalidSpec")
    assert inv["status"] == "True" and inv["reason"] == "ImmutableFieldChanged"
    assert inv["message"].startswith("spec.training.lr cannot change")
    # replicas still applies; nothing else is rewritten
    assert Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 3}}) in d.patches
    assert all(p.kind in ("StatefulSet", "ConfigMap") for p in d.patches)


def test_invalid_spec_creates_nothing() -> None:
    world = World(spec=_spec(**{"rollout.port": 9090, "rollout.metricsPort": 9090}), applied_spec=_spec(), exists=())
    d = decide(world.observed(), NOW)
    assert d.phase == "Invalid" and d.creates == [] and d.patches == []
    assert "spec.rollout" in _cond(d, "InvalidSpec")["message"]


def test_learner_progress_is_reported_and_kept_while_unreachable() -> None:
    running = World(
        ready=2, suspended=False, job_status={"active": 1, "ready": 1}, learner_pods=[_pod("learner", "l-1", "Running")]
    )
    evaluation = {"step": 20, "f1": 0.41, "mAP": 0.22, "mAP50": 0.5}
    progress = {"step": 23, "weightVersion": 23, "evaluation": evaluation}
    d = decide(replace(running.observed(), progress=progress), NOW)
    assert (d.status["step"], d.status["weightVersion"], d.status["evaluation"]) == (23, 23, evaluation)
    # The learner's /metrics did not answer this pass (restarting, network): the last figures stay.
    kept = decide(replace(running.observed(), status=d.status), NOW)
    assert (kept.status["step"], kept.status["evaluation"]) == (23, evaluation)
    # Before the first evaluation there is none.
    assert "evaluation" not in decide(replace(running.observed(), progress={"step": 3}), NOW).status


def test_a_figure_the_new_evaluation_lacks_is_removed_not_kept_stale() -> None:
    running = World(
        ready=2, suspended=False, job_status={"active": 1, "ready": 1}, learner_pods=[_pod("learner", "l-1", "Running")]
    )
    old = decide(replace(running.observed(), progress={"evaluation": {"step": 20, "f1": 0.4, "mAP": 0.2}}), NOW)
    new = decide(replace(running.observed(), status=old.status, progress={"evaluation": {"step": 30, "f1": 0.5}}), NOW)
    # The status is a merge patch: null deletes the old mAP instead of leaving it beside step 30.
    assert new.status["evaluation"] == {"step": 30, "f1": 0.5, "mAP": None}
    written = {**new.status, "evaluation": {"step": 30, "f1": 0.5}}  # what the API server stores
    again = decide(replace(running.observed(), status=written, progress={"evaluation": {"step": 30, "f1": 0.5}}), NOW)
    assert again.status == written  # a fixed point: nothing more to write


def test_decide_is_a_fixed_point_once_status_is_written() -> None:
    """A second pass over the same world yields the same status (so `act` writes nothing) and no
    new phase event; transition times survive."""
    world = World(ready=1)
    first = decide(world.observed(), NOW)
    again = decide(replace(world.observed(), status=first.status), "2026-11-23T11:00:00Z")
    assert again.status == first.status
    assert not any(e[1].startswith("Phase") for e in again.events)


# ------------------------------------------------------------------------ sync.transport shm


def _psa(level: str | None) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": NS, **({PSA_ENFORCE_LABEL: level} if level else {})}


SHM = {"sync.transport": "shm"}

# (id, world, refused?): a namespace whose Pod Security level refuses hostPath volumes gets no
# children for an shm job; any other combination goes on as usual.
SHM_TABLE: list[tuple[str, World, bool]] = [
    ("shm-baseline", World(spec=_spec(**SHM), exists=(), namespace_labels=_psa("baseline")), True),
    ("shm-restricted", World(spec=_spec(**SHM), exists=(), namespace_labels=_psa("restricted")), True),
    ("shm-privileged", World(spec=_spec(**SHM), exists=(), namespace_labels=_psa("privileged")), False),
    # no label: the cluster's default level, which the operator cannot see (FailedCreate names a refusal)
    ("shm-unlabelled", World(spec=_spec(**SHM), exists=(), namespace_labels=_psa(None)), False),
    ("shm-namespace-unreadable", World(spec=_spec(**SHM), exists=(), namespace_labels=None), False),
    (
        "grpc-baseline",
        World(spec=_spec(**{"sync.transport": "grpc"}), exists=(), namespace_labels=_psa("baseline")),
        False,
    ),
    ("auto-baseline", World(exists=(), namespace_labels=_psa("baseline")), False),  # auto = grpc in a cluster
]


@pytest.mark.parametrize("case", SHM_TABLE, ids=[c[0] for c in SHM_TABLE])
def test_shm_in_a_namespace_that_refuses_hostpath_creates_nothing(case: tuple[str, World, bool]) -> None:
    _, world, refused = case
    d = decide(world.observed(), NOW)
    assert d.phase == "Pending"
    if not refused:
        assert [render.child_key(o) for o in d.creates] == [k for k in CHILD_KINDS if k != "LearnerService"]
        assert _cond(d, "RolloutReady")["reason"] == "PoolNotReady"
        return
    assert d.creates == [] and d.patches == []
    for ctype in ("RolloutReady", "LearnerRunning"):
        c = _cond(d, ctype)
        assert (c["status"], c["reason"]) == ("False", "SharedMemoryForbidden")
    msg = d.status["message"]
    assert msg == _cond(d, "RolloutReady")["message"]
    level = world.namespace_labels[PSA_ENFORCE_LABEL]
    for words in (
        "spec.sync.transport",
        "hostPath",
        f"{PSA_ENFORCE_LABEL}={level}",
        f"namespace {NS}",
        "spec.sync.transport: grpc",
        "privileged",
        f"/dev/shm/rmsft/{NS}.{NAME}",
    ):
        assert words in msg, (words, msg)
    assert _cond(d, "InvalidSpec")["status"] == "False"
    assert not any(e[1] == "CheckpointsEphemeral" for e in d.events)  # no learner is on its way
    assert d.events == [("Warning", "SharedMemoryForbidden", msg), ("Normal", "PhasePending", msg)]
    # Level-triggered: the same world again writes nothing new; relabelled, the next pass creates.
    again = decide(replace(world.observed(), status=d.status), "2026-11-23T11:00:00Z")
    assert again.status == d.status and again.events == []
    relabelled = decide(replace(world.observed(), status=d.status, namespace_labels=_psa("privileged")), NOW)
    assert [render.child_key(o) for o in relabelled.creates] == [k for k in CHILD_KINDS if k != "LearnerService"]
    assert _cond(relabelled, "RolloutReady")["reason"] == "PoolNotReady"


def test_shm_job_already_running_when_the_namespace_is_relabelled_keeps_running() -> None:
    world = World(
        spec=_spec(**SHM),
        ready=2,
        suspended=False,
        job_status={"active": 1, "ready": 1},
        learner_pods=[_pod("learner", "l-1", "Running")],
        namespace_labels=_psa("baseline"),
    )
    d = decide(world.observed(), NOW)
    assert d.phase == "Running" and _cond(d, "RolloutReady")["reason"] == "PoolReady"


def test_shared_memory_refusal_names_nothing_for_grpc() -> None:
    job = parse_job(
        {
            "apiVersion": "rmsft.io/v1alpha1",
            "kind": "RolloutMatchingJob",
            "metadata": {"name": NAME},
            "spec": _spec(**{"sync.transport": "grpc"}),
        }
    )
    assert shared_memory_refusal(job, NS, _psa("restricted")) == ""


def test_a_key_added_to_the_schema_after_the_job_was_applied_is_not_an_edit() -> None:
    # A job applied by an operator that predates spec.sync.transport: its ConfigMap's manifest (and
    # the hash beside it) has no such key, the CR read back through today's CRD has the default.
    world = World(ready=1)
    obs = world.observed()
    cm = copy.deepcopy(obs.children["ConfigMap"])
    manifest = yaml.safe_load(cm["data"][render.CONFIG_KEY])
    del manifest["spec"]["sync"]["transport"]
    cm["data"][render.CONFIG_KEY] = yaml.safe_dump(manifest)
    cm["metadata"]["annotations"][render.SPEC_HASH_ANNOTATION] = render.spec_hash(manifest["spec"])
    d = decide(replace(obs, children={**obs.children, "ConfigMap": cm}), NOW)
    inv = _cond(d, "InvalidSpec")
    assert (inv["status"], inv["reason"]) == ("False", "SpecValid")
    # ...while a real edit next to it is still refused, naming only the edited key.
    edited = replace(obs, children={**obs.children, "ConfigMap": cm}, spec=_spec(**{"training.lr": 0.5}))
    inv = _cond(decide(edited, NOW), "InvalidSpec")
    assert inv["status"] == "True" and inv["message"].startswith("spec.training.lr cannot change")


class _Reads:
    """Just enough of `Kube` for `observe`: nothing exists yet; namespace reads are counted."""

    def __init__(self) -> None:
        self.namespaces: list[str] = []

    def get(self, kind: str, namespace: str, name: str) -> None:
        return None

    def namespace_labels(self, name: str) -> dict[str, str]:
        self.namespaces.append(name)
        return _psa("baseline")


@pytest.mark.parametrize("transport,reads", [("shm", True), ("grpc", False), ("auto", False)])
def test_observe_reads_the_namespace_for_shm_jobs_only(transport: str, reads: bool) -> None:
    kube = _Reads()
    body = {"metadata": {"name": NAME, "namespace": NS, "uid": UID}, "spec": _spec(**{"sync.transport": transport})}
    obs = observe(kube, body)  # type: ignore[arg-type]
    assert kube.namespaces == ([NS] if reads else [])
    assert obs.namespace_labels == (_psa("baseline") if reads else None)
    # An invalid spec costs no read either (decide reports it; nothing will be created).
    kube = _Reads()
    observe(kube, {"metadata": {"name": NAME, "namespace": NS}, "spec": {"sync": {"transport": "shm"}}})  # type: ignore[arg-type]
    assert kube.namespaces == []


class _Existing(_Reads):
    """`observe`'s reads over a namespace holding these objects (by child key: render.child_key); no pods."""

    def __init__(self, objects: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.objects = objects

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:  # type: ignore[override]
        return next((o for o in self.objects.values() if o["kind"] == kind and o["metadata"]["name"] == name), None)

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return []

    def list_events(self, namespace: str, field_selector: str) -> list[dict[str, Any]]:
        return []


@pytest.mark.parametrize("owner", ["none", "another job"])
def test_an_object_with_a_childs_name_that_is_not_the_jobs_is_never_adopted_or_touched(owner: str) -> None:
    mine = _children(_spec())
    theirs = copy.deepcopy(mine["StatefulSet"])
    theirs["spec"]["replicas"] = 7
    if owner == "none":  # made by hand
        theirs["metadata"].pop("ownerReferences")
    else:  # a job of the same name deleted and recreated: its children name the old uid
        theirs["metadata"]["ownerReferences"][0]["uid"] = "uid-of-another-job"
    kube = _Existing({**mine, "StatefulSet": theirs})
    obs = observe(kube, {"metadata": {"name": NAME, "namespace": NS, "uid": UID}, "spec": _spec()})  # type: ignore[arg-type]
    assert obs.foreign == {"StatefulSet": N["statefulset"]}
    assert obs.children["StatefulSet"] is None and obs.children["Job"] is mine["Job"]  # the job's own stay children
    d = decide(obs, NOW)
    assert (d.phase, d.creates, d.patches) == ("Pending", [], [])  # not scaled, not replaced, nothing made beside it
    ready = _cond(d, "RolloutReady")
    assert ready["status"] == "False" and ready["reason"] == "NameConflict"
    message = d.status["message"]
    assert f"StatefulSet {N['statefulset']} already exists in namespace {NS} and is not this job's" in message
    assert "delete or rename it" in message
    assert [(t, r) for t, r, _ in d.events] == [("Warning", "NameConflict"), ("Normal", "PhasePending")]
    # Written back, the next pass says nothing new; once the object is gone the job creates its own.
    again = decide(replace(obs, status=d.status), NOW)
    assert [r for _, r, _ in again.events] == [] and again.patches == []
    del kube.objects["StatefulSet"]
    freed = decide(observe(kube, {"metadata": {"name": NAME, "namespace": NS, "uid": UID}, "spec": _spec()}), NOW)  # type: ignore[arg-type]
    assert [o["kind"] for o in freed.creates] == ["StatefulSet"]


class _Refusing(_Existing):
    """An empty namespace whose API server refuses to create one kind with `status`; records every write."""

    def __init__(self, kind: str, status: int) -> None:
        super().__init__({})
        self.kind, self.status = kind, status
        self.writes: list[tuple[str, str]] = []

    def ensure(self, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        if obj["kind"] == self.kind:
            raise ApiError(self.status, f"POST {obj['kind']}: admission webhook said no")
        self.objects[render.child_key(obj)] = obj
        self.writes.append(("create", obj["kind"]))
        return obj, True

    def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        sub: str | None = None,
        expected: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        self.writes.append(("patch", kind))
        return body

    def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any], expected: tuple[int, ...] = ()
    ) -> dict[str, Any]:
        self.writes.append(("status", status["phase"]))
        return status


@pytest.mark.parametrize("status,phase", [(422, "Failed"), (400, "Failed"), (403, "Pending")])
def test_a_create_the_api_refuses_is_reported_once_not_retried_in_a_loop(status: int, phase: str) -> None:
    kube = _Refusing("StatefulSet", status)
    body = {"metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": 1}, "spec": _spec()}
    out = act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]
    # What came before the refused child was created; nothing after it, and no patch of this pass was applied.
    assert kube.writes == [
        ("create", "Secret"),
        ("create", "ConfigMap"),
        ("create", "Service"),
        ("create", "NetworkPolicy"),
        ("create", "PodDisruptionBudget"),
        ("status", phase),
    ]
    assert out.phase == phase
    failed = next(c for c in out.status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"]) == (
        ("True", "CreateRefused") if phase == "Failed" else ("False", "NotFailed")
    )
    assert f"refused to create StatefulSet {N['statefulset']}" in out.status["message"]
    assert "admission webhook said no" in out.status["message"]
    assert [(t, r) for t, r, _ in out.events] == [("Warning", "CreateRefused")]
    # The next pass (the resync) with that status written: no second event, whatever it decides.
    body["status"] = out.status
    kube.writes.clear()
    again = act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]
    assert again.events == [] and again.phase == phase
    if phase == "Failed":  # final: nothing is created again
        assert ("create", "StatefulSet") not in kube.writes and not any(w[0] == "create" for w in kube.writes)


def test_other_api_errors_on_create_are_left_to_the_retry() -> None:
    kube = _Refusing("StatefulSet", 500)
    body = {"metadata": {"name": NAME, "namespace": NS, "uid": UID}, "spec": _spec()}
    with pytest.raises(ApiError, match="500"):
        act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]


COLOCATE_CHILDREN = ("Secret", "ConfigMap", "LearnerDisruptionBudget", "LearnerNetworkPolicy", "Job")


def _colocate_spec() -> dict[str, Any]:
    spec = _spec(**{"rollout.mode": "colocate"})
    spec["rollout"].pop("replicas")
    return spec


def test_a_colocate_job_creates_no_pool_and_resumes_its_learner_at_once() -> None:
    spec = _colocate_spec()
    d = decide(World(spec=spec, exists=()).observed(), NOW)
    assert [render.child_key(o) for o in d.creates] == list(COLOCATE_CHILDREN)
    d = decide(World(spec=spec, exists=COLOCATE_CHILDREN).observed(), NOW)
    assert d.creates == []
    assert d.patches == [Patch("Job", N["job"], {"spec": {"suspend": False}})]  # nothing to wait for
    assert _cond(d, "RolloutReady")["reason"] == "Colocated"
    running = World(
        spec=spec,
        exists=COLOCATE_CHILDREN,
        suspended=False,
        job_status={"active": 1, "ready": 1},
        learner_pods=[_pod("learner", "l-1", "Running")],
    )
    d = decide(running.observed(), NOW)
    assert d.phase == "Running" and d.patches == [] and d.status["rolloutReplicas"] == 0
    done = World(
        spec=spec,
        exists=COLOCATE_CHILDREN,
        suspended=False,
        job_status={"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]},
    )
    d = decide(done.observed(), NOW)
    assert d.phase == "Complete" and d.patches == []  # no StatefulSet to scale down


# ------------------------------------------------------------------- a start that cannot succeed

MIN_AGO = {
    m: f"2026-11-23T{(600 - m) // 60:02d}:{(600 - m) % 60:02d}:00Z"  # NOW=10:00
    for m in (1, 4, 6, 29, 31, 45, 59, 61, 120)
}
LOG_TAIL = (
    "INFO 11-23 09:59:58 [__init__.py:244] Automatically detected platform cuda.\n"
    "rmsft serve: invalid configuration:\n  model folder /models/missing does not exist\n"
)


def _server(
    name: str = "demo-rollout-0",
    created: int = 4,
    ready: bool = False,
    restarts: int = 0,
    ended: dict[str, Any] | None = None,
    **status: Any,
) -> dict[str, Any]:
    """A rollout pod `created` minutes before NOW, in CrashLoopBackOff after `ended` when given."""
    cs: dict[str, Any] = {
        "name": "rollout",
        "restartCount": restarts,
        "ready": ready,
        "state": {"running": {}}
        if ready or not ended
        else {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
    }
    if ended:
        cs["lastState"] = {"terminated": {"reason": "Error", **ended}}
    pod = _pod(
        "rollout",
        name,
        "Running",
        containerStatuses=[cs],
        conditions=[{"type": "Ready", "status": "True" if ready else "False"}],
        **status,
    )
    pod["metadata"]["creationTimestamp"] = MIN_AGO[created]
    return pod


def _unschedulable(role: str, name: str, since: int) -> dict[str, Any]:
    pod = _pod(
        role,
        name,
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": MIN_AGO[since],
                "message": "0/1 nodes are available: 1 Insufficient cpu.",
            }
        ],
    )
    pod["metadata"]["creationTimestamp"] = MIN_AGO[since]
    return pod


_STARTED = {"ready": 2, "suspended": False, "job_status": {"active": 1}}
PREFLIGHT_SAID = (
    "rmsft preflight: the model in /models/Qwen3-VL-2B-Instruct (spec.model.path) does not fit "
    f"training.format coordexp: ... Fix: {coordexp_fix('/models/Qwen3-VL-2B-Instruct')}"
)


def _preflight(
    role: str = "rollout",
    name: str = "demo-rollout-0",
    exit_code: int = 2,
    restarted: bool = True,
    container: str = render.PREFLIGHT_CONTAINER,
    message: str = PREFLIGHT_SAID,
) -> dict[str, Any]:
    """A pod whose init container `container` exited with `exit_code`: a rollout pod then waits in
    Init:CrashLoopBackOff (the exit in lastState) unless not yet `restarted`; a learner pod (restartPolicy
    Never) is Failed."""
    ended = {"terminated": {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed", "message": message}}
    init = {
        "name": container,
        "restartCount": 1 if restarted else 0,
        "ready": exit_code == 0,
        **(
            {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": ended}
            if restarted and exit_code
            else {"state": ended, "lastState": {}}
        ),
    }
    main = {
        "name": role,
        "restartCount": 0,
        "ready": False,
        "state": {"waiting": {"reason": "PodInitializing"}} if exit_code else {"running": {}},
    }
    phase = "Failed" if role == "learner" and exit_code else "Pending" if exit_code else "Running"
    pod = _pod(role, name, phase, initContainerStatuses=[init], containerStatuses=[main])
    pod["metadata"]["creationTimestamp"] = MIN_AGO[4]
    return pod


def _waiting_for_image(
    reason: str, message: str, role: str = "rollout", name: str = "demo-rollout-0", init: bool = False
) -> dict[str, Any]:
    """A pod created 4 minutes before NOW whose container (the preflight init container when `init`) waits with
    the kubelet's `reason` and `message`."""
    waiting = {
        "name": render.PREFLIGHT_CONTAINER if init else role,
        "image": "rmsft:missing",
        "ready": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": reason, "message": message}},
    }
    pod = _pod(role, name, **{"initContainerStatuses" if init else "containerStatuses": [waiting]})
    pod["metadata"]["creationTimestamp"] = MIN_AGO[4]
    return pod


def _placed_not_started(since: int) -> dict[str, Any]:
    """A learner pod placed on a node `since` minutes before NOW, its container still being created."""
    pod = _pod(
        "learner",
        "demo-learner-x",
        conditions=[{"type": "PodScheduled", "status": "True", "lastTransitionTime": MIN_AGO[since]}],
        containerStatuses=[
            {
                "name": "learner",
                "ready": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": "ContainerCreating"}},
            }
        ],
    )
    pod["metadata"]["creationTimestamp"] = MIN_AGO[since]
    return pod


# (id, world, Failed reason or None, words the message holds)
STARTUP_TABLE: list[tuple[str, World, str | None, list[str]]] = [
    (
        "invalid-config",
        World(rollout_pods=[_server(ended={"exitCode": 1, "message": LOG_TAIL})]),
        "RolloutInvalidConfig",
        ["demo-rollout-0", "rmsft serve: invalid configuration", "model folder /models/missing does not exist"],
    ),
    (
        "invalid-config-written-at-exit",
        World(
            rollout_pods=[
                _server(),
                _server(
                    "demo-rollout-1",
                    ended={
                        "exitCode": 1,
                        "message": "rmsft serve: invalid configuration:\n  tensor_parallel_size must be >= 1",
                    },
                ),
            ]
        ),
        "RolloutInvalidConfig",
        ["demo-rollout-1", "tensor_parallel_size must be >= 1"],
    ),
    (
        "crash-loop",
        World(
            rollout_pods=[
                _server(
                    restarts=3,
                    ended={
                        "exitCode": 1,
                        "message": ("Traceback (most recent call last):\n...\nRuntimeError: CUDA error: out of memory"),
                    },
                )
            ]
        ),
        "RolloutCrashLoop",
        ["demo-rollout-0", "restarted 3 times", "exit code 1", "CUDA error: out of memory"],
    ),
    ("two-restarts-is-not-yet-a-loop", World(rollout_pods=[_server(restarts=2, ended={"exitCode": 1})]), None, []),
    (
        "pool-not-ready-past-the-deadline",
        World(rollout_pods=[_unschedulable("rollout", "demo-rollout-1", 31)]),
        "RolloutStartupTimeout",
        ["spec.rollout.startupTimeout (30 min)", "demo-rollout-1", "Insufficient cpu"],
    ),
    (
        "still-loading-past-the-deadline",
        World(rollout_pods=[_server(created=31)]),
        "RolloutStartupTimeout",
        ["spec.rollout.startupTimeout (30 min)", "demo-rollout-0 is still starting"],
    ),
    (
        "pool-not-ready-within-the-deadline",
        World(rollout_pods=[_unschedulable("rollout", "demo-rollout-1", 29)]),
        None,
        [],
    ),
    (
        "own-deadline",
        World(spec=_spec(**{"rollout.startupTimeout": "5m"}), rollout_pods=[_server(created=6)]),
        "RolloutStartupTimeout",
        ["spec.rollout.startupTimeout (5 min)"],
    ),
    (
        "own-deadline-in-seconds",
        World(spec=_spec(**{"rollout.startupTimeout": 3000}), rollout_pods=[_server(created=31)]),
        None,
        [],
    ),
    ("a-ready-server-is-not-late", World(ready=1, rollout_pods=[_server(created=120, ready=True)]), None, []),
    # Once the learner runs, a server that restarts is the failover's business, not a failed start.
    (
        "learner-started",
        World(
            **_STARTED,
            rollout_pods=[
                _server(created=120, restarts=5, ended={"exitCode": 1, "message": "rmsft serve: the engine is dead"})
            ],
        ),
        None,
        [],
    ),
    (
        "learner-unschedulable-past-the-deadline",
        World(**_STARTED, learner_pods=[_unschedulable("learner", "demo-learner-x", 31)]),
        "LearnerUnschedulable",
        ["demo-learner-x", "spec.rollout.startupTimeout (30 min)", "Insufficient cpu"],
    ),
    (
        "learner-unschedulable-within-the-deadline",
        World(**_STARTED, learner_pods=[_unschedulable("learner", "demo-learner-x", 29)]),
        None,
        [],
    ),
    # The model preflight (init container) refused the checkpoint: fail at once, whatever the pool does.
    (
        "preflight-refused-the-model",
        World(rollout_pods=[_server(), _preflight(name="demo-rollout-1")]),
        "ModelPreflightFailed",
        ["rollout pod demo-rollout-1", "exit code 2", "rmsft prepare-model", "DST", "spec.training.format: qwen_json"],
    ),
    (
        "preflight-refused-before-its-first-restart",
        World(rollout_pods=[_preflight(restarted=False)]),
        "ModelPreflightFailed",
        ["rollout pod demo-rollout-0", "rmsft prepare-model"],
    ),
    (
        "preflight-said-it-in-its-log-tail",
        World(
            rollout_pods=[
                _preflight(
                    message=(
                        "INFO 11-23 09:59:58 [__init__.py:244] Automatically detected platform cuda.\n" + PREFLIGHT_SAID
                    )
                )
            ]
        ),
        "ModelPreflightFailed",
        ["rollout pod demo-rollout-0", "rmsft preflight: the model in"],
    ),
    (
        "preflight-refused-the-learners-model",
        World(**_STARTED, learner_pods=[_preflight("learner", "demo-learner-x", restarted=False)]),
        "ModelPreflightFailed",
        ["learner pod demo-learner-x", "rmsft prepare-model"],
    ),
    ("preflight-passed", World(rollout_pods=[_preflight(exit_code=0, message="")]), None, []),
    # Issue 41: an image that cannot be had fails at once, in the kubelet's words (before: the start deadline,
    # 30 minutes, and "pod ... is still starting").
    (
        "image-never-pulled",
        World(
            rollout_pods=[
                _waiting_for_image(
                    "ErrImageNeverPull", ('Container image "rmsft:missing" is not present with pull policy of Never')
                )
            ]
        ),
        "ImageUnavailable",
        [
            "rollout pod demo-rollout-0",
            "container rollout",
            "rmsft:missing",
            "ErrImageNeverPull",
            "is not present with pull policy of Never",
        ],
    ),
    (
        "preflight-image-invalid",
        World(
            rollout_pods=[
                _waiting_for_image(
                    "InvalidImageName",
                    ('Failed to apply default image tag "Rmsft:Bad": invalid reference format'),
                    init=True,
                )
            ]
        ),
        "ImageUnavailable",
        ["container preflight", "InvalidImageName", "invalid reference format"],
    ),
    (
        "learner-image-not-in-the-registry",
        World(
            **_STARTED,
            learner_pods=[
                _waiting_for_image(
                    "ErrImagePull",
                    ('failed to pull and unpack image "ghcr.io/x/rmsft:v9": ghcr.io/x/rmsft:v9: not found'),
                    role="learner",
                    name="demo-learner-x",
                )
            ],
        ),
        "ImageUnavailable",
        ["learner pod demo-learner-x", "ErrImagePull", "rmsft:v9: not found"],
    ),
    (
        "a-pull-timeout-waits-for-the-deadline",
        World(
            rollout_pods=[
                _waiting_for_image(
                    "ErrImagePull", ('failed to pull image "ghcr.io/x/rmsft:v9": dial tcp 10.0.0.1:443: i/o timeout')
                )
            ]
        ),
        None,
        [],
    ),
    # A learner pod placed on a node whose containers never start (a volume that does not attach) gets the
    # start deadline too (before: no clock at all).
    (
        "learner-never-starts",
        World(**_STARTED, learner_pods=[_placed_not_started(31)]),
        "LearnerStartupTimeout",
        [
            "learner pod demo-learner-x",
            "spec.rollout.startupTimeout (30 min)",
            "learner: ContainerCreating",
            "kubectl describe pod demo-learner-x",
        ],
    ),
    ("learner-starting-within-the-deadline", World(**_STARTED, learner_pods=[_placed_not_started(29)]), None, []),
    # The pool's clock is the job's (the StatefulSet's creation), not each pod's: a pod made again 4 minutes ago
    # in a pool asked for 31 minutes ago is late, and so are pods the API refused to create all along.
    (
        "pool-clock-is-the-jobs",
        World(pool_created=MIN_AGO[31], rollout_pods=[_server(created=4)]),
        "RolloutStartupTimeout",
        ["spec.rollout.startupTimeout (30 min)", "demo-rollout-0 is still starting"],
    ),
    (
        "pool-pods-refused-past-the-deadline",
        World(
            pool_created=MIN_AGO[31],
            failed_creates={
                "StatefulSet": 'pods "demo-rollout-1" is forbidden: exceeded quota: gpu, requested: nvidia.com/gpu=1'
            },
        ),
        "RolloutStartupTimeout",
        ["rollout pods cannot be created", "exceeded quota"],
    ),
    (
        "pool-pods-refused-within-the-deadline",
        World(
            pool_created=MIN_AGO[29],
            failed_creates={"StatefulSet": 'pods "demo-rollout-1" is forbidden: exceeded quota'},
        ),
        None,
        [],
    ),
    (
        "another-init-container-failed",
        World(
            **_STARTED,
            learner_pods=[
                _preflight(
                    "learner",
                    "demo-learner-x",
                    exit_code=1,
                    restarted=False,
                    container="shared-weights-owner",
                    message="chown: /rmsft-shared: Operation not permitted",
                )
            ],
        ),
        None,
        [],
    ),
]


@pytest.mark.parametrize("case", STARTUP_TABLE, ids=[c[0] for c in STARTUP_TABLE])
def test_a_start_that_cannot_succeed_fails_the_job_and_frees_the_pool(
    case: tuple[str, World, str | None, list[str]],
) -> None:
    _, world, reason, words = case
    d = decide(world.observed(), NOW)
    scale_to_zero = Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}})
    if reason is None:
        assert d.phase in ("Pending", "Starting") and _cond(d, "Failed")["status"] == "False"
        assert scale_to_zero not in d.patches
        return
    assert d.phase == "Failed" and d.status["phase"] == "Failed"
    failed = _cond(d, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", reason)
    for w in words:
        assert w in d.status["message"], (w, d.status["message"])
    assert "Automatically detected platform" not in d.status["message"]  # the server's words, not its log
    assert failed["message"] == d.status["message"]
    # Nothing held: the pool at zero; a learner that was let go is suspended (its pending pod removed).
    expected = [scale_to_zero] + ([Patch("Job", N["job"], {"spec": {"suspend": True}})] if not world.suspended else [])
    assert d.patches == expected
    assert d.status["rolloutReplicas"] == 0 and d.status["completionTime"] == NOW
    assert d.events[-1] == ("Warning", "PhaseFailed", d.status["message"])


def test_a_learner_job_failed_by_its_preflight_reports_the_preflights_words() -> None:
    # backoffLimit reached before the operator saw the pod: the Job is Failed (its pods counted failed: issue 62, no
    # pod of it ran, so the preflight's verdict holds), its pod kept with the exit.
    world = World(
        **{
            **_STARTED,
            "job_status": {
                "failed": 3,
                "conditions": [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                    }
                ],
            },
        },
        learner_pods=[_preflight("learner", "demo-learner-x", restarted=False)],
    )
    d = decide(world.observed(), NOW)
    assert d.phase == "Failed" and _cond(d, "Failed")["reason"] == "ModelPreflightFailed"
    assert "rmsft prepare-model" in d.status["message"] and "BackoffLimitExceeded" not in d.status["message"]
    # A finished Job is not suspended; the pool is freed.
    assert d.patches == [Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}})]


def test_a_failed_start_stays_failed_once_its_pods_are_gone() -> None:
    world = World(rollout_pods=[_server(ended={"exitCode": 1, "message": LOG_TAIL})])
    first = decide(world.observed(), NOW)
    # Next pass: the pool was scaled to zero, its pods are gone, nothing crash-loops any more.
    obs = replace(World().observed(), status=first.status)
    obs.children["StatefulSet"]["spec"]["replicas"] = 0
    later = decide(obs, "2026-11-23T10:05:00Z")
    assert later.phase == "Failed" and later.patches == [] and later.events == []
    assert later.status == first.status  # a fixed point: nothing more to write


def test_admission_checks_come_before_the_start_deadline() -> None:
    world = World(
        spec=_spec(**{"rollout.port": 9090, "rollout.metricsPort": 9090}),
        applied_spec=_spec(),
        rollout_pods=[_server(ended={"exitCode": 1, "message": LOG_TAIL})],
    )
    d = decide(world.observed(), NOW)
    assert d.phase == "Invalid" and d.patches == []


def test_the_startup_probe_waits_as_long_as_the_deadline() -> None:
    for value, threshold in (("30m", 180), (95, 10), ("1h", 360)):
        job = parse_job(
            {
                "apiVersion": "rmsft.io/v1alpha1",
                "kind": "RolloutMatchingJob",
                "metadata": {"name": NAME},
                "spec": _spec(**{"rollout.startupTimeout": value}),
            }
        )
        probe = render.render_statefulset(job, NS, UID)["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= job.spec.rollout.startup_timeout_seconds
        assert probe["failureThreshold"] == threshold


# ----------------------------------------------------------------------------- status.step


def _finished_learner(name: str, message: str, phase: str = "Succeeded") -> dict[str, Any]:
    code = 0 if phase == "Succeeded" else 1
    return _pod(
        "learner",
        name,
        phase,
        containerStatuses=[
            {
                "name": "learner",
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "message": message,
                    }
                },
            }
        ],
    )


def test_step_never_goes_back_across_a_learner_restart() -> None:
    running = World(
        ready=2, suspended=False, job_status={"active": 1, "ready": 1}, learner_pods=[_pod("learner", "l-2", "Running")]
    )
    before = {**running.observed().status, "step": 14, "weightVersion": 14}
    # The restarted learner's /metrics says 0 until it finished its first step after resuming.
    d = decide(replace(running.observed(), status=before, progress={"step": 0, "weightVersion": 0}), NOW)
    assert (d.status["step"], d.status["weightVersion"]) == (14, 14)
    d = decide(replace(running.observed(), status=d.status, progress={"step": 15, "weightVersion": 15}), NOW)
    assert (d.status["step"], d.status["weightVersion"]) == (15, 15)


def test_a_complete_job_reports_the_learners_last_step_not_the_last_scrape() -> None:
    # The last /metrics read saw step 14; the learner went on to 24 and said so when it exited.
    done = World(
        ready=2,
        suspended=False,
        job_status={"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]},
        learner_pods=[_finished_learner("l-1", "rmsft train: finished at step 24, weight version 24\n")],
        status={"phase": "Running", "step": 14, "weightVersion": 14},
    )
    d = decide(done.observed(), NOW)
    assert d.phase == "Complete"
    assert (d.status["step"], d.status["weightVersion"]) == (24, 24)


def test_a_failed_learner_keeps_the_last_step_seen() -> None:
    failed = World(
        ready=2,
        suspended=False,
        job_status={
            "failed": 1,
            "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}],
        },
        learner_pods=[_finished_learner("l-1", "Traceback ...\nRuntimeError: boom", "Failed")],
        status={"phase": "Running", "step": 14, "weightVersion": 14},
    )
    d = decide(failed.observed(), NOW)
    assert d.phase == "Failed" and d.status["step"] == 14


def test_final_progress_is_the_highest_any_finished_learner_pod_wrote() -> None:
    pods = [
        _finished_learner("l-1", "rmsft train: finished at step 25, weight version 25"),
        _finished_learner("l-2", "rmsft train: finished at step 60, weight version 61"),
        _finished_learner("l-3", "RuntimeError: boom", "Failed"),
        _pod("learner", "l-4", "Running"),
    ]
    assert learner_final_progress(pods) == {"step": 60, "weightVersion": 61}
    assert learner_final_progress(pods[2:]) == {}
    # what the learner writes is what the operator reads
    assert parse_final_progress(final_progress_message(24, 25)) == {"step": 24, "weightVersion": 25}


def test_a_server_lost_mid_run_is_said_once_and_given_back_when_it_is_the_pools_top() -> None:
    """Issue 41: mid-run (the learner resumed, status.startTime set), a replacement or added rollout server that is
    not Ready for spec.rollout.startupTimeout (30 min here) holds its GPUs while the others serve. It is said
    (RolloutReady False, ServerLost, the pod's own words, one Warning event) and, when it is among the pool's
    highest ordinals, given back: the StatefulSet scaled down, the learner's server list without it, and no later
    pass scales it up again. A lost server below a Ready one is named and kept; inside its 30 minutes nothing
    happens."""
    spec = _spec(**{"rollout.replicas": 3})
    crash = {"exitCode": 1, "message": "rmsft serve: CUDA out of memory"}
    ready = [_server(f"demo-rollout-{i}", ready=True) for i in (0, 1)]

    def running(pods: list[dict[str, Any]], status: dict[str, Any] | None = None, pool: int = 3) -> Observed:
        obs = World(
            spec=spec,
            ready=sum(_pod_ready_in(p) for p in pods),
            suspended=False,
            job_status={"active": 1, "ready": 1},
            rollout_pods=pods,
            status={"startTime": MIN_AGO[120], **(status or {})},
        ).observed()
        obs.children["StatefulSet"]["spec"]["replicas"] = pool  # as the last patch left it
        return obs

    # rollout-2 crash-looping, not Ready since 29 minutes: inside its startup timeout, only the usual words.
    young = _server("demo-rollout-2", created=29, restarts=5, ended=crash)
    early = decide(running([*ready, young]), NOW)
    assert _cond(early, "RolloutReady")["reason"] == "CrashLoopBackOff" and early.patches == []
    assert not any(e[1] == "ServerLost" for e in early.events)
    # Since 31 minutes: given back, the pool scaled to 2, the server list without it, said once.
    lost = _server("demo-rollout-2", created=31, restarts=7, ended=crash)
    d = decide(running([*ready, lost]), NOW)
    assert Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 2}}) in d.patches
    assert d.status["rolloutReplicas"] == 2 and d.status["releasedRolloutReplicas"] == 1 and d.phase == "Running"
    pool = _cond(d, "RolloutReady")
    assert pool["reason"] == "ServerLost" and "demo-rollout-2" in pool["message"], pool
    assert "rmsft serve: CUDA out of memory" in pool["message"] and "the pool scaled to 2" in pool["message"]
    assert [e[:2] for e in d.events if e[1] == "ServerLost"] == [("Warning", "ServerLost")]
    # The next pass, the pod gone: the pool stays at 2, the learner's list names 2 servers, no new event.
    after = decide(running(ready, d.status, pool=2), NOW)
    assert not any(p.kind == "StatefulSet" for p in after.patches)
    cm = next(p for p in after.patches if p.kind == "ConfigMap")
    assert "demo-rollout-1" in cm.body["data"][render.SERVERS_KEY]
    assert "demo-rollout-2" not in cm.body["data"][render.SERVERS_KEY]
    assert after.status["rolloutReplicas"] == 2 and _cond(after, "RolloutReady")["status"] == "True"
    assert "1 given back mid-run" in _cond(after, "RolloutReady")["message"]
    assert not any(e[1] == "ServerLost" for e in after.events)
    # rollout-1 lost below a Ready rollout-2: named and kept (a StatefulSet gives back only its top).
    middle = [
        _server("demo-rollout-0", ready=True),
        _server("demo-rollout-1", created=45, restarts=9, ended=crash),
        _server("demo-rollout-2", ready=True),
    ]
    kept = decide(running(middle), NOW)
    assert not any(p.kind == "StatefulSet" for p in kept.patches) and "releasedRolloutReplicas" not in kept.status
    assert "kept ordinal(s) 1" in _cond(kept, "RolloutReady")["message"]
    assert [e[1] for e in kept.events if e[0] == "Warning"] == ["ServerLost"]
    again = decide(running(middle, kept.status), NOW)
    assert not any(e[1] == "ServerLost" for e in again.events)  # once, not on every pass
    # Before the learner started (the pool starting), the start's own rules hold: no ServerLost.
    starting = World(spec=spec, ready=2, rollout_pods=[*ready, lost]).observed()
    assert _cond(decide(starting, NOW), "Failed")["reason"] == "RolloutCrashLoop"


def _pod_ready_in(pod: dict[str, Any]) -> int:
    return int(any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])))


def test_the_relay_allowlist_names_the_jobs_own_servers_exactly() -> None:
    """Issue 62: a server relays weight updates only to the job's own servers, named exactly (host:port, no pattern:
    a glob's `*` spanned dots and colons), every ordinal the pool may have, so a resized pool needs no new flags."""
    from rollout_engine.config import ServeConfig

    world = World(spec=_spec(**{"rollout.replicas": 3}), **_STARTED)
    obs = world.observed()
    serve = yaml.safe_load(obs.children["ConfigMap"]["data"][render.SERVE_KEY])
    allowed = serve["relay_allow"].split(",")
    port = serve["port"]
    assert allowed == [f"{N['statefulset']}-{i}.{N['service']}.{NS}.svc:{port}" for i in range(256)]
    assert not any(c in serve["relay_allow"] for c in "*?[]")
    allow = ServeConfig(model="m", relay_allow=serve["relay_allow"])
    servers = obs.children["ConfigMap"]["data"][render.SERVERS_KEY].split()
    assert len(servers) == 3 and all(map(allow.relay_allowed, servers))  # every address the learner relays to
    for other in (
        f"{N['statefulset']}-0.{N['service']}.other-team.svc:{port}",  # another namespace
        f"{N['statefulset']}-0.{N['service']}.{NS}.svc:{port + 1}",  # another port
        f"{N['statefulset']}-0.x.{N['service']}.{NS}.svc:{port}",  # what `*` let through
        f"{N['statefulset']}-256.{N['service']}.{NS}.svc:{port}",
    ):
        assert not allow.relay_allowed(other), other
    assert decide(obs, NOW).patches == []  # as rendered: nothing to patch


# ------------------------------------------------------------------ spec.scheduling.queueName (Kueue, issue 45)

_QUEUED = {"scheduling.queueName": "gpu-team"}


def _placed(pod: dict[str, Any], minutes: int) -> dict[str, Any]:
    """`pod`, placed by the scheduler `minutes` before NOW (PodScheduled True since then)."""
    pod["status"].setdefault("conditions", []).append(
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": MIN_AGO[minutes]}
    )
    return pod


def test_a_queued_job_labels_its_two_workloads_and_leaves_the_learners_suspend_to_kueue() -> None:
    """Kueue admits the learner Job and the rollout StatefulSet by their queue label, and owns the Job's suspend: the
    operator creates the Job suspended as always, never resumes it (not even with the pool Ready), says the learner
    waits for Kueue, and the job's start is timed from the pool being Ready, as the learner (started by Kueue) waits
    for it itself."""
    spec = _spec(**_QUEUED)
    d = decide(World(spec=spec, exists=()).observed(), NOW)
    created = {render.child_key(o): o for o in d.creates}
    assert created["Job"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-team"
    assert created["StatefulSet"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-team"
    assert created["Job"]["spec"]["suspend"] is True
    assert not any(
        "kueue.x-k8s.io/queue-name" in (o["metadata"].get("labels") or {})
        for k, o in created.items()
        if k not in ("Job", "StatefulSet")
    )
    assert not any(
        "kueue.x-k8s.io/queue-name" in o["spec"]["template"]["metadata"]["labels"]
        for o in (created["Job"], created["StatefulSet"])
    )  # Kueue's webhooks label the pods
    unqueued = {render.child_key(o): o for o in decide(World(exists=()).observed(), NOW).creates}
    assert "kueue.x-k8s.io/queue-name" not in unqueued["Job"]["metadata"]["labels"]

    ready = decide(World(spec=spec, ready=2).observed(), NOW)
    assert ready.patches == [] and ready.status["startTime"] == NOW
    lr = _cond(ready, "LearnerRunning")
    assert (lr["status"], lr["reason"]) == ("False", "Queued") and "LocalQueue gpu-team" in lr["message"]
    # Not resumed by the operator without a queue: the same world resumes it.
    assert decide(World(ready=2).observed(), NOW).patches == [Patch("Job", N["job"], {"spec": {"suspend": False}})]
    # Kueue admitted the learner before the pool was Ready: it runs and waits; the pool still starts.
    early = decide(
        World(
            spec=spec,
            ready=1,
            suspended=False,
            job_status={"active": 1, "ready": 1},
            learner_pods=[_pod("learner", "l-1", "Running")],
        ).observed(),
        NOW,
    )
    assert early.patches == [] and "startTime" not in early.status and early.phase == "Running"
    assert _cond(early, "RolloutReady")["reason"] == "PoolNotReady"


def test_a_queued_job_that_fails_to_start_deletes_its_learner_job_instead_of_suspending_it() -> None:
    """Kueue would resume a Job the operator suspended: a queued job that fails stops its learner by deleting the Job
    (its pods and its Workload go with it, which gives back the queue's quota); the pool is scaled to zero as for
    any job. Once final, a learner Job still there (queued or running) is deleted too, never suspended."""
    crash = [_server(restarts=3, ended={"exitCode": 1, "message": "RuntimeError: CUDA error: out of memory"})]
    for suspended in (True, False):  # waiting in the queue, or admitted and waiting for the pool
        d = decide(World(spec=_spec(**_QUEUED), suspended=suspended, rollout_pods=crash).observed(), NOW)
        assert d.phase == "Failed" and _cond(d, "Failed")["reason"] == "RolloutCrashLoop"
        assert d.deletes == [Delete("Job", N["job"], "job-uid-1")]
        assert d.patches == [Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}})]
    unqueued = decide(World(rollout_pods=crash).observed(), NOW)  # its Job stays suspended, as the operator made it
    assert (
        unqueued.phase == "Failed" and unqueued.deletes == [] and not [p for p in unqueued.patches if p.kind == "Job"]
    )

    final = {"phase": "Failed", "message": "learner failed"}
    d = decide(World(spec=_spec(**_QUEUED), suspended=False, status=final).observed(), NOW)
    assert d.deletes == [Delete("Job", N["job"], "job-uid-1")] and not [p for p in d.patches if p.kind == "Job"]
    ended = decide(
        World(
            spec=_spec(**_QUEUED), suspended=False, job_status={"succeeded": 1}, status={"phase": "Complete"}
        ).observed(),
        NOW,
    )
    assert ended.deletes == []  # a learner Job that ended is kept (its pods' logs)


def test_a_queued_pool_is_timed_from_its_placement_not_its_creation() -> None:
    """Rollout pods waiting for Kueue's admission (not placed: gated) are not failing to start, however long they
    wait; once placed, spec.rollout.startupTimeout runs from the placement. Unqueued, the clock is the StatefulSet's
    creation, so the same pods fail the job."""
    spec = _spec(**{**_QUEUED, "rollout.startupTimeout": "30m"})
    gated = _server("demo-rollout-0", created=120)
    gated["status"]["conditions"].append({"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"})
    assert decide(World(spec=spec, rollout_pods=[gated]).observed(), NOW).phase == "Pending"
    assert (
        _cond(decide(World(spec=_spec(), rollout_pods=[copy.deepcopy(gated)]).observed(), NOW), "Failed")["reason"]
        == "RolloutStartupTimeout"
    )
    recent = _placed(_server("demo-rollout-0", created=120), 29)
    assert decide(World(spec=spec, rollout_pods=[recent]).observed(), NOW).phase == "Pending"
    stuck = _placed(_server("demo-rollout-0", created=120), 31)
    failed = decide(World(spec=spec, rollout_pods=[stuck]).observed(), NOW)
    assert _cond(failed, "Failed")["reason"] == "RolloutStartupTimeout"
    assert "spec.rollout.startupTimeout (30 min)" in failed.status["message"]


def test_a_pool_left_idle_by_a_learner_kueue_does_not_admit_fails_the_job_after_the_startup_timeout() -> None:
    """Kueue admits the pool and the learner one by one: a pool Ready for spec.rollout.startupTimeout while its
    learner Job still waits in the queue fails the job, naming the queue (its GPUs idled), the Job deleted and the
    pool scaled to zero. A learner Kueue suspended again mid-run (a preemption: the Job's Suspended condition) gets
    a wait of its own."""
    spec = _spec(**{**_QUEUED, "rollout.startupTimeout": "30m"})
    waiting = World(spec=spec, ready=2, status={"startTime": MIN_AGO[29]})
    assert decide(waiting.observed(), NOW).phase == "Starting"
    idle = decide(replace(waiting, status={"startTime": MIN_AGO[31]}).observed(), NOW)
    assert idle.phase == "Failed" and _cond(idle, "Failed")["reason"] == "LearnerNotAdmitted"
    assert _cond(idle, "LearnerRunning")["reason"] == "LearnerNotAdmitted"
    assert (
        "LocalQueue gpu-team" in idle.status["message"]
        and "spec.rollout.startupTimeout (30 min)" in idle.status["message"]
    )
    assert idle.deletes == [Delete("Job", N["job"], "job-uid-1")]
    assert idle.patches == [Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}})]
    preempted = replace(
        waiting,
        status={"startTime": MIN_AGO[120]},
        job_status={
            "conditions": [
                {"type": "Suspended", "status": "True", "reason": "JobSuspended", "lastTransitionTime": MIN_AGO[4]}
            ]
        },
    )
    assert decide(preempted.observed(), NOW).phase != "Failed"
    unqueued = World(ready=2, status={"startTime": MIN_AGO[120]})  # the operator resumes it: nothing to wait for
    assert decide(unqueued.observed(), NOW).patches == [Patch("Job", N["job"], {"spec": {"suspend": False}})]


def test_the_learner_kueue_starts_before_its_pool_waits_as_long_as_the_pool_may_take() -> None:
    """The learner's wait for its servers at start (learner.train.loop) is the pool's startupTimeout at every start:
    queued, Kueue may start it first; unqueued, a retry's pod (issue 60) starts while servers may still restart,
    and waits as the first start does rather than one request's timeout."""
    spec = _spec(**{"rollout.startupTimeout": "30m"})
    request = parse_job(
        {"apiVersion": "rmsft.io/v1alpha1", "kind": "RolloutMatchingJob", "metadata": {"name": NAME}, "spec": spec}
    ).spec
    assert request.training.rollout.request_timeout_s < 1800
    assert request.pool_wait_seconds == 1800
    queued = parse_job(
        {
            "apiVersion": "rmsft.io/v1alpha1",
            "kind": "RolloutMatchingJob",
            "metadata": {"name": NAME},
            "spec": {**spec, "scheduling": {"queueName": "gpu-team"}},
        }
    ).spec
    assert queued.pool_wait_seconds == 1800


# ------------------------------------------------------------------ issue 62: a clock for every way to hold GPUs

_SCALE_TO_ZERO = Patch("StatefulSet", N["statefulset"], {"spec": {"replicas": 0}})


def _failed_with(d: Decision, reason: str) -> None:
    """`d` fails the job with `reason` and holds no GPU: the pool patched to zero (or already there), none wanted."""
    assert d.phase == "Failed", (d.phase, d.status.get("message"))
    assert _cond(d, "Failed")["reason"] == reason and _cond(d, "Failed")["status"] == "True"
    assert d.status["rolloutReplicas"] == 0 and _SCALE_TO_ZERO in d.patches


def test_a_learner_pod_the_api_refuses_to_create_fails_the_job_after_the_startup_timeout() -> None:
    """(a) A namespace GPU ResourceQuota the pool already uses (or Pod Security, a webhook) refuses the learner's pod:
    before, a condition and no deadline (3 days Starting with the pool Ready). The clock is the first refusal's event
    time (the API's), so a lost status write (the status below is empty every pass) cannot restart it."""
    quota = (
        'pods "demo-learner-x" is forbidden: exceeded quota: gpu, requested: nvidia.com/gpu=1, used: nvidia.com/gpu=2'
    )
    world = World(
        ready=2,
        suspended=False,
        job_status={"active": 0},
        failed_creates={"Job": quota},
        failed_create_since={"Job": MIN_AGO[29]},
        job_started=MIN_AGO[29],
    )
    waiting = decide(world.observed(), NOW)
    assert waiting.phase == "Starting" and _cond(waiting, "LearnerRunning")["reason"] == "FailedCreate"
    assert _SCALE_TO_ZERO not in waiting.patches
    late = decide(replace(world, failed_create_since={"Job": MIN_AGO[31]}).observed(), NOW)
    _failed_with(late, "LearnerCreateRefused")
    assert _cond(late, "LearnerRunning")["reason"] == "LearnerCreateRefused"
    assert "exceeded quota" in late.status["message"]
    assert "spec.rollout.startupTimeout (30 min)" in late.status["message"]
    assert Patch("Job", N["job"], {"spec": {"suspend": True}}) in late.patches  # its pod removed
    # No event seen (expired): the Job's own start is the clock.
    _failed_with(
        decide(replace(world, failed_create_since={}, job_started=MIN_AGO[31]).observed(), NOW), "LearnerCreateRefused"
    )


class _RefusingJobs(_Refusing):
    """A namespace whose quota on count/jobs.batch (or a webhook on Jobs) refuses the learner Job; the StatefulSet
    created before it is kept as patched."""

    def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        sub: str | None = None,
        expected: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        super().patch(kind, namespace, name, body, sub, expected)
        if kind == "StatefulSet":
            self.objects["StatefulSet"]["spec"].update(body["spec"])
        return body


def _ago(minutes: int) -> str:
    import datetime as dt

    return (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_learner_job_the_api_forbids_frees_the_pool_at_once_and_fails_after_the_startup_timeout() -> None:
    """(b) 403 on the learner Job: before, the StatefulSet created just before it stayed at full size, retried for
    ever. Now the pool is scaled to zero while it is retried, and the job is Failed once spec.rollout.startupTimeout
    has passed since its creation (the API's metadata.creationTimestamp: no status write restarts it)."""
    kube = _RefusingJobs("Job", 403)
    body = {
        "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": 1, "creationTimestamp": _ago(1)},
        "spec": _spec(),
    }
    out = act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]
    assert out.phase == "Pending" and out.status["rolloutReplicas"] == 0
    assert ("create", "StatefulSet") in kube.writes and kube.writes[-1] == ("patch", "StatefulSet")
    assert kube.objects["StatefulSet"]["spec"]["replicas"] == 0
    assert "the pool is scaled to zero meanwhile" in out.status["message"]
    # The next passes (the resync): the pool stays at zero; 31 minutes after the job's creation it is Failed.
    body["metadata"]["creationTimestamp"] = _ago(31)
    kube.writes.clear()
    late = act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]
    assert late.phase == "Failed" and kube.objects["StatefulSet"]["spec"]["replicas"] == 0
    failed = next(c for c in late.status["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "CreateRefused")
    assert "still did after spec.rollout.startupTimeout" in late.status["message"]
    body["status"] = late.status  # final: the next pass creates nothing, keeps the pool at zero
    kube.writes.clear()
    final = act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]
    assert final.phase == "Failed" and not any(w[0] == "create" for w in kube.writes)


def _stuck_gang(minutes: int) -> World:
    conditions = [
        {
            "type": "FailureTarget",
            "status": "True",
            "reason": "PodFailurePolicy",
            "message": _LOST,
            "lastTransitionTime": MIN_AGO[minutes],
        }
    ]
    terminating = _pod("learner", "demo-learner-0-ab", "Running")
    terminating["metadata"]["deletionTimestamp"] = MIN_AGO[minutes]
    return World(
        spec=_spec(**_GANG),
        ready=2,
        suspended=False,
        job_status={"conditions": conditions},
        status={"phase": "Running", "learnerAttempt": 1},
        learner_pods=[terminating],
    )


def test_an_attempt_whose_pods_never_stop_fails_the_job_after_their_grace_period() -> None:
    """(c) A learner on several pods waits for its failed Job's Failed condition, which Kubernetes 1.31+ writes only
    once every pod is terminal: a pod on a lost node stays Terminating and the job sat Running with its pool. Past the
    pods' grace period (10 min) plus 5 minutes from the FailureTarget (the Job controller's time), the job fails."""
    waiting = decide(_stuck_gang(4).observed(), NOW)
    assert waiting.phase == "Running" and waiting.deletes == [] and _SCALE_TO_ZERO not in waiting.patches
    late = decide(_stuck_gang(31).observed(), NOW)
    _failed_with(late, "LearnerNotStopped")
    assert "demo-learner-0-ab still terminating" in late.status["message"]
    assert _cond(late, "LearnerRunning")["reason"] == "LearnerNotStopped"
    assert late.deletes == []  # no next attempt beside a pod that may still run


def test_a_queued_pool_placed_only_in_part_is_timed_from_its_admission() -> None:
    """(d) Kueue admitted the pool but only part of it was placed: the unplaced pods had no clock. The first
    placement of any of its pods is the admission: spec.rollout.startupTimeout runs from it for every pod."""
    spec = _spec(**{**_QUEUED, "rollout.startupTimeout": "30m"})

    def pool(placed: int) -> list[dict[str, Any]]:
        first = _placed(_server("demo-rollout-0", created=120, ready=True), placed)
        unplaced = _unschedulable("rollout", "demo-rollout-1", 120)
        return [first, unplaced]

    assert decide(World(spec=spec, ready=1, rollout_pods=pool(29)).observed(), NOW).phase == "Starting"
    late = decide(World(spec=spec, ready=1, rollout_pods=pool(31)).observed(), NOW)
    _failed_with(late, "RolloutStartupTimeout")
    assert "demo-rollout-1" in late.status["message"] and late.deletes == [Delete("Job", N["job"], "job-uid-1")]
    gated = _pod(
        "rollout",
        "demo-rollout-1",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}],
    )
    still_queued = [_placed(_server("demo-rollout-0", created=120), 31)]
    still_queued[0]["status"]["conditions"] = [
        {"type": "Ready", "status": "True"},
        *still_queued[0]["status"]["conditions"][1:],
    ]
    assert decide(World(spec=spec, ready=1, rollout_pods=[*still_queued, gated]).observed(), NOW).phase != "Failed"


def test_a_lost_server_below_a_ready_one_fails_the_job_after_twice_the_startup_timeout() -> None:
    """(e) Mid-run, a lost server whose ordinal is below a Ready one kept its GPUs to the end of the run (and then
    the pool shrank to it, the run going on with the others' GPUs given back but the job's own still held). Kept
    for one timeout past the start's own (deleting its pod retries it), then not Ready for twice
    spec.rollout.startupTimeout (its pod's Ready condition: the API's clock, so the status below, empty every pass
    as if every write were lost, cannot restart it): Failed, ServerLost naming the ordinal and since when, the pool
    at zero and the learner suspended."""
    spec = _spec(**{"rollout.replicas": 3})
    crash = {"exitCode": 1, "message": "rmsft serve: CUDA out of memory"}

    def world(minutes: int) -> Observed:
        pods = [
            _server("demo-rollout-0", ready=True),
            _server("demo-rollout-1", created=minutes, restarts=9, ended=crash),
            _server("demo-rollout-2", ready=True),
        ]
        obs = World(
            spec=spec,
            ready=2,
            suspended=False,
            job_status={"active": 1, "ready": 1},
            rollout_pods=pods,
            status={"startTime": MIN_AGO[120]},
        ).observed()
        obs.children["StatefulSet"]["spec"]["replicas"] = 3
        return obs

    kept = decide(world(59), NOW)
    assert kept.phase == "Running" and not any(p.kind == "StatefulSet" for p in kept.patches)
    assert (
        "kept ordinal(s) 1" in kept.status["message"]
        and "the job fails and its pool is freed" in kept.status["message"]
    )
    late = decide(world(61), NOW)
    _failed_with(late, "ServerLost")
    message = _cond(late, "Failed")["message"]
    assert f"ordinal 1 not Ready since {MIN_AGO[61]}" in message and "rmsft serve: CUDA out of memory" in message
    assert "recreate the job" in message and "twice spec.rollout.startupTimeout (60 min)" in message
    assert Patch("Job", N["job"], {"spec": {"suspend": True}}) in late.patches  # the learner's GPUs freed too
    assert _cond(late, "RolloutReady")["reason"] == "PoolScaledDown"
    assert [e[1] for e in late.events if e[0] == "Warning"] == ["PhaseFailed"]
    # The top server lost as long is given back, not failed: the others serve on.
    top = [
        _server("demo-rollout-0", ready=True),
        _server("demo-rollout-1", ready=True),
        _server("demo-rollout-2", created=61, restarts=9, ended=crash),
    ]
    obs = World(
        spec=spec,
        ready=2,
        suspended=False,
        job_status={"active": 1, "ready": 1},
        rollout_pods=top,
        status={"startTime": MIN_AGO[120]},
    ).observed()
    obs.children["StatefulSet"]["spec"]["replicas"] = 3
    given = decide(obs, NOW)
    assert given.phase == "Running" and given.status["releasedRolloutReplicas"] == 1


class _LosingStatus(_Existing):
    """A namespace holding the job's children whose status writes fail (a 500, an API server restart) `lose` times;
    records every write that happened."""

    def __init__(self, objects: dict[str, dict[str, Any]], lose: int) -> None:
        super().__init__(objects)
        self.lose, self.writes = lose, []

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [p for p in self.pods if labels.items() <= p["metadata"]["labels"].items()]

    def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        sub: str | None = None,
        expected: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        self.writes.append(("patch", kind, body))
        return body

    def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any], expected: tuple[int, ...] = ()
    ) -> dict[str, Any]:
        if self.lose:
            self.lose -= 1
            raise ApiError(500, "etcdserver: request timed out")
        self.writes.append(("status", status["phase"], status))
        return status


def test_a_start_failure_whose_status_write_is_lost_is_not_undone_by_the_next_pass() -> None:
    """(f) Before, the pool was scaled down and then the status written: with that write lost, the next pass saw no
    failure (its pods were gone) and scaled the pool up again, clock restarted. Now the status is written first: a
    lost write leaves the pool (and the crash loop, the evidence) as it was, the next pass fails the job again."""
    kids = _children(_spec())
    kube = _LosingStatus(kids, lose=1)
    kube.pods = [_server(restarts=3, ended={"exitCode": 1, "message": "RuntimeError: CUDA error: out of memory"})]
    body = {"metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": 1}, "spec": _spec()}
    with pytest.raises(ApiError, match="500"):
        act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]
    assert kube.writes == []  # nothing scaled down without its status
    out = act(kube, obs := observe(kube, body), decide(obs, NOW))  # type: ignore[arg-type]
    assert out.phase == "Failed" and [w[:2] for w in kube.writes] == [("status", "Failed"), ("patch", "StatefulSet")]
    assert kube.writes[1][2] == {"spec": {"replicas": 0}}


# ------------------------------------------------------------------ issue 62: start rules at the start only

_RAN = {"startTime": MIN_AGO[120], "learnerStartTime": MIN_AGO[120], "phase": "Running"}


def _not_failed(d: Decision) -> None:
    assert d.phase != "Failed" and _cond(d, "Failed")["status"] == "False", d.status.get("message")
    assert _SCALE_TO_ZERO not in d.patches


def test_a_replacement_servers_preflight_killed_for_memory_is_a_fault_not_a_verdict() -> None:
    """Mid-run, a replacement server's preflight OOMKilled (the node's memory, not the model): before, Failed
    ModelPreflightFailed, final. Now the failover's: the other servers go on and the lost-server clock applies.
    At the start too, a killed preflight is no verdict about the model (only its own exit is)."""
    oom = _preflight(name="demo-rollout-1", exit_code=137, message="")
    oom["status"]["initContainerStatuses"][0]["lastState"]["terminated"]["reason"] = "OOMKilled"
    mid_run = World(**_STARTED, status=_RAN, rollout_pods=[_server("demo-rollout-0", ready=True), oom])
    _not_failed(decide(mid_run.observed(), NOW))
    verdict = _preflight(name="demo-rollout-1")  # the preflight's own refusal of the model, mid-run: a lost server too
    _not_failed(decide(replace(mid_run, rollout_pods=[_server("demo-rollout-0", ready=True), verdict]).observed(), NOW))
    at_start = decide(World(rollout_pods=[copy.deepcopy(oom)]).observed(), NOW)
    _not_failed(at_start)
    assert _cond(decide(World(rollout_pods=[verdict]).observed(), NOW), "Failed")["reason"] == "ModelPreflightFailed"


def _learner_pull(message: str) -> dict[str, Any]:
    return _waiting_for_image("ErrImagePull", message, role="learner", name="demo-learner-y")


def test_a_replacement_learners_refused_pull_is_retried_within_its_attempts() -> None:
    """Mid-run, a replacement learner pod whose pull the registry refuses with "unauthorized" (an expired registry
    token): before, Failed ImageUnavailable at once, final. Now it waits like any pod; past spec.rollout.startupTimeout
    it is deleted, so the learner Job retries it within spec.learner.backoffLimit (its attempts bound it)."""
    said = 'failed to pull image "ghcr.io/x/rmsft:v9": 401 Unauthorized: unauthorized: authentication required'
    fresh = World(**_STARTED, status=_RAN, learner_pods=[_learner_pull(said)])
    _not_failed(d := decide(fresh.observed(), NOW))
    assert d.deletes == []
    # The same pod at the start: the registry's answer holds, the job fails at once (the start rule).
    assert _cond(decide(replace(fresh, status={}).observed(), NOW), "Failed")["reason"] == "ImageUnavailable"
    placed = _placed(_learner_pull(said), 31)
    placed["metadata"]["uid"] = "pod-uid-y"
    late = decide(replace(fresh, learner_pods=[placed]).observed(), NOW)
    _not_failed(late)
    assert late.deletes == [Delete("Pod", "demo-learner-y", "pod-uid-y")]
    retried = [e for e in late.events if e[1] == "LearnerPodRetried"]
    assert len(retried) == 1 and "spec.learner.backoffLimit 2" in retried[0][2] and "unauthorized" in retried[0][2]


def test_a_replacement_learner_waiting_for_gpus_a_preemptor_took_is_retried_not_failed() -> None:
    """Mid-run, the learner's replacement pod cannot be placed (a preemptor took its GPUs): before, Failed
    LearnerUnschedulable after spec.rollout.startupTimeout, final. Now the pod is retried (deleted: the Job counts it
    against its backoffLimit and makes another), so the run survives a preemptor that leaves in time. The same
    learner had the job failed before it first ran (a start rule)."""
    waiting = _unschedulable("learner", "demo-learner-z", 31)
    waiting["metadata"]["uid"] = "pod-uid-z"
    world = World(**_STARTED, status=_RAN, learner_pods=[waiting])
    d = decide(world.observed(), NOW)
    _not_failed(d)
    assert d.deletes == [Delete("Pod", "demo-learner-z", "pod-uid-z")]
    # What says the learner ran is read from the API too: the Job counted a failed pod (the status lost).
    counted = replace(world, status={"startTime": MIN_AGO[120]}, job_status={"active": 1, "failed": 1})
    _not_failed(decide(counted.observed(), NOW))
    assert _cond(decide(replace(world, status={}).observed(), NOW), "Failed")["reason"] == "LearnerUnschedulable"


def test_a_kueue_preemption_of_both_workloads_is_not_learner_not_admitted() -> None:
    """Kueue preempted the pool and the learner: both wait in the queue, nothing holds GPUs. Before, more than
    spec.rollout.startupTimeout of it failed the job as LearnerNotAdmitted. The rule is for a Ready pool idling while
    its learner waits: it needs the pool Ready now, timed from its pods' Ready (the API's clock)."""
    spec = _spec(**{**_QUEUED, "rollout.startupTimeout": "30m"})
    suspended = {
        "conditions": [
            {"type": "Suspended", "status": "True", "reason": "JobSuspended", "lastTransitionTime": MIN_AGO[120]}
        ]
    }
    preempted = World(spec=spec, ready=0, job_status=suspended, status={"startTime": MIN_AGO[120]})
    _not_failed(decide(preempted.observed(), NOW))

    def ready_pool(minutes: int) -> list[dict[str, Any]]:
        pods = [_server(f"demo-rollout-{i}", created=120, ready=True) for i in (0, 1)]
        for p in pods:
            p["status"]["conditions"][0]["lastTransitionTime"] = MIN_AGO[minutes]
        return pods

    readmitted = replace(preempted, ready=2, rollout_pods=ready_pool(29))
    _not_failed(decide(readmitted.observed(), NOW))  # its pool Ready again 29 minutes ago
    idle = decide(replace(readmitted, rollout_pods=ready_pool(31)).observed(), NOW)
    assert idle.phase == "Failed" and _cond(idle, "Failed")["reason"] == "LearnerNotAdmitted"


def test_a_learner_redoing_steps_after_a_resume_is_not_stalled() -> None:
    """status.step never goes back (the STEP column), yet after a resume from an older checkpoint the learner redoes
    the steps up to it: the stall clock read status.step and, with failWhenStalled, failed the run. It now reads the
    step the learner is on (status.currentStep)."""
    spec = _spec(**{"learner.stallTimeout": "30m", "learner.failWhenStalled": True})
    pods = [_pod("learner", "l-2", "Running")]
    world = World(
        spec=spec,
        ready=2,
        suspended=False,
        job_status={"active": 1, "ready": 1},
        learner_pods=pods,
        status={**_RAN, "step": 50, "currentStep": 50, "lastStepTime": MIN_AGO[45]},
    )
    status, steps = (
        world.status,
        [
            (41, "2026-11-23T10:00:00Z"),
            (42, "2026-11-23T10:20:00Z"),
            (43, "2026-11-23T10:40:00Z"),
            (44, "2026-11-23T11:00:00Z"),
        ],
    )
    for step, at in steps:
        d = decide(replace(world.observed(), status=status, progress={"step": step}), at)
        _not_failed(d)
        assert d.status["step"] == 50 and d.status["currentStep"] == step and d.status["lastStepTime"] == at
        status = d.status
    # Still one clock: the learner stuck on step 44 for 31 minutes is stalled (and failed, as asked).
    stuck = decide(replace(world.observed(), status=status, progress={"step": 44}), "2026-11-23T11:31:00Z")
    assert stuck.phase == "Failed" and _cond(stuck, "Failed")["reason"] == "LearnerStalled"
    assert "since step 44" in stuck.status["message"]


def test_a_disruption_does_not_use_up_an_attempt_of_a_learner_on_several_pods() -> None:
    """Issue 60 item 6: a pod of a learner on several pods evicted (drain, preemption: its DisruptionTarget, matched
    by the Job's first podFailurePolicy rule) fails the attempt; it is run again without being counted, even on the
    last attempt, and status.learnerDisruptions says how often."""
    said = "Pod team-a/demo-learner-1-x9 has condition DisruptionTarget matching FailJob rule at index 0"
    conditions = [
        {"type": k, "status": "True", "reason": "PodFailurePolicy", "message": said}
        for k in ("FailureTarget", "Failed")
    ]
    world = World(
        spec=_spec(**_GANG),
        ready=2,
        suspended=False,
        job_status={"conditions": conditions},
        status={"phase": "Running", "learnerAttempt": 3},
    )  # backoffLimit 2: the last attempt
    d = decide(world.observed(), NOW)
    _not_failed(d)
    assert d.deletes == [Delete("Job", N["job"], "job-uid-1")]
    assert d.status["learnerAttempt"] == 3 and d.status["learnerDisruptions"] == 1
    assert "disrupted (not counted)" in d.status["message"]
    # A pod's own DisruptionTarget says it too, whatever the Job's words.
    evicted = _pod(
        "learner",
        "demo-learner-1-x9",
        "Failed",
        conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}],
    )
    plain = [{**c, "message": _LOST} for c in conditions]
    again = decide(replace(world, job_status={"conditions": plain}, learner_pods=[evicted]).observed(), NOW)
    assert again.status["learnerAttempt"] == 3 and again.deletes
    # A fault (no disruption) on the last attempt still fails the job.
    assert decide(replace(world, job_status={"conditions": plain}).observed(), NOW).phase == "Failed"


def test_a_job_without_a_periodic_checkpoint_says_so_at_admission() -> None:
    """Issue 60: with a claim the learner saves every 30 minutes unless told otherwise (training.checkpoint.
    every_minutes), and the condition says when it saves; a job with no periodic checkpoint at all (every 0,
    every_minutes 0) says that a learner killed outright starts again from step 0, claim or not."""
    claimed = decide(World(spec=_spec(**{"learner.checkpointClaim": "pvc"})).observed(), NOW)
    assert "saved every 30 minutes, at the end and on SIGTERM" in _cond(claimed, "CheckpointsDurable")["message"]
    steps = decide(
        World(
            spec=_spec(
                **{
                    "learner.checkpointClaim": "pvc",
                    "training.checkpoint.every": 50,
                    "training.checkpoint.every_minutes": 0,
                }
            )
        ).observed(),
        NOW,
    )
    assert "saved every 50 steps, at the end" in _cond(steps, "CheckpointsDurable")["message"]
    for spec in (_spec(), _spec(**{"learner.checkpointClaim": "pvc", "training.checkpoint.every_minutes": 0})):
        message = _cond(decide(World(spec=spec).observed(), NOW), "CheckpointsDurable")["message"]
        assert "no periodic checkpoint" in message and "killed outright" in message, message
