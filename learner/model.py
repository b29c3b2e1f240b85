"""Loading the policy for training: HF model + tokenizer, LoRA/DoRA via peft or full fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learner.core.vocab import VocabView
from rmsft.jobspec import TrainingConfig

_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ModelLoadError(RuntimeError):
    """The model folder cannot be used for training; the message says why."""


@dataclass
class Policy:
    model: Any  # transformers PreTrainedModel, possibly wrapped in a peft PeftModel
    tokenizer: Any
    vocab: VocabView
    is_peft: bool
    use_dora: bool


def load_policy(model_path: str | Path, cfg: TrainingConfig, dtype: str = "auto") -> Policy:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model folder {path} has no config.json (is spec.model.path right?)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        torch_dtype = getattr(torch, _DTYPES[dtype]) if _DTYPES.get(dtype) else "auto"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    try:
        vocab = VocabView.from_hf_tokenizer(tokenizer)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc

    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lora = cfg.lora
        peft_cfg = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            use_dora=lora.use_dora,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, peft_cfg)
    model.train()
    return Policy(model, tokenizer, vocab, is_peft=cfg.finetune == "lora", use_dora=cfg.lora.use_dora)


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended (what servers receive)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]
