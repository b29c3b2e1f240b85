"""Tiny, download-free Qwen-VL models (Qwen3-VL and Qwen2.5-VL) with the CoordExp vocabulary.

Random weights, a vision tower of two blocks, a processor with dynamic resolution (4-64 image
tokens per image) and a chat template that renders image items, built in seconds. vLLM (through
its Transformers backend on the CPU) and transformers both load the folder; ../shared/ENV.md
("Vision-language models on the CPU") has the facts each choice below rests on:
- Qwen3-VL is built without deepstack (`deepstack_visual_indexes=[]`): vLLM's Transformers backend
  drops deepstack injection silently, so outputs would differ from transformers'.
- head_dim 64 (vLLM's CPU attention rejects 16), `mrope_section` [8, 12, 12] (interleaved for
  Qwen3-VL), tied embeddings, `initializer_range` 0.08 so greedy decoding has clear winners.
- `<|video_pad|>` is in the vocabulary so the config's `video_token_id` exists.
"""

from __future__ import annotations

import json
from pathlib import Path

from rmsft_dev.tiny_model import CHAT_SPECIAL_TOKENS, build_tokenizer

ARCHITECTURES = ("qwen3_vl", "qwen2_5_vl")
VL_SPECIAL_TOKENS = [*CHAT_SPECIAL_TOKENS, "<|video_pad|>"]
# Messages whose content is a string, or a list of {"type": "image"} / {"type": "text", "text": ...}
# items (the Qwen-VL convention): an image item becomes <|vision_start|><|image_pad|><|vision_end|>,
# which the processor expands to the image's token count.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH_SIZE = 16
MERGE_SIZE = 2
# 4 to 64 image tokens per image: (64x64 .. 256x256 pixels) / (patch 16 x merge 2)^2.
MIN_PIXELS = 64 * 64
MAX_PIXELS = 256 * 256
MARKER_FILE = "rmsft_tiny_vl_model.json"
# Sizes: "tiny" (tests: seconds per step), "small" (learns the synthetic visual task faster on a CPU).
SIZES = {
    "tiny": {"text_hidden": 128, "text_layers": 2, "vision_depth": 2, "vision_hidden": 64},
    "small": {"text_hidden": 256, "text_layers": 4, "vision_depth": 4, "vision_hidden": 128},
}


def build_tiny_vl_model(
    out_dir: str | Path,
    arch: str = "qwen3_vl",
    seed: int = 0,
    size: str = "tiny",
    coord_tokens: bool = True,
    smooth_coords: bool = False,
) -> Path:
    """Write processor + random weights of a tiny `arch` model to `out_dir`; idempotent per (arch, seed, size,
    coord_tokens, smooth_coords). `coord_tokens=False`: a stock model whose tokenizer has no `<|coord_k|>`
    tokens. `smooth_coords`: the coordinate tokens' embedding rows start as a smooth function of the bin
    (`smooth_coord_embeddings`) instead of random."""
    import torch
    from transformers import GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rmsft.vl_processor import PROCESSORS

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny vision-language architecture {arch!r}; choose one of {ARCHITECTURES}")
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SIZES)}")
    out = Path(out_dir)
    marker = out / MARKER_FILE
    # Non-default options only, so folders built before an option existed keep their marker (no rebuild).
    params = (
        {"arch": arch, "seed": seed}
        | ({"size": size} if size != "tiny" else {})
        | ({} if coord_tokens else {"coord_tokens": False})
        | ({"smooth_coords": True} if smooth_coords else {})
    )
    if marker.exists() and json.loads(marker.read_text()) == params:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # Another build's marker goes first: a build that stops half way must not pass for the earlier one.
    marker.unlink(missing_ok=True)

    tokenizer = build_tokenizer(seed, VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE, coord_tokens=coord_tokens)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    config = _config(arch, len(tokenizer), ids, tokenizer, **SIZES[size])
    torch.manual_seed(seed)
    model = _model_class(arch)(config)
    if smooth_coords and coord_tokens:
        coord_ids = tokenizer.convert_tokens_to_ids([f"<|coord_{k}|>" for k in range(1000)])
        emb = model.get_input_embeddings().weight
        with torch.no_grad():  # tied embeddings: the output head's rows are the same smooth rows
            emb[coord_ids] = smooth_coord_embeddings(len(coord_ids), emb.shape[1], config.text_config.initializer_range)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=MERGE_SIZE,
    )
    processor = PROCESSORS[arch](image_processor=image_processor, tokenizer=tokenizer, chat_template=VL_CHAT_TEMPLATE)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    marker.write_text(json.dumps(params))
    return out


def smooth_coord_embeddings(bins: int, dim: int, std: float):
    """`bins` x `dim` embedding rows that vary smoothly with the bin: sines and cosines of the bin's position
    at geometric frequencies (1 to `bins` / 8 periods over the range), scaled to the random rows' `std`.

    Why: with random rows, the 1000 coordinate tokens of a tiny model are 1000 unrelated classes and 1000
    unrelated inputs. A coordinate the model writes one bin off the value it was trained on is then an input it
    has never seen, and the rest of its answer falls apart; and the soft coordinate target (a Gaussian over
    neighbouring bins) teaches each bin on its own. A pretrained model's number tokens are not like that; smooth
    rows make neighbouring bins near-synonyms, in and out (tied embeddings), as they are there."""
    import torch

    pos = torch.arange(bins, dtype=torch.float64)[:, None] / bins
    half = dim // 2
    freqs = torch.logspace(0, torch.log10(torch.tensor(bins / 8.0)), half, dtype=torch.float64)[None, :]
    angle = 2 * torch.pi * pos * freqs
    rows = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
    if rows.shape[1] < dim:  # odd width: one constant column
        rows = torch.cat([rows, torch.zeros(bins, dim - rows.shape[1], dtype=torch.float64)], dim=1)
    return (rows * std).to(torch.float32)  # each sin/cos column has variance 1/2: rows a bit quieter than random


def _model_class(arch: str):
    if arch == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration


def _config(
    arch: str,
    vocab_size: int,
    ids: dict[str, int],
    tokenizer,
    *,
    text_hidden: int,
    text_layers: int,
    vision_depth: int,
    vision_hidden: int,
):
    text = dict(
        vocab_size=vocab_size,
        hidden_size=text_hidden,
        intermediate_size=2 * text_hidden,
        num_hidden_layers=text_layers,
        num_attention_heads=text_hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.08,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_heads=2,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        out_hidden_size=text_hidden,
        initializer_range=0.08,
    )
    tokens = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [8, 12, 12],
            "mrope_interleaved": True,
        }
        vision.update(deepstack_visual_indexes=[], num_position_embeddings=256)
        return Qwen3VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=True, dtype="float32", **tokens
        )
    from transformers import Qwen2_5_VLConfig

    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    vision.update(window_size=64, fullatt_block_indexes=[1], hidden_act="silu")
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, dtype="float32", **tokens)
