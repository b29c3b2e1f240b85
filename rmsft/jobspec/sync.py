"""spec.sync: how the learner's new weights reach the rollout engines, and which transport carries them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rmsft.jobspec.base import _K8s

SyncTransport = Literal["grpc", "shm"]


class SyncSpec(_K8s):
    """How the learner's new weights reach the rollout engines, before each step that samples: every step under
    recipe generation 1, channel-B steps and held-out evaluations under generation 2."""

    mode: Literal["full", "adapter", "auto"] = Field(
        "full", description="full: the model's weights (LoRA merged); adapter: the LoRA adapter alone (needs "
        "rollout.enableLora and training.finetune lora); auto: adapter when every server and the model allow it, "
        "else full.",
    )
    fallback_to_full: bool = Field(
        True, description="After an adapter update fails, send full weights for the rest of the run.")
    frame_bytes: int = Field(4 << 20, ge=64 << 10, le=256 << 20, description="Max bytes per stream frame.")
    timeout_seconds: float = Field(600.0, gt=0, description="Deadline of one weight update, per server call.")
    transport: Literal["auto", "grpc", "shm"] = Field(
        "auto", description="How an update reaches the rollout servers: grpc streams its bytes over gRPC (works "
        "across nodes); shm writes it once to a file in node-local shared memory and gRPC carries only a header "
        "naming the file. auto = shm under `rmsft local` (one machine), grpc in a cluster. shm in a cluster is "
        "opt-in: the learner and the whole pool on one node (they fit spec.placement.gpusPerNode; the operator "
        "adds pod affinity) and a namespace whose Pod Security level allows hostPath volumes (privileged).",
    )

    @property
    def cluster_transport(self) -> SyncTransport:
        """The transport the operator deploys: auto is grpc in a cluster, where pods may land on any node."""
        return "shm" if self.transport == "shm" else "grpc"

    @property
    def local_transport(self) -> SyncTransport:
        """The transport of `rmsft local`: every process is on one machine, so auto is shm."""
        return "grpc" if self.transport == "grpc" else "shm"
