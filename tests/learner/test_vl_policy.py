"""The learner's vision-language policy on both tiny Qwen-VL families: the processor with the spec's pixel
bounds, LoRA on the language model only, `training.freeze` under full fine-tuning, and the FULL export
(checkpoint names, only what training can change). On the CPU, no vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from learner.sync.weights import checkpoint_name_map, full_export, is_peft_model
from learner.train.policy import load_policy
from rmsft.jobspec import TrainingConfig, VisionSpec
from rmsft_dev.tiny_vl import MAX_PIXELS, MIN_PIXELS, PATCH_SIZE
from rollout_engine.engine import checkpoint_table

TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]  # Qwen2.5-VL's vision MLP has the last three
VISION = VisionSpec(min_pixels=32 * 32, max_pixels=96 * 96)


def cfg(**kw) -> TrainingConfig:
    # coord_rows off: these tests are about where the LoRA adapters go (the trainable coordinate rows, on by default
    # with coordexp, have their own tests in test_coord_rows_lora.py)
    kw.setdefault("lora", {"r": 4, "alpha": 8.0, "target_modules": TARGETS, "coord_rows": False})
    return TrainingConfig(data={"path": "unused.jsonl"}, **kw)


_SHARED: dict[tuple, object] = {}


def shared_model(model_dir: Path, finetune: str, **freeze: bool):
    """A policy's model loaded once per module, for tests that only read it (exports leave it bit-identical)."""
    key = (str(model_dir), finetune, tuple(sorted(freeze.items())))
    if key not in _SHARED:
        _SHARED[key] = load_policy(model_dir, cfg(finetune=finetune, freeze=freeze), vision=VISION).model
    return _SHARED[key]


def arch(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


def params(model) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters())


def is_visual(name: str) -> bool:
    return "visual" in name.split(".")


def is_merger(name: str) -> bool:
    return is_visual(name) and any(p.startswith(("merger", "deepstack_merger")) for p in name.split("."))


# ---------------------------------------------------------------- processor


def test_the_processor_gets_the_spec_pixel_bounds(tiny_vl_model_dir: Path) -> None:
    policy = load_policy(tiny_vl_model_dir, cfg(), vision=VISION)
    assert policy.is_vision_language and policy.tokenizer is policy.processor.tokenizer
    assert dict(policy.processor.image_processor.size) == {"shortest_edge": 32 * 32, "longest_edge": 96 * 96}
    # The bound is what the processor resizes with: a 256x256 image is brought down to <= 96*96 pixels.
    enc = policy.processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"],
        images=[Image.new("RGB", (256, 256), (9, 9, 9))],
        return_tensors="pt",
    )
    t, h, w = enc["image_grid_thw"][0].tolist()
    assert h * w * PATCH_SIZE**2 <= 96 * 96 and t == 1
    # Unset bounds keep the folder's own; one bound alone changes only its side.
    own = load_policy(tiny_vl_model_dir, cfg(), vision=None).processor.image_processor.size
    assert dict(own) == {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    half = load_policy(tiny_vl_model_dir, cfg(), vision=VisionSpec(max_pixels=128 * 128))
    assert dict(half.processor.image_processor.size) == {"shortest_edge": MIN_PIXELS, "longest_edge": 128 * 128}


def test_a_text_model_loads_without_a_processor(tiny_model_dir: Path) -> None:
    policy = load_policy(tiny_model_dir, cfg(finetune="full"), vision=VISION)
    assert policy.processor is None and not policy.is_vision_language
    assert type(policy.model).__name__ == "Qwen2ForCausalLM"
    assert all(p.requires_grad for p in policy.model.parameters())
    assert checkpoint_name_map(policy.model) is None
    lora = load_policy(tiny_model_dir, cfg(), vision=VISION)
    assert lora.processor is None and is_peft_model(lora.model)
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in params(lora.model) if "lora_A" in n} == set(TARGETS)


# ---------------------------------------------------------------- LoRA / freeze


def test_lora_goes_on_the_language_model_only(tiny_vl_model_dir: Path) -> None:
    model = load_policy(tiny_vl_model_dir, cfg(), vision=VISION).model
    named = params(model)
    lora = [n for n in named if ".lora_" in n]
    assert not [n for n in lora if is_visual(n)]
    assert lora and all(".language_model." in n for n in lora)
    # Every target, in every decoder layer.
    n_layers = 2
    for target in TARGETS:
        assert sum(f".{target}.lora_A." in n for n in lora) == n_layers, target
    # Only the adapters train.
    assert {n for n, p in named.items() if p.requires_grad} == set(lora)
    if arch(tiny_vl_model_dir) == "qwen2_5_vl":  # the vision MLP's gate/up/down_proj stay plain
        assert any(n.endswith("visual.blocks.0.mlp.gate_proj.weight") for n in named)


def test_full_finetune_freezes_the_vision_side_by_default(tiny_vl_model_dir: Path) -> None:
    named = params(shared_model(tiny_vl_model_dir, "full"))
    tower = [n for n in named if is_visual(n) and not is_merger(n)]
    merger = [n for n in named if is_merger(n)]
    language = [n for n in named if not is_visual(n)]
    assert tower and merger and language
    assert not any(named[n].requires_grad for n in tower + merger)
    assert all(named[n].requires_grad for n in language)
    assert any("embed_tokens" in n for n in language)


@pytest.mark.parametrize(("vision_tower", "aligner"), [(False, True), (True, False), (False, False)])
def test_freeze_settings_release_each_part(tiny_vl_model_dir: Path, vision_tower: bool, aligner: bool) -> None:
    freeze = {"vision_tower": vision_tower, "aligner": aligner}
    named = params(shared_model(tiny_vl_model_dir, "full", **freeze))
    for n, p in named.items():
        if is_merger(n):
            assert p.requires_grad is not aligner, n
        elif is_visual(n):
            assert p.requires_grad is not vision_tower, n
        else:
            assert p.requires_grad, n


def test_freeze_embeddings(tiny_vl_model_dir: Path) -> None:
    model = shared_model(tiny_vl_model_dir, "full", embeddings=True)
    emb = model.get_input_embeddings().weight
    assert not emb.requires_grad
    named = params(model)
    trainable = [n for n, p in named.items() if p.requires_grad]
    assert trainable and not any("embed_tokens" in n or is_visual(n) for n in trainable)
    assert any(".layers.0.self_attn.q_proj.weight" in n for n in trainable)


# ---------------------------------------------------------------- export names


def test_checkpoint_name_map(tiny_vl_model_dir: Path) -> None:
    for model in (shared_model(tiny_vl_model_dir, "full"), shared_model(tiny_vl_model_dir, "lora")):
        mapping = checkpoint_name_map(model)
        names = [
            "model.language_model.layers.0.self_attn.q_proj.weight",
            "model.language_model.embed_tokens.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.linear_fc1.weight"
            if arch(tiny_vl_model_dir) == "qwen3_vl"
            else "model.visual.merger.mlp.0.weight",
        ]
        if arch(tiny_vl_model_dir) == "qwen3_vl":  # state-dict names are the checkpoint's
            assert mapping is None or all(mapping(n) == n for n in names)
        else:
            assert mapping is not None
            assert mapping(names[0]) == "model.layers.0.self_attn.q_proj.weight"
            assert mapping(names[1]) == "model.embed_tokens.weight"
            assert mapping(names[2]) == "visual.blocks.0.attn.qkv.weight"
            assert mapping(names[3]) == "visual.merger.mlp.0.weight"


def test_the_renamed_export_is_the_checkpoint(tiny_vl_model_dir: Path) -> None:
    """Every tensor of a full export, renamed, is a checkpoint tensor of the same shape, and all are sent."""
    table = checkpoint_table(tiny_vl_model_dir)
    for ft in ("full", "lora"):
        model = shared_model(tiny_vl_model_dir, ft)
        specs = dict(full_export(model, name_map=checkpoint_name_map(model)).specs)
        assert set(specs) == set(table), ft
        assert all(specs[n].shape == table[n].shape for n in specs)


# ---------------------------------------------------------------- changed_only


def test_lora_export_sends_only_the_merged_target_weights(tiny_vl_model_dir: Path) -> None:
    model = load_policy(tiny_vl_model_dir, cfg(), vision=VISION).model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B starts at zero: make the merge visible
    before = {n: t.clone() for n, t in model.state_dict().items()}
    mapping = checkpoint_name_map(model)
    export = list(full_export(model, changed_only=True, name_map=mapping))
    names = [n for n, _ in export]
    qwen25 = arch(tiny_vl_model_dir) == "qwen2_5_vl"
    layers = "model.layers" if qwen25 else "model.language_model.layers"
    want = {
        f"{layers}.{i}.{part}.{t}.weight"
        for i in range(2)
        for t in TARGETS
        for part in (("self_attn",) if t in ("q_proj", "v_proj") else ("mlp",))
    }
    # The base layer's bias (Qwen2.5-VL's q/v_proj have one) comes along, unchanged by the merge.
    assert {n for n in names if n.endswith(".weight")} == want
    assert all(n.endswith(".bias") and n.removesuffix(".bias") + ".weight" in want for n in names if n not in want)
    assert not any("visual" in n for n in names)

    modules = dict(model.named_modules())
    for name, tensor in export:
        if not name.endswith(".weight"):
            continue
        stem = f"base_model.model.model.language_model.layers.{name.split('layers.', 1)[1].removesuffix('.weight')}"
        layer = modules[stem]
        base = layer.get_base_layer().weight
        delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
        torch.testing.assert_close(tensor, base + delta)
        assert not torch.equal(tensor, base)
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())  # the training model is untouched


@pytest.mark.parametrize("freeze", [{}, {"embeddings": True}, {"vision_tower": False}])
def test_full_export_leaves_frozen_parts_out(tiny_vl_model_dir: Path, freeze: dict) -> None:
    model = shared_model(tiny_vl_model_dir, "full", **freeze)
    mapping = checkpoint_name_map(model)
    names = [n for n, _ in full_export(model, changed_only=True, name_map=mapping).specs]
    everything = [n for n, _ in full_export(model, name_map=mapping).specs]
    visual = [n for n in names if "visual" in n.split(".")]
    if freeze.get("vision_tower") is False:
        assert visual and not any("merger" in n for n in visual)  # the aligner stays frozen and unsent
        assert set(visual) == {n for n in everything if "visual" in n.split(".") and "merger" not in n}
    else:
        assert visual == []
    has_embedding = any(n.endswith("embed_tokens.weight") for n in names)
    assert has_embedding is not freeze.get("embeddings", False)
    assert any(n.endswith("layers.1.mlp.down_proj.weight") for n in names)
    assert "lm_head.weight" not in names  # tied: sent once, as the embedding
    assert set(names) <= set(checkpoint_table(tiny_vl_model_dir))
