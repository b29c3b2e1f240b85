"""Synthetic detection datasets for the tiny models.

- `write_synthetic_dataset`: text only. The prompt states each object's box, the ideal answer is
  the same objects in the CoordExp format. It needs no vision tower, yet exercises the whole
  pipeline: rollouts, parsing, matching, packing, sync.
- `write_visual_dataset`: a real visual task. PNG images of coloured shapes (3 colours x circle,
  rectangle, triangle) on pale backgrounds; the prompt does not give the answer away, so only a
  model that looks at the image can find the objects. Small class set, large shapes, strong
  contrast: learnable by a tiny vision-language model within minutes. `fmt` picks the instruction:
  the CoordExp one (a description and a bbox_2d or poly) or the qwen_json one (a list of bbox_2d and
  label); the records are the same (qwen_json answers a triangle with its enclosing box).

- `write_answer_dataset` + `CoordAnswerReward`: a short-answer task with a verifiable answer for GRPO on the
  tiny text model. Each prompt names one of the tiny vocabulary's classes; the answer is that class's fixed
  coordinate token (`answer_bin`). The reward scores the completion's first token: 1.0 for the answer, partial
  credit by distance for another coordinate token (`width`: 0 from that many bins away), 0.0 for anything else.
  About 45% of the tiny vocabulary is coordinate tokens, so a random-weight model's first samples already get
  some signal; a width near the classes' spacing keeps any constant answer from scoring well (configs/
  local-tiny-grpo.yaml says why).

The text-only prompt asks for "JSON with bbox_2d", which fits both formats; its stated boxes are on the
1000-bin grid, which is qwen_json's relative convention too (text has no resized image for pixels).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Literal

from PIL import Image, ImageChops, ImageDraw

from learner.core.codec import coord_bin_from_text, coord_token_text, pixel_to_bin
from rmsft_dev.tiny_model import CLASS_NAMES

SIZES = ((640, 480), (800, 600), (1024, 768), (512, 512))


def make_record(rng: random.Random, index: int, max_objects: int = 4) -> dict:
    width, height = rng.choice(SIZES)
    objects = []
    for _ in range(rng.randint(1, max_objects)):
        w, h = rng.randint(width // 10, width // 2), rng.randint(height // 10, height // 2)
        x1, y1 = rng.randint(0, width - w), rng.randint(0, height - h)
        objects.append({"desc": rng.choice(CLASS_NAMES), "bbox_2d": [x1, y1, x1 + w, y1 + h]})

    # The prompt states each box on the 1000-bin grid, so the answer is a copy task a tiny model
    # can learn within a short run (the rollout F1 then shows whether training is working).
    def grid(box: list[int]) -> list[int]:
        return [pixel_to_bin(v, width if i % 2 == 0 else height) for i, v in enumerate(box)]

    listing = "; ".join(f"{o['desc']} at {grid(o['bbox_2d'])}" for o in objects)
    prompt = f"It shows: {listing}. Detect every object and answer in JSON with bbox_2d."
    return {
        "id": f"synthetic-{index}",
        "width": width,
        "height": height,
        "messages": [{"role": "user", "content": prompt}],
        "objects": objects,
    }


def write_synthetic_dataset(path: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write `n` records to `path` (JSONL). Same seed, same file."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps(make_record(rng, i)) + "\n")
    return path


# ---------------------------------------------------------------- a short-answer task (GRPO)

ANSWER_PROMPT = "Where is the {name}? Answer with its coordinate token."


ANSWER_CLASSES = len(CLASS_NAMES)  # how many of the tiny vocabulary's classes the short-answer task asks about


def answer_bin(name: str, classes: int = ANSWER_CLASSES) -> int:
    """The coordinate bin that answers `name`: the task's first `classes` classes spread evenly over 0..999."""
    i = CLASS_NAMES[:classes].index(name)
    return (2 * i + 1) * 1000 // (2 * classes)


def write_answer_dataset(path: str | Path, n: int = 64, seed: int = 0, classes: int = ANSWER_CLASSES) -> Path:
    """`n` short-answer records (`answer`: the class's coordinate token) about the first `classes` classes, to
    `path` (JSONL). Same arguments, same file. Width and height are the 1000-bin grid (the records carry no
    image)."""
    if not 1 <= classes <= len(CLASS_NAMES):
        raise ValueError(f"classes must be in 1..{len(CLASS_NAMES)}, got {classes}")
    names = CLASS_NAMES[:classes]
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            name = names[i % classes] if i < classes else rng.choice(names)
            rec = {
                "id": f"answer-{i}",
                "width": 1000,
                "height": 1000,
                "messages": [{"role": "user", "content": ANSWER_PROMPT.format(name=name)}],
                "answer": coord_token_text(answer_bin(name, classes)),
            }
            f.write(json.dumps(rec) + "\n")
    return path


def leading_bin(text: str) -> int | None:
    """The bin of the coordinate token `text` starts with (after whitespace), else None."""
    head = text.lstrip()
    end = head.find("|>")
    return coord_bin_from_text(head[: end + 2]) if end >= 0 else None


class CoordAnswerReward:
    """`rmsft_dev.synthetic:CoordAnswerReward`, the reward of `write_answer_dataset`'s task: the completion's
    first token against the record's answer, 1 - |bin - answer| / `width` (at least 0) for a coordinate
    token, `other` for anything else. Pure and thread-safe."""

    name = "coord_answer"

    def __init__(self, width: float = 1000.0, other: float = 0.0) -> None:
        if not width > 0:
            raise ValueError(f"width: expected a number > 0, got {width!r}")
        self.width, self.other = float(width), float(other)

    def __call__(self, inp) -> float:  # a learner.rewards.interface.RewardInput
        answer = inp.answer if inp.answer is not None else getattr(inp.record, "answer", None)
        target = leading_bin(answer) if isinstance(answer, str) else None
        if target is None:
            raise ValueError(f"the record's answer must be one coordinate token, got {answer!r}")
        got = leading_bin(inp.text)
        if got is None:
            return self.other
        return max(0.0, 1.0 - abs(got - target) / self.width)


# ---------------------------------------------------------------- the visual task

VISUAL_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (20, 150, 40),
    "blue": (30, 70, 220),
}
VISUAL_SHAPES = ("circle", "rectangle", "triangle")
VISUAL_CLASS_NAMES = [f"{colour} {shape}" for colour in VISUAL_COLOURS for shape in VISUAL_SHAPES]
VISUAL_PROMPT = "Detect every shape in the image. Answer in JSON with a description and a bbox_2d or poly for each."
VISUAL_PROMPT_QWEN_JSON = "Detect every shape in the image. Answer with a JSON list of its bbox_2d and label for each."
VISUAL_PROMPTS = {"coordexp": VISUAL_PROMPT, "qwen_json": VISUAL_PROMPT_QWEN_JSON}
# Pale backgrounds: every channel >= 200 minus noise, far from the saturated shape colours.
_BACKGROUNDS = ((246, 246, 246), (226, 226, 226), (242, 234, 212), (220, 232, 246), (244, 226, 230), (226, 242, 226))
_NOISE_LEVELS = 16  # background noise amplitude, grey levels: texture, not camouflage


def _background(rng: random.Random, width: int, height: int) -> Image.Image:
    base = rng.choice(_BACKGROUNDS)
    img = Image.new("RGB", (width, height), base)
    kind = rng.choice(("plain", "gradient", "noise"))
    if kind == "gradient":
        other = rng.choice([c for c in _BACKGROUNDS if c != base])
        turn = rng.choice((None, Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_180, Image.Transpose.ROTATE_270))
        mask = Image.linear_gradient("L")
        if turn is not None:
            mask = mask.transpose(turn)
        img = Image.composite(Image.new("RGB", (width, height), other), img, mask.resize((width, height)))
    elif kind == "noise":
        # rng.randbytes, not Image.effect_noise (C rand(), not seeded): same seed, same pixels.
        noise = Image.frombytes("L", (width, height), rng.randbytes(width * height))
        noise = noise.point(lambda v: v * _NOISE_LEVELS // 256)
        img = ImageChops.subtract(img, Image.merge("RGB", (noise, noise, noise)))
    return img


def _triangle(rng: random.Random, size: int) -> list[tuple[int, int]]:
    """A fat triangle (vertices about 120 degrees apart on a circle) with its bbox at the origin."""
    radius = size / 2
    start = rng.uniform(0, 2 * math.pi)
    pts = [
        (radius * math.cos(a), radius * math.sin(a))
        for a in (start + k * 2 * math.pi / 3 + rng.uniform(-0.25, 0.25) for k in range(3))
    ]
    x0, y0 = min(p[0] for p in pts), min(p[1] for p in pts)
    pts_int = [(round(x - x0), round(y - y0)) for x, y in pts]
    # Canonical vertex order (top-most first, then clockwise as generated): one right answer per triangle.
    first = min(range(3), key=lambda k: (pts_int[k][1], pts_int[k][0]))
    return pts_int[first:] + pts_int[:first]


def _covers(box: list[int], point: tuple[int, int], margin: int = 2) -> bool:
    return box[0] - margin <= point[0] <= box[2] + margin and box[1] - margin <= point[1] <= box[3] + margin


def _iou(a: list[int], b: list[int]) -> float:
    iw, ih = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def visual_marker(obj: dict) -> tuple[int, int]:
    """A pixel inside the object that no later shape covers: the box centre, or a triangle's centroid."""
    if "poly" in obj:
        xs, ys = obj["poly"][0::2], obj["poly"][1::2]
        return round(sum(xs) / len(xs)), round(sum(ys) / len(ys))
    x1, y1, x2, y2 = obj["bbox_2d"]
    return (x1 + x2) // 2, (y1 + y2) // 2


def _box_of(obj: dict) -> list[int]:
    if "poly" in obj:
        xs, ys = obj["poly"][0::2], obj["poly"][1::2]
        return [min(xs), min(ys), max(xs), max(ys)]
    return list(obj["bbox_2d"])


def make_visual_sample(
    seed: int,
    index: int,
    min_side: int = 96,
    max_side: int = 256,
    max_objects: int = 3,
    fmt: Literal["coordexp", "qwen_json"] = "coordexp",
) -> tuple[Image.Image, dict]:
    """One image and its record (without `images`, which the writer sets). Each sample has its own
    RNG, so sample i is the same whatever `n` the dataset has; `fmt` only picks the instruction."""
    if fmt not in VISUAL_PROMPTS:
        raise ValueError(f"fmt must be one of {', '.join(VISUAL_PROMPTS)}, got {fmt!r}")
    rng = random.Random(f"rmsft-visual-{seed}-{index}")
    width, height = rng.randint(min_side, max_side), rng.randint(min_side, max_side)
    img = _background(rng, width, height)
    draw = ImageDraw.Draw(img)
    side = min(width, height)
    placed: list[dict] = []  # in drawing order: later shapes lie on top
    for _ in range(rng.randint(1, max_objects)):
        for _attempt in range(50):
            colour, shape = rng.choice(list(VISUAL_COLOURS)), rng.choice(VISUAL_SHAPES)
            lo, hi = max(8, round(side * 0.25)), max(8, round(side * 0.5))
            if shape == "triangle":
                # A triangle spans ~0.8 of its circle: scale up so it is as large as the others.
                local = _triangle(rng, min(side - 2, round(rng.randint(lo, hi) * 1.2)))
                bw, bh = max(p[0] for p in local), max(p[1] for p in local)
            elif shape == "circle":
                bw = bh = rng.randint(lo, hi)
            else:
                bw, bh = rng.randint(lo, hi), rng.randint(lo, hi)
            x1, y1 = rng.randint(0, width - 1 - bw), rng.randint(0, height - 1 - bh)
            if shape == "triangle":
                obj = {"desc": f"{colour} {shape}", "poly": [v for x, y in local for v in (x + x1, y + y1)]}
            else:
                obj = {"desc": f"{colour} {shape}", "bbox_2d": [x1, y1, x1 + bw, y1 + bh]}
            box = _box_of(obj)
            # Keep every earlier object identifiable: its marker pixel stays uncovered, overlaps stay
            # partial, and overlapping shapes differ in colour (same-colour shapes would merge).
            if all(
                not _covers(box, visual_marker(o))
                and _iou(box, _box_of(o)) <= 0.4
                and (_iou(box, _box_of(o)) == 0 or o["desc"].split()[0] != colour)
                for o in placed
            ):
                break
        else:
            break  # no room for another object in this image
        fill = VISUAL_COLOURS[colour]
        if shape == "circle":
            draw.ellipse([x1, y1, x1 + bw - 1, y1 + bh - 1], fill=fill)
        elif shape == "rectangle":
            draw.rectangle([x1, y1, x1 + bw - 1, y1 + bh - 1], fill=fill)
        else:
            draw.polygon([(obj["poly"][k], obj["poly"][k + 1]) for k in range(0, 6, 2)], fill=fill)
        placed.append(obj)
    # Reading order (top to bottom, then left to right): one canonical answer per image.
    objects = sorted(placed, key=lambda o: (_box_of(o)[1], _box_of(o)[0]))
    record = {
        "id": f"visual-{index}",
        "width": width,
        "height": height,
        "messages": [{"role": "user", "content": VISUAL_PROMPTS[fmt]}],
        "objects": objects,
    }
    return img, record


# ---------------------------------------------------------------- the grid task (learnable in minutes)

GRID_CELL = 32  # pixels: one image token of the tiny models (patch 16 x merge 2), so a cell is a token
GRID_SHAPES = ("circle", "rectangle")


def make_grid_sample(
    seed: int,
    index: int,
    cells: int = 4,
    max_objects: int = 2,
    min_cells: int = 1,
    max_cells: int = 2,
    min_objects: int = 1,
    fmt: Literal["coordexp", "qwen_json"] = "coordexp",
    colours: tuple[str, ...] = tuple(VISUAL_COLOURS),
    shapes: tuple[str, ...] = GRID_SHAPES,
) -> tuple[Image.Image, dict]:
    """One image of `cells` x `cells` grid cells of GRID_CELL pixels and its record: `min_objects`..`max_objects` shapes
    (circle or rectangle in one of `colours`), each covering `min_cells`..`max_cells` cells per side, placed on
    the grid and never overlapping. Every box edge lies on a cell edge, which is an image-token edge of the
    tiny models: the answer is which tokens hold a shape, so a tiny randomly initialised model can learn
    where things are within a few hundred steps (on the free layout of `make_visual_sample`, with any pixel
    a possible edge, it does not). Same (seed, index), same sample."""
    if fmt not in VISUAL_PROMPTS:
        raise ValueError(f"fmt must be one of {', '.join(VISUAL_PROMPTS)}, got {fmt!r}")
    if not 1 <= min_objects <= max_objects:
        raise ValueError(f"need 1 <= min_objects <= max_objects, got {min_objects}, {max_objects}")
    if not 1 <= min_cells <= max_cells <= cells:
        raise ValueError(f"need 1 <= min_cells <= max_cells <= cells, got {min_cells}, {max_cells}, {cells}")
    rng = random.Random(f"rmsft-grid-{seed}-{index}")
    side = cells * GRID_CELL
    img = _background(rng, side, side)
    draw = ImageDraw.Draw(img)
    taken: set[tuple[int, int]] = set()
    objects: list[dict] = []
    for _ in range(rng.randint(min_objects, max_objects)):
        for _attempt in range(50):
            colour, shape = rng.choice(colours), rng.choice(shapes)
            cw = rng.randint(min_cells, max_cells)
            ch = cw if shape == "circle" else rng.randint(min_cells, max_cells)
            cx, cy = rng.randint(0, cells - cw), rng.randint(0, cells - ch)
            mine = {(cx + i, cy + j) for i in range(cw) for j in range(ch)}
            if not mine & taken:
                break
        else:
            break  # no free cells left for another object
        taken |= mine
        box = [cx * GRID_CELL, cy * GRID_CELL, (cx + cw) * GRID_CELL, (cy + ch) * GRID_CELL]
        fill = VISUAL_COLOURS[colour]
        shape_box = [box[0], box[1], box[2] - 1, box[3] - 1]
        (draw.ellipse if shape == "circle" else draw.rectangle)(shape_box, fill=fill)
        objects.append({"desc": f"{colour} {shape}", "bbox_2d": box})
    objects.sort(key=lambda o: (o["bbox_2d"][1], o["bbox_2d"][0]))  # reading order: one canonical answer
    record = {
        "id": f"grid-{index}",
        "width": side,
        "height": side,
        "messages": [{"role": "user", "content": VISUAL_PROMPTS[fmt]}],
        "objects": objects,
    }
    return img, record


def make_row_sample(
    seed: int,
    index: int,
    cells: int = 6,
    min_row: int = 3,
    max_row: int = 6,
    max_others: int = 2,
    fmt: Literal["coordexp", "qwen_json"] = "coordexp",
) -> tuple[Image.Image, dict]:
    """One image of `cells` x `cells` grid cells with a row of `min_row`..`max_row` same-label tall rectangles side
    by side (one cell wide, two or three tall, in adjacent columns: people in a queue, bottles on a shelf) and up to
    `max_others` one-cell shapes of other labels in free cells. Neighbours in the row share an edge and a label, so a
    box one column off overlaps the next object of its kind: the scene where duplicate control (which same-label
    overlaps are one object answered twice) and dead anchors decide the rollout-matching target. Same (seed,
    index), same sample."""
    if fmt not in VISUAL_PROMPTS:
        raise ValueError(f"fmt must be one of {', '.join(VISUAL_PROMPTS)}, got {fmt!r}")
    if not 2 <= min_row <= max_row <= cells:
        raise ValueError(f"need 2 <= min_row <= max_row <= cells, got {min_row}, {max_row}, {cells}")
    if cells < 3:
        raise ValueError(f"need cells >= 3 (a row of objects two or more cells tall), got {cells}")
    rng = random.Random(f"rmsft-row-{seed}-{index}")
    side = cells * GRID_CELL
    img = _background(rng, side, side)
    draw = ImageDraw.Draw(img)
    colour = rng.choice(list(VISUAL_COLOURS))
    k, tall = rng.randint(min_row, max_row), rng.randint(2, 3)
    x0, y0 = rng.randint(0, cells - k), rng.randint(0, cells - tall)
    taken = {(x0 + i, y0 + j) for i in range(k) for j in range(tall)}
    objects = [
        {
            "desc": f"{colour} rectangle",
            "bbox_2d": [(x0 + i) * GRID_CELL, y0 * GRID_CELL, (x0 + i + 1) * GRID_CELL, (y0 + tall) * GRID_CELL],
        }
        for i in range(k)
    ]
    free = sorted({(x, y) for x in range(cells) for y in range(cells)} - taken)
    for _ in range(rng.randint(0, max_others)):
        other = rng.choice([c for c in VISUAL_COLOURS if c != colour])
        x, y = free.pop(rng.randrange(len(free)))
        objects.append(
            {
                "desc": f"{other} {rng.choice(GRID_SHAPES)}",
                "bbox_2d": [x * GRID_CELL, y * GRID_CELL, (x + 1) * GRID_CELL, (y + 1) * GRID_CELL],
            }
        )
    for obj in objects:
        b = obj["bbox_2d"]
        # One pixel in from the right and bottom edges: neighbours in the row stay two shapes, not one long bar.
        shape_box = [b[0], b[1], b[2] - 2, b[3] - 1]
        fill = VISUAL_COLOURS[obj["desc"].split()[0]]
        (draw.ellipse if obj["desc"].endswith("circle") else draw.rectangle)(shape_box, fill=fill)
    objects.sort(key=lambda o: (o["bbox_2d"][1], o["bbox_2d"][0]))  # reading order: one canonical answer
    record = {
        "id": f"row-{index}",
        "width": side,
        "height": side,
        "messages": [{"role": "user", "content": VISUAL_PROMPTS[fmt]}],
        "objects": objects,
    }
    return img, record


def write_visual_dataset(
    path: str | Path,
    n: int = 64,
    seed: int = 0,
    min_side: int = 96,
    max_side: int = 256,
    max_objects: int = 3,
    fmt: Literal["coordexp", "qwen_json"] = "coordexp",
    layout: Literal["free", "grid", "row"] = "free",
    **grid: int,
) -> Path:
    """Write `n` PNG images to `<stem>-images/` next to `path` and their records to `path` (JSONL), with
    the instruction of output format `fmt` (`training.format`).

    Image paths in the records are relative to the dataset file's folder, so the job needs no
    `image_root`. Same arguments, byte-identical files (PIL writes no timestamp into a PNG).
    """
    if layout not in ("free", "grid", "row"):
        raise ValueError(f"layout must be 'free', 'grid' or 'row', got {layout!r}")
    if not 32 <= min_side <= max_side:
        raise ValueError(f"need 32 <= min_side <= max_side, got min_side={min_side}, max_side={max_side}")
    if max_objects < 1:
        raise ValueError(f"max_objects must be >= 1, got {max_objects}")
    path = Path(path)
    folder = path.parent / f"{path.stem}-images"
    folder.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            if layout == "grid":
                img, record = make_grid_sample(seed, i, max_objects=max_objects, fmt=fmt, **grid)
            elif layout == "row":  # `grid` holds make_row_sample's keywords (cells, min_row, max_row, max_others)
                img, record = make_row_sample(seed, i, fmt=fmt, **grid)
            else:
                img, record = make_visual_sample(seed, i, min_side, max_side, max_objects, fmt)
            name = f"visual-{i:05d}.png"
            img.save(folder / name, format="PNG")
            record["images"] = [f"{folder.name}/{name}"]
            f.write(json.dumps(record) + "\n")
    return path
