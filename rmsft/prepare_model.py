"""`rmsft prepare-model SRC DST`: make a stock checkpoint CoordExp-ready.

A stock Qwen2 / Qwen2.5-VL / Qwen3-VL checkpoint has no `<|coord_k|>` tokens; rmsft's parser, targets
and losses need all 1000 (learner/core/vocab.py). This adds them to the tokenizer the way the tiny
CoordExp models have them (ordinary added tokens, `special=False`, `normalized=False`: decoding keeps
them and the text around them is never normalised into them), gives them embedding rows (input
embeddings and output head, tied or not) and writes a complete model folder to DST: weights, config
(vocabulary sizes, nested `text_config` for vision-language models), generation config, tokenizer,
chat template and every other file of SRC (processor configs, ...) as it was.

Rows of the new tokens: the mean of the existing tokens' rows plus a small ordered component
(`coord_rows`). Old rows are copied bit for bit, so the model's outputs on text without coord tokens
are unchanged apart from the logits of the new tokens themselves.

Idempotent: a SRC that already has the 1000 tokens needs nothing, and a DST that already holds SRC
prepared (its `rmsft_prepare_model.json` names SRC as it is now) is left as it is; both say so.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmsft.model_folder import forget_load_options
from rmsft.output_folder import OutputFolderError, check_output_folder, staged_folder

if TYPE_CHECKING:
    import torch

# The coord tokens a CoordExp vocabulary has (the core's `learner.core.codec.coord_token_text`), in bin order;
# the tiny builders (rmsft_dev) add the same ones.
NUM_COORD_BINS = 1000
COORD_TOKENS = [f"<|coord_{k}|>" for k in range(NUM_COORD_BINS)]
MARKER_FILE = "rmsft_prepare_model.json"
# The ordered component's radius, as a fraction of the existing rows' spread (root mean square
# distance from their mean). Small: see `coord_rows`.
ORDER_SCALE = 0.1
ORDER_SEED = 0  # the two directions of the ordered component: the same for every run (reproducible bytes)

# Never copied from SRC: the weights and config (written from the resized model), tokenizer files the
# tokenizer writes itself (added_tokens.json is a slow-tokenizer list of added tokens that would lack
# the new ones), and the tiny builders' markers (a copy would make `rmsft dev tiny-model DST` think its
# model were there).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = {
    "config.json",
    "added_tokens.json",
    MARKER_FILE,
    "rmsft_tiny_model.json",
    "rmsft_tiny_vl_model.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
}


class PrepareModelError(ValueError):
    """SRC cannot be prepared, or DST cannot take the result; the message says why and what to do."""


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare_model` did (or found already done)."""

    src: str
    dst: str
    changed: bool  # False: nothing was written
    reason: str  # one line: what was done, or why nothing was
    tokens_added: int = 0
    first_coord_id: int | None = None
    last_coord_id: int | None = None
    old_vocab: int = 0  # len(tokenizer)
    new_vocab: int = 0
    old_rows: int = 0  # embedding rows (input embeddings; the output head has as many)
    new_rows: int = 0
    tied: bool | None = None
    vision_language: bool = False
    dtype: str = ""

    def lines(self) -> list[str]:
        out = [self.reason]
        if not self.tokens_added:
            return out
        out += [
            f"tokens added: {self.tokens_added} (<|coord_0|>..<|coord_{NUM_COORD_BINS - 1}|> = ids "
            f"{self.first_coord_id}..{self.last_coord_id}; added tokens, not special)",
            f"vocabulary: {self.old_vocab} -> {self.new_vocab} tokens",
            f"embedding rows: {self.old_rows} -> {self.new_rows} "
            + ("(input embeddings and output head tied)" if self.tied else "(input embeddings and untied output head)"),
            f"new rows: mean of the existing tokens' rows + an ordered component ({ORDER_SCALE} x their spread)",
            f"config: {'text_config.' if self.vision_language else ''}vocab_size = {self.new_rows}; dtype {self.dtype}",
        ]
        return out


def coord_rows(existing: torch.Tensor, n_bins: int = NUM_COORD_BINS, scale: float = ORDER_SCALE) -> torch.Tensor:
    """Initial rows (float32, shape (n_bins, d)) for the coord tokens, from the existing tokens' rows.

    Row k = mean + scale * r * (cos(t_k) u + sin(t_k) v), t_k = pi * k / (n_bins - 1), where r is the
    existing rows' root mean square distance from their mean and u, v are two fixed orthonormal
    directions. Why:
    - The mean keeps the model's behaviour: with a tied head a new token's logit h.mean is the
      average of the old tokens' logits, never above the best one, so greedy decoding is unchanged
      and the new tokens take little probability mass (Hewitt, "Initializing new word embeddings").
    - The bins are ordinal, and all 1000 rows equal would make them indistinguishable at the start.
      On a half circle the distance between bins i and j, 2 s r sin(pi |i-j| / (2 (n_bins-1))),
      grows with |i-j|: neighbouring bins start close, far bins apart, so what training teaches one
      bin carries to its neighbours first (the ordinal prior CoordExp's coordinate losses also use).
    - `scale` 0.1 keeps that component well inside the existing rows' spread, so it moves a logit
      by a fraction of the usual gap between the best token and the average one.
    """
    import torch

    x = existing.detach().float()
    mean = x.mean(dim=0)
    radius = (x - mean).pow(2).sum(dim=1).mean().sqrt()
    u, v = _ordered_directions(x.shape[1])
    t = torch.arange(n_bins, dtype=torch.float64) * (math.pi / max(n_bins - 1, 1))
    circle = torch.cos(t).float()[:, None] * u + torch.sin(t).float()[:, None] * v
    return mean + scale * radius * circle


def _ordered_directions(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    if dim < 2:
        raise PrepareModelError(f"embedding width {dim} is too small for the ordered coord rows")
    g = torch.Generator().manual_seed(ORDER_SEED)
    q, _ = torch.linalg.qr(torch.randn(dim, 2, generator=g, dtype=torch.float64))
    return q[:, 0].float(), q[:, 1].float()


def _source_config(src: Path) -> dict[str, Any]:
    if not src.is_dir():
        raise PrepareModelError(f"{src} is not a model folder (no such folder)")
    try:
        cfg = json.loads((src / "config.json").read_text())
    except FileNotFoundError:
        raise PrepareModelError(f"{src} is not a model folder: it has no config.json") from None
    except (OSError, ValueError) as exc:
        raise PrepareModelError(f"{src}/config.json cannot be read: {exc}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise PrepareModelError(f"{src}/config.json is not a transformers model config (no model_type)")
    return cfg


def _fingerprint(src: Path) -> str:
    """Identifies SRC's contents without reading its weights: small files by content, large ones by
    name, size and modification time (what a changed checkpoint changes)."""
    h = hashlib.sha256()
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0".encode())
        h.update(f.read_bytes() if st.st_size <= (4 << 20) else str(st.st_mtime_ns).encode())
    return h.hexdigest()


def _coord_presence(tokenizer: Any) -> list[str]:
    vocab = tokenizer.get_vocab()
    return [t for t in COORD_TOKENS if t in vocab]


def _load_tokenizer(src: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        raise PrepareModelError(f"{src} is not a model folder: its tokenizer cannot be loaded ({exc})") from None


def _text_vocab_size(cfg: dict[str, Any]) -> int | None:
    for section in (cfg.get("text_config") or {}, cfg):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None


def _already_done(src: Path, dst: Path, fingerprint: str) -> PrepareSummary | None:
    """The summary of an earlier run when DST already holds SRC (as it is now) prepared."""
    try:
        marker = json.loads((dst / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("source_fingerprint") != fingerprint:
        return None
    if not (dst / "config.json").exists():
        return None
    fields = {k: v for k, v in (marker.get("summary") or {}).items() if k in PrepareSummary.__dataclass_fields__}
    fields.update(
        src=str(src), dst=str(dst), changed=False, reason=f"{dst} already holds {src} prepared (nothing changed)"
    )
    return PrepareSummary(**fields)


def prepare_model(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> PrepareSummary:
    """Write SRC with the 1000 `<|coord_k|>` tokens added to DST (see the module docstring); returns
    what was done. Raises `PrepareModelError` (with what to do) for a SRC that is no model folder, one
    that has only some of the tokens, and a DST that is not empty (unless `overwrite`)."""
    src, dst = Path(src), Path(dst)
    cfg = _source_config(src)
    if dst.exists() and dst.resolve() == src.resolve():
        raise PrepareModelError("DST must be a new folder, not SRC itself (SRC is left as it is)")
    tokenizer = _load_tokenizer(src)
    present = _coord_presence(tokenizer)
    vision_language = "vision_config" in cfg
    if len(present) == NUM_COORD_BINS:
        ids = tokenizer.convert_tokens_to_ids(COORD_TOKENS)
        rows = _text_vocab_size(cfg)
        if rows is not None and max(ids) >= rows:
            raise PrepareModelError(
                f"{src}: the tokenizer has the coord tokens (ids up to {max(ids)}) but the model has only {rows} "
                "embedding rows; it was changed by hand half way. Start from the stock checkpoint"
            )
        return PrepareSummary(
            str(src),
            str(dst),
            changed=False,
            vision_language=vision_language,
            reason=f"{src} already has the {NUM_COORD_BINS} coord tokens: nothing to do "
            "(use it as it is; nothing was written)",
        )
    if present:
        missing = [t for t in COORD_TOKENS if t not in set(present)]
        raise PrepareModelError(
            f"{src}: the tokenizer has {len(present)} of the {NUM_COORD_BINS} coord tokens (e.g. {present[0]}) but "
            f"not the other {len(missing)} (e.g. {missing[0]}); rmsft adds all of them or none. Start from the stock "
            "checkpoint, or add the missing ones with their ids in order"
        )
    fingerprint = _fingerprint(src)
    done = _already_done(src, dst, fingerprint)
    if done is not None:
        return done
    try:
        check_output_folder(dst, overwrite=overwrite)
    except OutputFolderError as exc:
        raise PrepareModelError(str(exc)) from None

    model = _load_model(src, vision_language)
    summary = _add_coord_tokens(model, tokenizer, src, dst, vision_language)
    try:
        with staged_folder(dst, overwrite=overwrite) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            forget_load_options(tokenizer)
            written = {Path(p).name for p in tokenizer.save_pretrained(tmp)}
            # Files the saves wrote win, except the generation config: SRC's, byte for byte.
            ours = {p.name for p in tmp.iterdir()} - {"generation_config.json"}
            _copy_other_files(src, tmp, skip=written | ours)
            _check_written(tmp, summary)
            (tmp / MARKER_FILE).write_text(
                json.dumps(
                    {"source": str(src.resolve()), "source_fingerprint": fingerprint, "summary": asdict(summary)},
                    indent=2,
                )
            )
    except OutputFolderError as exc:
        raise PrepareModelError(str(exc)) from None
    except OSError as exc:
        raise PrepareModelError(f"cannot write {dst}: {exc.strerror or exc}") from None
    return summary


def _load_model(src: Path, vision_language: bool) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_class = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    try:
        # The checkpoint's own dtype: a bf16 model stays bf16 (old rows are copied, not recomputed).
        return model_class.from_pretrained(src, dtype="auto")
    except (OSError, ValueError, ImportError, KeyError) as exc:
        raise PrepareModelError(f"cannot load the model in {src} ({model_class.__name__}): {exc}") from None


def _add_coord_tokens(model: Any, tokenizer: Any, src: Path, dst: Path, vision_language: bool) -> PrepareSummary:
    import torch
    from tokenizers import AddedToken

    old_vocab = len(tokenizer)
    # Rows of the tokens that exist now; rows past them (padding some checkpoints carry, e.g. Qwen's
    # 151936 rows for 151665 tokens) belong to no token and are not part of the mean.
    old_ids = sorted({i for i in tokenizer.get_vocab().values()})
    inp = model.get_input_embeddings()
    head = model.get_output_embeddings()
    old_rows = inp.weight.shape[0]
    tied = head is not None and head.weight.data_ptr() == inp.weight.data_ptr()
    if old_ids and old_ids[-1] >= old_rows:
        raise PrepareModelError(
            f"{src}: the tokenizer has ids up to {old_ids[-1]} but the model only {old_rows} "
            "embedding rows; the folder is inconsistent"
        )
    added = tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in COORD_TOKENS])
    ids = tokenizer.convert_tokens_to_ids(COORD_TOKENS)
    if added != NUM_COORD_BINS or len(set(ids)) != NUM_COORD_BINS or min(ids) < old_vocab:
        raise PrepareModelError(
            f"{src}: the tokenizer gave the coord tokens unexpected ids ({added} added, ids "
            f"{min(ids)}..{max(ids)} for {old_vocab} tokens before)"
        )
    need = max(ids) + 1
    if need > old_rows:
        # mean_resizing=False: transformers' own mean init samples rows at random; ours replace them below.
        model.resize_token_embeddings(need, mean_resizing=False)
        inp, head = model.get_input_embeddings(), model.get_output_embeddings()
    new_rows = inp.weight.shape[0]
    _set_vocab_size(model.config, new_rows)
    index = torch.tensor(ids)
    with torch.no_grad():
        w = inp.weight
        w[index] = coord_rows(w[torch.tensor(old_ids)]).to(w.dtype)
        if head is not None and not tied:
            hw = head.weight
            hw[index] = coord_rows(hw[torch.tensor(old_ids)]).to(hw.dtype)
            if getattr(head, "bias", None) is not None:
                # The average old bias: the new tokens' logits stay at the old tokens' average.
                head.bias[index] = head.bias[torch.tensor(old_ids)].float().mean().to(head.bias.dtype)
    dtype = str(w.dtype).removeprefix("torch.")
    return PrepareSummary(
        str(src),
        str(dst),
        changed=True,
        reason=f"prepared {src} -> {dst}",
        tokens_added=added,
        first_coord_id=ids[0],
        last_coord_id=ids[-1],
        old_vocab=old_vocab,
        new_vocab=len(tokenizer),
        old_rows=old_rows,
        new_rows=new_rows,
        tied=tied,
        vision_language=vision_language,
        dtype=dtype,
    )


def _set_vocab_size(config: Any, rows: int) -> None:
    """The text model's vocab_size (nested `text_config` for vision-language models, where transformers'
    resize writes it) and a top-level copy where the config keeps one too."""
    text = config.get_text_config()
    text.vocab_size = rows
    if text is not config and "vocab_size" in config.to_dict():
        config.vocab_size = rows


def _copy_other_files(src: Path, dst: Path, skip: set[str]) -> None:
    """SRC's other top-level files (processor and image-processor configs, chat template files, README,
    license, generation config) as they are."""
    for f in sorted(src.iterdir()):
        name = f.name
        if not f.is_file() or name in skip or name in _NOT_COPIED or name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(f, dst / name)


def _check_written(folder: Path, summary: PrepareSummary) -> None:
    """Read the written tokenizer back: every coord token at the id the rows were made for."""
    tok = _load_tokenizer(folder)
    ids = tok.convert_tokens_to_ids(COORD_TOKENS)
    if ids[0] != summary.first_coord_id or ids[-1] != summary.last_coord_id or len(tok) != summary.new_vocab:
        raise PrepareModelError(
            f"the tokenizer written to {folder} does not read back with the coord tokens "
            f"at ids {summary.first_coord_id}..{summary.last_coord_id}"
        )
