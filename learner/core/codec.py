"""Object format: the detection objects and how they are written as model output.

Public API
- `DetObject(desc, kind, bins)`: one object; `kind` is "bbox_2d" (4 bins x1,y1,x2,y2) or "poly"
  (even count >= 6); bins are ints on the 1000-bin grid. Every format, the parser and the matcher
  work on it, so its rules are the one place validity is decided:
  - `desc` is stripped of surrounding whitespace (a predicted " cat " is "cat", and appended
    ground truth never carries stray spaces into the supervised tail); blank after stripping, or
    holding coordinate-token text (`<|coord_`), is refused (`check_desc`);
  - a box with reversed corners (x2 < x1 or y2 < y1) is refused: the parser drops it (counted in
    `n_dropped`, never repaired, never matched) and ground truth refuses it at load
    (learner/data/records.py). Zero-width/height boxes (x1 == x2) are allowed.
- `pixel_to_bin(v, size)`, `bin_to_pixel(k, size)`, `DetObject.from_pixels(...)`: grid conversion,
  `round(v / size * 1000)` clamped to 0..999.
- `OutputFormat`: the interface a format implements (its container, rendering, strict validation
  of one parsed entry, binding to an image size).
- `output_format(name, coordinates="relative", polygons="pairs") -> OutputFormat`: the format the
  job spec's `training.format` / `training.format_options` name.
- `CoordExpFormat(polygons="pairs")` / `COORDEXP`: single-line JSON `{"object_1": {"desc": "...",
  "bbox_2d": ["<|coord_k|>", ...]}, ...}` with separators `", "` and `": "`; coordinates are coord
  tokens (coordinate losses apply). A "poly" is read as a flat list of coords or as a list of
  `[x, y]` pairs (both forms are accepted on parse, mixing them is not); it is written as pairs
  (CoordExp's own form) unless `polygons="flat"`.
- `CoordJsonFormat()` / `COORDJSON`: the reference's (CoordExp's) own answer since 2026-02, "CoordJSON":
  `{"objects": [{"desc": "cat", "bbox_2d": [<|coord_12|>, <|coord_56|>, <|coord_200|>, <|coord_512|>]}, ...]}`,
  one top-level key `objects` holding a list, coordinate tokens *bare* (not quoted: the text is JSON once each
  token is read as a value), a poly a flat list; separators `", "` and `": "`, the empty answer `{"objects": []}`.
  Written desc first (the reference's `object_field_order: desc_first`); a record with the geometry first is read
  too. Strict validation as the reference's salvage parse: keys exactly {"desc", one geometry}, every coordinate
  a bare coord token (a quoted one, an integer or a nested poly pair drops the record).
- `QwenJsonFormat(coordinates="relative")` / `QWEN_JSON`: the native grounding answer of
  Qwen2.5-VL / Qwen3-VL, a JSON list `[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}, ...]` with
  integer coordinates as plain text (no coord tokens: cross-entropy only). `coordinates`:
  - "relative": integers 0..1000 relative to the image (Qwen3-VL); value v is bin min(v, 999) and
    bin b is written as b;
  - "pixels": absolute pixels of the image as the processor resized it (Qwen2.5-VL). Such a format
    must be bound to that size with `for_image(width, height)`; an unbound one raises
    `FormatError` when it converts anything. Bins and pixels convert through the grid
    (`pixel_to_bin`, and `round(bin_to_pixel)` when written), so with images under 1000 pixels a
    side, several bins write as the same pixel: one pixel of precision is all that format has.
  Strict validation: keys exactly {"bbox_2d", "label"}, 4 ints (not bools, not floats) within
  range (0..1000, or 0..width / 0..height), a non-blank label; anything else is dropped.
  Ground-truth polygons cannot be written in this format: `as_written` turns a polygon into its
  enclosing box, and the learner applies it to the ground truth before matching, so the matcher
  compares and the targets append exactly what the model is asked to write.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeGuard

NUM_BINS = 1000
QWEN_RELATIVE_MAX = 1000  # Qwen3-VL writes relative coordinates as integers 0..1000 inclusive
Kind = Literal["bbox_2d", "poly"]
GEOMETRY_KINDS: tuple[Kind, ...] = ("bbox_2d", "poly")
FORMAT_NAMES = ("coordexp", "coordjson", "qwen_json")
Container = Literal["object", "list", "objects"]
# The "objects" container's opener and closer: a top-level object whose one key holds the list of entries.
OBJECTS_OPEN, OBJECTS_CLOSE = '{"objects": [', "]}"
_COORD_RE = re.compile(r"<\|coord_(\d{1,3})\|>")
_KEY_RE = re.compile(r"object_([1-9]\d{0,8})")
_COORD_TEXT = "<|coord_"


class FormatError(ValueError):
    """A format used in a way it cannot be (unknown name or option, an unbound pixels format)."""


def coord_token_text(k: int) -> str:
    return f"<|coord_{k}|>"


def coord_bin_from_text(text: str) -> int | None:
    """Bin of a string that is exactly one coord token, else None."""
    m = _COORD_RE.fullmatch(text)
    if m is None or (len(m.group(1)) > 1 and m.group(1)[0] == "0"):
        return None
    k = int(m.group(1))
    return k if k < NUM_BINS else None


def pixel_to_bin(v: float, size: float) -> int:
    if size <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    return min(NUM_BINS - 1, max(0, round(v / size * NUM_BINS)))


def bin_to_pixel(k: int, size: float) -> float:
    return k / NUM_BINS * size


def check_desc(desc: object) -> str:
    """The object description as every format keeps it (stripped), or ValueError saying why not."""
    if not isinstance(desc, str):
        raise ValueError(f"object desc must be a string, got {type(desc).__name__}")
    stripped = desc.strip()
    if not stripped:
        raise ValueError("object desc must not be blank")
    # Coordinate-token text in a name would tokenize to coord tokens inside a string the parser
    # treats as plain text, and break the coord-token bookkeeping of the appended tail.
    if _COORD_TEXT in stripped:
        raise ValueError(f"object desc must not contain coordinate-token text ({_COORD_TEXT!r}): {desc!r}")
    return stripped


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class DetObject:
    desc: str
    kind: Kind
    bins: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "desc", check_desc(self.desc))
        object.__setattr__(self, "bins", tuple(self.bins))
        if self.kind == "bbox_2d":
            if len(self.bins) != 4:
                raise ValueError(f"bbox_2d needs 4 coords, got {len(self.bins)}")
        elif self.kind == "poly":
            if len(self.bins) < 6 or len(self.bins) % 2:
                raise ValueError(f"poly needs an even count >= 6 of coords, got {len(self.bins)}")
        else:
            raise ValueError(f"unknown geometry kind {self.kind!r}; expected one of {GEOMETRY_KINDS}")
        for b in self.bins:
            if not _is_int(b) or not 0 <= b < NUM_BINS:
                raise ValueError(f"coord bin {b!r} outside 0..{NUM_BINS - 1}")
        if self.kind == "bbox_2d":
            x1, y1, x2, y2 = self.bins
            if x2 < x1 or y2 < y1:
                raise ValueError(f"bbox_2d {list(self.bins)} has reversed corners (x2 < x1 or y2 < y1)")

    @classmethod
    def from_pixels(cls, desc: str, kind: Kind, coords: Sequence[float], width: float, height: float) -> DetObject:
        """Pixel coords (x, y alternating) to bins on the image's own width/height."""
        bins = tuple(pixel_to_bin(v, width if i % 2 == 0 else height) for i, v in enumerate(coords))
        return cls(desc, kind, bins)

    def enclosing_box(self) -> DetObject:
        """The object's axis-aligned bounding box (itself for a box)."""
        if self.kind == "bbox_2d":
            return self
        xs, ys = self.bins[0::2], self.bins[1::2]
        return DetObject(self.desc, "bbox_2d", (min(xs), min(ys), max(xs), max(ys)))


class OutputFormat(Protocol):
    """What the parser and target builder need from an output format. Its four facts are read-only (properties
    here): the formats give them as class constants, or (`needs_image_size`) as a property of their options."""

    @property
    def name(self) -> str: ...
    # "object": a top-level JSON object of `"object_N": {...}` entries; "list": a top-level JSON list
    # of `{...}` entries; "objects": `{"objects": [{...}, ...]}`. The parser's scanner and the appended tail's
    # closing bracket follow it.
    @property
    def container(self) -> Container: ...
    # Whether coordinates are coord tokens (coordinate losses) or plain text (cross-entropy only).
    @property
    def coord_tokens(self) -> bool: ...
    # Coord tokens written bare as array elements (CoordJSON) rather than each alone in a JSON string.
    @property
    def bare_coords(self) -> bool: ...
    # True when coordinates are measured on the processor-resized image: bind with `for_image` first.
    @property
    def needs_image_size(self) -> bool: ...

    def render_entries(self, objects: Sequence[DetObject], start_index: int) -> str:
        """The entries without the container's brackets, joined by `", "`: `"object_{start}": {...},
        "object_{start+1}": {...}` for an object container (a list container ignores `start_index`)."""
        ...

    def render(self, objects: Sequence[DetObject]) -> str:
        """A complete answer."""
        ...

    def object_index(self, key: str) -> int | None:
        """The N of a valid entry key, else None (a list container has no keys: always None)."""
        ...

    def validate_entry(self, key: str | None, value: Any) -> DetObject | None:
        """Strictly validate one parsed entry (`key` is None for a list container's entries); None
        means drop it (never repaired)."""
        ...

    def desc_value_spans(self, entries_text: str) -> list[tuple[int, int]]:
        """Character spans of desc/label values (inside the quotes) in text from `render_entries`."""
        ...

    def as_written(self, obj: DetObject) -> DetObject:
        """The object as this format can write it (what ground truth must be compared as)."""
        ...

    def for_image(self, width: int, height: int) -> OutputFormat:
        """This format for an image of that (processor-resized) size; itself when sizes do not matter."""
        ...


def container_brackets(container: Container) -> tuple[str, str]:
    """The opening and closing bracket of a format's container (the "objects" container's are several
    characters: `{"objects": [` and `]}`)."""
    if container == "objects":
        return OBJECTS_OPEN, OBJECTS_CLOSE
    return ("[", "]") if container == "list" else ("{", "}")


@dataclass(frozen=True)
class CoordExpFormat:
    polygons: Literal["pairs", "flat"] = "pairs"
    name: ClassVar[str] = "coordexp"
    container: ClassVar[Container] = "object"
    coord_tokens: ClassVar[bool] = True
    bare_coords: ClassVar[bool] = False
    needs_image_size: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.polygons not in ("pairs", "flat"):
            raise FormatError(f"training.format_options.polygons: expected 'pairs' or 'flat', got {self.polygons!r}")

    def _geometry(self, obj: DetObject) -> str:
        tokens = [f'"{coord_token_text(b)}"' for b in obj.bins]
        if obj.kind == "poly" and self.polygons == "pairs":
            return ", ".join(f"[{tokens[i]}, {tokens[i + 1]}]" for i in range(0, len(tokens), 2))
        return ", ".join(tokens)

    def _value(self, obj: DetObject) -> str:
        return f'{{"desc": {json.dumps(obj.desc, ensure_ascii=False)}, "{obj.kind}": [{self._geometry(obj)}]}}'

    def render_entries(self, objects: Sequence[DetObject], start_index: int) -> str:
        return ", ".join(f'"object_{start_index + i}": {self._value(o)}' for i, o in enumerate(objects))

    def render(self, objects: Sequence[DetObject]) -> str:
        return "{" + self.render_entries(objects, 1) + "}"

    def object_index(self, key: str) -> int | None:
        m = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
        return int(m.group(1)) if m else None

    @staticmethod
    def _coord_texts(kind: str, coords: object) -> list[str] | None:
        """The coord strings of a geometry value, flat; a poly may also be a list of [x, y] pairs."""
        if not isinstance(coords, list) or not coords:
            return None
        if all(isinstance(c, str) for c in coords):
            return coords
        if kind == "poly" and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(c, str) for c in p) for p in coords
        ):
            return [c for p in coords for c in p]
        return None

    def validate_entry(self, key: str | None, value: Any) -> DetObject | None:
        if key is None or self.object_index(key) is None or not isinstance(value, dict):
            return None
        kinds = [k for k in GEOMETRY_KINDS if k in value]
        if len(kinds) != 1 or set(value) != {"desc", kinds[0]}:
            return None
        texts = self._coord_texts(kinds[0], value[kinds[0]])
        if texts is None:
            return None
        parsed = [coord_bin_from_text(c) for c in texts]
        bins = [b for b in parsed if b is not None]
        if len(bins) != len(parsed):
            return None
        try:
            return DetObject(value["desc"], kinds[0], tuple(bins))
        except ValueError:
            return None

    def desc_value_spans(self, entries_text: str) -> list[tuple[int, int]]:
        spans = []
        for m in re.finditer(r'\{"desc": "((?:[^"\\]|\\.)*)"', entries_text):
            spans.append((m.start(1), m.end(1)))
        return spans

    def as_written(self, obj: DetObject) -> DetObject:
        return obj

    def for_image(self, width: int, height: int) -> CoordExpFormat:
        return self  # coord tokens are relative to the image: no size to bind


@dataclass(frozen=True)
class CoordJsonFormat:
    """The reference's CoordJSON (module doc). The parser hands `validate_entry` each bare coord token as the
    string `"<|coord_k|>"` (it makes the entry JSON so), and counts the entry's bare coord tokens: a coordinate
    written any other way leaves the count short and drops the record."""

    name: ClassVar[str] = "coordjson"
    container: ClassVar[Container] = "objects"
    coord_tokens: ClassVar[bool] = True
    bare_coords: ClassVar[bool] = True
    needs_image_size: ClassVar[bool] = False

    def _value(self, obj: DetObject) -> str:
        coords = ", ".join(coord_token_text(b) for b in obj.bins)
        return f'{{"desc": {json.dumps(obj.desc, ensure_ascii=False)}, "{obj.kind}": [{coords}]}}'

    def render_entries(self, objects: Sequence[DetObject], start_index: int) -> str:
        return ", ".join(self._value(o) for o in objects)

    def render(self, objects: Sequence[DetObject]) -> str:
        return OBJECTS_OPEN + self.render_entries(objects, 1) + OBJECTS_CLOSE

    def object_index(self, key: str) -> int | None:
        return None

    def validate_entry(self, key: str | None, value: Any) -> DetObject | None:
        if key is not None or not isinstance(value, dict):
            return None
        kinds = [k for k in GEOMETRY_KINDS if k in value]
        if len(kinds) != 1 or set(value) != {"desc", kinds[0]}:
            return None
        coords = value[kinds[0]]
        if not isinstance(coords, list) or not coords or not all(isinstance(c, str) for c in coords):
            return None  # a poly of [x, y] pairs is not CoordJSON (the reference drops it too)
        bins = [coord_bin_from_text(c) for c in coords]
        if any(b is None for b in bins):
            return None
        try:
            return DetObject(value["desc"], kinds[0], tuple(bins))  # type: ignore[arg-type]
        except ValueError:
            return None

    def desc_value_spans(self, entries_text: str) -> list[tuple[int, int]]:
        return [(m.start(1), m.end(1)) for m in re.finditer(r'\{"desc": "((?:[^"\\]|\\.)*)"', entries_text)]

    def as_written(self, obj: DetObject) -> DetObject:
        return obj

    def for_image(self, width: int, height: int) -> CoordJsonFormat:
        return self


@dataclass(frozen=True)
class QwenJsonFormat:
    coordinates: Literal["relative", "pixels"] = "relative"
    # The processor-resized image size a "pixels" format converts with; set by `for_image`.
    width: int | None = None
    height: int | None = None
    name: ClassVar[str] = "qwen_json"
    container: ClassVar[Container] = "list"
    coord_tokens: ClassVar[bool] = False
    bare_coords: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.coordinates not in ("relative", "pixels"):
            raise FormatError(
                f"training.format_options.coordinates: expected 'relative' or 'pixels', got {self.coordinates!r}"
            )
        if (self.width is None) != (self.height is None):
            raise FormatError("qwen_json: give both width and height, or neither")
        if self.width is not None and not (
            _is_int(self.width) and _is_int(self.height) and self.width > 0 and self.height > 0
        ):
            raise FormatError(f"qwen_json: image size must be positive integers, got {self.width}x{self.height}")

    @property
    def needs_image_size(self) -> bool:
        return self.coordinates == "pixels"

    def for_image(self, width: int, height: int) -> QwenJsonFormat:
        if self.coordinates == "relative":
            return self
        return dataclasses.replace(self, width=int(width), height=int(height))

    def _sizes(self) -> tuple[int, int]:
        if self.width is None or self.height is None:
            raise FormatError(
                "qwen_json with format_options.coordinates 'pixels' writes pixels of the resized image: bind the "
                "format to that size with for_image(width, height) before rendering or parsing"
            )
        return self.width, self.height

    def _write(self, b: int, axis: int) -> int:
        if self.coordinates == "relative":
            return b
        size = self._sizes()[axis]
        return round(bin_to_pixel(b, size))

    def _read(self, v: object, axis: int) -> int | None:
        if not _is_int(v):
            return None
        if self.coordinates == "relative":
            return min(v, NUM_BINS - 1) if 0 <= v <= QWEN_RELATIVE_MAX else None
        size = self._sizes()[axis]
        return pixel_to_bin(v, size) if 0 <= v <= size else None

    def _value(self, obj: DetObject) -> str:
        box = self.as_written(obj)
        coords = ", ".join(str(self._write(b, i % 2)) for i, b in enumerate(box.bins))
        return f'{{"bbox_2d": [{coords}], "label": {json.dumps(box.desc, ensure_ascii=False)}}}'

    def render_entries(self, objects: Sequence[DetObject], start_index: int) -> str:
        return ", ".join(self._value(o) for o in objects)

    def render(self, objects: Sequence[DetObject]) -> str:
        return "[" + self.render_entries(objects, 1) + "]"

    def object_index(self, key: str) -> int | None:
        return None

    def validate_entry(self, key: str | None, value: Any) -> DetObject | None:
        if key is not None or not isinstance(value, dict) or set(value) != {"bbox_2d", "label"}:
            return None
        coords = value["bbox_2d"]
        if not isinstance(coords, list) or len(coords) != 4:
            return None
        read = [self._read(v, i % 2) for i, v in enumerate(coords)]
        bins = [b for b in read if b is not None]
        if len(bins) != len(read):
            return None
        try:
            return DetObject(value["label"], "bbox_2d", tuple(bins))
        except ValueError:
            return None

    def desc_value_spans(self, entries_text: str) -> list[tuple[int, int]]:
        # Anchored on the box's closing `]`: inside a JSON string the quotes would be escaped, so
        # `], "label": "` only ever occurs where a rendered entry puts it.
        return [(m.start(1), m.end(1)) for m in re.finditer(r'\], "label": "((?:[^"\\]|\\.)*)"', entries_text)]

    def as_written(self, obj: DetObject) -> DetObject:
        return obj.enclosing_box()


COORDEXP = CoordExpFormat()
COORDJSON = CoordJsonFormat()
QWEN_JSON = QwenJsonFormat()


def output_format(
    name: str,
    coordinates: Literal["relative", "pixels"] = "relative",
    polygons: Literal["pairs", "flat"] = "pairs",
) -> OutputFormat:
    """The format `training.format` names, with its `training.format_options` (each option applies to
    one format only: `coordinates` to qwen_json, `polygons` to coordexp; the other is ignored, and coordjson
    ignores both)."""
    if name == "coordexp":
        if coordinates not in ("relative", "pixels"):
            raise FormatError(
                f"training.format_options.coordinates: expected 'relative' or 'pixels', got {coordinates!r}"
            )
        return CoordExpFormat(polygons=polygons)
    if name == "coordjson":  # no options: coordinate tokens, flat polygons (the job spec refuses both options)
        return COORDJSON
    if name == "qwen_json":
        if polygons not in ("pairs", "flat"):
            raise FormatError(f"training.format_options.polygons: expected 'pairs' or 'flat', got {polygons!r}")
        return QwenJsonFormat(coordinates=coordinates)
    raise FormatError(f"training.format: unknown output format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
