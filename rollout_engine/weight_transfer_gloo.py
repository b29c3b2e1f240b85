"""A weight-transfer engine for vLLM's own weight-transfer API (`AsyncLLM.init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`) over a torch.distributed **gloo** group: the CPU
stand-in for vLLM's NCCL engine (issue 45), so the same control path runs where there is no GPU.

The learner is rank 0 of a stateless group (vLLM's `stateless_init_torch_distributed_process_group`: a TCP store
on the learner, no global process group touched on either side); each engine worker joins as rank
`rank_offset + its rank in the engine`. Names, dtypes and shapes travel on the control plane (the `update_weights`
dict); the bytes travel as broadcasts from rank 0, packed into the group's buckets (set at the join:
`rmsft.weight_wire.transfer.plan_buckets`; 0 is one tensor at a time), as uint8 views (gloo has no bf16 on every
build). Each received tensor goes to the model's `load_weights` between vLLM's layerwise-reload start and finish.

Registered inside every engine worker process (vLLM's CPU platform spawns its workers, so a registration in the
server's own process would not reach them): `register()` is called when `rollout_engine.worker_ext` is imported,
which vLLM does in each worker because it is the engine's `worker_extension_cls`. Selected with the engine argument
`weight_transfer_config={"backend": BACKEND}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from rmsft.weight_wire.transfer import GLOO as BACKEND
from rmsft.weight_wire.transfer import open_group, receive_whole


class _LoadsWeights(Protocol):
    """A vLLM model (the engine's `model`, typed only as a torch Module): it loads (name, tensor) pairs."""

    def load_weights(self, weights: Any) -> Any: ...


def _engine_class() -> type:
    """The engine class, built on first use: vLLM's base classes import vllm.config, which a learner without an
    engine never needs."""
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
        bucket_bytes: int = 0  # the group's bucket size (rmsft.weight_wire.transfer.plan_buckets); 0: per tensor

    @dataclass(kw_only=True)
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str] = field(default_factory=list)
        dtype_names: list[str] = field(default_factory=list)
        shapes: list[list[int]] = field(default_factory=list)
        # name -> a second name to load the same tensor under (the tied head: rollout_engine.worker_ext._tied_head)
        also_as: dict[str, str] = field(default_factory=dict)

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.group: Any = None
            self.bucket_bytes = 0
            self.reloading = False  # between initialize_layerwise_reload and its finalize

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            p = self.parallel_config
            rank = getattr(p, "data_parallel_index", 0) * p.world_size + p.rank + init_info.rank_offset
            self.group = open_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
            )
            self.bucket_bytes = init_info.bucket_bytes

        def start_weight_update(self) -> None:
            # The layerwise reload starts only once every bucket is here and the learner committed the update
            # (`receive_weights`): an update called off or broken leaves the model whole, on its last version.
            self.reloading = False

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if self.reloading:
                finalize_layerwise_reload(self.model, self.model_config)
                self.reloading = False

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("the gloo weight transfer was not initialised (init_weight_transfer_engine first)")
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            # GroupAborted (its message says NOTHING_LOADED) before the model is touched: rollout_engine.vllm_engine
            # reads that as "the previous version still serves".
            tensors = receive_whole(
                self.group, update_info.names, update_info.dtype_names, update_info.shapes, self.bucket_bytes
            )
            initialize_layerwise_reload(self.model)
            self.reloading = True
            for name, t in tensors:
                alias = update_info.also_as.get(name)
                cast(_LoadsWeights, self.model).load_weights([(name, t)] if alias is None else [(name, t), (alias, t)])

        def shutdown(self) -> None:
            self.group = None

    return GlooWeightTransferEngine


def register() -> None:
    """Adds BACKEND to vLLM's registry of worker-side engines; again is a no-op (the registry refuses a name twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())
