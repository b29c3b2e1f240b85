"""The short-answer task of configs/local-tiny-grpo.yaml: records, answers and the reward by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.data.records import load_records
from learner.rewards.interface import RewardInput
from rmsft_dev.synthetic import CoordAnswerReward, answer_bin, write_answer_dataset
from rmsft_dev.tiny_model import CLASS_NAMES


def test_answers_spread_the_classes_over_the_grid(tmp_path: Path) -> None:
    assert [answer_bin(n) for n in CLASS_NAMES][:3] == [31, 93, 156]  # (2i + 1) * 1000 // 32
    assert [answer_bin(n, classes=4) for n in CLASS_NAMES[:4]] == [125, 375, 625, 875]
    path = write_answer_dataset(tmp_path / "a.jsonl", n=40, seed=3, classes=4)
    assert path.read_bytes() == write_answer_dataset(tmp_path / "b.jsonl", n=40, seed=3, classes=4).read_bytes()
    records = load_records(path)  # the learner's own loader accepts them (answer is a Record field)
    assert len(records) == 40 and {r.answer for r in records} == {f"<|coord_{b}|>" for b in (125, 375, 625, 875)}
    for r in records:
        name = next(n for n in CLASS_NAMES[:4] if f"the {n}?" in r.messages[0].content)
        assert r.answer == f"<|coord_{answer_bin(name, 4)}|>"
    with pytest.raises(ValueError, match="classes must be in 1..16"):
        write_answer_dataset(tmp_path / "c.jsonl", classes=17)


def test_reward_by_hand(tmp_path: Path) -> None:
    rec = load_records(write_answer_dataset(tmp_path / "a.jsonl", n=1))[0]  # the person: bin 31
    reward = CoordAnswerReward(width=125)

    def score(text: str) -> float:
        return reward(RewardInput(rec, text))

    assert score("<|coord_31|>") == 1.0
    assert score(" <|coord_93|><|coord_5|>") == pytest.approx(1 - 62 / 125)  # the first token counts
    assert score("<|coord_500|>") == 0.0  # beyond the width
    assert score("person <|coord_31|>") == 0.0  # not a coordinate token first
    assert CoordAnswerReward(width=125, other=-0.1)(RewardInput(rec, "")) == -0.1
    bad = json.loads(rec.model_dump_json()) | {"answer": "thirty-one"}
    with pytest.raises(ValueError, match="one coordinate token"):
        reward(RewardInput(type(rec).model_validate(bad), "<|coord_31|>"))
    with pytest.raises(ValueError, match="width"):
        CoordAnswerReward(width=0)
