"""A dataset: its records (learner/data/records.py) and the `ImageStore` that reads their images
(learner/data/images.py), every image validated at load."""

from __future__ import annotations

from pathlib import Path

from learner.data.images import ImageStore
from learner.data.records import Record, load_records


def load_dataset(
    path: str | Path,
    image_root: str | Path | None,
    max_image_pixels: int,
    cache_images: int = 256,
) -> tuple[list[Record], ImageStore]:
    """Records plus the `ImageStore` that reads their images; every image is validated here, at load,
    when any record has one (a text-only dataset reads no image and the store stays unused)."""
    records = load_records(path)
    store = ImageStore(image_root, path, max_image_pixels, cache_images=cache_images)
    if any(r.images for r in records):
        store.validate(records)
    return records, store
