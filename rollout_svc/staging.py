"""Staging of a weight stream: bytes go to one preallocated file (in /dev/shm by default) while
`rmsft.weight_wire.StreamReader` checks every chunk; nothing touches the engine until the
trailer's digest matched. The file plus a JSON index is what the engine's worker loads from.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rmsft_protos import rollout_pb2

from rmsft.run_dir import pid_alive
from rmsft.weight_wire import (
    DTYPE_SIZES,
    FULL,
    PieceFrame,
    StagedTensor,
    StreamReader,
    TensorSpec,
    WireError,
    check_shared,
    open_shared,
)
from rmsft.weight_wire.shared import shared_path
from rollout_engine.staged_file import iter_staged_tensors


@dataclass
class StagedWeights:
    index_path: str
    data_path: str
    header: rollout_pb2.WeightHeader
    tensors: list[StagedTensor]
    bytes_received: int
    fd: int = -1  # shm: the shared file, held open (data_path is /proc/<pid>/fd/<fd>) until cleanup
    shared: bool = False  # shm: the data is the learner's file, never removed here

    def cleanup(self) -> None:
        for p in [self.index_path] if self.shared else [self.index_path, self.data_path]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        if self.fd >= 0:  # the shared file's memory is freed once every holder closed it
            os.close(self.fd)
            self.fd = -1


class StageObserver(Protocol):
    """Told what `Stager.stage` does with a grpc stream, in order (the relay forwards from it)."""

    def opened(self, header: rollout_pb2.WeightHeader, data_path: str) -> None: ...

    def piece(self, name: str, spec: TensorSpec, offset: int, dest: int, size: int) -> None: ...

    def finished(self, trailer: rollout_pb2.WeightTrailer) -> None: ...

    def failed(self, error: BaseException) -> None: ...


def _pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite may write less than asked (signals, huge buffers); a short write must not pass."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset}")
        view, offset = view[n:], offset + n


STAGE_PREFIX = "rmsft-stage-"  # + <server pid>-<version>-<random>.bin / .json


def remove_dead_servers_staging(staging_dir: str) -> list[str]:
    """Remove the staging files of servers that are gone (their pid, in the name, is not running): a server
    killed mid-update (SIGKILL, an OOM kill) cannot remove its own, and /dev/shm is memory. Files of live
    servers, and names this does not recognise, stay. Returns what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(staging_dir):
            head = entry.name.removeprefix(STAGE_PREFIX)
            pid = head.split("-", 1)[0]
            if head == entry.name or not pid.isdigit() or not head.endswith((".bin", ".json")) or head.count("-") != 2:
                continue
            if int(pid) != os.getpid() and not pid_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                removed.append(entry.path)
    return removed


class Stager:
    def __init__(self, staging_dir: str, max_frame_bytes: int, shared_dir: str = ""):
        self.staging_dir = staging_dir
        self.max_frame_bytes = max_frame_bytes
        self.shared_dir = shared_dir  # where shm updates are read from ("" = transport shm refused)
        self.removed_at_start = remove_dead_servers_staging(staging_dir)

    def stage(
        self,
        chunks: Iterable[rollout_pb2.WeightChunk],
        expected_for: Callable[..., Any],
        on_header: Callable[..., Any] | None = None,
        observer: StageObserver | None = None,
        on_shared_open: Callable[..., Any] | None = None,
    ) -> StagedWeights:
        """Consume a whole update. `expected_for(header)` -> (table, optional names, require_all).
        `on_header(header)` may refuse it (raise) before anything is staged, or return the
        `StageObserver` of this update (the relay). `on_shared_open()`: a shm update's file is open
        here (the servicer tells the learner, which writes the file only once every server has it).

        Raises WireError for any bad update; a partial staging file is removed before raising.
        """
        it: Iterator = iter(chunks)
        reader = StreamReader(max_frame_bytes=self.max_frame_bytes)
        try:
            first = next(it)
        except StopIteration:
            raise WireError("empty weight stream (no header)", reason="truncated") from None
        if first.WhichOneof("kind") != "header":
            raise WireError("a weight stream must start with a header")
        header = first.header
        if on_header is not None:
            observer = on_header(header) or observer
        table, optional, require_all = expected_for(header)
        reader.expected = table
        reader.optional = optional
        reader.require_all = require_all
        reader.parallel_digest = header.HasField("shared_file")  # a file in memory: hash it on every core
        reader.on_header(header)
        most = most_bytes(table)
        if most is not None and header.total_bytes > most:  # before any space is taken
            raise WireError(
                f"the update announces {header.total_bytes} bytes, more than the {most} bytes every tensor "
                f"it may carry takes ({len(table)} tensors): refused before staging",
                reason="count",
            )
        base = os.path.join(self.staging_dir, f"{STAGE_PREFIX}{os.getpid()}-{header.version}-{uuid.uuid4().hex[:8]}")
        if header.HasField("shared_file"):
            if header.relay_to:
                raise WireError("a shm update is read from the shared file by every server; it is never relayed")
            return self._stage_shared(header, it, reader, base + ".json", on_shared_open)
        staged = StagedWeights(base + ".json", base + ".bin", header, reader.tensors, 0)
        fd = os.open(staged.data_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            self._reserve(fd, header.total_bytes)
            if observer is not None:
                observer.opened(header, staged.data_path)
            for chunk in it:
                if chunk.WhichOneof("kind") == "piece":
                    if reader.finished:
                        raise WireError("data after the trailer")
                    # A PieceFrame (server deserializer `decode_chunk`) already holds a view of
                    # the payload; a plain WeightChunk's `.data` is read once (each read copies).
                    data = chunk.data if isinstance(chunk, PieceFrame) else chunk.piece.data
                    dest = reader.on_piece(chunk.piece, data)
                    if data:
                        _pwrite_all(fd, data, dest)
                    if observer is not None:
                        p = chunk.piece
                        observer.piece(p.name, reader.tensors[-1].spec, p.offset, dest, len(data))
                else:
                    reader.feed(chunk)
                if reader.finished:
                    break
            if not reader.finished:
                raise WireError("stream ended before the trailer", reason="truncated")
            for _ in it:  # anything after the trailer is a protocol error
                raise WireError("data after the trailer")
            staged.bytes_received = reader.received_bytes
            _write_index(staged)
            if observer is not None:
                observer.finished(chunk.trailer)
            return staged
        except BaseException as e:
            if observer is not None:
                observer.failed(e)
            staged.cleanup()
            raise
        finally:
            os.close(fd)

    def _stage_shared(
        self,
        header: rollout_pb2.WeightHeader,
        it: Iterator,
        reader: StreamReader,
        index_path: str,
        on_open: Callable[..., Any] | None,
    ) -> StagedWeights:
        fd = open_shared(self.shared_dir, header)
        try:
            if on_open is not None:
                on_open()
            try:
                trailer = next(it)  # the learner writes the file meanwhile
            except Exception as e:  # ended or broken off before the trailer: the learner is gone
                # Nobody else would remove its file (every server does the same; the first wins).
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(shared_path(self.shared_dir, header))
                if isinstance(e, StopIteration):
                    raise WireError(
                        "stream ended before the trailer (the shared file was removed)", reason="truncated"
                    ) from None
                raise
            if trailer.WhichOneof("kind") != "trailer":
                raise WireError("a shm update is a header and a trailer; the tensors are in the shared file")
            for _ in it:
                raise WireError("data after the trailer")
            check_shared(fd, header, trailer.trailer, reader)
            staged = StagedWeights(
                index_path,
                f"/proc/{os.getpid()}/fd/{fd}",
                header,
                reader.tensors,
                reader.received_bytes,
                fd=fd,
                shared=True,
            )
            _write_index(staged)
            return staged
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(index_path)
            os.close(fd)
            raise

    def _reserve(self, fd: int, nbytes: int) -> None:
        free = shutil.disk_usage(self.staging_dir).free
        if nbytes > free:
            raise WireError(
                f"weight stream needs {nbytes} bytes of staging but {self.staging_dir} has {free} free "
                "(give the pod a bigger /dev/shm or set --staging-dir)",
                code="RESOURCE_EXHAUSTED",
                reason="staging_space",
            )
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise WireError(
                    f"cannot reserve {nbytes} staging bytes in {self.staging_dir}: {e}",
                    code="RESOURCE_EXHAUSTED",
                    reason="staging_space",
                ) from e


_WIDEST = max(DTYPE_SIZES.values())  # bytes of the widest element the wire knows


def most_bytes(table: dict[str, TensorSpec] | None) -> int | None:
    """The most bytes an update against `table` (the tensors it may carry) can hold: each tensor once, at 8 bytes an
    element whatever its dtype (a stream in another dtype than the model's is refused later, with the dtype named:
    this bound only stops an announcement no model of this shape could need). None when it cannot be bounded (no
    table, or a dimension left open: -1)."""
    if table is None or any(-1 in spec.shape for spec in table.values()):
        return None
    return sum(math.prod(spec.shape) * _WIDEST for spec in table.values())


def _write_index(staged: StagedWeights) -> None:
    index = {
        "data": staged.data_path,
        "mode": int(staged.header.mode),
        "tensors": [[t.name, t.spec.dtype, list(t.spec.shape), t.start] for t in staged.tensors],
    }
    Path(staged.index_path).write_text(json.dumps(index))


def full_expectation(table: dict[str, TensorSpec], tied: bool, required: set[str] | frozenset[str] = frozenset()):
    """FULL: any subset of the checkpoint's tensors that holds every name in `required` (the tensors
    earlier FULL updates changed: leaving one out would leave it at a value no rollback copy holds).
    Tensors left out keep their current values: the learner does not resend what cannot have changed
    (a frozen vision tower). A tied `lm_head.weight` may come along and is ignored."""
    if tied and "lm_head.weight" not in table:
        for emb in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
            if emb in table:
                table = {**table, "lm_head.weight": table[emb]}
                break
    return table, set(table) - set(required), True


def adapter_expectation(table: dict[str, TensorSpec], config: dict) -> dict[str, TensorSpec]:
    """LoRA A/B tensors PEFT would save for each 2-D checkpoint weight, shaped by the config rank.

    Dtypes are checked only for being floating point ("*"): adapters are often kept in F32 on
    top of a BF16 base. PEFT names modules as the model class does, which is not always the
    checkpoint's layout: Qwen2-VL/Qwen2.5-VL checkpoints hold `model.layers.*` for what the model
    calls `model.language_model.layers.*` (vLLM's LoRA loader maps both), so both are accepted.
    """
    r = int(config.get("r", 0))
    per_module_rank = bool(config.get("rank_pattern"))
    vision_language = any(n.startswith(("visual.", "model.visual.")) for n in table)
    out: dict[str, TensorSpec] = {}
    for name, spec in table.items():
        if not name.endswith(".weight") or len(spec.shape) != 2:
            continue
        stem = name[: -len(".weight")]
        stems = [stem]
        if vision_language and stem.startswith("model.layers."):
            stems.append("model.language_model." + stem.removeprefix("model."))
        rows, cols = spec.shape
        a_shape = (-1 if per_module_rank else r, cols)
        b_shape = (rows, -1 if per_module_rank else r)
        for prefix in ("base_model.model.", ""):
            for st in stems:
                out[f"{prefix}{st}.lora_A.weight"] = TensorSpec("*", a_shape)
                out[f"{prefix}{st}.lora_B.weight"] = TensorSpec("*", b_shape)
    return out


def write_adapter_dir(staged: StagedWeights, out_dir: str) -> str:
    """PEFT adapter folder (adapter_model.safetensors + adapter_config.json) from a staged stream."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: t.clone() for name, t in iter_staged_tensors(staged.index_path)}
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    Path(out_dir, "adapter_config.json").write_text(staged.header.adapter_config_json)
    return out_dir


__all__ = ["FULL", "Stager", "StagedWeights", "full_expectation", "adapter_expectation", "write_adapter_dir"]
