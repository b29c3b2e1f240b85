"""What goes into and comes out of a rollout: requests, completions, the chunk plan, and the
errors the rollout client raises. No gRPC calls here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rmsft_protos import rollout_pb2

from learner.rollouts.pool import NoServerAvailableError
from rmsft.weight_wire import WeightVersion

FINISH_REASONS = {v: k.lower() for k, v in rollout_pb2.FinishReason.items()}


class RolloutError(RuntimeError):
    """A rollout could not be completed; the message says which chunk, where, and why."""


class AllServersDownError(RolloutError, NoServerAvailableError):
    """No server could take (the rest of) the work; names every server and its last error."""


class StaleRolloutError(RolloutError):
    """A completion carries another weight version than the learner's current one (another number, or
    another run's weights)."""


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt. `token_ids` is the fully templated prompt; when empty, `messages` (role, content)
    and `images` (bytes or URI strings) are rendered by the server."""

    token_ids: Sequence[int] = ()
    seed: int | None = None
    request_id: str = ""
    messages: Sequence[tuple[str, str]] = ()
    images: Sequence[bytes | str] = ()


@dataclass
class Rollout:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "finish_reason_unspecified"
    weight_version: int  # the number of the weight version that produced it ...
    server: str  # address of the server that produced it
    sample_index: int = 0  # which of the prompt's `sampling.n` samples
    logprobs: list[float] | None = None  # per token, when `sampling.logprobs` asked for them
    weight_run_id: str = ""  # ... and the learner run whose version that is
    # Which version sampled which tokens: (version, start, end) over token_ids, in order. Empty: every token is
    # `weights`' (a server from before spans, or none). More than one only after an in-flight weight update.
    version_spans: list[tuple[WeightVersion, int, int]] = field(default_factory=list)

    @property
    def weights(self) -> WeightVersion:
        """The weight version it was generated under: the call's fence, its oldest tokens' (run id and number).
        The staleness bound counts a rollout by it."""
        return WeightVersion(self.weight_run_id, self.weight_version)

    @property
    def spans(self) -> list[tuple[WeightVersion, int, int]]:
        """`version_spans`, or one span of `weights` over every token when the server sent none."""
        # getattr: a Rollout pickled before spans existed (a checkpoint's batches ahead) has no such field.
        return list(getattr(self, "version_spans", None) or ()) or [(self.weights, 0, len(self.token_ids))]

    @property
    def newest(self) -> WeightVersion:
        """The version of its newest tokens (`weights` unless a weight update applied while it generated)."""
        return self.spans[-1][0] if self.token_ids else self.weights


@dataclass(frozen=True)
class Chunk:
    """Prompts [start, stop) initially planned for the server at position `slot` of the plan."""

    start: int
    stop: int
    slot: int

    def __len__(self) -> int:
        return self.stop - self.start


# Most bytes of prompts in one Generate call: a whole share goes in one call unless it is bigger (images), so
# the message stays well under what a server accepts (rollout_svc/server.py, GENERATE_RECEIVE_BYTES).
MAX_CHUNK_BYTES = 16 << 20


def split_into_chunks(
    n: int,
    n_servers: int,
    batch_size: int = 0,
    sizes: Sequence[int] | None = None,
    max_bytes: int = MAX_CHUNK_BYTES,
) -> list[Chunk]:
    """Contiguous, balanced split of `n` prompts over `n_servers` (the first `n % n_servers` get one
    more), each share cut further into balanced pieces of at most `batch_size` (0 = no bound), and each
    piece cut where its prompts' `sizes` (serialized bytes) would pass `max_bytes` (a prompt bigger than
    that goes alone)."""
    if n_servers <= 0:
        raise ValueError("split_into_chunks needs at least one server")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if sizes is not None and len(sizes) != n:
        raise ValueError(f"split_into_chunks got {len(sizes)} sizes for {n} prompts")
    chunks: list[Chunk] = []
    base, extra = divmod(n, n_servers)
    start = 0
    for slot in range(n_servers):
        share = base + (1 if slot < extra else 0)
        if share == 0:
            continue
        pieces = -(-share // batch_size) if batch_size else 1
        p_base, p_extra = divmod(share, pieces)
        for p in range(pieces):
            size = p_base + (1 if p < p_extra else 0)
            chunks.extend(_cut_by_bytes(start, start + size, slot, sizes, max_bytes))
            start += size
    return chunks


def _cut_by_bytes(start: int, stop: int, slot: int, sizes: Sequence[int] | None, max_bytes: int) -> list[Chunk]:
    if sizes is None or max_bytes <= 0:
        return [Chunk(start, stop, slot)]
    out, first, total = [], start, 0
    for i in range(start, stop):
        if i > first and total + sizes[i] > max_bytes:
            out.append(Chunk(first, i, slot))
            first, total = i, 0
        total += sizes[i]
    out.append(Chunk(first, stop, slot))
    return out


def sampling_params(sampling: rollout_pb2.SamplingParams | Mapping[str, Any] | None) -> rollout_pb2.SamplingParams:
    """SamplingParams from a proto or a mapping with the proto's field names (clear error otherwise)."""
    if sampling is None:
        return rollout_pb2.SamplingParams()
    if isinstance(sampling, rollout_pb2.SamplingParams):
        return sampling
    known = set(rollout_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    unknown = sorted(set(sampling) - known)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
    try:
        return rollout_pb2.SamplingParams(**dict(sampling))
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad sampling parameters {dict(sampling)}: {e}") from None


def check_versions(rollouts: Sequence[Rollout], version: WeightVersion) -> None:
    """Raise StaleRolloutError when any rollout was not produced by weight version `version` (its run
    id and number)."""
    stale = [(i, r.request_id, str(r.weights), r.server) for i, r in enumerate(rollouts) if r.weights != version]
    if stale:
        raise StaleRolloutError(
            f"{len(stale)} rollout(s) not produced by the current weight version {version.describe()} "
            f"(index, request id, version, server): {stale[:5]}"
        )


def to_prompt_proto(r: RolloutRequest) -> rollout_pb2.Prompt:
    p = rollout_pb2.Prompt(token_ids=r.token_ids, request_id=r.request_id)
    if r.seed is not None:
        p.seed = r.seed
    for role, content in r.messages:
        p.messages.add(role=role, content=content)
    for img in r.images:
        if isinstance(img, bytes | bytearray):
            p.images.add(data=bytes(img))
        else:
            p.images.add(uri=str(img))
    return p
