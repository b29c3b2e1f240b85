"""`rmsft dev real-width`: a random Qwen3-VL at a memory-plan preset's widths and vocabulary (rmsft_dev/real_width.py).

Real widths are checked on the `meta` device (a 2-layer 2B-wide model is ~0.9 GB on disk); the written folder is
checked end to end at reduced widths (same structure, same real vocabulary)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rmsft.memory_plan.shapes import PRESETS, shape_from_config
from rmsft.prepare_model import COORD_TOKENS
from rmsft_dev.real_width import RealWidthError, build_tokenizer, model_config

PRESET_VOCAB = PRESETS["Qwen3-VL-2B"]["text_config"]["vocab_size"]  # 151,936


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(PRESET_VOCAB)


def test_tokenizer_is_the_preset_vocabulary_plus_coord_tokens(tokenizer) -> None:
    assert len(tokenizer) == PRESET_VOCAB + len(COORD_TOKENS)
    ids = tokenizer.convert_tokens_to_ids(COORD_TOKENS)
    assert ids == list(range(PRESET_VOCAB, PRESET_VOCAB + 1000))  # after the stock rows, as prepare-model puts them
    for k in (0, 1, 500, 999):  # each coordinate token is one id, bare or between text
        assert tokenizer.encode(f"<|coord_{k}|>", add_special_tokens=False) == [ids[k]]
    text = '"bbox_2d": [<|coord_3|>, <|coord_999|>]'
    enc = tokenizer.encode(text, add_special_tokens=False)
    assert ids[3] in enc and ids[999] in enc and tokenizer.decode(enc) == text
    # The filler rows are ids text never encodes to: an ordinary sentence stays in the trained BPE's ids.
    assert max(tokenizer.encode("Detect every object in the image, a person and a dog.")) < 2000
    assert len(build_tokenizer(PRESET_VOCAB, coord_tokens=False)) == PRESET_VOCAB


def test_config_and_meta_model_at_the_presets_widths(tokenizer) -> None:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    config = model_config("qwen3-vl-2b", tokenizer, text_layers=2, vision_layers=1)
    preset = PRESETS["Qwen3-VL-2B"]
    text, vision = config.text_config, config.vision_config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(text, key) == preset["text_config"][key], key
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "patch_size",
        "spatial_merge_size",
        "num_position_embeddings",
        "out_hidden_size",
    ):
        assert getattr(vision, key) == preset["vision_config"][key], key
    assert (text.num_hidden_layers, vision.depth) == (2, 1)
    assert vision.deepstack_visual_indexes == []  # vLLM's CPU (Transformers) backend drops deepstack
    assert text.vocab_size == len(tokenizer) == PRESET_VOCAB + 1000
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    assert model.get_input_embeddings().weight.shape == (len(tokenizer), 2048)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as the 2B is
    # The memory plan counts this model as it counts the preset, layer for layer (plus the coordinate rows,
    # minus deepstack's mergers).
    ours, stock = shape_from_config(config.to_dict()), shape_from_config(preset)
    assert (ours.hidden, ours.heads, ours.kv_heads, ours.head_dim, ours.intermediate, ours.vision_hidden) == (
        stock.hidden,
        stock.heads,
        stock.kv_heads,
        stock.head_dim,
        stock.intermediate,
        stock.vision_hidden,
    )
    assert ours.decoder_params == pytest.approx(stock.decoder_params * 2 / 28, rel=1e-4)
    assert ours.embed_params == sum(p.numel() for p in model.get_input_embeddings().parameters())
    assert ours.total_params == sum(p.numel() for p in model.parameters())


def test_unsupported_presets_say_what_builds(tokenizer) -> None:
    with pytest.raises(RealWidthError, match="Qwen3-VL presets"):
        model_config("Qwen2.5-VL-7B", tokenizer)
    with pytest.raises(RealWidthError, match="unknown preset"):
        model_config("llama-70b", tokenizer)


def test_cli_writes_a_folder_transformers_loads(tmp_path: Path) -> None:
    """Reduced widths (every width / 16), the real vocabulary: the folder loads as a processor and a model that
    runs on an image, with the coordinate rows it names."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rmsft.vl_processor import register

    out = tmp_path / "real-width"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rmsft_cli",
            "dev",
            "real-width",
            str(out),
            "--text-layers",
            "1",
            "--vision-layers",
            "1",
            "--width-divisor",
            "16",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "GB of random bfloat16 weights" in res.stderr and "vocabulary 152936" in res.stderr
    register()
    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert len(processor.tokenizer) == model.get_input_embeddings().weight.shape[0] == PRESET_VOCAB + 1000
    assert json.loads((out / "config.json").read_text())["text_config"]["vocab_size"] == PRESET_VOCAB + 1000
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[prompt], images=[Image.new("RGB", (640, 480), "gray")], return_tensors="pt")
    # A real-sized image at the real patch and merge sizes: (640 / 32) x (480 / 32) image tokens.
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 20 * 15
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[-1] == PRESET_VOCAB + 1000 and torch.isfinite(logits.float()).all()
