"""Vision-language requests on the rollout server, without vLLM: `prompts.build_items` (images placed,
bad images refused with the prompt named), `EngineRunner` (one call's bad prompt does not fail the
calls merged with it) and the vLLM engine's pure argument helpers."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from rmsft_protos import rollout_pb2

from rollout_engine.config import ServeConfig
from rollout_engine.engine import VisionLimits
from rollout_engine.prompts import PromptError, build_items
from rollout_engine.vllm_engine import _vision_kwargs, model_impl_for

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
LIMITS = VisionLimits(max_images_per_prompt=2, max_image_pixels=300 * 300)


def _png(size: tuple[int, int], colour: tuple[int, int, int] = (200, 20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG header claiming `width` x `height` with almost no pixel data."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@dataclass
class FakeEngine:
    tokenizer: Any
    vision: VisionLimits | None = LIMITS
    model: str = "/models/tiny-vl"
    max_model_len: int = 4096

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_vl_dir: Path):
    from transformers import AutoProcessor

    from rmsft.vl_processor import register

    register()
    return AutoProcessor.from_pretrained(tiny_qwen3_vl_dir).tokenizer


@pytest.fixture
def engine(tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)


def _request(*prompts: dict) -> rollout_pb2.GenerateRequest:
    req = rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(max_tokens=8))
    for p in prompts:
        req.prompts.add(**p)
    return req


def _user(text: str = "Detect every object.") -> list[rollout_pb2.ChatMessage]:
    return [rollout_pb2.ChatMessage(role="user", content=text)]


def _refusal(engine: FakeEngine, bad: dict, request_id: str = "rid-bad") -> str:
    """The message refusing `bad`, sent as the second prompt after a good (text) one."""
    good = {"messages": _user(), "request_id": "rid-ok"}
    with pytest.raises(PromptError) as err:
        build_items(_request(good, {"request_id": request_id, **bad}), engine)
    message = str(err.value)
    assert message.startswith(f"prompt 1 ({request_id}):"), message
    return message


# ---------------------------------------------------------------- placement


def test_images_go_before_the_text_of_the_first_user_message(engine: FakeEngine) -> None:
    msgs = [
        rollout_pb2.ChatMessage(role="system", content="You are a detector."),
        rollout_pb2.ChatMessage(role="user", content="Find cats."),
        rollout_pb2.ChatMessage(role="assistant", content="OK."),
        rollout_pb2.ChatMessage(role="user", content="And dogs."),
    ]
    images = [rollout_pb2.Image(data=_png((40, 30), (255, 0, 0))), rollout_pb2.Image(data=_png((20, 50), (0, 0, 255)))]
    [item] = build_items(_request({"messages": msgs, "images": images, "seed": 7}), engine)
    assert item.prompt_text == (
        "<|im_start|>system\nYou are a detector.<|im_end|>\n"
        f"<|im_start|>user\n{IMG}{IMG}Find cats.<|im_end|>\n"
        "<|im_start|>assistant\nOK.<|im_end|>\n"
        "<|im_start|>user\nAnd dogs.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert item.prompt_token_ids == []  # the engine's processor tokenizes text + images
    assert [im.size for im in item.images] == [(40, 30), (20, 50)]  # in request order
    assert all(im.mode == "RGB" for im in item.images)
    assert item.images[0].getpixel((0, 0)) == (255, 0, 0) and item.images[1].getpixel((0, 0)) == (0, 0, 255)
    assert item.sampling.seed == 7 and item.sampling.max_tokens == 8


def test_prompts_without_images_are_rendered_to_ids_as_before(engine: FakeEngine, tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(_png((16, 16)))
    items = build_items(
        _request(
            {"messages": _user("Hello.")},
            {"messages": _user("Hello."), "images": [rollout_pb2.Image(uri=f"file://{path}")]},
            {"messages": _user("Hello."), "images": [rollout_pb2.Image(uri=str(path))]},  # a bare path too
        ),
        engine,
    )
    assert items[0].prompt_token_ids == engine.render_chat([{"role": "user", "content": "Hello."}])
    assert items[0].prompt_text is None and items[0].images == []
    assert items[1].prompt_text == f"<|im_start|>user\n{IMG}Hello.<|im_end|>\n<|im_start|>assistant\n"
    assert [im.size for im in items[1].images] == [(16, 16)] == [im.size for im in items[2].images]


def test_limits_are_inclusive(engine: FakeEngine) -> None:
    side = 300  # exactly max_image_pixels, and exactly max_images_per_prompt images
    images = [rollout_pb2.Image(data=_png((side, side)))] * LIMITS.max_images_per_prompt
    [item] = build_items(_request({"messages": _user(), "images": images}), engine)
    assert len(item.images) == 2 and item.prompt_text.count("<|image_pad|>") == 2


# ---------------------------------------------------------------- refusals


def test_images_with_token_ids_are_refused(engine: FakeEngine) -> None:
    msg = _refusal(engine, {"token_ids": [1, 2, 3], "images": [rollout_pb2.Image(data=_png((8, 8)))]})
    assert "images need messages, not token_ids" in msg


def test_more_images_than_the_limit_are_refused(engine: FakeEngine) -> None:
    images = [rollout_pb2.Image(data=_png((8, 8)))] * 3
    msg = _refusal(engine, {"messages": _user(), "images": images})
    assert "carries 3 images; the server accepts at most 2 per prompt" in msg
    assert "maxImagesPerPrompt" in msg


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # 10000x10000: PIL warns only
@pytest.mark.parametrize("size", [(301, 300), (5000, 5000), (10000, 10000)])
def test_an_oversized_image_is_refused_from_its_header(
    engine: FakeEngine, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_decoding(self) -> None:
        raise AssertionError("pixel data was decoded")

    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    w, h = size
    msg = _refusal(engine, {"messages": _user(), "images": [rollout_pb2.Image(data=_png_claiming(w, h))]})
    assert f"image of {w}x{h} = {w * h} pixels exceeds the server's limit of {300 * 300}" in msg
    assert "maxImagePixels" in msg


def test_a_huge_claimed_size_gets_the_limit_message(engine: FakeEngine) -> None:
    msg = _refusal(engine, {"messages": _user(), "images": [rollout_pb2.Image(data=_png_claiming(100000, 100000))]})
    assert "exceeds the server's limit" in msg


def test_a_limit_above_pils_own_is_honoured(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: None)  # no pixel data to decode
    monkeypatch.setattr(Image.Image, "convert", lambda self, mode: self)  # no pixel data to convert
    engine = FakeEngine(tokenizer, vision=VisionLimits(1, 300_000_000))
    w, h = 15000, 14000
    assert w * h > 2 * Image.MAX_IMAGE_PIXELS
    [item] = build_items(
        _request({"messages": _user(), "images": [rollout_pb2.Image(data=_png_claiming(w, h))]}), engine
    )
    assert item.images[0].size == (w, h)


@pytest.mark.parametrize(
    "data",
    [
        _png((40, 30))[:60],  # a real PNG cut inside its pixel data
        _png_claiming(50, 50),  # a valid header, pixel data missing
        b"hello, not an image",
        b"",
    ],
)
def test_undecodable_bytes_are_refused(engine: FakeEngine, data: bytes) -> None:
    msg = _refusal(engine, {"messages": _user(), "images": [rollout_pb2.Image(data=data)]})
    assert "cannot decode image" in msg


def test_a_missing_file_is_refused(engine: FakeEngine, tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/nope.png"
    msg = _refusal(engine, {"messages": _user(), "images": [rollout_pb2.Image(uri=uri)]})
    assert f"image file {uri!r} does not exist on the server" in msg


@pytest.mark.parametrize("uri", ["http://example.com/a.png", "s3://bucket/a.png"])
def test_remote_uris_are_refused(engine: FakeEngine, uri: str) -> None:
    msg = _refusal(engine, {"messages": _user(), "images": [rollout_pb2.Image(uri=uri)]})
    assert f"image uri {uri!r}: only local paths / file:// are served" in msg


def test_an_image_without_a_source_is_refused(engine: FakeEngine) -> None:
    msg = _refusal(engine, {"messages": _user(), "images": [rollout_pb2.Image(mime_type="image/png")]})
    assert "image without data or uri" in msg


def test_images_to_a_text_model_are_refused(tokenizer) -> None:
    engine = FakeEngine(tokenizer, vision=None, model="/models/text-only")
    msg = _refusal(engine, {"messages": _user(), "images": [rollout_pb2.Image(data=_png((8, 8)))] * 2})
    assert "carries 2 image(s) but /models/text-only is not a vision-language model" in msg
    # Text prompts still go through on a text model.
    [item] = build_items(_request({"messages": _user()}), engine)
    assert item.prompt_token_ids and item.images == []


def test_a_prompt_without_request_id_is_named_by_index(engine: FakeEngine) -> None:
    good = {"messages": _user()}
    bad = {"messages": _user(), "images": [rollout_pb2.Image(data=b"junk")]}
    with pytest.raises(PromptError, match=r"^prompt 2: cannot decode image"):
        build_items(_request(good, good, bad), engine)


def test_images_without_a_user_message_name_the_prompt(engine: FakeEngine) -> None:
    msgs = [rollout_pb2.ChatMessage(role="system", content="Describe.")]
    msg = _refusal(engine, {"messages": msgs, "images": [rollout_pb2.Image(data=_png((8, 8)))]})
    assert "user message" in msg


# ---------------------------------------------------------------- vLLM engine arguments


@pytest.mark.parametrize(
    ("setting", "vision_language", "on_gpu", "want"),
    [
        ("auto", True, False, "transformers"),  # no torchvision on CPU machines: vLLM's Transformers backend
        ("auto", True, True, "auto"),
        ("auto", False, False, "auto"),
        ("vllm", True, False, "vllm"),  # an explicit setting wins
        ("transformers", True, True, "transformers"),
        ("transformers", False, False, "transformers"),
    ],
)
def test_model_impl_for(setting: str, vision_language: bool, on_gpu: bool, want: str) -> None:
    assert model_impl_for(setting, vision_language=vision_language, on_gpu=on_gpu) == want


def test_vision_kwargs_without_pixel_bounds() -> None:
    kw = _vision_kwargs(ServeConfig(model="m", max_images_per_prompt=3), on_gpu=False)
    assert kw == {"model_impl": "transformers", "limit_mm_per_prompt": {"image": 3}}
    assert _vision_kwargs(ServeConfig(model="m"), on_gpu=True)["model_impl"] == "auto"
    assert _vision_kwargs(ServeConfig(model="m", model_impl="vllm"), on_gpu=False)["model_impl"] == "vllm"


@pytest.mark.parametrize(
    ("min_pixels", "max_pixels", "size"),
    [
        (1024, 0, {"shortest_edge": 1024}),
        (0, 65536, {"longest_edge": 65536}),
        (1024, 65536, {"shortest_edge": 1024, "longest_edge": 65536}),
    ],
)
def test_vision_kwargs_pass_pixel_bounds_to_the_processor(min_pixels: int, max_pixels: int, size: dict) -> None:
    cfg = ServeConfig(model="m", min_pixels=min_pixels, max_pixels=max_pixels, max_images_per_prompt=1)
    kw = _vision_kwargs(cfg, on_gpu=True)
    assert kw == {"model_impl": "auto", "limit_mm_per_prompt": {"image": 1}, "mm_processor_kwargs": {"size": size}}
