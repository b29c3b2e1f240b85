"""Where a prompt's images go in its chat messages: one rule for the learner and every rollout server,
since both render the same prompt with their own processor and must get the same ids."""

from __future__ import annotations

from collections.abc import Sequence


class ChatImageError(ValueError):
    """Messages that cannot carry the images they come with."""


def with_image_items(messages: Sequence[dict], n_images: int) -> list[dict]:
    """`messages` (string contents) with `n_images` `{"type": "image"}` items put before the text of the first
    user message (the Qwen-VL content-list convention chat templates render); unchanged without images."""
    out = [dict(m) for m in messages]
    for m in out:
        if not isinstance(m.get("content"), str):
            raise ChatImageError(f"message content must be a string, got {type(m.get('content')).__name__}")
    if n_images == 0:
        return out  # string contents: the same text as the tokenizer's own chat template
    user = next((m for m in out if m.get("role") == "user"), None)
    if user is None:
        raise ChatImageError("images need a user message to go in; the messages have none")
    user["content"] = [{"type": "image"}] * n_images + [{"type": "text", "text": user["content"]}]
    return out
