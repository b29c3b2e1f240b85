"""Matching predicted objects to ground truth.

Public API
- `MatchConfig(iou_gate=0.3, fp_cost=0.5, fn_cost=2.0, mask_resolution=128)`.
- `match(pred, gt, cfg) -> MatchResult` with `pairs` ((pred_i, gt_j, iou), sorted by gt_j),
  `false_negatives` (unmatched gt indices, ascending) and `false_positives` (unmatched preds).
- `iou(a, b, mask_resolution)`: boxes exactly; anything with a polygon by mask IoU.
- `box_iou(a, b)`: IoU of two [x1, y1, x2, y2] boxes (what `iou` uses for two boxes).
- `pair_by_iou(a, b, min_iou, allowed=None) -> dict[int, int]`: a one-to-one pairing of `a` with `b` of the
  highest total IoU among pairs at `min_iou` or above (`allowed`: an [len(a), len(b)] mask of pairs that may
  pair, e.g. same label); what an explorer's answer "supports" of the anchor's (recipe generation 2).
- `MatchResult.without_predictions(removed)`: the same matching with unmatched predictions taken out and the
  others renumbered (the prefix's objects once dead anchors leave it).

Cost is `1 - IoU`; pairs with IoU below the gate are forbidden. The Hungarian problem is solved on
an (n_pred + n_gt) square matrix: the top-right diagonal is "pred i unmatched" (fp_cost), the
bottom-left diagonal is "gt j unmatched" (fn_cost), the bottom-right block is free. Leaving a pair
unmatched is thus a real option with a known price, never an artefact of a rectangular solve.
Geometry is compared on the 1000-bin grid (both sides share it, so IoU is unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from learner.core.codec import DetObject

_FORBIDDEN = 1e6


@dataclass(frozen=True)
class MatchConfig:
    iou_gate: float = 0.3
    fp_cost: float = 0.5
    fn_cost: float = 2.0
    mask_resolution: int = 128  # samples per side of the union box for polygon mask IoU

    def __post_init__(self) -> None:
        if not 0.0 <= self.iou_gate <= 1.0:
            raise ValueError(f"iou_gate must be in [0, 1], got {self.iou_gate}")
        if self.fp_cost < 0 or self.fn_cost < 0:
            raise ValueError("fp_cost and fn_cost must be >= 0")
        if self.mask_resolution < 8:
            raise ValueError("mask_resolution must be >= 8")


@dataclass(frozen=True)
class MatchResult:
    pairs: tuple[tuple[int, int, float], ...]
    false_negatives: tuple[int, ...]
    false_positives: tuple[int, ...]

    def gt_of_pred(self) -> dict[int, int]:
        return {p: g for p, g, _ in self.pairs}

    def without_predictions(self, removed: set[int] | frozenset[int]) -> MatchResult:
        """This matching over the predictions left once `removed` (unmatched ones) are taken out, renumbered in
        order."""
        if removed & {p for p, _, _ in self.pairs}:
            raise ValueError(f"predictions {sorted(removed)} include matched ones")
        n = len(self.pairs) + len(self.false_positives)
        new = {old: i for i, old in enumerate(j for j in range(n) if j not in removed)}
        return MatchResult(
            tuple((new[p], g, v) for p, g, v in self.pairs),
            self.false_negatives,
            tuple(new[p] for p in self.false_positives if p not in removed),
        )


def _box_of(o: DetObject) -> tuple[float, float, float, float]:
    xs, ys = o.bins[0::2], o.bins[1::2]
    if o.kind == "bbox_2d":
        return float(xs[0]), float(ys[0]), float(xs[1]), float(ys[1])
    return float(min(xs)), float(min(ys)), float(max(xs)), float(max(ys))


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two [x1, y1, x2, y2] boxes (a reversed box has no area)."""
    area_a = max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1])
    area_b = max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, iw) * max(0.0, ih)
    union = area_a + area_b - inter
    return inter / union if union > 0 else 0.0


def _polygon(o: DetObject) -> np.ndarray:
    if o.kind == "poly":
        return np.asarray(o.bins, dtype=np.float64).reshape(-1, 2)
    x1, y1, x2, y2 = _box_of(o)
    return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], dtype=np.float64)


def _inside(poly: np.ndarray, px: np.ndarray, py: np.ndarray) -> np.ndarray:
    """Even-odd rule point-in-polygon for many points at once."""
    inside = np.zeros(px.shape, dtype=bool)
    x0, y0 = poly[:, 0], poly[:, 1]
    x1, y1 = np.roll(x0, -1), np.roll(y0, -1)
    for ax, ay, bx, by in zip(x0, y0, x1, y1, strict=True):
        if ay == by:
            continue
        crosses = (ay > py) != (by > py)
        xcross = ax + (py - ay) * (bx - ax) / (by - ay)
        inside ^= crosses & (px < xcross)
    return inside


def _mask_iou(a: DetObject, b: DetObject, resolution: int) -> float:
    pa, pb = _polygon(a), _polygon(b)
    lo = np.minimum(pa.min(0), pb.min(0))
    hi = np.maximum(pa.max(0), pb.max(0))
    if np.any(hi - lo <= 0):
        return 0.0
    # Sample cell centres of a grid over the union box; resolution bounds the cost per pair.
    nx = int(min(resolution, max(1, hi[0] - lo[0])))
    ny = int(min(resolution, max(1, hi[1] - lo[1])))
    xs = lo[0] + (np.arange(nx) + 0.5) * (hi[0] - lo[0]) / nx
    ys = lo[1] + (np.arange(ny) + 0.5) * (hi[1] - lo[1]) / ny
    px, py = np.meshgrid(xs, ys)
    ma, mb = _inside(pa, px, py), _inside(pb, px, py)
    union = np.count_nonzero(ma | mb)
    return float(np.count_nonzero(ma & mb)) / union if union else 0.0


def iou(a: DetObject, b: DetObject, mask_resolution: int = 128) -> float:
    if a.kind == "bbox_2d" and b.kind == "bbox_2d":
        return box_iou(_box_of(a), _box_of(b))
    if box_iou(_box_of(a), _box_of(b)) == 0.0:
        return 0.0  # disjoint bounding boxes: skip rasterising
    return _mask_iou(a, b, mask_resolution)


def iou_matrix(pred: Sequence[DetObject], gt: Sequence[DetObject], mask_resolution: int = 128) -> np.ndarray:
    m = np.zeros((len(pred), len(gt)), dtype=np.float64)
    for i, p in enumerate(pred):
        for j, g in enumerate(gt):
            m[i, j] = iou(p, g, mask_resolution)
    return m


def match(pred: Sequence[DetObject], gt: Sequence[DetObject], cfg: MatchConfig | None = None) -> MatchResult:
    cfg = cfg or MatchConfig()
    n, m = len(pred), len(gt)
    if n == 0 or m == 0:
        return MatchResult((), tuple(range(m)), tuple(range(n)))
    ious = iou_matrix(pred, gt, cfg.mask_resolution)
    size = n + m
    cost = np.full((size, size), _FORBIDDEN)
    cost[:n, :m] = np.where(ious >= cfg.iou_gate, 1.0 - ious, _FORBIDDEN)
    cost[np.arange(n), m + np.arange(n)] = cfg.fp_cost
    cost[n + np.arange(m), np.arange(m)] = cfg.fn_cost
    cost[n:, m:] = 0.0
    rows, cols = linear_sum_assignment(cost)
    pairs = []
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
        if r < n and c < m and cost[r, c] < _FORBIDDEN:
            pairs.append((r, c, float(ious[r, c])))
    pairs.sort(key=lambda p: p[1])
    matched_p = {p for p, _, _ in pairs}
    matched_g = {g for _, g, _ in pairs}
    return MatchResult(
        pairs=tuple(pairs),
        false_negatives=tuple(j for j in range(m) if j not in matched_g),
        false_positives=tuple(i for i in range(n) if i not in matched_p),
    )


def pair_by_iou(
    a: Sequence[DetObject],
    b: Sequence[DetObject],
    min_iou: float,
    allowed: np.ndarray | None = None,
    mask_resolution: int = 128,
) -> dict[int, int]:
    """One-to-one pairs (index in `a` -> index in `b`) of the highest total IoU, each at `min_iou` or above and
    allowed by `allowed` (all pairs when None). Labels play no part unless `allowed` says so."""
    if not a or not b:
        return {}
    ious = iou_matrix(a, b, mask_resolution)
    ok = ious >= min_iou
    if allowed is not None:
        ok &= allowed
    if not ok.any():
        return {}
    rows, cols = linear_sum_assignment(np.where(ok, ious, 0.0), maximize=True)
    return {int(r): int(c) for r, c in zip(rows.tolist(), cols.tolist(), strict=True) if ok[r, c]}
