"""Receiver side of a weight update: `StreamReader` checks a stream (or a shared file read as
one) against the framing rules and the model's tensor table and maps every piece onto a flat
staging buffer; `decode_chunk` is the server's zero-copy deserializer of `UpdateWeights` messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rmsft_protos import rollout_pb2

from rmsft.weight_wire.contract import (
    ADAPTER,
    BLAKE3,
    DATA_FIELD,
    DEFAULT_MAX_FRAME_BYTES,
    DTYPE_SIZES,
    FULL,
    PIECE_TAG,
    SHA256,
    PipelinedDigest,
    TensorSpec,
    WireError,
    digest_name,
)
from rmsft.weight_wire.version import check_run_id


@dataclass
class StagedTensor:
    name: str
    spec: TensorSpec
    start: int  # byte offset in the flat staging buffer


class PieceHead(Protocol):
    """What `StreamReader` reads of a piece besides its bytes: a `rollout_pb2.TensorPiece`, or the views the
    shared-file and transfer-group paths make of their index entries."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def offset(self) -> int: ...


@dataclass(frozen=True)
class _Listed:
    """A tensor a transfer-group header lists, as `StreamReader._open` reads a first piece."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0


@dataclass
class StreamReader:
    """Validates one stream chunk by chunk and maps piece bytes onto a flat staging buffer.

    `expected`: tensor name -> spec the receiver accepts (None = accept any names/shapes).
    `require_all`: every expected tensor not in `optional` must be in the stream (a FULL update).
    In `expected`, dtype "*" accepts any floating dtype and a dimension of -1 accepts any size.
    """

    expected: Mapping[str, TensorSpec] | None = None
    require_all: bool = False
    optional: set[str] = field(default_factory=set)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    parallel_digest: bool = False  # hash big pieces on every core (`new_hash`): a shm file's reader
    header: Any = None
    tensors: list[StagedTensor] = field(default_factory=list)
    received_bytes: int = 0
    _current: StagedTensor | None = None
    _current_done: int = 0
    _next_start: int = 0
    _seen: set[str] = field(default_factory=set)
    _digest: Any = None  # PipelinedDigest of the header's algorithm
    finished: bool = False

    def on_header(self, header: rollout_pb2.WeightHeader) -> None:
        if self.header is not None:
            raise WireError("second header in one weight stream")
        if header.mode not in (FULL, ADAPTER):
            raise WireError(f"header.mode must be FULL or ADAPTER, got {header.mode}")
        if header.mode == ADAPTER and not header.adapter_config_json:
            raise WireError("ADAPTER header without adapter_config_json")
        check_run_id(header.run_id)  # it goes into logs and metric labels
        if header.digest_algorithm not in (SHA256, BLAKE3):
            raise WireError(f"header.digest_algorithm {header.digest_algorithm} is not SHA256 (0) or BLAKE3 (1)")
        if self.require_all and self.expected is not None:
            lo, hi = len(self.expected) - len(self.optional), len(self.expected)
            if not lo <= header.tensor_count <= hi:
                span = f"{lo}" if lo == hi else f"{lo} to {hi}"
                raise WireError(
                    f"FULL update announces {header.tensor_count} tensors but needs {span}: it must carry every "
                    f"checkpoint tensor an earlier FULL update changed (the model has {hi})",
                    reason="count",
                )
        self._digest = PipelinedDigest(header.digest_algorithm, parallel=self.parallel_digest)
        self.header = header

    def on_piece(self, piece: rollout_pb2.TensorPiece | PieceHead, data: bytes | memoryview | None = None) -> int:
        """Check one piece; return the offset in the staging buffer where its data goes.

        Pass `data` when the caller already read `piece.data`: every read of a protobuf bytes
        field makes a fresh copy.
        """
        if self.header is None:
            raise WireError("tensor piece before the header")
        if data is None:
            if not isinstance(piece, rollout_pb2.TensorPiece):
                raise TypeError(f"piece of {piece.name!r} comes without its bytes: pass `data`")
            data = piece.data
        if len(data) > self.max_frame_bytes:
            raise WireError(
                f"piece of {piece.name!r} carries {len(data)} bytes; the frame limit is {self.max_frame_bytes}",
                reason="frame_size",
            )
        cur = self._current
        if cur is not None and piece.name == cur.name:
            if piece.offset != self._current_done:
                raise WireError(
                    f"piece of {piece.name!r} at offset {piece.offset}, expected {self._current_done} "
                    "(pieces of a tensor must arrive in order)"
                )
            if piece.dtype != cur.spec.dtype or tuple(piece.shape) != cur.spec.shape:
                raise WireError(f"dtype/shape of {piece.name!r} changed between its pieces")
        else:
            self._close_current()
            cur = self._open(piece)
        end = self._current_done + len(data)
        if end > cur.spec.nbytes:
            raise WireError(
                f"tensor {piece.name!r} gets {end} bytes but {cur.spec.dtype}{list(cur.spec.shape)} "
                f"holds {cur.spec.nbytes}"
            )
        dest = cur.start + self._current_done
        self._current_done = end
        self.received_bytes += len(data)
        self._digest.update(data)
        return dest

    def _open(self, piece: PieceHead) -> StagedTensor:
        name = piece.name
        if not name:
            raise WireError("tensor piece without a name")
        if name in self._seen:
            raise WireError(f"tensor {name!r} sent twice")
        if piece.offset != 0:
            raise WireError(f"first piece of {name!r} starts at offset {piece.offset}, not 0")
        if piece.dtype not in DTYPE_SIZES:
            raise WireError(f"tensor {name!r} has unknown dtype {piece.dtype!r}", reason="dtype")
        spec = TensorSpec(piece.dtype, tuple(int(d) for d in piece.shape))
        if self.expected is not None:
            want = self.expected.get(name)
            if want is None:
                raise WireError(f"unknown tensor name {name!r}: the model has no such weight", reason="name")
            if len(want.shape) != len(spec.shape) or any(
                w not in (-1, g) for w, g in zip(want.shape, spec.shape, strict=True)
            ):
                raise WireError(
                    f"tensor {name!r} has shape {list(spec.shape)}, the model expects {list(want.shape)}",
                    reason="shape",
                )
            if want.dtype != spec.dtype and not (want.dtype == "*" and spec.dtype.startswith(("F", "BF"))):
                raise WireError(
                    f"tensor {name!r} has dtype {spec.dtype}, the model expects {want.dtype}", reason="dtype"
                )
        if len(self._seen) >= self.header.tensor_count:
            raise WireError(f"more tensors than the {self.header.tensor_count} announced", reason="count")
        start = self._next_start
        if start + spec.nbytes > self.header.total_bytes:
            raise WireError(
                f"tensor {name!r} overruns the {self.header.total_bytes} bytes announced in the header",
                reason="count",
            )
        self._seen.add(name)
        self._next_start = start + spec.nbytes
        staged = StagedTensor(name, spec, start)
        self.tensors.append(staged)
        self._current = staged
        self._current_done = 0
        return staged

    def _close_current(self) -> None:
        cur = self._current
        if cur is not None and self._current_done != cur.spec.nbytes:
            raise WireError(f"tensor {cur.name!r} ended after {self._current_done} of {cur.spec.nbytes} bytes")
        self._current = None

    def on_listing(self, tensors: Any) -> None:
        """Transport nccl: the header lists the tensors (`header.transfer_group.tensors`: name, dtype, shape) that
        come over the weight-transfer group, not in the stream. Check the list as a stream of them would be checked
        (names, dtypes, shapes, counts, completeness), with no bytes and no digest."""
        if self.header is None:
            raise WireError("tensor listing before the header")
        for entry in tensors:
            cur = self._open(_Listed(entry.name, entry.dtype, tuple(entry.shape)))
            self._current_done = cur.spec.nbytes
            self.received_bytes += cur.spec.nbytes
        self._check_complete()
        self.finished = True

    def on_trailer(self, trailer: rollout_pb2.WeightTrailer) -> None:
        """Final checks: completeness, counts and the digest."""
        self._check_complete()
        if trailer.digest != self._digest.digest():
            raise WireError(
                f"{digest_name(self.header.digest_algorithm)} digest of the received data does not match the trailer",
                reason="digest",
            )
        self.finished = True

    def _check_complete(self) -> None:
        if self.header is None:
            raise WireError("trailer before the header")
        self._close_current()
        h = self.header
        if len(self.tensors) != h.tensor_count:
            raise WireError(
                f"stream carried {len(self.tensors)} tensors, header announced {h.tensor_count}", reason="count"
            )
        if self.received_bytes != h.total_bytes:
            raise WireError(
                f"stream carried {self.received_bytes} bytes, header announced {h.total_bytes}", reason="count"
            )
        if self.require_all and self.expected is not None:
            missing = sorted(set(self.expected) - self._seen - self.optional)
            if missing:
                raise WireError(
                    f"FULL update lacks tensors {missing[:5]} (changed by earlier updates, or required)", reason="count"
                )

    def close(self) -> None:
        """Stop the digest's helper thread (waits for a hash in progress)."""
        if self._digest is not None:
            self._digest.settle()
            self._digest.close()

    def feed(self, chunk: rollout_pb2.WeightChunk) -> int | None:
        """Dispatch one chunk; returns the staging offset for pieces, None otherwise."""
        if self.finished:
            raise WireError("data after the trailer")
        kind = chunk.WhichOneof("kind")
        if kind == "header":
            self.on_header(chunk.header)
        elif kind == "piece":
            return self.on_piece(chunk.piece)
        elif kind == "trailer":
            self.on_trailer(chunk.trailer)
        else:
            raise WireError("empty WeightChunk")
        return None


@dataclass
class PieceFrame:
    """A received piece whose `data` is a view into the gRPC message bytes (no copy).

    `piece` is the `TensorPiece` with every field but `data` (parsed by protobuf); it quacks like
    a `WeightChunk` holding that piece so the receiver treats both alike.
    """

    piece: Any
    data: memoryview

    def WhichOneof(self, _group: str) -> str:  # protobuf's spelling
        return "piece"


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise IndexError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        n, pos = _varint(buf, pos)
        return pos + n
    if wire_type == 5:
        return pos + 4
    raise IndexError(f"wire type {wire_type}")


def decode_chunk(raw: bytes) -> rollout_pb2.WeightChunk | PieceFrame:
    """Server-side deserializer for UpdateWeights: like `WeightChunk.FromString`, but a piece's
    payload is not copied (protobuf copies it once on parse and again on every `.data` read).

    Only the common shape (one `piece` field holding at most one `data` field) takes the fast
    path; the small remaining fields are still parsed by protobuf. Anything else, including
    malformed input, goes through `WeightChunk.FromString` unchanged, so both paths accept and
    reject exactly the same messages.
    """
    buf = memoryview(raw)
    try:
        tag, pos = _varint(buf, 0)
        if tag != PIECE_TAG:
            raise IndexError("not a lone piece")
        n, start = _varint(buf, pos)
        end = start + n
        if end != len(buf):
            raise IndexError("more than one field")
        pos, data_span = start, None
        while pos < end:
            field_start = pos
            tag, pos = _varint(buf, pos)
            if tag >> 3 == DATA_FIELD and tag & 7 == 2:
                if data_span is not None:
                    raise IndexError("data twice")
                size, pos = _varint(buf, pos)
                data_span = (field_start, pos, pos + size)
                pos += size
            else:
                pos = _skip(buf, pos, tag & 7)
            if pos > end:
                raise IndexError("field overruns the message")
        if data_span is None:
            raise IndexError("no data")
    except IndexError:
        chunk: rollout_pb2.WeightChunk = rollout_pb2.WeightChunk.FromString(raw)
        return chunk
    field_start, data_start, data_end = data_span
    meta = rollout_pb2.TensorPiece.FromString(bytes(buf[start:field_start]) + bytes(buf[data_end:end]))
    return PieceFrame(meta, buf[data_start:data_end])
