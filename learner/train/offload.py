"""The offload context: training state in host memory while the in-process engine generates.

    with offloaded(updater, model, params=spec.offload_model, optimizer=spec.offload_optimizer) as report:
        completions = engine.generate(...)      # the accelerator's memory is the engine's meanwhile
    # parameters, gradients and optimizer state are back: same objects, device, dtype, bits

Why it is built this way:
- The tensors keep their identity. Each moved tensor gets new storage through `t.data = copy` (parameters,
  their `.grad`, the optimizer's state tensors alike), never a new object: the optimizer's state is keyed by the
  Parameter objects, autograd's gradient accumulators and any hooks (DDP's, DeepSpeed's) hold them, and all of
  them must find the same objects afterwards. Dropping the last reference to the old storage is what frees
  the accelerator; `torch.cuda.empty_cache()` then hands the blocks back to the driver, where the engine (its
  own allocator, not torch's cache) can have them.
- The copies are exact: a host tensor of the same dtype and strides, filled by `copy_`, and back the same way.
  No cast, no re-layout, so training resumes bit for bit as if nothing had moved.
- What moves is decided first, as a pure plan (`offload_moves`): every parameter, gradient and optimizer-state
  tensor on the training device (`updater.device`), each once (tied weights are one Parameter). The plan reads no
  data, so on the `meta` device it shows where everything would go (tests/learner/test_colocate_offload.py);
  executing it needs data, which `meta` has not, so that refuses.
- Buffers (rotary tables and the like) stay: they are small, and the engine has its own.
- Tensors that share one storage as distinct objects (a flat buffer's views) are refused: moving them one by
  one would silently untie them. DeepSpeed's ZeRO keeps exactly such flat buffers, so under ZeRO the context
  uses DeepSpeed's own `engine.offload_states` / `reload_states` (DeepSpeed >= 0.16; 0.19 has them for
  stages 1-3), which know its partitions, master weights and gradient buffers.
- Only between optimizer steps: DeepSpeed drops ZeRO-3's partially accumulated gradients when it offloads
  them, so the context is not for the middle of a step (the colocate loop generates before `updater.begin()`).
- Host copies are pinned when CUDA is there (faster copies both ways; torch's pinned allocator keeps the blocks
  cached for the next generation instead of paying cudaHostAlloc every time).
- Whatever happens inside the block, everything comes back (`finally`); a failure half-way out brings back
  what had already moved before the error is raised.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rmsft.jobspec import RolloutMatchingJob

KINDS = ("param", "grad", "optimizer")


class OffloadableUpdater(Protocol):
    """What the context reads of an updater (learner/train/updater.py): where training runs, and either a torch
    optimizer (`PlainUpdater.optimizer`) or a DeepSpeed engine (`ZeroUpdater.ds_engine`), found with getattr so this
    room needs nothing from learner.train (which sits above it)."""

    device: torch.device


@dataclass(frozen=True)
class Move:
    """One tensor the context moves: `tensor` is the object whose storage is swapped (kept as is)."""

    kind: str  # param | grad | optimizer
    name: str
    tensor: torch.Tensor
    device: torch.device  # where it lives, and comes back to
    nbytes: int


@dataclass
class OffloadReport:
    """What one offload did, for logs and metrics (the caller records it: the training loop's phase times)."""

    via: str = "none"  # none (both flags off) | torch | deepspeed
    moved_bytes: dict[str, int] = field(default_factory=dict)  # by kind; exact on the torch path
    tensors: int = 0
    freed_bytes: int | None = None  # the drop of torch.cuda.memory_allocated; None off CUDA
    offload_s: float = 0.0
    reload_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.moved_bytes.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def offload_moves(updater: OffloadableUpdater, model: torch.nn.Module, *, params: bool, optimizer: bool) -> list[Move]:
    """Every tensor the torch path would move to host: the model's parameters on the training device and their
    gradients (`params`), the optimizer's state tensors there (`optimizer`). Reads no tensor data."""
    if getattr(updater, "ds_engine", None) is not None:
        raise ValueError("a DeepSpeed updater moves its own buffers (engine.offload_states); there is no torch plan")
    device = updater.device
    moves: list[Move] = []
    seen: set[int] = set()

    def add(kind: str, name: str, t: torch.Tensor | None) -> None:
        if t is None or id(t) in seen or t.device != device:
            return  # not there (AdamW's step counters stay on the host), or already planned (tied weights)
        seen.add(id(t))
        moves.append(Move(kind, name, t, t.device, _nbytes(t)))

    names = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        names[id(p)] = name
        if params:
            add("param", name, p)
            add("grad", name + ".grad", p.grad)
    if optimizer:
        opt = getattr(updater, "optimizer", None)
        if opt is None:
            raise ValueError(f"{type(updater).__name__} has no optimizer to offload")
        for p, state in opt.state.items():
            for key, t in state.items():
                if isinstance(t, torch.Tensor):
                    add("optimizer", f"{names.get(id(p), '?')}:{key}", t)
    _refuse_shared_storage(moves)
    return moves


def _refuse_shared_storage(moves: list[Move]) -> None:
    """Distinct tensors over one storage would come back as separate copies: refuse instead of untying them."""
    owner: dict[tuple[torch.device, int], str] = {}
    for mv in moves:
        if mv.device.type == "meta" or mv.tensor.numel() == 0:
            continue  # meta storages have no address; an empty tensor holds nothing
        key = (mv.device, mv.tensor.untyped_storage().data_ptr())
        if key in owner:
            raise RuntimeError(
                f"cannot offload {mv.name}: it shares its storage with {owner[key]} (views of one buffer); moving "
                "them one by one would untie them. A DeepSpeed updater offloads through its DeepSpeed engine instead."
            )
        owner[key] = mv.name


def _to_host(t: torch.Tensor, host: torch.device, pin: bool) -> torch.Tensor:
    """An exact host copy: same dtype and strides (no cast, no re-layout)."""
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=host, pin_memory=pin)
    out.copy_(t, non_blocking=pin)
    return out


def _to_device(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=non_blocking)
    return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


@contextlib.contextmanager
def offloaded(
    updater: OffloadableUpdater,
    model: torch.nn.Module,
    *,
    params: bool,
    optimizer: bool,
    host: str | torch.device = "cpu",
) -> Iterator[OffloadReport]:
    """Inside the block, the training parameters (with their gradients) and/or the optimizer state live in `host`
    memory and the training device's copies are freed; on exit (an exception included) they are back on the same
    device, in the same dtype, with the same values, in the same objects. Both flags off: a no-op. Yields the
    report (bytes and seconds; `reload_s` is set on exit)."""
    report = OffloadReport()
    if not (params or optimizer):
        yield report
        return
    host = torch.device(host)
    engine = getattr(updater, "ds_engine", None)
    if engine is not None:
        with _deepspeed_offloaded(engine, torch.device(updater.device), params, optimizer, host, report):
            yield report
        return
    moves = offload_moves(updater, model, params=params, optimizer=optimizer)
    with _torch_offloaded(moves, torch.device(updater.device), host, report):
        yield report


@contextlib.contextmanager
def _torch_offloaded(
    moves: list[Move], device: torch.device, host: torch.device, report: OffloadReport
) -> Iterator[None]:
    if device.type == "meta":
        raise ValueError(
            "the training device is meta: its tensors have no data to copy to the host (offload_moves "
            "shows where they would go)"
        )
    pin = host.type == "cpu" and device.type == "cuda"
    report.via = "torch"
    report.moved_bytes = dict.fromkeys(KINDS, 0)
    before = _allocated(device)
    t0 = time.perf_counter()
    done: list[Move] = []
    try:
        with torch.no_grad():
            for mv in moves:
                # Swapping the storage under the same object drops the device copy once nothing else holds it.
                mv.tensor.data = _to_host(mv.tensor.data, host, pin)
                done.append(mv)
                report.moved_bytes[mv.kind] += mv.nbytes
        _synchronize(device)  # the host copies are complete before the engine takes the memory
        if device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver: the engine's allocator is not torch's cache
        report.tensors = len(done)
        report.offload_s = time.perf_counter() - t0
        if before is not None:
            report.freed_bytes = before - (_allocated(device) or 0)
        yield
    finally:
        t1 = time.perf_counter()
        _bring_back(done, pin)
        _synchronize(device)
        report.reload_s = time.perf_counter() - t1


def _bring_back(done: list[Move], non_blocking: bool) -> None:
    """Every moved tensor back to its device; one failure (the engine still holding the memory) does not stop the
    others, and the first is raised once all were tried."""
    error: BaseException | None = None
    left = 0
    with torch.no_grad():
        for mv in done:
            try:
                mv.tensor.data = _to_device(mv.tensor.data, mv.device, non_blocking)
            except Exception as exc:  # raised below, after the other tensors came back
                error, left = error or exc, left + 1
    if error is not None:
        raise RuntimeError(
            f"{left} offloaded tensor(s) could not come back to {done[0].device} (is the engine "
            "still holding the memory?)"
        ) from error


def _deepspeed_states(params: bool, optimizer: bool) -> tuple[list[Any], Any]:
    try:
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    except ImportError as exc:  # a DeepSpeed too old to offload its states
        raise RuntimeError(
            "spec.rollout.colocate offloading under ZeRO needs DeepSpeed's engine.offload_states "
            f"(DeepSpeed >= 0.16), which this DeepSpeed lacks ({exc})"
        ) from exc
    s = OffloadStateTypeEnum
    include = []
    if params:  # the module's weights, their gradient partitions, ZeRO-3's gradient bucket
        include += [s.lp_params, s.lp_grads, s.contiguous_grad_buffer]
    if optimizer:  # the fp32 master partitions and Adam's moments: both are the optimizer's
        include += [s.hp_params, s.optim_states]
    return include, OffloadDeviceEnum.cpu


@contextlib.contextmanager
def _deepspeed_offloaded(
    engine: Any, device: torch.device, params: bool, optimizer: bool, host: torch.device, report: OffloadReport
) -> Iterator[None]:
    if host.type != "cpu":
        raise ValueError(f"DeepSpeed offloads its states to the CPU only, not {host}")
    if not hasattr(engine, "offload_states") or not hasattr(engine.optimizer, "offload_states"):
        raise RuntimeError(
            "spec.rollout.colocate offloading under ZeRO needs DeepSpeed's engine.offload_states "
            f"(DeepSpeed >= 0.16); {type(engine.optimizer).__name__} of this DeepSpeed has none"
        )
    if optimizer and engine.zero_optimization_stage() == 3:
        from deepspeed.ops.adam import FusedAdam

        # DeepSpeed (0.19) moves ZeRO-3's optimizer state only for its own FusedAdam; the learner's is torch's.
        if not isinstance(engine.optimizer.optimizer, FusedAdam):
            raise RuntimeError(
                "spec.rollout.colocate.offloadOptimizer is not available with spec.training.deepspeed_stage 3: "
                "DeepSpeed offloads ZeRO-3's optimizer state only for its FusedAdam, and the learner uses torch's "
                "AdamW (use offloadModel alone, or deepspeed_stage 1 or 2)"
            )
    include, cpu = _deepspeed_states(params, optimizer)
    report.via = "deepspeed"
    before = _allocated(device)
    t0 = time.perf_counter()
    try:
        # DeepSpeed pins, copies, synchronizes and empties the cache itself (non_blocking=False: done on return).
        # Inside the try: reload_states brings back whatever it had offloaded when it fails half-way.
        engine.offload_states(include=include, device=cpu, pin_memory=device.type == "cuda", non_blocking=False)
        report.offload_s = time.perf_counter() - t0
        if before is not None:
            report.freed_bytes = before - (_allocated(device) or 0)
        yield
    finally:
        t1 = time.perf_counter()
        engine.reload_states(non_blocking=False)
        report.reload_s = time.perf_counter() - t1


def around_generation(
    job: RolloutMatchingJob, updater: OffloadableUpdater, model: torch.nn.Module
) -> AbstractContextManager:
    """Colocate: what happens to the training state while the in-process engine decodes: parameters and/or
    optimizer state to host memory (spec.rollout.colocate offloadModel / offloadOptimizer), back after."""
    c = job.spec.rollout.colocate
    if not (c.offload_model or c.offload_optimizer):
        return nullcontext()
    return offloaded(updater, model, params=c.offload_model, optimizer=c.offload_optimizer)
