"""What the learner sends to the rollout servers: the merged model under Hugging Face checkpoint
names (FULL), or the PEFT adapter tensors and its adapter_config.json (ADAPTER).

FULL merges each LoRA/DoRA layer with peft's own `merge` (so every adapter variant peft supports
merges the way peft does it), copies the merged weight, unmerges and then restores the saved base
weight bit for bit: merge + unmerge alone leaves float rounding in the training weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

_PEFT_PREFIX = "base_model.model."


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a train dependency
        return False
    return isinstance(model, PeftModel)


def active_adapter(model: Any) -> str:
    name = model.active_adapter
    if isinstance(name, list | tuple):
        if len(name) != 1:
            raise ValueError(f"weight sync supports one active adapter, the model has {list(name)}")
        name = name[0]
    return name


def hf_name(key: str, adapter: str = "default") -> str | None:
    """The HF checkpoint name of a PEFT state-dict key, or None when the key is PEFT-only (LoRA
    factors, DoRA magnitudes, the frozen copy behind `modules_to_save`, other adapters' copies)."""
    key = key.removeprefix(_PEFT_PREFIX)
    parts = key.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        if i + 1 >= len(parts) or parts[i + 1] != adapter:
            return None
        parts = parts[:i] + parts[i + 2 :]
    return ".".join(p for p in parts if p != "base_layer")


def _dedupe_tied(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Drop the second name of tensors that share storage (tied embeddings), as save_pretrained
    does: checkpoints and vLLM carry only the first."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for name, t in items:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def full_named_tensors(
    model: Any,
    *,
    dtype: torch.dtype | None = None,
    name_map: Callable[[str], str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The model's weights as the rollout servers load them: LoRA/DoRA merged, PEFT names stripped,
    tied duplicates dropped, optionally cast to `dtype` and renamed by `name_map`.

    The returned tensors are detached; unmerged parameters are shared with the live model (no copy),
    so use the list before the next optimizer step. The model's parameters are bit-identical after.
    """
    import torch

    merged: dict[str, torch.Tensor] = {}
    adapter = "default"
    peft = is_peft_model(model)
    with torch.no_grad():
        if peft:
            adapter = active_adapter(model)
            merged = _merged_base_weights(model)
        items = []
        for key, t in model.state_dict(keep_vars=False).items():
            name = hf_name(key, adapter) if peft else key
            if name is None:
                continue
            t = merged.get(key, t).detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            items.append((name_map(name) if name_map else name, t))
    return _dedupe_tied(items)


def _merged_base_weights(model: Any) -> dict[str, torch.Tensor]:
    """state-dict key -> merged copy, for every parameter of a LoRA layer's base layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = {}
    for mod_name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer) or not hasattr(module, "base_layer"):
            continue
        if module.merged:
            raise RuntimeError(
                f"{mod_name} already has a merged adapter; weight sync needs the unmerged training model"
            )
        base = module.get_base_layer()
        params = dict(base.named_parameters(recurse=False))
        saved = {n: p.detach().clone() for n, p in params.items()}
        module.merge()
        try:
            for n, p in base.named_parameters(recurse=False):
                out[f"{mod_name}.base_layer.{n}"] = p.detach().clone()
        finally:
            module.unmerge()
            for n, p in base.named_parameters(recurse=False):
                p.data.copy_(saved[n])
    return out


def adapter_named_tensors(model: Any) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """The active adapter as PEFT saves it: (tensors named as in adapter_model.safetensors,
    adapter_config.json text)."""
    from peft import get_peft_model_state_dict

    if not is_peft_model(model):
        raise ValueError("ADAPTER sync needs a peft model; this model is trained without an adapter")
    adapter = active_adapter(model)
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    items = [(k, v.detach()) for k, v in state.items()]
    return items, adapter_config_json(model.peft_config[adapter])


def adapter_config_json(config: Any) -> str:
    """adapter_config.json the way PeftModel.save_pretrained writes it (inference_mode on)."""
    d = config.to_dict()
    d["inference_mode"] = True
    for k, v in d.items():
        if isinstance(v, set):
            d[k] = sorted(v)
    return json.dumps(d, indent=2, sort_keys=True, default=str)


def adapter_unsupported_reason(model: Any, max_lora_rank: int = 0) -> str | None:
    """Why vLLM cannot load this model's adapter as a LoRA adapter, or None when it can."""
    if not is_peft_model(model):
        return "the model is trained without a peft adapter"
    from peft import LoraConfig

    config = model.peft_config[active_adapter(model)]
    if not isinstance(config, LoraConfig):
        return f"{type(config).__name__} adapters cannot be loaded by vLLM (only LoRA)"
    if config.use_dora:
        return "DoRA adapters are not supported by vLLM's LoRA loader"
    if config.modules_to_save:
        return f"modules_to_save={sorted(config.modules_to_save)} is not part of a vLLM LoRA adapter"
    if config.bias != "none":
        return f"LoRA bias={config.bias!r} is not supported by vLLM"
    if config.rank_pattern or config.alpha_pattern:
        return "per-module rank/alpha patterns are not supported by vLLM"
    if max_lora_rank and config.r > max_lora_rank:
        return f"LoRA rank {config.r} exceeds the servers' max_lora_rank {max_lora_rank}"
    return None
