"""Advice: which knob makes a job fit. Each knob is tried by planning the changed job again (the arithmetic's
`plan_mode`), not by a rule of thumb, and only a change the job would be accepted with is named: the job spec
validator and the learner's start checks run on the changed job (`refusal`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from rmsft.jobspec import JobSpec
from rmsft.memory_plan.arithmetic import plan_mode
from rmsft.memory_plan.shapes import ModelShape
from rmsft.memory_plan.units import gib

_Knob = tuple[str, Callable[[JobSpec], None]]


def _set(path: str, value: Any) -> Callable[[JobSpec], None]:
    def apply(spec: JobSpec) -> None:
        *parents, last = path.split(".")
        obj: Any = spec
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, last, value)

    return apply


def _shift(replicas: int, learners: int) -> Callable[[JobSpec], None]:
    def apply(spec: JobSpec) -> None:
        spec.rollout.replicas, spec.learner.gpus = replicas, learners

    return apply


def _knobs(spec: JobSpec, shape: ModelShape, gpu_memory: int | None) -> list[_Knob]:
    """Single changes worth trying, in the order they are cheapest to accept."""
    t, r, c = spec.training, spec.rollout, spec.rollout.colocate
    gpu = spec.placement.accelerator != "none"
    knobs: list[_Knob] = []

    def fits_with(*changes: Callable[[JobSpec], None]) -> bool:
        s = spec.model_copy(deep=True)
        for ch in changes:
            ch(s)
        return plan_mode(s, shape, gpu_memory).fits

    if r.colocated and gpu and r.engine == "vllm" and not c.kv_cache_bytes:
        # The largest share (in steps of 0.05) that still fits, below or above the current one.
        shares = [round(x * 0.05, 2) for x in range(19, 0, -1)]
        for share in shares:
            if share != c.gpu_memory_utilization and fits_with(_set("rollout.colocate.gpu_memory_utilization", share)):
                verb = "lower" if share < c.gpu_memory_utilization else "raise"
                knobs.append(
                    (
                        f"{verb} spec.rollout.colocate.gpuMemoryUtilization to {share}",
                        _set("rollout.colocate.gpu_memory_utilization", share),
                    )
                )
                break
        else:  # none fits alone: a smaller share to pair with another knob
            share = round(c.gpu_memory_utilization - 0.1, 2)
            if share >= 0.1:
                knobs.append(
                    (
                        f"lower spec.rollout.colocate.gpuMemoryUtilization to {share}",
                        _set("rollout.colocate.gpu_memory_utilization", share),
                    )
                )
    if r.colocated and gpu and r.engine == "vllm":
        offloads = [("offload_optimizer", "offloadOptimizer"), ("offload_model", "offloadModel")]
        for attr, name in offloads:
            if not getattr(c, attr):
                knobs.append((f"set spec.rollout.colocate.{name}: true", _set(f"rollout.colocate.{attr}", True)))
        if c.sleep_level == 0:
            knobs.append(("set spec.rollout.colocate.sleepLevel: 1", _set("rollout.colocate.sleep_level", 1)))
        n = spec.learner.gpus
        for tp in (2, 4, 8):
            if tp > c.tensor_parallel_size and n % tp == 0:
                knobs.append(
                    (
                        f"raise spec.rollout.colocate.tensorParallelSize to {tp}",
                        _set("rollout.colocate.tensor_parallel_size", tp),
                    )
                )
                break
    if not r.colocated and gpu and t.deepspeed_stage >= 1:
        # Rollout GPUs to the learner: ZeRO shards the training state over more ranks on the same node.
        learners, servers = spec.learner.gpus * 2, r.replicas
        while learners <= spec.gpus_needed - r.tensor_parallel_size:
            servers = (spec.gpus_needed - learners) // r.tensor_parallel_size
            if servers >= 1:
                knobs.append(
                    (
                        f"move GPUs to the learner (spec.rollout.replicas {servers}, spec.learner.gpus {learners})",
                        _shift(servers, learners),
                    )
                )
                break
            learners *= 2
    if not r.colocated and gpu and r.engine == "vllm" and not r.kv_cache_bytes:
        for share in [round(x * 0.05, 2) for x in range(1, 20)]:
            if share > r.gpu_memory_utilization and fits_with(_set("rollout.gpu_memory_utilization", share)):
                knobs.append(
                    (
                        f"raise spec.rollout.gpuMemoryUtilization to {share}",
                        _set("rollout.gpu_memory_utilization", share),
                    )
                )
                break
        for tp in (2, 4, 8):
            if tp > r.tensor_parallel_size:
                knobs.append(
                    (f"raise spec.rollout.tensorParallelSize to {tp}", _set("rollout.tensor_parallel_size", tp))
                )
                break
    if not t.gradient_checkpointing:
        knobs.append(("set spec.training.gradient_checkpointing: true", _set("training.gradient_checkpointing", True)))
    # The longest packing length that fits, halving; a packed row must still hold one whole sequence.
    length, floor = t.packing_length // 2, max(64, r.max_model_len)
    while length >= floor:
        if fits_with(_set("training.packing_length", length)):
            knobs.append((f"lower spec.training.packing_length to {length}", _set("training.packing_length", length)))
            break
        length //= 2
    else:  # none fits alone: half the length, to pair with another knob
        if t.packing_length // 2 >= floor:
            half = t.packing_length // 2
            knobs.append((f"lower spec.training.packing_length to {half}", _set("training.packing_length", half)))
    if max(1, spec.learner.gpus) > 1 and t.deepspeed_stage < 3:
        for stage in range(t.deepspeed_stage + 1, 4):
            knobs.append((f"set spec.training.deepspeed_stage: {stage}", _set("training.deepspeed_stage", stage)))
    if t.precision == "fp32":
        knobs.append(("set spec.training.precision: bf16", _set("training.precision", "bf16")))
    if t.finetune == "full":
        knobs.append(("set spec.training.finetune: lora", _set("training.finetune", "lora")))
    length = r.max_model_len // 2
    while length > t.rollout.max_tokens and length >= 64:
        if fits_with(_set("rollout.max_model_len", length)):
            knobs.append((f"lower spec.rollout.maxModelLen to {length}", _set("rollout.max_model_len", length)))
            break
        length //= 2
    return knobs


OFFLOAD_OPTIMIZER_ZERO3 = (
    "spec.rollout.colocate.offloadOptimizer is not available with "
    "spec.training.deepspeed_stage 3 (the learner refuses it at start)"
)


def changed(spec: JobSpec, *chosen: _Knob) -> JobSpec:
    """A copy of `spec` with the knobs' changes applied (not validated: see `refusal`)."""
    s = spec.model_copy(deep=True)
    for _, apply in chosen:
        apply(s)
    return s


def refusal(spec: JobSpec) -> str | None:
    """Why `spec` (e.g. a job changed by advice) would be refused before it trains, else None: the job spec
    validator (the same rules as the CRD's and `rmsft local`'s), then what the learner refuses at start although
    the spec allows it (offloading the optimizer under ZeRO-3: learner.train.offload)."""
    try:
        checked = JobSpec.model_validate(spec.model_dump(by_alias=True))
    except ValidationError as exc:
        return "; ".join(e["msg"] for e in exc.errors())
    c = checked.rollout.colocate
    if checked.rollout.colocated and c.offload_optimizer and checked.training.deepspeed_stage == 3:
        return OFFLOAD_OPTIMIZER_ZERO3
    return None


def advise(spec: JobSpec, shape: ModelShape, gpu_memory: int | None) -> tuple[str, ...]:
    """What to turn so that the job's own mode fits: each single knob that alone makes it fit, else the
    first pair that does, else the plain fact."""
    base = plan_mode(spec, shape, gpu_memory)
    if base.fits:
        return ()
    if base.host_limit is not None and base.host_total > base.host_limit and all(d.fits for d in base.devices):
        return (f"Raise spec.learner.resources.limits.memory to at least {gib(base.host_total)} or offload less.",)
    if spec.placement.accelerator == "none":  # CPU pods: their memory limits are the only capacity
        need = max((d.peak for d in base.devices if d.capacity is not None and d.peak > d.capacity), default=0)
        where = (
            "spec.learner.resources.limits.memory"
            if spec.rollout.colocated
            else "spec.learner.resources.limits.memory / spec.rollout.resources.limits.memory"
        )
        return (f"Raise the pods' memory limit ({where}) to at least {gib(need)}.",)
    singles, pair = advised_knobs(spec, shape, gpu_memory)
    out = []
    if singles:
        names = [k[0] for k in singles]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", or " + names[-1]
        out.append(f"To fit, {'any one of: ' if len(names) > 1 else ''}{listed}.")
    if pair is not None:
        lead = "Or, together" if singles else "No single knob is enough; together"
        out.append(f"{lead}: {pair[0][0]} and {pair[1][0]}.")
    if not out:
        more = "GPUs with more memory, more GPUs (spec.learner.gpus / replicas), or a smaller model"
        out.append(f"No knob of this job is enough, alone or in pairs: it needs {more}.")
    return tuple(out)


def advised_knobs(
    spec: JobSpec, shape: ModelShape, gpu_memory: int | None
) -> tuple[list[_Knob], tuple[_Knob, _Knob] | None]:
    """The knobs `advise` names for a GPU job that does not fit: the single ones that each make it fit, and a
    pair that does together (None when there is no pair or a gentle single knob is enough)."""
    # Only changes the job would be accepted with: what the validator refuses, or the learner refuses at start,
    # is no advice (every knob alone here, every pair below).
    knobs = [k for k in _knobs(spec, shape, gpu_memory) if refusal(changed(spec, k)) is None]

    def fits(*chosen: _Knob) -> bool:
        s = changed(spec, *chosen)
        return refusal(s) is None and plan_mode(s, shape, gpu_memory).fits

    singles = [k for k in knobs if fits(k)]
    # Switching full fine-tuning to LoRA changes the experiment: when it is the only single knob, also look
    # for a pair of the others.
    gentle = [k for k in knobs if not k[0].startswith("set spec.training.finetune")]
    pair = None
    if not any(k in gentle for k in singles):
        for pool in (gentle, knobs) if not singles else (gentle,):
            pair = next(((a, b) for i, a in enumerate(pool) for b in pool[i + 1 :] if fits(a, b)), None)
            if pair is not None:
                break
    return singles, pair
