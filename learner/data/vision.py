"""Vision-language inputs of teacher-forced segments (Qwen-VL family), on the learner side.

Public API
- `render_prompt(processor, messages, images) -> VisionPrompt`: the prompt's ids as the processor
  expands them (one `<|image_pad|>` per merged patch), its `pixel_values` and `image_grid_thw`.
- `mrope_positions(model, input_ids, image_grid_thw) -> Tensor [3, len]`: the model's own M-RoPE
  positions of one sequence (its `get_rope_index`), found through a peft wrapper too.
- `segment_vision(model, segment, prompt) -> SegmentVision` and `with_vision(model, segment, prompt)
  -> Segment`: a `learner.core` segment (prompt + Y_train) with what `learner.core.packing.pack`
  needs to build a vision-language row.

Why positions are computed here and not by the model: a packed row holds several segments, and the
model computes M-RoPE positions for a whole row as one sequence (images of later segments would get
positions continuing after earlier segments, and no restarts to build the block-causal mask from).
So every segment gets its own positions here, for the whole segment: the response tokens' positions
continue after the images' (not after the token count), so they cannot come from the prompt alone.
Text-only segments of a vision-language model get them too (t = h = w = 0..len-1), through the
same call, so a row's segments are all alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from learner.core.targets import Segment, SegmentVision, check_prompt_ids
from rmsft.chat import ChatImageError, with_image_items

if TYPE_CHECKING:
    from PIL import Image


class VisionInputError(ValueError):
    """Inputs that cannot give a consistent vision-language segment."""


@dataclass(frozen=True, eq=False)
class VisionPrompt:
    """A rendered prompt: ids with image placeholders expanded, and its images (None without)."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @property
    def n_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    def image_size(self, patch_size: int) -> tuple[int, int] | None:
        """(width, height) of the first image as the processor resized it (None without images): what a
        format in resized-image pixels (Qwen2.5-VL's grounding output) measures coordinates in."""
        if self.image_grid_thw is None:
            return None
        _, h, w = (int(v) for v in self.image_grid_thw[0])
        return w * patch_size, h * patch_size


def patch_size(processor: Any) -> int:
    """The vision encoder's patch size in pixels, from the processor's image processor."""
    size = getattr(getattr(processor, "image_processor", None), "patch_size", None)
    if not isinstance(size, int) or size < 1:
        raise VisionInputError("the processor has no image_processor.patch_size: is it a Qwen-VL processor?")
    return size


def resized_image_size(processor: Any, image: Image.Image) -> tuple[int, int]:
    """(width, height) of `image` after the processor's resize (a multiple of the patch size)."""
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    _, h, w = (int(v) for v in grid[0])
    p = patch_size(processor)
    return w * p, h * p


def vision_messages(messages: Sequence[dict], n_images: int) -> list[dict]:
    """`messages` with `n_images` image items before the text of the first user message, as every rollout
    server places them (`rmsft.chat.with_image_items`, the one rule both sides use)."""
    try:
        return with_image_items(messages, n_images)
    except ChatImageError as e:
        raise VisionInputError(str(e)) from None


def render_prompt(processor: Any, messages: Sequence[dict], images: Sequence[Image.Image]) -> VisionPrompt:
    """Render `messages` with `images` (in the first user message, before its text) through a
    Qwen-VL processor: the generation prompt's ids, `pixel_values` and `image_grid_thw`."""
    images = list(images)
    text = processor.apply_chat_template(
        vision_messages(messages, len(images)), add_generation_prompt=True, tokenize=False
    )
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    ids = [int(t) for t in enc["input_ids"][0].tolist()]
    if not images:
        return VisionPrompt(ids)
    return VisionPrompt(ids, enc["pixel_values"], enc["image_grid_thw"].to(torch.long))


def rope_model(model: torch.nn.Module) -> Any:
    """The module that owns `get_rope_index` (Qwen*VLModel), under a ForConditionalGeneration head
    and any peft wrapper. Looked up on the class, so peft's attribute forwarding is not involved."""
    for m in model.modules():
        if callable(getattr(type(m), "get_rope_index", None)):
            return m
    raise VisionInputError(f"{type(model).__name__} has no module with get_rope_index (not a Qwen-VL model?)")


def mm_token_type_ids(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Modality of each token (0 text, 1 image, 2 video), as the processor marks them: by token id."""
    types = torch.zeros_like(input_ids)
    for kind, name in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, name, None)
        if token is not None:
            types[input_ids == token] = kind
    return types


def mrope_positions(
    model: torch.nn.Module, input_ids: Sequence[int], image_grid_thw: torch.Tensor | None
) -> torch.Tensor:
    """[3, len] M-RoPE positions of one whole sequence, from the model's own `get_rope_index`
    (transformers 5: `(input_ids, mm_token_type_ids, image_grid_thw, ...)` on Qwen3-VL and
    Qwen2.5-VL alike). Index arithmetic only: runs on the CPU and reads no weight."""
    owner = rope_model(model)
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    types = mm_token_type_ids(owner.config, ids)
    grid = None if image_grid_thw is None else image_grid_thw.to("cpu", torch.long)
    n_image_tokens = int((types == 1).sum())
    merge = owner.config.vision_config.spatial_merge_size
    expected = 0 if grid is None else int(grid.prod(-1).sum()) // merge**2
    # get_rope_index would stop early or misplace positions on a mismatch, without a clear error.
    if n_image_tokens != expected:
        raise VisionInputError(
            f"{n_image_tokens} image tokens in the ids but the image grids need {expected}: "
            "render the prompt with the images it was sampled with (render_prompt)"
        )
    if (types == 2).any():
        raise VisionInputError("video tokens are not supported")
    pos, _ = owner.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
    return pos[:, 0, :].contiguous()


def segment_vision(model: torch.nn.Module, segment: Segment, prompt: VisionPrompt) -> SegmentVision:
    """The vision payload of `segment` (prompt + Y_train), whose prompt was rendered as `prompt`."""
    check_prompt_ids(segment.input_ids[: segment.prompt_len], prompt.input_ids)
    return SegmentVision(
        mrope_positions=mrope_positions(model, segment.input_ids, prompt.image_grid_thw),
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
    )


def with_vision(model: torch.nn.Module, segment: Segment, prompt: VisionPrompt) -> Segment:
    """`segment` carrying its vision payload, ready for `learner.core.packing`."""
    return dataclasses.replace(segment, vision=segment_vision(model, segment, prompt))
