"""Configuration of a rollout engine and of the `rmsft serve` process around it: one dataclass.

Both homes build it: `rmsft serve` fills it from an optional YAML file and flags (rollout_svc/config.py
defines the flag set), the colocated engine from the job spec (learner/rollouts/colocate).
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class ServeConfig:
    model: str = ""
    backend: str = "vllm"  # vllm | hf; never an automatic fallback between them
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # None = 0.9 on GPU; unused on the CPU backend by default
    kv_cache_bytes: int = 0  # 0 = auto (see rollout_svc/config.py's help); > 0 = exactly this KV cache, any backend
    max_model_len: int = 4096
    enable_lora: bool = False
    max_lora_rank: int = 16
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None  # None = True on CPU, False on GPU
    dtype: str = "auto"
    seed: int = 0
    # What Completion.logprobs hold: "raw" (log_softmax of the model's logits) or "processed" (of the distribution
    # sampled from: after temperature, top-k/top-p, penalties), vLLM's logprobs_mode. GRPO needs "processed".
    logprobs_mode: str = "raw"
    # Vision-language models (ignored for text models): how images become tokens, identical to the
    # learner's processor settings (both from spec.model.vision).
    model_impl: str = "auto"  # auto | vllm | transformers (see vllm_engine.model_impl_for)
    min_pixels: int = 0  # 0 = the processor's own
    max_pixels: int = 0
    max_images_per_prompt: int = 4
    max_image_pixels: int = 50_000_000
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9400  # 0 = no metrics endpoint
    auth_token: str = ""  # prefer auth_token_file / RMSFT_AUTH_TOKEN
    auth_token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # The peers this server forwards weight updates to (the header's relay_to): host:port patterns with shell
    # wildcards, comma-separated; a target matching none refuses the whole update. Loopback by default (`rmsft
    # local`); the operator names the job's own StatefulSet pods.
    relay_allow: str = "127.0.0.1:*,localhost:*"
    max_concurrent_requests: int = 64  # Generate calls admitted (waiting + running)
    max_num_seqs: int = 0  # sequences the engine runs at once (vLLM's max_num_seqs; 0 = vLLM's default)
    max_frame_bytes: int = 8 << 20
    staging_dir: str = ""  # default: /dev/shm when present, else the temp dir
    shared_weights_dir: str = ""  # transport shm: where the learner writes updates (default: $RMSFT_SHARED_WEIGHTS_DIR)
    keep_rollback_copy: bool = True  # keep the last FULL stream staged to undo a failed apply
    # Transport nccl: the engine's weight-transfer backend ("" = none: JoinWeightGroup refused), see
    # rmsft.weight_wire.transfer.
    weight_transfer: str = ""
    replica_ordinal: int = -1  # -1 = from POD_NAME / HOSTNAME "<name>-<k>", else 0
    grace_seconds: float = 5.0

    def resolved_replica_ordinal(self) -> int:
        if self.replica_ordinal >= 0:
            return self.replica_ordinal
        for var in ("RMSFT_REPLICA_ORDINAL",):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        # StatefulSet pods are named <set>-<ordinal>.
        for var in ("POD_NAME", "HOSTNAME"):
            m = re.search(r"-(\d+)$", os.environ.get(var, ""))
            if m:
                return int(m.group(1))
        return 0

    def resolved_auth_token(self) -> str:
        if self.auth_token_file:
            try:
                return Path(self.auth_token_file).read_text().strip()
            except OSError as e:
                raise SystemExit(f"rmsft serve: cannot read auth token file {self.auth_token_file}: {e}") from e
        return self.auth_token or os.environ.get("RMSFT_AUTH_TOKEN", "")

    def resolved_staging_dir(self) -> str:
        if self.staging_dir:
            return self.staging_dir
        import tempfile

        return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()

    def resolved_shared_weights_dir(self) -> str:
        """Where shm updates are read from; "" = this server refuses transport shm."""
        from rmsft.weight_wire import shared_dir_from_env

        return self.shared_weights_dir or shared_dir_from_env()

    def validate(self) -> None:
        problems = []
        if not self.model:
            problems.append("--model is required (a local model folder)")
        elif not Path(self.model).is_dir():
            problems.append(f"model folder {self.model} does not exist")
        if self.backend not in ("vllm", "hf"):
            problems.append(f"backend must be 'vllm' or 'hf', got {self.backend!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            problems.append("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_bytes < 0:
            problems.append("kv_cache_bytes must be >= 0 (0 = auto)")
        if self.tensor_parallel_size < 1:
            problems.append("tensor_parallel_size must be >= 1")
        if self.logprobs_mode not in ("raw", "processed"):
            problems.append(f"logprobs_mode must be raw or processed, got {self.logprobs_mode!r}")
        if self.model_impl not in ("auto", "vllm", "transformers"):
            problems.append(f"model_impl must be auto, vllm or transformers, got {self.model_impl!r}")
        if (
            self.min_pixels < 0
            or self.max_pixels < 0
            or (self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels)
        ):
            problems.append(f"pixel bounds must be >= 0 with min <= max, got {self.min_pixels}..{self.max_pixels}")
        if self.max_images_per_prompt < 0 or self.max_image_pixels < 1:
            problems.append("max_images_per_prompt must be >= 0 and max_image_pixels >= 1")
        if self.max_concurrent_requests < 1:
            problems.append("max_concurrent_requests must be >= 1")
        if self.weight_transfer and self.weight_transfer not in ("nccl", "rmsft_gloo"):
            problems.append(f"weight_transfer must be nccl or rmsft_gloo (or empty), got {self.weight_transfer!r}")
        if self.weight_transfer == "nccl" and self.backend != "vllm":  # the hf backend joins gloo groups only
            problems.append("weight_transfer nccl needs backend vllm")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("TLS needs both tls_cert and tls_key")
        if problems:
            raise SystemExit("rmsft serve: invalid configuration:\n  " + "\n  ".join(problems))

    def relay_allowed(self, target: str) -> bool:
        return any(fnmatch.fnmatchcase(target, p.strip()) for p in self.relay_allow.split(",") if p.strip())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
