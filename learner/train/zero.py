"""DeepSpeed ZeRO-1/2/3 for the learner (`training.deepspeed_stage`), with the same step semantics
as the plain loop: the step's loss is the token-level mean over every rank's rows.

Why the details below:
- DeepSpeed averages gradients over data-parallel ranks; our row losses are already normalised
  by the global target counts, so each loss is multiplied by the world size (average -> sum).
- ZeRO-2 reduces gradients from backward hooks, so every rank must run the same number of
  backward passes: ranks with fewer rows pad with zero-loss passes on a 2-token input, and the
  accumulation boundary is set by hand (rows per step vary), on a final zero-loss pass.
- ZeRO keeps fp32 master partitions apart from the module's parameters: a checkpoint restores
  them from the rank's own saved partition (`load_zero_optimizer`), not from the module weights.
- ZeRO-3 also partitions the parameters: every forward all-gathers them (collective, which the
  padding passes above keep in step), and whatever reads whole weights (weight export for a sync,
  checkpoints) runs inside `gathered`, entered by every rank at the same point. A rank-0-only
  export (re-syncing a restarted server mid-rollout) is impossible then: the sync client refuses
  it and the server is skipped until the next step's collective sync.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from learner.train.ranks import Ranks

SUPPORTED_STAGES = (1, 2, 3)


def require_deepspeed(stage: int) -> None:
    """Raise a clear error when `stage` cannot run here."""
    if stage not in SUPPORTED_STAGES:
        raise RuntimeError(
            f"spec.training.deepspeed_stage {stage} is not supported by the learner (supported: "
            f"{', '.join(map(str, SUPPORTED_STAGES))})"
        )
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # a broken install raises anything from its import
        raise RuntimeError(
            f"spec.training.deepspeed_stage {stage} needs DeepSpeed, which cannot be imported "
            f"({type(exc).__name__}: {exc}); install it (`pip install --no-build-isolation "
            f"-c requirements/constraints.txt deepspeed`, so it builds against the installed torch) "
            "or set deepspeed_stage: 0 "
            "(plain torch data-parallel all-reduce)"
        ) from exc


def _ensure_group() -> None:
    """DeepSpeed needs torch.distributed even for one rank: a private one-rank gloo group."""
    if dist.is_initialized():
        return
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's sanity check wants a launcher's variable
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _no_shm_allreduce_kernel(deepspeed: Any) -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce kernel (`deepspeed_shm_comm`) when its
    communication backend starts. On a CPU machine it builds the C++ op on first use (a minute of compiler time
    on 2 cores, every fresh machine or container) for `inference_all_reduce` alone, which ZeRO training never
    calls: its gradient and parameter collectives go through torch.distributed. DeepSpeed builds only the ops its
    compatibility table marks usable, so marking this one unusable skips the build and changes no collective.
    On GPUs the op does not exist and the table entry changes nothing."""
    ops = getattr(deepspeed, "ops", None)
    table = getattr(ops, "__compatible_ops__", None) if ops is not None else None
    if isinstance(table, dict):
        table["deepspeed_shm_comm"] = False


def precision_section(precision: str) -> dict[str, Any]:
    """DeepSpeed's precision keys for `training.precision`. Both precisions keep the trainable
    parameters (and so ZeRO's optimizer partitions) in fp32 and the frozen ones as loaded
    (learner/train/policy.py); bf16 compute comes from the step's torch autocast (learner/train/updater.py). So
    DeepSpeed's own mixed precision stays off: its `bf16` mode would convert the module to bf16
    and keep fp32 master copies itself, a second, conflicting answer to the same question."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"spec.training.precision {precision!r} is not fp32 or bf16")
    return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}


def deepspeed_engine(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, stage: int, max_grad_norm: float, precision: str = "fp32"
):
    """Wrap `model` and the learner's AdamW in a DeepSpeed engine (ZeRO `stage`)."""
    require_deepspeed(stage)
    _ensure_group()
    import deepspeed

    _no_shm_allreduce_kernel(deepspeed)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # boundaries are set per step by zero_step
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        **precision_section(precision),
    }
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return ds_engine


def partitions_parameters(ds_engine: Any) -> bool:
    """True when `ds_engine` (DeepSpeed's) shards the parameters themselves (ZeRO-3)."""
    return ds_engine is not None and ds_engine.zero_optimization_stage() == 3


@contextlib.contextmanager
def gathered(ds_engine: Any, model: torch.nn.Module, *, modifier_rank: int | None = None) -> Iterator[None]:
    """Whole parameters on every rank inside the block (ZeRO-3; a no-op otherwise). Collective:
    every rank must enter at the same point. With `modifier_rank`, that rank's in-place changes
    are kept (broadcast and re-partitioned on exit); without, they are dropped."""
    if not partitions_parameters(ds_engine):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=modifier_rank):
        yield


def _zero_loss(ds_engine: Any) -> torch.Tensor:
    """A loss of exactly 0 whose backward reaches every trainable parameter (fires ZeRO's hooks).
    Through the DeepSpeed engine's forward, which advances ZeRO-3's micro-step count."""
    device = next(ds_engine.module.parameters()).device
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    return ds_engine(input_ids=ids, use_cache=False).logits.float().sum() * 0.0


def zero_backward(ds_engine: Any, loss: torch.Tensor, world_size: int) -> None:
    """One micro-step inside an optimizer step (never the boundary)."""
    ds_engine.set_gradient_accumulation_boundary(False)
    ds_engine.backward(loss * world_size)
    ds_engine.step()


def pad_micro_steps(ds_engine: Any, n_local: int, ranks: Ranks) -> None:
    """Zero-loss micro-steps up to the most rows any rank trained this step (ZeRO-2's gradient
    reduction is collective, so every rank must run as many backward passes)."""
    most = int(ranks.max([n_local])[0])
    for _ in range(most - n_local):
        zero_backward(ds_engine, _zero_loss(ds_engine), ranks.world_size)


def zero_step(ds_engine: Any, lr: float) -> None:
    """The optimizer step (clipping by the global norm included) on a final zero-loss pass."""
    for g in ds_engine.optimizer.param_groups:
        g["lr"] = lr
    ds_engine.set_gradient_accumulation_boundary(True)
    ds_engine.backward(_zero_loss(ds_engine))
    ds_engine.step()


def load_zero_optimizer(ds_engine: Any, own: dict[str, Any]) -> None:
    """Restore this rank's optimizer partition and fp32 master weights from its own saved partition.

    DeepSpeed's load takes a list of every rank's state, for an elastic load into another world size; with the same
    world size and a rigid (not `elastic_checkpoint`) state, ZeRO-1/2 and ZeRO-3 read only the entry at the rank's
    own data-parallel index. So only that entry is given: no rank reads, or holds, another's partition (a
    DeepSpeed that read another entry would fail on the None, not load the wrong partition)."""
    opt = ds_engine.optimizer
    group = getattr(opt, "dp_process_group", None)
    states: list[dict[str, Any] | None] = [None] * dist.get_world_size(group=group)
    states[dist.get_rank(group=group)] = own
    opt.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
