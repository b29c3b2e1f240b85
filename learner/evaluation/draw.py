"""Pictures of rollouts: an image with its ground truth and the model's predicted objects drawn on it.

Ground truth is drawn dashed in green, predictions solid in orange with their description as a
label, polygons as outlines; every line has a thin black halo, so it stays visible on a shape of
its own colour (the synthetic task has green shapes). Small images are upscaled (nearest neighbour, whole factor, so the
pixels stay sharp and coordinates map exactly) before drawing, so a 96-pixel image gives a
readable picture. PIL only.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

GT_COLOUR = (0, 200, 0)
PRED_COLOUR = (255, 120, 0)
MIN_LONG_SIDE = 384  # upscale smaller images to at least this on the long side
LINE_WIDTH = 2
HALO = (0, 0, 0)
DASH = 6  # ground-truth dash and gap length, output pixels
HEADER_BG = (255, 255, 255)
HEADER_FG = (0, 0, 0)

Detection = tuple[str, str, Sequence[float]]  # (desc, "bbox_2d" | "poly", pixel coordinates)


def _points(kind: str, coords: Sequence[float], scale: int) -> list[tuple[float, float]]:
    """Outline vertices in output pixels; a box becomes its 4 corners (any corner order accepted)."""
    if kind == "bbox_2d":
        if len(coords) != 4:
            raise ValueError(f"bbox_2d needs 4 numbers, got {len(coords)}: {list(coords)}")
        x1, x2 = sorted((coords[0], coords[2]))
        y1, y2 = sorted((coords[1], coords[3]))
        pts = [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]
    elif kind == "poly":
        pts = [(coords[i], coords[i + 1]) for i in range(0, len(coords) - 1, 2)]
    else:
        raise ValueError(f"unknown geometry kind {kind!r}; expected 'bbox_2d' or 'poly'")
    # Pixel (x, y) covers [x*s, (x+1)*s) after upscaling: edge coordinates map to x*s.
    return [(x * scale, y * scale) for x, y in pts]


Point = tuple[float, float]


def _dashed(draw: ImageDraw.ImageDraw, a: Point, b: Point, fill: tuple[int, int, int], width: int) -> None:
    length = math.dist(a, b)
    if length == 0:
        return
    steps = max(1, math.ceil(length / (2 * DASH)))
    for k in range(steps):  # each dash starts at a multiple of 2*DASH from `a`, so corners are drawn
        t0, t1 = (2 * DASH * k) / length, min(1.0, (2 * DASH * k + DASH) / length)
        draw.line(
            [
                (a[0] + (b[0] - a[0]) * t0, a[1] + (b[1] - a[1]) * t0),
                (a[0] + (b[0] - a[0]) * t1, a[1] + (b[1] - a[1]) * t1),
            ],
            fill=fill,
            width=width,
        )


def _outline(
    draw: ImageDraw.ImageDraw, pts: list[Point], fill: tuple[int, int, int], dashed: bool, halo: bool = False
) -> None:
    """The closed outline through `pts`; with `halo`, its black underlay (drawn in a pass before
    every coloured line, so no halo covers another outline's colour)."""
    if len(pts) < 2:
        return
    colour, width = (HALO, LINE_WIDTH + 2) if halo else (fill, LINE_WIDTH)
    ring = pts + [pts[0]] if len(pts) > 2 else pts
    for a, b in zip(ring, ring[1:], strict=False):
        if dashed:
            _dashed(draw, a, b, colour, width)
        else:
            draw.line([a, b], fill=colour, width=width)


def _label(
    draw: ImageDraw.ImageDraw,
    xy: tuple[float, float],
    text: str,
    colour: tuple[int, int, int],
    font: ImageFont.ImageFont | ImageFont.FreeTypeFont,
    canvas: tuple[int, int],
    above: bool,
) -> None:
    """Text on a dark box, kept on the canvas: above the outline's top-left corner (predictions) or
    below its bottom-left (ground truth), so the two labels of a matched pair do not overlap."""
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    tw, th = right - left + 4, bottom - top + 2
    x = min(max(0.0, xy[0]), max(0.0, canvas[0] - tw))
    y = xy[1] - th - 1 if above else xy[1] + LINE_WIDTH + 1
    y = min(max(0.0, y), max(0.0, canvas[1] - th))
    draw.rectangle([x, y, x + tw - 1, y + th - 1], fill=(0, 0, 0))
    draw.text((x + 2 - left, y + 1 - top), text, fill=colour, font=font)


def draw_detections(
    image: Image.Image,
    ground_truth: Sequence[Detection],
    predicted: Sequence[Detection],
    title: str | None = None,
) -> Image.Image:
    """A new RGB picture: `image` upscaled by a whole factor, a header line (title and legend), ground
    truth dashed green, predictions solid orange with labels. Coordinates are in `image`'s pixels."""
    scale = max(1, math.ceil(MIN_LONG_SIDE / max(image.width, image.height)))
    body = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)
    font = ImageFont.load_default()
    probe = ImageDraw.Draw(body)
    line_h = int(probe.textbbox((0, 0), "Ag", font=font)[3]) + 4  # whole pixels (Pillow types the box as floats)
    header = 2 * line_h + 4
    canvas = Image.new("RGB", (body.width, body.height + header), HEADER_BG)
    canvas.paste(body, (0, header))
    draw = ImageDraw.Draw(canvas)

    text = title if title is not None else ""
    while text and draw.textlength(text, font=font) > canvas.width - 8:  # keep a long title on the canvas
        text = text[:-4] + "..." if len(text) > 4 else ""
    draw.text((4, 2), text, fill=HEADER_FG, font=font)
    x, y = 4, 2 + line_h
    for colour, dashed, name in (
        (GT_COLOUR, True, f"ground truth ({len(ground_truth)})"),
        (PRED_COLOUR, False, f"predicted ({len(predicted)})"),
    ):
        _outline(draw, [(x, y + line_h / 2), (x + 20, y + line_h / 2)], colour, dashed, halo=True)
        _outline(draw, [(x, y + line_h / 2), (x + 20, y + line_h / 2)], colour, dashed)
        draw.text((x + 24, y), name, fill=HEADER_FG, font=font)
        x += 24 + int(draw.textlength(name, font=font)) + 16

    size = (canvas.width, canvas.height)
    shifted: list[tuple[str, list[tuple[float, float]], bool]] = []
    for objs, is_gt in ((ground_truth, True), (predicted, False)):
        for desc, kind, coords in objs:
            pts = [(px, py + header) for px, py in _points(kind, coords, scale)]
            shifted.append((desc, pts, is_gt))
    # Halos, then coloured lines, then labels: no outline is drawn across a label.
    for halo in (True, False):
        for _desc, pts, is_gt in shifted:
            _outline(draw, pts, GT_COLOUR if is_gt else PRED_COLOUR, dashed=is_gt, halo=halo)
    for desc, pts, is_gt in shifted:
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if is_gt:
            _label(draw, (min(xs), max(ys)), desc, GT_COLOUR, font, size, above=False)
        else:
            _label(draw, (min(xs), min(ys)), desc, PRED_COLOUR, font, size, above=True)
    return canvas


@dataclass(frozen=True)
class RolloutPicture:
    """One rollout to draw: the record's image, its ground truth and what the model answered."""

    step: int
    record_id: str
    image: Image.Image
    ground_truth: Sequence[Detection] = ()
    predicted: Sequence[Detection] = ()
    sample: int | None = None  # which of a prompt's rollouts, when a step has several per record
    title: str | None = field(default=None)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def picture_name(step: int, record_id: str, sample: int | None = None) -> str:
    """`step000012-visual-3.png`; ids with characters unsafe in file names get a short hash so two
    ids that sanitise alike still get different files."""
    safe = _UNSAFE.sub("_", record_id)[:80]
    if safe != record_id:
        safe += "-" + hashlib.sha1(record_id.encode()).hexdigest()[:8]
    suffix = f"-s{sample}" if sample is not None else ""
    return f"step{step:06d}-{safe}{suffix}.png"


def save_rollout_pictures(items: Iterable[RolloutPicture], out_dir: str | Path) -> list[Path]:
    """Draw each item and write it to `out_dir` as a PNG named by step and record id; the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for item in items:
        title = item.title
        if title is None:
            title = f"step {item.step}  record {item.record_id}" + (
                f"  sample {item.sample}" if item.sample is not None else ""
            )
        path = out / picture_name(item.step, item.record_id, item.sample)
        draw_detections(item.image, item.ground_truth, item.predicted, title=title).save(path, format="PNG")
        paths.append(path)
    return paths
