"""A synthetic detection dataset for the tiny model: the prompt states each object's box,
the ideal answer is the same objects in the CoordExp format. Text only (the tiny model has no
vision tower), but it exercises the whole pipeline: rollouts, parsing, matching, packing, sync."""

from __future__ import annotations

import json
import random
from pathlib import Path

from learner.core.codec import pixel_to_bin
from rmsft.tiny_model import CLASS_NAMES

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
