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
assumptions they rest on are `ASSUMPTIONS` below, printed under every plan and in docs/memory.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rmsft.jobspec import JobSpec, JobSpecError, RolloutMatchingJob

GiB = 1 << 30
# vLLM's default token budget of one engine step (max_num_batched_tokens with chunked prefill) and the most
# sequences it samples at once: what its memory profile runs, so what its activation working set is sized by.
ENGINE_BATCHED_TOKENS = 8192
ENGINE_MAX_SEQS = 256
# CUDA graphs and vLLM's non-torch allocations; stays allocated while the engine sleeps.
ENGINE_GRAPHS_BYTES = 1 * GiB
# A training process's CUDA context, NCCL buffers and allocator slack, per GPU.
RUNTIME_BYTES = 1 * GiB
# DeepSpeed's default reduce bucket (elements) under ZeRO-2/3: a full-size gradient buffer next to the shards.
ZERO_REDUCE_BUCKET = 500_000_000
# vLLM-CPU's KV cache when neither kvCacheBytes nor a share is given (rollout_svc.vllm_engine).
CPU_DEFAULT_KV_CACHE_BYTES = 1 * GiB
# Share of a packed row taken by image tokens, for the vision tower's activations when it is trained.
IMAGE_TOKEN_SHARE = 0.5
DEFAULT_GPU_MEMORY = {"nvidia": 80 * GiB}
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_NAMES = {2: "bf16", 4: "fp32"}

ASSUMPTIONS = (
    "AdamW keeps 2 moments in the trained parameters' dtype (fp32 for LoRA/DoRA adapters and under precision "
    "bf16); DeepSpeed adds an fp32 master copy of them; torch's step needs one moment-sized temporary. Only "
    "trainable parameters get gradients and optimizer state.",
    "ZeRO shards over the learner ranks: stage 1 the optimizer state, 2 also the gradients (plus one "
    f"{ZERO_REDUCE_BUCKET // 1_000_000}M-element reduce bucket), 3 also the weights (gathered whole for a sync).",
    "Gradients live from backward to the optimizer step (zero_grad frees them): none during generation.",
    "Activations: one packed row of training.packing_length tokens (batch 1); without gradient checkpointing "
    "every decoder layer keeps its inputs, q/k/v, attention output and the gated MLP's four intermediates; with "
    "it, one hidden state per layer plus one layer recomputed. Logits over the whole row, and (upper bound) "
    "every position a cross-entropy target in fp32. The vision tower keeps activations only when it is trained "
    f"(then {IMAGE_TOKEN_SHARE:.0%} of the row taken as image tokens).",
    "Engine (vLLM): gpuMemoryUtilization x GPU memory is its whole footprint (weights split over the TP group, "
    f"a forward over {ENGINE_BATCHED_TOKENS} batched tokens, {ENGINE_GRAPHS_BYTES // GiB} GiB of CUDA graphs; "
    "the KV cache gets the rest) and the KV cache must hold at least one maxModelLen sequence; kvCacheBytes "
    "is per GPU, as vLLM's kv_cache_memory_bytes.",
    f"{RUNTIME_BYTES // GiB} GiB per training process for the CUDA context, NCCL and allocator slack.",
    "Sleep level 1 and 2 free the engine's weights and KV cache while training runs (level 1 keeps the weights "
    "in host memory); offloadModel / offloadOptimizer move the training weights / optimizer state to host "
    "memory while the engine generates.",
)


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
        raise MemoryPlanSettingError(f"{MEMORY_PLAN_ENV} must be one of {', '.join(MEMORY_PLAN_SETTINGS)} "
                                     f"(refuse when unset), got {raw!r}")
    return value


class ModelShapeError(ValueError):
    """No model shape to plan with: spec.model.path is not on this machine and no preset or --model-config
    names one. Callers at the learner's start may catch it and skip the plan."""


# ---------------------------------------------------------------- the model's shape and parameter counts


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its text dimensions and its parameters by part."""

    source: str  # where the counts came from, for the output
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    embed_params: int  # the input embeddings (the output head too when tied)
    lm_head_params: int  # 0 when tied
    decoder_params: int  # every decoder layer and the final norm
    vision_tower_params: int  # the image encoder's blocks, patch and position embeddings
    aligner_params: int  # the merger(s) mapping image features to the language model
    checkpoint_dtype: str | None  # safetensors name: BF16, F16, F32; None when unknown
    vision_hidden: int = 0
    vision_depth: int = 0
    vision_intermediate: int = 0
    spatial_merge: int = 1
    exact: bool = False  # counted from safetensors headers

    @property
    def total_params(self) -> int:
        return (self.embed_params + self.lm_head_params + self.decoder_params + self.vision_tower_params
                + self.aligner_params)  # fmt: skip

    @property
    def vision_language(self) -> bool:
        return self.vision_tower_params > 0

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each decoder-layer linear LoRA may target, by module name."""
        h, qd, kvd, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, qd), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (qd, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def lora_params(self, r: int, targets: list[str], dora: bool) -> int:
        """Adapter parameters peft adds on the language model's decoder layers: r x (in + out) per targeted
        linear, plus the magnitude vector (out) under DoRA. Names it does not know add nothing."""
        shapes = self.linear_shapes()
        per_layer = sum(r * (i + o) + (o if dora else 0) for name, (i, o) in shapes.items() if name in targets)
        return per_layer * self.layers


def _section(cfg: dict, key: str) -> dict:
    value = cfg.get(key)
    return value if isinstance(value, dict) else {}


def _text_section(cfg: dict) -> dict:
    # Qwen2.5-VL folders carry the text dimensions at the top, Qwen3-VL in text_config; transformers 5
    # writes both for Qwen2.5-VL. text_config wins when it has them.
    text = _section(cfg, "text_config")
    return text if "hidden_size" in text else cfg


def shape_from_config(cfg: dict, source: str = "config.json (analytic)") -> ModelShape:
    """Parameter counts from a config.json mapping, layer by layer as transformers builds Qwen2, Qwen3,
    Qwen2.5-VL and Qwen3-VL (other decoder-only families: attention_bias/mlp_bias, no q/k norms; other vision
    towers: a generic ViT estimate, said in `source`)."""
    text = _text_section(cfg)
    try:
        h, layers, heads = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["num_attention_heads"])
        vocab, inter = int(text["vocab_size"]), int(text["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelShapeError(f"model config has no {exc} (hidden_size, num_hidden_layers, num_attention_heads, "
                              "vocab_size and intermediate_size are needed)") from None
    if text.get("num_experts") or text.get("num_local_experts"):
        # Expert layers are not the dense MLP counted below; an undercount would let a job through.
        raise ModelShapeError("mixture-of-experts models are not covered by the memory plan yet")
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or h // heads)
    tied_value = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    tied = bool(tied_value)
    model_type = str(cfg.get("model_type", text.get("model_type", "")))
    qd, kvd = heads * head_dim, kv_heads * head_dim
    if model_type.startswith("qwen2"):  # q/k/v with bias, o_proj without, no q/k norms
        attn = h * qd + qd + 2 * (h * kvd + kvd) + qd * h
    else:
        bias = bool(text.get("attention_bias", False))
        attn = h * qd + 2 * h * kvd + qd * h + (qd + 2 * kvd + h if bias else 0)
        if model_type.startswith("qwen3"):
            attn += 2 * head_dim  # q_norm, k_norm over the head dimension
    mlp = 3 * h * inter + ((2 * inter + h) if text.get("mlp_bias") else 0)
    decoder = layers * (attn + mlp + 2 * h) + h  # two RMSNorms per layer, one final
    embed = vocab * h
    tower, aligner, v = _vision_params(cfg, model_type)
    if v.get("generic"):
        source += "; vision tower of an unknown family estimated as a plain ViT"
    dtype = None
    for section in (cfg, text):
        for key in ("dtype", "torch_dtype"):
            value = str(section.get(key, "")).removeprefix("torch.")
            if value in ("bfloat16", "float16", "float32"):
                dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[value]
                break
        if dtype:
            break
    return ModelShape(
        source=source, vocab=vocab, hidden=h, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=inter, tied=tied, embed_params=embed, lm_head_params=0 if tied else vocab * h,
        decoder_params=decoder, vision_tower_params=tower, aligner_params=aligner, checkpoint_dtype=dtype,
        vision_hidden=v.get("hidden", 0), vision_depth=v.get("depth", 0), vision_intermediate=v.get("inter", 0),
        spatial_merge=v.get("merge", 1),
    )  # fmt: skip


def _vision_params(cfg: dict, model_type: str) -> tuple[int, int, dict[str, Any]]:
    """(vision tower, aligner) parameters of a Qwen-VL vision_config, as transformers builds them."""
    vc = _section(cfg, "vision_config")
    if not vc:
        return 0, 0, {}
    vh = int(vc.get("hidden_size") or vc.get("embed_dim") or 0)
    depth = int(vc.get("depth") or vc.get("num_hidden_layers") or 0)
    vi = int(vc.get("intermediate_size") or 4 * vh)
    ps, tps = int(vc.get("patch_size", 14)), int(vc.get("temporal_patch_size", 2))
    ch = int(vc.get("in_channels") or vc.get("in_chans") or 3)
    m = int(vc.get("spatial_merge_size", 2))
    out = int(vc.get("out_hidden_size") or _text_section(cfg).get("hidden_size") or vh)
    big = vh * m * m  # the merger's width: m x m patches concatenated
    info: dict[str, Any] = {"hidden": vh, "depth": depth, "inter": vi, "merge": m}
    attn = 3 * vh * vh + 3 * vh + vh * vh + vh  # qkv and proj, with biases
    if model_type.startswith("qwen2_5_vl"):
        patch = ch * tps * ps * ps * vh  # Conv3d without bias
        block = 2 * vh + attn + 2 * (vh * vi + vi) + vi * vh + vh  # RMSNorms; gated MLP with biases
        merger = vh + big * big + big + big * out + out  # ln_q (RMSNorm), two linears
        return patch + depth * block, merger, info
    if model_type.startswith("qwen3_vl"):
        patch = ch * tps * ps * ps * vh + vh  # Conv3d with bias
        pos = int(vc.get("num_position_embeddings", 0)) * vh
        block = 4 * vh + attn + vh * vi + vi + vi * vh + vh  # LayerNorms; fc1/fc2 MLP with biases
        merger = 2 * vh + big * big + big + big * out + out  # LayerNorm before the shuffle
        deep = len(vc.get("deepstack_visual_indexes") or []) * (2 * big + big * big + big + big * out + out)
        return patch + pos + depth * block, merger + deep, info
    info["generic"] = True
    patch = ch * tps * ps * ps * vh
    block = 4 * vh + attn + 2 * vh * vi + vi + vh
    return patch + depth * block, vh + big * big + big + big * out + out, info


def shape_from_folder(folder: str | Path) -> ModelShape:
    """The shape of a local model folder: dimensions from config.json, parameter counts exact from the
    safetensors headers when the folder has weights (analytic from config.json otherwise)."""
    from rmsft.model_folder import model_config
    from rmsft.serving_dtype import safetensors_headers

    path = Path(folder)
    cfg = model_config(path)
    if not cfg:
        raise ModelShapeError(f"{path} has no readable config.json")
    shape = shape_from_config(cfg, f"{path}/config.json (analytic)")
    headers = safetensors_headers(path)
    if not headers:
        return shape
    counts = {"embed": 0, "lm_head": 0, "decoder": 0, "tower": 0, "aligner": 0}
    by_dtype: dict[str, int] = {}
    for _, header in headers:
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            n = math.prod(int(d) for d in info.get("shape", ()))
            by_dtype[info.get("dtype", "")] = by_dtype.get(info.get("dtype", ""), 0) + n
            parts = name.split(".")
            if "visual" in parts:
                key = "aligner" if any(p.startswith(("merger", "deepstack_merger")) for p in parts) else "tower"
            elif parts[0] == "lm_head":
                key = "lm_head"
            elif "embed_tokens" in parts:
                key = "embed"
            else:
                key = "decoder"
            counts[key] += n
    floating = {k: v for k, v in by_dtype.items() if k in ("BF16", "F16", "F32")}
    dtype = shape.checkpoint_dtype or (max(floating, key=floating.__getitem__) if floating else None)
    return ModelShape(
        **{**shape.__dict__, "source": f"{path} safetensors headers (exact)", "embed_params": counts["embed"],
           "lm_head_params": counts["lm_head"], "decoder_params": counts["decoder"],
           "vision_tower_params": counts["tower"], "aligner_params": counts["aligner"], "checkpoint_dtype": dtype,
           "exact": True},
    )  # fmt: skip


# Stock checkpoints' config.json values (Hugging Face, Qwen org), only what the counts read. A folder prepared
# for coordexp (`rmsft prepare-model`) has up to 1000 more vocabulary rows.
_QWEN3_VL_VISION = {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                    "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                    "temporal_patch_size": 2, "num_position_embeddings": 2304,
                    "deepstack_visual_indexes": [8, 16, 24]}  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen2.5-VL-7B": {
        "model_type": "qwen2_5_vl", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vision_config": {"model_type": "qwen2_5_vl", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
    },
    "Qwen3-VL-2B": {
        "model_type": "qwen3_vl", "tie_word_embeddings": True,
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 2048, "intermediate_size": 6144,
                        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                        "head_dim": 128, "vocab_size": 151936, "attention_bias": False, "dtype": "bfloat16"},
        "vision_config": {**_QWEN3_VL_VISION, "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                          "out_hidden_size": 2048, "deepstack_visual_indexes": [5, 11, 17]},
    },
    "Qwen3-VL-4B": {
        "model_type": "qwen3_vl", "tie_word_embeddings": True,
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 2560, "intermediate_size": 9728,
                        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "head_dim": 128, "vocab_size": 151936, "attention_bias": False, "dtype": "bfloat16"},
        "vision_config": {**_QWEN3_VL_VISION, "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                          "out_hidden_size": 2560, "deepstack_visual_indexes": [5, 11, 17]},
    },
    "Qwen3-VL-8B": {
        "model_type": "qwen3_vl", "tie_word_embeddings": False,
        "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096, "intermediate_size": 12288,
                        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "head_dim": 128, "vocab_size": 151936, "attention_bias": False, "dtype": "bfloat16"},
        "vision_config": {**_QWEN3_VL_VISION, "out_hidden_size": 4096},
    },
}  # fmt: skip


def preset_for(name: str) -> str | None:
    """The preset a model name or folder name stands for (`Qwen3-VL-2B-Instruct` -> `Qwen3-VL-2B`)."""
    base = Path(name.rstrip("/")).name.lower()
    for key in PRESETS:
        k = key.lower()
        if base == k or base.startswith(k + "-"):
            return key
    return None


def resolve_model_shape(spec: JobSpec, model_config: str | Path | None = None) -> ModelShape:
    """The shape to plan with: `model_config` (a config.json, a model folder or a preset name) when given,
    else spec.model.path when it is on this machine, else the preset its folder name matches."""
    if model_config is not None:
        text = str(model_config)
        path = Path(text)
        if path.is_dir():
            return shape_from_folder(path)
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ModelShapeError(f"cannot read {path}: {exc}") from None
            return shape_from_config(cfg if isinstance(cfg, dict) else {}, f"{path} (analytic)")
        preset = preset_for(text)
        if preset is None:
            raise ModelShapeError(f"--model-config {text!r} is neither a config.json, a model folder nor a preset "
                                  f"({', '.join(PRESETS)})")
        return shape_from_config(PRESETS[preset], f"preset {preset} (analytic)")
    folder = Path(spec.model.path)
    if (folder / "config.json").is_file():
        return shape_from_folder(folder)
    preset = preset_for(spec.model.path)
    if preset is not None:
        return shape_from_config(PRESETS[preset], f"preset {preset}, from spec.model.path's name (analytic)")
    raise ModelShapeError(f"spec.model.path {spec.model.path} is not on this machine and names no preset; pass "
                          f"--model-config with its config.json or one of {', '.join(PRESETS)}")


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Device:
    """One kind of device of a mode (`count` alike): bytes per component in each phase, on one device."""

    role: str
    count: int
    capacity: int | None  # None: unknown (CPU without a memory limit), never refused
    phases: dict[str, dict[str, int]]
    host_bytes: int = 0  # host memory this device's process takes for offload / sleep
    problems: tuple[str, ...] = ()  # beyond capacity: e.g. a KV cache smaller than one sequence
    notes: tuple[str, ...] = ()

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return not self.problems and (self.capacity is None or self.peak <= self.capacity)


@dataclass(frozen=True)
class ModePlan:
    mode: str  # "server" or "colocate"
    layout: str  # e.g. "6 rollout GPUs (TP 1) + 2 learner GPUs"
    devices: tuple[Device, ...]
    host_limit: int | None = None  # the learner pod's memory limit, when set
    host_total: int = 0  # host memory the learner pod needs for offload / sleep

    @property
    def fits(self) -> bool:
        host_ok = self.host_limit is None or self.host_total <= self.host_limit
        return host_ok and all(d.fits for d in self.devices)

    def failures(self) -> list[str]:
        out = []
        for d in self.devices:
            out.extend(d.problems)
            if d.capacity is not None and d.peak > d.capacity:
                out.append(f"a {d.role} needs {_gib(d.peak)} in its {d.peak_phase} phase, more than its "
                           f"{_gib(d.capacity)}")
        if self.host_limit is not None and self.host_total > self.host_limit:
            out.append(f"offloaded state needs {_gib(self.host_total)} of host memory in the learner pod, more "
                       f"than spec.learner.resources.limits.memory ({_gib(self.host_limit)})")
        return out


@dataclass(frozen=True)
class MemoryPlan:
    """Both modes' plans for a job; `mode` is the job's own, the one `fits` and `advice` are about."""

    job: str
    mode: str
    accelerator: str
    model: ModelShape
    trainable_params: int
    plans: dict[str, ModePlan]
    advice: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ASSUMPTIONS
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def own(self) -> ModePlan:
        return self.plans[self.mode]

    @property
    def fits(self) -> bool:
        return self.own.fits

    def message(self) -> str:
        """Why the job does not fit and what to turn (empty when it fits)."""
        if self.fits:
            return ""
        why = "; ".join(self.own.failures())
        knobs = " ".join(self.advice)
        return f"{self.job} does not fit ({self.mode} mode): {why}. {knobs}".strip()

    def lines(self) -> list[str]:
        """The plan as plain lines (for logs)."""
        out = [f"memory plan of {self.job}: model {_params(self.model.total_params)} parameters "
               f"({self.model.source}), {_params(self.trainable_params)} trainable"]
        for name, plan in self.plans.items():
            tag = "the job's mode" if name == self.mode else "for comparison"
            out.append(f"{name} ({tag}): {plan.layout}: {'fits' if plan.fits else 'does NOT fit'}")
            for d in plan.devices:
                cap = f" of {_gib(d.capacity)}" if d.capacity is not None else ""
                phases = ", ".join(f"{p} {_gib(d.total(p))}" for p in d.phases)
                out.append(f"  {d.count} x {d.role}: peak {_gib(d.peak)}{cap} ({phases})")
        if self.advice:
            out.append(" ".join(self.advice))
        return out

    def render(self) -> Any:
        """A rich renderable: one table per mode (rows: components, columns: device and phase), then the
        verdict, the advice and the assumptions."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = [Text(
            f"memory plan of {self.job}: {_params(self.model.total_params)} parameters "
            f"({_params(self.model.vision_tower_params + self.model.aligner_params)} in the vision tower and "
            f"aligner), {_params(self.trainable_params)} trainable; counts from {self.model.source}")]
        for name, plan in self.plans.items():
            own = name == self.mode
            verdict = "[green]fits[/green]" if plan.fits else "[red]does NOT fit[/red]"
            title = f"{name} mode ({'the job' if own else 'for comparison, same GPUs'}): {plan.layout}: {verdict}"
            parts.append(Text.from_markup(title))
            table = Table(show_lines=False, pad_edge=False)
            table.add_column("GiB per device", no_wrap=True)
            columns = [(d, p) for d in plan.devices for p in d.phases]
            for d, p in columns:
                table.add_column(f"{d.role} x{d.count}\n{p}", justify="right")
            rows: list[str] = []
            for d, p in columns:
                rows.extend(k for k in d.phases[p] if k not in rows)
            for row in rows:
                table.add_row(row, *(_num(d.phases[p].get(row)) for d, p in columns))
            table.add_row("[bold]total[/bold]", *(f"[bold]{_num(d.total(p))}[/bold]" for d, p in columns))
            table.add_row("capacity", *(_num(d.capacity) if d.capacity is not None else "-" for d, p in columns))
            parts.append(table)
            for d in plan.devices:
                for note in (*d.notes, *d.problems):
                    parts.append(Text(f"  {d.role}: {note}"))
                if d.host_bytes:
                    parts.append(Text(f"  {d.role}: {_gib(d.host_bytes)} of host memory per device "
                                      "(offload / sleep)"))
            for failure in plan.failures():
                parts.append(Text(f"  does not fit: {failure}", style="red"))
        if self.advice:
            parts.append(Text(" ".join(self.advice), style="yellow"))
        for note in self.notes:
            parts.append(Text(note))
        parts.append(Text("assumptions:", style="dim"))
        parts.extend(Text(f"  - {a}", style="dim") for a in self.assumptions)
        return Group(*parts)


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.0f} MiB"


def _num(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.1f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


_QUANTITY = re.compile(r"^\s*([0-9.]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40, "kib": 1 << 10,
          "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """`80GiB`, `80Gi` (binary), `80G`, `80GB` (decimal) or plain bytes, as a Kubernetes quantity reads."""
    m = _QUANTITY.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size (e.g. 80GiB, 80Gi, 96G)")
    return int(float(m.group(1)) * _UNITS[unit])


def default_gpu_memory(spec: JobSpec) -> int | None:
    """GPU memory when nothing says: the size in the node selector's GPU product label
    (`NVIDIA-H100-80GB-HBM3` -> 80 GiB), else the accelerator's default; None on CPUs."""
    if spec.placement.accelerator == "none":
        return None
    product = spec.placement.node_selector.get("nvidia.com/gpu.product", "")
    m = re.search(r"(\d+)\s*GB", product, re.IGNORECASE)
    if m:
        return int(m.group(1)) * GiB
    return DEFAULT_GPU_MEMORY.get(spec.placement.accelerator, 80 * GiB)


def _limit(resources: Any) -> int | None:
    value = resources.limits.get("memory")
    return parse_bytes(value) if value else None


# ---------------------------------------------------------------- the arithmetic


@dataclass(frozen=True)
class _Training:
    """Per-rank training state of a job, before the phases put it together."""

    weights: int  # on this rank (ZeRO-3: a shard)
    weights_full: int
    grads: int
    optimizer: int
    step_temp: int
    activations: int
    trainable: int


def _dtype_bytes(dtype: str, shape: ModelShape) -> int:
    if dtype != "auto":
        return _DTYPE_BYTES[dtype]
    return _DTYPE_BYTES.get(shape.checkpoint_dtype or "BF16", 2)


def trainable_params(spec: JobSpec, shape: ModelShape) -> int:
    """Parameters that get gradients and optimizer state: the adapters under LoRA/DoRA, the model less what
    training.freeze keeps fixed under full fine-tuning."""
    t = spec.training
    if t.finetune == "lora":
        return shape.lora_params(t.lora.r, t.lora.target_modules, t.lora.use_dora)
    n = shape.total_params
    if shape.vision_language:
        n -= shape.vision_tower_params if t.freeze.vision_tower else 0
        n -= shape.aligner_params if t.freeze.aligner else 0
    if t.freeze.embeddings:
        n -= shape.embed_params
    return n


def _training(spec: JobSpec, shape: ModelShape, ranks: int) -> _Training:
    t, stage = spec.training, spec.training.deepspeed_stage
    # learner/train/policy.py: bf16 + LoRA reads the base in bf16, bf16 + full in fp32 (master weights);
    # fp32 reads spec.model.dtype (auto = the checkpoint's). Adapters are fp32 (peft's autocast_adapter_dtype).
    base = (2 if t.finetune == "lora" else 4) if t.precision == "bf16" else _dtype_bytes(spec.model.dtype, shape)
    trainable = trainable_params(spec, shape)
    tbytes = 4 if (t.finetune == "lora" or t.precision == "bf16") else base
    weights_full = shape.total_params * base + (trainable * 4 if t.finetune == "lora" else 0)
    weights = weights_full // ranks if stage == 3 else weights_full
    grads = trainable * tbytes
    if stage >= 2:
        grads = grads // ranks + min(ZERO_REDUCE_BUCKET, trainable) * tbytes
    optimizer = trainable * 2 * tbytes + (trainable * 4 if stage >= 1 else 0)  # DeepSpeed's fp32 master copy
    step_temp = trainable * tbytes
    if stage >= 1:
        optimizer //= ranks
        step_temp //= ranks
    act = 2 if (t.precision == "bf16" or base == 2) else 4  # autocast or 16-bit weights compute in 16 bits
    return _Training(weights, weights_full, grads, optimizer, step_temp,
                     activation_bytes(spec, shape, act, base), trainable)  # fmt: skip


def activation_bytes(spec: JobSpec, shape: ModelShape, act: int = 2, residual: int = 2) -> int:
    """Activation memory of one packed row's forward and backward (see ASSUMPTIONS)."""
    t = spec.training
    s = t.packing_length
    h, qd, kvd, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    # per token and layer: norm inputs/outputs, q/k/v and their rotated copies, attention output, gated MLP's
    # gate, up, activation and product; RMSNorm's fp32 upcast of its input (two norms)
    per_token = act * (4 * h + 3 * qd + 3 * kvd + 4 * i) + 4 * 2 * h
    if t.finetune == "lora" and t.lora.dropout > 0:  # peft keeps each targeted linear's dropped input (+ mask)
        shapes = shape.linear_shapes()
        per_token += sum(shapes[n][0] for n in t.lora.target_modules if n in shapes) * (act + 1)
    if t.gradient_checkpointing:
        layers = s * shape.layers * h * residual + 2 * s * per_token  # boundaries + one layer and its grads
    else:
        layers = s * shape.layers * per_token
    logits = s * shape.vocab * (2 * act + 8)  # logits and their grad; the loss's fp32 copy and softmax grad
    vision = 0
    if shape.vision_language and t.finetune == "full" and not t.freeze.vision_tower:
        patches = int(s * IMAGE_TOKEN_SHARE) * shape.spatial_merge**2
        vh, vi = shape.vision_hidden, shape.vision_intermediate
        per_patch = act * (8 * vh + 4 * vi)
        depth = 1 if t.gradient_checkpointing else shape.vision_depth
        vision = patches * per_patch * depth + (patches * vh * residual * shape.vision_depth
                                                if t.gradient_checkpointing else 0)  # fmt: skip
    return layers + logits + vision


def _kv_per_token(shape: ModelShape, nbytes: int, tp: int) -> int:
    """KV cache bytes per token on one GPU of a TP group (KV heads split, replicated below one per GPU)."""
    heads = max(1, math.ceil(shape.kv_heads / tp))
    return 2 * shape.layers * heads * shape.head_dim * nbytes


def _engine_activations(shape: ModelShape, nbytes: int, tp: int) -> int:
    """vLLM's profiled working set: one step over ENGINE_BATCHED_TOKENS tokens (one layer at a time, split over
    the TP group), the vision encoder on as many merged patches, and the sampler's fp32 logits."""
    qd, kvd = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    text = ENGINE_BATCHED_TOKENS * (shape.hidden + (qd + 2 * kvd + 3 * shape.intermediate) // tp) * nbytes
    vision = 0
    if shape.vision_language:
        patches = ENGINE_BATCHED_TOKENS * shape.spatial_merge**2
        vision = patches * (4 * shape.vision_hidden + 2 * shape.vision_intermediate // tp) * nbytes
    return text + vision + ENGINE_MAX_SEQS * shape.vocab * 4


@dataclass(frozen=True)
class _Engine:
    weights: int
    activations: int
    graphs: int
    kv: int
    kv_min: int
    kv_per_token: int
    problems: tuple[str, ...]
    notes: tuple[str, ...]


def _engine(spec: JobSpec, shape: ModelShape, *, tp: int, share: float | None, kv_bytes: int | None,
            capacity: int | None, where: str) -> _Engine:
    """The engine on one device: weights at the serving dtype over `tp` GPUs, activations, CUDA graphs and a
    KV cache of `kv_bytes` or, from a share of `capacity`, whatever the share leaves."""
    r = spec.rollout
    nbytes = _dtype_bytes(spec.model.dtype, shape)
    gpu = spec.placement.accelerator != "none"
    per_token = _kv_per_token(shape, nbytes, tp)
    kv_min = r.max_model_len * per_token
    weights = shape.total_params * nbytes // tp
    acts = _engine_activations(shape, nbytes, tp)
    graphs = ENGINE_GRAPHS_BYTES if gpu else 0
    problems: list[str] = []
    if kv_bytes is None and gpu and share is not None and capacity is not None:
        kv = int(share * capacity) - weights - acts - graphs
        if kv < kv_min:
            problems.append(
                f"{where} x {_gib(capacity)} = {_gib(int(share * capacity))} leaves the engine "
                f"{_gib(max(kv, 0))} of KV cache after {_gib(weights)} of weights and {_gib(acts + graphs)} of "
                f"activations and graphs; one {r.max_model_len}-token sequence (spec.rollout.maxModelLen) needs "
                f"{_gib(kv_min)}")
        kv = max(kv, 0)
    else:
        kv = kv_bytes if kv_bytes is not None else CPU_DEFAULT_KV_CACHE_BYTES
        if kv < kv_min:
            problems.append(f"a KV cache of {_gib(kv)} holds {kv // per_token} tokens, fewer than one "
                            f"{r.max_model_len}-token sequence (spec.rollout.maxModelLen)")
    seqs = kv / kv_min if kv_min else 0
    notes = (f"KV cache: {kv // per_token:,} tokens, {seqs:.1f} sequences of maxModelLen "
             f"{r.max_model_len}",)
    return _Engine(weights, acts, graphs, kv, kv_min, per_token, tuple(problems), notes)


def _hf_engine(spec: JobSpec, shape: ModelShape, sequences: int) -> _Engine:
    """The HF engine (spec.rollout.engine hf): no weights of its own in colocate, a dynamic KV cache for the
    sequences of one call at full length."""
    nbytes = _dtype_bytes(spec.model.dtype, shape)
    per_token = _kv_per_token(shape, nbytes, 1)
    kv = sequences * spec.rollout.max_model_len * per_token
    acts = sequences * shape.vocab * 4 + _engine_activations(shape, nbytes, 1) - ENGINE_MAX_SEQS * shape.vocab * 4
    return _Engine(0, acts, 0, kv, 0, per_token, (),
                   (f"HF engine: a dynamic KV cache for {sequences} sequences of maxModelLen",))


def _completions_per_step(spec: JobSpec) -> int:
    t = spec.training
    return t.prompts_per_step * (t.grpo.group_size if spec.trainer == "grpo" else 1)


def _server_plan(spec: JobSpec, shape: ModelShape, gpu_memory: int | None) -> ModePlan:
    r, gpu = spec.rollout, spec.placement.accelerator != "none"
    tp = r.tensor_parallel_size if gpu else 1
    ranks = max(1, spec.learner.gpus)
    rollout_cap = gpu_memory if gpu else _limit(r.resources)
    learner_cap = gpu_memory if gpu else _limit(spec.learner.resources)
    if r.engine == "hf":
        seqs = math.ceil(_completions_per_step(spec) / max(1, r.replicas or 1))
        eng = _hf_engine(spec, shape, spec.training.rollout.generate_batch_size or seqs)
        eng = _Engine(shape.total_params * _dtype_bytes(spec.model.dtype, shape), eng.activations, 0, eng.kv, 0,
                      eng.kv_per_token, (), eng.notes)
    else:
        kv_bytes = r.kv_cache_bytes if (r.kv_cache_bytes or not gpu) else None
        eng = _engine(spec, shape, tp=tp, share=r.gpu_memory_utilization, kv_bytes=kv_bytes, capacity=rollout_cap,
                      where="spec.rollout.gpuMemoryUtilization")
    rollout_phase = {"engine weights": eng.weights, "engine activations": eng.activations, "KV cache": eng.kv}
    if eng.graphs:
        rollout_phase["CUDA graphs, vLLM runtime"] = eng.graphs
    tr = _training(spec, shape, ranks)
    learner_phases = _learner_phases(spec, tr, gpu)
    unit = "GPU" if gpu else "process"
    devices = (
        Device(f"rollout {unit}", (r.replicas or 0) * (tp if gpu else 1), rollout_cap, {"generate": rollout_phase},
               problems=eng.problems, notes=eng.notes),
        Device(f"learner {unit}", ranks if gpu else 1, learner_cap, learner_phases),
    )
    layout = (f"{r.replicas} rollout server(s) x TP {tp} + {spec.learner.gpus} learner GPU(s)" if gpu
              else f"{r.replicas} rollout server process(es) + 1 learner process, host memory")
    return ModePlan("server", layout, devices)


def _learner_phases(spec: JobSpec, tr: _Training, gpu: bool, engine: dict[str, int] | None = None,
                    sync_engine: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """train (forward/backward), step (AdamW), and for ZeRO-3 the sync's whole-model gather. `engine`: what a
    colocated engine holds meanwhile; `sync_engine`: what it holds while weights are written into it."""
    runtime = {"CUDA context, NCCL": RUNTIME_BYTES} if gpu else {}
    engine = engine or {}
    sync_engine = engine if sync_engine is None else sync_engine
    train = {"training weights": tr.weights, "gradients": tr.grads, "optimizer state": tr.optimizer,
             "activations": tr.activations, **engine, **runtime}  # fmt: skip
    step = {"training weights": tr.weights, "gradients": tr.grads, "optimizer state": tr.optimizer,
            "optimizer step temp": tr.step_temp, **engine, **runtime}  # fmt: skip
    phases = {"train": train, "step": step}
    if spec.training.deepspeed_stage == 3:
        phases["sync"] = {"training weights": tr.weights_full, "optimizer state": tr.optimizer, **sync_engine,
                          **runtime}
    return phases


def _colocate_plan(spec: JobSpec, shape: ModelShape, gpu_memory: int | None) -> ModePlan:
    c, r, gpu = spec.rollout.colocate, spec.rollout, spec.placement.accelerator != "none"
    ranks = max(1, spec.learner.gpus)
    tp = c.tensor_parallel_size if gpu else 1
    cap = gpu_memory if gpu else _limit(spec.learner.resources)
    if r.engine == "hf":
        seqs = c.generate_batch_size or math.ceil(_completions_per_step(spec) / ranks)
        eng = _hf_engine(spec, shape, seqs)
    else:
        kv_bytes = c.kv_cache_bytes if (c.kv_cache_bytes or not gpu) else None
        eng = _engine(spec, shape, tp=tp, share=c.gpu_memory_utilization, kv_bytes=kv_bytes, capacity=cap,
                      where="spec.rollout.colocate.gpuMemoryUtilization")
    tr = _training(spec, shape, ranks)
    asleep = c.sleep_level > 0
    graphs = {"CUDA graphs, vLLM runtime": eng.graphs} if eng.graphs else {}
    # While training runs the engine holds its weights and KV cache unless it sleeps; its activations are
    # transient (the allocator hands them to training), its CUDA graphs stay.
    idle = graphs if asleep else {"engine weights": eng.weights, "KV cache": eng.kv, **graphs}
    # A sync writes into the engine's weights, so a sleeping engine wakes them first (its KV cache may wait).
    waking = {"engine weights": eng.weights, **idle}
    phases = _learner_phases(spec, tr, gpu, {k: v for k, v in idle.items() if v},
                             {k: v for k, v in waking.items() if v})
    generate = {
        "training weights": 0 if c.offload_model else tr.weights,
        "optimizer state": 0 if c.offload_optimizer else tr.optimizer,
        "engine weights": eng.weights, "engine activations": eng.activations, "KV cache": eng.kv, **graphs,
    }  # fmt: skip
    if gpu:
        generate["CUDA context, NCCL"] = RUNTIME_BYTES
    phases["generate"] = {k: v for k, v in generate.items() if v or k == "training weights"}
    host = (tr.weights if c.offload_model else 0) + (tr.optimizer if c.offload_optimizer else 0) \
        + (eng.weights if c.sleep_level == 1 else 0)
    knobs = [f"TP {tp}", f"gpuMemoryUtilization {c.gpu_memory_utilization}" if not c.kv_cache_bytes
             else f"kvCacheBytes {_gib(c.kv_cache_bytes)}", f"sleepLevel {c.sleep_level}"]
    knobs += [k for k, on in (("offloadModel", c.offload_model), ("offloadOptimizer", c.offload_optimizer)) if on]
    layout = (f"{spec.learner.gpus} GPU(s), each a learner rank with its engine share ({', '.join(knobs)})" if gpu
              else "1 learner process with its in-process engine, host memory")
    device = Device("GPU" if gpu else "learner process", ranks if gpu else 1, cap, phases, host_bytes=host,
                    problems=eng.problems, notes=eng.notes)
    host_limit = _limit(spec.learner.resources) if gpu else None
    return ModePlan("colocate", layout, (device,), host_limit=host_limit, host_total=host * ranks)


def _as_colocate(spec: JobSpec) -> JobSpec:
    """A server job as colocate on the same GPUs: every GPU a learner rank with its engine share."""
    s = spec.model_copy(deep=True)
    s.rollout.mode, s.rollout.replicas = "colocate", 0
    if s.placement.accelerator != "none":
        s.learner.gpus = spec.gpus_needed
        if s.learner.gpus % s.rollout.colocate.tensor_parallel_size:
            s.rollout.colocate.tensor_parallel_size = 1
    return s


def _as_server(spec: JobSpec) -> JobSpec | None:
    """A colocate job as server on the same GPUs: a quarter of them (at least one) learns, the rest serve
    at TP 1; None where there are fewer than 2 GPUs to split."""
    s = spec.model_copy(deep=True)
    s.rollout.mode = "server"
    if s.placement.accelerator == "none":
        s.rollout.replicas = 1
        return s
    n = spec.learner.gpus
    if n < 2:
        return None
    s.learner.gpus = max(1, n // 4)
    s.rollout.replicas, s.rollout.tensor_parallel_size = n - s.learner.gpus, 1
    return s


def _plan_mode(spec: JobSpec, shape: ModelShape, gpu_memory: int | None) -> ModePlan:
    return _colocate_plan(spec, shape, gpu_memory) if spec.rollout.colocated else _server_plan(spec, shape, gpu_memory)


# ---------------------------------------------------------------- advice: which knob makes it fit


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
        return _plan_mode(s, shape, gpu_memory).fits

    if r.colocated and gpu and r.engine == "vllm" and not c.kv_cache_bytes:
        # The largest share (in steps of 0.05) that still fits, below or above the current one.
        shares = [round(x * 0.05, 2) for x in range(19, 0, -1)]
        for share in shares:
            if share != c.gpu_memory_utilization and fits_with(_set("rollout.colocate.gpu_memory_utilization", share)):
                verb = "lower" if share < c.gpu_memory_utilization else "raise"
                knobs.append((f"{verb} spec.rollout.colocate.gpuMemoryUtilization to {share}",
                              _set("rollout.colocate.gpu_memory_utilization", share)))
                break
        else:  # none fits alone: a smaller share to pair with another knob
            share = round(c.gpu_memory_utilization - 0.1, 2)
            if share >= 0.1:
                knobs.append((f"lower spec.rollout.colocate.gpuMemoryUtilization to {share}",
                              _set("rollout.colocate.gpu_memory_utilization", share)))
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
                knobs.append((f"raise spec.rollout.colocate.tensorParallelSize to {tp}",
                              _set("rollout.colocate.tensor_parallel_size", tp)))
                break
    if not r.colocated and gpu and t.deepspeed_stage >= 1:
        # Rollout GPUs to the learner: ZeRO shards the training state over more ranks on the same node.
        learners, servers = spec.learner.gpus * 2, r.replicas
        while learners <= spec.gpus_needed - r.tensor_parallel_size:
            servers = (spec.gpus_needed - learners) // r.tensor_parallel_size
            if servers >= 1:
                knobs.append((f"move GPUs to the learner (spec.rollout.replicas {servers}, spec.learner.gpus "
                              f"{learners})", _shift(servers, learners)))
                break
            learners *= 2
    if not r.colocated and gpu and r.engine == "vllm" and not r.kv_cache_bytes:
        for share in [round(x * 0.05, 2) for x in range(1, 20)]:
            if share > r.gpu_memory_utilization and fits_with(_set("rollout.gpu_memory_utilization", share)):
                knobs.append((f"raise spec.rollout.gpuMemoryUtilization to {share}",
                              _set("rollout.gpu_memory_utilization", share)))
                break
        for tp in (2, 4, 8):
            if tp > r.tensor_parallel_size:
                knobs.append((f"raise spec.rollout.tensorParallelSize to {tp}",
                              _set("rollout.tensor_parallel_size", tp)))
                break
    if not t.gradient_checkpointing:
        knobs.append(("set spec.training.gradient_checkpointing: true",
                      _set("training.gradient_checkpointing", True)))
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


OFFLOAD_OPTIMIZER_ZERO3 = ("spec.rollout.colocate.offloadOptimizer is not available with "
                           "spec.training.deepspeed_stage 3 (the learner refuses it at start)")


def changed(spec: JobSpec, *chosen: _Knob) -> JobSpec:
    """A copy of `spec` with the knobs' changes applied (not validated: see `refusal`)."""
    s = spec.model_copy(deep=True)
    for _, apply in chosen:
        apply(s)
    return s


def refusal(spec: JobSpec) -> str | None:
    """Why `spec` (e.g. a job changed by advice) would be refused before it trains, else None: the job spec
    validator (the same rules as the CRD's and `rmsft local`'s), then what the learner refuses at start although
    the spec allows it (offloading the optimizer under ZeRO-3: learner.colocate.offload)."""
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
    base = _plan_mode(spec, shape, gpu_memory)
    if base.fits:
        return ()
    if base.host_limit is not None and base.host_total > base.host_limit and all(d.fits for d in base.devices):
        return (f"Raise spec.learner.resources.limits.memory to at least {_gib(base.host_total)} or offload less.",)
    if spec.placement.accelerator == "none":  # CPU pods: their memory limits are the only capacity
        need = max((d.peak for d in base.devices if d.capacity is not None and d.peak > d.capacity), default=0)
        where = "spec.learner.resources.limits.memory" if spec.rollout.colocated else \
            "spec.learner.resources.limits.memory / spec.rollout.resources.limits.memory"
        return (f"Raise the pods' memory limit ({where}) to at least {_gib(need)}.",)
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


def advised_knobs(spec: JobSpec, shape: ModelShape,
                  gpu_memory: int | None) -> tuple[list[_Knob], tuple[_Knob, _Knob] | None]:
    """The knobs `advise` names for a GPU job that does not fit: the single ones that each make it fit, and a
    pair that does together (None when there is no pair or a gentle single knob is enough)."""
    # Only changes the job would be accepted with: what the validator refuses, or the learner refuses at start,
    # is no advice (every knob alone here, every pair below).
    knobs = [k for k in _knobs(spec, shape, gpu_memory) if refusal(changed(spec, k)) is None]

    def fits(*chosen: _Knob) -> bool:
        s = changed(spec, *chosen)
        return refusal(s) is None and _plan_mode(s, shape, gpu_memory).fits

    singles = [k for k in knobs if fits(k)]
    # Switching full fine-tuning to LoRA changes the experiment: when it is the only single knob, also look
    # for a pair of the others.
    gentle = [k for k in knobs if not k[0].startswith("set spec.training.finetune")]
    pair = None
    if not any(k in gentle for k in singles):
        for pool in (gentle, knobs) if not singles else (gentle,):
            pair = next(((a, b) for i, a in enumerate(pool) for b in pool[i + 1:] if fits(a, b)), None)
            if pair is not None:
                break
    return singles, pair


# ---------------------------------------------------------------- entry points


def plan_memory(job: RolloutMatchingJob, *, gpu_memory: int | None = None,
                model_config: str | Path | None = None, shape: ModelShape | None = None) -> MemoryPlan:
    """The memory plan of `job` in both modes. `gpu_memory`: bytes per GPU (default: the node selector's GPU
    product, else 80 GiB for nvidia); `model_config`: a config.json, model folder or preset name to use instead
    of spec.model.path. Raises ModelShapeError when no model shape can be found."""
    spec = job.spec
    shape = shape or resolve_model_shape(spec, model_config)
    memory = gpu_memory if gpu_memory is not None else default_gpu_memory(spec)
    if spec.placement.accelerator == "none":
        memory = None  # CPU jobs: host memory, bounded only by the pods' limits
    plans = {spec.rollout.mode: _plan_mode(spec, shape, memory)}
    notes: list[str] = []
    other = _as_server(spec) if spec.rollout.colocated else _as_colocate(spec)
    if other is not None:
        plans[other.rollout.mode] = _plan_mode(other, shape, memory)
    else:
        notes.append("server mode for comparison needs at least 2 GPUs (one rollout, one learner)")
    ordered = {k: plans[k] for k in ("server", "colocate") if k in plans}
    if memory is not None:
        notes.append(f"GPU memory: {_gib(memory)} per GPU"
                     + ("" if gpu_memory is not None else " (default for the accelerator / node selector; "
                        "--gpu-memory to change)"))
    return MemoryPlan(job=job.metadata.name, mode=spec.rollout.mode, accelerator=spec.placement.accelerator,
                      model=shape, trainable_params=trainable_params(spec, shape), plans=ordered,
                      advice=advise(spec, shape, memory), notes=tuple(notes))  # fmt: skip


def check_memory_plan(job: RolloutMatchingJob, *, gpu_memory: int | None = None,
                      model_config: str | Path | None = None) -> MemoryPlan:
    """The plan of `job`; raises MemoryPlanError (a JobSpecError, so a ValueError) naming the knobs to turn
    when its own mode cannot fit. The learner calls this at start; pass the real device's memory as
    `gpu_memory` where it is known."""
    plan = plan_memory(job, gpu_memory=gpu_memory, model_config=model_config)
    if not plan.fits:
        raise MemoryPlanError(plan.message(), plan)
    return plan
