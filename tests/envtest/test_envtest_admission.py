"""The RolloutMatchingJob CRD at admission on a real kube-apiserver (not the offline emulation of
tests/operator/crd_admission.py): every example job is accepted, each invalid spec of
tests/operator/test_operator_crd.py is refused with 422 and a message naming the field, and only
`spec.rollout.replicas` may change once a job exists."""

from __future__ import annotations

import copy
import importlib.util
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from controlplane import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(
    p
    for p in (ROOT / "configs").glob("*.yaml")
    if any(d and d.get("kind") == "RolloutMatchingJob" for d in yaml.safe_load_all(p.read_text()))
)
API = "/apis/rmsft.io/v1alpha1"


def _offline_crd_tests() -> ModuleType:
    """tests/operator/test_operator_crd.py, loaded under a private name (so pytest's own import of
    it is untouched): its INVALID cases and `_set` are the single source of the invalid specs."""
    sys.path.insert(0, str(ROOT / "tests/operator"))  # for its `from crd_admission import admit`
    path = ROOT / "tests/operator/test_operator_crd.py"
    spec = importlib.util.spec_from_file_location("_rmsft_offline_crd_cases", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_OFFLINE = _offline_crd_tests()
INVALID: list[tuple[str, dict[str, Any], list[str]]] = _OFFLINE.INVALID
_set = _OFFLINE._set


def _job(path: Path = ROOT / "configs/job.yaml") -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "RolloutMatchingJob")


def _create(cp: ControlPlane, namespace: str, doc: dict[str, Any]) -> tuple[int, Any]:
    # fieldValidation=Strict is what `kubectl apply/create` sends: unknown fields are errors, not pruned.
    return cp.request("POST", f"{API}/namespaces/{namespace}/rolloutmatchingjobs?fieldValidation=Strict", doc)


def _delete(cp: ControlPlane, namespace: str, name: str) -> None:
    cp.request("DELETE", f"{API}/namespaces/{namespace}/rolloutmatchingjobs/{name}")


def _message(body: Any) -> str:
    return body.get("message", "") if isinstance(body, dict) else str(body)


# The real server appends this cause, with no field (`<nil>`), whenever schema errors kept it from
# running the CEL rules: it names nothing by design, so it is left out of the field checks.
_RULES_SKIPPED = "some validation rules were not checked"


def _cause_fields(body: Any) -> list[str]:
    causes = (body.get("details") or {}).get("causes") or [] if isinstance(body, dict) else []
    return [c.get("field", "") for c in causes if _RULES_SKIPPED not in c.get("message", "")]


@pytest.fixture(scope="module")
def jobs_ns(control_plane: ControlPlane, rmj_crd: dict[str, Any]) -> Iterator[str]:
    name = f"admission-{uuid.uuid4().hex[:6]}"
    control_plane.create_namespace(name)
    yield name
    control_plane.request("DELETE", f"/api/v1/namespaces/{name}")


def test_there_are_at_least_25_invalid_specs() -> None:
    assert len(INVALID) >= 25


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_job_is_accepted(control_plane: ControlPlane, jobs_ns: str, path: Path) -> None:
    doc = _job(path)
    status, body = _create(control_plane, jobs_ns, doc)
    try:
        assert status == 201, f"{path.name} refused ({status}): {_message(body)}"
        # The server's structural defaulting filled in what the example leaves out.
        assert body["spec"]["rollout"]["port"] and body["spec"]["sync"]["mode"]
    finally:
        _delete(control_plane, jobs_ns, doc["metadata"]["name"])


@pytest.mark.parametrize("value", [1800, "1h30m", None], ids=["seconds", "duration", "default"])
def test_startup_timeout_is_seconds_or_a_duration(control_plane: ControlPlane, jobs_ns: str, value: Any) -> None:
    doc = _job()
    doc["metadata"]["name"] = f"startup-{uuid.uuid4().hex[:6]}"
    if value is not None:
        doc["spec"]["rollout"]["startupTimeout"] = value
    status, body = _create(control_plane, jobs_ns, doc)
    try:
        assert status == 201, _message(body)
        assert body["spec"]["rollout"]["startupTimeout"] == (value if value is not None else "30m")
    finally:
        _delete(control_plane, jobs_ns, doc["metadata"]["name"])


# Cases whose only fault is a key the schema does not know.
UNKNOWN_FIELD_CASES = {"unknown-key", "freeze-unknown", "grpo-reward-unknown-key"}


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_naming_the_field(
    control_plane: ControlPlane, jobs_ns: str, case: tuple[str, dict[str, Any], list[str]]
) -> None:
    case_id, edits, fields = case
    doc = _job()
    for dotted, value in edits.items():
        _set(doc, dotted, value)
    status, body = _create(control_plane, jobs_ns, doc)
    if status == 201:
        _delete(control_plane, jobs_ns, doc["metadata"]["name"])
    message = _message(body)
    # Strict field validation refuses an unknown field as a bad request (400), before the schema runs.
    expected = 400 if case_id in UNKNOWN_FIELD_CASES else 422
    assert status == expected, f"{case_id}: expected {expected}, got {status}: {message}"
    for field in fields:
        assert field in message, f"{case_id}: the API server's message does not name {field}: {message}"
    causes = _cause_fields(body)
    if expected == 400:
        return  # a decoding error: the message is all there is (no causes)
    assert causes and all(f and f != "<nil>" for f in causes), f"{case_id}: cause without a field: {causes} {message}"


@pytest.fixture
def existing_job(control_plane: ControlPlane, jobs_ns: str) -> Iterator[dict[str, Any]]:
    doc = _job()
    doc["metadata"]["name"] = f"immutable-{uuid.uuid4().hex[:6]}"
    assert "kvCacheBytes" not in doc["spec"]["rollout"]  # the "added later" case below relies on it
    status, body = _create(control_plane, jobs_ns, doc)
    assert status == 201, _message(body)
    yield body
    _delete(control_plane, jobs_ns, doc["metadata"]["name"])


def _patch(cp: ControlPlane, job: dict[str, Any], dotted: str, value: Any) -> tuple[int, Any]:
    patch: dict[str, Any] = {}
    _set(patch, dotted, value)
    meta = job["metadata"]
    return cp.request(
        "PATCH",
        f"{API}/namespaces/{meta['namespace']}/rolloutmatchingjobs/{meta['name']}?fieldValidation=Strict",
        patch,
    )


IMMUTABLE_EDITS = [
    ("spec.training.lr", 0.001, "spec.training"),
    ("spec.model.path", "/models/other", "spec.model"),
    ("spec.rollout.port", 50052, "spec.rollout.port"),
    ("spec.rollout.kvCacheBytes", 2**30, "spec.rollout.kvCacheBytes"),  # absent at creation, added now
    ("spec.rollout.tensorParallelSize", 2, "spec.rollout.tensorParallelSize"),
    ("spec.learner.gpus", 1, "spec.learner"),
    ("spec.sync.transport", "grpc", "spec.sync"),  # the pods were placed for shm (one node, hostPath)
]


@pytest.mark.parametrize(("dotted", "value", "field"), IMMUTABLE_EDITS, ids=[e[0] for e in IMMUTABLE_EDITS])
def test_edit_of_immutable_field_is_refused(
    control_plane: ControlPlane, existing_job: dict[str, Any], dotted: str, value: Any, field: str
) -> None:
    status, body = _patch(control_plane, existing_job, dotted, value)
    message = _message(body)
    assert status == 422, f"editing {dotted} was not refused ({status}): {message}"
    assert field in message and "immutable" in message, message
    assert any(f.startswith(field) or field.startswith(f) for f in _cause_fields(body)), (_cause_fields(body), message)


def test_replicas_edit_is_accepted(control_plane: ControlPlane, existing_job: dict[str, Any]) -> None:
    before = existing_job["spec"]
    status, body = _patch(control_plane, existing_job, "spec.rollout.replicas", 4)
    assert status == 200, _message(body)
    assert body["spec"]["rollout"]["replicas"] == 4
    assert body["metadata"]["generation"] == existing_job["metadata"]["generation"] + 1
    after = copy.deepcopy(body["spec"])
    after["rollout"]["replicas"] = before["rollout"]["replicas"]
    assert after == before  # nothing else moved (defaults are not re-applied differently)
