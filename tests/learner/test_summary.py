"""The end-of-run summary names the final and the best held-out figures and where the pictures are."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from learner.data.episode import EpisodeStats
from learner.evaluation.held_out import HeldOutFigures
from learner.local import print_summary
from learner.train.results import RolloutMatchingFigures, StepResult, Summary, rollout_rates


def _step(step: int, channel: str, stats: EpisodeStats | None) -> StepResult:
    return StepResult(
        step=step,
        weight_version=step,
        rollouts=[],
        record_ids=[],
        loss=1.0,
        parts={},
        rows=1,
        fill=1.0,
        seconds=0.1,
        figures=RolloutMatchingFigures(channel, stats),
    )


# Two sampling steps of rollout F1 0.4 and 0.6 (P = R = F1), one ground-truth step between them.
_F1_STEPS = [
    _step(1, "B", EpisodeStats(matched=2, false_positives=3, false_negatives=3)),
    _step(2, "A", EpisodeStats(false_negatives=5)),
    _step(3, "B", EpisodeStats(matched=3, false_positives=2, false_negatives=2)),
]


def _summary(**kw) -> Summary:
    base = dict(
        steps=60,
        first_loss=4.0,
        last_loss=3.0,
        losses=[4.0, 3.0],
        history=_F1_STEPS,
        weight_version=41,
        phase_seconds={"rollout": 2.0},
        wall_seconds=10.0,
    )
    return Summary(**(base | kw))


def test_final_and_best_held_out_figures() -> None:
    s = _summary(evaluations=[(20, 0.50, 0.30), (40, 0.70, 0.45), (60, 0.65, 0.44), (61, 0.70, 0.40)])
    assert s.final_evaluation == (61, 0.70, 0.40)
    assert s.best_evaluation == (40, 0.70, 0.45)  # the earliest of a tie
    assert _summary().final_evaluation is None and _summary().best_evaluation is None


def test_print_summary_names_them_and_the_pictures_folder(tmp_path: Path) -> None:
    pictures = [tmp_path / "heldout" / f"step-60-{i}.png" for i in range(4)]
    s = _summary(
        evaluations=[(20, 0.5, 0.3), (40, 0.75, 0.5), (60, 0.7, 0.45)],
        eval_pictures=pictures,
        pictures=[tmp_path / "rollouts" / "a.png"],
    )
    console = Console(record=True, width=200)
    print_summary(s, console)
    text = console.export_text()
    assert "held-out label-aware F1@0.5, final" in text and "0.700 (mAP 0.450) at step 60" in text
    assert "held-out label-aware F1@0.5, best" in text and "0.750 (mAP 0.500) at step 40" in text
    assert f"4 in {tmp_path / 'heldout'}" in text
    assert "rollout F1 (first -> last)" in text and "0.400 -> 0.600" in text


def test_rollout_rates_are_the_mean_over_rollout_matching_steps() -> None:
    # Step 1 is channel A (nothing generated: its stats would say 0 truncated of 0); step 4 reuses a batch.
    history = [
        _step(1, "A", EpisodeStats(rollouts=8, gt_objects=12)),
        _step(2, "B", EpisodeStats(rollouts=4, truncated=1, predicted=10, duplicates=1, gt_objects=5)),
        _step(3, "B", EpisodeStats(rollouts=4, truncated=3, predicted=6, duplicates=3, gt_objects=6)),
        _step(4, "B", None),
    ]
    assert _summary().series("f1") == pytest.approx([0.4, 0.6])  # the sampling steps' only
    rates = rollout_rates([h.figures for h in history])
    assert rates == {
        "steps": 2.0,
        "truncation_rate": pytest.approx((0.25 + 0.75) / 2),
        "duplicate_rate": pytest.approx((0.1 + 0.5) / 2),
        "predicted_per_gt": pytest.approx((2 + 1) / 2),
    }
    assert rollout_rates([h.figures for h in history[:1]]) is None


def test_print_summary_shows_every_held_out_figure_and_the_rollout_rates() -> None:
    fig = HeldOutFigures(
        step=20,
        f1=0.5,
        f1_geometry=0.625,
        map=0.25,
        map_agnostic=0.375,
        truncation_rate=0.125,
        duplicate_rate=0.0625,
        predicted_per_answer=1.75,
        gt_per_record=1.5,
    )
    history = [_step(21, "B", EpisodeStats(rollouts=4, truncated=1, predicted=8, duplicates=2, gt_objects=4))]
    s = _summary(evaluations=[(20, 0.5, 0.25)], held_out=[fig], history=history)
    console = Console(record=True, width=400)
    print_summary(s, console)
    text = console.export_text()
    assert "label-aware F1 0.500  mAP 0.250" in text
    assert "geometry F1 0.625, class-agnostic mAP 0.375" in text
    assert "truncated 12.5%, duplicates 6.2%, objects 1.75/answer vs 1.50 true" in text
    assert "training rollouts (mean of 1 rollout-matching steps)" in text
    assert "truncated 25.0%, duplicates 25.0%, 2.00 predicted per ground-truth object" in text


def test_the_learner_log_closes_with_the_same_figures(caplog: pytest.LogCaptureFixture) -> None:
    from rmsft_cli.app import _log_summary

    fig = HeldOutFigures(
        step=20,
        f1=0.5,
        f1_geometry=0.625,
        map=0.25,
        map_agnostic=0.375,
        truncation_rate=0.125,
        duplicate_rate=0.0625,
        predicted_per_answer=1.75,
        gt_per_record=1.5,
    )
    history = [_step(21, "B", EpisodeStats(rollouts=4, truncated=1, predicted=8, duplicates=2, gt_objects=4))]
    with caplog.at_level("INFO", logger="rmsft.train"):
        _log_summary(_summary(evaluations=[(20, 0.5, 0.25)], held_out=[fig], history=history))
    text = caplog.text
    assert "held-out evaluation at step 20: label-aware F1@0.5 0.500 mAP 0.250; geometry F1 0.625" in text
    assert "training rollouts (mean of 1 rollout-matching steps): truncated 25.0%, duplicates 25.0%" in text
