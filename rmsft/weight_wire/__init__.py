"""The weight-update contract between the learner and the rollout servers, both halves in one place.

An update (`RolloutService.UpdateWeights`, a client stream of `WeightChunk`s answered by one
`UpdateReply`) is one `WeightHeader`, then the tensors' bytes, then one `WeightTrailer`. Two
transports carry the bytes; everything else is common:

- **grpc**: the bytes travel in the stream as `TensorPiece`s. Tensors one after the other; the
  pieces of one tensor consecutive and in byte order (`offset` = bytes of that tensor already
  sent), each at most `frame_bytes` long and repeating name/dtype/shape (so a receiver validates
  on the first piece without buffering). `header.relay_to` may name more servers: the receiver
  forwards the same stream to the first of them with the rest of the list (a relay), so the
  learner sends the bytes once for the whole pool; the reply's `relayed` says what each answered.
- **shm**: the learner writes the bytes once into a file in node-local shared memory (the
  `shared_file` of the header names it and lists its tensors, back to back from byte 0); the
  stream carries no pieces. Each server checks the file against the same rules by reading it as
  if it were the pieces of a stream.

Every update announces a weight version, `header.run_id` with `header.version`: the pair is what
the server reports once the update applied, and what a fenced Generate must name (see `version`).

Common rules: `header.tensor_count` / `header.total_bytes` count the tensors and their raw bytes
(C order, the tensor's own dtype, little-endian as torch stores it). The trailer holds a digest
over every tensor byte in stream (file) order with the hash the header names (`digest_algorithm`:
BLAKE3, what rmsft sends, or SHA256, the proto default); nothing reaches the engine before the
digest matched. The server refuses with a gRPC status whose code says what to do (see
`WireError`): INVALID_ARGUMENT for a stream that breaks these rules or does not fit the model,
RESOURCE_EXHAUSTED when it cannot stage, FAILED_PRECONDITION when it cannot take this kind of
update, ABORTED when another update is in progress.

- `contract`: the rules (dtypes, `TensorSpec`, digests, `WireError`, limits, field tags read from
  the protobuf descriptor);
- `version`: what a weight version is, `WeightVersion` (the announcing learner run's id and a
  number), and the fields of every message that carries one (`version_of` / `set_version`);
- `send`: the learner's encoder (grpc) and `shared`: the shared-file writer and reader (shm);
- `receive`: the server's `StreamReader` and zero-copy deserializer.

No gRPC server logic here; torch is imported lazily (the operator image imports `rmsft` without it).
"""

from rmsft.weight_wire.contract import (
    ADAPTER,
    BLAKE3,
    DEFAULT_DIGEST,
    DEFAULT_FRAME_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    DTYPE_SIZES,
    FULL,
    SHA256,
    PipelinedDigest,
    SyncMode,
    TensorSpec,
    WireError,
    digest_name,
    dtype_name,
    new_hash,
    torch_dtype,
)
from rmsft.weight_wire.receive import PieceFrame, StagedTensor, StreamReader, decode_chunk
from rmsft.weight_wire.send import (
    encode_piece,
    encode_planned_stream,
    encode_weight_stream,
    iter_weight_chunks,
    stream_header,
    stream_header_and_specs,
    update_weights_raw,
)
from rmsft.weight_wire.shared import (
    SHARED_DIR_ENV,
    SharedSpaceError,
    SharedUpdate,
    check_shared,
    open_shared,
    shared_dir_from_env,
)
from rmsft.weight_wire.version import (
    FRESH,
    NO_RUN,
    WeightVersion,
    check_run_id,
    mismatch_message,
    new_run_id,
    set_version,
    version_of,
)

__all__ = [
    "ADAPTER",
    "BLAKE3",
    "DEFAULT_DIGEST",
    "DEFAULT_FRAME_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "DTYPE_SIZES",
    "FULL",
    "SHA256",
    "SHARED_DIR_ENV",
    "SharedSpaceError",
    "SharedUpdate",
    "check_shared",
    "open_shared",
    "shared_dir_from_env",
    "PieceFrame",
    "PipelinedDigest",
    "StagedTensor",
    "StreamReader",
    "SyncMode",
    "TensorSpec",
    "WireError",
    "decode_chunk",
    "digest_name",
    "dtype_name",
    "encode_piece",
    "encode_planned_stream",
    "encode_weight_stream",
    "iter_weight_chunks",
    "new_hash",
    "stream_header_and_specs",
    "stream_header",
    "torch_dtype",
    "update_weights_raw",
    "FRESH",
    "NO_RUN",
    "WeightVersion",
    "check_run_id",
    "mismatch_message",
    "new_run_id",
    "set_version",
    "version_of",
]
