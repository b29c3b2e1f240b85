"""The arithmetic: bytes per device, component and phase of a job, in server and colocate mode (`plan_mode`),
and the same job laid out in the other mode on the same GPUs (`as_server`, `as_colocate`). Every figure rests
on `ASSUMPTIONS`, printed under every plan and in docs/memory.md."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from rmsft.jobspec import JobSpec
from rmsft.memory_plan.shapes import ModelShape
from rmsft.memory_plan.units import GiB, gib, parse_bytes

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
# vLLM-CPU's KV cache when neither kvCacheBytes nor a share is given (rollout_engine.vllm_engine).
CPU_DEFAULT_KV_CACHE_BYTES = 1 * GiB
# Share of a packed row taken by image tokens, for the vision tower's activations when it is trained.
IMAGE_TOKEN_SHARE = 0.5
DEFAULT_GPU_MEMORY = {"nvidia": 80 * GiB}
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "bfloat16": 2, "float16": 2, "float32": 4}

ASSUMPTIONS = (
    "AdamW keeps 2 moments in the trained parameters' dtype (fp32 for LoRA/DoRA adapters and under precision "
    "bf16); DeepSpeed adds an fp32 master copy of them; torch's step needs one moment-sized temporary. Only "
    "trainable parameters get gradients and optimizer state.",
    "ZeRO shards over the learner ranks: stage 1 the optimizer state, 2 also the gradients (plus one "
    f"{ZERO_REDUCE_BUCKET // 1_000_000}M-element reduce bucket), 3 also the weights (gathered whole for a sync).",
    "Gradients live from backward to the optimizer step (zero_grad frees them): none during generation.",
    "Activations: one packed row of training.packing_length tokens (batch 1); without gradient checkpointing "
    "every decoder layer keeps its inputs, q/k/v, attention output and the gated MLP's four intermediates; with "
    "it, one hidden state per layer plus one layer recomputed. Logits (with their fp32 copy, softmax and "
    "gradients) over the whole row with training.loss.logits full, over training.loss.logits_chunk target "
    "positions with chunked (the default: one chunk's logits exist at a time). The vision tower keeps "
    "activations only when it is trained "
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

# ---------------------------------------------------------------- a mode's devices and what each holds


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
        out: list[str] = []
        for d in self.devices:
            out.extend(d.problems)
            if d.capacity is not None and d.peak > d.capacity:
                out.append(
                    f"a {d.role} needs {gib(d.peak)} in its {d.peak_phase} phase, more than its {gib(d.capacity)}"
                )
        if self.host_limit is not None and self.host_total > self.host_limit:
            out.append(
                f"offloaded state needs {gib(self.host_total)} of host memory in the learner pod, more "
                f"than spec.learner.resources.limits.memory ({gib(self.host_limit)})"
            )
        return out


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
        adapters = shape.lora_params(t.lora.r, t.lora.target_modules, t.lora.use_dora)
        # training.lora.coord_rows (unset: on with a coordinate-token format): the 1000 coordinate rows of the
        # embedding train beside the adapter, and of an untied head too.
        rows = t.lora.coord_rows if t.lora.coord_rows is not None else t.format != "qwen_json"
        return adapters + (1000 * shape.hidden * (1 if shape.tied else 2) if rows else 0)
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
    return _Training(
        weights, weights_full, grads, optimizer, step_temp, activation_bytes(spec, shape, act, base), trainable
    )


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
    # Logits and their grad; the loss's fp32 copy and softmax grad: over the whole row (loss.logits full), or over
    # one chunk of target positions (chunked: the head runs per chunk and again per chunk in backward).
    rows = s if t.loss.logits == "full" else min(s, t.loss.logits_chunk)
    logits = rows * shape.vocab * (2 * act + 8)
    vision = 0
    if shape.vision_language and t.finetune == "full" and not t.freeze.vision_tower:
        patches = int(s * IMAGE_TOKEN_SHARE) * shape.spatial_merge**2
        vh, vi = shape.vision_hidden, shape.vision_intermediate
        per_patch = act * (8 * vh + 4 * vi)
        depth = 1 if t.gradient_checkpointing else shape.vision_depth
        vision = patches * per_patch * depth + (
            patches * vh * residual * shape.vision_depth if t.gradient_checkpointing else 0
        )
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


def _engine(
    spec: JobSpec,
    shape: ModelShape,
    *,
    tp: int,
    share: float | None,
    kv_bytes: int | None,
    capacity: int | None,
    where: str,
) -> _Engine:
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
                f"{where} x {gib(capacity)} = {gib(int(share * capacity))} leaves the engine "
                f"{gib(max(kv, 0))} of KV cache after {gib(weights)} of weights and {gib(acts + graphs)} of "
                f"activations and graphs; one {r.max_model_len}-token sequence (spec.rollout.maxModelLen) needs "
                f"{gib(kv_min)}"
            )
        kv = max(kv, 0)
    else:
        kv = kv_bytes if kv_bytes is not None else CPU_DEFAULT_KV_CACHE_BYTES
        if kv < kv_min:
            problems.append(
                f"a KV cache of {gib(kv)} holds {kv // per_token} tokens, fewer than one "
                f"{r.max_model_len}-token sequence (spec.rollout.maxModelLen)"
            )
    seqs = kv / kv_min if kv_min else 0
    notes = (f"KV cache: {kv // per_token:,} tokens, {seqs:.1f} sequences of maxModelLen {r.max_model_len}",)
    return _Engine(weights, acts, graphs, kv, kv_min, per_token, tuple(problems), notes)


def _hf_engine(spec: JobSpec, shape: ModelShape, sequences: int) -> _Engine:
    """The HF engine (spec.rollout.engine hf): no weights of its own in colocate, a dynamic KV cache for the
    sequences of one call at full length."""
    nbytes = _dtype_bytes(spec.model.dtype, shape)
    per_token = _kv_per_token(shape, nbytes, 1)
    kv = sequences * spec.rollout.max_model_len * per_token
    acts = sequences * shape.vocab * 4 + _engine_activations(shape, nbytes, 1) - ENGINE_MAX_SEQS * shape.vocab * 4
    return _Engine(
        0, acts, 0, kv, 0, per_token, (), (f"HF engine: a dynamic KV cache for {sequences} sequences of maxModelLen",)
    )


def _completions_per_step(spec: JobSpec) -> int:
    t = spec.training
    return t.prompts_per_step * (t.grpo.group_size if spec.trainer == "grpo" else 1)


def _server_plan(spec: JobSpec, shape: ModelShape, gpu_memory: int | None) -> ModePlan:
    r, gpu = spec.rollout, spec.placement.accelerator != "none"
    tp = r.tensor_parallel_size if gpu else 1
    # The learner's world: every GPU of every learner pod (spec.learner.nodes); ZeRO partitions over all of them.
    ranks = max(1, spec.learner.gpus) * spec.learner.nodes
    rollout_cap = gpu_memory if gpu else _limit(r.resources)
    learner_cap = gpu_memory if gpu else _limit(spec.learner.resources)
    if r.engine == "hf":
        seqs = math.ceil(_completions_per_step(spec) / max(1, r.replicas or 1))
        eng = _hf_engine(spec, shape, spec.training.rollout.generate_batch_size or seqs)
        eng = _Engine(
            shape.total_params * _dtype_bytes(spec.model.dtype, shape),
            eng.activations,
            0,
            eng.kv,
            0,
            eng.kv_per_token,
            (),
            eng.notes,
        )
    else:
        kv_bytes = r.kv_cache_bytes if (r.kv_cache_bytes or not gpu) else None
        eng = _engine(
            spec,
            shape,
            tp=tp,
            share=r.gpu_memory_utilization,
            kv_bytes=kv_bytes,
            capacity=rollout_cap,
            where="spec.rollout.gpuMemoryUtilization",
        )
    rollout_phase = {"engine weights": eng.weights, "engine activations": eng.activations, "KV cache": eng.kv}
    if eng.graphs:
        rollout_phase["CUDA graphs, vLLM runtime"] = eng.graphs
    tr = _training(spec, shape, ranks)
    learner_phases = _learner_phases(spec, tr, gpu)
    unit = "GPU" if gpu else "process"
    devices = (
        Device(
            f"rollout {unit}",
            (r.replicas or 0) * (tp if gpu else 1),
            rollout_cap,
            {"generate": rollout_phase},
            problems=eng.problems,
            notes=eng.notes,
        ),
        Device(f"learner {unit}", ranks if gpu else 1, learner_cap, learner_phases),
    )
    pods = spec.learner.nodes
    learner = (
        f"{spec.learner.gpus} learner GPU(s)"
        if pods == 1
        else f"{pods} learner pods x {spec.learner.gpus} GPU(s) (one node each)"
    )
    layout = (
        f"{r.replicas} rollout server(s) x TP {tp} + {learner}"
        if gpu
        else f"{r.replicas} rollout server process(es) + {pods} learner process(es), host memory"
    )
    return ModePlan("server", layout, devices)


def _learner_phases(
    spec: JobSpec,
    tr: _Training,
    gpu: bool,
    engine: dict[str, int] | None = None,
    sync_engine: dict[str, int] | None = None,
) -> dict[str, dict[str, int]]:
    """train (forward/backward), step (AdamW), and for ZeRO-3 the sync's whole-model gather. `engine`: what a
    colocated engine holds meanwhile; `sync_engine`: what it holds while weights are written into it."""
    runtime = {"CUDA context, NCCL": RUNTIME_BYTES} if gpu else {}
    engine = engine or {}
    sync_engine = engine if sync_engine is None else sync_engine
    train = {
        "training weights": tr.weights,
        "gradients": tr.grads,
        "optimizer state": tr.optimizer,
        "activations": tr.activations,
        **engine,
        **runtime,
    }
    step = {
        "training weights": tr.weights,
        "gradients": tr.grads,
        "optimizer state": tr.optimizer,
        "optimizer step temp": tr.step_temp,
        **engine,
        **runtime,
    }
    phases = {"train": train, "step": step}
    if spec.training.deepspeed_stage == 3:
        phases["sync"] = {
            "training weights": tr.weights_full,
            "optimizer state": tr.optimizer,
            **sync_engine,
            **runtime,
        }
    elif sync_engine != engine:  # a sleeping colocated engine wakes for the push, on top of the training state
        phases["sync"] = {"training weights": tr.weights, "optimizer state": tr.optimizer, **sync_engine, **runtime}
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
        eng = _engine(
            spec,
            shape,
            tp=tp,
            share=c.gpu_memory_utilization,
            kv_bytes=kv_bytes,
            capacity=cap,
            where="spec.rollout.colocate.gpuMemoryUtilization",
        )
    tr = _training(spec, shape, ranks)
    asleep = c.sleep_level > 0
    graphs = {"CUDA graphs, vLLM runtime": eng.graphs} if eng.graphs else {}
    # While training runs the engine holds its weights and KV cache unless it sleeps; its activations are
    # transient (the allocator hands them to training), its CUDA graphs stay.
    idle = graphs if asleep else {"engine weights": eng.weights, "KV cache": eng.kv, **graphs}
    # A sync writes into the engine's weights, so a sleeping engine wakes them first (its KV cache may wait).
    waking = {"engine weights": eng.weights, **idle}
    phases = _learner_phases(
        spec, tr, gpu, {k: v for k, v in idle.items() if v}, {k: v for k, v in waking.items() if v}
    )
    generate = {
        "training weights": 0 if c.offload_model else tr.weights,
        "optimizer state": 0 if c.offload_optimizer else tr.optimizer,
        "engine weights": eng.weights,
        "engine activations": eng.activations,
        "KV cache": eng.kv,
        **graphs,
    }
    if gpu:
        generate["CUDA context, NCCL"] = RUNTIME_BYTES
    phases["generate"] = {k: v for k, v in generate.items() if v or k == "training weights"}
    host = (
        (tr.weights if c.offload_model else 0)
        + (tr.optimizer if c.offload_optimizer else 0)
        + (eng.weights if c.sleep_level == 1 else 0)
    )
    knobs = [
        f"TP {tp}",
        f"gpuMemoryUtilization {c.gpu_memory_utilization}"
        if not c.kv_cache_bytes
        else f"kvCacheBytes {gib(c.kv_cache_bytes)}",
        f"sleepLevel {c.sleep_level}",
    ]
    knobs += [k for k, on in (("offloadModel", c.offload_model), ("offloadOptimizer", c.offload_optimizer)) if on]
    layout = (
        f"{spec.learner.gpus} GPU(s), each a learner rank with its engine share ({', '.join(knobs)})"
        if gpu
        else "1 learner process with its in-process engine, host memory"
    )
    device = Device(
        "GPU" if gpu else "learner process",
        ranks if gpu else 1,
        cap,
        phases,
        host_bytes=host,
        problems=eng.problems,
        notes=eng.notes,
    )
    host_limit = _limit(spec.learner.resources) if gpu else None
    return ModePlan("colocate", layout, (device,), host_limit=host_limit, host_total=host * ranks)


def as_colocate(spec: JobSpec) -> JobSpec:
    """A server job as colocate on the same GPUs: every GPU a learner rank with its engine share."""
    s = spec.model_copy(deep=True)
    s.rollout.mode, s.rollout.replicas = "colocate", 0
    if s.placement.accelerator != "none":
        s.learner.gpus = spec.gpus_needed
        if s.learner.gpus % s.rollout.colocate.tensor_parallel_size:
            s.rollout.colocate.tensor_parallel_size = 1
    return s


def as_server(spec: JobSpec) -> JobSpec | None:
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


def plan_mode(spec: JobSpec, shape: ModelShape, gpu_memory: int | None) -> ModePlan:
    """The plan of `spec` in its own mode (spec.rollout.mode) on GPUs of `gpu_memory` bytes."""
    return _colocate_plan(spec, shape, gpu_memory) if spec.rollout.colocated else _server_plan(spec, shape, gpu_memory)
