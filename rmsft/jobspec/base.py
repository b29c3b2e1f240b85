"""What every section of the job spec shares: the API's names, the Kubernetes patterns, the error type and
the two key conventions (camelCase Kubernetes-facing sections, the snake_case `training` section).
"""

from __future__ import annotations

import re
from typing import Final

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# Final: their literal types are the manifest's Literal fields' (rmsft.jobspec.manifest)
API_GROUP: Final = "rmsft.io"
API_VERSION: Final = "v1alpha1"
API_GROUP_VERSION: Final = "rmsft.io/v1alpha1"  # f"{API_GROUP}/{API_VERSION}", spelled out for its literal type
KIND: Final = "RolloutMatchingJob"
PLURAL = "rolloutmatchingjobs"

QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class JobSpecError(ValueError):
    """A manifest that is not a valid RolloutMatchingJob; `errors` holds one line per bad key."""

    def __init__(self, errors: list[str], source: str = "job spec") -> None:
        self.errors = errors
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  - {e}" for e in errors))


class _K8s(BaseModel):
    """camelCase keys, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class _Learner(BaseModel):
    """snake_case keys (the learner's own config), unknown keys rejected."""

    model_config = ConfigDict(extra="forbid")


# Durations (spec.rollout.startupTimeout and recoveryTimeout, spec.learner.stallTimeout): whole seconds, or
# hours/minutes/seconds in that order (Go's duration syntax, the units Kubernetes users write). The CRD's CEL rule
# holds the same pattern.
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"


def duration_seconds(value: int | str, field: str) -> int:
    """Seconds of `value`: an int (or a string of digits) is seconds; '1h30m', '45m', '90s' are durations. > 0."""
    if isinstance(value, bool):  # a bool is an int to Python, not to a person writing YAML
        raise ValueError(f"{field} must be seconds or a duration such as 30m, got {value!r}")
    if isinstance(value, int):
        seconds = value
    else:
        text = str(value).strip()
        m = re.fullmatch(DURATION_PATTERN, text)
        if text.isdigit():
            seconds = int(text)
        elif text and m:
            h, mi, s = (int(g[:-1]) if g else 0 for g in m.groups())
            seconds = 3600 * h + 60 * mi + s
        else:
            raise ValueError(f"{field} must be seconds or a duration such as 30m, 1h30m or 90s, got {value!r}")
    if seconds < 1:
        raise ValueError(f"{field} must be at least 1 second, got {value!r}")
    return seconds
