"""studies/method/paired.py's COCO mAP of resampled record sets equals faster-coco-eval's (learner.evaluation.coco_map)
on the same sets: records repeated, reordered, with ties in score across records, labels written two ways, a
label no ground truth uses, empty records, boxes past the image and reversed corners."""

from __future__ import annotations

import random

import pytest
from benchmark_module import load_study

from learner.core.clean_prefix import normalize_label
from learner.evaluation.coco_map import Box, coco_map, order_score


def _paired():
    return load_study("paired")


LABELS = ("red circle", "Red_Circle", "blue square", "green triangle")


def _records(rng: random.Random, n: int) -> tuple[list[list[Box]], list[list[Box]], list[tuple[int, int]]]:
    truth, predicted, sizes = [], [], []
    for _ in range(n):
        w, h = rng.choice(((320, 320), (384, 256)))
        gts, dts = [], []
        for _ in range(rng.choice((0, 1, 3, 5, 8))):
            x, y, s = rng.uniform(-10, w - 20), rng.uniform(0, h - 20), rng.uniform(12, 60)
            label = rng.choice(LABELS)
            gts.append(Box(label, (x, y, x + s, y + s)))
            for _ in range(rng.choice((0, 1, 1, 1, 2))):  # missed, found, found twice
                j = rng.uniform(-0.3, 0.3) * s
                box = (x + s + j, y, x, y + s - j) if rng.random() < 0.2 else (x + j, y, x + s, y + s + j)
                dts.append(Box(rng.choice((label, label, label, "blue square")), box))
        if rng.random() < 0.3:  # a hallucination, sometimes of a label no ground truth uses
            dts.append(Box(rng.choice(("purple star", "green triangle")), (5.0, 5.0, 40.0, 50.0)))
        rng.shuffle(dts)
        truth.append(gts)
        predicted.append([Box(b.label, b.xyxy, order_score(i)) for i, b in enumerate(dts)])
        sizes.append((w, h))
    return truth, predicted, sizes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resampled_map_equals_faster_coco_eval(seed: int) -> None:
    paired = _paired()
    rng = random.Random(seed)
    truth, predicted, sizes = _records(rng, 40)
    matches = paired.RecordMatches(truth, predicted, sizes)
    draws = [list(range(40)), list(range(39, -1, -1))] + [[rng.randrange(40) for _ in range(40)] for _ in range(6)]
    for idx in draws:
        want = coco_map(
            [truth[i] for i in idx], [predicted[i] for i in idx], [sizes[i] for i in idx], category=normalize_label
        )["map"]
        assert matches.map(idx) == pytest.approx(want, abs=1e-12), idx
    assert 0.05 < matches.map(list(range(40))) < 0.95  # neither empty nor perfect: the comparison has content


def test_a_resample_without_ground_truth_has_no_map_and_perfect_answers_score_one() -> None:
    paired = _paired()
    gt = [Box("cup", (0.0, 0.0, 10.0, 10.0)), Box("cup", (20.0, 0.0, 30.0, 10.0))]
    perfect = [Box(b.label, b.xyxy, order_score(i)) for i, b in enumerate(gt)]
    matches = paired.RecordMatches([gt, []], [perfect, [Box("cup", (1.0, 1.0, 5.0, 5.0))]], [(64, 64), (64, 64)])
    assert matches.map([0, 0]) == pytest.approx(1.0)
    assert matches.map([1, 1]) != matches.map([1, 1])  # NaN: nothing to find
    assert matches.map([0, 1]) < 1.0  # the empty record's false positive ranks above the second cup


def test_the_map_bootstrap_cancels_shared_difficulty_and_sees_a_gain() -> None:
    """paired_bootstrap with the mAP figure: an arm equal to the other gives exactly zero; an arm that also finds
    the object the other misses on every third record is above it."""
    paired = _paired()
    rng = random.Random(3)
    truth, predicted, sizes = _records(rng, 30)
    base = paired.RecordMatches(truth, [p[:1] for p in predicted], sizes)
    more = paired.RecordMatches(
        truth,
        [
            p[:1] + ([Box(g.label, g.xyxy, 0.01) for g in t] if i % 3 == 0 else [])
            for i, (p, t) in enumerate(zip(predicted, truth, strict=True))
        ],
        sizes,
    )
    figure = paired.RecordMatches.map
    assert paired.paired_bootstrap({0: base, 1: base}, {0: base, 1: base}, figure=figure, draws=200) == (0, 0, 0)
    d, lo, hi = paired.paired_bootstrap({0: more, 1: more}, {0: base, 1: base}, figure=figure, draws=200)
    assert 0.0 < lo <= d <= hi
