"""What rmsft reads from a model folder's config.json, in one place for the learner and the rollout server.
Torch-free (the server's preflight and the operator-side checks import it)."""

from __future__ import annotations

import json
from pathlib import Path


def model_config(model_dir: str | Path) -> dict:
    """The folder's config.json as a mapping; {} when it is missing or unreadable (callers then see a text
    model without tied embeddings, and the model's own loader reports the real problem)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def is_vision_language(model_dir: str | Path) -> bool:
    """A model folder whose config has a vision tower (Qwen-VL and friends)."""
    return "vision_config" in model_config(model_dir)


def forget_load_options(tokenizer_or_processor: object) -> None:
    """Drop what transformers 5 remembers of how a tokenizer was loaded (`is_local`, `local_files_only`
    in its init_kwargs): save_pretrained would write them into tokenizer_config.json, where they describe
    the machine that loaded it, not the tokenizer."""
    tok = getattr(tokenizer_or_processor, "tokenizer", tokenizer_or_processor)
    kwargs = getattr(tok, "init_kwargs", None)
    if isinstance(kwargs, dict):
        for key in ("is_local", "local_files_only"):
            kwargs.pop(key, None)
