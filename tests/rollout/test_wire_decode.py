"""`decode_chunk` (the server's zero-copy UpdateWeights deserializer) against protobuf's parser.

Equivalence is the point: for every message the fast path must yield the same fields as
`WeightChunk.FromString`, and whatever it does not recognise must go to protobuf unchanged
(so malformed bytes raise the same DecodeError as before).
"""

from __future__ import annotations

import os

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from rmsft_protos import rollout_pb2

from rmsft.weight_wire import FULL, PieceFrame, decode_chunk, iter_weight_chunks
from rollout_engine.staged_file import iter_staged_tensors
from rollout_svc.staging import Stager


def _fields(chunk) -> tuple:
    if isinstance(chunk, PieceFrame):
        p = chunk.piece
        assert p.data == b"", "the fast path must leave the payload out of the parsed metadata"
        return ("piece", p.name, p.dtype, tuple(p.shape), p.offset, bytes(chunk.data))
    kind = chunk.WhichOneof("kind")
    if kind == "piece":
        p = chunk.piece
        return ("piece", p.name, p.dtype, tuple(p.shape), p.offset, p.data)
    return (kind, getattr(chunk, kind).SerializeToString(deterministic=True))


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(max_size=40),
    dtype=st.sampled_from(["F32", "BF16", "U8", ""]),
    shape=st.lists(st.integers(0, 2**40), max_size=5),
    offset=st.integers(0, 2**63 - 1),
    data=st.binary(max_size=300),
)
def test_piece_fields_equal_protobuf(name, dtype, shape, offset, data):
    msg = rollout_pb2.WeightChunk()
    msg.piece.name, msg.piece.dtype, msg.piece.offset, msg.piece.data = name, dtype, offset, data
    msg.piece.shape.extend(shape)
    raw = msg.SerializeToString()
    got = decode_chunk(raw)
    assert _fields(got) == _fields(rollout_pb2.WeightChunk.FromString(raw))
    assert got.WhichOneof("kind") == "piece"
    # Only a piece with a payload takes the fast path (an empty payload is not on the wire).
    assert isinstance(got, PieceFrame) == bool(data)


def test_header_trailer_and_odd_layouts_fall_back_to_protobuf():
    header = rollout_pb2.WeightChunk(header=rollout_pb2.WeightHeader(version=3, mode=FULL, tensor_count=1))
    trailer = rollout_pb2.WeightChunk(trailer=rollout_pb2.WeightTrailer(digest=b"x" * 32))
    piece = rollout_pb2.WeightChunk()
    piece.piece.name, piece.piece.data = "w", b"abc"
    other = rollout_pb2.WeightChunk()
    other.piece.name, other.piece.data = "w", b"zzzz"
    odd = [
        header.SerializeToString(),
        trailer.SerializeToString(),
        # Two piece fields in one message: protobuf merges them (last data wins).
        piece.SerializeToString() + other.SerializeToString(),
        # Piece followed by a header: the oneof keeps the header.
        piece.SerializeToString() + header.SerializeToString(),
        # Unknown top-level field after the piece.
        piece.SerializeToString() + b"\x28\x07",
        b"",
    ]
    for raw in odd:
        got = decode_chunk(raw)
        assert not isinstance(got, PieceFrame)
        assert got == rollout_pb2.WeightChunk.FromString(raw)


def test_unknown_fields_inside_a_piece_are_kept_out_of_the_payload():
    msg = rollout_pb2.WeightChunk()
    msg.piece.name, msg.piece.data = "w", b"payload"
    raw = msg.SerializeToString()
    inner = raw[2:] + b"\x30\x05" + b"\x3d\x01\x02\x03\x04"  # varint field 6, fixed32 field 7
    raw2 = b"\x12" + bytes([len(inner)]) + inner
    got = decode_chunk(raw2)
    assert isinstance(got, PieceFrame)
    assert bytes(got.data) == b"payload" and got.piece.name == "w"


@pytest.mark.parametrize("cut", [1, 3, 10, -1])
def test_truncated_bytes_raise_like_protobuf(cut):
    msg = rollout_pb2.WeightChunk()
    msg.piece.name, msg.piece.dtype, msg.piece.data = "layer.weight", "F32", os.urandom(64)
    raw = msg.SerializeToString()[:cut]
    with pytest.raises(DecodeError):
        rollout_pb2.WeightChunk.FromString(raw)
    with pytest.raises(DecodeError):
        decode_chunk(raw)


def test_stager_stages_decoded_frames_identically(tmp_path):
    torch.manual_seed(0)
    tensors = [("a", torch.randn(37, 5)), ("b", torch.arange(10, dtype=torch.int64)), ("c", torch.empty(0, 3))]
    chunks = list(iter_weight_chunks(tensors, number=7, mode=FULL, frame_bytes=64))
    decoded = [decode_chunk(c.SerializeToString()) for c in chunks]
    assert any(isinstance(c, PieceFrame) for c in decoded)
    staged = Stager(str(tmp_path), 1 << 20).stage(iter(decoded), lambda h: (None, set(), False))
    try:
        got = dict(iter_staged_tensors(staged.index_path))
        assert set(got) == {"a", "b", "c"}
        for name, t in tensors:
            assert torch.equal(got[name], t), name
    finally:
        staged.cleanup()


def test_stager_rejects_a_corrupted_decoded_payload(tmp_path):
    from rmsft.weight_wire import WireError

    tensors = [("a", torch.randn(64))]
    raws = [c.SerializeToString() for c in iter_weight_chunks(tensors, number=1, mode=FULL, frame_bytes=64)]
    bad = bytearray(raws[1])
    bad[-1] ^= 0xFF  # last payload byte of the first piece
    raws[1] = bytes(bad)
    with pytest.raises(WireError, match="digest of the received data"):
        Stager(str(tmp_path), 1 << 20).stage((decode_chunk(r) for r in raws), lambda h: (None, set(), False))
    assert not list(tmp_path.iterdir()), "a refused stream leaves no staging files"
