"""Logits only where the loss reads them, a chunk at a time: the output head applied per chunk of target positions,
recomputed in backward (`spec.training.loss.logits: chunked`).

Why: a packed row's full logits are [L, V]; at 8192 tokens and Qwen3-VL's 152k vocabulary that is 2.5 GB in bf16,
and the loss's fp32 copy, its softmax and both gradients make it about 15 GB, most of a learner GPU's activations.
The loss needs logits only at target positions (a prompt and its image tokens have none), and each loss term is a
function of one position's logits, so the terms can be computed chunk by chunk: per chunk the head makes the chunk's
logits, the per-position terms ([c] vectors) are kept and the logits are dropped (torch.utils.checkpoint), and the
backward makes them again, one chunk at a time. Peak: one chunk's logits and their gradient.

Public API
- `RowHead(hidden [L, H], head, chunk=DEFAULT_CHUNK)`: a row's final hidden states and the model's output head.
  `.map(rows, fn, *aux) -> tuple[Tensor, ...]`: `fn(logits [c, V], *aux_chunk)` returns [c]-shaped tensors; run on
  the logits of hidden rows `rows` (positions - 1: the logits that predict the targets), chunk by chunk, concatenated.
- `logits_rows(source, rows, fn, *aux)`: the same on full logits [L, V] (one call, today's computation) or a RowHead.
- `token_ce(source, rows, labels, temperature=1.0) -> [n]`: fp32 cross-entropy of `labels` under the logits of
  `rows` (the CE term, GRPO's log-probs); with a `fused` RowHead one call of liger-kernel's fused linear
  cross-entropy (learner/core/fused.py: no logits of more than its own small chunk exist, forward or backward),
  else `logits_rows`.
- `row_outputs(forward, model, inputs, mode, chunk) -> Tensor | RowHead`: the forward of one row: full logits
  [1, L, V] (`full`), or the hidden states and the head with no logits computed (`chunked`; `fused`, and `auto`
  where the kernel can run: a RowHead with `fused` set, `learner.core.fused.resolve_logits_mode`).

The values are those of the full path: the same functions run on the same rows of the same head's output (a GEMM on
fewer rows may round its last bit differently; tests/core/test_core_chunked_loss.py bounds it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 1024  # target positions per chunk: 1024 x 152k fp32 logits = 0.6 GB, a few % of a learner GPU
LOGITS_MODES = ("chunked", "fused", "full")  # and `auto`: fused where the kernel can run, else chunked

RowTerms = Callable[..., tuple[torch.Tensor, ...]]


@dataclass
class RowHead:
    """One row's final hidden states [L, H] (after the last norm) and the model's output head (a module: LoRA or
    trainable-token wrappers on it take part, and under ZeRO-3 its hooks gather its weight)."""

    hidden: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]
    chunk: int = DEFAULT_CHUNK
    # training.loss.logits fused: `token_ce` (the CE term, GRPO's log-probs) runs liger-kernel's fused linear
    # cross-entropy on the head's weight; every other term still goes through `map` (learner/core/fused.py).
    fused: bool = False

    def __post_init__(self) -> None:
        if self.hidden.dim() == 3:
            if self.hidden.shape[0] != 1:
                raise ValueError(f"a packed row has batch size 1, got hidden states {tuple(self.hidden.shape)}")
            self.hidden = self.hidden[0]
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")

    @property
    def length(self) -> int:
        return int(self.hidden.shape[0])

    def zero(self) -> torch.Tensor:
        """A zero in the graph (a row without targets still backwards)."""
        return 0.0 * self.hidden.reshape(-1)[0].float().clamp(-1.0, 1.0)

    def map(self, rows: torch.Tensor, fn: RowTerms, *aux: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`fn` on the logits of `rows`, `chunk` rows at a time; each output concatenated over the chunks. With grad
        on, a chunk's logits are not kept: backward recomputes them (the RNG state is restored, so a dropout in the
        head draws the same mask)."""
        pieces: list[tuple[torch.Tensor, ...]] = []
        for lo in range(0, int(rows.numel()), self.chunk):
            idx = rows[lo : lo + self.chunk]
            part = tuple(a[lo : lo + self.chunk] for a in aux)
            if torch.is_grad_enabled():
                out = checkpoint(self._terms, self.hidden, idx, fn, *part, use_reentrant=False)
            else:
                out = self._terms(self.hidden, idx, fn, *part)
            pieces.append(tuple(out))
        if len(pieces) == 1:
            return pieces[0]
        return tuple(torch.cat(cols) for cols in zip(*pieces, strict=True))

    def _terms(
        self, hidden: torch.Tensor, idx: torch.Tensor, fn: RowTerms, *aux: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return tuple(fn(self.head(hidden[idx]), *aux))


def logits_rows(
    source: torch.Tensor | RowHead, rows: torch.Tensor, fn: RowTerms, *aux: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`fn(logits[rows], *aux)`: on full logits [L, V] in one call, on a `RowHead` chunk by chunk."""
    if isinstance(source, RowHead):
        return source.map(rows, fn, *aux)
    return tuple(fn(source[rows], *aux))


def token_ce(
    source: torch.Tensor | RowHead, rows: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[n] fp32 cross-entropy of `labels` under the logits of `rows` divided by `temperature`, with grad: on full
    logits or chunk by chunk (`logits_rows`), or with a fused RowHead in liger-kernel's kernel (temperature 1 only:
    the kernel has no logit scale, and dividing bf16 hidden states instead would round differently; another
    temperature takes the chunked path)."""
    if isinstance(source, RowHead) and source.fused and temperature == 1.0:
        from learner.core.fused import fused_token_ce  # imports liger_kernel: only where the mode is fused

        return fused_token_ce(source.hidden[rows], source.head, labels)
    return logits_rows(source, rows, _ce_terms(temperature), labels)[0]


def _ce_terms(temperature: float) -> RowTerms:
    def terms(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor]:
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        return (torch.nn.functional.cross_entropy(z, labels, reduction="none"),)

    return terms


def squeeze_row(source: torch.Tensor | RowHead, length: int) -> torch.Tensor | RowHead:
    """Full logits [1, L, V] -> [L, V] (a RowHead is already per row); checks the row's length."""
    if isinstance(source, RowHead):
        got = source.length
    else:
        if source.dim() == 3:
            if source.shape[0] != 1:
                raise ValueError(f"a packed row has batch size 1, got logits of shape {tuple(source.shape)}")
            source = source[0]
        got = int(source.shape[0])
    if got != length:
        raise ValueError(f"logits cover {got} positions but the row has {length}")
    return source


def zero_of(source: torch.Tensor | RowHead) -> torch.Tensor:
    """A zero that stays in the graph (backward works on rows without targets), NaN-free for inf logits."""
    if isinstance(source, RowHead):
        return source.zero()
    return 0.0 * source.reshape(-1)[0].clamp(-1.0, 1.0)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under peft's and DeepSpeed's wrappers."""
    m = getattr(model, "module", model)  # a DeepSpeed engine
    get_base = getattr(m, "get_base_model", None)  # a PeftModel
    return get_base() if callable(get_base) else m


class ChunkedLogitsError(RuntimeError):
    """The model cannot run the chunked loss (names why and the setting that avoids it)."""


def _chunkable(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model's decoder (its output's first field: the final, normed hidden states) and its output head; refuses
    a model whose logits are more than the head of the hidden states (soft-capping, a logit scale)."""
    hf = _unwrap(model)
    cfg = getattr(hf, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(text, attr, None) not in (None, 1.0):
            raise ChunkedLogitsError(
                f"{type(hf).__name__} transforms its logits after the head ({attr}); set "
                "spec.training.loss.logits: full"
            )
    get_decoder = getattr(hf, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        raise ChunkedLogitsError(
            f"{type(hf).__name__} exposes no decoder and output head (get_decoder, "
            "get_output_embeddings); set spec.training.loss.logits: full"
        )
    return decoder, head


def row_outputs(
    forward: Callable[..., Any],
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    mode: str,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor | RowHead:
    """One packed row's forward through `forward` (the updater's, or the model itself): the full logits, or with
    `chunked` the row's final hidden states and the head, the model asked for the logits of no position
    (`logits_to_keep` an empty index: its head runs on 0 rows)."""
    if mode == "full":
        return forward(**inputs).logits
    if mode not in (*LOGITS_MODES, "auto"):
        raise ValueError(f"spec.training.loss.logits must be one of {('auto', *LOGITS_MODES)}, got {mode!r}")
    decoder, head = _chunkable(model)
    fused = False
    if mode in ("auto", "fused"):  # the kernel where it can run (auto), or refused where it cannot (fused)
        from learner.core.fused import resolve_logits_mode

        fused = resolve_logits_mode(mode, inputs["input_ids"].device, head) == "fused"
    seen: list[torch.Tensor] = []

    def keep(_m: torch.nn.Module, _a: Any, out: Any) -> None:
        seen.append(out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out)

    hook = decoder.register_forward_hook(keep)
    try:
        ids = inputs["input_ids"]
        out = forward(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=ids.device))
    finally:
        hook.remove()
    if len(seen) != 1 or out.logits.shape[-2] != 0:
        raise ChunkedLogitsError(
            f"{type(_unwrap(model)).__name__}'s forward ran its decoder {len(seen)} time(s) and "
            f"returned logits of shape {tuple(out.logits.shape)} for an empty logits_to_keep; "
            "set spec.training.loss.logits: full"
        )
    hidden = seen[0]
    if hidden.dim() != 3 or hidden.shape[:2] != ids.shape[:2]:
        raise ChunkedLogitsError(
            f"the decoder's output {tuple(hidden.shape)} is not the row's hidden states "
            f"(input {tuple(ids.shape)}); set spec.training.loss.logits: full"
        )
    return RowHead(hidden, head, chunk, fused=fused)
