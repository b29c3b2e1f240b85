"""What a weight version is, for learner and servers alike: a learner run's identity and a number.

The number alone is not unique. A learner counts versions from its checkpoint's, so a learner
restarted from a checkpoint announces the numbers its dead predecessor already used (with other
weights), and two learners against one pool count from the same start. So every version travels
with the identity of the run that announced it: `WeightVersion(run_id, number)`. A run id is made
when a learner starts (`new_run_id`) and is new after every restart, so no two runs share one,
and within a run the numbers only go up. Therefore no two sets of weights ever carry the same
pair.

The rules, on both ends:

- A server reports the pair it holds (`StatusReply`, `GenerateResponse`, every `Completion`,
  `UpdateReply`, `RelayOutcome`) and takes the pair of an update (`WeightHeader`) only together
  with its weights: a failed apply leaves both as they were.
- A server no update reached holds `NO_RUN` version 0 (the checkpoint's weights). `NO_RUN` is
  also the run of an update sent outside any learner run (a hand-made one); no learner has that
  run id, so no learner ever takes such a server for current.
- A Generate fenced to a version (`expected_weight_version` set) is served only when the pair
  (`expected_weight_run_id`, `expected_weight_version`) equals the server's; otherwise
  FAILED_PRECONDITION with both pairs in the message (`mismatch_message`).
- The learner takes a server for current, and a completion for usable, only when the pair equals
  its own current version: a server holding another run's weights, whatever their number, is
  stale until this run re-synced it.

`version_of(message)` / `set_version(message, v)` read and write the pair of every message that
carries one; the field names are written down once, below, and checked against the protobuf
descriptor at import.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, overload

from google.protobuf.message import Message
from rmsft_protos import rollout_pb2

from rmsft.weight_wire.contract import WireError

NO_RUN = ""  # the run of the checkpoint's weights and of updates sent outside any learner run
RUN_ID_BYTES = 6  # `new_run_id`: 12 hex characters, 48 random bits
MAX_RUN_ID_LENGTH = 64
# Run ids end up in log lines and metric labels: a small alphabet, no spaces or quotes.
_RUN_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")


def new_run_id() -> str:
    """A fresh run id (12 hex characters from the OS's random source)."""
    return secrets.token_hex(RUN_ID_BYTES)


def check_run_id(run_id: str, *, allow_none: bool = True) -> str:
    """`run_id` when it is a valid run id (NO_RUN too, unless `allow_none` is False); WireError
    (INVALID_ARGUMENT) naming it otherwise."""
    if run_id == NO_RUN and allow_none:
        return run_id
    if not isinstance(run_id, str) or len(run_id) > MAX_RUN_ID_LENGTH or not _RUN_ID.fullmatch(run_id):
        raise WireError(
            f"run id {run_id!r} is not valid: 1 to {MAX_RUN_ID_LENGTH} characters of [0-9A-Za-z._-], starting "
            "with a letter or digit",
            reason="run_id",
        )
    return run_id


@dataclass(frozen=True)
class WeightVersion:
    """One weight version: the run that announced it and its number in that run."""

    run_id: str
    number: int

    @property
    def run_text(self) -> str:
        return f"run {self.run_id}" if self.run_id else "no run"

    def describe(self) -> str:
        """`22 of run 3fa2c1d09e77` (for "weight version ..." messages)."""
        return f"{self.number} of {self.run_text}"

    def __str__(self) -> str:
        """`v22 of run 3fa2c1d09e77`; `v0 of no run` on a server no update reached."""
        return f"v{self.number} of {self.run_text}"


FRESH = WeightVersion(NO_RUN, 0)  # what a server holds before any update applied


# message type -> (run id field, number field). The one place the wire names them.
_FIELDS: dict[type[Message], tuple[str, str]] = {
    rollout_pb2.WeightHeader: ("run_id", "version"),
    rollout_pb2.UpdateReply: ("run_id", "version"),
    rollout_pb2.RelayOutcome: ("run_id", "version"),
    rollout_pb2.StatusReply: ("weight_run_id", "weight_version"),
    rollout_pb2.GenerateResponse: ("weight_run_id", "weight_version"),
    rollout_pb2.Completion: ("weight_run_id", "weight_version"),
    rollout_pb2.VersionSpan: ("weight_run_id", "weight_version"),
    rollout_pb2.GenerateRequest: ("expected_weight_run_id", "expected_weight_version"),
}


def _check_fields() -> None:
    for message, (run_field, number_field) in _FIELDS.items():
        fields = message.DESCRIPTOR.fields_by_name
        run, number = fields.get(run_field), fields.get(number_field)
        if run is None or number is None or run.type != run.TYPE_STRING or number.type != number.TYPE_UINT64:
            raise TypeError(f"{message.DESCRIPTOR.name} has no string {run_field} / uint64 {number_field} pair")


_check_fields()


def _fields(message: Any) -> tuple[str, str]:
    try:
        return _FIELDS[type(message)]
    except KeyError:
        raise TypeError(f"{type(message).__name__} carries no weight version") from None


# The messages that always carry a version (a reply, a header); a GenerateRequest carries one only when fenced.
_Versioned = (
    rollout_pb2.WeightHeader
    | rollout_pb2.UpdateReply
    | rollout_pb2.RelayOutcome
    | rollout_pb2.StatusReply
    | rollout_pb2.GenerateResponse
    | rollout_pb2.Completion
)


@overload
def version_of(message: _Versioned) -> WeightVersion: ...
@overload
def version_of(message: rollout_pb2.GenerateRequest) -> WeightVersion | None: ...
def version_of(message: Any) -> WeightVersion | None:
    """The weight version a message carries; for a `GenerateRequest` the one it is fenced to, None
    when it is not fenced (`expected_weight_version` unset)."""
    run_field, number_field = _fields(message)
    if isinstance(message, rollout_pb2.GenerateRequest) and not message.HasField(number_field):
        return None
    return WeightVersion(getattr(message, run_field), getattr(message, number_field))


def set_version(message: Any, version: WeightVersion) -> Any:
    """Write `version` into a message that carries one (a `GenerateRequest`: fence it to `version`);
    returns the message."""
    run_field, number_field = _fields(message)
    setattr(message, run_field, version.run_id)
    setattr(message, number_field, version.number)
    return message


def mismatch_message(expected: WeightVersion, actual: WeightVersion) -> str:
    """Why a call fenced to `expected` is refused by a server holding `actual`."""
    text = f"expected weight version {expected.describe()}, server has {actual.describe()}"
    if expected.number == actual.number and expected.run_id != actual.run_id:
        text += " (same number, another run's weights)"
    return text


__all__ = [
    "FRESH",
    "MAX_RUN_ID_LENGTH",
    "NO_RUN",
    "WeightVersion",
    "check_run_id",
    "mismatch_message",
    "new_run_id",
    "set_version",
    "version_of",
]
