"""`spec.training.loss.logits: fused | auto`: the token cross-entropy in liger-kernel's fused linear cross-entropy
kernel (Triton, CUDA), the other loss terms in the chunked path (learner/core/head.py).

Which terms the kernel computes, and why only those: it takes the hidden states, the head's weight and one target
token per position and returns that token's cross-entropy (per position with reduction "none", the gradient of a
per-position weight folded in before the head's gradient is summed), without the logits of more than its own
chunk (about hidden-size x positions elements) ever existing, forward or backward.
- The CE term over every labelled position, per-token weights (`ce_weights`: an explorer-recovered object's)
  multiplied onto its per-position output: the kernel.
- GRPO's log-probs of the completion tokens (-CE of the sampled token) and its reference policy's: the kernel at
  spec.training.grpo.temperature 1; at another temperature the chunked path (the kernel has no logit scale, and
  dividing bf16 hidden states by it would round differently from dividing the logits).
- The coordinate terms (soft CE, W1, gate, coord CE, the box terms' expected coordinates) and the unlikelihood
  term: the chunked path. They need a position's coordinate logits or its whole distribution, not one token's CE;
  they are read at coordinate and duplicate positions only, a small share of a row's targets.

Where it runs: a CUDA device, the liger-kernel package importable (the GPU image installs it: pyproject.toml's
`fused` extra, requirements/constraints-gpu.txt; the CPU image and CI do not), and a head whose weight is one
tensor: a bias-free nn.Linear (tied or not), or peft's trainable token rows on one (training.lora.coord_rows:
the merged weight, as their forward makes it). Not under ZeRO-3 (the head's weight is a partition outside its
forward). `auto` (the default) takes fused where all of that holds and chunked otherwise; `fused` asked for
where it cannot run is refused: at admission (spec.placement.accelerator 'none', spec.training.deepspeed_stage 3:
rmsft.jobspec.job) and at the learner's start (`check_logits_mode`: no CUDA device, no liger-kernel, another
head), each saying to use chunked. Values: those of the chunked path within the kernel's fp32 reduction order
(tests/gpu/test_fused_loss_gpu.py); the selection is tested on the CPU (tests/core/test_core_fused_select.py).

Public API
- `FusedLogitsError(ValueError)`: fused asked for where it cannot run (a ValueError: exit code 2, refused).
- `fused_unavailable(device, head=None, deepspeed_stage=0) -> str | None`: why the kernel cannot run here, or None.
- `resolve_logits_mode(mode, device, head=None, deepspeed_stage=0) -> "fused" | "chunked" | "full"`.
- `check_logits_mode(mode, device, model, deepspeed_stage)`: the learner's start: refuses fused that cannot run.
- `fused_token_ce(hidden [n, H], head, labels [n]) -> [n]`: fp32 per-position CE through the kernel, with grad.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

LIGER_MODULE = "liger_kernel.transformers.functional"  # liger_fused_linear_cross_entropy
_USE_CHUNKED = "set spec.training.loss.logits: chunked (the same loss without the kernel) or auto"


class FusedLogitsError(ValueError):
    """spec.training.loss.logits fused where the kernel cannot run; the message says why and what to set. A
    ValueError: a refused configuration, exit code 2 (rmsft.exit_codes.exit_code_for)."""


def _liger_missing() -> str | None:
    try:
        importlib.import_module(LIGER_MODULE)
    except Exception as exc:  # not installed, or its Triton cannot load: either way the kernel is not there
        return (
            f"the liger-kernel package cannot be imported ({type(exc).__name__}: {exc}); the GPU image installs "
            "it (pyproject.toml's `fused` extra), the CPU image does not"
        )
    return None


def _weight_source(head: torch.nn.Module) -> Callable[[], torch.Tensor] | str:
    """How to get the head's whole weight [V, H] for the kernel, or why it cannot be had."""
    name = type(head).__name__
    inner = getattr(head, "token_adapter", None)  # peft's TrainableTokensWrapper: its forward is the layer's
    if isinstance(inner, torch.nn.Module):
        head = inner
    base = getattr(head, "base_layer", None)
    if base is not None and hasattr(head, "trainable_tokens_delta"):  # peft's TrainableTokensLayer (coord_rows)
        if type(base) is not torch.nn.Linear or base.bias is not None:
            return f"the output head is trainable token rows on a {type(base).__name__}, not a bias-free Linear"
        if getattr(base.weight, "ds_id", None) is not None:
            return "the output head's weight is partitioned (DeepSpeed ZeRO-3)"
        if head.disable_adapters or head.merged or not head.active_adapters:  # e.g. GRPO's reference policy
            return lambda: base.weight
        return lambda: head.get_merged_weights(head.active_adapters)
    if type(head) is not torch.nn.Linear:  # a LoRA-wrapped or quantized head computes more than weight @ h
        return f"the output head is a {name}, not a bias-free Linear (nor trainable token rows on one)"
    if head.bias is not None:
        return "the output head has a bias"
    if getattr(head.weight, "ds_id", None) is not None:
        return "the output head's weight is partitioned (DeepSpeed ZeRO-3)"
    return lambda: head.weight


def fused_unavailable(
    device: torch.device | str, head: torch.nn.Module | None = None, deepspeed_stage: int = 0
) -> str | None:
    """Why liger-kernel's fused cross-entropy cannot run for this learner, or None when it can."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return f"it is a CUDA (Triton) kernel and this learner runs on {torch.device(device).type}"
    if deepspeed_stage == 3:
        return "spec.training.deepspeed_stage 3 partitions the output head's weight"
    missing = _liger_missing()
    if missing:
        return missing
    if head is not None:
        source = _weight_source(head)
        if isinstance(source, str):
            return source
    return None


_told: set[tuple[str, str]] = set()


def resolve_logits_mode(
    mode: str, device: torch.device | str, head: torch.nn.Module | None = None, deepspeed_stage: int = 0
) -> str:
    """The loss's logits mode for this learner: `auto` -> fused where the kernel can run, else chunked (said once);
    `fused` where it cannot -> FusedLogitsError; chunked and full as they are."""
    if mode in ("chunked", "full"):
        return mode
    if mode not in ("auto", "fused"):
        raise ValueError(f"spec.training.loss.logits must be auto, fused, chunked or full, got {mode!r}")
    why = fused_unavailable(device, head, deepspeed_stage)
    if why is None:
        picked = "fused"
    elif mode == "fused":
        raise FusedLogitsError(
            f"spec.training.loss.logits fused (liger-kernel's fused linear cross-entropy) cannot "
            f"run here: {why}; {_USE_CHUNKED}"
        )
    else:
        picked = "chunked"
    if mode == "auto" and (picked, why or "") not in _told:
        _told.add((picked, why or ""))
        log.info(
            "training.loss.logits auto: %s%s",
            picked,
            f" ({why})"
            if why
            else " (liger-kernel's fused cross-entropy for the CE term and log-probs; learner/core/fused.py)",
        )
    return picked


def check_logits_mode(mode: str, device: torch.device | str, model: torch.nn.Module, deepspeed_stage: int) -> None:
    """At the learner's start, before a step is paid for: refuse `fused` that cannot run (a FusedLogitsError that
    says to use chunked); `auto` says which it takes."""
    if mode not in ("auto", "fused"):
        return
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    resolve_logits_mode(mode, device, head if isinstance(head, torch.nn.Module) else None, deepspeed_stage)


def fused_token_ce(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | torch.nn.Module, labels: torch.Tensor
) -> torch.Tensor:
    """[n] fp32 cross-entropy of `labels` under `head(hidden)`, through the kernel (reduction "none": its backward
    recomputes the chunk's logits and folds in each position's upstream gradient, so per-token weights multiplied
    onto the result are exact)."""
    if hidden.shape[0] == 0:
        return hidden.sum(-1).float()  # no positions: empty, in the graph
    if not isinstance(head, torch.nn.Module):
        raise FusedLogitsError(f"the output head is a {type(head).__name__}, not a module; {_USE_CHUNKED}")
    source = _weight_source(head)
    if isinstance(source, str):
        raise FusedLogitsError(f"spec.training.loss.logits fused cannot run: {source}; {_USE_CHUNKED}")
    weight = source()
    fn = importlib.import_module(LIGER_MODULE).liger_fused_linear_cross_entropy
    # The kernel's GEMM takes both operands in one dtype; under autocast the hidden states may be fp32 beside a
    # bf16 weight, which the head's own F.linear would have cast to the autocast dtype.
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    ce = fn(hidden.contiguous(), weight, labels.contiguous(), reduction="none")
    return ce.float()
