"""Sender side of a weight update over gRPC (`RolloutService.UpdateWeights`); the rules are in
`rmsft.weight_wire.contract`, the receiver in `rmsft.weight_wire.receive`.

- `iter_weight_chunks`: header, pieces and trailer as `WeightChunk` messages (for callers that
  inspect or edit them: tests, the benchmark's comparison path).
- `encode_weight_stream`: the same stream as ready-made request bytes, what the learner sends.
  gRPC's generated stub takes messages and serializes them itself; for a 4 MiB piece that path
  copies the payload three times before gRPC's own send copy (the tensor view to `bytes`, those
  bytes into the message, the message into its serialized form). Here each piece is written as
  protobuf would write it, the payload copied once, straight from the tensor's memory; a
  channel's `stream_unary` with no request serializer sends the bytes as they are
  (`update_weights_raw`). The bytes are identical to `SerializeToString()` of
  `iter_weight_chunks`'s messages (`tests/rollout/test_wire_encode.py`), so the server cannot
  tell the two apart.
- `encode_planned_stream`: the same, with the header built from names and specs alone and the
  tensors produced lazily, one at a time (the learner's FULL export, which merges LoRA layers as
  it goes, so the merged model never exists in memory at once).

A tensor is read only until the next one is requested: each piece's payload is copied into its
request (which is also what the digest reads) before the producer is asked for the next tensor.
That lets a producer reuse or rewrite a tensor's memory once it moved on (the FULL export
restores a LoRA base weight in place after copying its merged value).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rmsft_protos import rollout_pb2

from rmsft.weight_wire.contract import (
    ADAPTER,
    DATA_TAG,
    DEFAULT_DIGEST,
    DEFAULT_FRAME_BYTES,
    FULL,
    PIECE_TAG,
    UPDATE_WEIGHTS_METHOD,
    PipelinedDigest,
    SyncMode,
    TensorSpec,
    WireError,
    dtype_name,
    new_hash,
)
from rmsft.weight_wire.version import NO_RUN, check_run_id

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import numpy.typing as npt
    import torch


def _flat_bytes(tensor: torch.Tensor) -> npt.NDArray[np.uint8]:
    """A uint8 numpy view of the tensor's bytes (CPU, contiguous); copies only when it must."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def stream_header(
    specs: Sequence[tuple[str, TensorSpec]],
    *,
    number: int,
    mode: SyncMode,
    run_id: str = NO_RUN,
    adapter_config_json: str = "",
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    digest: int = DEFAULT_DIGEST,
    relay_to: Sequence[str] = (),
) -> rollout_pb2.WeightHeader:
    """Check a stream's arguments and build its header from (name, spec) pairs alone: no tensor
    needs to exist yet. `relay_to`: the servers the receiver forwards the stream to (in order).

    `number` with `run_id` (the learner run announcing it; NO_RUN outside any run) is the weight version the
    header announces (rmsft.weight_wire.version).

    Raises ValueError on a bad frame size, mode, digest, run id, missing adapter config or duplicate
    names, in the caller, before anything is sent.
    """
    try:
        check_run_id(run_id)
    except WireError as e:
        raise ValueError(str(e)) from None
    new_hash(digest)  # an unknown algorithm fails here, not after the first frames went out
    if frame_bytes <= 0:
        raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
    if mode not in (FULL, ADAPTER):
        raise ValueError(f"mode must be FULL or ADAPTER, got {mode!r}")
    if mode == ADAPTER and not adapter_config_json:
        raise ValueError("ADAPTER sync needs adapter_config_json (the PEFT adapter_config.json text)")
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names in weight stream: {dup[:5]}")
    return rollout_pb2.WeightHeader(
        version=number,
        run_id=run_id,
        # protoc's stubs take an enum field as its class or name; protobuf takes any int (proto3 enums are open)
        mode=mode,  # type: ignore[arg-type]
        tensor_count=len(specs),
        total_bytes=sum(s.nbytes for _, s in specs),
        adapter_config_json=adapter_config_json,
        digest_algorithm=digest,  # type: ignore[arg-type]  # an int, as `mode` above
        relay_to=list(relay_to),
    )


def stream_header_and_specs(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    number: int,
    mode: SyncMode,
    run_id: str = NO_RUN,
    adapter_config_json: str = "",
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    digest: int = DEFAULT_DIGEST,
    relay_to: Sequence[str] = (),
) -> tuple[rollout_pb2.WeightHeader, list[tuple[str, torch.Tensor, TensorSpec]]]:
    """Check a stream's arguments and build its header: (header, [(name, tensor, spec)]).
    Every tensor is taken up front (see `encode_planned_stream` for a lazy producer)."""
    items = list(named_tensors)
    planned = [(n, t, TensorSpec(dtype_name(t.dtype), tuple(t.shape))) for n, t in items]
    header = stream_header(
        [(n, s) for n, _, s in planned],
        number=number,
        run_id=run_id,
        mode=mode,
        adapter_config_json=adapter_config_json,
        frame_bytes=frame_bytes,
        digest=digest,
        relay_to=relay_to,
    )
    return header, planned


def _checked(
    specs: Sequence[tuple[str, TensorSpec]], tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor, TensorSpec]]:
    """Pair a lazy producer's tensors with the specs the header announced; a tensor that differs
    would make the server reject the stream after it was sent, so it stops the stream here with
    the reason instead."""
    it = iter(tensors)
    for i, (want_name, spec) in enumerate(specs):
        try:
            name, tensor = next(it)
        except StopIteration:
            raise ValueError(f"weight stream producer ended after {i} of {len(specs)} announced tensors") from None
        got = TensorSpec(dtype_name(tensor.dtype), tuple(tensor.shape))
        if name != want_name or got != spec:
            raise ValueError(
                f"weight stream tensor {i} is {name!r} {got.dtype}{list(got.shape)}, the header announced "
                f"{want_name!r} {spec.dtype}{list(spec.shape)}"
            )
        yield name, tensor, spec
        del tensor  # not kept alive while the producer makes the next one
    for name, _ in it:
        raise ValueError(f"weight stream producer has more tensors than the {len(specs)} announced ({name!r})")


def iter_pieces(
    planned: Iterable[tuple[str, torch.Tensor, TensorSpec]], frame_bytes: int
) -> Iterator[tuple[str, TensorSpec, int, Any]]:
    """(name, spec, offset, payload) per piece, payload a uint8 numpy view of at most
    `frame_bytes` (no copy for a contiguous CPU tensor of the wire dtype). Each tensor is copied
    to the CPU only while its own pieces are produced, so the sender's extra memory is one
    tensor plus what the caller keeps of the frames. No reference to a tensor is left here when
    the next one is requested (a lazy producer frees or reuses it then)."""
    for name, tensor, spec in planned:
        flat = _flat_bytes(tensor)
        del tensor
        n = flat.shape[0]
        offset = 0
        # A zero-size tensor still gets one (empty) piece so the receiver sees its name/shape.
        while True:
            size = min(frame_bytes, n - offset)
            yield name, spec, offset, flat[offset : offset + size]
            offset += size
            if offset >= n:
                break
        del flat


def iter_weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    number: int,
    mode: SyncMode,
    run_id: str = NO_RUN,
    adapter_config_json: str = "",
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    digest: int = DEFAULT_DIGEST,
) -> Iterator[rollout_pb2.WeightChunk]:
    """Yield header, pieces and trailer for `named_tensors` as protobuf messages (for callers
    that inspect or edit them; the learner sends `encode_weight_stream`'s pre-serialized bytes,
    the same bytes with two fewer payload copies)."""
    header, planned = stream_header_and_specs(
        named_tensors,
        number=number,
        run_id=run_id,
        mode=mode,
        adapter_config_json=adapter_config_json,
        frame_bytes=frame_bytes,
        digest=digest,
    )
    yield rollout_pb2.WeightChunk(header=header)
    hasher = PipelinedDigest(header.digest_algorithm)
    for name, spec, offset, view in iter_pieces(planned, frame_bytes):
        data = view.tobytes()
        del view  # see iter_pieces: no reference to the tensor while the next one is made
        hasher.update(data)
        # Filling the nested message in place: building TensorPiece(...) and passing it to
        # WeightChunk(piece=...) copies the payload again (~30x slower per 4 MiB frame).
        chunk = rollout_pb2.WeightChunk()
        piece = chunk.piece
        piece.name, piece.dtype, piece.offset, piece.data = name, spec.dtype, offset, data
        piece.shape.extend(spec.shape)
        yield chunk
    yield rollout_pb2.WeightChunk(trailer=rollout_pb2.WeightTrailer(digest=hasher.digest()))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_PIECE_TAG = _varint(PIECE_TAG)
_DATA_TAG = _varint(DATA_TAG)


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
    number: int,
    mode: SyncMode,
    run_id: str = NO_RUN,
    adapter_config_json: str = "",
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    digest: int = DEFAULT_DIGEST,
    relay_to: Sequence[str] = (),
) -> tuple[rollout_pb2.WeightHeader, Iterator[bytes]]:
    """(header, serialized requests): header, pieces and the digest trailer of `named_tensors`.

    The arguments are checked and the header built now (a bad name or mode raises here, in the
    caller); the pieces are produced lazily, one frame at a time.
    """
    header, planned = stream_header_and_specs(
        named_tensors,
        number=number,
        run_id=run_id,
        mode=mode,
        adapter_config_json=adapter_config_json,
        frame_bytes=frame_bytes,
        digest=digest,
        relay_to=relay_to,
    )
    return header, _requests(header, planned, frame_bytes)


def encode_planned_stream(
    specs: Sequence[tuple[str, TensorSpec]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    number: int,
    mode: SyncMode,
    run_id: str = NO_RUN,
    adapter_config_json: str = "",
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    digest: int = DEFAULT_DIGEST,
    relay_to: Sequence[str] = (),
) -> tuple[rollout_pb2.WeightHeader, Iterator[bytes]]:
    """Like `encode_weight_stream`, with the header built from `specs` ((name, TensorSpec) in
    stream order) and `tensors` a lazy producer of the same names, dtypes and shapes, consumed
    one tensor at a time as the frames are sent. A tensor that differs from its spec, or a
    producer with too few or too many tensors, raises ValueError from the request iterator.
    Same bytes as `encode_weight_stream` of the same tensors."""
    specs = list(specs)
    header = stream_header(
        specs,
        number=number,
        run_id=run_id,
        mode=mode,
        adapter_config_json=adapter_config_json,
        frame_bytes=frame_bytes,
        digest=digest,
        relay_to=relay_to,
    )
    return header, _requests(header, _checked(specs, tensors), frame_bytes)


def _requests(
    header: rollout_pb2.WeightHeader, planned: Iterable[tuple[str, torch.Tensor, TensorSpec]], frame_bytes: int
) -> Iterator[bytes]:
    yield rollout_pb2.WeightChunk(header=header).SerializeToString()
    hasher = PipelinedDigest(header.digest_algorithm)
    try:
        for name, spec, offset, payload in iter_pieces(planned, frame_bytes):
            size = memoryview(payload).nbytes
            request = encode_piece(name, spec, offset, payload)
            del payload  # no view of the tensor survives into the next tensor's production
            if size:
                # The digest reads the request's copy of the payload (its last `size` bytes), on
                # its own thread while the next frame is made: a view of the tensor would keep
                # the tensor alive, and readable only as long as its producer leaves it alone.
                hasher.update(memoryview(request)[-size:])
            yield request
        trailer = rollout_pb2.WeightTrailer(digest=hasher.digest())
    finally:
        hasher.close()
    yield rollout_pb2.WeightChunk(trailer=trailer).SerializeToString()


def update_weights_raw(channel: Any) -> Any:
    """`UpdateWeights` on `channel` taking pre-serialized request bytes (from
    `encode_weight_stream`) and returning an `UpdateReply`."""
    return channel.stream_unary(
        UPDATE_WEIGHTS_METHOD, request_serializer=None, response_deserializer=rollout_pb2.UpdateReply.FromString
    )
