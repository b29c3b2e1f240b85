"""The CRD (schema + CEL) and the pydantic model agree: same valid examples, same defaults, and
each invalid spec is rejected by both with a message that names the bad field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_admission import admit, default_errors, root_schema
from rmsft_operator.crd import apply_defaults, build_crd, crd_yaml

from rmsft.jobspec import JobSpecError, load_job, parse_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["configs/job.yaml", "configs/job-3v1.yaml", "configs/job-kind-cpu.yaml", "configs/job-grpo-6v2.yaml"]
CRD_FILE = ROOT / "charts/rmsft/crds/rolloutmatchingjobs.yaml"


def _base() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "configs/job.yaml").read_text())


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    node = doc
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value


_DELETE = object()
# configs/job.yaml as a GRPO job: its sampling's top-p and repetition penalty turned off.
_COLOCATE = {"spec.rollout.mode": "colocate", "spec.rollout.replicas": _DELETE}
_CPU = {"spec.placement.accelerator": "none", "spec.learner.gpus": 0}
_GRPO = {"spec.trainer": "grpo", "spec.training.rollout.top_p": 1.0, "spec.training.rollout.repetition_penalty": 1.0}

# (id, {dotted path: value}, substrings every rejection message must contain)
INVALID: list[tuple[str, dict[str, Any], list[str]]] = [
    ("negative-replicas", {"spec.rollout.replicas": -1}, ["spec.rollout.replicas"]),
    ("zero-tp", {"spec.rollout.tensorParallelSize": 0}, ["spec.rollout.tensorParallelSize"]),
    ("gpu-mem-above-1", {"spec.rollout.gpuMemoryUtilization": 1.5}, ["spec.rollout.gpuMemoryUtilization"]),
    ("gpu-mem-zero", {"spec.rollout.gpuMemoryUtilization": 0}, ["spec.rollout.gpuMemoryUtilization"]),
    ("privileged-port", {"spec.rollout.port": 80}, ["spec.rollout.port"]),
    ("same-ports", {"spec.rollout.port": 9090}, ["spec.rollout.port"]),
    ("sync-mode-enum", {"spec.sync.mode": "nccl"}, ["spec.sync.mode"]),
    # Over the network the job may span nodes, but each pod fits one (issue 45).
    (
        "tp-over-a-node",
        {"spec.sync.transport": "grpc", "spec.rollout.replicas": 1, "spec.rollout.tensorParallelSize": 16},
        ["spec.rollout.tensorParallelSize", "one pod"],
    ),
    (
        "learner-gpus-over-a-node",
        {"spec.sync.transport": "grpc", "spec.learner.gpus": 9},
        ["spec.learner.gpus", "a learner pod is on one node"],
    ),
    # An shm job must fit one node (gpusPerNode); the refusal names the transport.
    (
        "shm-pool-too-big",
        {"spec.sync.transport": "shm", "spec.rollout.replicas": 7},
        ["spec.sync.transport", "spec.placement.gpusPerNode"],
    ),
    (
        "shm-tp-too-big",
        {
            "spec.sync.transport": "shm",
            "spec.rollout.replicas": 3,
            "spec.rollout.tensorParallelSize": 2,
            "spec.learner.gpus": 4,
        },
        ["spec.sync.transport", "spec.placement.gpusPerNode"],
    ),
    ("sync-transport-enum", {"spec.sync.transport": "rdma"}, ["spec.sync.transport"]),
    (
        "gpu-budget-tp",
        {"spec.rollout.replicas": 2, "spec.rollout.tensorParallelSize": 4},
        ["spec.placement.gpusPerNode"],
    ),
    ("cpu-learner-gpus", {"spec.placement.accelerator": "none"}, ["spec.learner.gpus"]),
    ("adapter-without-lora", {"spec.sync.mode": "adapter"}, ["spec.sync.mode", "enableLora"]),
    ("adapter-dora", {"spec.sync.mode": "adapter", "spec.rollout.enableLora": True}, ["spec.sync.mode", "use_dora"]),
    (
        "adapter-full-ft",
        {
            "spec.sync.mode": "adapter",
            "spec.rollout.enableLora": True,
            "spec.training.lora.use_dora": False,
            "spec.training.finetune": "full",
        },
        ["spec.sync.mode", "finetune"],
    ),
    (
        "lora-rank",
        {"spec.rollout.enableLora": True, "spec.rollout.maxLoraRank": 16},
        ["spec.training.lora.r", "maxLoraRank"],
    ),
    ("max-tokens", {"spec.training.rollout.max_tokens": 8192}, ["spec.training.rollout.max_tokens"]),
    ("lr-zero", {"spec.training.lr": 0}, ["spec.training.lr"]),
    ("data-not-jsonl", {"spec.training.data.path": "/data/train.csv"}, ["spec.training.data.path"]),
    ("data-missing", {"spec.training.data": _DELETE}, ["spec.training", "data"]),
    ("model-missing", {"spec.model": _DELETE}, ["spec", "model"]),
    ("unknown-key", {"spec.rollout.bogus": 1}, ["spec.rollout.bogus"]),
    ("iou-gate", {"spec.training.matching.iou_gate": 1.5}, ["spec.training.matching.iou_gate"]),
    ("top-p-zero", {"spec.training.rollout.top_p": 0}, ["spec.training.rollout.top_p"]),
    ("two-volume-sources", {"spec.model.volume.hostPath": "/mnt/models"}, ["spec.model.volume"]),
    ("warmup", {"spec.training.warmup_steps": 5000}, ["spec.training.warmup_steps"]),
    ("pull-policy", {"spec.image.pullPolicy": "Sometimes"}, ["spec.image.pullPolicy"]),
    (
        "toleration-op",
        {"spec.placement.tolerations": [{"key": "a", "operator": "Maybe"}]},
        ["spec.placement.tolerations", "operator"],
    ),
    ("name-too-long", {"metadata.name": "x" * 41}, ["metadata.name"]),
    ("bad-quantity", {"spec.rollout.resources.requests.cpu": "lots"}, ["spec.rollout.resources.requests"]),
    ("m-steps-zero", {"spec.training.buffer.m_steps": 0}, ["spec.training.buffer.m_steps"]),
    ("deepspeed-stage", {"spec.training.deepspeed_stage": 4}, ["spec.training.deepspeed_stage"]),
    (
        "vision-pixel-bounds",
        {"spec.model.vision": {"minPixels": 100000, "maxPixels": 1000}},
        ["spec.model.vision", "minPixels"],
    ),
    ("model-impl", {"spec.rollout.modelImpl": "onnx"}, ["spec.rollout.modelImpl"]),
    ("freeze-unknown", {"spec.training.freeze.text_tower": True}, ["spec.training.freeze"]),
    ("format-enum", {"spec.training.format": "yolo"}, ["spec.training.format"]),
    (
        "coordexp-pixels",
        {"spec.training.format_options": {"coordinates": "pixels"}},
        ["spec.training.format_options.coordinates"],
    ),
    (
        "qwen-json-flat-polys",
        {"spec.training.format": "qwen_json", "spec.training.format_options": {"polygons": "flat"}},
        ["spec.training.format_options.polygons"],
    ),
    ("eval-not-jsonl", {"spec.training.eval": {"data": "/data/held.csv"}}, ["spec.training.eval.data"]),
    ("eval-iou-zero", {"spec.training.eval": {"data": "/data/held.jsonl", "iou": 0}}, ["spec.training.eval.iou"]),
    # spec.trainer: grpo (configs/job.yaml samples with top-p and a repetition penalty, which GRPO refuses)
    ("trainer-enum", {"spec.trainer": "ppo"}, ["spec.trainer"]),
    ("grpo-group-of-one", {**_GRPO, "spec.training.grpo.group_size": 1}, ["spec.training.grpo.group_size"]),
    ("grpo-clip-eps", {**_GRPO, "spec.training.grpo.clip_eps": 1.5}, ["spec.training.grpo.clip_eps"]),
    ("grpo-clip-eps-high", {**_GRPO, "spec.training.grpo.clip_eps_high": 0}, ["spec.training.grpo.clip_eps_high"]),
    ("grpo-greedy", {**_GRPO, "spec.training.grpo.temperature": 0}, ["spec.training.grpo.temperature"]),
    ("grpo-kl-negative", {**_GRPO, "spec.training.grpo.kl_coef": -0.1}, ["spec.training.grpo.kl_coef"]),
    ("grpo-loss-norm", {**_GRPO, "spec.training.grpo.loss_norm": "batch"}, ["spec.training.grpo.loss_norm"]),
    ("grpo-no-rewards", {**_GRPO, "spec.training.grpo.rewards": []}, ["spec.training.grpo.rewards"]),
    (
        "grpo-reward-without-name",
        {**_GRPO, "spec.training.grpo.rewards": [{"weight": 2.0}]},
        ["spec.training.grpo.rewards[0]", "name"],
    ),
    (
        "grpo-reward-unknown-key",
        {**_GRPO, "spec.training.grpo.rewards": [{"name": "detection", "wieght": 2.0}]},
        ["spec.training.grpo.rewards[0].wieght"],
    ),
    ("grpo-max-tokens", {**_GRPO, "spec.training.grpo.max_tokens": 8192}, ["spec.training.grpo.max_tokens"]),
    (
        "grpo-rollout-buffer",
        {**_GRPO, "spec.training.buffer": {"enabled": True, "m_steps": 2}},
        ["spec.training.buffer.m_steps", "grpo"],
    ),
    ("grpo-warm-start", {**_GRPO, "spec.training.warm_start_steps": 10}, ["spec.training.warm_start_steps"]),
    (
        "grpo-grad-accumulation",
        {**_GRPO, "spec.training.grad_accumulation": 2},
        ["spec.training.grad_accumulation", "grpo"],
    ),
    # written as an integer: the API server hands a `number` field to CEL as a double
    (
        "grpo-kl-full-finetune",
        {**_GRPO, "spec.training.grpo.kl_coef": 1, "spec.training.finetune": "full"},
        ["spec.training.grpo.kl_coef", "finetune"],
    ),
    ("grpo-top-p", {"spec.trainer": "grpo"}, ["spec.training.rollout", "top_p", "grpo"]),
    (
        "inflight-without-staleness",
        {"spec.training.rollout.inflight": True, "spec.training.rollout.max_staleness": 0},
        ["spec.training.rollout.inflight needs max_staleness >= 1"],
    ),
    # spec.training.grpo corrections and sampling rules (issue 63)
    ("grpo-correction-enum", {**_GRPO, "spec.training.grpo.correction": "ppo"}, ["spec.training.grpo.correction"]),
    (
        "grpo-bounds-without-correction",
        {**_GRPO, "spec.training.grpo.correction_high": 3.0},
        ["spec.training.grpo.correction_low / correction_high need a correction"],
    ),
    (
        "grpo-tis-with-low",
        {**_GRPO, "spec.training.grpo.correction": "tis", "spec.training.grpo.correction_low": 0.5},
        ["spec.training.grpo.correction tis truncates from above only"],
    ),
    (
        "grpo-correction-high-at-1",
        {**_GRPO, "spec.training.grpo.correction": "icepop", "spec.training.grpo.correction_high": 1.0},
        ["spec.training.grpo.correction_high"],
    ),
    (
        "grpo-correction-low-at-1",
        {**_GRPO, "spec.training.grpo.correction": "mis", "spec.training.grpo.correction_low": 1.0},
        ["spec.training.grpo.correction_low"],
    ),
    (
        "grpo-dynamic-sampling-enum",
        {**_GRPO, "spec.training.grpo.dynamic_sampling": "refill"},
        ["spec.training.grpo.dynamic_sampling"],
    ),
    (
        "grpo-dynamic-sampling-rounds",
        {**_GRPO, "spec.training.grpo.dynamic_sampling_rounds": 9},
        ["spec.training.grpo.dynamic_sampling_rounds"],
    ),
    ("grpo-overlong-enum", {**_GRPO, "spec.training.grpo.overlong": "truncate"}, ["spec.training.grpo.overlong"]),
    (
        "grpo-overlong-buffer",
        {**_GRPO, "spec.training.grpo.max_tokens": 64, "spec.training.grpo.overlong_buffer": 64},
        ["spec.training.grpo.overlong_buffer must be < max_tokens"],
    ),
    # spec.rollout.mode: colocate (configs/job.yaml: 8 GPUs per node, a 4-GPU learner)
    ("mode-enum", {"spec.rollout.mode": "hybrid"}, ["spec.rollout.mode"]),
    ("colocate-with-replicas", {**_COLOCATE, "spec.rollout.replicas": 2}, ["spec.rollout.replicas", "colocate"]),
    (
        "colocate-tp-not-dividing",
        {**_COLOCATE, "spec.rollout.colocate.tensorParallelSize": 3},
        ["spec.rollout.colocate.tensorParallelSize", "spec.learner.gpus"],
    ),
    (
        "colocate-tp-on-cpu",
        {**_COLOCATE, **_CPU, "spec.rollout.colocate.tensorParallelSize": 2},
        ["spec.rollout.colocate.tensorParallelSize", "'none'"],
    ),
    (
        "colocate-sleep-on-cpu",
        {**_COLOCATE, **_CPU, "spec.rollout.colocate.sleepLevel": 1},
        ["spec.rollout.colocate.sleepLevel", "CPU"],
    ),
    (
        "colocate-sleep-level-3",
        {**_COLOCATE, "spec.rollout.colocate.sleepLevel": 3},
        ["spec.rollout.colocate.sleepLevel"],
    ),
    (
        "colocate-offload-on-cpu",
        {**_COLOCATE, **_CPU, "spec.rollout.colocate.offloadModel": True},
        ["spec.rollout.colocate.offloadModel"],
    ),
    (
        "colocate-hf-tp",
        {**_COLOCATE, "spec.rollout.engine": "hf", "spec.rollout.colocate.tensorParallelSize": 2},
        ["spec.rollout.colocate.tensorParallelSize", "'hf'"],
    ),
    (
        "colocate-adapter-sync",
        {
            **_COLOCATE,
            "spec.sync.mode": "adapter",
            "spec.rollout.enableLora": True,
            "spec.training.finetune": "lora",
            "spec.training.lora.use_dora": False,
        },
        ["spec.sync.mode", "colocate"],
    ),
    ("colocate-shm", {**_COLOCATE, "spec.sync.transport": "shm"}, ["spec.sync.transport", "colocate"]),
    (
        "colocate-max-staleness",
        {**_COLOCATE, "spec.sync.transport": "auto", "spec.training.rollout.max_staleness": 1},
        ["spec.training.rollout.max_staleness", "spec.rollout.mode", "colocate"],
    ),
    ("max-staleness-negative", {"spec.training.rollout.max_staleness": -1}, ["max_staleness"]),
    (
        "colocate-sleep-zero3",
        {
            **_COLOCATE,
            "spec.sync.transport": "auto",
            "spec.rollout.colocate": {"sleepLevel": 1},
            "spec.training.deepspeed_stage": 3,
        },
        ["spec.rollout.colocate.sleepLevel", "deepspeed_stage 3"],
    ),
    ("recipe-ratio-above-1", {"spec.training.recipe.channel_b_ratio": 1.5}, ["channel_b_ratio"]),
    ("recipe-generation-3", {"spec.training.recipe.generation": 3}, ["generation"]),
    (
        "recipe-gen1-with-ratio",
        {"spec.training.recipe.generation": 1, "spec.training.recipe.channel_b_ratio": 0.5},
        ["spec.training.recipe", "channel_b_ratio", "generation 2 only"],
    ),
    (
        "recipe-gen1-with-explorers",
        {
            "spec.training.recipe.generation": 1,
            "spec.training.recipe.channel_b_ratio": _DELETE,
            "spec.training.recipe.explorers": {"count": 0},
        },
        ["spec.training.recipe", "explorers", "generation 2 only"],
    ),
    (
        "recipe-explorers-ahead",
        {"spec.training.recipe.explorers": {"count": 1}, "spec.training.rollout.max_staleness": 1},
        ["spec.training.recipe.explorers.count", "max_staleness"],
    ),
    ("recipe-duplicate-iou-zero", {"spec.training.recipe.duplicates": {"iou": 0.0}}, ["iou"]),
    ("max-staleness-too-large", {"spec.training.rollout.max_staleness": 5}, ["max_staleness"]),
    (
        "colocate-gpu-memory",
        {**_COLOCATE, "spec.rollout.colocate.gpuMemoryUtilization": 1.0},
        ["spec.rollout.colocate.gpuMemoryUtilization"],
    ),
    # spec.rollout.startupTimeout: seconds or a duration, more than zero
    ("startup-timeout-zero", {"spec.rollout.startupTimeout": 0}, ["spec.rollout.startupTimeout"]),
    ("startup-timeout-zero-duration", {"spec.rollout.startupTimeout": "0m0s"}, ["spec.rollout.startupTimeout"]),
    ("startup-timeout-words", {"spec.rollout.startupTimeout": "30 minutes"}, ["spec.rollout.startupTimeout"]),
    ("startup-timeout-order", {"spec.rollout.startupTimeout": "30m1h"}, ["spec.rollout.startupTimeout"]),
    ("recovery-timeout-zero", {"spec.rollout.recoveryTimeout": 0}, ["spec.rollout.recoveryTimeout"]),
    ("recovery-timeout-words", {"spec.rollout.recoveryTimeout": "ten minutes"}, ["spec.rollout.recoveryTimeout"]),
    ("stall-timeout-zero", {"spec.learner.stallTimeout": "0s"}, ["spec.learner.stallTimeout"]),
    # spec.rollout.tls: a Secret's name, server mode only, a health port of its own
    ("tls-without-secret", {"spec.rollout.tls": {}}, ["spec.rollout.tls", "secretName"]),
    ("tls-secret-not-a-name", {"spec.rollout.tls": {"secretName": "Rollout_TLS"}}, ["spec.rollout.tls.secretName"]),
    (
        "tls-with-colocate",
        {**_COLOCATE, "spec.sync.transport": "auto", "spec.rollout.tls": {"secretName": "tls"}},
        ["spec.rollout.tls", "colocate"],
    ),
    (
        "tls-health-port-is-metrics",
        {"spec.rollout.tls": {"secretName": "tls", "healthPort": 9090}},
        ["spec.rollout.tls.healthPort"],
    ),
    (
        "tls-health-port-is-grpc",
        {"spec.rollout.tls": {"secretName": "tls", "healthPort": 50051}},
        ["spec.rollout.tls.healthPort"],
    ),
    # spec.learner.nodes > 1 (issue 45): a network transport, one checkpoint folder, server mode, GPUs per pod
    ("learner-nodes-zero", {"spec.learner.nodes": 0}, ["spec.learner.nodes"]),
    ("learner-nodes-over-shm", {"spec.learner.nodes": 2}, ["spec.sync.transport", "spec.learner.nodes > 1"]),
    (
        "learner-nodes-without-claim",
        {"spec.learner.nodes": 2, "spec.sync.transport": "grpc", "spec.learner.checkpointClaim": _DELETE},
        ["spec.learner.checkpointClaim"],
    ),
    (
        "learner-nodes-colocate",
        {**_COLOCATE, "spec.sync.transport": "auto", "spec.learner.nodes": 2},
        ["spec.learner.nodes > 1", "colocate"],
    ),
    (
        "learner-nodes-gpus-per-pod",
        {"spec.learner.nodes": 2, "spec.sync.transport": "grpc", "spec.learner.gpus": 9},
        ["spec.learner.gpus", "spec.placement.gpusPerNode", "per learner pod"],
    ),
    ("learner-ranks-per-pod-with-gpus", {"spec.learner.ranksPerPod": 3}, ["spec.learner.ranksPerPod"]),
    # spec.scheduling (issue 45): the user's pod labels and annotations never take rmsft's keys, and are valid
    ("scheduling-queue-name", {"spec.scheduling.queueName": "GPU_team"}, ["spec.scheduling.queueName"]),
    (
        "scheduling-queue-label-on-pods",
        {"spec.scheduling.podLabels": {"kueue.x-k8s.io/queue-name": "gpu-team"}},
        ["spec.scheduling.podLabels", "spec.scheduling.queueName"],
    ),
    (
        "scheduling-reserved-label",
        {"spec.scheduling.podLabels": {"rmsft.io/job": "other"}},
        ["spec.scheduling.podLabels", "rmsft's own"],
    ),
    (
        "scheduling-reserved-annotation",
        {"spec.scheduling.podAnnotations": {"prometheus.io/port": "1"}},
        ["spec.scheduling.podAnnotations", "rmsft's own"],
    ),
    ("scheduling-label-value", {"spec.scheduling.podLabels": {"team": "not ok!"}}, ["spec.scheduling.podLabels"]),
    ("scheduling-label-key", {"spec.scheduling.podLabels": {"bad key": "x"}}, ["spec.scheduling.podLabels"]),
    ("scheduling-scheduler-name", {"spec.scheduling.schedulerName": "Not_A_Name"}, ["spec.scheduling.schedulerName"]),
    (
        "scheduling-topology-with-one-pod",
        {"spec.scheduling.learnerTopologyKey": "topology.kubernetes.io/zone"},
        ["spec.scheduling.learnerTopologyKey", "spec.learner.nodes > 1"],
    ),
    # spec.sync.transport nccl (issue 45): full weights only; pods may span nodes, but each pod fits one
    ("nccl-not-full", {"spec.sync.transport": "nccl", "spec.sync.mode": "auto"}, ["spec.sync.mode", "'nccl'"]),
    (
        "nccl-server-beyond-a-node",
        {"spec.sync.transport": "nccl", "spec.rollout.tensorParallelSize": 16},
        ["spec.rollout.tensorParallelSize", "one pod"],
    ),
    (
        "nccl-learner-beyond-a-node",
        {"spec.sync.transport": "nccl", "spec.learner.gpus": 12},
        ["spec.learner.gpus", "one node"],
    ),
]


def _normalise(msg: str) -> str:
    # jsonschema writes list indexes as [0], pydantic as .0
    import re

    return re.sub(r"\.(\d+)(?=\.|:|$)", r"[\1]", msg)


def test_there_are_at_least_twenty_invalid_specs() -> None:
    assert len(INVALID) >= 20


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_rejected_by_crd_and_model(case: tuple[str, dict[str, Any], list[str]]) -> None:
    _, edits, fields = case
    doc = _base()
    for dotted, value in edits.items():
        _set(doc, dotted, value)
    crd_errors = admit(doc)
    assert crd_errors, "the CRD admitted an invalid spec"
    crd_text = "\n".join(crd_errors)
    for field in fields:
        assert field in crd_text, f"CRD message does not name {field}: {crd_text}"
    with pytest.raises(JobSpecError) as exc:
        parse_job(doc)
    model_text = _normalise("\n".join(exc.value.errors))
    for field in fields:
        assert field in model_text, f"model message does not name {field}: {model_text}"


@pytest.mark.parametrize("path", EXAMPLES)
def test_examples_are_admitted_and_defaults_agree(path: str) -> None:
    doc = yaml.safe_load((ROOT / path).read_text())
    assert admit(doc) == []
    model = load_job(ROOT / path).to_manifest()
    # The fully defaulted model dump is itself admitted (nothing the model fills in is invalid)...
    assert admit(model) == []
    # ...and every default the API server would fill in equals the model's default.
    crd_defaulted = apply_defaults(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], doc)
    _assert_subset(crd_defaulted["spec"], model["spec"], "spec")


def _assert_subset(crd: Any, model: Any, where: str) -> None:
    if isinstance(crd, dict):
        assert isinstance(model, dict), where
        for key, value in crd.items():
            assert key in model, f"{where}.{key} defaulted by the CRD but unknown to the model"
            _assert_subset(value, model[key], f"{where}.{key}")
    else:
        assert crd == model, f"{where}: CRD gives {crd!r}, model gives {model!r}"


def test_a_job_over_the_network_may_span_nodes_where_an_shm_job_may_not() -> None:
    """The one-node budget (pool + learner <= gpusPerNode) binds shm only (host memory is one node's); grpc and nccl
    move weights over the network, so their pool and learner may take more GPUs than one node has."""
    doc = _base()
    _set(doc, "spec.rollout.replicas", 7)
    for transport in ("grpc", "nccl", "auto"):
        _set(doc, "spec.sync.transport", transport)
        assert admit(doc) == [], transport
        assert parse_job(doc).spec.gpus_needed == 9
    _set(doc, "spec.sync.transport", "shm")
    assert any("spec.placement.gpusPerNode" in e and "spec.sync.transport 'shm'" in e for e in admit(doc))


def test_shm_on_cpus_is_left_to_the_scheduler() -> None:
    # No GPU count to check on CPU pods: the pod affinity keeps them on one node, and a pod that
    # does not fit is named in RolloutReady (Unschedulable).
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    doc["spec"]["sync"]["transport"] = "shm"
    doc["spec"]["rollout"]["replicas"] = 12
    assert admit(doc) == []
    assert parse_job(doc).spec.sync.cluster_transport == "shm"


def test_replicas_may_change_everything_else_is_immutable() -> None:
    old = _base()
    scaled = copy.deepcopy(old)
    scaled["spec"]["rollout"]["replicas"] = 4
    assert admit(scaled, old=old) == []
    for dotted, value in [
        ("spec.training.lr", 0.001),
        ("spec.rollout.tensorParallelSize", 2),
        ("spec.model.path", "/models/other"),
        ("spec.learner.gpus", 1),
        ("spec.sync.transport", "grpc"),
    ]:
        edited = copy.deepcopy(old)
        _set(edited, dotted, value)
        errors = admit(edited, old=old)
        section = ".".join(dotted.split(".")[:3]) if "rollout" in dotted else ".".join(dotted.split(".")[:2])
        assert any(section in e and "immutable" in e for e in errors), (dotted, errors)


def test_every_default_passes_its_rules_as_written() -> None:
    # helm install failed on a real API server: `rollout.default: {}` broke
    # `self.port != self.metricsPort` ("no such key: port"); the fast tier now sees the same.
    assert default_errors(root_schema()) == []


def test_default_checker_catches_a_rule_reading_a_nested_default() -> None:
    section = {
        "type": "object",
        "default": {},
        "properties": {"port": {"type": "integer", "default": 1}, "metricsPort": {"type": "integer", "default": 2}},
        "x-kubernetes-validations": [{"rule": "self.port != self.metricsPort", "message": "differ"}],
    }
    assert default_errors({"type": "object", "properties": {"rollout": section}})


def test_adding_or_removing_an_optional_rollout_field_is_refused() -> None:
    old = _base()
    added = copy.deepcopy(old)
    added["spec"]["rollout"]["kvCacheBytes"] = 1 << 30
    assert any("spec.rollout.kvCacheBytes" in e and "immutable" in e for e in admit(added, old=old))
    assert any("spec.rollout.kvCacheBytes" in e for e in admit(old, old=added))


def test_crd_file_is_generated_from_the_model() -> None:
    assert CRD_FILE.read_text() == crd_yaml(), "run: python -m rmsft_operator.crd > " + str(CRD_FILE)


def test_crd_validates_against_kubernetes_schema() -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD_FILE.read_text()), "1.32", strict=True)


def test_crd_has_status_printer_columns_and_short_name() -> None:
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols["Phase"] == ".status.phase" and cols["Ready"] == ".status.readyRolloutReplicas"
    assert "Step" in cols and "Age" in cols
    assert cols["Eval-F1"] == ".status.evaluation.f1" and cols["Eval-mAP"] == ".status.evaluation.mAP"
    evaluation = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["evaluation"]
    assert set(evaluation["properties"]) == {"step", "f1", "mAP", "mAP50"}
    assert "rmj" in crd["spec"]["names"]["shortNames"]


def test_load_job_reports_file_problems(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(JobSpecError, match="not valid YAML"):
        load_job(bad)
    bad.write_text("kind: Pod\n")
    with pytest.raises(JobSpecError, match="no document with kind: RolloutMatchingJob"):
        load_job(bad)
    with pytest.raises(JobSpecError, match="cannot read"):
        load_job(tmp_path / "missing.yaml")


# YAML 1.1 booleans: go-yaml (kubectl, helm) reads these bare keys as true/false, PyYAML as strings. A `n:` key
# made helm's server-side apply of the CRD conflict (a property named "false") and kubectl send `"false": 8`.
_YAML11_BOOLS = {"y", "yes", "n", "no", "on", "off", "true", "false"}


def _keys(node: Any, where: str) -> list[tuple[str, str]]:
    if isinstance(node, dict):
        return [(where, str(k)) for k in node] + [kv for k, v in node.items() for kv in _keys(v, f"{where}.{k}")]
    if isinstance(node, list):
        return [kv for i, v in enumerate(node) for kv in _keys(v, f"{where}[{i}]")]
    return []


def test_no_key_reads_as_a_boolean_in_yaml_1_1() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    docs = [("crd", schema)] + [(p.name, yaml.safe_load(p.read_text())) for p in (ROOT / "configs").glob("*.yaml")]
    bad = [(name, where, k) for name, doc in docs for where, k in _keys(doc, "") if k.lower() in _YAML11_BOOLS]
    assert not bad, bad


@pytest.mark.parametrize(
    "value,seconds", [(1800, 1800), ("1800", 1800), ("45m", 2700), ("1h30m", 5400), ("90s", 90), ("2h", 7200)]
)
def test_startup_timeout_takes_seconds_or_a_duration(value: Any, seconds: int) -> None:
    doc = _base()
    doc["spec"]["rollout"]["startupTimeout"] = value
    assert admit(doc) == []
    assert parse_job(doc).spec.rollout.startup_timeout_seconds == seconds


def test_startup_timeout_defaults_to_half_an_hour_on_both_sides() -> None:
    doc = _base()
    doc["spec"]["rollout"].pop("startupTimeout", None)
    crd_defaulted = apply_defaults(root_schema(), doc)
    assert crd_defaulted["spec"]["rollout"]["startupTimeout"] == "30m"
    assert parse_job(doc).spec.rollout.startup_timeout_seconds == 1800
