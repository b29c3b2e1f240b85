"""What every section of the job spec shares: the API's names, the Kubernetes patterns, the error type and
the two key conventions (camelCase Kubernetes-facing sections, the snake_case `training` section).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

API_GROUP = "rmsft.io"
API_VERSION = "v1alpha1"
KIND = "RolloutMatchingJob"
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
