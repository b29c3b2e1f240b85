"""Wire format of a weight stream (`RolloutService.UpdateWeights`), shared by both ends.

A stream is: one `WeightHeader`, then `TensorPiece`s, then one `WeightTrailer`.

- Tensors are sent one after the other; the pieces of one tensor are consecutive and in byte
  order (`offset` = bytes of that tensor already sent), each piece carries at most
  `frame_bytes` of data, and every piece repeats name/dtype/shape (so a receiver can validate
  on the first piece without buffering).
- `header.tensor_count` / `header.total_bytes` count the tensors and their raw bytes (C order,
  the tensor's own dtype, little-endian as torch stores it).
- The trailer holds a digest over the `data` of every piece, in stream order, with the hash
  the header names (`digest_algorithm`: BLAKE3, what rmsft sends, or SHA256, the proto default).

The sender side is `rmsft.wire_encode`; the receiver side is `StreamReader`, which checks the
framing rules above plus an optional expected-tensor table, and tells the caller where each
piece's bytes belong in a flat staging buffer of `header.total_bytes` bytes. This module has no
gRPC server logic and imports torch lazily (the operator image imports `rmsft` without torch).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rmsft_protos import rollout_pb2

if TYPE_CHECKING:  # pragma: no cover
    import torch

SyncMode = int  # rollout_pb2.SyncMode value: rollout_pb2.FULL or rollout_pb2.ADAPTER
FULL = rollout_pb2.FULL
ADAPTER = rollout_pb2.ADAPTER
SHA256 = rollout_pb2.SHA256
BLAKE3 = rollout_pb2.BLAKE3
# What senders use: BLAKE3 costs ~0.15 CPU-s/GB per core here, SHA-256 ~0.6 (with SHA-NI); both
# ends hash every byte, so this is most of the CPU a stream costs beyond copying it.
DEFAULT_DIGEST = BLAKE3

DEFAULT_FRAME_BYTES = 4 << 20
# What a server accepts per piece unless configured otherwise: twice the default frame, so a
# sender may use a bigger frame without renegotiation, but one message can never be huge.
DEFAULT_MAX_FRAME_BYTES = 8 << 20

# safetensors dtype names <-> element sizes; torch names are resolved lazily.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
_TORCH_NAMES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def torch_dtype(name: str) -> torch.dtype:
    """safetensors dtype name (F32, BF16, ...) -> torch dtype."""
    import torch

    try:
        return getattr(torch, _TORCH_NAMES[name])
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPE_SIZES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> safetensors dtype name."""
    text = str(dtype).removeprefix("torch.")
    for name, tname in _TORCH_NAMES.items():
        if tname == text:
            return name
    raise ValueError(f"dtype {dtype} cannot be sent; supported: {sorted(_TORCH_NAMES.values())}")


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def matches(self, other: TensorSpec) -> bool:
        """`self` used as a pattern: dtype "*" = any float, dim -1 = any size."""
        if self.dtype != other.dtype and not (self.dtype == "*" and other.dtype.startswith(("F", "BF"))):
            return False
        return len(self.shape) == len(other.shape) and all(
            w in (-1, g) for w, g in zip(self.shape, other.shape, strict=True)
        )


def digest_name(algorithm: int) -> str:
    return rollout_pb2.DigestAlgorithm.Name(algorithm) if algorithm in (SHA256, BLAKE3) else str(algorithm)


def new_hash(algorithm: int) -> Any:
    """A fresh hash object (`update`/`digest`) for a `DigestAlgorithm` value."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == BLAKE3:
        import blake3  # lazy: the operator image imports rmsft without the data-plane packages

        return blake3.blake3()
    raise ValueError(f"unknown digest algorithm {algorithm}; expected SHA256 (0) or BLAKE3 (1)")


class PipelinedDigest:
    """A digest computed on a helper thread, one frame behind the caller.

    hashlib and blake3 release the GIL on large buffers, so hashing frame k overlaps with
    producing or receiving frame k+1; at most one frame waits, so memory stays bounded.
    """

    _MIN_THREADED = 1 << 20  # below this, a thread hop costs more than it saves

    def __init__(self, algorithm: int = DEFAULT_DIGEST) -> None:
        self._h = new_hash(algorithm)
        self._pool: Any = None
        self._pending: Any = None

    def update(self, data: bytes) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if len(data) < self._MIN_THREADED:
            self._h.update(data)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rmsft-digest")
        self._pending = self._pool.submit(self._h.update, data)

    def digest(self) -> bytes:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self.close()
        return self._h.digest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __del__(self) -> None:
        self.close()


class WireError(Exception):
    """A stream that breaks the wire rules or does not fit the model.

    `code` is a grpc.StatusCode name (kept as text so this module needs no grpc), `reason` a
    short label for the sync-failure metric.
    """

    def __init__(self, message: str, *, code: str = "INVALID_ARGUMENT", reason: str = "malformed"):
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass
class StagedTensor:
    name: str
    spec: TensorSpec
    start: int  # byte offset in the flat staging buffer


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
        self._digest = PipelinedDigest(header.digest_algorithm)
        self.header = header

    def on_piece(self, piece: rollout_pb2.TensorPiece, data: bytes | None = None) -> int:
        """Check one piece; return the offset in the staging buffer where its data goes.

        Pass `data` when the caller already read `piece.data`: every read of a protobuf bytes
        field makes a fresh copy.
        """
        if self.header is None:
            raise WireError("tensor piece before the header")
        if data is None:
            data = piece.data
        if len(data) > self.max_frame_bytes:
            raise WireError(
                f"piece of {piece.name!r} carries {len(data)} bytes; the frame limit is "
                f"{self.max_frame_bytes}",
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

    def _open(self, piece: rollout_pb2.TensorPiece) -> StagedTensor:
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
            raise WireError(
                f"tensor {cur.name!r} ended after {self._current_done} of {cur.spec.nbytes} bytes"
            )
        self._current = None

    def on_trailer(self, trailer: rollout_pb2.WeightTrailer) -> None:
        """Final checks: completeness, counts and the digest."""
        if self.header is None:
            raise WireError("trailer before the header")
        self._close_current()
        h = self.header
        if len(self.tensors) != h.tensor_count:
            raise WireError(f"stream carried {len(self.tensors)} tensors, header announced {h.tensor_count}",
                            reason="count")
        if self.received_bytes != h.total_bytes:
            raise WireError(f"stream carried {self.received_bytes} bytes, header announced {h.total_bytes}",
                            reason="count")
        if self.require_all and self.expected is not None:
            missing = sorted(set(self.expected) - self._seen - self.optional)
            if missing:
                raise WireError(f"FULL update lacks tensors {missing[:5]} (changed by earlier updates, or required)",
                               reason="count")
        if trailer.digest != self._digest.digest():
            raise WireError(
                f"{digest_name(self.header.digest_algorithm)} digest of the received data does not match "
                "the trailer", reason="digest",
            )
        self.finished = True

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
