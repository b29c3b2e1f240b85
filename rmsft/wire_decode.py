"""Server-side zero-copy deserializer of `UpdateWeights` messages (see `decode_chunk`).

Kept apart from `rmsft.weights_wire` (the stream's rules, both ends) because it knows protobuf's
encoding of one message shape, which only the receiving server needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rmsft_protos import rollout_pb2


@dataclass
class PieceFrame:
    """A received piece whose `data` is a view into the gRPC message bytes (no copy).

    `piece` is the `TensorPiece` with every field but `data` (parsed by protobuf); it quacks like
    a `WeightChunk` holding that piece so the receiver treats both alike.
    """

    piece: Any
    data: memoryview

    def WhichOneof(self, _group: str) -> str:  # noqa: N802 - protobuf's spelling
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


_PIECE_TAG = (2 << 3) | 2  # WeightChunk.piece, length-delimited
_DATA_FIELD = 5  # TensorPiece.data


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
        if len(buf) < 2 or buf[0] != _PIECE_TAG:
            raise IndexError("not a lone piece")
        n, start = _varint(buf, 1)
        end = start + n
        if end != len(buf):
            raise IndexError("more than one field")
        pos, data_span = start, None
        while pos < end:
            field_start = pos
            tag, pos = _varint(buf, pos)
            if tag >> 3 == _DATA_FIELD and tag & 7 == 2:
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
        return rollout_pb2.WeightChunk.FromString(raw)
    field_start, data_start, data_end = data_span
    meta = rollout_pb2.TensorPiece.FromString(bytes(buf[start:field_start]) + bytes(buf[data_end:end]))
    return PieceFrame(meta, buf[data_start:data_end])
