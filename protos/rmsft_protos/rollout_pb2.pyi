from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    ABORT: _ClassVar[FinishReason]

class SyncMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_MODE_UNSPECIFIED: _ClassVar[SyncMode]
    FULL: _ClassVar[SyncMode]
    ADAPTER: _ClassVar[SyncMode]

class DigestAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHA256: _ClassVar[DigestAlgorithm]
    BLAKE3: _ClassVar[DigestAlgorithm]
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason
ABORT: FinishReason
SYNC_MODE_UNSPECIFIED: SyncMode
FULL: SyncMode
ADAPTER: SyncMode
SHA256: DigestAlgorithm
BLAKE3: DigestAlgorithm

class JoinWeightGroupRequest(_message.Message):
    __slots__ = ("group_id", "master_address", "master_port", "world_size", "rank_offset", "timeout_s", "bucket_bytes")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    timeout_s: float
    bucket_bytes: int
    def __init__(self, group_id: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., timeout_s: _Optional[float] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class JoinWeightGroupReply(_message.Message):
    __slots__ = ("group_id", "ranks", "bucket_bytes")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    ranks: int
    bucket_bytes: int
    def __init__(self, group_id: _Optional[str] = ..., ranks: _Optional[int] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class TransferGroup(_message.Message):
    __slots__ = ("group_id", "tensors")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    def __init__(self, group_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "stop", "stop_token_ids", "n", "logprobs", "min_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    logprobs: bool
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "uri", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    uri: str
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., uri: _Optional[str] = ..., mime_type: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids", "messages", "images", "seed", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    seed: int
    request_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., seed: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "expected_weight_version", "expected_weight_run_id")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    expected_weight_version: int
    expected_weight_run_id: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., expected_weight_version: _Optional[int] = ..., expected_weight_run_id: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("prompt_token_ids", "token_ids", "finish_reason", "weight_version", "request_id", "sample_index", "logprobs", "weight_run_id", "version_spans")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    weight_version: int
    request_id: str
    sample_index: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_run_id: str
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., weight_version: _Optional[int] = ..., request_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_run_id: _Optional[str] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("weight_version", "weight_run_id", "start", "end")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    weight_run_id: str
    start: int
    end: int
    def __init__(self, weight_version: _Optional[int] = ..., weight_run_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "weight_version", "weight_run_id")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    weight_version: int
    weight_run_id: str
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., weight_version: _Optional[int] = ..., weight_run_id: _Optional[str] = ...) -> None: ...

class WeightHeader(_message.Message):
    __slots__ = ("version", "mode", "tensor_count", "total_bytes", "adapter_config_json", "digest_algorithm", "shared_file", "relay_to", "run_id", "transfer_group", "keep_generating")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SHARED_FILE_FIELD_NUMBER: _ClassVar[int]
    RELAY_TO_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_GROUP_FIELD_NUMBER: _ClassVar[int]
    KEEP_GENERATING_FIELD_NUMBER: _ClassVar[int]
    version: int
    mode: SyncMode
    tensor_count: int
    total_bytes: int
    adapter_config_json: str
    digest_algorithm: DigestAlgorithm
    shared_file: SharedFile
    relay_to: _containers.RepeatedScalarFieldContainer[str]
    run_id: str
    transfer_group: TransferGroup
    keep_generating: bool
    def __init__(self, version: _Optional[int] = ..., mode: _Optional[_Union[SyncMode, str]] = ..., tensor_count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., adapter_config_json: _Optional[str] = ..., digest_algorithm: _Optional[_Union[DigestAlgorithm, str]] = ..., shared_file: _Optional[_Union[SharedFile, _Mapping]] = ..., relay_to: _Optional[_Iterable[str]] = ..., run_id: _Optional[str] = ..., transfer_group: _Optional[_Union[TransferGroup, _Mapping]] = ..., keep_generating: _Optional[bool] = ...) -> None: ...

class SharedFile(_message.Message):
    __slots__ = ("path", "tensors")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    path: str
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    def __init__(self, path: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "start")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    start: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightTrailer(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    def __init__(self, digest: _Optional[bytes] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "piece", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    piece: TensorPiece
    trailer: WeightTrailer
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., piece: _Optional[_Union[TensorPiece, _Mapping]] = ..., trailer: _Optional[_Union[WeightTrailer, _Mapping]] = ...) -> None: ...

class UpdateReply(_message.Message):
    __slots__ = ("version", "tensors_applied", "bytes_received", "apply_seconds", "relayed", "run_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors_applied: int
    bytes_received: int
    apply_seconds: float
    relayed: _containers.RepeatedCompositeFieldContainer[RelayOutcome]
    run_id: str
    def __init__(self, version: _Optional[int] = ..., tensors_applied: _Optional[int] = ..., bytes_received: _Optional[int] = ..., apply_seconds: _Optional[float] = ..., relayed: _Optional[_Iterable[_Union[RelayOutcome, _Mapping]]] = ..., run_id: _Optional[str] = ...) -> None: ...

class RelayOutcome(_message.Message):
    __slots__ = ("address", "code", "message", "version", "run_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    code: int
    message: str
    version: int
    run_id: str
    def __init__(self, address: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., version: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("model", "tensor_parallel_size", "replica_ordinal", "weight_version", "active_adapter", "ready", "lora_enabled", "backend", "max_lora_rank", "weight_run_id", "pid", "weight_group", "weight_transfer")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_GROUP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    model: str
    tensor_parallel_size: int
    replica_ordinal: int
    weight_version: int
    active_adapter: str
    ready: bool
    lora_enabled: bool
    backend: str
    max_lora_rank: int
    weight_run_id: str
    pid: int
    weight_group: str
    weight_transfer: str
    def __init__(self, model: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., replica_ordinal: _Optional[int] = ..., weight_version: _Optional[int] = ..., active_adapter: _Optional[str] = ..., ready: _Optional[bool] = ..., lora_enabled: _Optional[bool] = ..., backend: _Optional[str] = ..., max_lora_rank: _Optional[int] = ..., weight_run_id: _Optional[str] = ..., pid: _Optional[int] = ..., weight_group: _Optional[str] = ..., weight_transfer: _Optional[str] = ...) -> None: ...
