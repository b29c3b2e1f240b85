"""spec.sync: how the learner's new weights reach the rollout engines, and which transport carries them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rmsft.jobspec.base import _K8s

SyncTransport = Literal["grpc", "shm", "nccl"]


class SyncSpec(_K8s):
    """How the learner's new weights reach the rollout engines, before each step that samples: every step under
    recipe generation 1, channel-B steps and held-out evaluations under generation 2."""

    mode: Literal["full", "adapter", "auto"] = Field(
        "full",
        description="full: the model's weights (LoRA merged); adapter: the LoRA adapter alone (needs "
        "rollout.enableLora and training.finetune lora); auto: adapter when every server and the model allow it, "
        "else full.",
    )
    fallback_to_full: bool = Field(
        True, description="After an adapter update fails, send full weights for the rest of the run."
    )
    frame_bytes: int = Field(4 << 20, ge=64 << 10, le=256 << 20, description="Max bytes per stream frame.")
    timeout_seconds: float = Field(600.0, gt=0, description="Deadline of one weight update, per server call.")
    # 512 MiB: verl's default bucket for its weight sync; vLLM's own packed NCCL default is 1 GiB. Each bucket is
    # a copy on the learner's device (two in flight on NCCL), so the size is also the sync's extra memory.
    bucket_megabytes: int = Field(
        512,
        ge=0,
        le=16384,
        description="Transport nccl: the weight-transfer group packs full weights into buckets "
        "of this many MiB, one broadcast per bucket (a tensor larger than a bucket goes alone); each bucket is "
        "an extra copy on the learner's device while it is sent (two in flight on NCCL). 0: one broadcast per "
        "tensor.",
    )
    group_timeout_seconds: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="Transport nccl: the deadline of each operation of the weight-transfer "
        "group, on the learner and on every server: the join, each bucket's broadcast, the update's finish (every "
        "member says it holds every bucket before any loads them). A server that misses it is cut off: it loads "
        "nothing of that update, serves the version it had, and is re-synced over gRPC when it answers again; the "
        "other members load nothing either (the update is whole on all or on none) and the learner's sync fails "
        "naming it. On GPUs (NCCL, which has no timeout of its own) also the rendezvous's timeout, the learner's "
        "watchdog (it aborts the communicator when no broadcast completed for this long) and each server's bound on "
        "its engine (this x (the update's collectives + 2); past it the server exits to be restarted).",
    )
    transport: Literal["auto", "grpc", "shm", "nccl"] = Field(
        "auto",
        description="How an update reaches the rollout servers: grpc streams its bytes over gRPC (works "
        "across nodes); shm writes it once to a file in node-local shared memory and gRPC carries only a header "
        "naming the file; nccl broadcasts full weights from the learner's rank 0 to every server's engine workers "
        "over one weight-transfer group (vLLM's weight-transfer API; NCCL on GPUs, gloo on CPUs), driven over "
        "gRPC, and needs sync.mode full (re-syncs of one server go over grpc). auto = shm under `rmsft local` (one "
        "machine), grpc in a cluster. shm in a cluster is opt-in: the learner and the whole pool on one node (they "
        "fit spec.placement.gpusPerNode; the operator adds pod affinity) and a namespace whose Pod Security level "
        "allows hostPath volumes (privileged). nccl lets the learner and the pool span nodes.",
    )

    @property
    def cluster_transport(self) -> SyncTransport:
        """The transport the operator deploys: auto is grpc in a cluster, where pods may land on any node."""
        return "grpc" if self.transport == "auto" else self.transport

    @property
    def local_transport(self) -> SyncTransport:
        """The transport of `rmsft local`: every process is on one machine, so auto is shm."""
        return "shm" if self.transport == "auto" else self.transport

    def group_backend(self, accelerator: str) -> str | None:
        """Transport nccl's weight-transfer backend (rmsft.weight_wire.transfer): vLLM's NCCL engine on GPUs,
        rmsft's gloo stand-in on CPUs; None for the other transports."""
        if self.transport != "nccl":
            return None
        return "nccl" if accelerator == "nvidia" else "rmsft_gloo"
