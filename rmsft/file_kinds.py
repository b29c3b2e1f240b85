"""What kind of annotation file a path holds, for the error of a command given the wrong one: a COCO instances
file given to `rmsft data check` (or as spec.training.data.path), training records given to
`rmsft data from-coco`, a COCO results list given to either, a job manifest given to either, a data file given
as a job (`rmsft plan`, `local`, ...). The commands' own readers decide what they accept; this only names what
was given instead and the command that reads it, so that "not valid JSON at line 2" becomes "this is a records
file: check it with `rmsft data check`".

`kind_of(path) -> FileKind | None`: None when the file is none of the kinds named here (then the reader's own
error stands). Torch-free, and it never raises: it runs while another error is being reported.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A whole-file parse is what tells a pretty-printed COCO file from a broken one; past this size the first
# MiB's keys have to do (a COCO train file is ~450 MB: parsing it again only to name it is too slow).
_PARSE_LIMIT = 64 << 20
_PEEK = 1 << 20


@dataclass(frozen=True)
class FileKind:
    name: str  # "a COCO instances file", as it reads in a sentence
    command: str  # what to do with it


RECORDS = FileKind(
    "a training records file (JSONL, one record per line)",
    "it is what a job reads: check it with `rmsft data check FILE`",
)
INSTANCES = FileKind(
    "a COCO instances file (images, annotations, categories)",
    "convert it to training records with `rmsft data from-coco FILE IMAGES_DIR OUT.jsonl`",
)
JOB = FileKind(
    "a RolloutMatchingJob manifest (YAML)",
    "see what it would run with `rmsft plan FILE`, run it with `rmsft local FILE`",
)
RESULTS = FileKind(
    "a COCO results file (a list of detections with scores: a model's output, not ground truth)",
    "training records are made from the split's instances file: `rmsft data from-coco "
    "instances_*.json IMAGES_DIR OUT.jsonl`",
)


def _is_records_line(doc: Any) -> bool:
    return isinstance(doc, dict) and "messages" in doc and ("objects" in doc or "width" in doc)


def _is_instances(doc: Any) -> bool:
    return (
        isinstance(doc, dict) and isinstance(doc.get("images"), list) and ("annotations" in doc or "categories" in doc)
    )


def _is_results(doc: Any) -> bool:
    return (
        isinstance(doc, list)
        and bool(doc)
        and isinstance(doc[0], dict)
        and "image_id" in doc[0]
        and "score" in doc[0]
        and ("bbox" in doc[0] or "segmentation" in doc[0])
    )


def _text(path: Path, limit: int) -> str:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read(limit)


def kind_of(path: str | Path) -> FileKind | None:
    """The kind of annotation file at `path` among those above, None when none (or unreadable)."""
    path = Path(path)
    try:
        big = path.stat().st_size > _PARSE_LIMIT
        text = _text(path, _PEEK if big else _PARSE_LIMIT + 1)
    except (OSError, EOFError, ValueError):
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        doc = None
    if doc is not None:
        if _is_instances(doc):
            return INSTANCES
        if _is_results(doc):
            return RESULTS
        if _is_records_line(doc):  # a records file of one line
            return RECORDS
        return None
    if "kind: RolloutMatchingJob" in text[:_PEEK]:  # YAML; JSON was tried above
        return JOB
    first = text.lstrip().split("\n", 1)[0]
    try:
        line = json.loads(first)
    except (ValueError, RecursionError):
        line = None
    if _is_records_line(line):
        return RECORDS
    # Too big to parse here, or pretty-printed and cut at the peek: the top-level keys say it.
    head = text.lstrip()[:_PEEK]
    if (
        head.startswith("{")
        and '"images"' in head
        and ('"annotations"' in head or '"categories"' in head or '"licenses"' in head)
    ):
        return INSTANCES
    if head.startswith("[") and '"score"' in head[:4096] and '"image_id"' in head[:4096]:
        return RESULTS
    return None


def wrong_kind(path: str | Path, expected: FileKind) -> str | None:
    """ "this is X, not Y: <command>" when `path` is a known kind other than `expected`, else None."""
    kind = kind_of(path)
    if kind is None or kind is expected:
        return None
    return f"this is {kind.name}, not {expected.name}: {kind.command}"
