"""A weight-transfer engine for vLLM's own weight-transfer API (`AsyncLLM.init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`) over a torch.distributed **gloo** group: the CPU
stand-in for vLLM's NCCL engine (issue 45), so the same control path runs where there is no GPU.

The learner is rank 0 of a stateless group (vLLM's `stateless_init_torch_distributed_process_group`: a TCP store
on the learner, no global process group touched on either side); each engine worker joins as rank
`rank_offset + its rank in the engine`. Names, dtypes and shapes travel on the control plane (the `update_weights`
dict); the bytes travel as broadcasts from rank 0, one tensor at a time, as uint8 views (gloo has no bf16 on every
build). Each received tensor goes to the model's `load_weights` between vLLM's layerwise-reload start and finish.

Registered inside every engine worker process (vLLM's CPU platform spawns its workers, so a registration in the
server's own process would not reach them): `register()` is called when `rollout_engine.worker_ext` is imported,
which vLLM does in each worker because it is the engine's `worker_extension_cls`. Selected with the engine argument
`weight_transfer_config={"backend": BACKEND}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKEND = "rmsft_gloo"


def _engine_class() -> type:
    """The engine class, built on first use: vLLM's base classes import vllm.config, which a learner without an
    engine never needs."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass(kw_only=True)
    class GlooInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        world_size: int
        rank_offset: int = 1
        timeout_s: float = 300.0

    @dataclass(kw_only=True)
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str] = field(default_factory=list)
        dtype_names: list[str] = field(default_factory=list)
        shapes: list[list[int]] = field(default_factory=list)

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.group: Any = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            import datetime

            p = self.parallel_config
            rank = getattr(p, "data_parallel_index", 0) * p.world_size + p.rank + init_info.rank_offset
            self.group = stateless_init_torch_distributed_process_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, backend="gloo",
                timeout=datetime.timedelta(seconds=init_info.timeout_s))

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("the gloo weight transfer was not initialised (init_weight_transfer_engine first)")
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                               strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dtype_name))
                self.group.broadcast(t.view(-1).view(torch.uint8), 0).wait()
                self.model.load_weights([(name, t)])

        def shutdown(self) -> None:
            self.group = None

    return GlooWeightTransferEngine


def register() -> None:
    """Adds BACKEND to vLLM's registry of worker-side engines; again is a no-op (the registry refuses a name twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


class GlooSender:
    """The learner's side: rank 0 of the group. `join` blocks until every worker joined (call it while the engine's
    init_weight_transfer_engine call runs); `send` broadcasts the tensors in the order `describe` listed them (call it
    while the engine's update_weights call runs)."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 300.0) -> None:
        self.host, self.port, self.world_size, self.timeout_s = host, port, world_size, timeout_s
        self.group: Any = None

    def init_info(self, rank_offset: int = 1) -> dict[str, Any]:
        return {"master_address": self.host, "master_port": self.port, "world_size": self.world_size,
                "rank_offset": rank_offset, "timeout_s": self.timeout_s}

    def join(self) -> None:
        import datetime

        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.group = stateless_init_torch_distributed_process_group(
            self.host, self.port, 0, self.world_size, backend="gloo",
            timeout=datetime.timedelta(seconds=self.timeout_s))

    @staticmethod
    def describe(tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        """The update_weights dict of `tensors` ((checkpoint name, tensor) pairs): names, dtypes, shapes."""
        return {"names": [n for n, _ in tensors],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors]}

    def send(self, tensors: list[tuple[str, Any]]) -> None:
        import torch

        for _, t in tensors:
            self.group.broadcast(t.detach().contiguous().view(-1).view(torch.uint8), 0).wait()
