"""The flags of `rmsft serve`: defined once here (argparse) from `ServeConfig`'s fields and used by both
`python -m rollout_svc` and `rmsft serve`, so the two entry points cannot drift apart; an optional YAML
file gives any of them, flags win.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from rollout_engine.config import ServeConfig

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
    "relay_allow": "comma-separated host:port patterns (shell wildcards) this server may relay weight updates to",
    "max_concurrent_requests": "Generate calls admitted at once; more get RESOURCE_EXHAUSTED",
    "max_num_seqs": "sequences the vLLM engine runs in one batch (0 = vLLM's default); more wait in its queue",
    "max_frame_bytes": "largest TensorPiece payload accepted in UpdateWeights",
    "staging_dir": "where weight streams are staged (default /dev/shm)",
    "shared_weights_dir": "transport shm: the node-local shared-memory dir the learner writes updates into "
    "(default: $RMSFT_SHARED_WEIGHTS_DIR; unset = shm updates refused)",
    "keep_rollback_copy": "keep the last applied FULL stream in the staging dir so a failed apply can be "
    "undone (costs one model size of staging memory); without it a failed apply marks the server broken",
    "weight_transfer": "transport nccl: the weight-transfer backend the engine joins the learner's group with: nccl "
    "(GPUs) or rmsft_gloo (the CPU stand-in); unset = full weights come over gRPC or shm only",
    "replica_ordinal": "replica index reported by GetStatus (default: from POD_NAME/HOSTNAME suffix)",
    "grace_seconds": "shutdown grace for in-flight calls",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class WholeWordsHelp(argparse.HelpFormatter):
    """argparse's help, wrapped between words only, as every other `rmsft` command's (rmsft_cli.app): textwrap's
    defaults break at hyphens (`--kv-` | `cache-bytes`) and inside words longer than the column."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.TextWrapper(width, break_on_hyphens=False, break_long_words=False).wrap(
            self._whitespace_matcher.sub(" ", text).strip()
        )

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return textwrap.TextWrapper(
            width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
        ).fill(self._whitespace_matcher.sub(" ", text).strip())


def build_parser(prog: str = "rmsft serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Serve one rollout engine over gRPC (rmsft contract).", formatter_class=WholeWordsHelp
    )
    p.add_argument("--config", help="YAML file with any of the options below (snake_case keys); flags win")
    for f in fields(ServeConfig):
        default = f.default if f.default is not MISSING else None
        text = _HELP.get(f.name, "")
        if f.type in ("bool", "bool | None"):
            p.add_argument(
                _flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{text} (default {default})",
            )
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
            # Tolerated, said on stderr (docs/upgrade.md): an operator newer than this image may write a key this
            # image does not know into a job's serve.yaml; refusing it would crash-loop every server of the job.
            print(
                f"rmsft serve: warning: ignoring unknown keys in {args.config}: {unknown} (written for a newer "
                "rmsft serve, or misspelt)",
                file=sys.stderr,
            )
        values.update({k: v for k, v in data.items() if k in known})
    for k, v in vars(args).items():
        if k != "config" and v is not None:
            values[k] = v
    cfg = ServeConfig(**values)
    cfg.validate()
    return cfg
