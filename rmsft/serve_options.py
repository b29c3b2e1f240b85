"""The `rmsft serve` options a job spec implies: one translation, used by the operator (the
`serve.yaml` of the job's ConfigMap) and by `rmsft local` (the flags of its server processes), so
the two can never disagree. Torch-free: the operator imports it.

Keys are `rollout_engine.config.ServeConfig` fields. What depends on where the server runs (model
path as mounted, ports, staging dir) is added by the caller.
"""

from __future__ import annotations

from typing import Any

from rmsft.jobspec import RolloutMatchingJob


def serve_options(job: RolloutMatchingJob, *, gpus: bool) -> dict[str, Any]:
    """`gpus`: the server runs on GPUs. On CPUs the spec's GPU memory fraction is not passed: vLLM's
    CPU backend would read it as a fraction of the NUMA node's RAM; `kvCacheBytes` (or the server's
    CPU default) sizes the KV cache instead."""
    r = job.spec.rollout
    vision = job.spec.model.vision
    return {
        "backend": r.engine,
        "tensor_parallel_size": r.tensor_parallel_size,
        "gpu_memory_utilization": r.gpu_memory_utilization if gpus else None,
        "kv_cache_bytes": r.kv_cache_bytes or 0,
        "max_model_len": r.max_model_len,
        "enable_lora": r.enable_lora,
        "max_lora_rank": r.max_lora_rank,
        "enable_prefix_caching": r.enable_prefix_caching,
        "dtype": job.spec.model.dtype,
        # The engine's base seed; every request carries its own seed derived from this one.
        "seed": job.spec.training.rollout.seed,
        # GRPO's importance ratio compares the learner's log-probs with the sampled distribution's (temperature
        # applied); rollout-matching asks for none.
        "logprobs_mode": "processed" if job.spec.trainer == "grpo" else "raw",
        # Headroom over the learner's frame size for each piece's header.
        "max_frame_bytes": 2 * job.spec.sync.frame_bytes,
        # Images become the same tokens on the servers as in the learner's processor.
        "model_impl": r.model_impl,
        "min_pixels": vision.min_pixels or 0,
        "max_pixels": vision.max_pixels or 0,
        "max_images_per_prompt": vision.max_images_per_prompt,
        "max_image_pixels": vision.max_image_pixels,
        # spec.sync.transport nccl: the engine joins the learner's weight-transfer group with this backend.
        "weight_transfer": job.spec.sync.group_backend("nvidia" if gpus else "none"),
    }
