"""Turn a GenerateRequest into engine items, rejecting bad input with a clear message."""

from __future__ import annotations

import io
from pathlib import Path

from rmsft_protos import rollout_pb2

from rollout_svc.engine import GenItem, Sampling


class PromptError(ValueError):
    pass


def sampling_of(sp: rollout_pb2.SamplingParams, seed: int | None) -> Sampling:
    if sp.max_tokens <= 0:
        raise PromptError("sampling.max_tokens must be > 0")
    if sp.temperature < 0:
        raise PromptError(f"sampling.temperature must be >= 0, got {sp.temperature}")
    if not 0 <= sp.top_p <= 1:
        raise PromptError(f"sampling.top_p must be in [0, 1], got {sp.top_p}")
    if sp.repetition_penalty < 0:
        raise PromptError(f"sampling.repetition_penalty must be >= 0, got {sp.repetition_penalty}")
    return Sampling(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p or 1.0,
        top_k=sp.top_k if sp.top_k > 0 else 0,
        repetition_penalty=sp.repetition_penalty or 1.0,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        seed=seed,
    )


def _image(img: rollout_pb2.Image):
    from PIL import Image

    kind = img.WhichOneof("source")
    try:
        if kind == "data":
            return Image.open(io.BytesIO(img.data)).convert("RGB")
        if kind == "uri":
            path = img.uri.removeprefix("file://")
            if "://" in path:
                raise PromptError(f"image uri {img.uri!r}: only local paths / file:// are served")
            return Image.open(Path(path)).convert("RGB")
    except PromptError:
        raise
    except Exception as e:
        raise PromptError(f"cannot decode image: {e}") from e
    raise PromptError("image without data or uri")


def build_items(request: rollout_pb2.GenerateRequest, engine) -> list[GenItem]:
    if not request.prompts:
        raise PromptError("GenerateRequest has no prompts")
    items = []
    for i, p in enumerate(request.prompts):
        s = sampling_of(request.sampling, p.seed if p.HasField("seed") else None)
        images = [_image(img) for img in p.images]
        text = None
        if p.token_ids:
            ids = list(p.token_ids)
        elif p.messages:
            msgs = [{"role": m.role, "content": m.content} for m in p.messages]
            if images:
                # Multimodal models: the engine's processor expands image placeholders itself.
                msgs[0] = {"role": msgs[0]["role"],
                           "content": [{"type": "image"}] * len(images)
                           + [{"type": "text", "text": msgs[0]["content"]}]}
                text = engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                ids = []
            else:
                ids = engine.render_chat(msgs)
        else:
            raise PromptError(f"prompt {i} has neither token_ids nor messages")
        if images and p.token_ids:
            raise PromptError(f"prompt {i}: images need messages (the server renders the image tokens)")
        bad = [t for t in ids if t >= engine.vocab_size]
        if bad:
            raise PromptError(f"prompt {i} has token ids outside the vocabulary (size {engine.vocab_size}): {bad[:5]}")
        if len(ids) + 1 > engine.max_model_len:
            raise PromptError(f"prompt {i} has {len(ids)} tokens; max_model_len is {engine.max_model_len}")
        items.append(GenItem(ids, s, images, text))
    return items
