"""The updater: how one optimizer step is taken, plain torch (gradients all-reduced over ranks, `PlainUpdater`) or
DeepSpeed ZeRO (`ZeroUpdater`). The training loop holds one as `loop.updater`.

The training loop calls the same four things either way:
    updater.begin() -> updater.forward(**inputs) / updater.backward(loss) per row -> updater.finish(rows, lr)
and never asks which it has. The updater also owns where training runs (`device`) and the numeric
context of the forward (`autocast`), so the loop writes `.to(updater.device)` where rows move.

Nothing here reads a tensor back to the host: an updater runs unchanged with its parameters on the
`meta` device (tests/learner/test_placement.py), which is how placement is proven without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from learner.core.fused import check_logits_mode
from learner.train import zero
from learner.train.policy import autocast_context
from learner.train.ranks import Ranks


def resolve_device(setting: str) -> torch.device:
    """`training.device`: auto = cuda:LOCAL_RANK when CUDA is available (each torchrun rank on its
    own GPU), else cpu; or an explicit device."""
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"spec.training.device is {setting!r} but CUDA is not available on this machine")
    return device


class Updater(Protocol):
    """How the optimizer steps, as the loop drives it: `PlainUpdater` (torch AdamW) or `ZeroUpdater` (DeepSpeed)."""

    device: torch.device

    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...
    def forward(self, **inputs: Any) -> Any: ...
    def begin(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def finish(self, n_rows: int, lr: float) -> None: ...
    def optimizer_state(self) -> dict[str, Any]: ...
    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class PlainUpdater:
    """torch AdamW; with several ranks, gradients are summed (all-reduce) before clipping."""

    def __init__(
        self,
        model: torch.nn.Module,
        ranks: Ranks,
        *,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        device: torch.device,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.ranks, self.device, self.max_grad_norm = model, ranks, device, max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self._autocast_dtype = autocast_dtype

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast_context(self.device, self._autocast_dtype)

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    def begin(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish(self, n_rows: int, lr: float) -> None:
        self.ranks.all_reduce_grads(self.params)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def close(self) -> None:
        """Nothing to release: the optimizer holds no process-group buffers (ZeroUpdater's DeepSpeed engine does)."""


class ZeroUpdater:
    """DeepSpeed ZeRO-1/2/3 (learner/train/zero.py has why each call is what it is)."""

    ds_engine: Any  # DeepSpeed's engine around the model and AdamW (not a rollout engine); None once closed

    def __init__(
        self,
        model: torch.nn.Module,
        ranks: Ranks,
        *,
        stage: int,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        device: torch.device,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.ranks, self.device = ranks, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        # DeepSpeed moves the module to its own device (cuda:LOCAL_RANK, or the CPU); rows follow it.
        precision = "bf16" if autocast_dtype == torch.bfloat16 else "fp32"
        self.ds_engine = zero.deepspeed_engine(model, optimizer, stage, max_grad_norm, precision)
        self.device = torch.device(self.ds_engine.device) if device.type != "meta" else device
        self._autocast_dtype = autocast_dtype
        self._rows = 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast_context(self.device, self._autocast_dtype)

    def forward(self, **inputs: Any) -> Any:
        # Through the engine: ZeRO-3 counts micro-steps in engine.forward (on the bare module every
        # micro-step's gradients would replace the previous ones).
        return self.ds_engine(**inputs)

    def begin(self) -> None:
        self._rows = 0

    def backward(self, loss: torch.Tensor) -> None:
        zero.zero_backward(self.ds_engine, loss, self.ranks.world_size)
        self._rows += 1

    def finish(self, n_rows: int, lr: float) -> None:
        zero.pad_micro_steps(self.ds_engine, self._rows, self.ranks)
        zero.zero_step(self.ds_engine, lr)

    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer partition (and its fp32 master weights): its own, saved in its own part."""
        return self.ds_engine.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """This rank's own partition, as `optimizer_state` gave it (same world size)."""
        zero.load_zero_optimizer(self.ds_engine, state)

    def close(self) -> None:
        if self.ds_engine is not None:  # its optimizer holds buffers tied to the process group
            self.ds_engine.destroy()
            self.ds_engine = None


def make_updater(
    model: torch.nn.Module, ranks: Ranks, cfg: Any, *, device: torch.device, autocast_dtype: torch.dtype | None = None
) -> PlainUpdater | ZeroUpdater:
    """The updater `training.deepspeed_stage` asks for, with the model already on `device`. Refuses first, at
    the learner's start, a `training.loss.logits: fused` this learner cannot run (no CUDA, no liger-kernel, a head
    the kernel cannot take: learner/core/fused.py), saying to use chunked."""
    check_logits_mode(cfg.loss.logits, device, model, cfg.deepspeed_stage)
    common = {
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm,
        "device": device,
        "autocast_dtype": autocast_dtype,
    }
    if cfg.deepspeed_stage:
        return ZeroUpdater(model, ranks, stage=cfg.deepspeed_stage, **common)
    return PlainUpdater(model, ranks, **common)


@contextlib.contextmanager
def gathered_weights(updater: Updater, model: torch.nn.Module, **kw: Any) -> Iterator[None]:
    """Whole parameters inside the block (ZeRO-3: collective on every rank; otherwise a no-op)."""
    with zero.gathered(getattr(updater, "ds_engine", None), model, **kw):
        yield
