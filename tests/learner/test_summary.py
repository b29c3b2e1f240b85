"""The end-of-run summary names the final and the best held-out figures and where the pictures are."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from learner.local import print_summary
from learner.train.results import Summary


def _summary(**kw) -> Summary:
    base = dict(steps=60, first_loss=4.0, last_loss=3.0, losses=[4.0, 3.0], f1=[0.4, 0.6], weight_version=41,
                phase_seconds={"rollout": 2.0}, wall_seconds=10.0)
    return Summary(**(base | kw))


def test_final_and_best_held_out_figures() -> None:
    s = _summary(evaluations=[(20, 0.50, 0.30), (40, 0.70, 0.45), (60, 0.65, 0.44), (61, 0.70, 0.40)])
    assert s.final_evaluation == (61, 0.70, 0.40)
    assert s.best_evaluation == (40, 0.70, 0.45)  # the earliest of a tie
    assert _summary().final_evaluation is None and _summary().best_evaluation is None


def test_print_summary_names_them_and_the_pictures_folder(tmp_path: Path) -> None:
    pictures = [tmp_path / "heldout" / f"step-60-{i}.png" for i in range(4)]
    s = _summary(evaluations=[(20, 0.5, 0.3), (40, 0.75, 0.5), (60, 0.7, 0.45)], eval_pictures=pictures,
                 pictures=[tmp_path / "rollouts" / "a.png"])
    console = Console(record=True, width=200)
    print_summary(s, console)
    text = console.export_text()
    assert "held-out F1@0.5, final" in text and "0.700 (mAP 0.450) at step 60" in text
    assert "held-out F1@0.5, best" in text and "0.750 (mAP 0.500) at step 40" in text
    assert f"4 in {tmp_path / 'heldout'}" in text
    assert "rollout F1 (first -> last)" in text and "0.400 -> 0.600" in text
