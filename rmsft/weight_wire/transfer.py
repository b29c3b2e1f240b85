"""Transport nccl's weight-transfer group, both halves of what crosses it: the backends, what each side hands vLLM's
weight-transfer API, and the learner's rank-0 end.

Two backends, one control path (`JoinWeightGroup`, then an `UpdateWeights` header with `transfer_group`):
- "nccl": vLLM's own NCCL engine (`vllm/distributed/weight_transfer/nccl_engine.py`), GPUs only; the learner's
  rank 0 opens its end with vLLM's `trainer_init` and broadcasts from its CUDA device, unpacked (one tensor per
  broadcast, so the order and sizes are the header's listing).
- "rmsft_gloo": rmsft's gloo engine (`rollout_engine/weight_transfer_gloo.py`, registered in vLLM's registry from
  every engine worker), the CPU stand-in: the same calls on machines without a GPU (tests, `rmsft local` on the CPU).
  Its group is a stateless torch.distributed gloo group (vLLM's helper: a TCP store on the learner, no global
  process group touched on either side); the bytes travel as uint8 broadcasts (gloo has no bf16 on every build).

The server is started with `--weight-transfer BACKEND` (vLLM needs the backend when the engine is created); the
learner picks the same from `spec.accelerator`. torch and vLLM are imported lazily.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

GLOO = "rmsft_gloo"
NCCL = "nccl"
BACKENDS = (NCCL, GLOO)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"weight-transfer backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def worker_init_info(backend: str, *, master_address: str, master_port: int, world_size: int, rank_offset: int,
                     timeout_s: float) -> dict[str, Any]:
    """`init_weight_transfer_engine`'s init_info for one server, whose workers take ranks rank_offset.."""
    check_backend(backend)
    info: dict[str, Any] = {"master_address": master_address, "master_port": master_port, "world_size": world_size,
                            "rank_offset": rank_offset}
    if backend == GLOO:
        info["timeout_s"] = timeout_s
    else:
        info["packed"] = False  # one broadcast per tensor, in the listing's order
    return info


def update_info(backend: str, specs: Sequence[tuple[str, Any]], also_as: dict[str, str]) -> dict[str, Any]:
    """`update_weights`' update_info for the listed tensors ((name, TensorSpec) pairs, in broadcast order).
    `also_as`: name -> a second name to load the same tensor under (rmsft's gloo engine only; the tied head)."""
    check_backend(backend)
    from rmsft.weight_wire import torch_dtype

    info: dict[str, Any] = {
        "names": [name for name, _ in specs],
        "dtype_names": [str(torch_dtype(spec.dtype)).removeprefix("torch.") for _, spec in specs],
        "shapes": [[int(d) for d in spec.shape] for _, spec in specs],
    }
    if backend == GLOO and also_as:
        info["also_as"] = dict(also_as)
    return info


class NcclSender:
    """The learner's end of an NCCL group (rank 0), with vLLM's trainer-side helper. `port` must be free on this
    host: vLLM's rendezvous binds it itself when `join` runs."""

    def __init__(self, world_size: int, timeout_s: float = 300.0, *, address: str, port: int) -> None:
        self.world_size, self.timeout_s, self.address, self.port = world_size, timeout_s, address, port
        self.group: Any = None

    def join(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": self.address, "master_port": self.port,
                                   "world_size": self.world_size})

    def send(self, tensors: Iterable[tuple[str, Any]]) -> int:
        import torch

        total = 0
        stream = torch.cuda.current_stream()
        for _, t in tensors:
            flat = t.detach().contiguous()  # NCCL sends numel elements from data_ptr: never a strided view
            self.group.broadcast(flat, src=0, stream=stream)
            total += flat.numel() * flat.element_size()
        stream.synchronize()
        return total

    def close(self) -> None:
        self.group = None


def make_sender(backend: str, world_size: int, timeout_s: float, *, address: str) -> Any:
    """The learner's rank-0 end for `backend`, its port chosen (`.port`); `join()` then meets the servers."""
    check_backend(backend)
    if backend == GLOO:
        return GlooSender(world_size, timeout_s, address=address)
    import socket

    with socket.socket() as s:  # vLLM's NCCL rendezvous binds the port itself: a free one, chosen now
        s.bind(("", 0))
        port = s.getsockname()[1]
    return NcclSender(world_size, timeout_s, address=address, port=port)


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, listen_socket: Any = None) -> Any:
    """This process's member of a stateless gloo group (rank 0 hosts the rendezvous: a TCP store on `listen_socket`
    when given, so no other process can take its port between choosing it and listening)."""
    import datetime

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend="gloo", listen_socket=listen_socket,
        timeout=datetime.timedelta(seconds=timeout_s))


def receive(group: Any, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> Any:
    """(name, tensor) as each arrives from rank 0, in the order the update listed them."""
    import torch

    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype_name))
        group.broadcast(t.view(-1).view(torch.uint8), 0).wait()
        yield name, t


class GlooSender:
    """The learner's side: rank 0 of the group, the rendezvous host. `join` blocks until every worker joined (call
    it while the engines' init_weight_transfer_engine calls run); `send` broadcasts the tensors in the order
    `describe` listed them (call it while the engines' update_weights calls run).

    `address` is the one the servers reach the learner at: every member names the rendezvous by the same
    address and port (the group's keys are prefixed with them). The learner listens on every interface; port 0
    picks a free one, held from now on (the socket listens already), so `port` is known before any server is told
    to join."""

    def __init__(self, world_size: int, timeout_s: float = 300.0, *, address: str = "127.0.0.1",
                 port: int = 0) -> None:
        import socket

        self.world_size, self.timeout_s, self.address = world_size, timeout_s, address
        self._listen: socket.socket | None = socket.create_server(("", port))
        self.port = self._listen.getsockname()[1]
        self.group: Any = None

    def join(self) -> None:
        try:
            self.group = open_group(self.address, self.port, 0, self.world_size, self.timeout_s,
                                    listen_socket=self._listen)
        finally:
            self._listen = None  # the store owns the socket now (or it failed with it)

    def close(self) -> None:
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        self.group = None

    def send(self, tensors: Any) -> int:
        """Broadcast each (name, tensor) of `tensors`, one at a time, as it is produced; returns the bytes sent."""
        import torch

        total = 0
        for _, t in tensors:
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            self.group.broadcast(flat, 0).wait()
            total += flat.numel()
        return total
