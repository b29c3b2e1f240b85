"""The whole RolloutMatchingJob manifest (apiVersion, kind, metadata, spec), and reading one: from a mapping
or a YAML file, every error a line that starts with the dotted path of the bad key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rmsft.jobspec.base import _DNS_LABEL, API_GROUP_VERSION, KIND, JobSpecError
from rmsft.jobspec.job import JobSpec


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., pattern=_DNS_LABEL, max_length=40)
    namespace: str | None = None


class RolloutMatchingJob(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # status/other metadata pass through
    api_version: Literal["rmsft.io/v1alpha1"] = Field(API_GROUP_VERSION, alias="apiVersion")
    kind: Literal["RolloutMatchingJob"] = KIND
    metadata: ObjectMeta
    spec: JobSpec

    def to_manifest(self) -> dict[str, Any]:
        """The manifest with every default filled in (what the learner and servers read)."""
        meta = {"name": self.metadata.name}
        if self.metadata.namespace:
            meta["namespace"] = self.metadata.namespace
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": meta,
            "spec": self.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        }


def _format_errors(exc: ValidationError, prefix: str) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        where = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not part of the RolloutMatchingJob schema)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and err["type"] not in ("value_error",) and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        out.append(f"{where}: {msg}")
    return out


def parse_spec(spec: dict[str, Any]) -> JobSpec:
    """Validate a bare `spec` mapping (what the operator sees); errors name `spec.<key>`."""
    if not isinstance(spec, dict):
        raise JobSpecError([f"spec: must be a mapping, got {type(spec).__name__}"])
    try:
        return JobSpec.model_validate(spec)
    except ValidationError as exc:
        raise JobSpecError(_format_errors(exc, "spec")) from None


def parse_job(doc: dict[str, Any], source: str = "job spec") -> RolloutMatchingJob:
    """Validate a whole manifest; every error line starts with the dotted path of the bad key."""
    if not isinstance(doc, dict):
        raise JobSpecError([f"<root>: must be a mapping, got {type(doc).__name__}"], source)
    try:
        return RolloutMatchingJob.model_validate(doc)
    except ValidationError as exc:
        errs = []
        for line in _format_errors(exc, "<root>"):
            errs.append(line.removeprefix("<root>."))
        raise JobSpecError(errs, source) from None


def load_job(path: str | Path) -> RolloutMatchingJob:
    """Read a manifest from a YAML file (the first document of kind RolloutMatchingJob)."""
    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as exc:
        raise JobSpecError([f"cannot read {path}: {exc.strerror}"], str(path)) from None
    except yaml.YAMLError as exc:
        raise JobSpecError([f"not valid YAML: {exc}"], str(path)) from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        raise JobSpecError([f"no document with kind: {KIND}"], str(path))
    return parse_job(jobs[0], source=str(path))
