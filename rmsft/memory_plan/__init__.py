"""A memory plan before anything starts: what one GPU (or, on CPUs, one process) holds in each phase of a job.

`rmsft plan job.yaml` prints it; the learner calls `check_memory_plan(job)` at start. Both modes are planned:
- **server**: a rollout GPU holds the engine (weights at the serving dtype, split over its TP group, its
  activations and CUDA graphs, and a KV cache filling `spec.rollout.gpuMemoryUtilization`); a learner GPU holds
  the training state (weights, gradients, optimizer state, activations), sharded by ZeRO over the learner ranks.
- **colocate**: one GPU holds both. With `sleepLevel: 0` the engine's share stays allocated while training
  runs, so the peak is the sum; `sleepLevel: 1/2` frees the engine's weights and KV cache during training and
  `offloadModel` / `offloadOptimizer` move training state to host memory during generation, so the peak becomes
  the larger of the training and the generation phase instead of their sum.

A job whose own mode cannot fit is refused (`MemoryPlanError`, a `JobSpecError`) with the knobs that would
make it fit, each found by planning the changed job again, not by a rule of thumb. The other mode is shown
for comparison on the same GPUs and never refuses anything.

Pure arithmetic: config.json (or safetensors headers, when the model folder is on this machine) in, bytes out.
No torch, nothing of the learner: the base package (tests/test_imports.py). The numbers are estimates; the
assumptions they rest on are `ASSUMPTIONS` (arithmetic.py), printed under every plan and in docs/memory.md.

One module per idea, each importing only those above it in this list:
- units.py: bytes as people write and read them (`parse_bytes`, `gib`).
- shapes.py: the model's shape and parameter counts, from safetensors headers, config.json or a preset.
- arithmetic.py: bytes per device, component and phase in each mode, and the assumptions they rest on.
- render.py: `MemoryPlan`, and how it reads (log lines, the refusal's message, `rmsft plan`'s tables).
- advice.py: which knob makes a job fit, each checked by planning the changed job again.
- check.py: the entry points (`plan_memory`, `check_memory_plan`) and the RMSFT_MEMORY_PLAN switch.
This package re-exports what the rest of the project imports.
"""

from rmsft.memory_plan.advice import advised_knobs, changed
from rmsft.memory_plan.arithmetic import RUNTIME_BYTES, ZERO_REDUCE_BUCKET, default_gpu_memory, trainable_params
from rmsft.memory_plan.check import (
    MEMORY_PLAN_ENV,
    MemoryPlanError,
    MemoryPlanSettingError,
    check_memory_plan,
    memory_plan_setting,
    plan_memory,
)
from rmsft.memory_plan.shapes import PRESETS, ModelShapeError, preset_for, shape_from_config, shape_from_folder
from rmsft.memory_plan.units import GiB, parse_bytes

__all__ = [
    "MEMORY_PLAN_ENV",
    "PRESETS",
    "RUNTIME_BYTES",
    "ZERO_REDUCE_BUCKET",
    "GiB",
    "MemoryPlanError",
    "MemoryPlanSettingError",
    "ModelShapeError",
    "advised_knobs",
    "changed",
    "check_memory_plan",
    "default_gpu_memory",
    "memory_plan_setting",
    "parse_bytes",
    "plan_memory",
    "preset_for",
    "shape_from_config",
    "shape_from_folder",
    "trainable_params",
]
