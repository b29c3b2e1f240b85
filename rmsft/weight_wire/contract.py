"""The rules both ends of a weight update share: dtypes, tensor specs, digests, errors, limits,
and the protobuf field tags the hand-written encoder and decoder use (read from the descriptor,
so a renumbered field cannot silently desynchronise them). See the package docstring for the
shapes of an update on each transport.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rmsft_protos import rollout_pb2

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import numpy.typing as npt
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
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_TORCH_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def torch_dtype(name: str) -> torch.dtype:
    """safetensors dtype name (F32, BF16, ...) -> torch dtype."""
    import torch

    try:
        dtype: torch.dtype = getattr(torch, _TORCH_NAMES[name])
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPE_SIZES)}") from None
    return dtype


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


class Hasher(Protocol):
    """What a digest is computed with: hashlib's and blake3's hash objects alike."""

    # Any: a buffer (numpy declares its arrays buffers only from Python 3.12 on, collections.abc.Buffer)
    def update(self, data: Any, /) -> object: ...
    def digest(self) -> bytes: ...


def new_hash(algorithm: int, parallel: bool = False) -> Hasher:
    """A fresh hash object (`update`/`digest`) for a `DigestAlgorithm` value. `parallel`: BLAKE3
    hashes each large `update` on every core (a tree hash: the same digest), for a reader that has
    the whole update in memory already (a shm file), not one receiving it frame by frame."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == BLAKE3:
        import blake3  # lazy: the operator image imports rmsft without the data-plane packages

        return blake3.blake3(max_threads=blake3.blake3.AUTO) if parallel else blake3.blake3()
    raise ValueError(f"unknown digest algorithm {algorithm}; expected SHA256 (0) or BLAKE3 (1)")


class PipelinedDigest:
    """A digest computed on a helper thread, one frame behind the caller.

    hashlib and blake3 release the GIL on large buffers, so hashing frame k overlaps with
    producing or receiving frame k+1; at most one frame waits, so memory stays bounded.
    """

    _MIN_THREADED = 1 << 20  # below this, a thread hop costs more than it saves

    def __init__(self, algorithm: int = DEFAULT_DIGEST, parallel: bool = False) -> None:
        self._h = new_hash(algorithm, parallel)
        self._pool: Any = None
        self._pending: Any = None

    def update(self, data: bytes | memoryview | npt.NDArray[np.uint8]) -> None:
        """Hash `data` next (a flat uint8 array's len is its byte count, as a bytes' or a byte memoryview's)."""
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

    def settle(self) -> None:
        """Wait until every byte handed to `update` was hashed (its buffer may then be reused)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

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


# -- protobuf field tags (wire type 2: length-delimited) of the fields the fast paths write or parse


def _length_delimited_tag(message: Any, field_name: str) -> int:
    f = message.DESCRIPTOR.fields_by_name[field_name]
    if f.type not in (f.TYPE_MESSAGE, f.TYPE_BYTES, f.TYPE_STRING):
        raise TypeError(f"{message.DESCRIPTOR.name}.{field_name} is not length-delimited")
    tag: int = (f.number << 3) | 2
    return tag


PIECE_TAG = _length_delimited_tag(rollout_pb2.WeightChunk, "piece")  # WeightChunk.piece
DATA_TAG = _length_delimited_tag(rollout_pb2.TensorPiece, "data")  # TensorPiece.data
DATA_FIELD = rollout_pb2.TensorPiece.DESCRIPTOR.fields_by_name["data"].number
UPDATE_WEIGHTS_METHOD = "/" + rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name + "/UpdateWeights"
