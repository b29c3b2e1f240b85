"""What the learner checks before anything is paid for: the job's memory plan against this machine's GPU memory,
the records' images against the model, and how long ranks may wait for one another."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from learner.data.records import Record
from learner.train.policy import Policy
from rmsft.jobspec import RolloutMatchingJob

log = logging.getLogger("rmsft.learner")


def collective_timeout_s(job: RolloutMatchingJob) -> float:
    """How long a rank may wait for the others: long enough for rank 0's rollouts (with retries)
    and a weight sync. RMSFT_DIST_TIMEOUT_S overrides."""
    env = os.environ.get("RMSFT_DIST_TIMEOUT_S")
    if env:
        return float(env)
    t = job.spec.training.rollout.request_timeout_s
    return max(1800.0, 3 * t + 2 * job.spec.sync.timeout_seconds)


def check_images_fit(records: Sequence[Record], policy: Policy, max_images: int, path: str) -> None:
    """Refuse at start what no server would take: images for a text model, more images than allowed."""
    with_images = [r for r in records if r.images]
    if with_images and not policy.is_vision_language:
        raise ValueError(
            f"{path}: {len(with_images)} record(s) carry images (first: {with_images[0].id!r}) but "
            "spec.model.path is a text model; use a vision-language model or drop the images"
        )
    over = [r.id for r in with_images if len(r.images) > max_images]
    if over:
        raise ValueError(
            f"{path}: {len(over)} record(s) carry more than spec.model.vision.maxImagesPerPrompt="
            f"{max_images} images (first: {over[0]!r})"
        )


def check_memory_plan(job: RolloutMatchingJob, *, log_it: bool) -> None:
    """The job's memory plan (rmsft.memory_plan, what `rmsft plan` prints) against this machine's GPU memory:
    logged, and a job that cannot fit is refused before anything loads, naming the knob to turn. The plan is an
    estimate: RMSFT_MEMORY_PLAN=warn makes a refusal a warning, =off skips the plan (any other value but refuse,
    the default, is a MemoryPlanSettingError)."""
    from rmsft.memory_plan import MEMORY_PLAN_ENV, MemoryPlanError, ModelShapeError, memory_plan_setting, plan_memory

    setting = memory_plan_setting()
    if setting == "off":
        return
    gpu_memory = None
    if torch.cuda.is_available():
        gpu_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        plan = plan_memory(job, gpu_memory=gpu_memory)
    except ModelShapeError as exc:
        if log_it:
            log.warning("no memory plan: %s", exc)
        return
    if log_it:
        for line in plan.lines():
            log.info("memory plan: %s", line)
    if not plan.fits:
        if setting == "warn":
            log.warning(
                "the memory plan says this job does not fit (%s=warn: going on): %s", MEMORY_PLAN_ENV, plan.message()
            )
            return
        raise MemoryPlanError(
            f"{plan.message()} ({MEMORY_PLAN_ENV}=warn goes on anyway: the plan is an estimate)", plan
        )
