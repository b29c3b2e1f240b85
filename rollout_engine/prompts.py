"""Turn a GenerateRequest into engine items, rejecting bad input with a clear message."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from pathlib import Path

from rmsft_protos import rollout_pb2

from rmsft.chat import ChatImageError, with_image_items
from rollout_engine.engine import GenItem, Sampling


class PromptError(ValueError):
    pass


MAX_SAMPLES_PER_PROMPT = 256


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a prompt seeded with `seed`: a pure function of the two, so a retry on any
    server reproduces every sample. Sample 0 keeps the prompt's seed (n = 1 behaves as before); the others are
    hashed rather than `seed + index` (vLLM's own rule for `n`), because the learner seeds neighbouring prompts
    with neighbouring seeds, and `seed + 1` would make sample 1 of one prompt replay sample 0 of the next."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"rmsft-sample:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: a valid seed for vLLM and torch alike


def sampling_of(sp: rollout_pb2.SamplingParams, seed: int | None) -> Sampling:
    if sp.max_tokens <= 0:
        raise PromptError("sampling.max_tokens must be > 0")
    if sp.temperature < 0:
        raise PromptError(f"sampling.temperature must be >= 0, got {sp.temperature}")
    if not 0 <= sp.top_p <= 1:
        raise PromptError(f"sampling.top_p must be in [0, 1], got {sp.top_p}")
    if sp.repetition_penalty < 0:
        raise PromptError(f"sampling.repetition_penalty must be >= 0, got {sp.repetition_penalty}")
    if sp.min_tokens > sp.max_tokens:
        raise PromptError(f"sampling.min_tokens ({sp.min_tokens}) must be <= max_tokens ({sp.max_tokens})")
    return Sampling(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k if sp.top_k > 0 else 0,
        repetition_penalty=sp.repetition_penalty or 1.0,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        seed=seed,
        logprobs=sp.logprobs,
        min_tokens=sp.min_tokens,
    )


def samples_per_prompt(sp: rollout_pb2.SamplingParams) -> int:
    n = sp.n or 1
    if n > MAX_SAMPLES_PER_PROMPT:
        raise PromptError(f"sampling.n is {n}; at most {MAX_SAMPLES_PER_PROMPT} samples per prompt are served")
    return n


def _image(img: rollout_pb2.Image, max_pixels: int, where: str):
    """Decode one image, refusing an oversized one from its header alone (before decoding it)."""
    from PIL import Image, UnidentifiedImageError

    # The server's limit is the authority: PIL's decompression-bomb guard (89 Mpx) would refuse images the spec
    # allows; raised to the limit, never lowered. Anything above the limit gets the header check's message below.
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels
    kind = img.WhichOneof("source")
    src: io.BytesIO | Path
    try:
        if kind == "data":
            src = io.BytesIO(img.data)
        elif kind == "uri":
            path = img.uri.removeprefix("file://")
            if "://" in path:
                raise PromptError(f"{where}: image uri {img.uri!r}: only local paths / file:// are served")
            src = Path(path)
        else:
            raise PromptError(f"{where}: image without data or uri")
        with Image.open(src) as im:  # reads the header only
            w, h = im.size
            if w * h > max_pixels:
                raise PromptError(
                    f"{where}: image of {w}x{h} = {w * h} pixels exceeds the server's limit of "
                    f"{max_pixels} (--max-image-pixels, spec.model.vision.maxImagePixels)"
                )
            return im.convert("RGB")
    except PromptError:
        raise
    except FileNotFoundError:
        raise PromptError(f"{where}: image file {img.uri!r} does not exist on the server") from None
    except Image.DecompressionBombError as e:  # PIL's guard fires before the header check for enormous sizes
        raise PromptError(
            f"{where}: image exceeds the server's limit of {max_pixels} pixels "
            f"(--max-image-pixels, spec.model.vision.maxImagePixels): {e}"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise PromptError(f"{where}: cannot decode image: {type(e).__name__}: {e}") from None


def _with_images(msgs: list[dict], n: int, where: str) -> list[dict]:
    """Images before the text of the first user message: the rule the learner renders with too
    (`rmsft.chat`); the processor expands each placeholder to the image's token count."""
    try:
        return with_image_items(msgs, n)
    except ChatImageError as e:
        raise PromptError(f"{where}: {e}") from None


def build_items(request: rollout_pb2.GenerateRequest, engine) -> list[GenItem]:
    """One item per sample: prompt by prompt, samples 0..n-1 within a prompt (the reply's order). The `n`
    samples of a prompt are `n` engine requests with derived seeds (`sample_seed`); they share the rendered
    prompt, and vLLM's prefix cache computes its tokens once."""
    if not request.prompts:
        raise PromptError("GenerateRequest has no prompts")
    n = samples_per_prompt(request.sampling)
    limits = getattr(engine, "vision", None)
    items = []
    for i, p in enumerate(request.prompts):
        where = f"prompt {i}" + (f" ({p.request_id})" if p.request_id else "")
        s = sampling_of(request.sampling, p.seed if p.HasField("seed") else None)
        if p.images:
            if p.token_ids:
                raise PromptError(
                    f"{where}: images need messages, not token_ids (the server renders the image "
                    "tokens with its processor)"
                )
            if limits is None:
                raise PromptError(
                    f"{where}: carries {len(p.images)} image(s) but {engine.model} is not a vision-language model"
                )
            if len(p.images) > limits.max_images_per_prompt:
                raise PromptError(
                    f"{where}: carries {len(p.images)} images; the server accepts at most "
                    f"{limits.max_images_per_prompt} per prompt (--max-images-per-prompt, "
                    "spec.model.vision.maxImagesPerPrompt)"
                )
        # (images with no limits were refused above)
        images = [_image(img, limits.max_image_pixels, where) for img in p.images] if p.images and limits else []
        text = None
        if p.token_ids:
            ids = list(p.token_ids)
        elif p.messages:
            msgs = [{"role": m.role, "content": m.content} for m in p.messages]
            if images:
                text = engine.tokenizer.apply_chat_template(
                    _with_images(msgs, len(images), where), tokenize=False, add_generation_prompt=True
                )
                ids = []
            else:
                ids = engine.render_chat(msgs)
        else:
            raise PromptError(f"{where} has neither token_ids nor messages")
        bad = [t for t in ids if t >= engine.vocab_size]
        if bad:
            raise PromptError(f"{where} has token ids outside the vocabulary (size {engine.vocab_size}): {bad[:5]}")
        if len(ids) + 1 > engine.max_model_len:
            raise PromptError(f"{where} has {len(ids)} tokens; max_model_len is {engine.max_model_len}")
        items.append(GenItem(ids, s, images, text))
        for k in range(1, n):
            seed = None if s.seed is None else sample_seed(s.seed, k)
            items.append(GenItem(ids, dataclasses.replace(s, seed=seed), images, text))
    return items
