"""What the learner sends to the rollout servers: the merged model under Hugging Face checkpoint
names (FULL), or the PEFT adapter tensors and its adapter_config.json (ADAPTER).

FULL merges each LoRA/DoRA layer with peft's own `merge` (so every adapter variant peft supports
merges the way peft does it), copies the merged weight, unmerges and then restores the saved base
weight bit for bit: merge + unmerge alone leaves float rounding in the training weights.

FULL is a stream (`full_export`): its names, dtypes and shapes come from the model's metadata (no
merged copy is needed to know them, so the stream's header is built first), then the tensors are
produced one at a time, each LoRA layer merged only when its turn comes and its merged copy
dropped once the encoder moved on. The export's extra memory on the training device is therefore
one LoRA layer's worth (the saved base weight, the merged copy, and peft's delta temporaries while
merging) instead of a merged copy of every LoRA-targeted weight at once. Tensors are cast to the
serving dtype (`serving_dtype`) as they are produced, once each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmsft.serving_dtype import CASTABLE_DTYPES, SERVE_DTYPES
from rmsft.weight_wire import TensorSpec, dtype_name

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
    factors, DoRA magnitudes, the frozen copy behind `modules_to_save`, other adapters' copies, trainable token
    rows)."""
    key = key.removeprefix(_PEFT_PREFIX)
    parts = key.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    if "trainable_tokens_delta" in parts or "trainable_tokens_original" in parts:
        return None  # trainable token rows (training.lora.coord_rows): sent merged into their base weight
    parts = [p for p in parts if p != "token_adapter"]
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        if i + 1 >= len(parts) or parts[i + 1] != adapter:
            return None
        parts = parts[:i] + parts[i + 2 :]
    return ".".join(p for p in parts if p != "base_layer")


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype of a model folder's checkpoint ("bfloat16", "float16", "float32"), by the rule the
    rollout server resolves `--dtype auto` with (rmsft/serving_dtype.py); None when the checkpoint
    has no floating tensor."""
    from rmsft.serving_dtype import serving_dtype_name
    from rmsft.weight_wire import torch_dtype

    wire = serving_dtype_name("auto", model_dir)
    return None if wire is None else str(torch_dtype(wire)).removeprefix("torch.")


def serving_dtype(dtype: str | torch.dtype | None, checkpoint_dir: str | Path | None = None) -> torch.dtype | None:
    """The torch dtype FULL weights are sent in. `dtype` is `spec.model.dtype` ("bfloat16",
    "float16", "float32", or "auto" = the checkpoint's, read from `checkpoint_dir`), a torch dtype,
    or None (no cast: the training dtype). None as well for "auto" on a checkpoint without floating
    tensors (the server then expects every tensor in its checkpoint dtype)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if checkpoint_dir is None:
            raise ValueError("serving dtype 'auto' means the checkpoint's dtype: pass the checkpoint folder too")
        dtype = checkpoint_dtype(checkpoint_dir)
        if dtype is None:
            return None
    if dtype not in SERVE_DTYPES:
        raise ValueError(f"serving dtype must be 'auto' or one of {sorted(SERVE_DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def _wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """Floating tensors travel in the serving dtype; float8 weights and integer buffers keep theirs."""
    if dtype is not None and dtype_name(t.dtype) in CASTABLE_DTYPES:
        return dtype
    return t.dtype


@dataclass(frozen=True)
class _Entry:
    name: str  # as sent (HF checkpoint name, after name_map)
    key: str  # state-dict key
    spec: TensorSpec
    dtype: torch.dtype  # what the tensor is sent as
    tensor: torch.Tensor | None  # the live tensor (a detached view); None for a LoRA base parameter
    lora: Any = None  # the peft layer whose merge produces this parameter
    prefix: str = ""  # state-dict prefix of that layer's base-layer parameters


class FullExport:
    """A FULL export: `specs` ((name, TensorSpec) in stream order, from metadata alone), and
    iterating yields (name, tensor) one at a time in that order.

    A LoRA/DoRA layer is merged when its first base parameter comes up: its base parameters are
    saved, peft merges, the merged parameters are copied in the wire dtype, peft unmerges and the
    saved bits are put back, all before the copy is yielded, so the live model is never left merged
    between two tensors (a stream abandoned half way leaves it as it was). Other tensors are yielded
    as they are (a view of the live model) or cast once. Read a yielded tensor before asking for the
    next one: the export drops its own reference then (the memory bound relies on the consumer doing
    the same), and while a later layer merges, a view that shares its storage (tied weights) reads
    merged values. `rmsft.weight_wire.encode_planned_stream` consumes it so.

    Iterate it under the same conditions as the model's forward: not during an optimizer step.
    """

    def __init__(self, entries: list[_Entry]) -> None:
        self._entries = entries
        self.specs: list[tuple[str, TensorSpec]] = [(e.name, e.spec) for e in entries]
        # Per LoRA layer: state-dict key -> wire dtype of each of its base parameters.
        self._layer_dtypes: dict[int, dict[str, torch.dtype]] = {}
        for e in entries:
            if e.lora is not None:
                self._layer_dtypes.setdefault(id(e.lora), {})[e.key] = e.dtype

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for _, s in self.specs)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        merged: dict[str, torch.Tensor] = {}  # state-dict key -> merged copy, of the current layer only
        layer = None
        for e in self._entries:
            if e.lora is None:
                assert e.tensor is not None, "only a LoRA base parameter has no live tensor"
                t = e.tensor if e.tensor.dtype == e.dtype else e.tensor.to(e.dtype)
            else:
                if e.lora is not layer:
                    merged.clear()  # a previous layer's leftovers (none with peft's state-dict order)
                    merged = _merged_copies(e.lora, e.prefix, self._layer_dtypes[id(e.lora)])
                    layer = e.lora
                t = merged.pop(e.key)
                if tuple(t.shape) != e.spec.shape:
                    raise RuntimeError(f"merged {e.key} has shape {list(t.shape)}, the model said {list(e.spec.shape)}")
            yield e.name, t
            del t  # the encoder is done with it: do not keep it while the next layer merges
        merged.clear()


def _merged_copies(module: Any, prefix: str, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Merge one peft layer, copy its base layer's parameters (state-dict key -> copy in the dtype
    `dtypes` names), unmerge and restore the saved parameters bit for bit."""
    import torch

    with torch.no_grad():
        base = module.get_base_layer()
        # The tensors the parameters hold now (their storage) and a copy of their bits: some peft
        # variants (DoRA) merge and unmerge by swapping in new tensors, others write in place.
        held = {n: p.data for n, p in base.named_parameters(recurse=False)}
        saved = {n: t.clone() for n, t in held.items()}
        try:
            module.merge()
            out = {}
            for n, p in base.named_parameters(recurse=False):
                key = f"{prefix}{n}"
                # One copy, straight into the wire dtype (no full-precision copy first).
                out[key] = p.detach().to(dtypes.get(key, p.dtype), copy=True)
        finally:
            if module.merged:
                module.unmerge()
            for n, p in base.named_parameters(recurse=False):
                if p.data_ptr() != held[n].data_ptr():
                    # Back to the parameter's own storage: views of it (tied weights), optimizers and
                    # DeepSpeed keep pointing at it, and the swapped-in tensor is freed now.
                    p.data = held[n]
                p.data.copy_(saved[n])
            del saved, held
    return out


def checkpoint_name_map(model: Any) -> Callable[[str], str] | None:
    """Renaming from the model's state-dict names to the names `save_pretrained` writes, which is
    what vLLM's checkpoint-format reload expects; None when they are the same. They differ for some
    vision-language families (Qwen2.5-VL: `model.language_model.layers.*` is `model.layers.*` on disk,
    `model.visual.*` is `visual.*`; sending state-dict names kills vLLM's engine). transformers'
    own reverse conversion decides, name by name, so no family's layout is written down here."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    peft = is_peft_model(model)
    hf = model.get_base_model() if peft else model
    adapter = active_adapter(model) if peft else "default"
    # The names full_export renames: state-dict keys with peft's wrapping removed.
    names = [n for n in (hf_name(k, adapter) if peft else k for k in model.state_dict()) if n is not None]
    probe = torch.empty(0, device="meta")
    mapping = {}
    for n in names:
        out = list(revert_weight_conversion(hf, {n: probe}))
        if len(out) != 1:
            raise ValueError(
                f"{type(hf).__name__}: {n} does not map to one checkpoint tensor ({out}); weight sync cannot rename it"
            )
        mapping[n] = out[0]
    if all(k == v for k, v in mapping.items()):
        return None
    return lambda name: mapping.get(name, name)


def changed_keys(model: Any) -> set[str]:
    """State-dict keys of the tensors training can change: trainable parameters (base model names),
    and the base weights of LoRA/DoRA layers (FULL sync sends them merged)."""
    peft = is_peft_model(model)
    keys = set()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if peft and any(part.startswith("lora_") for part in name.split(".")):
            stem = name.split(".lora_")[0]
            keys.add(f"{stem}.base_layer.weight")
            keys.add(f"{stem}.base_layer.bias")
            continue
        if peft and ".trainable_tokens_delta." in name:  # trainable token rows: their embedding, sent merged
            keys.add(f"{name.split('.trainable_tokens_delta.')[0]}.base_layer.weight")
            continue
        keys.add(name)
    return keys


def full_export(
    model: Any,
    *,
    dtype: torch.dtype | None = None,
    name_map: Callable[[str], str] | None = None,
    changed_only: bool = False,
) -> FullExport:
    """The model's weights as the rollout servers load them, as a stream: LoRA/DoRA merged, PEFT
    names stripped, tied duplicates dropped, floating tensors cast to `dtype` (None = as trained),
    renamed by `name_map`. `changed_only`: only what training can change (`changed_keys`), so a
    frozen vision tower or frozen embeddings are never resent; the server keeps the rest. Planning
    touches metadata only; the model's parameters are bit-identical after the stream was consumed
    (or abandoned)."""
    keep = changed_keys(model) if changed_only else None
    peft = is_peft_model(model)
    adapter = active_adapter(model) if peft else "default"
    lora: dict[str, tuple[Any, str]] = {}  # state-dict key of a base-layer parameter -> (layer, prefix)
    if peft:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for mod_name, module in model.named_modules():
            if not isinstance(module, BaseTunerLayer) or not hasattr(module, "base_layer"):
                continue
            if module.merged:
                raise RuntimeError(
                    f"{mod_name} already has a merged adapter; weight sync needs the unmerged training model"
                )
            prefix = f"{mod_name}.base_layer."
            for n, _ in module.get_base_layer().named_parameters(recurse=False):
                lora[prefix + n] = (module, prefix)
    # Tied tensors (shared storage) are sent once under the first name, as save_pretrained does:
    # checkpoints and vLLM carry only the first. A LoRA layer's merged weight is its own tensor, so
    # it neither drops nor is dropped as a duplicate.
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    entries = []
    for key, t in model.state_dict(keep_vars=False).items():
        if keep is not None and key not in keep:
            continue
        name = hf_name(key, adapter) if peft else key
        if name is None:
            continue
        name = name_map(name) if name_map else name
        wire = _wire_dtype(t, dtype)
        spec = TensorSpec(dtype_name(wire), tuple(t.shape))
        if key in lora:
            module, prefix = lora[key]
            if type(module).__name__ == "TrainableTokensLayer":
                # Trainable token rows of a tied embedding: peft wraps the head too, on the same weight and the
                # same rows; like any tied pair it is sent once, under the first name.
                tie = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
                if t.numel() and tie in seen:
                    continue
                seen.add(tie)
            entries.append(_Entry(name, key, spec, wire, None, module, prefix))
            continue
        tie = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and tie in seen:
            continue
        seen.add(tie)
        entries.append(_Entry(name, key, spec, wire, t.detach()))
    return FullExport(entries)


def full_named_tensors(
    model: Any,
    *,
    dtype: torch.dtype | None = None,
    name_map: Callable[[str], str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """`full_export` as a list, every merged copy held at once (tests, small models; the weight
    sync streams `full_export` instead). Unmerged, uncast tensors are shared with the live model
    (no copy), so use the list before the next optimizer step."""
    return list(full_export(model, dtype=dtype, name_map=name_map))


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
    if getattr(config, "trainable_token_indices", None):
        return (
            "the coordinate tokens' embedding rows train beside the adapter (training.lora.coord_rows) and a "
            "vLLM LoRA adapter cannot carry embedding rows; FULL sends them merged (set "
            "training.lora.coord_rows: false to keep them frozen and sync adapters)"
        )
    if config.bias != "none":
        return f"LoRA bias={config.bias!r} is not supported by vLLM"
    if config.rank_pattern or config.alpha_pattern:
        return "per-module rank/alpha patterns are not supported by vLLM"
    if max_lora_rank and config.r > max_lora_rank:
        return f"LoRA rank {config.r} exceeds the servers' max_lora_rank {max_lora_rank}"
    return None
