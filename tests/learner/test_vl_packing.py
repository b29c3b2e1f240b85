"""Packed vision-language rows train exactly like their segments run one by one.

For the tiny Qwen3-VL and Qwen2.5-VL: 5 segments with 0-2 images of different sizes and some
labelled response tokens, packed into one row ([4, 1, L] position ids, images concatenated), must
give each token's log-prob and the gradient of every parameter of the segments run alone through
the model's standard call (which computes its own M-RoPE positions). Controls show the comparison
can fail: the same row with 1-D restarting ids (no M-RoPE for images) or with only the 3 M-RoPE
rows (no restarts: segments attend to each other) is far off.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from learner.core.packing import PackedRow, pack
from learner.core.targets import IGNORE_INDEX, Segment
from learner.data.vision import VisionInputError, mm_token_type_ids, mrope_positions, render_prompt, with_vision

# (image sizes, user text, response text): 0, 1 and 2 images, several sizes, one reused.
SPECS = [
    ([(64, 96)], "find the cat", '{"1": {"desc": "cat"}}'),
    ([], "no image here", '{"1": {"desc": "dog"}, "2": {"desc": "x"}}'),
    ([(200, 120), (256, 256)], "two images", '{"1": {"desc": "box"}}'),
    ([(120, 200)], "tall one", "{}"),
    ([(64, 96), (96, 64)], "small pair", '{"1": {"desc": "a b c"}}'),
]


def image(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vl(tiny_vl_model_dir: Path):
    """(model in fp32 eval mode, processor, segments with vision, their prompts and ids)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_model_dir)
    model = AutoModelForImageTextToText.from_pretrained(
        tiny_vl_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    tok = processor.tokenizer
    segments, prompts = [], []
    for i, (sizes, user, response) in enumerate(SPECS):
        msgs = [{"role": "system", "content": "Detect objects."}, {"role": "user", "content": user}]
        prompt = render_prompt(processor, msgs, [image(s, 10 * i + k) for k, s in enumerate(sizes)])
        resp = tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]
        n = len(prompt.input_ids)
        seg = Segment(
            tuple(prompt.input_ids) + tuple(resp), (IGNORE_INDEX,) * n + tuple(resp), (n + 1,), (7 * i,), n, 0, {"i": i}
        )
        segments.append(with_vision(model, seg, prompt))
        prompts.append(prompt)
    return model, processor, segments, prompts


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token ([L-1]) from [L, V] logits."""
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None])[:, 0]


def alone_forward(model, seg: Segment) -> torch.Tensor:
    """The model's standard unpacked call: it computes its own M-RoPE positions."""
    ids = torch.tensor([seg.input_ids])
    v = seg.vision
    out = model(
        input_ids=ids,
        pixel_values=v.pixel_values,
        image_grid_thw=v.image_grid_thw,
        mm_token_type_ids=mm_token_type_ids(model.config, ids),
        use_cache=False,
    )
    return out.logits[0]


def packed_errors(model, segments: list[Segment], row: PackedRow) -> float:
    with torch.no_grad():
        logits = model(**row.model_inputs()).logits[0]
        worst = 0.0
        for info, seg in zip(row.segments, segments, strict=True):
            sl = slice(info.offset, info.offset + info.length)
            ids = torch.tensor(seg.input_ids)
            packed = token_logprobs(logits[sl], ids)
            alone = token_logprobs(alone_forward(model, seg), ids)
            worst = max(worst, float((packed - alone).abs().max()))
    return worst


def test_render_prompt_matches_processor_and_tokenizer(vl):
    model, processor, segments, prompts = vl
    tok = processor.tokenizer
    msgs = [{"role": "system", "content": "Detect objects."}, {"role": "user", "content": "no image here"}]
    assert prompts[1].input_ids == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert prompts[1].pixel_values is None and segments[1].vision.image_grid_thw is None
    # Images: the processor's own marking of image tokens equals ours.
    imgs = [image(s, 20 + k) for k, s in enumerate(SPECS[2][0])]
    content = [{"type": "image"}] * 2 + [{"type": "text", "text": "two images"}]
    text = processor.apply_chat_template(
        [msgs[0], {"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    enc = processor(text=[text], images=imgs, return_tensors="pt")
    assert prompts[2].input_ids == enc["input_ids"][0].tolist()
    assert torch.equal(prompts[2].pixel_values, enc["pixel_values"])
    assert torch.equal(mm_token_type_ids(model.config, enc["input_ids"]), enc["mm_token_type_ids"])
    assert prompts[2].n_images == 2
    # Text-only segment of a VL model: plain positions on all three axes.
    n = len(segments[1])
    assert torch.equal(segments[1].vision.mrope_positions, torch.arange(n).expand(3, n))
    # An image segment: the response continues after the image's (smaller) position span.
    m = segments[2].vision.mrope_positions
    assert m.shape == (3, len(segments[2])) and int(m.max()) < len(segments[2]) - 1


def test_row_layout(vl):
    _, _, segments, _ = vl
    row = pack(segments)
    assert row.position_ids.shape == (4, 1, row.length)
    assert row.pixel_values.shape[0] == sum(
        int(s.vision.image_grid_thw.prod(-1).sum()) for s in segments if s.vision.image_grid_thw is not None
    )
    assert row.image_grid_thw.shape == (6, 3)
    inputs = row.to("cpu").model_inputs()
    assert set(inputs) == {"input_ids", "position_ids", "use_cache", "pixel_values", "image_grid_thw"}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_match_segments_alone(vl, attn):
    model, _, segments, _ = vl
    model.set_attn_implementation(attn)
    try:
        row = pack(segments)
        err = packed_errors(model, segments, row)
        print(f"{model.config.model_type} {attn}: max |log-prob packed - alone| = {err:.2e}")
        assert err < 1e-5

        # Controls: the same comparison catches wrong position ids.
        flat = dataclasses.replace(row, position_ids=row.position_ids[0])  # [1, L] restarts only
        no_text_row = dataclasses.replace(row, position_ids=row.position_ids[1:])  # M-RoPE rows only
        errs = [packed_errors(model, segments, r) for r in (flat, no_text_row)]
        print(f"controls: 1-D ids {errs[0]:.2e}, no text row {errs[1]:.2e}")
        assert min(errs) > 1e-2
    finally:
        model.set_attn_implementation("sdpa")


def test_packed_gradients_match_segments_alone(vl):
    model, _, segments, _ = vl
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        return [
            g if g is not None else torch.zeros_like(p)
            for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True), strict=True)
        ]

    def supervised_logprob_sum(logits: torch.Tensor, seg_labels: torch.Tensor) -> torch.Tensor:
        pos = (seg_labels != IGNORE_INDEX).nonzero()[:, 0]
        return torch.log_softmax(logits[pos - 1].float(), -1).gather(-1, seg_labels[pos, None]).sum()

    row = pack(segments)
    packed = grads(supervised_logprob_sum(model(**row.model_inputs()).logits[0], row.labels[0]))
    alone = [torch.zeros_like(p) for p in params]
    for seg in segments:
        g = grads(supervised_logprob_sum(alone_forward(model, seg), torch.tensor(seg.labels)))
        alone = [a + b for a, b in zip(alone, g, strict=True)]
    err = max(float((a - b).abs().max()) for a, b in zip(packed, alone, strict=True))
    scale = max(float(a.abs().max()) for a in alone)
    print(f"{model.config.model_type}: max |grad packed - alone| = {err:.2e} (largest grad {scale:.2e})")
    assert err < 1e-4
    # The vision tower is in the graph: its gradients are not all zero.
    assert any(float(g.abs().max()) > 0 for (n, _), g in zip(named, packed, strict=True) if "visual" in n)


def test_mismatched_images_are_refused(vl):
    model, _, segments, prompts = vl
    with pytest.raises(VisionInputError, match="image tokens"):
        mrope_positions(model, segments[0].input_ids, prompts[2].image_grid_thw)
    with pytest.raises(ValueError, match="prompt ids differ"):
        with_vision(model, dataclasses.replace(segments[0], vision=None), prompts[3])


def test_through_a_peft_wrapper(vl, tiny_vl_model_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    _, _, segments, prompts = vl
    # A model of its own: peft injects adapters in place, and the module's model must stay plain.
    base = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir, dtype=torch.float32).eval()
    lora = LoraConfig(r=4, target_modules=r".*language_model\.layers\.\d+\.self_attn\.(q_proj|v_proj)")
    model = get_peft_model(base, lora)
    for seg, prompt in zip(segments, prompts, strict=True):
        assert torch.equal(mrope_positions(model, seg.input_ids, prompt.image_grid_thw), seg.vision.mrope_positions)
    assert packed_errors(model, segments[:3], pack(segments[:3])) < 1e-5
