"""Data-parallel learner ranks: process group setup, rank 0's hand-out of rollouts, gradient
all-reduce, and failure agreement so one rank's error never leaves the others waiting.

`Ranks` is a no-op wrapper when there is one process, so the training loop has one code path.
Started under torchrun (`WORLD_SIZE` > 1) it initialises torch.distributed itself (gloo on CPU,
gloo + NCCL when CUDA is present); given a process group it uses that one.

Failure agreement: every phase in which a single rank can fail on its own (rank 0's rollouts and
weight sync, any rank's segment building or forward/backward) runs inside `Ranks.guard(what)`,
which ends in an all-gather of "ok / error text" from every rank. If any rank failed, every rank
raises: the failing rank its own exception, the others `RankFailedError` naming rank and cause.
What no guard covers (a rank killed outright) ends at the process group's timeout or when gloo
sees the peer's connection close, and torchrun tears the other workers down.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rmsft.exit_codes import RETRY_EXIT, exit_code_for, verdict

log = logging.getLogger("rmsft.learner")

_BUCKET_BYTES = 32 << 20  # gradients are all-reduced in flat buckets of about this size


class RankFailedError(RuntimeError):
    """Another learner rank failed; the message names the rank, the phase and its error. `exit_code`: the failed
    ranks' verdict (rmsft.exit_codes), so every rank exits as the failing one does (a refusal on rank 0 is a
    refusal on rank 1 too, a transient error a retry)."""

    def __init__(self, message: str, exit_code: int = RETRY_EXIT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def share_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank `rank`'s contiguous, balanced share of n items (the first n % world_size
    ranks get one more)."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


class Ranks:
    """This process's place among the learner ranks, and the collectives the training loop needs."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, owns_group: bool = False) -> None:
        self.group = group
        self.owns_group = owns_group
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    @classmethod
    def single(cls) -> Ranks:
        return cls(None)

    @classmethod
    def from_env(cls, timeout_s: float = 1800.0) -> Ranks:
        """One rank unless started under torchrun (WORLD_SIZE > 1) or torch.distributed is already
        initialised; then the default group (initialised here when needed)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.group.WORLD) if dist.get_world_size() > 1 else cls.single()
        if env_world_size() <= 1:
            return cls.single()
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
        backend = "gloo"
        if torch.cuda.is_available():
            # Tensors on the CPU (object collectives, a CPU-resident model) go over gloo.
            backend = "cpu:gloo,cuda:nccl"
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # rendezvous errors come from deep inside c10d
            raise RuntimeError(
                f"cannot join the learner's process group (WORLD_SIZE={os.environ.get('WORLD_SIZE')}, "
                f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}): {exc}"
            ) from exc
        return cls(dist.group.WORLD, owns_group=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def share(self, n: int) -> tuple[int, int]:
        return share_bounds(n, self.world_size, self.rank)

    # -- failure agreement ------------------------------------------------------------------
    def check(self, error: BaseException | None, what: str) -> None:
        """Collective: raise on every rank if any rank passes an error."""
        if not self.enabled:
            if error is not None:
                raise error
            return
        # The error's text and its exit code (rmsft.exit_codes): the other ranks exit with the failed one's code.
        mine = None if error is None else (f"{type(error).__name__}: {error}", exit_code_for(error))
        got: list[tuple[str, int] | None] = [None] * self.world_size
        dist.all_gather_object(got, mine, group=self.group)
        if error is not None:
            raise error
        failed = [(r, box) for r, box in enumerate(got) if box is not None]
        if failed:
            raise RankFailedError(
                "; ".join(f"learner rank {r} failed while {what}: {msg}" for r, (msg, _) in failed),
                exit_code=verdict({r: code for r, (_, code) in failed}, 1),
            )

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run a block that may fail on one rank only; afterwards all ranks agree (see module doc)."""
        error: BaseException | None = None
        try:
            yield
        except Exception as exc:  # re-raised by check() on this rank
            error = exc
        self.check(error, what)

    # -- objects ----------------------------------------------------------------------------
    def scatter_from_main(self, per_rank: Sequence[Any] | None) -> Any:
        """Rank 0 passes one payload per rank; every rank returns its own."""
        if not self.enabled:
            assert per_rank is not None
            return per_rank[0]
        out: list[Any] = [None]
        payloads = None
        if self.is_main:
            assert per_rank is not None, "rank 0 passes one payload per rank"
            payloads = list(per_rank)
        dist.scatter_object_list(out, payloads, src=self._global(0), group=self.group)
        return out[0]

    def broadcast_from_main(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.group)
        return out

    def _global(self, group_rank: int) -> int:
        assert self.group is not None, "collectives run only with several ranks, which have a group"
        return dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank

    # -- tensors ----------------------------------------------------------------------------
    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so token counts stay exact)."""
        if not self.enabled:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def max(self, values: Sequence[float]) -> list[float]:
        if not self.enabled:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def broadcast_params(self, params: Sequence[torch.Tensor]) -> None:
        """Make every rank's copy equal to rank 0's (start of a run, like DDP)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for bucket in _buckets(list(params)):
                flat = torch.cat([p.detach().reshape(-1) for p in bucket])
                dist.broadcast(flat, src=self._global(0), group=self.group)
                _unflatten_into(flat, bucket)

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """SUM each trainable parameter's gradient over ranks. A rank that trained no row (or whose
        rows never reached a parameter) contributes zeros; a parameter no rank reached keeps
        `grad is None`, exactly as in a single-process step."""
        if not self.enabled:
            return
        params = list(params)
        has = self.sum([0.0 if p.grad is None else 1.0 for p in params])
        reached = [p for p, h in zip(params, has, strict=True) if h > 0]
        for p in reached:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in reached if p.grad is not None]):  # every one (zeros above)
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            _unflatten_into(flat, bucket)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)

    def close(self, *, barrier_timeout_s: float = 60.0) -> None:
        """Leave the process group together: a rank that tears gloo down while a peer still
        finishes its last collective (rank 0 writing the final checkpoint) can abort the peer's
        process at exit ("terminate called without an active exception")."""
        if not (self.owns_group and dist.is_initialized()):
            return
        if self.enabled:
            try:
                if dist.get_backend(self.group) == "gloo":
                    timeout = datetime.timedelta(seconds=barrier_timeout_s)
                    dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
                else:
                    dist.barrier(group=self.group)
            except Exception as exc:  # a peer already gone must not hide the real exit status
                log.warning("learner ranks did not meet before leaving the process group: %s", exc)
        dist.destroy_process_group()
        self.owns_group = False


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same dtype/device tensors of about _BUCKET_BYTES each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size >= _BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
