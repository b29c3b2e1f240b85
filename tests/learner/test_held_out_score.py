"""Held-out scoring of hand-written answers: label-aware F1 and mAP (the headline) against geometry-only
figures, and what the answers themselves look like (truncation, duplicates, object counts)."""

from __future__ import annotations

import re

import pytest

from learner.core.codec import COORDEXP, NUM_BINS, DetObject, coord_token_text
from learner.core.match import MatchConfig, match
from learner.core.vocab import VocabView
from learner.data.records import GroundTruthObject, Message, Record
from learner.evaluation.held_out import EvalSetup, match_by_label, score

_COORD = re.compile(rb"<\|coord_(\d{1,3})\|>")


def _vocab() -> VocabView:
    """One token per byte, the 1000 coord tokens, an end of turn."""
    pieces = [bytes([b]) for b in range(256)] + [coord_token_text(k).encode() for k in range(NUM_BINS)]
    eos = len(pieces)
    pieces.append(b"<|im_end|>")

    def encode(text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            m = _COORD.match(data, i)
            if m:
                out.append(256 + int(m.group(1)))
                i = m.end()
            else:
                out.append(data[i])
                i += 1
        return out

    return VocabView(
        coord_token_ids=tuple(range(256, 256 + NUM_BINS)), token_bytes=tuple(pieces), encode=encode, eos_id=eos
    )


VOCAB = _vocab()
SETUP = EvalSetup(vocab=VOCAB, fmt=COORDEXP, matching=MatchConfig(iou_gate=0.5))
RED = ("red circle", [0, 0, 40, 40])
BLUE = ("blue square", [50, 50, 90, 90])
GREEN = ("green triangle", [0, 60, 30, 90])


def _record(rid: str, *objects: tuple[str, list[float]]) -> Record:
    return Record(
        id=rid,
        width=100,
        height=100,
        messages=[Message(role="user", content="find the shapes")],
        objects=[GroundTruthObject(desc=d, bbox_2d=b) for d, b in objects],
    )


def _answer(*objects: tuple[str, list[float]], cut: int | None = None) -> list[int]:
    """The answer writing `objects` (pixels of a 100 x 100 image); `cut`: only its first `cut` characters, no
    end of turn (an answer max_tokens stopped)."""
    text = COORDEXP.render([DetObject.from_pixels(d, "bbox_2d", b, 100, 100) for d, b in objects])
    return VOCAB.encode(text[:cut]) if cut is not None else [*VOCAB.encode(text), VOCAB.eos_id]


def test_a_right_box_with_a_wrong_label_counts_for_geometry_only() -> None:
    rec = _record("r", RED, BLUE)
    ev = score([rec], [_answer(RED, ("green square", BLUE[1]))], SETUP, iou=0.5)
    # Label-aware: the red circle found, the blue square missed, a "green square" that is none of the truth.
    at = ev.stats[0.5]
    assert (at.matched, at.false_positives, at.false_negatives) == (1, 1, 1)
    assert ev.f1 == pytest.approx(0.5)
    # Geometry only: both boxes are exact.
    assert ev.geometry[0.5].matched == 2 and ev.f1_geometry == pytest.approx(1.0)
    # COCO: red circle AP 1, blue square AP 0 (missed), "green square" a category without ground truth (out of
    # the mean); class-agnostic: both found first -> 1.
    assert ev.map == pytest.approx(0.5) and ev.map_agnostic == pytest.approx(1.0)
    figures = ev.scalars()
    assert figures["eval/f1"] == pytest.approx(0.5) and figures["eval/f1_geometry"] == pytest.approx(1.0)
    assert figures["eval/map"] == pytest.approx(0.5) and figures["eval/map_agnostic"] == pytest.approx(1.0)
    assert "label-aware F1@0.5 0.500" in ev.describe() and "geometry F1 1.000" in ev.describe()


def test_labels_are_compared_normalized() -> None:
    rec = _record("r", RED, BLUE)
    ev = score([rec], [_answer(("Red_Circle", RED[1]), ("blue  SQUARE", BLUE[1]))], SETUP, iou=0.5)
    assert ev.f1 == pytest.approx(1.0) and ev.map == pytest.approx(1.0)


def test_wrong_label_fails_at_the_training_gate_too() -> None:
    setup = EvalSetup(vocab=VOCAB, fmt=COORDEXP, matching=MatchConfig(iou_gate=0.3))
    ev = score([_record("r", RED)], [_answer(("blue square", RED[1]))], setup, iou=0.5)
    assert ev.stats[0.3].matched == 0 and ev.geometry[0.3].matched == 1
    assert ev.scalars()["eval/f1_iou0.3"] == 0.0 and ev.scalars()["eval/f1_geometry_iou0.3"] == pytest.approx(1.0)


def test_truncation_duplicates_and_counts() -> None:
    records = [_record("a", RED, BLUE), _record("b", RED, BLUE, GREEN)]
    full = _answer(RED, BLUE)
    one = len(COORDEXP.render([DetObject.from_pixels(RED[0], "bbox_2d", RED[1], 100, 100)]))  # "{...}"
    answers = [
        _answer(RED, ("red circle", [1, 1, 40, 40]), BLUE),  # the red circle written twice: one duplicate
        _answer(RED, BLUE, cut=one + 12),  # stopped inside its second object: one object, truncated
    ]
    assert len(answers[1]) < len(full)
    ev = score(records, answers, SETUP, iou=0.5)
    fig = ev.figures()
    assert ev.answer_stats.truncated == 1 and fig.truncation_rate == pytest.approx(0.5)
    assert ev.answer_stats.predicted == 4 and ev.answer_stats.duplicates == 1
    assert fig.duplicate_rate == pytest.approx(1 / 4)
    assert fig.predicted_per_answer == pytest.approx(2.0) and fig.gt_per_record == pytest.approx(2.5)
    assert fig.count_ratio == pytest.approx(0.8)
    # The duplicate is a false positive either way; the truncated answer's objects still count.
    assert ev.stats[0.5].matched == 3 and ev.stats[0.5].false_positives == 1 and ev.stats[0.5].false_negatives == 2
    s = ev.scalars()
    assert (s["eval/truncation_rate"], s["eval/duplicate_rate"], s["eval/predicted_per_gt"]) == pytest.approx(
        (0.5, 0.25, 0.8)
    )
    assert "truncated 50.0%" in ev.describe() and "duplicates 25.0%" in ev.describe()


def test_match_by_label_pairs_only_equal_labels_and_is_the_matcher_within_one_label() -> None:
    def box(desc: str, x: int) -> DetObject:
        return DetObject(desc, "bbox_2d", (x, 0, x + 100, 100))

    pred = [box("cat", 0), box("dog", 200), box("Cat", 410), box("bird", 600)]
    gt = [box("dog", 0), box("cat", 210), box("cat", 400), box("dog", 190)]
    cfg = MatchConfig(iou_gate=0.5)
    r = match_by_label(pred, gt, cfg)
    assert {(p, g) for p, g, _ in r.pairs} == {(1, 3), (2, 2)}
    assert r.false_positives == (0, 3) and r.false_negatives == (0, 1)
    same = [DetObject("cat", o.kind, o.bins) for o in pred]
    assert match_by_label(same, [DetObject("cat", o.kind, o.bins) for o in gt], cfg) == match(
        same, [DetObject("cat", o.kind, o.bins) for o in gt], cfg
    )
