"""A random model at a stock checkpoint's real widths and vocabulary, with no download: `rmsft dev real-width`.

The widths (text hidden, intermediate, heads, head_dim; vision hidden, intermediate, heads, patch and merge sizes)
and the vocabulary come from a memory-plan preset (`rmsft.memory_plan.shapes.PRESETS`), so a job on this model
holds what a job on the real checkpoint holds per layer, per image token and per vocabulary row; the depths are
options (a few layers fit a CPU machine, the preset's depth is the default). What the preset does not record
(positions, norms, activations) is the real checkpoint's config (`_QWEN3_VL_BUILD`).

- Vocabulary: the preset's `vocab_size` rows as a stock tokenizer has them (the tiny byte-level BPE, its chat
  special tokens, then unused filler entries no merge produces, up to the preset's size), then the 1000
  `<|coord_k|>` tokens after them, as `rmsft prepare-model` appends them: tokenizer length = embedding rows =
  preset vocabulary + 1000 (`stock=True`: without them, the preset's vocabulary exactly).
- Deepstack off (`deepstack_visual_indexes=[]`): vLLM's Transformers backend, the one that runs Qwen3-VL on the
  CPU, drops deepstack injection silently (../shared/ENV.md), so outputs would differ from transformers'. A real
  Qwen3-VL-2B carries three deepstack mergers (about 3 x 25M parameters) this model does not.
- bf16 weights (the preset's dtype), initialised as transformers initialises them (initializer_range 0.02).
- Qwen3-VL presets only; the Qwen2.5-VL preset is refused with what to use instead.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rmsft.prepare_model import COORD_TOKENS
from rmsft_dev.tiny_vl import VL_CHAT_TEMPLATE, VL_SPECIAL_TOKENS

MARKER_FILE = "rmsft_real_width_model.json"
# The real Qwen3-VL checkpoints' values the presets leave out (their config.json and preprocessor_config.json):
# M-RoPE over head_dim 128 ([24, 20, 20], interleaved), rope_theta 5e6, gelu-tanh vision MLP, and the image
# processor's pixel range (256x256 .. 4096x4096, patch 16, merge 2).
_QWEN3_VL_BUILD: dict[str, Any] = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
    "max_position_embeddings": 262_144,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "vision_hidden_act": "gelu_pytorch_tanh",
    "min_pixels": 256 * 256,
    "max_pixels": 4096 * 4096,
}


class RealWidthError(ValueError):
    """The preset or the depths asked for cannot be built; the message says what can."""


def preset_config(preset: str) -> tuple[str, dict[str, Any]]:
    """The preset's name as `PRESETS` spells it and its config mapping; `RealWidthError` for an unknown or
    unsupported one."""
    from rmsft.memory_plan.shapes import PRESETS, preset_for

    name = preset_for(preset)
    qwen3 = [k for k, v in PRESETS.items() if v.get("model_type") == "qwen3_vl"]
    if name is None:
        raise RealWidthError(f"unknown preset {preset!r}; choose one of {', '.join(qwen3)}")
    cfg = PRESETS[name]
    if cfg.get("model_type") != "qwen3_vl":
        raise RealWidthError(
            f"preset {name} is a {cfg.get('model_type')} model; `rmsft dev real-width` builds the "
            f"Qwen3-VL presets ({', '.join(qwen3)})"
        )
    return name, cfg


def build_tokenizer(vocab_size: int, seed: int = 0, coord_tokens: bool = True):
    """The CoordExp tokenizer at a stock vocabulary of `vocab_size` entries (then the coord tokens, unless
    `coord_tokens=False`): the tiny BPE and its special tokens keep their ids, filler entries
    `<|unused_N|>` take the ids up to `vocab_size` - 1 (no merge produces them, so text never encodes to them;
    they are rows a stock checkpoint has and a job carries)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from rmsft_dev.tiny_model import build_tokenizer as build_tiny_tokenizer

    base = build_tiny_tokenizer(seed, VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE, coord_tokens=False)
    data = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    if len(vocab) > vocab_size or sorted(vocab.values()) != list(range(len(vocab))):
        raise RealWidthError(f"the base tokenizer's {len(vocab)} ids do not fit a vocabulary of {vocab_size}")
    vocab.update({f"<|unused_{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer.from_str(json.dumps(data))
    if coord_tokens:
        # As `rmsft prepare-model` adds them: ordinary added tokens after the stock vocabulary.
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in COORD_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=VL_SPECIAL_TOKENS[1:],
    )
    fast.chat_template = VL_CHAT_TEMPLATE
    return fast


def model_config(
    preset: str,
    tokenizer: Any,
    text_layers: int | None = None,
    vision_layers: int | None = None,
    width_divisor: int = 1,
):
    """The `Qwen3VLConfig` of the preset at the given depths (None: the preset's), vocabulary `len(tokenizer)`.
    `width_divisor` divides every width and head count (head_dim kept): a cheap folder of the same structure,
    for tests only."""
    from transformers import Qwen3VLConfig

    name, cfg = preset_config(preset)
    text, vision = dict(cfg["text_config"]), dict(cfg["vision_config"])
    layers = text["num_hidden_layers"] if text_layers is None else text_layers
    depth = vision["depth"] if vision_layers is None else vision_layers
    if layers < 1 or depth < 1:
        raise RealWidthError(f"--text-layers and --vision-layers must be at least 1 (got {layers}, {depth})")
    if width_divisor < 1 or text["hidden_size"] % width_divisor or vision["hidden_size"] % width_divisor:
        raise RealWidthError(f"width divisor {width_divisor} does not divide {name}'s widths")
    d = width_divisor

    def div(n: int) -> int:
        return max(1, n // d)

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    build = _QWEN3_VL_BUILD
    text_cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=div(text["hidden_size"]),
        intermediate_size=div(text["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=div(text["num_attention_heads"]),
        num_key_value_heads=div(text["num_key_value_heads"]),
        head_dim=text["head_dim"],
        attention_bias=text.get("attention_bias", False),
        max_position_embeddings=build["max_position_embeddings"],
        rms_norm_eps=build["rms_norm_eps"],
        hidden_act=build["hidden_act"],
        initializer_range=build["initializer_range"],
        rope_parameters=dict(build["rope_parameters"]),
        tie_word_embeddings=cfg["tie_word_embeddings"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision_cfg = dict(
        depth=depth,
        hidden_size=div(vision["hidden_size"]),
        intermediate_size=div(vision["intermediate_size"]),
        num_heads=div(vision["num_heads"]),
        in_channels=vision["in_channels"],
        patch_size=vision["patch_size"],
        spatial_merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        num_position_embeddings=vision["num_position_embeddings"],
        out_hidden_size=text_cfg["hidden_size"],
        hidden_act=build["vision_hidden_act"],
        initializer_range=build["initializer_range"],
        deepstack_visual_indexes=[],  # see the module docstring
    )
    return Qwen3VLConfig(
        text_config=text_cfg,
        vision_config=vision_cfg,
        tie_word_embeddings=cfg["tie_word_embeddings"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        dtype=text.get("dtype", "bfloat16"),
    )


def build_real_width_model(
    out_dir: str | Path,
    preset: str = "Qwen3-VL-2B",
    text_layers: int | None = None,
    vision_layers: int | None = None,
    seed: int = 0,
    coord_tokens: bool = True,
    width_divisor: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write processor, config and random weights (the preset's dtype) of `preset` at the given depths to
    `out_dir`; idempotent per its arguments (a marker file). `progress` gets one line before the weights are
    written (their size: gigabytes at real widths) and one after."""
    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rmsft.vl_processor import PROCESSORS

    name, cfg = preset_config(preset)
    out = Path(out_dir)
    marker = out / MARKER_FILE
    params = {
        "preset": name,
        "text_layers": text_layers,
        "vision_layers": vision_layers,
        "seed": seed,
        "coord_tokens": coord_tokens,
        "width_divisor": width_divisor,
    }
    if marker.exists() and json.loads(marker.read_text()) == params:
        return out
    tokenizer = build_tokenizer(cfg["text_config"]["vocab_size"], seed, coord_tokens=coord_tokens)
    config = model_config(name, tokenizer, text_layers, vision_layers, width_divisor)
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # a build that stops half way must not pass for an earlier one
    torch.manual_seed(seed)
    dtype = getattr(torch, str(config.text_config.dtype or "bfloat16").removeprefix("torch."))
    model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    n = sum(p.numel() for p in model.parameters())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    say = progress or (lambda line: None)
    say(
        f"writing {size / 1e9:.2f} GB of random {str(dtype).removeprefix('torch.')} weights ({n / 1e6:.0f}M "
        f"parameters: {name} widths, {config.text_config.num_hidden_layers} text layers, "
        f"{config.vision_config.depth} vision blocks, vocabulary {len(tokenizer)}) to {out}"
    )
    start = time.monotonic()
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": _QWEN3_VL_BUILD["min_pixels"], "longest_edge": _QWEN3_VL_BUILD["max_pixels"]},
        patch_size=config.vision_config.patch_size,
        temporal_patch_size=config.vision_config.temporal_patch_size,
        merge_size=config.vision_config.spatial_merge_size,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],  # Qwen3-VL's normalisation
    )
    processor = PROCESSORS["qwen3_vl"](
        image_processor=image_processor, tokenizer=tokenizer, chat_template=VL_CHAT_TEMPLATE
    )
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    marker.write_text(json.dumps(params))
    say(f"wrote {out} in {time.monotonic() - start:.0f} s")
    return out
