"""The RolloutMatchingJob CRD, generated from the pydantic model in `rmsft.jobspec`.

Generating it (instead of writing the YAML by hand) keeps one source of truth for field names,
ranges, enums and defaults; CEL rules below cover what the schema cannot say and mirror
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
    COLOCATE_REPLICAS,
    COLOCATE_SLEEP_ZERO3,
    COLOCATE_STALENESS,
    DURATION_PATTERN,
    KIND,
    LOGITS_FUSED_CPU,
    LOGITS_FUSED_ZERO3,
    PLURAL,
    QUANTITY_PATTERN,
    RECIPE_EXPLORERS_STALENESS,
    RECIPE_SECOND_ONLY,
    REPORT_TO_TWICE,
    TLS_COLOCATE,
    TLS_HEALTH_PORT,
    JobSpec,
    RecipeConfig,
)
from rmsft.jobspec.grpo import CORRECTION_NONE_BOUNDS, CORRECTION_TIS_LOW, OVERLONG_BUFFER
from rmsft.jobspec.pods import _LABEL_VALUE, _QUALIFIED_KEY, KUEUE_QUEUE_LABEL, RESERVED_KEY_PREFIXES
from rmsft.jobspec.training import INFLIGHT_STALENESS, TRAIN_COORD_ROWS_QWEN_JSON

SHORT_NAMES = ["rmj"]
PHASES = ["Pending", "Starting", "Running", "Complete", "Failed", "Invalid"]
CONDITION_TYPES = ["RolloutReady", "LearnerRunning", "Progressing", "Complete", "Failed", "InvalidSpec",
                   "CheckpointsDurable"]

# Bounds that keep the API server's CEL cost estimate finite (unbounded strings/lists make
# `self == oldSelf` rules "too expensive" and the CRD would be refused).
_MAX_STRING = 1024
_MAX_ITEMS = 64
_MAX_PROPERTIES = 64

# GPUs of the rollout pool: none with colocate (the engine shares the learner's); replicas unset = 1 server.
_POOL_GPUS = ("(self.rollout.mode == 'colocate' ? 0 : (has(self.rollout.replicas) ? self.rollout.replicas : 1) "
              "* self.rollout.tensorParallelSize)")
_COLOCATE = "self.rollout.mode != 'colocate' || "
# training.loss.logits other than fused (its default is auto): rmsft.jobspec.job's LOGITS_FUSED_* rules.
_NOT_FUSED = ("!has(self.training.loss) || !has(self.training.loss.logits) || self.training.loss.logits != 'fused' "
              "|| ")

# spec.rollout.startupTimeout and recoveryTimeout as rmsft.jobspec.duration_seconds reads them: seconds >= 1, or a
# duration of hours/minutes/seconds that is not all zeros. The length bound keeps the rule's cost estimate finite.
DURATION_FIELDS = ("rollout.startupTimeout", "rollout.recoveryTimeout", "learner.stallTimeout")


def duration_rule(field: str) -> dict[str, str]:
    return {
        "rule": "type(self) == int ? self >= 1 : (self.size() <= 32 && "
        f"(self.matches('^[0-9]+$') || (self != '' && self.matches('{DURATION_PATTERN}'))) && self.matches('[1-9]'))",
        "message": f"spec.{field} must be seconds (>= 1) or a duration such as 30m, 1h30m or 90s",
    }


# Cross-field rules on `spec` (same text as rmsft.jobspec.cross_field_errors).
SPEC_RULES: list[dict[str, str]] = [
    {
        # The one-node budget binds shm only (host memory is one node's); over grpc or nccl the pool
        # and the learner may span nodes, and the rules below keep each pod within one.
        "rule": "self.sync.transport != 'shm' || self.placement.accelerator == 'none' || "
        f"{_POOL_GPUS} + self.learner.gpus <= self.placement.gpusPerNode",
        "message": "spec.sync.transport 'shm' needs the learner and the whole pool on one node: "
        "spec.rollout.replicas * spec.rollout.tensorParallelSize + spec.learner.gpus "
        "must be <= spec.placement.gpusPerNode",
        "fieldPath": ".sync.transport",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.placement.accelerator != 'nvidia' || !has(self.learner.ranksPerPod) "
        "|| self.learner.ranksPerPod == self.learner.gpus",
        "message": "spec.learner.ranksPerPod must equal spec.learner.gpus when spec.placement.accelerator is "
        "'nvidia' (one rank per GPU; leave it unset)",
        "fieldPath": ".learner.ranksPerPod",
    },
    {
        "rule": "self.placement.accelerator != 'nvidia' || self.learner.gpus <= self.placement.gpusPerNode",
        "message": "spec.learner.gpus must be <= spec.placement.gpusPerNode: a learner pod is on one node (with "
        "spec.learner.nodes > 1 it counts GPUs per learner pod)",
        "fieldPath": ".learner.gpus",
    },
    {
        "rule": "self.learner.nodes > 1 || !has(self.scheduling) || !has(self.scheduling.learnerTopologyKey)",
        "message": "spec.scheduling.learnerTopologyKey applies to spec.learner.nodes > 1 (the learner's pods meeting "
        "in one topology domain)",
        "fieldPath": ".scheduling.learnerTopologyKey",
    },
    {
        "rule": "self.learner.nodes == 1 || self.rollout.mode != 'colocate'",
        "message": "spec.learner.nodes > 1 is not available with spec.rollout.mode 'colocate' yet (one learner pod "
        "holds the engines); use server mode",
        "fieldPath": ".learner.nodes",
    },
    {
        "rule": "self.learner.nodes == 1 || self.sync.transport != 'shm'",
        "message": "spec.sync.transport 'shm' cannot reach learner pods on several nodes (host memory is one "
        "node's): with spec.learner.nodes > 1 use grpc or auto",
        "fieldPath": ".sync.transport",
    },
    {
        "rule": "self.learner.nodes == 1 || has(self.learner.checkpointClaim)",
        "message": "spec.learner.nodes > 1 needs spec.learner.checkpointClaim: every learner pod saves its share "
        "of a checkpoint into one folder and resumes from it (a ReadWriteMany claim across nodes)",
        "fieldPath": ".learner.checkpointClaim",
    },
    {
        "rule": _NOT_FUSED + "self.placement.accelerator != 'none'",
        "message": LOGITS_FUSED_CPU,
        "fieldPath": ".training.loss.logits",
    },
    {
        "rule": _NOT_FUSED + "self.training.deepspeed_stage != 3",
        "message": LOGITS_FUSED_ZERO3,
        "fieldPath": ".training.loss.logits",
    },
    {
        "rule": "self.placement.accelerator != 'none' || self.learner.gpus == 0",
        "message": "spec.learner.gpus must be 0 when spec.placement.accelerator is 'none'",
        "fieldPath": ".learner.gpus",
    },
    {
        "rule": "self.sync.transport != 'nccl' || self.sync.mode == 'full'",
        "message": "spec.sync.transport 'nccl' carries full weights: spec.sync.mode must be 'full' (adapters go "
        "over grpc)",
        "fieldPath": ".sync.mode",
    },
    {
        "rule": "self.placement.accelerator != 'nvidia' "
        "|| self.rollout.tensorParallelSize <= self.placement.gpusPerNode",
        "message": "spec.rollout.tensorParallelSize must be <= spec.placement.gpusPerNode: a server is one pod",
        "fieldPath": ".rollout.tensorParallelSize",
    },
    {
        "rule": "self.sync.mode != 'adapter' || self.rollout.enableLora",
        "message": "spec.sync.mode 'adapter' requires spec.rollout.enableLora: true",
        "fieldPath": ".sync.mode",
    },
    {
        "rule": "self.sync.mode != 'adapter' || self.training.finetune == 'lora'",
        "message": "spec.sync.mode 'adapter' requires spec.training.finetune: lora",
        "fieldPath": ".sync.mode",
    },
    {
        "rule": "self.sync.mode != 'adapter' || !self.training.lora.use_dora",
        "message": "spec.sync.mode 'adapter' cannot serve DoRA (spec.training.lora.use_dora); use full",
        "fieldPath": ".sync.mode",
    },
    {
        "rule": "!self.rollout.enableLora || self.training.lora.r <= self.rollout.maxLoraRank",
        "message": "spec.training.lora.r must be <= spec.rollout.maxLoraRank",
        "fieldPath": ".training.lora.r",
    },
    {
        "rule": "self.training.rollout.max_tokens < self.rollout.maxModelLen",
        "message": "spec.training.rollout.max_tokens must be < spec.rollout.maxModelLen",
        "fieldPath": ".training.rollout.max_tokens",
    },
    # spec.trainer: grpo (rmsft.jobspec.grpo_errors)
    {
        "rule": "self.trainer != 'grpo' || self.training.grpo.max_tokens < self.rollout.maxModelLen",
        "message": "spec.training.grpo.max_tokens must be < spec.rollout.maxModelLen",
        "fieldPath": ".training.grpo.max_tokens",
    },
    {
        "rule": "self.trainer != 'grpo' || !self.training.buffer.enabled || self.training.buffer.m_steps <= 1",
        "message": "spec.training.buffer.m_steps > 1 is not supported by spec.trainer 'grpo': every step samples "
        "fresh groups from the learner's current weights (disable the buffer or set m_steps: 1)",
        "fieldPath": ".training.buffer.m_steps",
    },
    {
        "rule": "self.trainer != 'grpo' || self.training.warm_start_steps == 0",
        "message": "spec.training.warm_start_steps applies to spec.trainer 'rollout_matching' only (GRPO has no "
        "ground-truth targets to warm start on)",
        "fieldPath": ".training.warm_start_steps",
    },
    {
        "rule": "self.trainer != 'grpo' || self.training.grad_accumulation == 1",
        "message": "spec.training.grad_accumulation must be 1 with spec.trainer 'grpo': a step trains on every "
        "completion it sampled, in as many packed rows as they fill",
        "fieldPath": ".training.grad_accumulation",
    },
    {
        "rule": "self.trainer != 'grpo' || self.training.grpo.kl_coef <= 0.0 || self.training.finetune == 'lora'",
        "message": "spec.training.grpo.kl_coef > 0 needs spec.training.finetune: lora (the reference policy is the "
        "base weights, the adapters disabled); with finetune: full set kl_coef: 0",
        "fieldPath": ".training.grpo.kl_coef",
    },
    {
        "rule": "self.trainer != 'grpo' || (self.training.rollout.top_p == 1.0 && self.training.rollout.top_k <= 0 "
        "&& (!has(self.training.rollout.repetition_penalty) || self.training.rollout.repetition_penalty == 1.0))",
        "message": "spec.training.rollout.top_p, top_k and repetition_penalty must stay off with spec.trainer "
        "'grpo' (it samples at spec.training.grpo.temperature alone, so that the learner's log-probs are those "
        "of the distribution sampled from)",
        "fieldPath": ".training.rollout",
    },
    # spec.rollout.mode: colocate (rmsft.jobspec.colocate_errors)
    {
        "rule": _COLOCATE + "self.placement.accelerator != 'none' || self.rollout.colocate.tensorParallelSize == 1",
        "message": "spec.rollout.colocate.tensorParallelSize must be 1 when spec.placement.accelerator is 'none' "
        "(vLLM's CPU backend runs TP > 1 in worker processes of its own, not in the learner's)",
        "fieldPath": ".rollout.colocate.tensorParallelSize",
    },
    {
        "rule": _COLOCATE + "self.placement.accelerator == 'none' || (self.learner.gpus >= 1 && "
        "self.learner.gpus % self.rollout.colocate.tensorParallelSize == 0)",
        "message": "spec.rollout.colocate.tensorParallelSize must divide spec.learner.gpus: the learner's ranks "
        "form whole TP groups",
        "fieldPath": ".rollout.colocate.tensorParallelSize",
    },
    {
        "rule": _COLOCATE + "self.rollout.colocate.sleepLevel == 0 || (self.placement.accelerator == 'nvidia' && "
        "self.rollout.engine == 'vllm')",
        "message": "spec.rollout.colocate.sleepLevel > 0 needs spec.placement.accelerator 'nvidia' and "
        "spec.rollout.engine 'vllm' (vLLM's sleep mode is CUDA's; the CPU backend has none)",
        "fieldPath": ".rollout.colocate.sleepLevel",
    },
    {
        "rule": _COLOCATE + "self.rollout.colocate.sleepLevel == 0 || self.training.deepspeed_stage != 3",
        "message": COLOCATE_SLEEP_ZERO3,
        "fieldPath": ".rollout.colocate.sleepLevel",
    },
    {
        "rule": _COLOCATE + "self.placement.accelerator != 'none' || (!self.rollout.colocate.offloadModel && "
        "!self.rollout.colocate.offloadOptimizer)",
        "message": "spec.rollout.colocate.offloadModel and offloadOptimizer move training state off the GPUs; "
        "with spec.placement.accelerator 'none' there is nothing to move (set them false)",
        "fieldPath": ".rollout.colocate",
    },
    {
        "rule": _COLOCATE + "self.rollout.engine != 'hf' || self.rollout.colocate.tensorParallelSize == 1",
        "message": "spec.rollout.colocate.tensorParallelSize must be 1 with spec.rollout.engine 'hf' (the HF "
        "engine is the training model itself)",
        "fieldPath": ".rollout.colocate.tensorParallelSize",
    },
    {
        "rule": _COLOCATE + "self.sync.mode != 'adapter'",
        "message": "spec.sync.mode 'adapter' is not available with spec.rollout.mode 'colocate': the in-process "
        "engine takes merged weights (use full or auto)",
        "fieldPath": ".sync.mode",
    },
    {
        "rule": _COLOCATE + "self.sync.transport == 'auto'",
        "message": "spec.sync.transport must stay 'auto' with spec.rollout.mode 'colocate': weights go straight "
        "into the in-process engine, with no transport",
        "fieldPath": ".sync.transport",
    },
    {
        "rule": _COLOCATE + "self.training.rollout.max_staleness == 0",
        "message": COLOCATE_STALENESS,
        "fieldPath": ".training.rollout.max_staleness",
    },
]

# Rules local to one object: {dotted path under spec: [rules]}.
LOCAL_RULES: dict[str, list[dict[str, str]]] = {
    "model.volume": [
        {
            "rule": "!(has(self.claimName) && has(self.hostPath))",
            "message": "spec.model.volume: set only one of claimName and hostPath",
        }
    ],
    "rollout": [
        {"rule": "self.port != self.metricsPort", "message": "spec.rollout.port and metricsPort must differ"},
        {"rule": "self.mode != 'colocate' || !has(self.replicas) || self.replicas == 0",
         "message": COLOCATE_REPLICAS, "fieldPath": ".replicas"},
        {"rule": "self.mode != 'colocate' || !has(self.tls)", "message": TLS_COLOCATE, "fieldPath": ".tls"},
        {"rule": "!has(self.tls) || (self.tls.healthPort != self.port && self.tls.healthPort != self.metricsPort)",
         "message": TLS_HEALTH_PORT, "fieldPath": ".tls.healthPort"},
    ],
    "training.rollout": [
        {"rule": "!self.inflight || self.max_staleness >= 1", "message": INFLIGHT_STALENESS,
         "fieldPath": ".inflight"},
    ],
    "training.grpo": [
        {"rule": "self.correction != 'none' || (!has(self.correction_low) && !has(self.correction_high))",
         "message": CORRECTION_NONE_BOUNDS, "fieldPath": ".correction"},
        {"rule": "self.correction != 'tis' || !has(self.correction_low)", "message": CORRECTION_TIS_LOW,
         "fieldPath": ".correction_low"},
        {"rule": "!has(self.overlong_buffer) || self.overlong_buffer < self.max_tokens", "message": OVERLONG_BUFFER,
         "fieldPath": ".overlong_buffer"},
    ],
    "training": [
        {"rule": "self.warmup_steps <= self.steps", "message": "spec.training.warmup_steps exceeds steps"},
        {"rule": "!has(self.report_to) || self.report_to.all(t, self.report_to.exists_one(u, u == t))",
         "message": REPORT_TO_TWICE, "fieldPath": ".report_to"},
        *({"rule": f"self.recipe.generation == 2 || !has(self.recipe.{name})",
           "message": RECIPE_SECOND_ONLY.format(name=name)} for name in RecipeConfig.SECOND_ONLY),
        {"rule": "!has(self.recipe.explorers) || self.recipe.explorers.count == 0 "
                 "|| self.rollout.max_staleness == 0", "message": RECIPE_EXPLORERS_STALENESS},
        {
            "rule": "(has(self.format) && self.format == 'qwen_json') || !has(self.format_options) "
            "|| !has(self.format_options.coordinates) || self.format_options.coordinates == 'relative'",
            "message": "spec.training.format_options.coordinates applies to format qwen_json only",
        },
        {
            "rule": "!has(self.format) || self.format != 'qwen_json' || !has(self.lora) "
            "|| !has(self.lora.coord_rows) || !self.lora.coord_rows",
            "message": TRAIN_COORD_ROWS_QWEN_JSON,
        },
        {
            "rule": "!has(self.format) || self.format == 'coordexp' || !has(self.format_options) "
            "|| !has(self.format_options.polygons) || self.format_options.polygons == 'pairs'",
            "message": "spec.training.format_options.polygons applies to format coordexp only",
        },
    ],
    "scheduling": [
        *({"rule": f"!has(self.{field}) || self.{field}.all(k, "
                   + " && ".join(f"!k.startsWith('{pre}')" for pre in RESERVED_KEY_PREFIXES) + ")",
           "message": f"spec.scheduling.{field}: keys under {', '.join(RESERVED_KEY_PREFIXES)} are rmsft's own (the "
                      "operator sets them on its pods)", "fieldPath": f".{field}"}
          for field in ("podLabels", "podAnnotations")),
        *({"rule": f"!has(self.{field}) || self.{field}.all(k, k.size() <= 253 && k.matches('{_QUALIFIED_KEY}'))",
           "message": f"spec.scheduling.{field}: a key is not a Kubernetes qualified name (prefix/name)",
           "fieldPath": f".{field}"} for field in ("podLabels", "podAnnotations")),
        {"rule": "!has(self.podLabels) || self.podLabels.all(k, self.podLabels[k].size() <= 63 && "
                 f"self.podLabels[k].matches('{_LABEL_VALUE}'))",
         "message": "spec.scheduling.podLabels: a value is not a label value (<= 63 chars: letters, digits, -_. "
                    "inside)", "fieldPath": ".podLabels"},
        {"rule": f"!has(self.podLabels) || !('{KUEUE_QUEUE_LABEL}' in self.podLabels)",
         "message": f"spec.scheduling.podLabels: {KUEUE_QUEUE_LABEL} goes on the job's workloads, not its pods: set "
                    "spec.scheduling.queueName", "fieldPath": ".podLabels"},
        {"rule": f"!has(self.learnerTopologyKey) || self.learnerTopologyKey.matches('{_QUALIFIED_KEY}')",
         "message": "spec.scheduling.learnerTopologyKey is not a node label key", "fieldPath": ".learnerTopologyKey"},
    ],
    "model.vision": [
        {
            "rule": "!(has(self.minPixels) && has(self.maxPixels)) || self.minPixels <= self.maxPixels",
            "message": "spec.model.vision: minPixels exceeds maxPixels",
        }
    ],
}

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
        return {**{k: node[k] for k in ("description", "default") if k in node},
                "x-kubernetes-int-or-string": True}
    if "anyOf" in node:  # Optional[X] -> X (absent means None)
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express union in a structural schema: {options}")
        default = node.pop("default", None)
        node = {**options[0], **node}
        if default is not None:
            node["default"] = default
    out: dict[str, Any] = {}
    for key in ("description", "type", "enum", "default", "pattern", "minLength", "maxLength",
                "minimum", "maximum", "minItems", "maxItems", "required"):
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
            if conv.get("type") == "object" and name not in required and "default" not in conv \
                    and not optional_object:
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
                    sub.setdefault("x-kubernetes-validations", []).append({
                        "rule": f"has(self.{field}) == has(oldSelf.{field})",
                        "message": f"spec.rollout.{field} is immutable once the job exists "
                                   "(it cannot be added or removed)",
                        "fieldPath": f".{field}",
                    })
        else:
            _immutable(sub, f"spec.{section}")
    return schema


def _immutable(node: dict[str, Any], where: str) -> None:
    node.setdefault("x-kubernetes-validations", []).append(
        {"rule": "self == oldSelf", "message": f"{where} is immutable once the job exists"}
    )


_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}


def status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "description": "One aspect of the job's state.",
        "properties": {
            "type": {"type": "string", "enum": CONDITION_TYPES, "description": "The aspect: " + ", ".join(
                CONDITION_TYPES) + "."},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "Whether it holds."},
            "reason": {"type": "string", "maxLength": 256, "description": "Why, in one CamelCase word."},
            "message": {"type": "string", "maxLength": 4096, "description": "Why, in words a person can act on."},
            "lastTransitionTime": {"type": "string", "format": "date-time",
                                   "description": "When status last changed."},
            "observedGeneration": {"type": "integer", "minimum": 0,
                                   "description": "The metadata.generation the condition was set from."},
        },
    }
    return {
        "type": "object",
        "description": "What the operator observed, written by the operator.",
        "properties": {
            "phase": {"type": "string", "enum": PHASES, "description": "Pending (no rollout server Ready yet), "
                      "Starting (servers coming up, or the learner resumed and its pod not running yet), Running "
                      "(learner pod running), Complete (the learner Job succeeded), Failed (the learner Job failed), "
                      "Invalid (the spec was refused)."},
            "conditions": {
                "type": "array", "items": condition, "maxItems": 16,
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
                "description": "RolloutReady, LearnerRunning, Progressing, Complete, Failed, InvalidSpec and "
                "CheckpointsDurable, each with its reason and message.",
            },
            "observedGeneration": {"type": "integer", "minimum": 0,
                                   "description": "The metadata.generation this status was computed from."},
            "rolloutReplicas": {"type": "integer", "minimum": 0, "description": "Rollout servers wanted now."},
            "releasedRolloutReplicas": {"type": "integer", "minimum": 0,
                                        "description": "Rollout servers given back mid-run: not Ready for "
                                                       "spec.rollout.startupTimeout (condition RolloutReady, reason "
                                                       "ServerLost)."},
            "readyRolloutReplicas": {"type": "integer", "minimum": 0, "description": "Rollout servers Ready."},
            "learnerAttempt": {"type": "integer", "minimum": 1,
                               "description": "spec.learner.nodes > 1: the learner's attempt (1 first); a lost pod "
                                              "fails the attempt and the next resumes from the newest checkpoint, up "
                                              "to spec.learner.backoffLimit restarts."},
            "learnerAttemptTime": {"type": "string", "format": "date-time",
                                   "description": "spec.learner.nodes > 1: when the last failed attempt's Job was "
                                                  "deleted (a re-created Job that a policy refuses is timed from it)."},
            "learnerDisruptions": {"type": "integer", "minimum": 0,
                                   "description": "spec.learner.nodes > 1: attempts run again after a disruption "
                                                  "(eviction, drain, preemption), not counted as attempts."},
            "learnerStartTime": {"type": "string", "format": "date-time",
                                 "description": "When a learner pod was first seen running: from then on a pod's "
                                                "trouble is a fault the job survives, not a failed start."},
            "learnerActive": {"type": "integer", "minimum": 0, "description": "Active learner pods."},
            "step": {"type": "integer", "minimum": 0, "description": "Optimizer step reported by the learner."},
            "currentStep": {"type": "integer", "minimum": 0,
                            "description": "The step the learner is on now: after a resume it redoes steps below "
                                           "status.step (the highest reported); spec.learner.stallTimeout reads it."},
            "weightVersion": {"type": "integer", "minimum": 0,
                              "description": "Weight version reported by the learner (it counts weight updates)."},
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
            "startTime": {"type": "string", "format": "date-time",
                          "description": "When the learner was started (the rollout pool Ready)."},
            "lastStepTime": {"type": "string", "format": "date-time",
                             "description": "When the learner's step last moved (spec.learner.stallTimeout counts from "
                                            "it)."},
            "completionTime": {"type": "string", "format": "date-time",
                               "description": "When the learner finished, successfully or not."},
            "message": {"type": "string", "maxLength": 4096, "description": "The state in one line: the pool, the "
                        "learner, or why the job stopped or was refused."},
        },
    }


def build_crd() -> dict[str, Any]:
    version = {
        "name": API_VERSION,
        "served": True,
        "storage": True,
        "subresources": {"status": {}},
        "additionalPrinterColumns": [
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyRolloutReplicas",
             "description": "Rollout servers Ready"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.rollout.replicas"},
            {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
            # Held-out figures: `kubectl get rmj -o wide` (priority 1) keeps the default listing narrow.
            {"name": "Eval-F1", "type": "number", "jsonPath": ".status.evaluation.f1", "priority": 1,
             "description": "Held-out F1 at IoU spec.training.eval.iou, last evaluation"},
            {"name": "Eval-mAP", "type": "number", "jsonPath": ".status.evaluation.mAP", "priority": 1,
             "description": "Held-out COCO bbox mAP@[.50:.95], last evaluation"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
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
                    "metadata": {"type": "object", "properties": {"name": {
                        "type": "string",
                        "x-kubernetes-validations": [{
                            "rule": "self.size() <= 40",
                            "message": "metadata.name must be at most 40 characters (child names add suffixes)",
                        }],
                    }}},
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
