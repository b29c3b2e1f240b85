"""A run whose answers are in another format than training.format says so, once (learner/core/format_watch.py)."""

from __future__ import annotations

import logging

from learner.core.codec import COORDEXP, COORDJSON, QWEN_JSON, DetObject
from learner.core.format_watch import FormatWatch

CAT = DetObject("cat", "bbox_2d", (12, 56, 200, 512))
DOG = DetObject("dog", "bbox_2d", (500, 500, 700, 700))


def _answers(vocab, fmt, n=2):
    return [list(vocab.encode(fmt.render([CAT, DOG][: 1 + i % 2]))) + [vocab.eos_id] for i in range(n)]


def test_answers_of_the_other_format_are_named_once_after_three_empty_steps(tiny_vocab, caplog):
    watch = FormatWatch(COORDEXP, tiny_vocab, steps=3)
    reference = _answers(tiny_vocab, COORDJSON)  # what a reference stage-1 checkpoint writes
    with caplog.at_level(logging.WARNING, logger="rmsft.learner"):
        assert watch.observe(reference, predicted=0, gt_objects=3) is None
        assert watch.observe(reference, predicted=0, gt_objects=0) is None  # empty ground truth: says nothing
        assert watch.observe(reference, predicted=0, gt_objects=3) is None
        message = watch.observe(reference, predicted=0, gt_objects=3)
        assert message is not None and "set spec.training.format: coordjson" in message
        assert "in training.format coordexp" in message and "give 9 objects" in message  # 3 steps x 3 objects
        assert watch.observe(reference, predicted=0, gt_objects=3) is None  # once
    assert [r.getMessage() for r in caplog.records] == [message]


def test_a_step_with_objects_resets_the_count_and_unreadable_answers_are_said_so(tiny_vocab):
    watch = FormatWatch(COORDJSON, tiny_vocab, steps=2)
    legacy = _answers(tiny_vocab, COORDEXP)
    assert watch.observe(legacy, 0, 2) is None
    assert watch.observe(_answers(tiny_vocab, COORDJSON), 3, 3) is None  # this step parsed: start again
    assert watch.observe(legacy, 0, 2) is None
    assert "read as coordexp give 6 objects" in watch.observe(legacy, 0, 2)
    # Answers no format reads: the warning says so instead of naming one.
    garbage = [list(tiny_vocab.encode("I see a cat.")) + [tiny_vocab.eos_id]]
    blind = FormatWatch(QWEN_JSON, tiny_vocab, steps=1)
    assert "give no object either" in blind.observe(garbage, 0, 1)
