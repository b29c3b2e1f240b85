"""The model's shape: its text and vision dimensions and its parameters by part (the split rmsft.model_parts
defines, the one the learner freezes by). Exact from the safetensors headers when the model folder is on this
machine; else analytic from its config.json, a config.json given instead, or the preset of a stock checkpoint
its folder name matches (`PRESETS`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from rmsft.jobspec import JobSpec
from rmsft.model_parts import Part, part_of


class ModelShapeError(ValueError):
    """No model shape to plan with: spec.model.path is not on this machine and no preset or --model-config
    names one. Callers at the learner's start may catch it and skip the plan."""


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
        return (
            self.embed_params
            + self.lm_head_params
            + self.decoder_params
            + self.vision_tower_params
            + self.aligner_params
        )

    @property
    def vision_language(self) -> bool:
        return self.vision_tower_params > 0

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each decoder-layer linear LoRA may target, by module name."""
        h, qd, kvd, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (h, qd),
            "k_proj": (h, kvd),
            "v_proj": (h, kvd),
            "o_proj": (qd, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

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
        raise ModelShapeError(
            f"model config has no {exc} (hidden_size, num_hidden_layers, num_attention_heads, "
            "vocab_size and intermediate_size are needed)"
        ) from None
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
        source=source,
        vocab=vocab,
        hidden=h,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=inter,
        tied=tied,
        embed_params=embed,
        lm_head_params=0 if tied else vocab * h,
        decoder_params=decoder,
        vision_tower_params=tower,
        aligner_params=aligner,
        checkpoint_dtype=dtype,
        vision_hidden=v.get("hidden", 0),
        vision_depth=v.get("depth", 0),
        vision_intermediate=v.get("inter", 0),
        spatial_merge=v.get("merge", 1),
    )


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
    counts = dict.fromkeys(get_args(Part), 0)
    by_dtype: dict[str, int] = {}
    for _, header in headers:
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            n = math.prod(int(d) for d in info.get("shape", ()))
            by_dtype[info.get("dtype", "")] = by_dtype.get(info.get("dtype", ""), 0) + n
            counts[part_of(name)] += n  # the split the learner freezes by (rmsft.model_parts)
    floating = {k: v for k, v in by_dtype.items() if k in ("BF16", "F16", "F32")}
    dtype = shape.checkpoint_dtype or (max(floating, key=floating.__getitem__) if floating else None)
    return ModelShape(
        **{
            **shape.__dict__,
            "source": f"{path} safetensors headers (exact)",
            "embed_params": counts["embeddings"],
            "lm_head_params": counts["lm_head"],
            "decoder_params": counts["decoder"],
            "vision_tower_params": counts["vision_tower"],
            "aligner_params": counts["aligner"],
            "checkpoint_dtype": dtype,
            "exact": True,
        },
    )


# Stock checkpoints' config.json values (Hugging Face, Qwen org), only what the counts read. A folder prepared
# for coordexp (`rmsft prepare-model`) has up to 1000 more vocabulary rows.
_QWEN3_VL_VISION = {
    "model_type": "qwen3_vl",
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen2.5-VL-7B": {
        "model_type": "qwen2_5_vl",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    },
    "Qwen3-VL-2B": {
        "model_type": "qwen3_vl",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "attention_bias": False,
            "dtype": "bfloat16",
        },
        "vision_config": {
            **_QWEN3_VL_VISION,
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "out_hidden_size": 2048,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    },
    "Qwen3-VL-4B": {
        "model_type": "qwen3_vl",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "attention_bias": False,
            "dtype": "bfloat16",
        },
        "vision_config": {
            **_QWEN3_VL_VISION,
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "out_hidden_size": 2560,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    },
    "Qwen3-VL-8B": {
        "model_type": "qwen3_vl",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "attention_bias": False,
            "dtype": "bfloat16",
        },
        "vision_config": {**_QWEN3_VL_VISION, "out_hidden_size": 4096},
    },
}


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
            raise ModelShapeError(
                f"--model-config {text!r} is neither a config.json, a model folder nor a preset ({', '.join(PRESETS)})"
            )
        return shape_from_config(PRESETS[preset], f"preset {preset} (analytic)")
    folder = Path(spec.model.path)
    if (folder / "config.json").is_file():
        return shape_from_folder(folder)
    preset = preset_for(spec.model.path)
    if preset is not None:
        return shape_from_config(PRESETS[preset], f"preset {preset}, from spec.model.path's name (analytic)")
    raise ModelShapeError(
        f"spec.model.path {spec.model.path} is not on this machine and names no preset; pass "
        f"--model-config with its config.json or one of {', '.join(PRESETS)}"
    )
