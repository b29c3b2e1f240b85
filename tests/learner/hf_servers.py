"""A real rollout server without a subprocess: `RolloutServicer` + the HF engine behind a real gRPC
server on loopback, registered as `rmsft serve --backend hf` registers it (no vLLM)."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import torch


class InProcessServer:
    def __init__(
        self,
        model_dir: Path,
        staging: Path,
        *,
        dtype: str = "auto",
        shared: Path | None = None,
        port: int = 0,
        logprobs_mode: str = "raw",
        weight_transfer: str = "",
    ) -> None:
        from rollout_engine.config import ServeConfig
        from rollout_engine.hf_engine import HfEngine
        from rollout_svc.server import add_rollout_service
        from rollout_svc.servicer import RolloutServicer

        staging.mkdir(parents=True, exist_ok=True)
        self.staging = staging
        cfg = ServeConfig(
            model=str(model_dir),
            backend="hf",
            dtype=dtype,
            staging_dir=str(staging),
            shared_weights_dir=str(shared or ""),
            logprobs_mode=logprobs_mode,
            weight_transfer=weight_transfer,
        )
        self.servicer = RolloutServicer(cfg)
        self.engine = HfEngine(cfg)
        self.servicer.attach(self.engine)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        add_rollout_service(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def param(self, name: str) -> torch.Tensor:
        return dict(self.engine.hf.named_parameters())[name]

    def close(self) -> None:
        """Also what a dead pod looks like from outside: connections dropped, nothing answers."""
        self.server.stop(None).wait()
        self.servicer.close()


def fresh_model(model_dir: Path):
    """The learner's side of these tests: the tiny model in float32, seeded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def bump(model, value: float) -> dict[str, torch.Tensor]:
    """Give the model new weights (every parameter moved by `value`); returns a copy of each parameter."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(value)
    return {n: p.detach().clone() for n, p in model.named_parameters()}
