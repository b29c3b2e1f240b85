"""Every CEL rule of the CRD fires on an invalid case of its own (issue 65): for each rule in the generated schema
there is one edit of configs/job.yaml (and, for a transition rule, the object it updates) under which that rule,
and no other, refuses the job. A new rule without its case fails here, naming it; a rule that could never fire (a
typo in a field name reads as "no such key" or as always true) fails its case.

The edits go through the same offline admission as tests/operator/test_operator_crd.py (crd_admission: defaults,
the schema, then every rule with cel-python), so a case the schema refuses first does not count as the rule's."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_admission import every_rule, failed_rules

ROOT = Path(__file__).resolve().parents[2]
_DELETE = object()


def _base() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "configs/job.yaml").read_text())


def _edited(edits: dict[str, Any], doc: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = copy.deepcopy(doc if doc is not None else _base())
    for dotted, value in edits.items():
        node = doc
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return doc


# configs/job.yaml is an 8-GPU node, 6 servers over shm, a 2-GPU LoRA (DoRA) learner. These turn it into the
# other shapes a rule needs.
_GRPO = {"spec.trainer": "grpo", "spec.training.rollout.top_p": 1.0, "spec.training.rollout.repetition_penalty": 1.0}
_COLOCATE = {"spec.rollout.mode": "colocate", "spec.rollout.replicas": _DELETE, "spec.sync.transport": "auto"}
_CPU = {"spec.placement.accelerator": "none", "spec.learner.gpus": 0}
_GRPC = {"spec.sync.transport": "grpc"}
_GEN1 = {"spec.training.recipe": {"generation": 1}}

# (schema path, the start of the rule's message, edits, edits of the old object for a transition rule or None)
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any] | None]] = [
    ("metadata.name", "metadata.name must be at most 40", {"metadata.name": "x" * 41}, None),
    # spec: rules across sections
    ("spec", "spec.sync.transport 'shm' needs the learner", {"spec.rollout.replicas": 7}, None),
    ("spec", "spec.learner.ranksPerPod must equal", {"spec.learner.ranksPerPod": 3}, None),
    ("spec", "spec.learner.gpus must be <= spec.placement.gpusPerNode", {**_GRPC, "spec.learner.gpus": 9}, None),
    (
        "spec",
        "spec.scheduling.learnerTopologyKey applies",
        {"spec.scheduling.learnerTopologyKey": "topology.kubernetes.io/zone"},
        None,
    ),
    (
        "spec",
        "spec.learner.nodes > 1 is not available with spec.rollout.mode",
        {**_COLOCATE, "spec.learner.nodes": 2},
        None,
    ),
    ("spec", "spec.sync.transport 'shm' cannot reach learner pods", {"spec.learner.nodes": 2}, None),
    (
        "spec",
        "spec.learner.nodes > 1 needs spec.learner.checkpointClaim",
        {**_GRPC, "spec.learner.nodes": 2, "spec.learner.checkpointClaim": _DELETE},
        None,
    ),
    ("spec", "spec.learner.gpus must be 0 when", {"spec.placement.accelerator": "none"}, None),
    (
        "spec",
        "spec.training.loss.logits 'fused' needs spec.placement.accelerator",
        {**_CPU, "spec.training.loss": {"logits": "fused"}},
        None,
    ),
    (
        "spec",
        "spec.training.loss.logits 'fused' cannot run under",
        {"spec.training.loss": {"logits": "fused"}, "spec.training.deepspeed_stage": 3},
        None,
    ),
    (
        "spec",
        "spec.sync.transport 'nccl' carries full weights",
        {"spec.sync.transport": "nccl", "spec.sync.mode": "auto"},
        None,
    ),
    (
        "spec",
        "spec.rollout.tensorParallelSize must be <= spec.placement.gpusPerNode",
        {**_GRPC, "spec.rollout.replicas": 1, "spec.rollout.tensorParallelSize": 16},
        None,
    ),
    (
        "spec",
        "spec.sync.mode 'adapter' requires spec.rollout.enableLora",
        {"spec.sync.mode": "adapter", "spec.training.lora.use_dora": False},
        None,
    ),
    (
        "spec",
        "spec.sync.mode 'adapter' requires spec.training.finetune",
        {
            "spec.sync.mode": "adapter",
            "spec.rollout.enableLora": True,
            "spec.training.lora.use_dora": False,
            "spec.training.finetune": "full",
        },
        None,
    ),
    (
        "spec",
        "spec.sync.mode 'adapter' cannot serve DoRA",
        {"spec.sync.mode": "adapter", "spec.rollout.enableLora": True},
        None,
    ),
    (
        "spec",
        "spec.training.lora.r must be <= spec.rollout.maxLoraRank",
        {"spec.rollout.enableLora": True, "spec.rollout.maxLoraRank": 16},
        None,
    ),
    ("spec", "spec.training.rollout.max_tokens must be <", {"spec.training.rollout.max_tokens": 8192}, None),
    ("spec", "spec.training.grpo.max_tokens must be <", {**_GRPO, "spec.training.grpo.max_tokens": 8192}, None),
    (
        "spec",
        "spec.training.buffer.m_steps > 1 is not supported",
        {**_GRPO, "spec.training.buffer": {"enabled": True, "m_steps": 2}},
        None,
    ),
    ("spec", "spec.training.warm_start_steps applies", {**_GRPO, "spec.training.warm_start_steps": 10}, None),
    ("spec", "spec.training.grad_accumulation must be 1", {**_GRPO, "spec.training.grad_accumulation": 2}, None),
    (
        "spec",
        "spec.training.grpo.kl_coef > 0 needs",
        {**_GRPO, "spec.training.grpo.kl_coef": 0.1, "spec.training.finetune": "full"},
        None,
    ),
    ("spec", "spec.training.rollout.top_p, top_k and repetition_penalty", {"spec.trainer": "grpo"}, None),
    (
        "spec",
        "spec.rollout.colocate.tensorParallelSize must be 1 when",
        {**_COLOCATE, **_CPU, "spec.rollout.colocate.tensorParallelSize": 2},
        None,
    ),
    (
        "spec",
        "spec.rollout.colocate.tensorParallelSize must divide",
        {**_COLOCATE, "spec.rollout.colocate.tensorParallelSize": 3},
        None,
    ),
    (
        "spec",
        "spec.rollout.colocate.sleepLevel > 0 needs",
        {**_COLOCATE, **_CPU, "spec.rollout.colocate.sleepLevel": 1},
        None,
    ),
    (
        "spec",
        "spec.rollout.colocate.sleepLevel > 0 cannot be combined",
        {**_COLOCATE, "spec.rollout.colocate.sleepLevel": 1, "spec.training.deepspeed_stage": 3},
        None,
    ),
    (
        "spec",
        "spec.rollout.colocate.offloadModel and offloadOptimizer",
        {**_COLOCATE, **_CPU, "spec.rollout.colocate.offloadModel": True},
        None,
    ),
    (
        "spec",
        "spec.rollout.colocate.tensorParallelSize must be 1 with",
        {**_COLOCATE, "spec.rollout.engine": "hf", "spec.rollout.colocate.tensorParallelSize": 2},
        None,
    ),
    (
        "spec",
        "spec.sync.mode 'adapter' is not available with",
        {
            **_COLOCATE,
            "spec.sync.mode": "adapter",
            "spec.rollout.enableLora": True,
            "spec.training.lora.use_dora": False,
        },
        None,
    ),
    ("spec", "spec.sync.transport must stay 'auto'", {**_COLOCATE, "spec.sync.transport": "grpc"}, None),
    (
        "spec",
        "spec.training.rollout.max_staleness must be 0",
        {**_COLOCATE, "spec.training.rollout.max_staleness": 1},
        None,
    ),
    # spec.model, spec.rollout, spec.training, spec.scheduling: rules on one section
    ("spec.model.volume", "spec.model.volume: set only one", {"spec.model.volume.hostPath": "/mnt/models"}, None),
    (
        "spec.model.vision",
        "spec.model.vision: minPixels exceeds",
        {"spec.model.vision": {"minPixels": 100000, "maxPixels": 1000}},
        None,
    ),
    ("spec.rollout", "spec.rollout.port and metricsPort must differ", {"spec.rollout.port": 9090}, None),
    ("spec.rollout", "spec.rollout.replicas must be unset or 0", {**_COLOCATE, "spec.rollout.replicas": 2}, None),
    (
        "spec.rollout",
        "spec.rollout.tls needs spec.rollout.mode",
        {**_COLOCATE, "spec.rollout.tls": {"secretName": "t"}},
        None,
    ),
    (
        "spec.rollout",
        "spec.rollout.tls.healthPort must differ",
        {"spec.rollout.tls": {"secretName": "t", "healthPort": 9090}},
        None,
    ),
    (
        "spec.rollout.startupTimeout",
        "spec.rollout.startupTimeout must be seconds",
        {"spec.rollout.startupTimeout": "0m0s"},
        None,
    ),
    (
        "spec.rollout.recoveryTimeout",
        "spec.rollout.recoveryTimeout must be seconds",
        {"spec.rollout.recoveryTimeout": 0},
        None,
    ),
    (
        "spec.learner.stallTimeout",
        "spec.learner.stallTimeout must be seconds",
        {"spec.learner.stallTimeout": "0s"},
        None,
    ),
    ("spec.training", "spec.training.warmup_steps exceeds steps", {"spec.training.warmup_steps": 5000}, None),
    (
        "spec.training.rollout",
        "spec.training.rollout.inflight needs max_staleness >= 1",
        {"spec.training.rollout.inflight": True, "spec.training.rollout.max_staleness": 0},
        None,
    ),
    # spec.training.grpo: its own fields together (rmsft.jobspec.grpo.grpo_config_errors)
    (
        "spec.training.grpo",
        "spec.training.grpo.correction_low / correction_high need a correction",
        {"spec.training.grpo.correction_high": 3.0},
        None,
    ),
    (
        "spec.training.grpo",
        "spec.training.grpo.correction tis truncates from above only",
        {"spec.training.grpo.correction": "tis", "spec.training.grpo.correction_low": 0.5},
        None,
    ),
    (
        "spec.training.grpo",
        "spec.training.grpo.overlong_buffer must be < max_tokens",
        {"spec.training.grpo.max_tokens": 64, "spec.training.grpo.overlong_buffer": 64},
        None,
    ),
    (
        "spec.training",
        "spec.training.report_to names a tracker more than once",
        {"spec.training.report_to": ["mlflow", "tensorboard", "mlflow"]},
        None,
    ),
    *(
        (
            "spec.training",
            f"spec.training.recipe: {name} applies to recipe generation 2",
            {"spec.training.recipe": {"generation": 1, name: value}},
            None,
        )
        for name, value in (
            ("channel_b_ratio", 0.5),
            ("anchor", "sampled"),
            ("structure_ce", 1.0),
            ("prefix_labels", True),
            ("dead_anchors", "keep"),
            ("duplicates", {}),
            ("explorers", {"count": 0}),
        )
    ),
    (
        "spec.training",
        "spec.training.recipe.explorers.count must be 0",
        {"spec.training.recipe.explorers": {"count": 1}, "spec.training.rollout.max_staleness": 1},
        None,
    ),
    (
        "spec.training",
        "spec.training.format_options.coordinates applies",
        {"spec.training.format_options": {"coordinates": "pixels"}},
        None,
    ),
    (
        "spec.training",
        "spec.training.lora.coord_rows applies",
        {"spec.training.format": "qwen_json", "spec.training.lora.coord_rows": True},
        None,
    ),
    (
        "spec.training",
        "spec.training.format_options.polygons applies",
        {"spec.training.format": "qwen_json", "spec.training.format_options": {"polygons": "flat"}},
        None,
    ),
    (
        "spec.scheduling",
        "spec.scheduling.podLabels: keys under",
        {"spec.scheduling.podLabels": {"rmsft.io/job": "x"}},
        None,
    ),
    (
        "spec.scheduling",
        "spec.scheduling.podAnnotations: keys under",
        {"spec.scheduling.podAnnotations": {"rmsft.io/job": "x"}},
        None,
    ),
    (
        "spec.scheduling",
        "spec.scheduling.podLabels: a key is not",
        {"spec.scheduling.podLabels": {"bad key": "x"}},
        None,
    ),
    (
        "spec.scheduling",
        "spec.scheduling.podAnnotations: a key is not",
        {"spec.scheduling.podAnnotations": {"bad key": "x"}},
        None,
    ),
    (
        "spec.scheduling",
        "spec.scheduling.podLabels: a value is not",
        {"spec.scheduling.podLabels": {"team": "not ok!"}},
        None,
    ),
    (
        "spec.scheduling",
        "spec.scheduling.podLabels: kueue.x-k8s.io/queue-name",
        {"spec.scheduling.podLabels": {"kueue.x-k8s.io/queue-name": "gpu"}},
        None,
    ),
    (
        "spec.scheduling",
        "spec.scheduling.learnerTopologyKey is not",
        {"spec.learner.nodes": 2, **_GRPC, "spec.scheduling.learnerTopologyKey": "Not A Key"},
        None,
    ),
    # Transition rules: an update of a running job (the old object) that changes what cannot change
    ("spec.trainer", "spec.trainer is immutable", {**_GRPO, "spec.trainer": "rollout_matching"}, _GRPO),
    ("spec.model", "spec.model is immutable", {"spec.model.path": "/models/other"}, {}),
    ("spec.image", "spec.image is immutable", {"spec.image.tag": "0.2.0"}, {}),
    ("spec.placement", "spec.placement is immutable", {"spec.placement.nodeSelector": {"pool": "b"}}, {}),
    ("spec.rollout", "spec.rollout.kvCacheBytes is immutable", {"spec.rollout.kvCacheBytes": 1 << 30}, {}),
    ("spec.rollout", "spec.rollout.tls is immutable", {"spec.rollout.tls": {"secretName": "t"}}, {}),
    ("spec.rollout.mode", "spec.rollout.mode is immutable", {**_COLOCATE, "spec.rollout.mode": "server"}, _COLOCATE),
    (
        "spec.rollout.colocate",
        "spec.rollout.colocate is immutable",
        {**_COLOCATE, "spec.rollout.colocate.gpuMemoryUtilization": 0.5},
        _COLOCATE,
    ),
    (
        "spec.rollout.tensorParallelSize",
        "spec.rollout.tensorParallelSize is immutable",
        {"spec.rollout.replicas": 3, "spec.rollout.tensorParallelSize": 2},
        {"spec.rollout.replicas": 3},
    ),
    (
        "spec.rollout.gpuMemoryUtilization",
        "spec.rollout.gpuMemoryUtilization is immutable",
        {"spec.rollout.gpuMemoryUtilization": 0.8},
        {},
    ),
    (
        "spec.rollout.kvCacheBytes",
        "spec.rollout.kvCacheBytes is immutable",
        {"spec.rollout.kvCacheBytes": 2 << 30},
        {"spec.rollout.kvCacheBytes": 1 << 30},
    ),
    ("spec.rollout.maxModelLen", "spec.rollout.maxModelLen is immutable", {"spec.rollout.maxModelLen": 16384}, {}),
    ("spec.rollout.enableLora", "spec.rollout.enableLora is immutable", {"spec.rollout.enableLora": True}, {}),
    ("spec.rollout.maxLoraRank", "spec.rollout.maxLoraRank is immutable", {"spec.rollout.maxLoraRank": 128}, {}),
    (
        "spec.rollout.enablePrefixCaching",
        "spec.rollout.enablePrefixCaching is immutable",
        {"spec.rollout.enablePrefixCaching": False},
        {},
    ),
    ("spec.rollout.engine", "spec.rollout.engine is immutable", {"spec.rollout.engine": "hf"}, {}),
    ("spec.rollout.modelImpl", "spec.rollout.modelImpl is immutable", {"spec.rollout.modelImpl": "transformers"}, {}),
    ("spec.rollout.port", "spec.rollout.port is immutable", {"spec.rollout.port": 50052}, {}),
    ("spec.rollout.metricsPort", "spec.rollout.metricsPort is immutable", {"spec.rollout.metricsPort": 9091}, {}),
    ("spec.rollout.shmSize", "spec.rollout.shmSize is immutable", {"spec.rollout.shmSize": "16Gi"}, {}),
    ("spec.rollout.resources", "spec.rollout.resources is immutable", {"spec.rollout.resources.requests.cpu": "4"}, {}),
    (
        "spec.rollout.startupTimeout",
        "spec.rollout.startupTimeout is immutable",
        {"spec.rollout.startupTimeout": "1h"},
        {"spec.rollout.startupTimeout": "30m"},
    ),
    (
        "spec.rollout.tls",
        "spec.rollout.tls is immutable",
        {"spec.rollout.tls": {"secretName": "b"}},
        {"spec.rollout.tls": {"secretName": "a"}},
    ),
    (
        "spec.rollout.disruptionBudget",
        "spec.rollout.disruptionBudget is immutable",
        {"spec.rollout.disruptionBudget": False},
        {},
    ),
    (
        "spec.rollout.recoveryTimeout",
        "spec.rollout.recoveryTimeout is immutable",
        {"spec.rollout.recoveryTimeout": "20m"},
        {"spec.rollout.recoveryTimeout": "10m"},
    ),
    ("spec.learner", "spec.learner is immutable", {"spec.learner.gpus": 1}, {}),
    ("spec.training", "spec.training is immutable", {"spec.training.lr": 0.001}, {}),
    ("spec.sync", "spec.sync is immutable", {"spec.sync.fallbackToFull": False}, {}),
    ("spec.monitoring", "spec.monitoring is immutable", {"spec.monitoring.enabled": False}, {}),
    (
        "spec.scheduling",
        "spec.scheduling is immutable",
        {"spec.scheduling.schedulerName": "b"},
        {"spec.scheduling.schedulerName": "a"},
    ),
]


def _case_for(path: str, message: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    found = [(edits, old) for p, start, edits, old in CASES if p == path and message.startswith(start)]
    assert found, f"no invalid case for the CEL rule at {path!r}: {message!r} (add one to CASES)"
    assert len(found) == 1, f"{len(found)} cases for the rule at {path!r}: {message!r}"
    return found[0]


RULES = every_rule()


def test_the_crd_has_the_rules_this_table_was_written_for() -> None:
    """A case that matches no rule (a rule removed or reworded) is stale: the table stays one case per rule."""
    assert len(RULES) >= 80
    unmatched = [
        (p, start)
        for p, start, _, _ in CASES
        if not any(path == p and message.startswith(start) for path, _, message in RULES)
    ]
    assert unmatched == []
    assert len(CASES) == len(RULES)


def test_the_base_job_and_its_updates_pass_every_rule() -> None:
    """The cases' starting points are valid, so what a case refuses is its own edit."""
    assert failed_rules(_base()) == []
    for _, _, _, old in CASES:
        if old is not None:
            assert failed_rules(_edited(old)) == [], old


@pytest.mark.parametrize("path,rule,message", RULES, ids=[f"{p}:{m[:48]}" for p, _, m in RULES])
def test_each_rule_fires_on_an_invalid_case_of_its_own(path: str, rule: str, message: str) -> None:
    edits, old_edits = _case_for(path, message)
    old = _edited(old_edits) if old_edits is not None else None
    new = _edited(edits)
    assert failed_rules(new, old=old) == [(path, rule)]
