"""COCO-style bbox mAP of predicted objects against ground truth, by faster-coco-eval.

The evaluator is faster-coco-eval (pycocotools' algorithm with its inner loops in C++; it gives the same
figures as pycocotools to the last digit, ~18x faster on 200 images, and takes a print function instead of
writing tables to stdout). This module only turns rmsft's per-image object lists into COCO's tables and
reads the figures back; the matching and the 101-point interpolated AP are the evaluator's.

Conventions:

- Categories are the labels (`Box.label`, the object's `desc`), compared as exact strings unless the caller
  passes `category`, the function that maps a label to its category: the held-out evaluation passes
  `learner.core.clean_prefix.normalize_label` ("Red_Circle" and "red circle" are one category) and, for the
  class-agnostic figure beside it, a constant (every object one category: geometry alone).
- Scores rank predictions, within an image and across images (COCO sorts each category's predictions by
  score over the whole set). A greedy rollout has no confidence: `boxes_from_detections` ranks objects by
  the order the model wrote them in, earliest = most confident, with score `1 / (1 + index)`, so every
  image's first object ranks above every image's second one. Callers with real scores pass them.
- Every prediction is kept: COCO's per-image cap (`maxDets`, 100) is raised to the largest image's count,
  since a generative model's answer has no score to cut at.
- Boxes are clipped to their image (an object cannot be seen outside it); reversed corners are accepted.
- A predicted label that no ground-truth object in the evaluated set uses is a false positive of a category
  without ground truth. COCO leaves such a category out of the mean (its AP is undefined), so it lowers no
  AP, as in COCO itself where a detection of an unknown category id is never looked at; it is not an error,
  and `n_unknown_label` counts those predictions so a model that invents labels still shows. A prediction
  with a wrong label that other ground truth does use is a false positive of that category and lowers it.

Empty cases: with no ground-truth object in any image the mAPs are undefined and returned as NaN (COCO's
-1 sentinel would plot as a real value); with ground truth but no prediction they are 0.0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Its progress lines ("creating index...", "DONE (t=0.00s)") go to this logger at INFO/DEBUG; an rmsft run at
# --log-level debug would print them on every evaluation. Its warnings and errors still come through.
logging.getLogger("faster_coco_eval").setLevel(logging.WARNING)

Detection = tuple[str, str, Sequence[float]]  # (desc, "bbox_2d" | "poly", pixel coordinates), as learner.data.episode


@dataclass(frozen=True)
class Box:
    """One object: its label, its box in pixels (x1, y1, x2, y2) and, for a prediction, its score (higher
    ranks first; ground truth ignores it)."""

    label: str
    xyxy: tuple[float, float, float, float]
    score: float = 1.0


def order_score(index: int) -> float:
    """The score of a greedy answer's `index`-th object (0 = first written): 1, 1/2, 1/3, ..."""
    return 1.0 / (1 + index)


def boxes_from_detections(detections: Sequence[Detection], *, rank_by_order: bool = True) -> list[Box]:
    """`(desc, kind, coords)` objects (what `learner.data.episode.predicted_detections` and
    `ground_truth_detections` give) as boxes; a polygon becomes its enclosing box. With `rank_by_order`
    each gets `order_score(index)`, otherwise 1.0 (ground truth)."""
    out = []
    for i, (desc, kind, coords) in enumerate(detections):
        if kind == "bbox_2d":
            if len(coords) != 4:
                raise ValueError(f"bbox_2d of {desc!r} needs 4 numbers, got {len(coords)}")
            box = (float(coords[0]), float(coords[1]), float(coords[2]), float(coords[3]))
        elif kind == "poly":
            if len(coords) < 2:
                raise ValueError(f"poly of {desc!r} has no point")
            xs, ys = coords[0::2], coords[1::2]
            box = (float(min(xs)), float(min(ys)), float(max(xs)), float(max(ys)))
        else:
            raise ValueError(f"unknown geometry kind {kind!r} of {desc!r}; expected 'bbox_2d' or 'poly'")
        out.append(Box(desc, box, order_score(i) if rank_by_order else 1.0))
    return out


def clipped_xywh(box: Box, width: float, height: float, where: str = "box") -> list[float]:
    """The box as COCO is given it: [x, y, w, h] with its corners sorted and clipped to the image (benchmarks/
    paired.py's mAP draws convert the same way). `where` names the box in the error a malformed one raises."""
    if len(box.xyxy) != 4 or not all(math.isfinite(v) for v in box.xyxy):
        raise ValueError(f"{where}: box {box.xyxy!r} needs 4 finite numbers")
    x1, x2 = sorted((box.xyxy[0], box.xyxy[2]))
    y1, y2 = sorted((box.xyxy[1], box.xyxy[3]))
    x1, x2 = min(max(x1, 0.0), width), min(max(x2, 0.0), width)
    y1, y2 = min(max(y1, 0.0), height), min(max(y2, 0.0), height)
    return [x1, y1, x2 - x1, y2 - y1]


def _quiet(*_args: Any, **_kwargs: Any) -> None:
    """The evaluator's print function: it would otherwise log or print a table per call."""


KEYS = ("map", "map_50", "map_75", "mar")


def coco_map(
    ground_truth: Sequence[Sequence[Box]],
    predictions: Sequence[Sequence[Box]],
    image_sizes: Sequence[tuple[int, int]],
    *,
    category: Callable[[str], str] | None = None,
) -> dict[str, float]:
    """COCO bbox metrics of `predictions` against `ground_truth`, one list of boxes per image, images of
    `image_sizes` (width, height) pixels; `category(label)` names each box's category (None: the label).

    Returns `map` (AP averaged over IoU .50:.05:.95 and the categories with ground truth), `map_50`,
    `map_75`, `mar` (recall averaged the same way, every prediction counted), and the counts `n_images`,
    `n_ground_truth`, `n_predictions`, `n_unknown_label` (predictions whose label no ground truth uses).
    The mAPs are NaN when no image has ground truth, 0.0 when there is ground truth but no prediction."""
    if not len(ground_truth) == len(predictions) == len(image_sizes):
        raise ValueError(
            f"{len(ground_truth)} ground-truth list(s), {len(predictions)} prediction list(s) and "
            f"{len(image_sizes)} image size(s): one of each per image"
        )
    cat = category or (lambda label: label)
    gt_labels = {cat(b.label) for boxes in ground_truth for b in boxes}
    labels = sorted(gt_labels | {cat(b.label) for boxes in predictions for b in boxes})
    cat_id = {label: i + 1 for i, label in enumerate(labels)}  # COCO ids start at 1
    images: list[dict[str, Any]] = []
    gts: list[dict[str, Any]] = []
    dts: list[dict[str, Any]] = []
    for i, (gt_boxes, dt_boxes, size) in enumerate(zip(ground_truth, predictions, image_sizes, strict=True)):
        width, height = int(size[0]), int(size[1])
        if width <= 0 or height <= 0:
            raise ValueError(f"image {i}: size {tuple(size)} must be positive (width, height)")
        images.append({"id": i + 1, "width": width, "height": height})
        for b in gt_boxes:
            xywh = clipped_xywh(b, width, height, f"image {i} ground truth {b.label!r}")
            gts.append(
                {
                    "id": len(gts) + 1,
                    "image_id": i + 1,
                    "category_id": cat_id[cat(b.label)],
                    "bbox": xywh,
                    "area": xywh[2] * xywh[3],
                    "iscrowd": 0,
                }
            )
        for b in dt_boxes:
            if not math.isfinite(b.score):
                raise ValueError(f"image {i} prediction {b.label!r}: score {b.score!r} is not finite")
            dts.append(
                {
                    "image_id": i + 1,
                    "category_id": cat_id[cat(b.label)],
                    "score": float(b.score),
                    "bbox": clipped_xywh(b, width, height, f"image {i} prediction {b.label!r}"),
                }
            )
    counts = {
        "n_images": float(len(images)),
        "n_ground_truth": float(len(gts)),
        "n_predictions": float(len(dts)),
        "n_unknown_label": float(sum(cat(b.label) not in gt_labels for boxes in predictions for b in boxes)),
    }
    if not gts:  # nothing to find: AP is undefined for every category
        return {**dict.fromkeys(KEYS, math.nan), **counts}

    # Imported here: it also imports OpenCV when installed (vLLM brings it), which only an evaluating rank needs.
    from faster_coco_eval import COCO, COCOeval_faster

    coco_gt = COCO(
        {
            "images": images,
            "annotations": gts,
            "categories": [{"id": cat_id[label], "name": label} for label in labels],
        },
        print_function=_quiet,
    )
    coco_dt = coco_gt.loadRes(dts)
    coco_dt.print_function = _quiet
    ev = COCOeval_faster(coco_gt, coco_dt, "bbox", print_function=_quiet)
    most = max((len(d) for d in predictions), default=0)
    ev.params.maxDets = [1, 10, max(100, most)]  # the last one counts: keep every prediction
    ev.evaluate()
    ev.accumulate()

    # precision: [IoU threshold, recall threshold, category, area range, maxDets]; recall: the same without
    # the recall axis. -1 marks a category without ground truth: out of every mean, as COCO's summarize does.
    p = ev.params
    area, last = p.areaRngLbl.index("all"), len(p.maxDets) - 1
    precision = np.asarray(ev.eval["precision"])[:, :, :, area, last]
    recall = np.asarray(ev.eval["recall"])[:, :, area, last]
    thresholds = np.asarray(p.iouThrs)

    def mean(values: np.ndarray) -> float:
        kept = values[values > -1]
        return float(kept.mean()) if kept.size else math.nan

    def at(iou: float) -> np.ndarray:
        return precision[np.isclose(thresholds, iou)]

    return {"map": mean(precision), "map_50": mean(at(0.5)), "map_75": mean(at(0.75)), "mar": mean(recall), **counts}
