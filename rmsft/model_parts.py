"""Which part of a model a parameter belongs to, read from its name: the vision tower, the aligner, the input
embeddings, the output head or the language model's decoder.

Defined once because two places must agree on it: the learner freezes by it (`spec.training.freeze` under
`finetune: full`, learner/train/policy.py) and the memory plan counts by it (rmsft/memory_plan/shapes.py, from
safetensors headers), so the parameters the plan calls trainable are the ones that train.

Names as transformers writes Qwen2.5-VL and Qwen3-VL, in a checkpoint and in `named_parameters()` alike
(`visual.merger.…`, `model.visual.blocks.…`, `model.language_model.embed_tokens.weight`): everything under
`visual` is the vision tower except the merger(s) that map patch features to the language model's width
(`merger`, Qwen3-VL's `deepstack_merger_list`), which are the aligner. A text-only model has no vision parts.
"""

from __future__ import annotations

from typing import Literal

# The vision parts are named as spec.training.freeze names them (freeze.vision_tower, freeze.aligner).
Part = Literal["vision_tower", "aligner", "embeddings", "lm_head", "decoder"]
VISION_TOWER: Part = "vision_tower"
ALIGNER: Part = "aligner"
_ALIGNER_MODULES = ("merger", "deepstack_merger")


def part_of(name: str) -> Part:
    """The part the parameter (or checkpoint tensor) `name` belongs to; "decoder" is every decoder layer and the
    final norm, what is left once the others are named."""
    parts = name.split(".")
    if "visual" in parts:
        return ALIGNER if any(p.startswith(_ALIGNER_MODULES) for p in parts) else VISION_TOWER
    if parts[0] == "lm_head":
        return "lm_head"
    if "embed_tokens" in parts:
        return "embeddings"
    return "decoder"
