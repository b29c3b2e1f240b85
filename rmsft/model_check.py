"""Does a model folder fit a job's answer format? Read from its tokenizer files alone, in well under a second.

`training.format: coordexp` needs the 1000 `<|coord_k|>` tokens in the tokenizer (rmsft prepare-model adds
them to a stock checkpoint); `qwen_json` needs nothing beyond a model folder with a tokenizer. The learner
finds out too (learner/core/vocab.py), but only once it loads the model, after the rollout servers loaded
it on their GPUs. This reads JSON only (no transformers, no torch, no GPU), so it can run first: in an init
container of every pod the operator creates (`rmsft preflight`) and in `rmsft local` before any server
starts. Torch-free, like rmsft.model_folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rmsft.prepare_model import COORD_TOKENS, NUM_COORD_BINS

# Where a Hugging Face model folder lists its tokens (any of them may be absent): the fast tokenizer's
# tokenizer.json (model vocabulary and added tokens), tokenizer_config.json's added_tokens_decoder, the
# slow tokenizers' added_tokens.json and vocab.json. A stock Qwen-VL checkpoint has all but
# added_tokens.json; what transformers 5 saves has tokenizer.json alone.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json", "vocab.json")


class ModelCheckError(ValueError):
    """The model folder cannot serve the job; the message says why and how to fix it."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelCheckError(
            f"{path} cannot be read as JSON ({exc}); copy the checkpoint's tokenizer files into the folder again"
        ) from None


def _ids(mapping: Any) -> dict[str, int]:
    """token -> id pairs of a {token: id} mapping, other entries left out."""
    if not isinstance(mapping, dict):
        return {}
    return {str(t): i for t, i in mapping.items() if isinstance(i, int) and not isinstance(i, bool)}


def tokenizer_tokens(model_dir: str | Path) -> dict[str, int]:
    """Every token the folder's tokenizer files name, with its id (token -> id). Raises ModelCheckError when
    the folder has none of TOKENIZER_FILES or one of them is not JSON."""
    folder = Path(model_dir)
    present = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not present:
        raise ModelCheckError(
            f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
            "checkpoint's tokenizer files into it"
        )
    tokens: dict[str, int] = {}
    for path in present:
        data = _read_json(path)
        if not isinstance(data, dict):
            continue
        if path.name == "tokenizer.json":
            tokens.update(_ids((data.get("model") or {}).get("vocab")))
            for entry in data.get("added_tokens") or []:
                if isinstance(entry, dict) and isinstance(entry.get("id"), int):
                    tokens[str(entry.get("content"))] = entry["id"]
        elif path.name == "tokenizer_config.json":
            for tid, entry in (data.get("added_tokens_decoder") or {}).items():
                if isinstance(entry, dict) and str(tid).isdigit():
                    tokens[str(entry.get("content"))] = int(tid)
        else:  # added_tokens.json, vocab.json: {token: id}
            tokens.update(_ids(data))
    return tokens


def _embedding_rows(config: dict[str, Any]) -> int | None:
    for section in (config.get("text_config") or {}, config):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None


def coordexp_fix(model_path: str) -> str:
    """The two ways out for a checkpoint without the coord tokens."""
    return (
        f"run `rmsft prepare-model {model_path} DST` (it adds the tokens and writes a new model folder) and "
        "set spec.model.path to DST, or set spec.training.format: qwen_json (plain-text coordinates, the "
        "stock Qwen-VL answer format)"
    )


def check_model(model_dir: str | Path, fmt: str, field: str = "spec.model.path") -> str:
    """One line saying that the folder fits `fmt` (coordexp, coordjson or qwen_json); raises ModelCheckError, whose
    message names `field` and the fix, when it does not: no such folder, no model folder (config.json), no tokenizer,
    or (coordexp, coordjson) coord tokens missing, partly present or past the model's embedding rows."""
    folder = Path(model_dir)
    if not folder.exists():
        raise ModelCheckError(
            f"model folder {folder} does not exist ({field}): point {field} at the model folder "
            "as the job's processes see it (in a cluster: inside the pods, where spec.model.volume "
            "mounts it)"
        )
    if not folder.is_dir():
        raise ModelCheckError(f"{folder} ({field}) is a file, not a model folder")
    if not (folder / "config.json").is_file():
        raise ModelCheckError(
            f"{folder} ({field}) is not a model folder: it has no config.json (a Hugging Face "
            "checkpoint folder has config.json, weights and tokenizer files)"
        )
    config = _read_json(folder / "config.json")
    tokens = tokenizer_tokens(folder)
    if fmt == "qwen_json":
        return f"{folder}: a model folder with a tokenizer; training.format qwen_json needs nothing more"
    if fmt not in ("coordexp", "coordjson"):
        raise ModelCheckError(f"training.format must be coordexp, coordjson or qwen_json, got {fmt!r}")
    present = [t for t in COORD_TOKENS if t in tokens]
    if not present:
        raise ModelCheckError(
            f"the model in {folder} ({field}) does not fit training.format {fmt}: its tokenizer has none of the "
            f"{NUM_COORD_BINS} coordinate tokens <|coord_0|>..<|coord_{NUM_COORD_BINS - 1}|> that format writes "
            f"coordinates with (a stock checkpoint). Fix: {coordexp_fix(str(folder))}"
        )
    if len(present) < NUM_COORD_BINS:
        missing = next(t for t in COORD_TOKENS if t not in tokens)
        raise ModelCheckError(
            f"the model in {folder} ({field}) has {len(present)} of the {NUM_COORD_BINS} coordinate tokens "
            f"training.format {fmt} needs (e.g. no {missing}): start from the stock checkpoint and "
            f"{coordexp_fix('STOCK')}"
        )
    top = max(tokens[t] for t in COORD_TOKENS)
    rows = _embedding_rows(config) if isinstance(config, dict) else None
    if rows is not None and top >= rows:
        raise ModelCheckError(
            f"the tokenizer in {folder} ({field}) has the coordinate tokens (ids up to {top}) but the model has "
            f"only {rows} embedding rows (config.json vocab_size): the tokens were added to the tokenizer alone. "
            f"Start from the stock checkpoint and {coordexp_fix('STOCK')}"
        )
    return f"{folder}: the tokenizer has the {NUM_COORD_BINS} coordinate tokens training.format {fmt} needs"
