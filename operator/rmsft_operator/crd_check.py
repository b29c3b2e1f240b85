"""At start: is the installed RolloutMatchingJob CRD the one this operator was built for?

Helm installs `crds/` once and never upgrades it, so after `helm upgrade` the operator may run against an older CRD.
Then every status write that names a condition type the old schema does not list is refused (422), and a status field
the old schema does not have (status.learnerAttempt, status.lastStepTime...) is pruned on every write, which loses its
clock or its count. Instead of failing job after job, the operator says it once, at start, in its log and in a Warning
Event (in its own namespace, naming the CRD), with the fields at stake and the command that fixes it (docs/upgrade.md).
It goes on running: a job whose status fits the old schema still works.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from rmsft.jobspec import API_GROUP, PLURAL
from rmsft_operator.kube import ApiError, Kube

log = logging.getLogger("rmsft_operator.crd_check")
CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
REASON = "CRDVersionMismatch"
FIX = (
    "apply the chart's CRD: kubectl apply --server-side -f charts/rmsft/crds/rolloutmatchingjobs.yaml "
    "(Helm never upgrades crds/; docs/upgrade.md)"
)


def _properties(schema: dict[str, Any], prefix: str) -> set[str]:
    """Every property path under `schema` (objects and arrays of objects), e.g. status.evaluation.f1."""
    out: set[str] = set()
    items = schema.get("items") if isinstance(schema.get("items"), dict) else None
    for key, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{key}"
        out.add(path)
        if isinstance(sub, dict):
            out |= _properties(sub, path)
    if items:
        out |= _properties(items, f"{prefix}[]")
    return out


def _version(crd: dict[str, Any] | None, name: str) -> dict[str, Any]:
    for v in ((crd or {}).get("spec") or {}).get("versions") or []:
        if v.get("name") == name:
            return v
    return {}


def mismatch(installed: dict[str, Any] | None, own: dict[str, Any]) -> str:
    """What this operator writes or reads that `installed` lacks, in words; "" when the installed CRD has it all.
    Compared: the served version, the status and spec fields (a missing one is pruned), the phase and condition type
    enums (a missing value is refused)."""
    if installed is None:
        return f"the CRD {CRD_NAME} is not installed"
    (own_version,) = own["spec"]["versions"]
    name = own_version["name"]
    theirs = _version(installed, name)
    if not theirs or not theirs.get("served"):
        served = [v.get("name") for v in installed["spec"].get("versions") or [] if v.get("served")]
        return f"the installed CRD {CRD_NAME} does not serve {name} (it serves {', '.join(map(str, served)) or 'none'})"
    mine_schema = own_version["schema"]["openAPIV3Schema"]
    their_schema = (theirs.get("schema") or {}).get("openAPIV3Schema") or {}
    problems = []
    for part in ("status", "spec"):
        lacks = sorted(
            _properties(mine_schema["properties"][part], part)
            - _properties((their_schema.get("properties") or {}).get(part) or {}, part)
        )
        if lacks:
            what = "pruned from every status write" if part == "status" else "pruned from every job"
            problems.append(
                f"{len(lacks)} {part} field(s) it lacks ({what}): {', '.join(lacks[:12])}"
                + (" ..." if len(lacks) > 12 else "")
            )

    def enum(schema: dict[str, Any], *path: str) -> set[str]:
        node: Any = schema
        for key in path:
            node = (node or {}).get(key) if isinstance(node, dict) else None
        return set((node or {}).get("enum") or []) if isinstance(node, dict) else set()

    for label, path in (
        ("condition types", ("properties", "status", "properties", "conditions", "items", "properties", "type")),
        ("phases", ("properties", "status", "properties", "phase")),
    ):
        missing = sorted(enum(mine_schema, *path) - enum(their_schema, *path))
        if missing and enum(their_schema, *path):
            problems.append(f"{label} it refuses (every status write naming one fails with 422): {', '.join(missing)}")
    if not problems:
        return ""
    return f"the installed CRD {CRD_NAME} is older than this operator: " + "; ".join(problems) + f"; {FIX}"


def check(kube: Kube, namespace: str, own: dict[str, Any]) -> str:
    """Reads the installed CRD (only it: the chart grants `get` on it by name) and, when it does not match `own`,
    logs an error and posts a Warning Event in `namespace` (skipped when empty). Returns the mismatch ("" when none,
    or when the CRD cannot be read, which is logged)."""
    try:
        installed = kube.request("GET", CRD_PATH, expected=(403, 404))
    except ApiError as exc:
        if exc.status == 404:
            installed = None
        else:
            log.warning("cannot read the CRD %s (%s): its version is not checked", CRD_NAME, exc)
            return ""
    said = mismatch(installed, own)
    if not said:
        log.info("the installed CRD %s is this operator's", CRD_NAME)
        return ""
    log.error("%s", said)
    if namespace:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "rmsft-crd-", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "name": CRD_NAME,
                "namespace": namespace,
            },
            "reason": REASON,
            "message": said[:1024],
            "type": "Warning",
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": "rmsft-operator"},
        }
        try:
            kube.request("POST", f"/api/v1/namespaces/{namespace}/events", event)
        except ApiError as exc:
            log.warning("could not post the %s Event in %s: %s", REASON, namespace, exc)
    return said
