"""Object format: the detection objects and how they are written as model output.

Public API
- `DetObject(desc, kind, bins)`: one object; `kind` is "bbox_2d" (4 bins x1,y1,x2,y2) or "poly"
  (even count >= 6); bins are ints on the 1000-bin grid.
- `pixel_to_bin(v, size)`, `bin_to_pixel(k, size)`, `DetObject.from_pixels(...)`: grid conversion,
  `round(v / size * 1000)` clamped to 0..999.
- `OutputFormat`: the interface a format implements (render entries, validate one parsed entry).
- `CoordExpFormat` / `COORDEXP`: single-line JSON `{"object_1": {"desc": "...", "bbox_2d":
  ["<|coord_k|>", ...]}, ...}` with separators `", "` and `": "`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

NUM_BINS = 1000
GEOMETRY_KINDS = ("bbox_2d", "poly")
Kind = Literal["bbox_2d", "poly"]
_COORD_RE = re.compile(r"<\|coord_(\d{1,3})\|>")
_KEY_RE = re.compile(r"object_([1-9]\d{0,8})")


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


@dataclass(frozen=True)
class DetObject:
    desc: str
    kind: Kind
    bins: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.desc, str) or not self.desc.strip():
            raise ValueError("object desc must be a non-empty string")
        if "<|coord_" in self.desc:
            raise ValueError(f"object desc must not contain coord token text: {self.desc!r}")
        if self.kind == "bbox_2d":
            if len(self.bins) != 4:
                raise ValueError(f"bbox_2d needs 4 coords, got {len(self.bins)}")
        elif self.kind == "poly":
            if len(self.bins) < 6 or len(self.bins) % 2:
                raise ValueError(f"poly needs an even count >= 6 of coords, got {len(self.bins)}")
        else:
            raise ValueError(f"unknown geometry kind {self.kind!r}; expected one of {GEOMETRY_KINDS}")
        for b in self.bins:
            if not isinstance(b, int) or not 0 <= b < NUM_BINS:
                raise ValueError(f"coord bin {b!r} outside 0..{NUM_BINS - 1}")

    @classmethod
    def from_pixels(cls, desc: str, kind: Kind, coords: Sequence[float], width: float, height: float):
        """Pixel coords (x, y alternating) to bins on the image's own width/height."""
        bins = tuple(pixel_to_bin(v, width if i % 2 == 0 else height) for i, v in enumerate(coords))
        return cls(desc, kind, bins)


class OutputFormat(Protocol):
    """What the parser and target builder need from an output format."""

    name: str

    def render_entries(self, objects: Sequence[DetObject], start_index: int) -> str:
        """`"object_{start}": {...}, "object_{start+1}": {...}` (no braces around)."""
        ...

    def render(self, objects: Sequence[DetObject]) -> str:
        """A complete answer."""
        ...

    def object_index(self, key: str) -> int | None:
        """The N of a valid entry key, else None."""
        ...

    def validate_entry(self, key: str, value: Any) -> DetObject | None:
        """Strictly validate one parsed entry; None means drop it (never repaired)."""
        ...

    def desc_value_spans(self, entries_text: str) -> list[tuple[int, int]]:
        """Character spans of desc values (inside the quotes) in text from `render_entries`."""
        ...


class CoordExpFormat:
    name = "coordexp"

    def _value(self, obj: DetObject) -> str:
        coords = ", ".join(f'"{coord_token_text(b)}"' for b in obj.bins)
        return f'{{"desc": {json.dumps(obj.desc, ensure_ascii=False)}, "{obj.kind}": [{coords}]}}'

    def render_entries(self, objects: Sequence[DetObject], start_index: int) -> str:
        return ", ".join(f'"object_{start_index + i}": {self._value(o)}' for i, o in enumerate(objects))

    def render(self, objects: Sequence[DetObject]) -> str:
        return "{" + self.render_entries(objects, 1) + "}"

    def object_index(self, key: str) -> int | None:
        m = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
        return int(m.group(1)) if m else None

    def validate_entry(self, key: str, value: Any) -> DetObject | None:
        if self.object_index(key) is None or not isinstance(value, dict):
            return None
        kinds = [k for k in GEOMETRY_KINDS if k in value]
        if len(kinds) != 1 or set(value) != {"desc", kinds[0]}:
            return None
        desc, coords = value["desc"], value[kinds[0]]
        if not isinstance(desc, str) or not desc.strip() or "<|coord_" in desc:
            return None
        if not isinstance(coords, list) or not all(isinstance(c, str) for c in coords):
            return None
        bins = [coord_bin_from_text(c) for c in coords]
        if any(b is None for b in bins):
            return None
        try:
            return DetObject(desc, kinds[0], tuple(bins))  # type: ignore[arg-type]
        except ValueError:
            return None

    def desc_value_spans(self, entries_text: str) -> list[tuple[int, int]]:
        spans = []
        for m in re.finditer(r'\{"desc": "((?:[^"\\]|\\.)*)"', entries_text):
            spans.append((m.start(1), m.end(1)))
        return spans


COORDEXP = CoordExpFormat()
