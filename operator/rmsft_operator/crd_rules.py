"""The CRD's CEL rules: what the schema generated from rmsft.jobspec cannot say, each mirroring
`rmsft.jobspec.cross_field_errors` (or a field validator) message for message. Every rule has a case of its own in
tests/operator/test_operator_cel_rules.py that makes it fire."""

from __future__ import annotations

from rmsft.jobspec import (
    COLOCATE_REPLICAS,
    COLOCATE_SLEEP_ZERO3,
    COLOCATE_STALENESS,
    DURATION_PATTERN,
    LOGITS_FUSED_CPU,
    LOGITS_FUSED_ZERO3,
    RECIPE_EXPLORERS_STALENESS,
    RECIPE_SECOND_ONLY,
    REPORT_TO_TWICE,
    TLS_COLOCATE,
    TLS_HEALTH_PORT,
    RecipeConfig,
)
from rmsft.jobspec.grpo import CORRECTION_NONE_BOUNDS, CORRECTION_TIS_LOW, OVERLONG_BUFFER
from rmsft.jobspec.pods import _LABEL_VALUE, _QUALIFIED_KEY, KUEUE_QUEUE_LABEL, RESERVED_KEY_PREFIXES
from rmsft.jobspec.training import INFLIGHT_STALENESS, TRAIN_COORD_ROWS_QWEN_JSON

# GPUs of the rollout pool: none with colocate (the engine shares the learner's); replicas unset = 1 server.
_POOL_GPUS = (
    "(self.rollout.mode == 'colocate' ? 0 : (has(self.rollout.replicas) ? self.rollout.replicas : 1) "
    "* self.rollout.tensorParallelSize)"
)
_COLOCATE = "self.rollout.mode != 'colocate' || "
# training.loss.logits other than fused (its default is auto): rmsft.jobspec.job's LOGITS_FUSED_* rules.
_NOT_FUSED = "!has(self.training.loss) || !has(self.training.loss.logits) || self.training.loss.logits != 'fused' || "

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
        {
            "rule": "self.mode != 'colocate' || !has(self.replicas) || self.replicas == 0",
            "message": COLOCATE_REPLICAS,
            "fieldPath": ".replicas",
        },
        {"rule": "self.mode != 'colocate' || !has(self.tls)", "message": TLS_COLOCATE, "fieldPath": ".tls"},
        {
            "rule": "!has(self.tls) || (self.tls.healthPort != self.port && self.tls.healthPort != self.metricsPort)",
            "message": TLS_HEALTH_PORT,
            "fieldPath": ".tls.healthPort",
        },
    ],
    "training.rollout": [
        {"rule": "!self.inflight || self.max_staleness >= 1", "message": INFLIGHT_STALENESS, "fieldPath": ".inflight"},
    ],
    "training.grpo": [
        {
            "rule": "self.correction != 'none' || (!has(self.correction_low) && !has(self.correction_high))",
            "message": CORRECTION_NONE_BOUNDS,
            "fieldPath": ".correction",
        },
        {
            "rule": "self.correction != 'tis' || !has(self.correction_low)",
            "message": CORRECTION_TIS_LOW,
            "fieldPath": ".correction_low",
        },
        {
            "rule": "!has(self.overlong_buffer) || self.overlong_buffer < self.max_tokens",
            "message": OVERLONG_BUFFER,
            "fieldPath": ".overlong_buffer",
        },
    ],
    "training": [
        {"rule": "self.warmup_steps <= self.steps", "message": "spec.training.warmup_steps exceeds steps"},
        {
            "rule": "!has(self.report_to) || self.report_to.all(t, self.report_to.exists_one(u, u == t))",
            "message": REPORT_TO_TWICE,
            "fieldPath": ".report_to",
        },
        *(
            {
                "rule": f"self.recipe.generation == 2 || !has(self.recipe.{name})",
                "message": RECIPE_SECOND_ONLY.format(name=name),
            }
            for name in RecipeConfig.SECOND_ONLY
        ),
        {
            "rule": "!has(self.recipe.explorers) || self.recipe.explorers.count == 0 "
            "|| self.rollout.max_staleness == 0",
            "message": RECIPE_EXPLORERS_STALENESS,
        },
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
        *(
            {
                "rule": f"!has(self.{field}) || self.{field}.all(k, "
                + " && ".join(f"!k.startsWith('{pre}')" for pre in RESERVED_KEY_PREFIXES)
                + ")",
                "message": f"spec.scheduling.{field}: keys under {', '.join(RESERVED_KEY_PREFIXES)} "
                "are rmsft's own (the operator sets them on its pods)",
                "fieldPath": f".{field}",
            }
            for field in ("podLabels", "podAnnotations")
        ),
        *(
            {
                "rule": f"!has(self.{field}) || self.{field}.all(k, k.size() <= 253 && k.matches('{_QUALIFIED_KEY}'))",
                "message": f"spec.scheduling.{field}: a key is not a Kubernetes qualified name (prefix/name)",
                "fieldPath": f".{field}",
            }
            for field in ("podLabels", "podAnnotations")
        ),
        {
            "rule": "!has(self.podLabels) || self.podLabels.all(k, self.podLabels[k].size() <= 63 && "
            f"self.podLabels[k].matches('{_LABEL_VALUE}'))",
            "message": "spec.scheduling.podLabels: a value is not a label value (<= 63 chars: letters, digits, -_. "
            "inside)",
            "fieldPath": ".podLabels",
        },
        {
            "rule": f"!has(self.podLabels) || !('{KUEUE_QUEUE_LABEL}' in self.podLabels)",
            "message": f"spec.scheduling.podLabels: {KUEUE_QUEUE_LABEL} goes on the job's workloads, not its pods: set "
            "spec.scheduling.queueName",
            "fieldPath": ".podLabels",
        },
        {
            "rule": f"!has(self.learnerTopologyKey) || self.learnerTopologyKey.matches('{_QUALIFIED_KEY}')",
            "message": "spec.scheduling.learnerTopologyKey is not a node label key",
            "fieldPath": ".learnerTopologyKey",
        },
    ],
    "model.vision": [
        {
            "rule": "!(has(self.minPixels) && has(self.maxPixels)) || self.minPixels <= self.maxPixels",
            "message": "spec.model.vision: minPixels exceeds maxPixels",
        }
    ],
}
