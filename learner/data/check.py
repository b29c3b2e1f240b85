"""`rmsft data check`: a records file loaded as a job loads it (the learner's own loader and image check), reported
as counts, a label histogram, the images found and missing and their sizes, and what a job would refuse."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.core.codec import check_desc
from learner.data.coco import OUT_SUFFIXES
from learner.data.images import ImageError, ImageStore
from learner.data.records import load_records, outside_frame
from learner.data.wording import LISTED, counted, listed
from rmsft.jobspec import VisionSpec

if TYPE_CHECKING:
    from learner.data.images import _Source


@dataclass
class RecordsCheck:
    """A records file as a job would load it (`check_records`): what it holds and what a job would refuse."""

    path: Path
    image_root: Path
    records: int = 0
    objects: int = 0
    polygons: int = 0
    empty_records: int = 0
    most_objects: int = 0
    labels: Counter[str] = field(default_factory=Counter)  # desc as the core keeps it (stripped) -> objects
    image_refs: int = 0  # references in all records (two records may share an image)
    images: int = 0  # distinct images the loader checked
    found: int = 0  # ... that exist and passed the loader's check
    missing: list[str] = field(default_factory=list)  # paths of image files that do not exist
    unusable: int = 0  # exist, or inline, but unreadable, corrupt or too large
    sizes: Counter[tuple[int, int]] = field(default_factory=Counter)  # (width, height) of the found images
    refusals: list[str] = field(default_factory=list)  # what a job would refuse, in the loader's words
    # What a job accepts but trains other than the file says (clamped boxes) or not at all (no objects): warnings.
    warnings: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return not self.refusals

    def lines(self) -> list[str]:
        """The report as printed: counts, the label histogram, the images, then the verdict and each refusal."""
        per_record = self.objects / self.records if self.records else 0.0
        out = [
            f"{self.path}: {counted(self.records, 'record')} with {counted(self.objects, 'object')} "
            f"({counted(self.polygons, 'polygon')}, {counted(self.objects - self.polygons, 'box', 'boxes')}); "
            f"{counted(self.empty_records, 'record')} without objects",
            f"objects per record: {per_record:.2f} on average, {self.most_objects} at most",
            f"labels: {len(self.labels)}",
        ]
        width = len(str(max(self.labels.values(), default=0)))
        histogram = sorted(self.labels.items(), key=lambda kv: (-kv[1], kv[0]))  # most objects first
        out.extend(f"  {n:>{width}} {label}" for label, n in histogram)
        if self.image_refs:
            out.append(
                f"images: {self.images} distinct ({self.image_refs} references) under {self.image_root}: "
                f"{self.found} found, {len(self.missing)} missing, {self.unusable} unusable"
            )
            if self.missing:
                out.append(f"  missing: {listed(self.missing)}")
            if self.sizes:
                (w0, h0), (w1, h1) = (f(self.sizes, key=lambda s: s[0] * s[1]) for f in (min, max))
                common = ", ".join(f"{w}x{h} ({n})" for (w, h), n in self.sizes.most_common(5))
                out.append(f"  sizes: {len(self.sizes)} distinct, {w0}x{h0} to {w1}x{h1} pixels; most common: {common}")
        else:
            out.append("images: none (a text-only file)")
        out.extend(f"warning: {w}" for w in self.warnings)
        if self.accepted:
            out.append(
                "a job would accept this file"
                + (f" ({counted(len(self.warnings), 'warning')} above)" if self.warnings else "")
            )
        else:
            out.append(f"a job would refuse this file: {counted(len(self.refusals), 'problem')}")
            out.extend(f"  - {p}" for p in self.refusals[:LISTED])
            if len(self.refusals) > LISTED:
                out.append(f"  ... and {len(self.refusals) - LISTED} more")
        return out


class _NotingStore(ImageStore):
    """The loader's image store, noting what its `validate` found for each distinct image: `validate` stays the
    judge of what a job refuses (its very check and wording), and every image is still read once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sizes: dict[str, tuple[int, int]] = {}
        self.missing: list[str] = []
        self.unusable = 0

    def _inspect(self, source: _Source) -> tuple[int, int]:
        try:
            size = super()._inspect(source)
        except Exception:
            if source.path is not None and not source.path.exists():
                self.missing.append(str(source.path))
            else:
                self.unusable += 1
            raise
        self.sizes[source.key] = size
        return size


def check_records(
    path: str | Path,
    image_root: str | Path | None = None,
    max_image_pixels: int = VisionSpec.model_fields["max_image_pixels"].default,
    max_images_per_prompt: int = VisionSpec.model_fields["max_images_per_prompt"].default,
) -> RecordsCheck:
    """Load a records file as a job does (`load_records`, then the image store's `validate` with `image_root`,
    None = the file's folder as for an unset spec.training.data.image_root) and report on it. A file whose
    records do not load at all raises the loader's `DataError` (file, line, field); image problems, a name a job
    spec refuses and records over the images-per-prompt limit are listed in `refusals`."""
    path = Path(path)
    records = load_records(path)
    store = _NotingStore(image_root, path, max_image_pixels, cache_images=0)
    check = RecordsCheck(path=path, image_root=store.image_root)
    if not path.name.endswith(OUT_SUFFIXES):
        check.refusals.append(f"{path}: spec.training.data.path takes only .jsonl or .jsonl.gz files")
    for r in records:
        check.records += 1
        check.objects += len(r.objects)
        check.polygons += sum(o.poly is not None for o in r.objects)
        check.empty_records += not r.objects
        check.most_objects = max(check.most_objects, len(r.objects))
        check.labels.update(check_desc(o.desc) for o in r.objects)
        check.image_refs += len(r.images)
    outside = outside_frame(records)
    if outside.objects:
        check.warnings.append(outside.line(check.objects))
    if check.objects == 0 and check.image_refs:  # a text-only file (GRPO's answers) has no objects by design
        check.warnings.append(
            f"all {counted(check.records, 'record')} are without objects: a detection job would "
            "teach the model that the images hold nothing"
        )
    # What the learner refuses at start (learner/train/start_checks.py), before the model is loaded.
    over = [r.id for r in records if len(r.images) > max_images_per_prompt]
    if over:
        verb = "carries" if len(over) == 1 else "carry"
        check.refusals.append(
            f"{counted(len(over), 'record')} {verb} more than spec.model.vision.maxImagesPerPrompt="
            f"{max_images_per_prompt} images (first: {over[0]!r})"
        )
    try:
        store.validate(records)
    except ImageError as exc:
        check.refusals.extend(exc.problems)
    check.images = len(store.sizes) + len(store.missing) + store.unusable
    check.found, check.missing, check.unusable = len(store.sizes), store.missing, store.unusable
    check.sizes = Counter(store.sizes.values())
    return check
