"""Wire format round trips and every framing rule the receiver enforces (no server needed)."""

from __future__ import annotations

import os

import pytest
import torch
from rmsft_protos import rollout_pb2

from rmsft.weight_wire import (
    ADAPTER,
    FULL,
    StreamReader,
    TensorSpec,
    WireError,
    iter_weight_chunks,
    torch_dtype,
)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(37, 11, generator=g)),
        ("b.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("c.scalar", torch.tensor(3.5)),
        ("d.idx", torch.arange(9, dtype=torch.int64).reshape(3, 3).t()),  # non-contiguous
    ]


def _receive(chunks, reader: StreamReader) -> dict[str, torch.Tensor]:
    buf = None
    for chunk in chunks:
        dest = reader.feed(chunk)
        if chunk.WhichOneof("kind") == "header":
            buf = bytearray(chunk.header.total_bytes)
        if dest is not None:
            data = chunk.piece.data
            buf[dest : dest + len(data)] = data
    out = {}
    for t in reader.tensors:
        raw = bytes(buf[t.start : t.start + t.spec.nbytes])
        out[t.name] = torch.frombuffer(bytearray(raw), dtype=torch_dtype(t.spec.dtype)).reshape(t.spec.shape)
    return out


@pytest.mark.parametrize("frame", [1, 7, 64, 1 << 20])
def test_round_trip_any_frame_size(frame: int) -> None:
    src = _tensors()
    chunks = list(iter_weight_chunks(src, number=3, mode=FULL, frame_bytes=frame))
    header = chunks[0].header
    assert header.version == 3 and header.tensor_count == 4
    assert header.total_bytes == sum(t.numel() * t.element_size() for _, t in src)
    assert all(len(c.piece.data) <= frame for c in chunks if c.WhichOneof("kind") == "piece")
    reader = StreamReader(max_frame_bytes=frame)
    got = _receive(chunks, reader)
    assert reader.finished
    for name, t in src:
        assert got[name].dtype == t.dtype
        assert torch.equal(got[name], t.contiguous())


def _expected() -> dict[str, TensorSpec]:
    return {
        "a.weight": TensorSpec("F32", (37, 11)),
        "b.bias": TensorSpec("BF16", (5,)),
        "c.scalar": TensorSpec("F32", ()),
        "d.idx": TensorSpec("I64", (3, 3)),
    }


def test_reader_accepts_matching_model_table() -> None:
    chunks = iter_weight_chunks(_tensors(), number=1, mode=FULL, frame_bytes=100)
    reader = StreamReader(expected=_expected(), require_all=True, max_frame_bytes=100)
    _receive(chunks, reader)
    assert reader.finished


def _bad(mutate, **reader_kw) -> WireError:
    chunks = list(iter_weight_chunks(_tensors(), number=1, mode=FULL, frame_bytes=100))
    chunks = mutate(chunks)
    reader = StreamReader(expected=_expected(), require_all=True, **reader_kw)
    with pytest.raises(WireError) as info:
        _receive(chunks, reader)
    return info.value


def test_wrong_shape_is_rejected() -> None:
    def mutate(chunks):
        chunks[1].piece.shape[:] = [11, 37]
        return chunks

    err = _bad(mutate)
    assert err.reason == "shape" and "a.weight" in str(err)


def test_unknown_name_is_rejected() -> None:
    def mutate(chunks):
        for c in chunks:
            if c.WhichOneof("kind") == "piece" and c.piece.name == "b.bias":
                c.piece.name = "zzz.weight"
        return chunks

    err = _bad(mutate)
    assert err.reason == "name" and "zzz.weight" in str(err)


def test_bad_digest_is_rejected() -> None:
    def mutate(chunks):
        chunks[-1].trailer.digest = b"\0" * 32
        return chunks

    assert _bad(mutate).reason == "digest"


def test_flipped_byte_is_caught_by_digest() -> None:
    def mutate(chunks):
        data = bytearray(chunks[2].piece.data)
        data[0] ^= 1
        chunks[2].piece.data = bytes(data)
        return chunks

    assert _bad(mutate).reason == "digest"


def test_oversize_frame_is_rejected() -> None:
    err = _bad(lambda c: c, max_frame_bytes=50)
    assert err.reason == "frame_size"


def test_truncated_stream_and_missing_tensor() -> None:
    # Dropping the last tensor's pieces: count mismatch at the trailer.
    def drop_last(chunks):
        return [c for c in chunks if not (c.WhichOneof("kind") == "piece" and c.piece.name == "d.idx")]

    assert _bad(drop_last).reason == "count"

    def drop_piece(chunks):
        return chunks[:2] + chunks[3:]

    with pytest.raises(WireError):
        _receive(drop_piece(list(iter_weight_chunks(_tensors(), number=1, mode=FULL, frame_bytes=100))), StreamReader())


def test_full_header_count_must_match_model() -> None:
    chunks = iter_weight_chunks(_tensors()[:3], number=1, mode=FULL)
    with pytest.raises(WireError, match="every checkpoint tensor"):
        _receive(chunks, StreamReader(expected=_expected(), require_all=True))


def test_encoder_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="adapter_config_json"):
        list(iter_weight_chunks(_tensors(), number=1, mode=ADAPTER))
    with pytest.raises(ValueError, match="duplicate"):
        list(iter_weight_chunks(_tensors() + _tensors()[:1], number=1, mode=FULL))


def test_piece_before_header_and_data_after_trailer() -> None:
    chunks = list(iter_weight_chunks(_tensors(), number=1, mode=FULL))
    with pytest.raises(WireError, match="before the header"):
        StreamReader().feed(chunks[1])
    reader = StreamReader()
    _receive(chunks, reader)
    with pytest.raises(WireError, match="after the trailer"):
        reader.feed(rollout_pb2.WeightChunk(header=chunks[0].header))


@pytest.mark.parametrize("algorithm", [rollout_pb2.SHA256, rollout_pb2.BLAKE3])
def test_digest_algorithms_round_trip_and_catch_a_flipped_byte(algorithm: int) -> None:
    import hashlib

    import blake3

    src = _tensors()
    chunks = list(iter_weight_chunks(src, number=1, mode=FULL, frame_bytes=64, digest=algorithm))
    assert chunks[0].header.digest_algorithm == algorithm
    data = b"".join(c.piece.data for c in chunks if c.WhichOneof("kind") == "piece")
    want = (hashlib.sha256 if algorithm == rollout_pb2.SHA256 else blake3.blake3)(data).digest()
    assert chunks[-1].trailer.digest == want  # independent of the pipelined hasher
    reader = StreamReader()
    got = _receive(chunks, reader)
    assert reader.finished and torch.equal(got["a.weight"], src[0][1])

    flipped = list(iter_weight_chunks(src, number=1, mode=FULL, frame_bytes=64, digest=algorithm))
    piece = flipped[1].piece
    piece.data = bytes([piece.data[0] ^ 1]) + piece.data[1:]
    with pytest.raises(WireError, match=f"{rollout_pb2.DigestAlgorithm.Name(algorithm)} digest") as e:
        _receive(flipped, StreamReader())
    assert e.value.reason == "digest"


def test_receiver_hashes_with_the_algorithm_the_header_names() -> None:
    """A SHA-256 trailer on a stream announced as BLAKE3 does not pass."""
    import hashlib

    chunks = list(iter_weight_chunks(_tensors(), number=1, mode=FULL, digest=rollout_pb2.BLAKE3))
    data = b"".join(c.piece.data for c in chunks if c.WhichOneof("kind") == "piece")
    chunks[-1].trailer.digest = hashlib.sha256(data).digest()
    with pytest.raises(WireError, match="BLAKE3 digest"):
        _receive(chunks, StreamReader())


def test_unknown_digest_algorithm_is_refused_by_both_ends() -> None:
    with pytest.raises(ValueError, match="unknown digest algorithm 7"):
        list(iter_weight_chunks(_tensors(), number=1, mode=FULL, digest=7))
    chunks = list(iter_weight_chunks(_tensors(), number=1, mode=FULL))
    chunks[0].header.digest_algorithm = 7
    with pytest.raises(WireError, match="digest_algorithm 7"):
        _receive(chunks, StreamReader())


# -- weight versions: (run id, number) ----------------------------------------------------------


def test_the_header_carries_the_run_id_on_both_transports(tmp_path) -> None:
    """The run id announced with a version arrives with it: grpc (message and pre-serialized paths, as the
    receiver parses them) and shm (the header that names the shared file, the file checked as a stream)."""
    from rmsft.weight_wire import (
        PieceFrame,
        SharedUpdate,
        WeightVersion,
        check_shared,
        decode_chunk,
        dtype_name,
        encode_weight_stream,
        open_shared,
        version_of,
    )

    want = WeightVersion("3fa2c1d09e77", 22)
    src = _tensors()
    chunks = list(iter_weight_chunks(src, number=22, run_id=want.run_id, mode=FULL, frame_bytes=64))
    reader = StreamReader()
    _receive(chunks, reader)
    assert reader.finished and version_of(reader.header) == want
    header, requests = encode_weight_stream(src, number=22, run_id=want.run_id, mode=FULL, frame_bytes=64)
    assert version_of(header) == want
    reader = StreamReader()  # what the server does with the bytes: its deserializer, then the reader
    for raw in requests:
        chunk = decode_chunk(raw)
        if isinstance(chunk, PieceFrame):  # a piece's payload is a view, as the stager reads it
            reader.on_piece(chunk.piece, chunk.data)
        else:
            reader.feed(chunk)
    assert reader.finished and version_of(reader.header) == want

    specs = [(n, TensorSpec(dtype_name(t.dtype), tuple(t.shape))) for n, t in src]
    update = SharedUpdate.create(tmp_path, specs, number=22, run_id=want.run_id, mode=FULL)
    try:
        digest = update.write(src)
        wire = rollout_pb2.WeightChunk.FromString(rollout_pb2.WeightChunk(header=update.header).SerializeToString())
        assert version_of(wire.header) == want
        reader = StreamReader()
        reader.on_header(wire.header)
        fd = open_shared(str(tmp_path), wire.header)
        try:
            check_shared(fd, wire.header, rollout_pb2.WeightTrailer(digest=digest), reader)
        finally:
            os.close(fd)
        assert reader.finished and version_of(reader.header) == want
    finally:
        update.remove()


@pytest.mark.parametrize("run_id", ["bad id", 'q"uote', "-dash-first", "x" * 65, "ü"])
def test_a_run_id_that_cannot_go_into_a_log_line_or_a_label_is_refused_by_both_ends(run_id: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        list(iter_weight_chunks(_tensors(), number=1, run_id=run_id, mode=FULL))
    chunks = list(iter_weight_chunks(_tensors(), number=1, run_id="ok", mode=FULL))
    chunks[0].header.run_id = run_id
    with pytest.raises(WireError, match="run id") as err:
        StreamReader().feed(chunks[0])
    assert err.value.code == "INVALID_ARGUMENT" and err.value.reason == "run_id"


def test_weight_version_is_the_pair_on_every_message_that_carries_one() -> None:
    from rmsft.weight_wire import FRESH, NO_RUN, WeightVersion, mismatch_message, new_run_id, set_version, version_of

    v = WeightVersion("3fa2c1d09e77", 22)
    for message in (
        rollout_pb2.WeightHeader(),
        rollout_pb2.UpdateReply(),
        rollout_pb2.RelayOutcome(),
        rollout_pb2.StatusReply(),
        rollout_pb2.GenerateResponse(),
        rollout_pb2.Completion(),
        rollout_pb2.GenerateRequest(),
    ):
        assert version_of(type(message).FromString(set_version(message, v).SerializeToString())) == v
    assert version_of(rollout_pb2.GenerateRequest()) is None  # not fenced
    assert version_of(set_version(rollout_pb2.GenerateRequest(), FRESH)) == FRESH  # fenced to v0 of no run
    assert version_of(rollout_pb2.StatusReply()) == FRESH == WeightVersion(NO_RUN, 0)
    with pytest.raises(TypeError, match="carries no weight version"):
        version_of(rollout_pb2.Prompt())
    assert (str(v), v.describe(), str(FRESH)) == ("v22 of run 3fa2c1d09e77", "22 of run 3fa2c1d09e77", "v0 of no run")
    assert v != WeightVersion("9b0e5d2c4a11", 22) and v != WeightVersion(v.run_id, 21)
    assert mismatch_message(WeightVersion("9b0e5d2c4a11", 22), v) == (
        "expected weight version 22 of run 9b0e5d2c4a11, server has 22 of run 3fa2c1d09e77 (same number, another "
        "run's weights)"
    )
    ids = {new_run_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 12 and int(i, 16) >= 0 for i in ids)
