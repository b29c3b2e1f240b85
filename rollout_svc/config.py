"""Configuration of `rmsft serve`: one dataclass, filled from an optional YAML file and flags.

The flag set is defined once here (argparse) and used by both `python -m rollout_svc` and
`rmsft serve`, so the two entry points cannot drift apart.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class ServeConfig:
    model: str = ""
    backend: str = "vllm"  # vllm | hf; never an automatic fallback between them
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # None = 0.9 on GPU; unused on the CPU backend by default
    kv_cache_bytes: int = 0  # 0 = auto (see _HELP); > 0 = exactly this KV cache, any backend
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
    max_concurrent_requests: int = 64  # Generate calls admitted (waiting + running)
    max_num_seqs: int = 0  # sequences the engine runs at once (vLLM's max_num_seqs; 0 = vLLM's default)
    max_frame_bytes: int = 8 << 20
    staging_dir: str = ""  # default: /dev/shm when present, else the temp dir
    shared_weights_dir: str = ""  # transport shm: where the learner writes updates (default: $RMSFT_SHARED_WEIGHTS_DIR)
    keep_rollback_copy: bool = True  # keep the last FULL stream staged to undo a failed apply
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
        if self.min_pixels < 0 or self.max_pixels < 0 or (self.min_pixels and self.max_pixels
                                                          and self.min_pixels > self.max_pixels):
            problems.append(f"pixel bounds must be >= 0 with min <= max, got {self.min_pixels}..{self.max_pixels}")
        if self.max_images_per_prompt < 0 or self.max_image_pixels < 1:
            problems.append("max_images_per_prompt must be >= 0 and max_image_pixels >= 1")
        if self.max_concurrent_requests < 1:
            problems.append("max_concurrent_requests must be >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("TLS needs both tls_cert and tls_key")
        if problems:
            raise SystemExit("rmsft serve: invalid configuration:\n  " + "\n  ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_HELP = {
    "model": "local model folder (HF layout, safetensors)",
    "backend": "engine: vllm (default) or hf (transformers, explicit only; never a fallback)",
    "tensor_parallel_size": "GPUs per engine (vLLM tensor parallelism)",
    "gpu_memory_utilization": "vLLM memory share (default 0.9 on GPU); on the CPU backend, when given, the share "
    "of the NUMA node's RAM for the worker's weights + KV cache (prefer --kv-cache-bytes there)",
    "kv_cache_bytes": "exact KV cache size in bytes, overriding --gpu-memory-utilization (0 = auto: "
    "1 GiB on the CPU backend when no --gpu-memory-utilization is given, else vLLM sizes it)",
    "max_model_len": "longest prompt + completion in tokens",
    "enable_lora": "serve LoRA adapters (needed for ADAPTER weight sync)",
    "max_lora_rank": "largest adapter rank accepted (vLLM supports 8, 16, 32, 64, ...)",
    "enable_prefix_caching": "vLLM prefix caching (reset after every weight change)",
    "enforce_eager": "skip CUDA graphs / compilation (default: on for CPU, off for GPU)",
    "dtype": "model dtype for vLLM (auto = checkpoint dtype)",
    "seed": "engine seed (per-request seeds still win)",
    "logprobs_mode": "what sampled tokens' log-probs are: raw (the model's own distribution) or processed (the "
    "distribution sampled from, after temperature, top-k/top-p and penalties; what GRPO's importance ratio needs)",
    "model_impl": "vLLM model implementation: auto = native, except vision-language models on the CPU backend, "
    "which need the Transformers backend (vLLM's native Qwen-VL code needs torchvision); vllm | transformers force one",
    "min_pixels": "smallest resized image area in pixels for vision-language models (0 = the processor's own); "
    "must equal the learner's",
    "max_pixels": "largest resized image area in pixels (0 = the processor's own); must equal the learner's",
    "max_images_per_prompt": "images one prompt may carry (vLLM's limit_mm_per_prompt); more are refused",
    "max_image_pixels": "largest source image (width x height) accepted; larger ones are refused before decoding",
    "host": "address to listen on",
    "port": "gRPC port; startup fails when it is taken",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "auth_token": "shared token required on every call (prefer --auth-token-file or RMSFT_AUTH_TOKEN)",
    "auth_token_file": "file holding the shared token (e.g. a mounted Secret)",
    "tls_cert": "PEM certificate chain; with --tls-key enables TLS",
    "tls_key": "PEM private key",
    "max_concurrent_requests": "Generate calls admitted at once; more get RESOURCE_EXHAUSTED",
    "max_num_seqs": "sequences the vLLM engine runs in one batch (0 = vLLM's default); more wait in its queue",
    "max_frame_bytes": "largest TensorPiece payload accepted in UpdateWeights",
    "staging_dir": "where weight streams are staged (default /dev/shm)",
    "shared_weights_dir": "transport shm: the node-local shared-memory dir the learner writes updates into "
    "(default: $RMSFT_SHARED_WEIGHTS_DIR; unset = shm updates refused)",
    "keep_rollback_copy": "keep the last applied FULL stream in the staging dir so a failed apply can be "
    "undone (costs one model size of staging memory); without it a failed apply marks the server broken",
    "replica_ordinal": "replica index reported by GetStatus (default: from POD_NAME/HOSTNAME suffix)",
    "grace_seconds": "shutdown grace for in-flight calls",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(prog: str = "rmsft serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve one rollout engine over gRPC (rmsft contract).")
    p.add_argument("--config", help="YAML file with any of the options below (snake_case keys); flags win")
    for f in fields(ServeConfig):
        default = f.default if f.default is not MISSING else None
        text = _HELP.get(f.name, "")
        if f.type in ("bool", "bool | None"):
            p.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{text} (default {default})")
        else:
            typ = {"int": int, "float": float, "float | None": float}.get(str(f.type), str)
            p.add_argument(_flag(f.name), dest=f.name, type=typ, default=None, help=f"{text} (default {default!r})")
    return p


def parse_config(argv: list[str] | None = None, prog: str = "rmsft serve") -> ServeConfig:
    args = build_parser(prog).parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(data, dict):
            raise SystemExit(f"rmsft serve: {args.config} must hold a mapping")
        known = {f.name for f in fields(ServeConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SystemExit(f"rmsft serve: unknown keys in {args.config}: {unknown}")
        values.update(data)
    for k, v in vars(args).items():
        if k != "config" and v is not None:
            values[k] = v
    cfg = ServeConfig(**values)
    cfg.validate()
    return cfg
