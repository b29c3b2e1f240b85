"""Which dtype FULL weights travel in, the one rule both ends of a weight stream follow.

The rollout server serves in `--dtype` (`spec.model.dtype`; `auto` = the checkpoint's dtype), and
a FULL update carries every floating tensor in that dtype and every other tensor (float8 weights,
integer buffers) in its checkpoint dtype. The learner casts what it sends by this rule
(learner/sync/weights.py), the server checks what it receives by it (rollout_svc/servicer.py) and
sizes its staging space by it (rollout_svc/preflight.py). Torch-free: it reads config.json and the
safetensors headers only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rmsft.model_folder import model_config
from rmsft.weight_wire import TensorSpec

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def safetensors_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then JSON): names,
    dtypes, shapes and offsets, without reading any tensor data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        body = f.read(n)
    try:
        header = json.loads(body)
    except ValueError as e:
        raise ValueError(f"{path} has a malformed safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a malformed safetensors header (not a JSON object)")
    return header


# Tensors stored in one of these are sent (and staged) in the serving dtype; float8 weights and
# integer buffers keep their checkpoint dtype. Same rule as the learner's export.
CASTABLE_DTYPES = ("F16", "BF16", "F32", "F64")
SERVE_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_ALIASES = {"half": "float16", "float": "float32"}  # what vLLM's --dtype also takes


def config_dtype(model_dir: str | Path) -> str | None:
    """config.json's `dtype` (transformers >= 4.56) or `torch_dtype`, at the top or in
    `text_config` (VLMs), as a safetensors dtype name; None when it names none of SERVE_DTYPES."""
    cfg = model_config(model_dir)
    for section in (cfg, cfg.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = section.get(key) if isinstance(section, dict) else None
            if isinstance(value, str) and value.removeprefix("torch.") in SERVE_DTYPES:
                return SERVE_DTYPES[value.removeprefix("torch.")]
    return None


def safetensors_headers(model_dir: str | Path) -> list[tuple[Path, dict]]:
    return [(f, safetensors_header(f)) for f in sorted(Path(model_dir).glob("*.safetensors"))]


def serving_dtype_name(dtype: str, model_dir: str | Path) -> str | None:
    """The safetensors dtype name the engine serves in for `--dtype dtype`: an explicit dtype, or
    for `auto` the checkpoint's (config.json, else the floating dtype holding most bytes in the
    safetensors files). None when `auto` finds no
    floating tensor at all (then every tensor keeps its checkpoint dtype)."""
    dtype = _ALIASES.get(dtype, dtype)
    if dtype != "auto":
        if dtype not in SERVE_DTYPES:
            raise ValueError(f"--dtype must be auto or one of {sorted(SERVE_DTYPES)}, got {dtype!r}")
        return SERVE_DTYPES[dtype]
    found = config_dtype(model_dir)
    if found is not None:
        return found
    by_dtype: dict[str, int] = {}
    for _, header in safetensors_headers(model_dir):
        for name, info in header.items():
            if name != "__metadata__" and info.get("dtype") in SERVE_DTYPES.values():
                spec = TensorSpec(info["dtype"], tuple(int(d) for d in info.get("shape", ())))
                by_dtype[spec.dtype] = by_dtype.get(spec.dtype, 0) + spec.nbytes
    return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None


def served_spec(spec: TensorSpec, serve: str | None) -> TensorSpec:
    """How a checkpoint tensor travels in a FULL update to an engine serving in `serve`."""
    if serve is not None and spec.dtype in CASTABLE_DTYPES and spec.dtype != serve:
        return TensorSpec(serve, spec.shape)
    return spec
