"""`encode_weight_stream` (the learner's pre-serialized UpdateWeights requests) against protobuf.

The server parses whatever arrives with protobuf's rules, so the hand-written encoder must produce
exactly the bytes `WeightChunk.SerializeToString()` produces for the same stream, and a real gRPC
server must accept them through the raw (serializer-less) method.
"""

from __future__ import annotations

import hashlib
from concurrent import futures

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rmsft_protos import rollout_pb2, rollout_pb2_grpc

from rmsft.weight_wire import (
    ADAPTER,
    FULL,
    PieceFrame,
    StreamReader,
    TensorSpec,
    decode_chunk,
    encode_piece,
    encode_weight_stream,
    iter_weight_chunks,
    update_weights_raw,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@st.composite
def named_tensors(draw) -> list[tuple[str, torch.Tensor]]:
    n = draw(st.integers(0, 5))
    names = draw(st.lists(st.text(min_size=1, max_size=20), min_size=n, max_size=n, unique=True))
    out = []
    for i, name in enumerate(names):
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        g = torch.Generator().manual_seed(i)
        t = (torch.randn(shape, generator=g) * 50).to(dtype)
        if draw(st.booleans()) and t.dim() == 2:
            t = t.t()  # non-contiguous: the encoder must send C order like the message path
        out.append((name, t))
    return out


@settings(max_examples=150, deadline=None)
@given(
    tensors=named_tensors(),
    frame=st.integers(1, 200),
    version=st.integers(0, 2**63),
    adapter=st.booleans(),
    run_id=st.sampled_from(["", "3fa2c1d09e77", "run.A_b-" + "x" * 55]),
)
def test_encoded_stream_is_byte_identical_to_protobuf(tensors, frame, version, adapter, run_id):
    kw = dict(
        number=version,
        run_id=run_id,
        mode=ADAPTER if adapter else FULL,
        frame_bytes=frame,
        adapter_config_json='{"r": 8}' if adapter else "",
    )
    want = [c.SerializeToString() for c in iter_weight_chunks(tensors, **kw)]
    header, requests = encode_weight_stream(tensors, **kw)
    got = list(requests)
    assert got == want
    assert rollout_pb2.WeightChunk(header=header).SerializeToString() == want[0]


@settings(max_examples=100, deadline=None)
@given(
    name=st.text(max_size=30),
    shape=st.lists(st.integers(0, 2**40), max_size=4),
    offset=st.integers(0, 2**63 - 1),
    data=st.binary(max_size=400),
)
def test_piece_round_trips_through_both_parsers(name, shape, offset, data):
    raw = encode_piece(name, TensorSpec("U8", tuple(shape)), offset, memoryview(data))
    msg = rollout_pb2.WeightChunk.FromString(raw)
    assert (msg.piece.name, tuple(msg.piece.shape), msg.piece.offset, msg.piece.data) == (
        name,
        tuple(shape),
        offset,
        data,
    )
    fast = decode_chunk(raw)
    assert bytes(fast.data if isinstance(fast, PieceFrame) else fast.piece.data) == data


def test_bad_arguments_raise_in_the_caller():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="duplicate tensor names"):
        encode_weight_stream([("w", t), ("w", t)], number=1, mode=FULL)
    with pytest.raises(ValueError, match="adapter_config_json"):
        encode_weight_stream([("w", t)], number=1, mode=ADAPTER)
    with pytest.raises(ValueError, match="frame_bytes"):
        encode_weight_stream([("w", t)], number=1, mode=FULL, frame_bytes=0)


class _Recorder(rollout_pb2_grpc.RolloutServiceServicer):
    """Receives a stream with the generated (protobuf) deserializer and checks it like a server."""

    def __init__(self) -> None:
        self.tensors: dict[str, bytes] = {}

    def UpdateWeights(self, request_iterator, context):
        reader = StreamReader()
        buf = bytearray()
        for chunk in request_iterator:
            dest = reader.feed(chunk)
            if dest is not None:
                data = chunk.piece.data
                buf[dest : dest + len(data)] = data
        self.tensors = {t.name: bytes(buf[t.start : t.start + t.spec.nbytes]) for t in reader.tensors}
        return rollout_pb2.UpdateReply(version=reader.header.version, bytes_received=reader.received_bytes)


def test_raw_call_is_accepted_by_a_protobuf_server():
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tensors = [("a", torch.randn(300, 7)), ("b", torch.arange(1000, dtype=torch.int64)), ("c", torch.zeros(0))]
        header, requests = encode_weight_stream(tensors, number=9, mode=FULL, frame_bytes=1000)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = update_weights_raw(channel)(requests, timeout=30)
        assert reply.version == 9 and reply.bytes_received == header.total_bytes
        for name, t in tensors:  # the digest was verified by StreamReader; compare the bytes too
            got, want = recorder.tensors[name], t.contiguous().view(torch.uint8).numpy().tobytes()
            assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest()
    finally:
        server.stop(None)
