"""Paired comparisons of two arms on the same held-out records and seeds: the difference of a figure with a 95%
interval from a two-level bootstrap (seeds drawn with replacement, then records, the same records for both arms).

Two figures, each computed on the drawn records pooled:
- label-aware F1@0.5, from each record's (matched, false positives, false negatives) counts (`pooled_f1`);
- label-aware COCO mAP (.50:.95), from each record's detections (`RecordMatches`).

Why a COCO AP of its own here, beside learner.evaluation.coco_map (faster-coco-eval), which the runs report: a
bootstrap recomputes mAP on thousands of resampled record sets, and faster-coco-eval takes about 44 ms a call on
128 crowded images (about 9 minutes for one comparison at 1000 draws x 6 seeds x 2 arms). COCO matches predictions
to ground truth image by image, whatever other images are in the set, so `RecordMatches` matches each record once
(COCO's greedy rule, per category and IoU threshold) and only COCO's accumulation is redone per draw: predictions of
all drawn records sorted by score (ties in record order), cumulative precision and recall, the 101-point
interpolated precision, the mean over thresholds and the categories with ground truth. About a millisecond.
tests/learner/test_paired_map.py holds it equal to faster-coco-eval on resampled sets, duplicates included.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from learner.core.clean_prefix import normalize_label
from learner.evaluation.coco_map import Box, clipped_xywh

T = TypeVar("T")

# COCO's defaults (pycocotools' Params.setDetParams), which learner.evaluation.coco_map keeps.
IOU_THRESHOLDS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
RECALL_THRESHOLDS = np.linspace(0.0, 1.00, int(np.round((1.00 - 0.0) / 0.01)) + 1, endpoint=True)


def pooled_f1(counts: Sequence[tuple[int, int, int]], idx: Sequence[int]) -> float:
    """Label-aware F1 of the records `idx` (repeats count again), pooled: 2M / (2M + FP + FN)."""
    m = sum(counts[i][0] for i in idx)
    fp = sum(counts[i][1] for i in idx)
    fn = sum(counts[i][2] for i in idx)
    return 2 * m / (2 * m + fp + fn) if m else 0.0


def paired_bootstrap(
    a: dict[int, T],
    b: dict[int, T],
    *,
    figure: Callable[[T, list[int]], float] = pooled_f1,
    draws: int = 2000,
    seed: int = 0,
    vary: str = "both",
) -> tuple[float, float, float]:
    """figure(a) - figure(b) on the same held-out records over the same seeds (each side: seed -> that run's
    per-record data, anything `len` and `figure(data, record indices)` take): the observed difference (mean over
    seeds of the figure on every record) and a 95% percentile interval from a two-level bootstrap: seeds drawn with
    replacement, then records, the same records for both sides (paired: what one image does to both models
    cancels). Seeds only one side has are left out.

    `vary` says which level is drawn: "both" (the interval), or one alone, the other kept whole, to see which
    level an interval's width comes from: "records" (every seed each draw: the width more seeds cannot narrow, only
    a larger held-out set) or "seeds" (every record each draw: what more seeds narrow)."""
    if vary not in ("both", "records", "seeds"):
        raise ValueError(f"vary must be 'both', 'records' or 'seeds', not {vary!r}")
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("no seed that both arms ran")
    n = len(a[seeds[0]])  # type: ignore[arg-type]
    if any(len(a[s]) != n or len(b[s]) != n for s in seeds):  # type: ignore[arg-type]
        raise ValueError("the arms were evaluated on different held-out sets")
    every = list(range(n))
    observed = statistics.fmean(figure(a[s], every) - figure(b[s], every) for s in seeds)
    rng = random.Random(seed)
    diffs = []
    for _ in range(draws):
        picked = seeds if vary == "records" else [rng.choice(seeds) for _ in seeds]
        idx = every if vary == "seeds" else [rng.randrange(n) for _ in range(n)]
        diffs.append(statistics.fmean(figure(a[s], idx) - figure(b[s], idx) for s in picked))
    diffs.sort()
    return observed, diffs[int(0.025 * draws)], diffs[min(draws - 1, int(0.975 * draws))]


def _iou(dt: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """COCO's box IoU (maskApi's bbIou, no crowd) of (D, 4) and (G, 4) xywh boxes, in its order of operations."""
    w = np.minimum(dt[:, None, 0] + dt[:, None, 2], gt[None, :, 0] + gt[None, :, 2]) - np.maximum(
        dt[:, None, 0], gt[None, :, 0]
    )
    h = np.minimum(dt[:, None, 1] + dt[:, None, 3], gt[None, :, 1] + gt[None, :, 3]) - np.maximum(
        dt[:, None, 1], gt[None, :, 1]
    )
    inter = np.where((w > 0) & (h > 0), w * h, 0.0)
    union = (dt[:, 2] * dt[:, 3])[:, None] + (gt[:, 2] * gt[:, 3])[None, :] - inter
    return np.where(inter > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def _match(dt: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """COCO's evaluateImg for one image and category (no crowd, no ignored ground truth): (T, D) whether each
    prediction, in score order, is matched at each IoU threshold. Greedy: each prediction takes the unmatched
    ground truth of highest IoU at or above the threshold (the last of equals)."""
    matched = np.zeros((len(IOU_THRESHOLDS), len(dt)), dtype=bool)
    if not len(dt) or not len(gt):
        return matched
    ious = _iou(dt, gt)
    for t, thr in enumerate(IOU_THRESHOLDS):
        taken = np.zeros(len(gt), dtype=bool)
        for d in range(len(dt)):
            best, m = min(float(thr), 1 - 1e-10), -1
            for g in range(len(gt)):
                if taken[g] or ious[d, g] < best:
                    continue
                best, m = ious[d, g], g
            if m >= 0:
                taken[m] = True
                matched[t, d] = True
    return matched


class RecordMatches:
    """One run's held-out detections, matched record by record once, so that `map(idx)` gives COCO's label-aware
    mAP (as learner.evaluation.coco_map with `normalize_label` categories) of any multiset of its records fast.

    `truth` and `predicted` hold one list of boxes per record; a prediction's `score` ranks it (the held-out
    evaluation's: the order written); `sizes` the records' (width, height)."""

    def __init__(
        self,
        truth: Sequence[Sequence[Box]],
        predicted: Sequence[Sequence[Box]],
        sizes: Sequence[tuple[float, float]],
        *,
        category: Callable[[str], str] = normalize_label,
    ) -> None:
        if not len(truth) == len(predicted) == len(sizes):
            raise ValueError(
                f"{len(truth)} ground-truth list(s), {len(predicted)} prediction list(s) and "
                f"{len(sizes)} size(s): one of each per record"
            )
        names = sorted({category(b.label) for boxes in (*truth, *predicted) for b in boxes})
        cat = {name: i for i, name in enumerate(names)}
        self.n_categories = len(names)
        self.gt_counts = np.zeros((len(truth), len(names)), dtype=np.int64)  # (record, category)
        rec, cats, scores, order, matched = [], [], [], [], []
        for r, (gts, dts, (w, h)) in enumerate(zip(truth, predicted, sizes, strict=True)):
            for c in {cat[category(b.label)] for b in (*gts, *dts)}:
                g = [clipped_xywh(b, w, h) for b in gts if cat[category(b.label)] == c]
                self.gt_counts[r, c] = len(g)
                mine = [b for b in dts if cat[category(b.label)] == c]
                # COCO sorts an image's predictions by score, stable (mergesort).
                ranked = sorted(range(len(mine)), key=lambda i, mine=mine: -mine[i].score)
                d = np.asarray([clipped_xywh(mine[i], w, h) for i in ranked], dtype=float).reshape(-1, 4)
                m = _match(d, np.asarray(g, dtype=float).reshape(-1, 4))
                for pos, i in enumerate(ranked):
                    rec.append(r)
                    cats.append(c)
                    scores.append(mine[i].score)
                    order.append(pos)
                    matched.append(m[:, pos])
        self.n = len(truth)
        self._rec = np.asarray(rec, dtype=np.int64)
        self._cat = np.asarray(cats, dtype=np.int64)
        self._score = np.asarray(scores, dtype=float)
        self._order = np.asarray(order, dtype=np.int64)
        self._matched = np.asarray(matched, dtype=bool).reshape(-1, len(IOU_THRESHOLDS))
        self._by_record = [np.flatnonzero(self._rec == r) for r in range(self.n)]

    def __len__(self) -> int:
        return self.n

    def map(self, idx: Sequence[int]) -> float:
        """COCO mAP of the records `idx`, in that order, repeats as further images (NaN without ground truth)."""
        idx = np.asarray(idx, dtype=np.int64)
        npig = self.gt_counts[idx].sum(axis=0)  # ground truth per category
        rows = [self._by_record[r] for r in idx]
        det = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        image = np.repeat(np.arange(len(idx)), [len(x) for x in rows])
        per_category = []
        for c in np.flatnonzero(npig > 0):
            mine = self._cat[det] == c
            d, img = det[mine], image[mine]
            # COCO's accumulate: images in order, each image's predictions by score, then a stable sort by score.
            d = d[np.lexsort((self._order[d], img, -self._score[d]))]
            tp = np.cumsum(self._matched[d].T, axis=1, dtype=float)  # (T, D)
            fp = np.cumsum(~self._matched[d].T, axis=1, dtype=float)
            q = np.zeros((len(IOU_THRESHOLDS), len(RECALL_THRESHOLDS)))
            if len(d):
                rc = tp / npig[c]
                pr = tp / (fp + tp + np.spacing(1))
                pr = np.maximum.accumulate(pr[:, ::-1], axis=1)[:, ::-1]  # the precision envelope
                for t in range(len(IOU_THRESHOLDS)):
                    at = np.searchsorted(rc[t], RECALL_THRESHOLDS, side="left")
                    ok = at < len(d)
                    q[t, ok] = pr[t, at[ok]]
            per_category.append(q)
        if not per_category:
            return float("nan")
        return float(np.stack(per_category, axis=2).mean())


def record_matches(doc: dict[str, Any]) -> RecordMatches:
    """A detections-ledger entry (method_compare's NAME-detections.jsonl.gz line) as RecordMatches: `truth` and
    `predicted` lists of [label, x1, y1, x2, y2] per record, predictions in the order written (scored as the
    held-out evaluation scores them), `sizes` [width, height] per record."""
    from learner.evaluation.coco_map import order_score

    def boxes(objs: list, ranked: bool) -> list[Box]:
        return [
            Box(str(o[0]), (float(o[1]), float(o[2]), float(o[3]), float(o[4])), order_score(i) if ranked else 1.0)
            for i, o in enumerate(objs)
        ]

    return RecordMatches(
        [boxes(t, False) for t in doc["truth"]],
        [boxes(p, True) for p in doc["predicted"]],
        [(float(w), float(h)) for w, h in doc["sizes"]],
    )
