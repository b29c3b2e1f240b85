"""Matcher: gate, dummy costs, Hungarian optimality, polygons."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.core.codec import DetObject
from learner.core.match import MatchConfig, iou, iou_matrix, match


def box(x1, y1, x2, y2, desc="obj") -> DetObject:
    return DetObject(desc, "bbox_2d", (x1, y1, x2, y2))


def poly(*xy, desc="obj") -> DetObject:
    return DetObject(desc, "poly", tuple(xy))


A, B, C = box(0, 0, 100, 100), box(200, 200, 300, 300), box(500, 500, 700, 600)


def test_perfect_prediction():
    r = match([C, A, B], [A, B, C])
    assert sorted((p, g) for p, g, _ in r.pairs) == [(0, 2), (1, 0), (2, 1)]
    assert all(v == 1.0 for _, _, v in r.pairs)
    assert r.false_negatives == () and r.false_positives == ()


def test_extra_predictions_are_false_positives():
    r = match([A, box(800, 800, 900, 900), B], [A, B])
    assert [(p, g) for p, g, _ in r.pairs] == [(0, 0), (2, 1)]
    assert r.false_positives == (1,) and r.false_negatives == ()


def test_missed_objects_are_false_negatives():
    r = match([B], [A, B, C])
    assert [(p, g) for p, g, _ in r.pairs] == [(0, 1)]
    assert r.false_negatives == (0, 2) and r.false_positives == ()


def test_duplicates_match_once():
    near = box(0, 0, 100, 90)
    r = match([near, A, box(2, 2, 100, 100)], [A])
    assert [(p, g) for p, g, _ in r.pairs] == [(1, 0)]  # the best duplicate wins
    assert r.false_positives == (0, 2)


def test_pairs_under_the_gate_are_forbidden():
    shifted = box(60, 0, 160, 100)  # IoU with A = 40 / 160 = 0.25
    assert iou(shifted, A) == pytest.approx(0.25)
    r = match([shifted], [A])
    assert r.pairs == () and r.false_negatives == (0,) and r.false_positives == (0,)
    r = match([shifted], [A], MatchConfig(iou_gate=0.2))
    assert [(p, g) for p, g, _ in r.pairs] == [(0, 0)]


def test_empty_prediction_and_empty_ground_truth():
    r = match([], [A, B])
    assert r.pairs == () and r.false_negatives == (0, 1) and r.false_positives == ()
    r = match([A, B], [])
    assert r.pairs == () and r.false_negatives == () and r.false_positives == (0, 1)
    assert match([], []).pairs == ()


def test_fn_cost_makes_unmatching_an_option():
    # With a tiny FN+FP price, leaving a poor pair unmatched is cheaper than matching it.
    weak = box(0, 0, 100, 40)  # IoU 0.4 -> cost 0.6
    assert match([weak], [A]).pairs
    r = match([weak], [A], MatchConfig(fp_cost=0.1, fn_cost=0.1))
    assert r.pairs == () and r.false_negatives == (0,)


def test_polygons_mask_iou():
    square = poly(0, 0, 100, 0, 100, 100, 0, 100)
    assert iou(square, A) == pytest.approx(1.0, abs=1e-6)
    tri = poly(0, 0, 100, 0, 0, 100)  # half of the square
    assert iou(tri, square) == pytest.approx(0.5, abs=0.02)
    other_tri = poly(100, 0, 100, 100, 0, 100)  # the other half: touching, no overlap
    assert iou(tri, other_tri) == pytest.approx(0.0, abs=0.02)
    # Concave L shape: 3 of the 4 quadrants of the square.
    ell = poly(0, 0, 100, 0, 100, 50, 50, 50, 50, 100, 0, 100)
    assert iou(ell, square) == pytest.approx(0.75, abs=0.02)
    r = match([other_tri, tri], [square, box(0, 0, 100, 100)])
    assert len(r.pairs) == 2 and r.false_negatives == ()


def test_degenerate_geometry_has_zero_iou():
    flat = box(10, 10, 10, 50)
    assert iou(flat, A) == 0.0
    assert match([flat], [A]).pairs == ()


boxes = st.builds(
    lambda x, y, w, h: box(x, y, min(999, x + w), min(999, y + h)),
    st.integers(0, 900),
    st.integers(0, 900),
    st.integers(1, 200),
    st.integers(1, 200),
)


@settings(max_examples=150, deadline=None)
@given(pred=st.lists(boxes, max_size=4), gt=st.lists(boxes, max_size=4))
def test_assignment_is_optimal_against_brute_force(pred, gt):
    cfg = MatchConfig()
    r = match(pred, gt, cfg)
    ious = iou_matrix(pred, gt)

    def cost(pairs):
        return (
            sum(1 - ious[p, g] for p, g in pairs)
            + cfg.fp_cost * (len(pred) - len(pairs))
            + cfg.fn_cost * (len(gt) - len(pairs))
        )

    best = cost([])
    for k in range(1, min(len(pred), len(gt)) + 1):
        for ps in itertools.permutations(range(len(pred)), k):
            for gs in itertools.combinations(range(len(gt)), k):
                pairs = list(zip(ps, gs, strict=True))
                if all(ious[p, g] >= cfg.iou_gate for p, g in pairs):
                    best = min(best, cost(pairs))
    got = [(p, g) for p, g, _ in r.pairs]
    assert all(ious[p, g] >= cfg.iou_gate for p, g in got)
    assert cost(got) == pytest.approx(best, abs=1e-9)
    assert sorted(r.false_negatives + tuple(g for _, g in got)) == list(range(len(gt)))
    assert sorted(r.false_positives + tuple(p for p, _ in got)) == list(range(len(pred)))
