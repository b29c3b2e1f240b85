"""COCO mAP through faster-coco-eval: a case worked out by hand, the empty cases, and no console output."""

from __future__ import annotations

import math

import pytest

from learner.evaluation.coco_map import Box, boxes_from_detections, coco_map, order_score

SIZES = [(100, 100), (100, 100)]

# Image 1: a cat found, then found again (a duplicate), and a bird called "dog" (a label other ground truth
# uses: a false positive of "dog" and a miss of "bird"). Image 2: a cat found exactly, a dog found with IoU
# 0.72 (40x28.8 inside 40x40).
GT = [
    [Box("cat", (0, 0, 40, 40)), Box("bird", (50, 50, 90, 90))],
    [Box("cat", (10, 10, 50, 50)), Box("dog", (60, 60, 100, 100))],
]
PRED = [
    [Box("cat", (0, 0, 40, 40), 0.9), Box("cat", (2, 2, 40, 40), 0.8), Box("dog", (50, 50, 90, 90), 0.7)],
    [Box("cat", (10, 10, 50, 50), 0.6), Box("dog", (60, 60, 100, 88.8), 0.5)],
]

# By hand, COCO's rules: per category, predictions of all images sorted by score; each takes the unmatched
# ground truth it overlaps best at IoU >= t; precision made non-increasing from the right; AP = its mean at
# the 101 recall points 0, .01, ..., 1 (the first ranked point whose recall reaches r; 0 past the last).
#
# cat (2 gt): .9 TP (R .5, P 1), .8 FP (the duplicate's cat is taken: R .5, P .5), .6 TP (R 1, P 2/3).
#   Envelope 1, 2/3, 2/3: r <= .50 -> 1 (51 points), r in .51..1 -> 2/3 (50 points).
#   AP = (51 + 50 * 2/3) / 101 = 253/303 at every threshold (both TPs have IoU 1).
# dog (1 gt, in image 2): .7 FP (image 1 has no dog), .5 IoU .72: TP for t in .50..70 (5 thresholds) ->
#   (R 0, P 0), (R 1, P 1/2): envelope 1/2 everywhere, AP = 1/2; for t in .75..95 no TP: AP = 0.
# bird (1 gt): never predicted: AP = 0.
# map_50 = (253/303 + 1/2 + 0) / 3 = 809/1818;  map_75 = (253/303 + 0 + 0) / 3 = 253/909
# map = mean over the 10 thresholds = (5 * 809/1818 + 5 * 253/909) / 10 = 1315/3636
# mar: cat recall 1 at every t, dog 1 at 5 of 10, bird 0 -> (1 + 1/2 + 0) / 3 = 1/2


def test_hand_computed_case() -> None:
    r = coco_map(GT, PRED, SIZES)
    assert r["map_50"] == pytest.approx(809 / 1818, abs=1e-9)
    assert r["map_75"] == pytest.approx(253 / 909, abs=1e-9)
    assert r["map"] == pytest.approx(1315 / 3636, abs=1e-9)
    assert r["mar"] == pytest.approx(0.5, abs=1e-9)
    assert (r["n_images"], r["n_ground_truth"], r["n_predictions"], r["n_unknown_label"]) == (2, 4, 5, 0)


def test_the_evaluator_writes_nothing_to_the_console(capfd: pytest.CaptureFixture[str]) -> None:
    coco_map(GT, PRED, SIZES)
    coco_map(GT, [[], []], SIZES)
    out, err = capfd.readouterr()  # file descriptors too: the evaluator's C++ could write there
    assert out == "" and err == ""


def test_no_predictions_is_zero() -> None:
    r = coco_map(GT, [[], []], SIZES)
    assert (r["map"], r["map_50"], r["map_75"], r["mar"]) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("images", [0, 2])
def test_no_ground_truth_anywhere_is_nan(images: int) -> None:
    pred = [[Box("cat", (0, 0, 10, 10))]] * images
    r = coco_map([[]] * images, pred, [(50, 50)] * images)
    assert all(math.isnan(r[k]) for k in ("map", "map_50", "map_75", "mar"))
    assert r["n_unknown_label"] == images


def test_an_image_without_ground_truth_contributes_false_positives() -> None:
    # The cat of image 2 (no ground truth there) outranks the true one: cat (R 0, P 0), (R 1, P 1/2).
    gt = [[Box("cat", (0, 0, 10, 10))], []]
    pred = [[Box("cat", (0, 0, 10, 10), 0.5)], [Box("cat", (0, 0, 10, 10), 0.9)]]
    assert coco_map(gt, pred, [(50, 50)] * 2)["map"] == pytest.approx(0.5)
    ranked_after = [[Box("cat", (0, 0, 10, 10), 0.9)], [Box("cat", (0, 0, 10, 10), 0.5)]]
    assert coco_map(gt, ranked_after, [(50, 50)] * 2)["map"] == pytest.approx(1.0)


def test_a_label_only_predicted_is_counted_not_an_error() -> None:
    extra = [PRED[0], [*PRED[1], Box("unicorn", (0, 0, 30, 30), 0.95)]]
    r = coco_map(GT, extra, SIZES)
    # Its category has no ground truth, so COCO leaves it out of the mean: no AP moves.
    assert r["map"] == pytest.approx(1315 / 3636, abs=1e-9)
    assert r["n_unknown_label"] == 1 and r["n_predictions"] == 6


def test_wrong_label_with_ground_truth_elsewhere_lowers_that_category() -> None:
    gt = [[Box("cat", (0, 0, 10, 10))], [Box("dog", (0, 0, 10, 10))]]
    right = [[Box("cat", (0, 0, 10, 10))], [Box("dog", (0, 0, 10, 10))]]
    wrong = [[Box("dog", (0, 0, 10, 10))], [Box("dog", (0, 0, 10, 10), 0.5)]]
    assert coco_map(gt, right, [(50, 50)] * 2)["map"] == pytest.approx(1.0)
    # cat: missed (0). dog: FP (1.0) then TP (0.5): P 1/2 at R 1 -> AP 1/2. Mean 1/4.
    assert coco_map(gt, wrong, [(50, 50)] * 2)["map"] == pytest.approx(0.25)


def test_boxes_are_normalised_and_clipped() -> None:
    gt = [[Box("cat", (0, 0, 20, 20))]]
    # Reversed corners, and a box hanging over the top-left edge: clipped to (0, 0, 20, 20).
    assert coco_map(gt, [[Box("cat", (20, 20, 0, 0))]], [(20, 20)])["map"] == pytest.approx(1.0)
    assert coco_map(gt, [[Box("cat", (-10, -10, 20, 20))]], [(20, 20)])["map"] == pytest.approx(1.0)


def test_more_than_100_predictions_in_an_image_all_count() -> None:
    # 150 misses first, the hit last: COCO's default cap of 100 would drop the hit (AP 0).
    pred = [[Box("cat", (30, 30, 31, 31), 1.0 - i / 1000) for i in range(150)] + [Box("cat", (0, 0, 10, 10), 0.1)]]
    r = coco_map([[Box("cat", (0, 0, 10, 10))]], pred, [(50, 50)])
    assert r["mar"] == pytest.approx(1.0)
    assert r["map"] == pytest.approx(1 / 151)


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="one of each per image"):
        coco_map(GT, PRED, SIZES[:1])
    with pytest.raises(ValueError, match="finite"):
        coco_map([[Box("cat", (0, 0, math.nan, 1))]], [[]], [(10, 10)])
    with pytest.raises(ValueError, match="must be positive"):
        coco_map([[]], [[]], [(0, 10)])


def test_boxes_from_detections_ranks_by_written_order() -> None:
    dets = [("cat", "bbox_2d", [1, 2, 3, 4]), ("dog", "poly", [5, 1, 9, 4, 6, 8])]
    boxes = boxes_from_detections(dets)
    assert boxes == [Box("cat", (1, 2, 3, 4), 1.0), Box("dog", (5, 1, 9, 8), 0.5)]
    assert [b.score for b in boxes_from_detections(dets, rank_by_order=False)] == [1.0, 1.0]
    assert [order_score(i) for i in range(3)] == [1.0, 0.5, pytest.approx(1 / 3)]
    # Written order is the ranking: the first object of the answer is tried first.
    gt = [[Box("cat", (0, 0, 10, 10))]]
    answer = boxes_from_detections([("cat", "bbox_2d", [0, 0, 10, 10]), ("cat", "bbox_2d", [20, 20, 30, 30])])
    assert coco_map(gt, [answer], [(50, 50)])["map"] == pytest.approx(1.0)
    assert coco_map(gt, [answer[::-1]], [(50, 50)])["map"] == pytest.approx(1.0)  # scores, not list order
    late = boxes_from_detections([("cat", "bbox_2d", [20, 20, 30, 30]), ("cat", "bbox_2d", [0, 0, 10, 10])])
    assert coco_map(gt, [late], [(50, 50)])["map"] == pytest.approx(0.5)


def test_category_maps_labels_to_categories() -> None:
    from learner.core.clean_prefix import normalize_label

    gt = [[Box("red circle", (0, 0, 10, 10)), Box("blue square", (20, 20, 30, 30))]]
    pred = [[Box("Red_Circle", (0, 0, 10, 10)), Box("green square", (20, 20, 30, 30), 0.5)]]
    # Exact strings: neither prediction names a ground-truth category, both are missed.
    assert coco_map(gt, pred, [(50, 50)])["map"] == pytest.approx(0.0)
    # Normalized: the red circle is found, the blue square missed ("green square" has no ground truth).
    r = coco_map(gt, pred, [(50, 50)], category=normalize_label)
    assert r["map"] == pytest.approx(0.5) and r["n_unknown_label"] == 1
    # One category: geometry alone, both boxes found.
    assert coco_map(gt, pred, [(50, 50)], category=lambda _: "object")["map"] == pytest.approx(1.0)
