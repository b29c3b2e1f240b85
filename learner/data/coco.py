"""COCO detection annotations to training records (`rmsft data from-coco`), and the check of a records file
(`rmsft data check`); docs/data.md.

Public API
- `convert_coco(annotations, images_dir, out, options) -> CocoSummary`: read a COCO instances file
  (`images`, `annotations`, `categories`), check every image, write one record per usable image
  (learner/data/records.py) to a `.jsonl` file, or gzip-compressed to a `.jsonl.gz` one (the loader reads
  both), and say what was converted and what was skipped, with a count per reason.
- `CocoOptions`: the prompt, the geometry written, the object cap, the image size limit, how image
  paths are written, whether a file without annotations is converted.
- `CocoError`: a file that is not a usable COCO instances file (the message names the file and key).
(`rmsft data check`, which reads what this writes, is learner/data/check.py.)

What becomes what:
- a category's `name` is the object's `desc`;
- an annotation with one polygon in `segmentation` becomes a `poly` (pixels, clamped to the image);
  with several polygons (an object split by an occluder) or an RLE mask (`{"counts", "size"}`) it
  becomes its `bbox` as a `bbox_2d`: a record's `poly` is one outline, and decoding RLE masks into
  outlines is not done here (both are counted in the summary); `geometry="box"` writes every object
  as its box;
- `iscrowd` 1 (or `true`, or the string "1", as some exporters write it) annotations are skipped: they mark a
  region of many instances, not one object, and COCO's own evaluation ignores them rather than counting them
  as objects; a value that is neither 0 nor 1 refuses the file, since guessing would either teach a crowd
  region as one object or drop an object;
- `bbox` [x, y, w, h] becomes [x, y, x + w, y + h], clamped to the image; a box of zero width or height
  after clamping is skipped;
- `{categories}` in the prompt becomes the names of the categories at least one written object has: a
  category no object uses (labelme's `_background_`, a placeholder id 0) would ask the model for something
  it is never shown.

Images are checked by the loader's own check (`ImageStore.inspect_file`: exists, Pillow opens and
verifies it, decodes it where verify checks nothing, at most `max_image_pixels`) and their size, so the
output loads. An image whose real size differs from the annotation's `width`/`height` is skipped: the
coordinates were drawn in the frame the annotation names, and rescaling them to another frame would
guess (a rotated or re-encoded copy moves objects, not just scales them). An image whose every
annotation was skipped is skipped too: written without objects it would teach the model that nothing
is there. An image with no annotation at all is written with no objects (a negative example) unless
`keep_empty=False`. Objects are written in reading order (top to bottom, then left to right), one
canonical answer per image as the synthetic tasks have. An RLE mask or a polygon in several parts is
not a crowd and not skipped: its box keeps the object in the answer.

Files that look like COCO but are not instances files are refused, not converted into nothing: a file with
no annotation at all (an image list such as image_info_test2017.json; `allow_no_annotations` converts it
into records without objects), a panoptic or a captions file (their annotations have no `bbox` or
`category_id`), two categories with one id (which name would their objects get?).

Torch-free: only PIL (through the image store) and the record schema.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import unicodedata
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from learner.core.codec import check_desc
from learner.data.images import ImageError, ImageStore
from learner.data.records import Record
from learner.data.wording import counted, listed
from rmsft.jobspec import VisionSpec

# Prompts that name the answer's keys of each output format (spec.training.format), as the shipped
# synthetic tasks' do; `{categories}` in a prompt is replaced by the names of the categories the written
# objects have, comma-separated.
DEFAULT_PROMPTS = {
    "coordexp": "Detect every object in the image. Answer in JSON with a description and a bbox_2d or poly for each.",
    "qwen_json": "Detect every object in the image. Answer with a JSON list of its bbox_2d and label for each.",
    "coordjson": "Detect every object in the image. Answer in JSON with a list of objects, a description and a "
    "bbox_2d or poly for each.",
}
CATEGORIES_PLACEHOLDER = "{categories}"
_DECIMALS = 2  # coordinates are kept to 1/100 pixel: finer means nothing on the 1000-bin grid
# What spec.training.data.path (and training.eval.data) take; the loader reads a .gz name through gzip.
OUT_SUFFIXES = (".jsonl", ".jsonl.gz")

# Reasons, as the summary prints them (one counter per reason).
SKIP_CROWD = "crowd annotation (iscrowd: 1)"
SKIP_UNKNOWN_IMAGE = "annotation of an image id not in `images`"
SKIP_UNKNOWN_CATEGORY = "annotation of a category id not in `categories`"
SKIP_BAD_CATEGORY = "category name unusable as a desc"
SKIP_BAD_BOX = "bbox missing or not 4 finite numbers"
SKIP_NEGATIVE_BOX = "bbox with a negative width or height"
SKIP_BAD_ID = "image_id or category_id not an integer id"
SKIP_EMPTY_BOX = "box of zero width or height inside the image"
IMG_MISSING = "image file missing"
IMG_UNUSABLE = "image unreadable, corrupt or over --max-image-pixels"
IMG_SIZE = "image size differs from the annotation's width/height"
IMG_ALL_SKIPPED = "every annotation of the image skipped"
IMG_TOO_MANY = "more objects than --max-objects"
IMG_EMPTY = "no annotation (--drop-empty)"
AS_BOX_MULTI = "polygon in several parts, written as its box"
AS_BOX_RLE = "RLE mask, written as its box"
AS_BOX_BAD_POLYGON = "polygon of fewer than 3 points or no area, written as its box"
AS_BOX_BAD_SEGMENTATION = "segmentation neither a list of polygons nor an RLE mask, written as its box"
# A category name longer than this is no object's name (a description pasted into the wrong field, say): every
# answer would repeat it once per object.
MAX_CATEGORY_NAME = 200
# The largest width/height read as a pixel size: int32, what image libraries hold a side in.
MAX_SIDE = (1 << 31) - 1


class CocoError(ValueError):
    """A COCO file that cannot be converted; the message names the file and the key at fault."""


@dataclass(frozen=True)
class CocoOptions:
    """How records are written. `prompt` None = the default prompt of `format`."""

    format: Literal["coordexp", "coordjson", "qwen_json"] = "coordexp"
    prompt: str | None = None
    geometry: Literal["auto", "box"] = "auto"  # auto: one-part polygons as poly, the rest as boxes
    max_objects: int | None = None
    keep_empty: bool = True
    # Image references: "out" relative to the output file's folder (the job needs no image_root),
    # "images" relative to IMAGES_DIR (set spec.training.data.image_root to it), "absolute".
    paths: Literal["out", "images", "absolute"] = "out"
    # Largest source image accepted: the job's spec.model.vision.maxImagePixels, which the loader enforces.
    max_image_pixels: int = VisionSpec.model_fields["max_image_pixels"].default
    # A file without any annotation (an image list, a test split) is refused unless this is set: converted,
    # it is records without objects, which teach the model that the images hold nothing.
    allow_no_annotations: bool = False

    def __post_init__(self) -> None:
        if self.format not in DEFAULT_PROMPTS:
            raise ValueError(f"format must be one of {', '.join(DEFAULT_PROMPTS)}, got {self.format!r}")
        if self.geometry not in ("auto", "box"):
            raise ValueError(f"geometry must be 'auto' or 'box', got {self.geometry!r}")
        if self.paths not in ("out", "images", "absolute"):
            raise ValueError(f"paths must be 'out', 'images' or 'absolute', got {self.paths!r}")
        if self.max_objects is not None and self.max_objects < 1:
            raise ValueError(f"max_objects must be >= 1, got {self.max_objects}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("the prompt must not be blank")


@dataclass
class CocoSummary:
    """What a conversion wrote and skipped. Every annotation read is counted once: written as an object, in
    `skipped_annotations`, or in `annotations_of_skipped_images` (usable, but its image was skipped)."""

    out: Path
    images_in: int = 0
    annotations_in: int = 0
    records: int = 0
    objects: int = 0
    polygons: int = 0
    boxes: int = 0
    empty_records: int = 0
    annotations_of_skipped_images: int = 0
    # Usable categories no written object has: left out of `{categories}` (only reported when the prompt has it).
    unused_categories: list[str] = field(default_factory=list)
    prompt_has_categories: bool = False
    skipped_annotations: Counter[str] = field(default_factory=Counter)
    skipped_images: Counter[str] = field(default_factory=Counter)
    as_box: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> first case, for the summary
    # Annotation ids used by more than one annotation (each is still converted: records are keyed by image).
    duplicate_ids: int = 0
    first_duplicate_id: str = ""

    def note(self, counter: Counter[str], reason: str, example: str) -> None:
        counter[reason] += 1
        self.examples.setdefault(reason, example)

    def lines(self) -> list[str]:
        """The summary as printed: totals first, then one line per reason with its count and first case."""
        out = [
            f"{counted(self.records, 'record')} with {counted(self.objects, 'object')} "
            f"({counted(self.polygons, 'polygon')}, {counted(self.boxes, 'box', 'boxes')}) written to {self.out}",
            f"read {counted(self.images_in, 'image')} and {counted(self.annotations_in, 'annotation')}; "
            f"{counted(self.empty_records, 'record')} without objects (images with no annotation)",
        ]
        for title, counter in (
            ("skipped annotations", self.skipped_annotations),
            ("skipped images", self.skipped_images),
            ("written as boxes", self.as_box),
        ):
            if counter:
                head = f"{title}: {sum(counter.values())}"
                if counter is self.skipped_images:
                    # Skipping an image drops its objects too; said here, since no annotation reason counts them.
                    head += f" ({counted(self.annotations_of_skipped_images, 'annotation')} of them not written)"
                out.append(head)
                out.extend(f"  {n} {reason} (first: {self.examples[reason]})" for reason, n in counter.most_common())
        if self.duplicate_ids:
            out.append(
                f"warning: {counted(self.duplicate_ids, 'annotation id')} used more than once (first: "
                f"{self.first_duplicate_id}): every annotation is converted, but a tool that looks "
                "annotations up by id (COCO's evaluation) cannot tell them apart"
            )
        if self.prompt_has_categories and self.unused_categories:
            left_out = counted(len(self.unused_categories), "category", "categories")
            out.append(
                f"{CATEGORIES_PLACEHOLDER} leaves out {left_out} no written object has: "
                f"{listed(self.unused_categories)}"
            )
        return out


def _not_instances(path: Path, annotations: list[Any]) -> str | None:
    """What kind of COCO file this is when its annotations are not detection annotations: panoptic and
    captions files have `images` and `annotations` too, and every annotation would otherwise be skipped one by
    one as "category id not in categories", hiding that the wrong file was given."""
    anns = [a for a in annotations if isinstance(a, dict)]
    if not anns or any("category_id" in a or "bbox" in a for a in anns):
        return None
    if any("segments_info" in a for a in anns):
        return (
            "a panoptic file (its annotations are segments_info lists and PNG file_names, with no bbox or category_id)"
        )
    if any("caption" in a for a in anns):
        return "a captions file (its annotations are captions, with no bbox or category_id)"
    return None


def _load(path: Path) -> dict[str, Any]:
    """The file's JSON with `images`, `categories` and `annotations` lists; a missing or null `annotations`
    (an image-list or test-split file has none) reads as an empty list, which `convert_coco` decides on."""
    from rmsft.file_kinds import INSTANCES, wrong_kind

    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CocoError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CocoError(
            f"{path}: is a folder; ANNOTATIONS is the COCO instances file (e.g. annotations/instances_train2017.json)"
        ) from None
    except OSError as exc:
        raise CocoError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        other = wrong_kind(path, INSTANCES)
        raise CocoError(f"{path}: {other or f'not valid JSON ({exc})'}") from None
    except RecursionError:
        raise CocoError(f"{path}: not a COCO file: JSON nested deeper than a parser follows") from None
    except ValueError as exc:  # an integer of over 4300 digits (Python's int conversion limit)
        raise CocoError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or ("annotations" not in doc and "categories" not in doc):
        other = wrong_kind(path, INSTANCES)  # a records file of one line, a results list
        if other is not None:
            raise CocoError(f"{path}: {other}")
    if not isinstance(doc, dict):
        raise CocoError(f"{path}: expected a JSON object with images, annotations and categories")
    if isinstance(doc.get("annotations"), list):
        # Before the keys: a captions file has no `categories`, and "key missing" would not say what it is.
        kind = _not_instances(path, doc["annotations"])
        if kind is not None:
            raise CocoError(
                f"{path}: this is not an instances (detection) file: it looks like {kind}; give the "
                "split's instances_*.json"
            )
    if doc.get("annotations") is None and isinstance(doc.get("images"), list):
        doc["annotations"] = []
    for key in ("images", "annotations", "categories"):
        if not isinstance(doc.get(key), list):
            raise CocoError(
                f"{path}: key {key!r} must be a list (a COCO instances file has images, annotations and categories)"
            )
    return doc


def _entry(path: Path, key: str, i: int, item: Any, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """One entry of `images`/`categories` with its required fields checked (these are the file's own
    structure: a bad one stops the conversion instead of being skipped)."""
    if not isinstance(item, dict):
        raise CocoError(f"{path}: {key}[{i}] must be an object")
    for name, kind in fields.items():
        value = item.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            names: dict[type | tuple[type, ...], str] = {int: "an integer", str: "a string"}
            what = names.get(kind, "a number")
            raise CocoError(f"{path}: {key}[{i}].{name} is missing or not {what} ({_short(value)})")
    return item


def _pixels(path: Path, i: int, image: dict[str, Any], key: str) -> int:
    """An image's `width` or `height` as an integer. Some exporters write 500.0: a whole number is a size as
    good as 500; 500.5 or 0 is no pixel size, and the record's frame would be a guess."""
    value = image.get(key)
    name = image["file_name"]
    where = f"{path}: images[{i}] (id {image['id']}, {name if len(name) <= 80 else name[:80] + '...'})"
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise CocoError(f"{where}: {key} is missing or not a number ({_short(value)})")
    # an int is whole as it is (float() of a 400-digit one would overflow)
    if not isinstance(value, int) and not (math.isfinite(value) and value.is_integer()):
        raise CocoError(f"{where}: {key} {value!r} is not a whole number of pixels")
    if value < 1:
        raise CocoError(f"{where}: {key} {value!r} must be >= 1")
    if value > MAX_SIDE:
        raise CocoError(f"{where}: {key} {_short(value)} is not a pixel size (at most {MAX_SIDE})")
    return int(value)


def _short(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters: a message quotes the value at fault, not 10,000 characters."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str() limit
        return f"<an integer of over {limit} digits>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _name_problem(name: str) -> str | None:
    """Why a category name cannot be an object's desc, None when it can: what `check_desc` refuses (blank,
    coordinate-token text), and what it lets through but no answer should carry: a line break or another
    control character (the answer is one line of JSON), an invisible format character (a zero-width space
    makes two names that look the same), a name of over MAX_CATEGORY_NAME characters."""
    try:
        check_desc(name)
    except ValueError as exc:
        return str(exc)
    for ch in name:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            what = {"\n": "a line break", "\r": "a carriage return", "\t": "a tab"}.get(ch) or (
                "a control character"
                if unicodedata.category(ch) == "Cc"
                else unicodedata.name(ch, "").lower() or "an invisible character"
            )
            return f"holds {what} (U+{ord(ch):04X})"
    if len(name) > MAX_CATEGORY_NAME:
        return f"{len(name)} characters long (at most {MAX_CATEGORY_NAME})"
    return None


_CROWD_WORDS = {"0": False, "1": True, "false": False, "true": True}


def _is_crowd(value: Any) -> bool | None:
    """`iscrowd` as a flag (absent or null: not a crowd); None for a value that says neither."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return _CROWD_WORDS.get(value.strip().lower())
    return None


def _finite(values: Any, n: int | None = None) -> list[float] | None:
    if not isinstance(values, list) or (n is not None and len(values) != n):
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    try:
        out = [float(v) for v in values]
    except OverflowError:  # an integer past float's range is no coordinate
        return None
    return out if all(math.isfinite(v) for v in out) else None


def _clamp(v: float, hi: int) -> float | int:
    v = round(min(max(v, 0.0), float(hi)), _DECIMALS)
    return int(v) if v.is_integer() else v  # 12, not 12.0: COCO's integer pixels stay integers


def _geometry(
    ann: dict[str, Any], width: int, height: int, geometry: str
) -> tuple[dict[str, list[float]] | None, str | None, str | None]:
    """(geometry, skip reason, why a segmented object became a box) of one annotation. An annotation
    without segmentation (a detection-only file) is a box as a matter of course: nothing to report."""
    # The bbox first, whatever the segmentation: an annotation whose bbox is garbage is skipped (docs/data.md),
    # even when its polygon would be written; the two disagree, and which is right is not guessed.
    bbox = _finite(ann.get("bbox"), 4)
    if bbox is None:
        return None, SKIP_BAD_BOX, None
    x, y, w, h = bbox
    if w < 0 or h < 0:
        return None, SKIP_NEGATIVE_BOX, None
    box = [_clamp(x, width), _clamp(y, height), _clamp(x + w, width), _clamp(y + h, height)]
    if box[2] <= box[0] or box[3] <= box[1]:
        return None, SKIP_EMPTY_BOX, None
    seg = ann.get("segmentation")
    as_box = None
    if geometry == "auto" and isinstance(seg, dict):
        as_box = AS_BOX_RLE
    elif (
        geometry == "auto"
        and seg is not None
        and not (isinstance(seg, list) and all(isinstance(part, list) for part in seg))
    ):
        as_box = AS_BOX_BAD_SEGMENTATION  # "polygon" (a string), a flat list of numbers, a number
    elif geometry == "auto" and len(seg or []) > 1:
        as_box = AS_BOX_MULTI
    elif geometry == "auto" and seg and len(seg) == 1:
        part = _finite(seg[0])
        if part is not None and len(part) >= 6 and len(part) % 2 == 0:
            poly = [_clamp(v, width if k % 2 == 0 else height) for k, v in enumerate(part)]
            xs, ys = poly[0::2], poly[1::2]
            if max(xs) > min(xs) and max(ys) > min(ys):
                return {"poly": poly}, None, None
        as_box = AS_BOX_BAD_POLYGON
    return {"bbox_2d": box}, None, as_box


def _check_image(store: ImageStore, path: Path, width: int, height: int) -> tuple[str, str] | None:
    """(reason, what exactly) when the image cannot be used, else None: the loader's own check."""
    if not path.is_file():
        return IMG_MISSING, str(path)
    try:
        size = store.inspect_file(path)
    except ImageError as exc:
        return IMG_UNUSABLE, str(exc)
    if size != (width, height):
        return IMG_SIZE, f"{path} is {size[0]}x{size[1]}, the annotation says {width}x{height}"
    return None


def _reading_order(obj: dict[str, Any]) -> tuple[float, float]:
    if "bbox_2d" in obj:
        return obj["bbox_2d"][1], obj["bbox_2d"][0]
    return min(obj["poly"][1::2]), min(obj["poly"][0::2])


def _image_ref(path: Path, file_name: str, out: Path, paths: str) -> str:
    if paths == "images":
        return file_name
    if paths == "absolute":
        return str(path.resolve())
    return os.path.relpath(path.resolve(), out.resolve().parent)


def _check_out(out: Path) -> None:
    """Refuse an OUT that cannot be written before anything is read or written: found after the conversion, it
    would leave OUT.tmp behind and say only what the OS said."""
    if not out.name.endswith(OUT_SUFFIXES):
        raise CocoError(
            f"{out}: the output must be a .jsonl file, or .jsonl.gz for gzip (what spec.training.data.path takes)"
        )
    if out.is_dir():
        raise CocoError(f"{out}: is a folder; OUT is the file to write (e.g. {out / 'train.jsonl'})")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise CocoError(f"{out}: cannot be written: {above} is a file, not a folder")


@contextmanager
def _writer(tmp: Path, out: Path) -> Iterator[TextIO]:
    """Text written to `tmp`, gzip-compressed when OUT is a .gz file (the loader reads .gz through gzip)."""
    with tmp.open("wb") as raw:
        if not out.name.endswith(".gz"):
            with io.TextIOWrapper(raw, encoding="utf-8") as f:
                yield f
            return
        # OUT's name in the header, not the temporary one (gunzip -N restores it), and mtime 0: the same
        # conversion writes the same bytes.
        with (
            gzip.GzipFile(filename=out.name, mode="wb", fileobj=raw, mtime=0) as gz,
            io.TextIOWrapper(gz, encoding="utf-8") as f,
        ):
            yield f


def convert_coco(
    annotations: str | Path, images_dir: str | Path, out: str | Path, options: CocoOptions | None = None
) -> CocoSummary:
    """Convert a COCO instances file to a JSONL of training records at `out` (overwritten; gzip when it ends in
    .gz); see the module docstring for what becomes what. Raises `CocoError` for a file that is not COCO
    instances or that yields no record, and for an `out` that cannot be written (nothing is left behind)."""
    options = options or CocoOptions()
    annotations, images_dir, out = Path(annotations), Path(images_dir), Path(out)
    _check_out(out)
    if not images_dir.is_dir():
        raise CocoError(f"{images_dir}: no such folder (IMAGES_DIR: the folder the images' file_name are relative to)")
    doc = _load(annotations)
    summary = CocoSummary(out=out, images_in=len(doc["images"]), annotations_in=len(doc["annotations"]))

    categories: dict[int, str | None] = {}
    raw_names: dict[int, str] = {}
    name_problems: dict[int, str] = {}  # category id -> why its name is no desc, for the summary's example
    for i, raw in enumerate(doc["categories"]):
        cat = _entry(annotations, "categories", i, raw, {"id": int, "name": str})
        if cat["id"] in raw_names:  # the last would win silently, renaming every object of the first
            raise CocoError(
                f"{annotations}: categories[{i}].id {cat['id']} is used by {raw_names[cat['id']]!r} "
                f"and {cat['name']!r}; category ids must be unique"
            )
        raw_names[cat["id"]] = cat["name"]
        problem = _name_problem(cat["name"])
        categories[cat["id"]] = None if problem else check_desc(cat["name"])  # None: its annotations are skipped
        if problem:
            name_problems[cat["id"]] = f"{_short(cat['name'], 40)} {problem}"
    images: dict[int, dict[str, Any]] = {}
    for i, raw in enumerate(doc["images"]):
        img = _entry(annotations, "images", i, raw, {"id": int, "file_name": str})
        if img["id"] in images:
            raise CocoError(f"{annotations}: images[{i}].id {img['id']} is used by another image too")
        images[img["id"]] = {
            **img,
            "width": _pixels(annotations, i, img, "width"),
            "height": _pixels(annotations, i, img, "height"),
        }

    # After the structure's checks, which say more about a broken file than "no annotations" would.
    if not doc["annotations"] and not options.allow_no_annotations:
        raise CocoError(
            f"{annotations}: the file has no annotations (it looks like an image-list or test-split "
            "file): every record would be without objects; --allow-no-annotations converts it anyway"
        )

    # Per image: (object, why it is a box when it is one by fallback, where) - counted once written.
    objects: dict[int, list[tuple[dict[str, Any], str | None, str]]] = {image_id: [] for image_id in images}
    annotated: Counter[int] = Counter()  # annotations per image, skipped ones included
    ann_ids: Counter[Any] = Counter()
    for i, ann in enumerate(doc["annotations"]):
        if not isinstance(ann, dict):
            raise CocoError(f"{annotations}: annotations[{i}] must be an object")
        where = f"annotation id {_short(ann.get('id', f'#{i}'))}"
        if isinstance(ann.get("id"), int | str) and not isinstance(ann.get("id"), bool):
            ann_ids[ann["id"]] += 1
            if ann_ids[ann["id"]] == 2:
                summary.duplicate_ids += 1
                summary.first_duplicate_id = summary.first_duplicate_id or f"id {_short(ann['id'])}"
        image_id, cat_id = ann.get("image_id"), ann.get("category_id")
        # true is an int to Python (image 1), not an id to the file's author
        if isinstance(image_id, bool) or isinstance(cat_id, bool):
            summary.note(
                summary.skipped_annotations,
                SKIP_BAD_ID,
                f"{where}, image_id {_short(image_id)}, category_id {_short(cat_id)}",
            )
            continue
        image = images.get(image_id) if isinstance(image_id, int) else None
        if image is None:
            summary.note(summary.skipped_annotations, SKIP_UNKNOWN_IMAGE, f"{where}, image_id {_short(image_id)}")
            continue
        annotated[image["id"]] += 1
        crowd = _is_crowd(ann.get("iscrowd"))
        if crowd is None:
            raise CocoError(
                f"{annotations}: annotations[{i}] ({where}): iscrowd {_short(ann['iscrowd'])} is neither 0 "
                "nor 1 (nor true/false); whether it is one object or a crowd region is not guessed"
            )
        if crowd:
            summary.note(summary.skipped_annotations, SKIP_CROWD, where)
            continue
        if not isinstance(cat_id, int) or cat_id not in categories:
            summary.note(summary.skipped_annotations, SKIP_UNKNOWN_CATEGORY, f"{where}, category_id {_short(cat_id)}")
            continue
        desc = categories[cat_id]
        if desc is None:
            why = f": {name_problems[cat_id]}" if cat_id in name_problems else ""
            summary.note(summary.skipped_annotations, SKIP_BAD_CATEGORY, f"{where}, category_id {cat_id!r}{why}")
            continue
        geometry, skip, as_box = _geometry(ann, image["width"], image["height"], options.geometry)
        if geometry is None:
            summary.note(summary.skipped_annotations, skip or SKIP_BAD_BOX, where)
            continue
        objects[image["id"]].append(({"desc": desc, **geometry}, as_box, where))

    # Images first, then the prompt: `{categories}` names what the written objects have, which is known only
    # once every image is checked (an image that is skipped takes its objects with it).
    store = ImageStore(None, out, options.max_image_pixels, cache_images=0)
    kept: list[tuple[dict[str, Any], list[tuple[dict[str, Any], str | None, str]], Path]] = []
    for image_id, image in images.items():
        name = image["file_name"]
        entries = sorted(objects[image_id], key=lambda e: _reading_order(e[0]))
        skipped: tuple[str, str] | None = None
        if not entries:
            reason = IMG_ALL_SKIPPED if annotated[image_id] else (None if options.keep_empty else IMG_EMPTY)
            skipped = None if reason is None else (reason, name)
        if skipped is None and options.max_objects is not None and len(entries) > options.max_objects:
            skipped = IMG_TOO_MANY, f"{name} ({len(entries)} objects)"
        path = images_dir / name
        if skipped is None:
            skipped = _check_image(store, path, image["width"], image["height"])
        if skipped is not None:
            summary.note(summary.skipped_images, *skipped)
            summary.annotations_of_skipped_images += len(entries)
            continue
        kept.append((image, entries, path))

    usable = sorted({n for n in categories.values() if n})
    used = sorted({obj["desc"] for _, entries, _ in kept for obj, _, _ in entries})
    # No object at all (allow_no_annotations): the file's categories are all there is to name.
    names = used or usable
    summary.unused_categories = [n for n in usable if n not in set(names)]
    template = options.prompt or DEFAULT_PROMPTS[options.format]
    summary.prompt_has_categories = CATEGORIES_PLACEHOLDER in template
    prompt = template.replace(CATEGORIES_PLACEHOLDER, ", ".join(names))
    records = []
    for image, entries, path in kept:
        objs = [obj for obj, _, _ in entries]
        record = {
            "id": str(image["id"]),
            "width": image["width"],
            "height": image["height"],
            "messages": [{"role": "user", "content": prompt}],
            "images": [_image_ref(path, image["file_name"], out, options.paths)],
            "objects": objs,
        }
        if "neg_category_ids" in image or "not_exhaustive_category_ids" in image:  # an LVIS file: its verification

            def named(ids: Any) -> list[str]:
                return sorted({name for i in ids or () if (name := categories.get(i))})

            record["lvis"] = {
                "pos_categories": sorted({o["desc"] for o in objs}),
                "neg_categories": named(image.get("neg_category_ids")),
                "not_exhaustive_categories": named(image.get("not_exhaustive_category_ids")),
            }
        Record.model_validate(record)  # what the learner's loader will check; a failure here is a bug
        records.append(record)
        for _, as_box, where in entries:
            if as_box is not None:
                summary.note(summary.as_box, as_box, where)
        summary.records += 1
        summary.objects += len(objs)
        summary.polygons += sum("poly" in o for o in objs)
        summary.empty_records += not objs
    summary.boxes = summary.objects - summary.polygons
    if summary.records == 0:
        raise CocoError(f"{annotations}: no image could be converted:\n" + "\n".join(summary.lines()[1:]))
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _writer(tmp, out) as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        tmp.replace(out)  # never a half-written dataset at OUT
    except OSError as exc:  # a full disk, a folder that appeared at OUT meanwhile: nothing left behind
        tmp.unlink(missing_ok=True)
        raise CocoError(f"{out}: cannot be written ({exc.strerror or exc})") from None
    return summary
