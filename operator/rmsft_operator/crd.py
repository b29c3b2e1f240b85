"""The RolloutMatchingJob CRD, generated from the pydantic model in `rmsft.jobspec`.

Generating it (instead of writing the YAML by hand) keeps one source of truth for field names,
ranges, enums and defaults; CEL rules (crd_rules) cover what the schema cannot say and mirror
`rmsft.jobspec.cross_field_errors` message for message. `python -m rmsft_operator.crd` prints the
YAML that lives in charts/rmsft/crds/ (a test checks the two are identical).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from rmsft.jobspec import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    QUANTITY_PATTERN,
    JobSpec,
)
from rmsft_operator.crd_rules import DURATION_FIELDS, LOCAL_RULES, SPEC_RULES, duration_rule

SHORT_NAMES = ["rmj"]
PHASES = ["Pending", "Starting", "Running", "Complete", "Failed", "Invalid"]
CONDITION_TYPES = [
    "RolloutReady",
    "LearnerRunning",
    "Progressing",
    "Complete",
    "Failed",
    "InvalidSpec",
    "CheckpointsDurable",
]

# Bounds that keep the API server's CEL cost estimate finite (unbounded strings/lists make
# `self == oldSelf` rules "too expensive" and the CRD would be refused).
_MAX_STRING = 1024
_MAX_ITEMS = 64
_MAX_PROPERTIES = 64

# Everything but the rollout pool size is fixed once the job exists: the StatefulSet template,
# the suspended learner Job and the ConfigMap the learner already read cannot change in place.
MUTABLE_SPEC_PATHS = {"rollout.replicas"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = defs[node["$ref"].split("/")[-1]]
            merged = {**_resolve(target, defs), **{k: v for k, v in node.items() if k != "$ref"}}
            return _resolve(merged, defs)
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def _to_openapi(node: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema (pydantic) -> Kubernetes structural OpenAPI v3."""
    node = dict(node)
    if sorted(o.get("type", "") for o in node.get("anyOf", [])) == ["integer", "string"]:
        # int | str (seconds or a duration): Kubernetes' int-or-string, the one union a structural schema has.
        # Its form is checked by a CEL rule (duration_rule), which a plain pattern cannot do for an integer.
        return {**{k: node[k] for k in ("description", "default") if k in node}, "x-kubernetes-int-or-string": True}
    if "anyOf" in node:  # Optional[X] -> X (absent means None)
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express union in a structural schema: {options}")
        default = node.pop("default", None)
        node = {**options[0], **node}
        if default is not None:
            node["default"] = default
    out: dict[str, Any] = {}
    for key in (
        "description",
        "type",
        "enum",
        "default",
        "pattern",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "minItems",
        "maxItems",
        "required",
    ):
        if key in node:
            out[key] = node[key]
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    t = out.get("type")
    if t == "string" and "maxLength" not in out and "enum" not in out:
        out["maxLength"] = _MAX_STRING
    if t == "array":
        out["items"] = _to_openapi(node["items"])
        out.setdefault("maxItems", _MAX_ITEMS)
    if t == "object" and "properties" in node:
        props = {}
        required = set(node.get("required", []))
        for name, sub in node["properties"].items():
            conv = _to_openapi(sub)
            optional_object = "anyOf" in sub
            if conv.get("type") == "object" and name not in required and "default" not in conv and not optional_object:
                # An omitted section gets its nested defaults. Written out in full, not as `{}`:
                # the API server checks every declared default against the schema and its CEL
                # rules exactly as written, without filling in nested defaults first, so `{}`
                # fails any rule that reads a defaulted key (e.g. rollout.port != metricsPort).
                conv["default"] = apply_defaults(conv, {})
            props[name] = conv
        out["properties"] = props
    elif t == "object":
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = _to_openapi(extra)
            out["maxProperties"] = _MAX_PROPERTIES
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _at(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def spec_schema() -> dict[str, Any]:
    raw = JobSpec.model_json_schema(by_alias=True, mode="validation")
    schema = _to_openapi(_resolve({k: v for k, v in raw.items() if k != "$defs"}, raw.get("$defs", {})))
    schema["x-kubernetes-validations"] = copy.deepcopy(SPEC_RULES)
    for path, rules in LOCAL_RULES.items():
        _at(schema, path).setdefault("x-kubernetes-validations", []).extend(copy.deepcopy(rules))
    for field in DURATION_FIELDS:
        _at(schema, field).setdefault("x-kubernetes-validations", []).append(duration_rule(field))
    for path in ("training.data.path", "training.eval.data"):  # the models' `_jsonl` validators
        _at(schema, path)["pattern"] = r"\.jsonl(\.gz)?$"
    for owner in ("rollout", "learner"):
        for kind in ("requests", "limits"):
            _at(schema, f"{owner}.resources.{kind}")["additionalProperties"]["pattern"] = QUANTITY_PATTERN
    for section, sub in schema["properties"].items():
        if section == "rollout":
            for field, fsub in sub["properties"].items():
                if f"rollout.{field}" in MUTABLE_SPEC_PATHS:
                    continue
                _immutable(fsub, f"spec.rollout.{field}")
                if "default" not in fsub:
                    # A field's own transition rule runs only when both old and new values exist,
                    # so adding or removing an optional field needs a rule on its parent.
                    sub.setdefault("x-kubernetes-validations", []).append(
                        {
                            "rule": f"has(self.{field}) == has(oldSelf.{field})",
                            "message": f"spec.rollout.{field} is immutable once the job exists "
                            "(it cannot be added or removed)",
                            "fieldPath": f".{field}",
                        }
                    )
        else:
            _immutable(sub, f"spec.{section}")
    return schema


def _immutable(node: dict[str, Any], where: str) -> None:
    node.setdefault("x-kubernetes-validations", []).append(
        {"rule": "self == oldSelf", "message": f"{where} is immutable once the job exists"}
    )


_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}


def _condition_schema() -> dict[str, Any]:
    """One item of status.conditions."""
    return {
        "type": "object",
        "required": ["type", "status"],
        "description": "One aspect of the job's state.",
        "properties": {
            "type": {
                "type": "string",
                "enum": CONDITION_TYPES,
                "description": "The aspect: " + ", ".join(CONDITION_TYPES) + ".",
            },
            "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "Whether it holds."},
            "reason": {"type": "string", "maxLength": 256, "description": "Why, in one CamelCase word."},
            "message": {"type": "string", "maxLength": 4096, "description": "Why, in words a person can act on."},
            "lastTransitionTime": {"type": "string", "format": "date-time", "description": "When status last changed."},
            "observedGeneration": {
                "type": "integer",
                "minimum": 0,
                "description": "The metadata.generation the condition was set from.",
            },
        },
    }


def status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "What the operator observed, written by the operator.",
        "properties": {
            "phase": {
                "type": "string",
                "enum": PHASES,
                "description": "Pending (no rollout server Ready yet), "
                "Starting (servers coming up, or the learner resumed and its pod not running yet), Running "
                "(learner pod running), Complete (the learner Job succeeded), Failed (the learner Job failed), "
                "Invalid (the spec was refused).",
            },
            "conditions": {
                "type": "array",
                "items": _condition_schema(),
                "maxItems": 16,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "description": "RolloutReady, LearnerRunning, Progressing, Complete, Failed, InvalidSpec and "
                "CheckpointsDurable, each with its reason and message.",
            },
            "observedGeneration": {
                "type": "integer",
                "minimum": 0,
                "description": "The metadata.generation this status was computed from.",
            },
            "rolloutReplicas": {"type": "integer", "minimum": 0, "description": "Rollout servers wanted now."},
            "releasedRolloutReplicas": {
                "type": "integer",
                "minimum": 0,
                "description": "Rollout servers given back mid-run: not Ready for "
                "spec.rollout.startupTimeout (condition RolloutReady, reason "
                "ServerLost).",
            },
            "readyRolloutReplicas": {"type": "integer", "minimum": 0, "description": "Rollout servers Ready."},
            **_learner_status(),
            **_progress_status(),
            "startTime": {
                "type": "string",
                "format": "date-time",
                "description": "When the learner was started (the rollout pool Ready).",
            },
            "lastStepTime": {
                "type": "string",
                "format": "date-time",
                "description": "When the learner's step last moved (spec.learner.stallTimeout counts from it).",
            },
            "completionTime": {
                "type": "string",
                "format": "date-time",
                "description": "When the learner finished, successfully or not.",
            },
            "message": {
                "type": "string",
                "maxLength": 4096,
                "description": "The state in one line: the pool, the learner, or why the job stopped or was refused.",
            },
        },
    }


def _learner_status() -> dict[str, Any]:
    """The learner's attempts and start, in status."""
    return {
        "learnerAttempt": {
            "type": "integer",
            "minimum": 1,
            "description": "spec.learner.nodes > 1: the learner's attempt (1 first); a lost pod "
            "fails the attempt and the next resumes from the newest checkpoint, up "
            "to spec.learner.backoffLimit restarts.",
        },
        "learnerAttemptTime": {
            "type": "string",
            "format": "date-time",
            "description": "spec.learner.nodes > 1: when the last failed attempt's Job was "
            "deleted (a re-created Job that a policy refuses is timed from it).",
        },
        "learnerDisruptions": {
            "type": "integer",
            "minimum": 0,
            "description": "spec.learner.nodes > 1: attempts run again after a disruption "
            "(eviction, drain, preemption), not counted as attempts.",
        },
        "learnerStartTime": {
            "type": "string",
            "format": "date-time",
            "description": "When a learner pod was first seen running: from then on a pod's "
            "trouble is a fault the job survives, not a failed start.",
        },
        "learnerActive": {"type": "integer", "minimum": 0, "description": "Active learner pods."},
    }


def _progress_status() -> dict[str, Any]:
    """The learner's progress, in status: its step, weight version and last evaluation."""
    return {
        "step": {"type": "integer", "minimum": 0, "description": "Optimizer step reported by the learner."},
        "currentStep": {
            "type": "integer",
            "minimum": 0,
            "description": "The step the learner is on now: after a resume it redoes steps below "
            "status.step (the highest reported); spec.learner.stallTimeout reads it.",
        },
        "weightVersion": {
            "type": "integer",
            "minimum": 0,
            "description": "Weight version reported by the learner (it counts weight updates).",
        },
        "evaluation": {
            "type": "object",
            "description": "The learner's last held-out evaluation (spec.training.eval); absent before the first.",
            "properties": {
                "step": {"type": "integer", "minimum": 0, "description": "Optimizer step it was taken at."},
                "f1": {**_FRACTION, "description": "F1 at IoU spec.training.eval.iou (0.5 by default)."},
                "mAP": {**_FRACTION, "description": "COCO bbox mAP@[.50:.95]."},
                "mAP50": {**_FRACTION, "description": "COCO bbox mAP@.50."},
            },
        },
    }


def _printer_columns() -> list[dict[str, Any]]:
    """`kubectl get rmj`'s columns."""
    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {
            "name": "Ready",
            "type": "integer",
            "jsonPath": ".status.readyRolloutReplicas",
            "description": "Rollout servers Ready",
        },
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.rollout.replicas"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
        # Held-out figures: `kubectl get rmj -o wide` (priority 1) keeps the default listing narrow.
        {
            "name": "Eval-F1",
            "type": "number",
            "jsonPath": ".status.evaluation.f1",
            "priority": 1,
            "description": "Held-out F1 at IoU spec.training.eval.iou, last evaluation",
        },
        {
            "name": "Eval-mAP",
            "type": "number",
            "jsonPath": ".status.evaluation.mAP",
            "priority": 1,
            "description": "Held-out COCO bbox mAP@[.50:.95], last evaluation",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def build_crd() -> dict[str, Any]:
    version = {
        "name": API_VERSION,
        "served": True,
        "storage": True,
        "subresources": {"status": {}},
        "additionalPrinterColumns": _printer_columns(),
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "description": "Rollout-matching SFT of a vision-language detection model.",
                "required": ["spec"],
                "properties": {
                    "apiVersion": {"type": "string", "description": f"{API_GROUP}/{API_VERSION}"},
                    "kind": {"type": "string", "description": KIND},
                    # The rule sits on the name itself (not on the root, where the API server
                    # reports the field as `<nil>`); CRDs may restrict only name and generateName, and the API
                    # server refuses anything else on `metadata`, a description included.
                    "metadata": {
                        "type": "object",
                        "properties": {
                            "name": {
                                "type": "string",
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.size() <= 40",
                                        "message": "metadata.name must be at most 40 characters "
                                        "(child names add suffixes)",
                                    }
                                ],
                            }
                        },
                    },
                    "spec": spec_schema(),
                    "status": status_schema(),
                },
            }
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{API_GROUP}",
            "labels": {"app.kubernetes.io/part-of": "rmsft"},
        },
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": SHORT_NAMES,
                "categories": ["rmsft"],
            },
            "versions": [version],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `python -m rmsft_operator.crd` from rmsft/jobspec/: do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=110)


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it (defaults of absent keys, recursively)."""
    if not isinstance(obj, dict) or schema.get("type") != "object":
        if isinstance(obj, list) and "items" in schema:
            return [apply_defaults(schema["items"], v) for v in obj]
        return obj
    out = dict(obj)
    for name, sub in schema.get("properties", {}).items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_defaults(sub, out[name])
    return out


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
