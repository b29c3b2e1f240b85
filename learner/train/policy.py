"""Loading the policy for training: HF model + tokenizer, LoRA/DoRA via peft or full fine-tuning.

Public API
- `load_policy(model_path, cfg, dtype="auto") -> Policy`: applies `cfg.precision`, `cfg.attn_implementation`
  and `cfg.gradient_checkpointing`; refuses combinations that cannot train with a `ModelLoadError` naming
  the spec field.
- `policy_from_model(model, tokenizer, cfg) -> Policy`: the same for a model already built (in
  `load_dtype(cfg, dtype)`), e.g. from a config with random weights.
- `Policy.autocast_dtype`: `torch.bfloat16` under `precision: bf16`, else None.
- `policy_autocast(policy, device)`: the context the forward runs in (`torch.autocast` or a no-op).
- `prompt_ids(tokenizer, messages)`.

Precision (docs/architecture.md, "Precision, attention, memory"):
- fp32: weights as `spec.model.dtype` says (default "auto": the checkpoint's dtype), no autocast.
- bf16: frozen weights in bf16, every trainable parameter in fp32 (LoRA/DoRA adapters; with
  `finetune: full` the whole model), forward under `torch.autocast(..., dtype=torch.bfloat16)`.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.core.codec import output_format
from learner.core.vocab import VocabView
from rmsft.exit_codes import CONFIG_EXIT
from rmsft.jobspec import TrainingConfig, VisionSpec
from rmsft.model_folder import is_vision_language
from rmsft.model_parts import ALIGNER, VISION_TOWER, part_of

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ModelLoadError(RuntimeError):
    """The model folder cannot be used for training; the message says why."""

    exit_code = CONFIG_EXIT  # spec.model.path or its settings: the same spec fails the same way


@dataclass
class Policy:
    model: Any  # transformers PreTrainedModel, possibly wrapped in a peft PeftModel
    tokenizer: Any
    vocab: VocabView
    is_peft: bool
    use_dora: bool
    # What the forward runs under (`policy_autocast`): bf16 for `precision: bf16`, None for fp32.
    autocast_dtype: torch.dtype | None = None
    # Vision-language models: the processor that turns messages + images into the model's inputs
    # (its pixel bounds set from spec.model.vision, as on every rollout server). None for text models.
    processor: Any = None

    @property
    def is_vision_language(self) -> bool:
        return self.processor is not None


def autocast_context(device: str | torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """`torch.autocast(device, dtype)`, or a no-op for `dtype` None.

    Run the forward (and the loss, which upcasts logits to fp32 itself) inside it and `backward()` outside:
    autograd replays each op in the dtype the forward used."""
    import torch

    device_type = torch.device(device).type
    # meta (shape-only placement tests) has no autocast; the dtypes are checked on the CPU instead.
    if dtype is None or device_type == "meta":
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def policy_autocast(policy: Policy, device: str | torch.device) -> AbstractContextManager:
    """Context for the policy's forward on `device`: autocast in `policy.autocast_dtype`, or a no-op."""
    return autocast_context(device, policy.autocast_dtype)


def training_device_type(cfg: TrainingConfig) -> str:
    """Device type of the training step, "cuda" or "cpu", from `spec.training.device` (auto = CUDA when visible)."""
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device.split(":", 1)[0]


def _flex_backward_on_cpu() -> bool:
    """Whether this torch's FlexAttention has a backward pass on the CPU (torch 2.13: no, it raises
    NotImplementedError at the first training forward). Asks torch's own device check so the refusal
    lifts by itself when a later torch adds it; an unknown torch layout counts as "no"."""
    import torch

    try:
        from torch.nn.attention.flex_attention import _validate_device
    except ImportError:
        return False
    q = torch.zeros(1, 1, 1, 16, requires_grad=True)
    try:
        _validate_device(q, q, q)
    except (NotImplementedError, ValueError):
        return False
    return True


def _checkpoint_dtype(path: Path) -> Any:
    """The dtype `from_pretrained(dtype="auto")` loads: the config's, float32 when it names none."""
    import torch
    from transformers import AutoConfig

    dt = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt or torch.float32


def _check_attention(path: Path, cfg: TrainingConfig, dtype: str) -> None:
    """Refuse, before any weight is read, an attention kernel that cannot train here."""
    import torch

    impl = cfg.attn_implementation
    field = f"spec.training.attn_implementation: {impl}"
    device_type = training_device_type(cfg)
    if impl == "flash_attention_2":
        missing = []
        if device_type != "cuda":
            missing.append(f"a CUDA device (spec.training.device {cfg.device!r} resolves to {device_type})")
        elif not torch.cuda.is_available():
            missing.append(f"a CUDA device (spec.training.device is {cfg.device!r} but torch sees no CUDA device)")
        if importlib.util.find_spec("flash_attn") is None:
            missing.append("the flash_attn package (not installed in the learner's image)")
        if missing:
            raise ModelLoadError(f"{field} needs {' and '.join(missing)}; use sdpa there instead")
        # FA2 kernels exist for fp16/bf16 only; transformers feeds them q/k/v in the autocast dtype or,
        # without autocast, in the weights' dtype, so fp32 weights without autocast fail at the first step.
        if cfg.precision == "fp32":
            weights = getattr(torch, name) if (name := _DTYPES.get(dtype)) else _checkpoint_dtype(path)
            if weights == torch.float32:
                raise ModelLoadError(
                    f"{field} computes in bf16/fp16 only, but spec.training.precision is fp32 and the weights load "
                    f"as float32; set spec.training.precision: bf16 (or spec.model.dtype: bfloat16)"
                )
    elif impl == "flex_attention" and device_type == "cpu" and not _flex_backward_on_cpu():
        raise ModelLoadError(
            f"{field} has no backward pass on the CPU in torch {torch.__version__} (it would fail at the first "
            f"training step); use sdpa or eager on the CPU, or train on CUDA (spec.training.device)"
        )


def load_dtype(cfg: TrainingConfig, dtype: str) -> Any:
    """The dtype the weights are read in. bf16 + LoRA: the frozen base in bf16 (adapters are made fp32
    after wrapping). bf16 + full: fp32, since every weight is trained and needs an fp32 master copy
    (reading bf16 then upcasting would also round an fp32 checkpoint). fp32: `spec.model.dtype` as before."""
    import torch

    if cfg.precision == "bf16":
        if dtype not in ("auto", "bfloat16"):
            log.info(
                "spec.training.precision bf16 decides the learner's weight dtypes; spec.model.dtype %s "
                "still applies to the rollout servers",
                dtype,
            )
        return torch.bfloat16 if cfg.finetune == "lora" else torch.float32
    return getattr(torch, name) if (name := _DTYPES.get(dtype)) else "auto"


def _enable_gradient_checkpointing(hf_model: Any) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    Non-reentrant checkpointing (stated, not left to a default that has changed before): it needs no
    input that requires grad, keeps the autocast state for the recompute, restores the RNG state so
    dropout masks repeat, and works with peft's frozen base. transformers' checkpointed layers force
    `use_cache=False` in training, which packed rows pass anyway (a cache breaks their block-causal mask)."""
    if not getattr(hf_model, "supports_gradient_checkpointing", False):
        raise ModelLoadError(
            f"spec.training.gradient_checkpointing: {type(hf_model).__name__} does not support gradient checkpointing"
        )
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    emb = hf_model.get_input_embeddings()
    # With frozen embeddings (LoRA) the first layer's input does not require grad; reentrant checkpointing
    # would then drop every gradient of the layers it wraps. transformers registers this hook itself today;
    # it is only added here when it did not, so a reentrant function swapped in later still trains.
    if emb is not None and not emb.weight.requires_grad and not getattr(hf_model, "_require_grads_hooks", None):
        hf_model.enable_input_require_grads()


def load_processor(path: str | Path, vision: VisionSpec | None = None) -> Any:
    """The model folder's processor with `vision`'s pixel bounds: what the rollout servers use too
    (`rmsft serve --min-pixels/--max-pixels` from the same spec), so prompts tokenize alike."""
    from transformers import AutoProcessor

    from rmsft.vl_processor import register

    register()  # rmsft's torchvision-free Qwen-VL processors, named by the tiny models' folders
    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"cannot load the processor of {path}: {exc}") from exc
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        raise ModelLoadError(
            f"AutoProcessor found no image processor in {path} (got {type(processor).__name__}): a vision-language "
            "model folder needs processor_config.json / preprocessor_config.json naming its processor"
        )
    if vision is not None and (vision.min_pixels or vision.max_pixels):
        size = dict(image_processor.size)
        if vision.min_pixels:
            size["shortest_edge"] = vision.min_pixels
        if vision.max_pixels:
            size["longest_edge"] = vision.max_pixels
        image_processor.size = size
    return processor


def _language_model_targets(names: list[str]) -> str:
    """LoRA targets restricted to the language model: peft matches bare module names anywhere, which in
    a vision-language model includes the vision tower (Qwen2.5-VL's vision MLP has gate/up/down_proj).
    A regex over the full module path keeps adapters where vLLM serves them (ENV.md: LoRA on the language
    model only)."""
    import re

    return r".*language_model\..*\.(" + "|".join(re.escape(n) for n in names) + r")$"


def _vision_parts(model: Any) -> tuple[list[Any], list[Any]]:
    """(vision tower parameters, aligner parameters) of a Qwen-VL model, split by rmsft.model_parts: the aligner
    is the merger that maps patch features to the language model's width, the tower is everything else under
    `visual`. The memory plan counts trainable parameters by the same split."""
    tower, aligner = [], []
    for name, p in model.named_parameters():
        part = part_of(name)
        if part == VISION_TOWER:
            tower.append(p)
        elif part == ALIGNER:
            aligner.append(p)
    return tower, aligner


def _apply_freeze(model: Any, cfg: TrainingConfig, vision_language: bool) -> None:
    """`training.freeze` under `finetune: full` (LoRA freezes the whole base model itself)."""
    frozen = []
    if vision_language:
        tower, aligner = _vision_parts(model)
        if cfg.freeze.vision_tower:
            frozen += tower
        if cfg.freeze.aligner:
            frozen += aligner
    if cfg.freeze.embeddings:
        frozen.append(model.get_input_embeddings().weight)
    for p in frozen:
        p.requires_grad_(False)


def warm_cpu_math_kernels() -> None:
    """Run torch's CPU transcendental kernels once on every intra-op thread before the first training forward.

    Why: in a learner process (not in a bare script), the first forward on the CPU sometimes computed the rotary
    embedding's cos on one of the OpenMP threads' share with an error of about 1.5e-4 (cos(0.13335) as 0.990972,
    not 0.991122), so that half of the packed row's logits moved by about 1e-3 and step 1 trained on them; every
    later forward was exact. `scripts/first_forward_check.py` found it in 5 of 14 runs of the cluster tier's tiny
    job on 2 cores (sdpa and eager attention alike; none of 6 on one thread), and in none of 16 with this call
    first (docs/development.md, "The CPU learner's first forward"). The kernels' first use is what goes wrong, so
    it happens here, on throwaway numbers. Cost: a few milliseconds, once per process."""
    import torch

    # Enough elements that torch's element-wise loops (grain 32768) hand every thread a share.
    x = torch.linspace(0.0, 8.0, 4 * 32768 * max(1, torch.get_num_threads()))
    for f in (torch.cos, torch.sin, torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.rsqrt, torch.erf):
        f(x)


def load_policy(
    model_path: str | Path, cfg: TrainingConfig, dtype: str = "auto", vision: VisionSpec | None = None
) -> Policy:
    """Tokenizer (and processor, for a vision-language model) + model for training with `cfg`'s fine-tuning
    mode, precision, attention kernel and gradient checkpointing. The model stays on the CPU, in train
    mode; the caller moves it to its device."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model folder {path} has no config.json (is spec.model.path right?)")
    _check_attention(path, cfg, dtype)
    if training_device_type(cfg) == "cpu":
        warm_cpu_math_kernels()
    vision_language = is_vision_language(path)
    processor = load_processor(path, vision) if vision_language else None
    model_class = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    try:
        tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(path)
        model = model_class.from_pretrained(
            path, dtype=load_dtype(cfg, dtype), attn_implementation=cfg.attn_implementation
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    return policy_from_model(model, tokenizer, cfg, vision_language=vision_language, processor=processor)


def policy_from_model(
    model: Any, tokenizer: Any, cfg: TrainingConfig, *, vision_language: bool = False, processor: Any = None
) -> Policy:
    """A loaded transformers model (weights in `load_dtype(cfg, dtype)`) made the training
    policy `cfg` asks for: LoRA/DoRA or freezing, fp32 masters under bf16, gradient checkpointing, train
    mode. `load_policy` ends here; benchmarks/gpu_step.py, which builds real-size models from a config with
    random weights (no folder of many GiB to write and read back), enters here so it trains what a job would."""
    import torch

    try:
        # Only coordexp writes coord tokens; qwen_json works with a stock Qwen-VL tokenizer.
        vocab = VocabView.from_hf_tokenizer(tokenizer, coord_tokens=output_format(cfg.format).coord_tokens)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc

    hf_model = model
    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lora = cfg.lora
        targets = list(lora.target_modules)
        peft_cfg = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates an int; it scales by alpha / r, a float too
            lora_dropout=lora.dropout,
            target_modules=_language_model_targets(targets) if vision_language else targets,
            use_dora=lora.use_dora,
            task_type="CAUSAL_LM",
            trainable_token_indices=coord_row_indices(model, cfg, vocab),
        )
        # autocast_adapter_dtype (peft's default) already makes adapters fp32 on a bf16 base.
        model = get_peft_model(model, peft_cfg, autocast_adapter_dtype=True)
    else:
        _apply_freeze(model, cfg, vision_language)
    if cfg.precision == "bf16":
        # fp32 master copies of what is trained: AdamW state follows the parameter dtype, and a bf16
        # weight (8 mantissa bits) drops an update smaller than ~1/256 of itself, so small-lr steps vanish.
        for p in _trainable(model):
            if p.dtype != torch.float32:
                p.data = p.data.float()
    if cfg.gradient_checkpointing:
        _enable_gradient_checkpointing(hf_model)
    model.train()
    log.info(
        "policy: %s finetune=%s precision=%s attn=%s gradient_checkpointing=%s trainable=%d",
        type(hf_model).__name__,
        cfg.finetune,
        cfg.precision,
        cfg.attn_implementation,
        cfg.gradient_checkpointing,
        sum(p.numel() for p in _trainable(model)),
    )
    return Policy(
        model,
        tokenizer,
        vocab,
        is_peft=cfg.finetune == "lora",
        use_dora=cfg.lora.use_dora,
        autocast_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
        processor=processor,
    )


def train_coord_rows(cfg: TrainingConfig) -> bool:
    """`training.lora.coord_rows` resolved: unset = on for a coordinate-token format (coordexp, coordjson)."""
    if cfg.lora.coord_rows is not None:
        return cfg.lora.coord_rows
    return output_format(cfg.format).coord_tokens


def coord_row_indices(model: Any, cfg: TrainingConfig, vocab: VocabView) -> dict[str, list[int]] | None:
    """peft's `trainable_token_indices` for the coordinate tokens' rows (training.lora.coord_rows), or None.
    The input embedding always; an untied output head too (a tied one is the same weight: peft wraps it with the
    embedding's rows itself)."""
    if not train_coord_rows(cfg) or not vocab.coord_token_ids:
        return None
    ids = [int(i) for i in vocab.coord_token_ids]
    rows = {"embed_tokens": ids}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is not embed.weight:  # untied (the weights themselves say)
        rows["lm_head"] = ids
    return rows


def _trainable(model: Any) -> Iterator[Any]:
    return (p for p in model.parameters() if p.requires_grad)


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended (what servers receive)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]
