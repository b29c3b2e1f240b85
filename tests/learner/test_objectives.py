"""The objective interface (learner/train/objectives/base.py) from the outside: a third objective is one module
(tests/learner/toy_objective.py) and one registry line, and the loop runs it like the two it ships with."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # torch's own spelling
from trainer_fixtures import make_job


def test_a_third_objective_is_one_module_and_one_registry_line(tmp_path: Path, tiny_model_dir: Path, data_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from toy_objective import PromptLM

    from learner.train.checkpoint_files import list_checkpoints
    from learner.train.loop import TrainingLoop
    from learner.train.objectives import OBJECTIVES, objective_for

    monkeypatch.setitem(OBJECTIVES, PromptLM.name, PromptLM)  # the registry line
    job = make_job(tiny_model_dir, data_path, tmp_path / "ck", steps=3)
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"trainer": PromptLM.name})})
    assert type(objective_for(job)) is PromptLM
    loop = TrainingLoop(job, [])  # no servers: this objective samples nothing
    try:
        first = loop.objective.plan(0).batch
        prompts = [loop.feed.text_prompt(i) for i in first]
        with torch.no_grad():  # the first step's loss, unpacked, by the untrained model
            nll = [F.cross_entropy(loop.model(input_ids=torch.tensor([p])).logits[0, :-1].float(),
                                   torch.tensor(p[1:]), reduction="sum") for p in prompts]
        expected = float(sum(nll)) / sum(len(p) - 1 for p in prompts)
        with caplog.at_level(logging.INFO, logger="rmsft.learner"):
            summary = loop.run()
    finally:
        loop.close()
    assert summary.steps == 3 and summary.weight_version == 0  # trained, and never synced: nothing to sync to
    assert summary.losses[0] == pytest.approx(expected, rel=1e-4)  # packed = unpacked, through the loop
    assert [h.record_ids for h in loop.history][0] == [loop.records[i].id for i in first]
    assert sum("prompt-lm loss" in r.getMessage() for r in caplog.records) == 3  # the objective's log line
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step-3"]


def test_an_unknown_trainer_names_the_objectives_there_are(tiny_model_dir: Path, data_path: Path,
                                                           tmp_path: Path) -> None:
    from learner.train.objectives import objective_for

    job = make_job(tiny_model_dir, data_path, tmp_path / "ck")
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"trainer": "dpo"})})
    with pytest.raises(ValueError, match=r"spec.trainer 'dpo' names no objective \(known: grpo, rollout_matching\)"):
        objective_for(job)
