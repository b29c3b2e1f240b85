"""Training records: a JSONL file, one detection sample per line, validated on load.

A record::

    {"id": "img-7", "width": 640, "height": 480,
     "messages": [{"role": "user", "content": "Detect every object ..."}],
     "images": ["file:///data/img-7.jpg"],                       # optional
     "objects": [{"desc": "person", "bbox_2d": [10, 20, 110, 220]},
                 {"desc": "kite", "poly": [5, 5, 60, 5, 30, 40]}]}  # pixel coordinates

A record may also carry `"answer": "..."` (or a list of accepted answers): the expected answer of a
short-answer task, which GRPO's text rewards score against (learner/rewards/builtins.py).

Bad lines fail the load with the file, the line number and the field at fault; nothing is
silently skipped. Object rules are the core's (`learner.core.codec.check_desc`, `DetObject`), applied
here so that a bad object fails at load with its record's line, not later inside a training step: a
desc blank after stripping or holding coordinate-token text (`<|coord_`), a box with x2 < x1 or
y2 < y1, a coordinate that is not a finite number. Descs are kept as written; the core strips them.

Image references (`images`), resolved by learner/data/images.py:

- `"img-7.jpg"`, `"sub/img-7.jpg"`: relative to `spec.training.data.image_root`, or when that is
  unset to the folder holding the dataset file;
- `"/data/img-7.jpg"` or `"file:///data/img-7.jpg"`: an absolute local path;
- `"data:image/png;base64,iVBOR..."`: the image bytes inline.

Remote URIs (http://, s3://, ...) are refused. `load_dataset` (learner/data/dataset.py) checks every
image at load (exists, decodes, at most `spec.model.vision.maxImagePixels`, and for a record with one
image, the image's size equals the record's `width`/`height`, the frame of its ground truth) and reports
all problems at once. `load_records` reads the records only (text datasets, and callers that check images later).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from learner.core.codec import check_desc


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class GroundTruthObject(BaseModel):
    # NaN/inf coordinates would only fail later, in the grid conversion of a training step.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    desc: str = Field(min_length=1)
    bbox_2d: list[float] | None = None
    poly: list[float] | None = None

    @field_validator("desc")
    @classmethod
    def _desc(cls, v: str) -> str:
        check_desc(v)  # raises ValueError with the reason; pydantic adds the field's path
        return v

    @model_validator(mode="after")
    def _one_geometry(self) -> GroundTruthObject:
        if (self.bbox_2d is None) == (self.poly is None):
            raise ValueError("exactly one of bbox_2d or poly is required")
        if self.bbox_2d is not None:
            if len(self.bbox_2d) != 4:
                raise ValueError(f"bbox_2d needs 4 numbers, got {len(self.bbox_2d)}")
            x1, y1, x2, y2 = self.bbox_2d
            if x2 < x1 or y2 < y1:
                raise ValueError(f"bbox_2d {self.bbox_2d} has x2 < x1 or y2 < y1")
        if self.poly is not None and (len(self.poly) < 6 or len(self.poly) % 2):
            raise ValueError(f"poly needs an even count >= 6 of numbers, got {len(self.poly)}")
        return self


class LvisMeta(BaseModel):
    """LVIS's per-image category verification (federated annotation): which categories were checked on the image.
    `pos_categories`: verified present (every instance annotated, unless also in `not_exhaustive_categories`);
    `neg_categories`: verified absent. Category names, as the objects' `desc` writes them."""

    model_config = ConfigDict(extra="forbid")
    pos_categories: list[str] = Field(default_factory=list)
    neg_categories: list[str] = Field(default_factory=list)
    not_exhaustive_categories: list[str] = Field(default_factory=list)

    def verified(self) -> frozenset[str]:
        """Normalized names of the categories whose every instance on the image is known: a prediction of one of
        them that matches no ground truth is wrong (exhaustively annotated present ones, and absent ones)."""
        from learner.core.clean_prefix import normalize_label

        partial = {normalize_label(n) for n in self.not_exhaustive_categories}
        present = {normalize_label(n) for n in self.pos_categories} - partial
        return frozenset(present | {normalize_label(n) for n in self.neg_categories})


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    messages: list[Message] = Field(min_length=1)
    images: list[str] = Field(default_factory=list)
    objects: list[GroundTruthObject] = Field(default_factory=list)
    # A short-answer task's expected answer (several accepted: a list), for GRPO's text rewards (`text_match`).
    answer: str | list[str] | None = None
    # LVIS's verified categories of the image (optional): recipe generation 2's dead-anchor triage also takes out an
    # unmatched object of a verified category (docs/data.md, docs/method.md).
    lvis: LvisMeta | None = None


class DataError(ValueError):
    """A dataset line that cannot be used; the message names file, line and field."""


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<record>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown key{_did_you_mean(e['loc'])}"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def _did_you_mean(loc: tuple) -> str:
    """ " (did you mean bbox_2d?)" for an unknown key close to the keys of its place (a record, an object, a
    message), else " (keys: ...)" naming them."""
    import difflib

    model = GroundTruthObject if "objects" in loc else Message if "messages" in loc else Record
    keys = list(model.model_fields)
    near = difflib.get_close_matches(str(loc[-1]), keys, n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(near)}?)" if near else f" (a {model.__name__} has {', '.join(keys)})"


def _first_line_error(path: Path, lineno: int, message: str) -> DataError:
    """The error of a bad line; on line 1, a file of another known kind (a COCO instances or results file) is
    named with the command for it instead of "not valid JSON" (rmsft/file_kinds.py)."""
    if lineno == 1:
        from rmsft.file_kinds import RECORDS, wrong_kind

        other = wrong_kind(path, RECORDS)
        if other is not None:
            return DataError(f"{path}: {other}")
    return DataError(f"{path}:{lineno}: {message}")


def iter_records(path: str | Path) -> Iterator[Record]:
    path = Path(path)
    try:
        exists, folder = path.exists(), path.is_dir()
    except OSError as exc:  # a name over 255 bytes: the OS's words, naming the file
        raise DataError(f"dataset {path}: cannot be read ({exc.strerror})") from None
    if not exists:
        raise DataError(f"dataset {path} does not exist")
    if folder:
        raise DataError(f"dataset {path} is a folder: give the records file in it (.jsonl or .jsonl.gz)")
    # spec.training.data.path may be .jsonl.gz: read through gzip, one line at a time as the plain file.
    opener = gzip.open if path.suffix == ".gz" else open
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise _first_line_error(path, lineno, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
                except RecursionError:
                    raise DataError(
                        f"{path}:{lineno}: not a record: JSON nested deeper than a parser follows"
                    ) from None
                except ValueError as exc:  # an integer of over 4300 digits (Python's int conversion limit)
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc})") from None
                try:
                    yield Record.model_validate(raw)
                except ValidationError as exc:
                    raise _first_line_error(path, lineno, _describe(exc)) from None
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}:{lineno + 1}: not UTF-8 text ({exc.reason} at byte {exc.start}); a compressed "
            "file needs the .gz suffix"
        ) from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise DataError(f"{path}: not a complete gzip file ({exc or type(exc).__name__})") from None
    except OSError as exc:  # unreadable (permissions), a read error
        raise DataError(f"dataset {path}: cannot be read ({exc.strerror or exc})") from None


def load_records(path: str | Path) -> list[Record]:
    records = list(iter_records(path))
    if not records:
        raise DataError(f"dataset {path} holds no records")
    seen: set[str] = set()
    for r in records:
        if r.id in seen:
            raise DataError(f"{path}: duplicate record id {r.id!r}")
        seen.add(r.id)
    return records


@dataclass(frozen=True)
class OutsideFrame:
    """Objects with a coordinate outside their record's `width` x `height` frame (`outside_frame`): the grid
    conversion clamps them to the image's edges (`pixel_to_bin`), so what is trained is not what the file says."""

    objects: int = 0
    records: int = 0
    first: str = ""  # the first case, as `record 'id' object 2 bbox_2d [..] in 640x480`

    def line(self, total: int) -> str:
        return (
            f"{self.objects} of {total} objects (in {self.records} records) reach outside their image's "
            f"width x height: training clamps them to its edges (first: {self.first})"
        )


def outside_frame(records: list[Record]) -> OutsideFrame:
    """Count the objects of `records` with an x outside 0..width or a y outside 0..height."""
    objects = in_records = 0
    first = ""
    for r in records:
        hit = 0
        for k, o in enumerate(r.objects, start=1):
            kind, coords = ("bbox_2d", o.bbox_2d) if o.bbox_2d is not None else ("poly", o.poly)
            xs, ys = coords[0::2], coords[1::2]  # type: ignore[index]
            if min(xs) < 0 or min(ys) < 0 or max(xs) > r.width or max(ys) > r.height:
                hit += 1
                first = first or f"record {r.id!r} object {k} {kind} {coords} in {r.width}x{r.height}"
        objects += hit
        in_records += bool(hit)
    return OutsideFrame(objects, in_records, first)
