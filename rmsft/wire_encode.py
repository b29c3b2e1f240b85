"""Sender-side serializer of a weight stream: `UpdateWeights` requests as ready-made bytes.

gRPC's generated stub takes `WeightChunk` messages and serializes them itself. For a 4 MiB piece
that path copies the payload three times before gRPC's own send copy: the tensor view to `bytes`,
those bytes into the message (upb stores its own copy) and the message into its serialized form.
Here each piece is written as protobuf would write it, with the payload copied once, straight from
the tensor's memory into the request bytes; a channel's `stream_unary` with no request serializer
sends them as they are (`update_weights_raw`). The bytes are identical to
`WeightChunk.SerializeToString()` of `rmsft.weights_wire.iter_weight_chunks`'s messages
(`tests/rollout/test_wire_encode.py`), so the server cannot tell the two apart.

Kept apart from `rmsft.weights_wire` (the stream's rules, both ends) because it knows protobuf's
encoding of one message shape, which only the sender needs; `rmsft.wire_decode` is its mirror.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from rmsft_protos import rollout_pb2

from rmsft.weights_wire import (
    DEFAULT_FRAME_BYTES,
    PipelinedDigest,
    SyncMode,
    TensorSpec,
    iter_pieces,
    plan_weight_stream,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

_PIECE_TAG = bytes([(2 << 3) | 2])  # WeightChunk.piece, length-delimited
_DATA_TAG = bytes([(5 << 3) | 2])  # TensorPiece.data, length-delimited
UPDATE_WEIGHTS_METHOD = "/" + rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name + "/UpdateWeights"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_piece(name: str, spec: TensorSpec, offset: int, payload: Any) -> bytes:
    """One `WeightChunk{piece}` as protobuf serializes it; `payload` is any contiguous buffer and
    is copied exactly once."""
    meta = rollout_pb2.TensorPiece(name=name, dtype=spec.dtype, shape=spec.shape, offset=offset).SerializeToString()
    size = memoryview(payload).nbytes
    # proto3 leaves an empty bytes field out (a zero-size tensor's piece), and so must we.
    data_field = _DATA_TAG + _varint(size) if size else b""
    prefix = _PIECE_TAG + _varint(len(meta) + len(data_field) + size) + meta + data_field
    return b"".join((prefix, payload)) if size else prefix


def encode_weight_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    mode: SyncMode,
    adapter_config_json: str = "",
    frame_bytes: int = DEFAULT_FRAME_BYTES,
) -> tuple[rollout_pb2.WeightHeader, Iterator[bytes]]:
    """(header, serialized requests): header, pieces and the sha256 trailer of `named_tensors`.

    The arguments are checked and the header built now (a bad name or mode raises here, in the
    caller); the pieces are produced lazily, one frame at a time.
    """
    header, planned = plan_weight_stream(
        named_tensors, version=version, mode=mode, adapter_config_json=adapter_config_json,
        frame_bytes=frame_bytes,
    )  # fmt: skip

    def requests() -> Iterator[bytes]:
        yield rollout_pb2.WeightChunk(header=header).SerializeToString()
        digest = PipelinedDigest()
        try:
            for name, spec, offset, payload in iter_pieces(planned, frame_bytes):
                # The payload is a view of the tensor: hashed on the digest's thread while the
                # request copy is made here (both only read it).
                digest.update(payload)
                yield encode_piece(name, spec, offset, payload)
            trailer = rollout_pb2.WeightTrailer(sha256=digest.digest())
        finally:
            digest.close()
        yield rollout_pb2.WeightChunk(trailer=trailer).SerializeToString()

    return header, requests()


def update_weights_raw(channel: Any) -> Any:
    """`UpdateWeights` on `channel` taking pre-serialized request bytes (from
    `encode_weight_stream`) and returning an `UpdateReply`."""
    return channel.stream_unary(
        UPDATE_WEIGHTS_METHOD, request_serializer=None, response_deserializer=rollout_pb2.UpdateReply.FromString
    )
