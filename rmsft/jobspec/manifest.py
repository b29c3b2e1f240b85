"""The whole RolloutMatchingJob manifest (apiVersion, kind, metadata, spec), and reading one: from a mapping
or a YAML file, every error a line that starts with the dotted path of the bad key.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any, Literal, get_args

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


def _keys_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys a manifest may have at `loc` (the path of an unknown key, without the key): each model's keys as
    written (camelCase aliases in the Kubernetes-facing sections, snake_case in `training`); [] when `loc` leads
    into no model (a mapping such as nodeSelector takes any key)."""
    for part in loc:
        fields = {(f.alias or name): f for name, f in model.model_fields.items()}
        fields.update(model.model_fields)
        field = fields.get(part) if isinstance(part, str) else None
        if field is None:
            if isinstance(part, int):  # a list's item: the model is the list's
                continue
            return []
        inner = _model_of(field.annotation)
        if inner is None:
            return []
        model = inner
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (`X`, `X | None`, `list[X]`), None when there is none."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """ "; did you mean replicas?" for an unknown key close to known ones (difflib's nearest, case-blind), else ""."""
    key = loc[-1] if loc and isinstance(loc[-1], str) else None
    if key is None:
        return ""
    known = _keys_at(RolloutMatchingJob, loc[:-1])
    by_lower = {k.lower(): k for k in known}
    near = [by_lower[k] for k in difflib.get_close_matches(key.lower(), list(by_lower), n=3, cutoff=0.6)]
    if not near:
        return ""
    return f"; did you mean {' or '.join(near)}?"


def _format_errors(exc: ValidationError, prefix: str, root: tuple[str, ...] = ()) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        where = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            path = (*root, *(p for p in err["loc"] if not str(p).startswith("function-after")))
            msg = f"unknown key (not part of the RolloutMatchingJob schema{_did_you_mean(path)})"
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
        raise JobSpecError(_format_errors(exc, "spec", root=("spec",))) from None


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


def _read_job_doc(path: Path) -> dict[str, Any]:
    """The first document of kind RolloutMatchingJob in a YAML file, as written."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as exc:
        raise JobSpecError([f"cannot read {path}: {exc.strerror}"], str(path)) from None
    except yaml.YAMLError as exc:
        raise JobSpecError([f"not valid YAML{_other_kind(path)}: {exc}"], str(path)) from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        raise JobSpecError([f"no document with kind: {KIND}{_other_kind(path)}"], str(path))
    return jobs[0]


def apply_overrides(
    doc: dict[str, Any], overrides: list[str] | tuple[str, ...], source: str = "job spec"
) -> dict[str, Any]:
    """A copy of the manifest `doc` with each `key=value` of `overrides` (`rmsft local JOB --set
    training.steps=10`) set: the key a dotted path under `spec` (or starting at `spec.` / `metadata.`), written as
    in the file (camelCase in the Kubernetes-facing sections); the value read as YAML (`10` a number, `true` a
    flag, `[a, b]` a list, `null` the default). The result is validated as the file is, so an unknown key or a bad
    value is refused naming it (`did you mean`)."""
    out = copy.deepcopy(doc)
    errors = []
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = [p for p in key.strip().split(".")]
        if not sep or not key.strip() or any(not p for p in parts):
            errors.append(f"--set {item!r}: expected key=value, e.g. training.steps=10")
            continue
        if parts[0] not in ("spec", "metadata"):
            parts = ["spec", *parts]
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            errors.append(f"--set {item!r}: the value is not YAML ({problem})")
            continue
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                errors.append(
                    f"--set {item!r}: {'.'.join(parts[: i + 1])} is {type(child).__name__}, not a mapping with keys"
                )
                break
            node = child
        else:
            if value is None:  # the field's default
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = value
    if errors:
        raise JobSpecError(errors, source)
    return out


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RolloutMatchingJob:
    """Read a manifest from a YAML file (the first document of kind RolloutMatchingJob), with `overrides`
    (`apply_overrides`) set; its relative paths are the file's folder's (`resolve_paths`)."""
    path = Path(path)
    doc = apply_overrides(_read_job_doc(path), overrides, str(path)) if overrides else _read_job_doc(path)
    job = parse_job(doc, source=str(path))
    resolve_paths(job, path.parent)
    return job


def absolute_paths(doc: dict[str, Any], folder: str | Path) -> dict[str, Any]:
    """A copy of the manifest `doc` (as read from a file in `folder`) with its relative PATH_FIELDS made absolute
    against `folder`, as `load_job` reads them: for a script that copies a job file elsewhere (a temporary folder)
    and must keep the files it names."""
    out = copy.deepcopy(doc)
    base = os.path.abspath(folder)
    for *parents, key in PATH_FIELDS:
        node = out.get("spec")
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value) and "://" not in value:
            node[key] = os.path.normpath(os.path.join(base, value))  # type: ignore[index]
    return out


def write_effective_job(path: str | Path, overrides: list[str] | tuple[str, ...], out: str | Path) -> Path:
    """Write the manifest at `path` with `overrides` set and its relative paths made absolute to `out`, as
    written otherwise (its annotations kept): what the processes of `rmsft local --set` read, the learner's
    torchrun ranks included. Validated first (raises JobSpecError as `load_job`)."""
    path, out = Path(path), Path(out)
    load_job(path, overrides)
    doc = absolute_paths(apply_overrides(_read_job_doc(path), overrides, str(path)), path.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


# The spec's file and folder paths (section, ..., key): what `resolve_paths` reads relative to the job file's folder.
PATH_FIELDS = (
    ("model", "path"),
    ("training", "data", "path"),
    ("training", "data", "image_root"),
    ("training", "eval", "data"),
    ("training", "eval", "image_root"),
    ("training", "checkpoint", "dir"),
    ("training", "export", "dir"),
    ("training", "log_dir"),
    ("training", "wandb", "dir"),
)


def resolve_paths(job: RolloutMatchingJob, folder: str | Path) -> None:
    """Make the job's relative paths (PATH_FIELDS) absolute against `folder`, the job file's: a job file means the
    same files from wherever it is run (`rmsft local configs/local-tiny.yaml` from the repository root and
    `rmsft local local-tiny.yaml` from configs/ read one model), as a compose or kustomize file does. Absolute
    paths stay as written; in a cluster every path is absolute, as the pods see it."""
    base = os.path.abspath(folder)
    for *parents, key in PATH_FIELDS:
        section: Any = job.spec
        for name in parents:
            section = getattr(section, name)
        value = getattr(section, key)
        if value and not os.path.isabs(value) and "://" not in value:
            setattr(section, key, os.path.normpath(os.path.join(base, value)))


def _other_kind(path: Path) -> str:
    """ " (this is a COCO instances file: ...)" for a data file given where a job manifest goes (JSON is YAML, and
    "no document with kind" would not say what was given), else ""."""
    from rmsft.file_kinds import JOB, wrong_kind

    other = wrong_kind(path, JOB)
    return f" ({other})" if other else ""
