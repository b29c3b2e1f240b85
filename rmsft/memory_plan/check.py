"""The entry points: `plan_memory` (what `rmsft plan` prints), `check_memory_plan` (the learner's start check,
refusing a job that cannot fit with `MemoryPlanError`), and `memory_plan_setting`: the RMSFT_MEMORY_PLAN switch
that says what the learner does with a plan that does not fit."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rmsft.jobspec import JobSpecError, RolloutMatchingJob
from rmsft.memory_plan.advice import advise
from rmsft.memory_plan.arithmetic import (
    ModePlan,
    as_colocate,
    as_server,
    default_gpu_memory,
    plan_mode,
    trainable_params,
)
from rmsft.memory_plan.render import MemoryPlan
from rmsft.memory_plan.shapes import ModelShape, resolve_model_shape
from rmsft.memory_plan.units import gib


class MemoryPlanError(JobSpecError):
    """The job cannot fit its devices. A JobSpecError (so ValueError), reported like a bad spec: one `error:`
    line and exit code 2; `advice` holds the knobs that would make it fit."""

    def __init__(self, message: str, plan: MemoryPlan) -> None:
        self.errors = [message]
        self.plan = plan
        self.advice = plan.advice
        ValueError.__init__(self, message)


MEMORY_PLAN_ENV = "RMSFT_MEMORY_PLAN"
MEMORY_PLAN_SETTINGS = ("refuse", "warn", "off")  # refuse: the default


class MemoryPlanSettingError(ValueError):
    """RMSFT_MEMORY_PLAN holds something other than its documented values."""


def memory_plan_setting(environ: Mapping[str, str] | None = None) -> str:
    """What the learner does with a plan that does not fit: RMSFT_MEMORY_PLAN's value, "refuse" when unset or
    empty. Anything but `MEMORY_PLAN_SETTINGS` is an error (a typo must not silently mean "refuse")."""
    raw = (os.environ if environ is None else environ).get(MEMORY_PLAN_ENV, "")
    value = raw.strip().lower() or "refuse"
    if value not in MEMORY_PLAN_SETTINGS:
        raise MemoryPlanSettingError(
            f"{MEMORY_PLAN_ENV} must be one of {', '.join(MEMORY_PLAN_SETTINGS)} (refuse when unset), got {raw!r}"
        )
    return value


def plan_memory(
    job: RolloutMatchingJob,
    *,
    gpu_memory: int | None = None,
    model_config: str | Path | None = None,
    shape: ModelShape | None = None,
) -> MemoryPlan:
    """The memory plan of `job` in both modes. `gpu_memory`: bytes per GPU (default: the node selector's GPU
    product, else 80 GiB for nvidia); `model_config`: a config.json, model folder or preset name to use instead
    of spec.model.path. Raises ModelShapeError when no model shape can be found."""
    spec = job.spec
    shape = shape or resolve_model_shape(spec, model_config)
    memory = gpu_memory if gpu_memory is not None else default_gpu_memory(spec)
    if spec.placement.accelerator == "none":
        memory = None  # CPU jobs: host memory, bounded only by the pods' limits
    plans: dict[str, ModePlan] = {spec.rollout.mode: plan_mode(spec, shape, memory)}
    notes: list[str] = []
    other = as_server(spec) if spec.rollout.colocated else as_colocate(spec)
    if other is not None:
        plans[other.rollout.mode] = plan_mode(other, shape, memory)
    else:
        notes.append("server mode for comparison needs at least 2 GPUs (one rollout, one learner)")
    ordered: dict[str, ModePlan] = {k: plans[k] for k in ("server", "colocate") if k in plans}
    if memory is not None:
        notes.append(
            f"GPU memory: {gib(memory)} per GPU"
            + (
                ""
                if gpu_memory is not None
                else " (default for the accelerator / node selector; --gpu-memory to change)"
            )
        )
    return MemoryPlan(
        job=job.metadata.name,
        mode=spec.rollout.mode,
        accelerator=spec.placement.accelerator,
        model=shape,
        trainable_params=trainable_params(spec, shape),
        plans=ordered,
        advice=advise(spec, shape, memory),
        notes=tuple(notes),
    )


def check_memory_plan(
    job: RolloutMatchingJob, *, gpu_memory: int | None = None, model_config: str | Path | None = None
) -> MemoryPlan:
    """The plan of `job`; raises MemoryPlanError (a JobSpecError, so a ValueError) naming the knobs to turn
    when its own mode cannot fit. The learner calls this at start; pass the real device's memory as
    `gpu_memory` where it is known."""
    plan = plan_memory(job, gpu_memory=gpu_memory, model_config=model_config)
    if not plan.fits:
        raise MemoryPlanError(plan.message(), plan)
    return plan
