"""What each server answered to an update, as the learner and the relaying servers read it, and the
metadata that carries it.

A relayed update has one answer per server: the head's reply lists the others' (`relayed`); a
refusal carries that list in trailing metadata, since a gRPC error has no reply body.
"""

from __future__ import annotations

import grpc
from rmsft_protos import rollout_pb2

RELAYED_METADATA_KEY = "rmsft-relayed-bin"  # "-bin": gRPC carries the value as bytes
# Initial metadata of a shm update: the server has the shared file open (so it will remove it if the
# learner dies before the trailer); the learner writes the file only once every server said so.
SHARED_OPENED_METADATA = (("rmsft-shared-opened", "1"),)
# Initial metadata of a transfer-group (transport nccl) update: the server checked the header's listing, drained
# its running calls and waits for the learner's go (the trailer); the learner broadcasts only once every member
# said so, since a member missing from a collective would hold the others until its timeout.
GROUP_READY_METADATA = (("rmsft-group-ready", "1"),)


def relayed_metadata(outcomes: list[rollout_pb2.RelayOutcome]) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata reporting `outcomes` with a refusal."""
    return ((RELAYED_METADATA_KEY, rollout_pb2.UpdateReply(relayed=outcomes).SerializeToString()),)


def relayed_from_error(error: grpc.RpcError) -> list[rollout_pb2.RelayOutcome]:
    """The downstream outcomes a refused update's trailing metadata carries (none if absent)."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == RELAYED_METADATA_KEY:
            return list(rollout_pb2.UpdateReply.FromString(value).relayed)
    return []


def outcome_of_error(address: str, error: grpc.RpcError) -> rollout_pb2.RelayOutcome:
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    return rollout_pb2.RelayOutcome(address=address, code=code.value[0], message=details or code.name)
