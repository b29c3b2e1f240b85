"""Vision-language pieces of the E-step and the trainer's start checks: vision tokens in a sampled answer,
prompts a server rendered differently from the learner, and datasets no server would take."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from learner.core.targets import PromptMismatchError
from learner.data.episode import VISION_TOKENS, check_rollout_prompts, vision_safe_response, vision_token_ids
from learner.data.records import Record
from learner.train.start_checks import check_images_fit
from rmsft_dev.tiny_model import CHAT_SPECIAL_TOKENS, build_tokenizer

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_tokenizer(tiny_qwen3_vl_dir: Path):
    from transformers import AutoProcessor

    from rmsft.vl_processor import register

    register()
    return AutoProcessor.from_pretrained(tiny_qwen3_vl_dir).tokenizer


def _record(rid: str, images: int = 0) -> Record:
    return Record.model_validate(
        {
            "id": rid,
            "width": 64,
            "height": 48,
            "messages": [{"role": "user", "content": "Detect."}],
            "images": [f"img-{rid}-{k}.png" for k in range(images)],
        }
    )


# ---------------------------------------------------------------- vision tokens in answers


def test_vision_token_ids_of_a_vl_tokenizer(vl_tokenizer) -> None:
    ids = vision_token_ids(vl_tokenizer)
    assert len(VISION_TOKENS) == 4
    assert ids == {vl_tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    assert len(ids) == 4 and all(isinstance(i, int) and 0 <= i < len(vl_tokenizer) for i in ids)
    # Ordinary text and coordinate tokens are not among them.
    text_ids = vl_tokenizer("Detect every object <|coord_12|>")["input_ids"]
    assert not ids & set(text_ids)


def test_vision_token_ids_of_text_tokenizers(tiny_tokenizer) -> None:
    # The tiny text model's vocabulary has three of the four (no <|video_pad|>): those three are found.
    present = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
    assert set(present) <= set(CHAT_SPECIAL_TOKENS) and "<|video_pad|>" not in tiny_tokenizer.get_vocab()
    assert vision_token_ids(tiny_tokenizer) == {tiny_tokenizer.convert_tokens_to_ids(t) for t in present}
    # A vocabulary without any of them: none, and no None or unk id slips in.
    bare = build_tokenizer(0, [t for t in CHAT_SPECIAL_TOKENS if t not in VISION_TOKENS])
    assert not set(VISION_TOKENS) & set(bare.get_vocab())
    assert vision_token_ids(bare) == frozenset()


def test_vision_safe_response_cuts_at_the_first_vision_token(vl_tokenizer) -> None:
    vision = vision_token_ids(vl_tokenizer)
    pad = vl_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    start = vl_tokenizer.convert_tokens_to_ids("<|vision_start|>")
    text = vl_tokenizer('{"object_1": {"desc": "cat"')["input_ids"]
    assert vision_safe_response(text, vision) == text  # nothing to cut: kept whole
    assert vision_safe_response([*text[:3], start, *text[3:], pad], vision) == text[:3]
    assert vision_safe_response([pad, *text], vision) == []
    assert vision_safe_response((), vision) == []
    assert vision_safe_response(tuple(text), frozenset()) == text  # a text model: never cut
    assert isinstance(vision_safe_response(tuple(text), vision), list)


# ---------------------------------------------------------------- prompts the server rendered


def _rendered(tokenizer, images: int, text: str = "Detect every object.") -> list[int]:
    return tokenizer(f"<|im_start|>user\n{IMG * images}{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]


def _expanded(tokenizer, pads_per_image: int) -> list[int]:
    """A one-image prompt with its image token expanded as a processor does."""
    return tokenizer(
        f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * pads_per_image}<|vision_end|>Find cats.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )["input_ids"]


def test_equal_prompts_pass(vl_tokenizer) -> None:
    ids = [_expanded(vl_tokenizer, 4), _rendered(vl_tokenizer, 0)]
    rollouts = [SimpleNamespace(prompt_token_ids=tuple(i), server="s0") for i in ids]  # any sequence type
    assert check_rollout_prompts([_record("a", 1), _record("b")], ids, rollouts, vl_tokenizer) is None


def test_a_different_image_token_count_is_explained(vl_tokenizer) -> None:
    mine, theirs = _expanded(vl_tokenizer, 4), _expanded(vl_tokenizer, 6)
    records = [_record("ok"), _record("img-7", 1)]
    ok = _rendered(vl_tokenizer, 0)
    rollouts = [
        SimpleNamespace(prompt_token_ids=ok, server="srv-0"),
        SimpleNamespace(prompt_token_ids=theirs, server="rollout-1:50051"),
    ]
    with pytest.raises(PromptMismatchError) as err:
        check_rollout_prompts(records, [ok, mine], rollouts, vl_tokenizer)
    msg = str(err.value)
    i = next(k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
    assert mine[i] == vl_tokenizer.convert_tokens_to_ids("<|vision_end|>")  # the learner's pads ran out first
    assert msg.startswith(
        "record 'img-7': server rollout-1:50051 rendered a prompt of "
        f"{len(theirs)} tokens, the learner {len(mine)}; they part at token {i}:"
    )
    lo = max(0, i - 8)
    learner_side = repr(vl_tokenizer.decode(mine[lo : i + 8], skip_special_tokens=False))
    server_side = repr(vl_tokenizer.decode(theirs[lo : i + 8], skip_special_tokens=False))
    assert f"learner {learner_side} vs server {server_side}" in msg
    assert "<|vision_end|>" in learner_side and "<|image_pad|>" in server_side
    assert "image token counts differ" in msg and "minPixels/maxPixels" in msg
    assert "same model folder" in msg


def test_a_text_difference_gets_no_image_hint(vl_tokenizer) -> None:
    mine, theirs = _rendered(vl_tokenizer, 1, "Detect every object."), _rendered(vl_tokenizer, 1, "Detect all things.")
    rollout = SimpleNamespace(prompt_token_ids=theirs)  # no server attribute: shown as '?'
    with pytest.raises(PromptMismatchError) as err:
        check_rollout_prompts([_record("t-1", 1)], [mine], [rollout], vl_tokenizer)
    msg = str(err.value)
    assert msg.startswith("record 't-1': server ? rendered a prompt")
    assert "image token counts differ" not in msg
    i = next(k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
    lo = max(0, i - 8)
    learner_side = vl_tokenizer.decode(mine[lo : i + 8], skip_special_tokens=False)
    server_side = vl_tokenizer.decode(theirs[lo : i + 8], skip_special_tokens=False)
    assert "Detect e" in learner_side and "Detect a" in server_side  # each side's own text at the split
    assert f"learner {learner_side!r} vs server {server_side!r}" in msg


def test_a_prompt_that_is_a_prefix_of_the_other_parts_at_its_end(vl_tokenizer) -> None:
    mine = _rendered(vl_tokenizer, 1)
    theirs = mine[:-2]
    with pytest.raises(PromptMismatchError, match=rf"they part at token {len(theirs)}:"):
        check_rollout_prompts(
            [_record("p")], [mine], [SimpleNamespace(prompt_token_ids=theirs, server="s")], vl_tokenizer
        )


# ---------------------------------------------------------------- datasets at start


def test_images_need_a_vision_language_policy() -> None:
    text_policy = SimpleNamespace(is_vision_language=False)
    records = [_record("plain"), _record("pic-1", 1), _record("pic-2", 2)]
    with pytest.raises(ValueError) as err:
        check_images_fit(records, text_policy, 4, "/data/train.jsonl")
    msg = str(err.value)
    assert msg.startswith("/data/train.jsonl: 2 record(s) carry images (first: 'pic-1')")
    assert "text model" in msg
    check_images_fit([_record("plain")], text_policy, 4, "/data/train.jsonl")  # text records: fine


def test_too_many_images_per_record_are_refused() -> None:
    vl_policy = SimpleNamespace(is_vision_language=True)
    records = [_record("one", 1), _record("three", 3), _record("two", 2), _record("four", 4)]
    with pytest.raises(ValueError) as err:
        check_images_fit(records, vl_policy, 2, "train.jsonl")
    msg = str(err.value)
    assert "2 record(s) carry more than spec.model.vision.maxImagesPerPrompt=2 images (first: 'three')" in msg
    check_images_fit(records[:3:2], vl_policy, 2, "train.jsonl")  # at the limit: fine
    check_images_fit([_record("none")], vl_policy, 0, "train.jsonl")
