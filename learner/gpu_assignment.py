"""Which GPUs each process of `rmsft local` gets.

On a cluster the scheduler gives every rollout pod `spec.rollout.tensorParallelSize` GPUs and the
learner pod `spec.learner.gpus`; on one machine nobody does, and every process would open GPU 0.
`assign_gpus` is that scheduler for one machine: rollout server i gets the contiguous indices
[i*TP, (i+1)*TP), the learner the next `learner.gpus`; no two processes share a GPU. Indices are
positions among this process's visible devices; the `CUDA_VISIBLE_DEVICES` handed to each child
names them as the user's own `CUDA_VISIBLE_DEVICES` does (ids, UUIDs or MIG names), so a user who
restricted the devices keeps that restriction.

Pure but for `visible_gpu_count` (the one place that asks torch), so the table of cases is tested
without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from rmsft.jobspec import JobSpecError, RolloutMatchingJob

CUDA_ENV = "CUDA_VISIBLE_DEVICES"


class GpuAssignmentError(JobSpecError):
    """The job cannot be placed on this machine's GPUs.

    A JobSpecError so `rmsft local` reports it like a bad spec (one `error:` line, exit code 2, no
    traceback), before any process starts. `str(err)` is the message alone: the spec itself is
    valid, only this machine is too small for it."""

    def __init__(self, message: str) -> None:
        self.errors = [message]
        ValueError.__init__(self, message)


@dataclass(frozen=True)
class GpuAssignment:
    """Where each process of a local job runs.

    `servers[i]` / `learner`: indices into this process's visible devices (empty: on CPUs).
    `device_ids[k]`: how a child's `CUDA_VISIBLE_DEVICES` names visible device k.
    `accelerated`: the job runs on GPUs (False for `accelerator: none`, whatever the machine has).
    """

    servers: tuple[tuple[int, ...], ...]
    learner: tuple[int, ...]
    device_ids: tuple[str, ...]
    accelerated: bool

    @property
    def available(self) -> int:
        return len(self.device_ids)

    def _env(self, indices: tuple[int, ...]) -> dict[str, str]:
        if self.accelerated:
            return {CUDA_ENV: self.names(indices)}
        if self.device_ids:
            # accelerator: none on a machine with GPUs: hide them, as a CPU pod on a cluster sees none;
            # otherwise every child would still open GPU 0.
            return {CUDA_ENV: ""}
        return {}

    def server_env(self, i: int) -> dict[str, str]:
        """Environment entries for rollout server `i` (empty on a machine without GPUs)."""
        return self._env(self.servers[i])

    def learner_env(self) -> dict[str, str]:
        """Environment entries for a learner subprocess (the torchrun ranks)."""
        return self._env(self.learner)

    def learner_device(self, requested: str) -> str:
        """`spec.training.device` for the learner, from the spec's value.

        One learner GPU or none (the learner runs in this process): the device among this process's
        devices. In a pod the learner sees only its own GPUs, so `cuda:K` in the manifest means the
        learner's K-th GPU; it is mapped to that GPU's index here, so the same manifest means the
        same thing on a cluster and locally. `auto` is the learner's GPU, or `cpu` when it has none
        (torch's own `auto` would pick cuda:0, a rollout server's GPU).

        Several learner GPUs (torchrun ranks, each seeing only the learner's GPUs): `auto` or `cpu`
        unchanged; an explicit `cuda:K` would put every rank on one GPU and is refused."""
        if requested == "cpu":
            return "cpu"
        if len(self.learner) > 1:
            if requested != "auto":
                raise GpuAssignmentError(
                    f"spec.training.device {requested} would put all {len(self.learner)} learner ranks "
                    f"(spec.learner.gpus) on one GPU; use auto (each rank on cuda:LOCAL_RANK)"
                )
            return requested
        if requested == "auto":
            return f"cuda:{self.learner[0]}" if self.learner else "cpu"
        k = int(requested.partition(":")[2] or 0)
        if not self.accelerated:
            why = "spec.placement.accelerator is none" if self.device_ids else "this machine has no GPU"
            raise GpuAssignmentError(f"spec.training.device {requested} asks for a GPU, but {why}")
        if not self.learner:
            raise GpuAssignmentError(f"spec.training.device {requested} asks for a GPU, but spec.learner.gpus is 0")
        if k > 0:  # one learner GPU here: several were handled above
            raise GpuAssignmentError(
                f"spec.training.device {requested} is the learner's GPU {k}, but spec.learner.gpus is 1 "
                f"(its GPU is cuda:0); use auto"
            )
        return f"cuda:{self.learner[0]}"

    def names(self, indices: tuple[int, ...]) -> str:
        """The devices at `indices` as the user's device ids name them, e.g. "6,7"."""
        return ",".join(self.device_ids[k] for k in indices)

    def describe(self) -> str:
        """One line for the console: which device ids each process got."""
        if not self.accelerated:
            return "on CPUs" + (" (GPUs hidden: spec.placement.accelerator is none)" if self.device_ids else "")

        def gpus(indices: tuple[int, ...]) -> str:
            return f"GPU{'s' if len(indices) > 1 else ''} {self.names(indices)}" if indices else "on CPUs"

        parts = [f"rollout-{i} {gpus(g)}" for i, g in enumerate(self.servers)]
        parts.append(f"learner {gpus(self.learner)}")
        return "; ".join(parts)


def _device_ids(available: int, visible_devices: str | None) -> tuple[str, ...]:
    if visible_devices is None:
        return tuple(str(k) for k in range(available))
    ids = tuple(p.strip() for p in visible_devices.split(",") if p.strip())
    # CUDA stops at the first entry it cannot use, so it may see fewer devices than listed, never more.
    if len(ids) < available:
        raise GpuAssignmentError(
            f"{CUDA_ENV}={visible_devices!r} names {len(ids)} device(s) but CUDA sees {available}; "
            f"cannot tell which device is which"
        )
    return ids[:available]


def assign_gpus(job: RolloutMatchingJob, available: int, *, visible_devices: str | None = None) -> GpuAssignment:
    """Place the job's rollout servers and learner on `available` GPUs (0 = no CUDA).

    `visible_devices`: this process's `CUDA_VISIBLE_DEVICES` (None when unset). Raises GpuAssignmentError,
    naming the spec keys and the numbers, when the machine has too few GPUs."""
    if available < 0:
        raise ValueError(f"available must be >= 0, got {available}")
    spec = job.spec
    # The learner's pod layout is a cluster's (rmsft_operator.render): here the learner is one process group on this
    # machine, one rank per learner GPU, or one process on the CPU.
    if spec.learner.nodes > 1:
        raise GpuAssignmentError(
            f"spec.learner.nodes ({spec.learner.nodes}) spreads the learner over pods of a "
            "cluster; `rmsft local` runs it on this machine: set spec.learner.nodes to 1"
        )
    if spec.learner.ranks_per_pod not in (None, 1) and spec.placement.accelerator == "none":
        raise GpuAssignmentError(
            f"spec.learner.ranksPerPod ({spec.learner.ranks_per_pod}) runs several CPU ranks in "
            "a cluster's learner pod; `rmsft local` runs the learner in one process on the "
            "CPU: leave it unset"
        )
    ids = _device_ids(available, visible_devices)
    n, tp, learner = spec.rollout.replicas, spec.rollout.tensor_parallel_size, spec.learner.gpus
    assert n is not None, "RolloutSpec's validator sets replicas"
    if spec.placement.accelerator == "none":  # the spec already holds learner.gpus at 0 here
        return GpuAssignment(servers=((),) * n, learner=(), device_ids=ids, accelerated=False)
    needed = n * tp + learner
    if needed > available:
        sum_ = (
            f"spec.rollout.replicas {n} x spec.rollout.tensorParallelSize {tp} + spec.learner.gpus {learner} "
            f"= {needed} GPUs needed"
        )
        if available == 0:
            seen = f" ({CUDA_ENV}={visible_devices!r})" if visible_devices is not None else ""
            raise GpuAssignmentError(
                f"the job asks for GPUs (spec.placement.accelerator nvidia: {sum_}), but this machine has none"
                f"{seen}; to run on CPUs set spec.placement.accelerator: none and spec.learner.gpus: 0"
            )
        seen = f" visible ({CUDA_ENV}={visible_devices})" if visible_devices is not None else ""
        raise GpuAssignmentError(f"{sum_}, this machine has {available}{seen}")
    servers = tuple(tuple(range(i * tp, (i + 1) * tp)) for i in range(n))
    return GpuAssignment(servers=servers, learner=tuple(range(n * tp, needed)), device_ids=ids, accelerated=True)


def visible_gpu_count() -> int:
    """CUDA devices this process can use (0 without CUDA). The one place that asks torch, so tests
    simulate a GPU machine by patching `torch.cuda.is_available` / `device_count`."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
