"""The objective interface (learner/train/objectives/base.py) from the outside: a third objective is one module
(tests/learner/toy_objective.py) and one registry line (rmsft.jobspec.objectives), the spec and the CRD's enum take
its name, the loop runs it like the two it ships with, and its own figures reach the bar, the summary and /metrics
with no edit to their code."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # torch's own spelling
from trainer_fixtures import make_job


def test_a_third_objective_is_one_module_and_one_registry_line(
    tmp_path: Path,
    tiny_model_dir: Path,
    data_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rich.console import Console
    from rmsft_operator.crd import spec_schema
    from toy_objective import PromptLM

    from learner.local import train_in_process
    from learner.tracking import metrics as m
    from learner.train.build import build_loop
    from learner.train.checkpoint_files import list_checkpoints
    from learner.train.objectives import objective_for
    from rmsft.jobspec import JobSpecError, parse_job
    from rmsft.jobspec.objectives import OBJECTIVES

    manifest = make_job(tiny_model_dir, data_path, tmp_path / "ck", steps=3).model_dump(by_alias=True)
    manifest["spec"]["trainer"] = PromptLM.name
    with pytest.raises(JobSpecError, match=r"spec.trainer 'prompt_lm' names no objective"):
        parse_job(manifest)  # not registered yet: the spec refuses the name
    assert PromptLM.name not in spec_schema()["properties"]["trainer"]["enum"]
    monkeypatch.setitem(OBJECTIVES, PromptLM.name, "toy_objective:PromptLM")  # the registry line
    # The CRD's generator, as `python -m rmsft_operator.crd` runs it, now lists it; the spec takes it.
    assert spec_schema()["properties"]["trainer"]["enum"] == ["rollout_matching", "grpo", "prompt_lm"]
    job = parse_job(manifest)
    assert type(objective_for(job)) is PromptLM
    loop = build_loop(job, [])  # no servers: this objective samples nothing
    first = loop.objective.plan(0).batch
    prompts = [loop.feed.text_prompt(i) for i in first]
    with torch.no_grad():  # the first step's loss, unpacked, by the untrained model
        nll = [
            F.cross_entropy(
                loop.model(input_ids=torch.tensor([p])).logits[0, :-1].float(), torch.tensor(p[1:]), reduction="sum"
            )
            for p in prompts
        ]
    expected = float(sum(nll)) / sum(len(p) - 1 for p in prompts)
    console = Console(record=True, width=300)
    with caplog.at_level(logging.INFO, logger="rmsft.learner"):  # rmsft local's bar and summary, closing the loop
        summary = train_in_process(job, [], auth_token="", resume=False, console=console, loop=loop)
    assert summary.steps == 3 and summary.weight_version == 0  # trained, and never synced: nothing to sync to
    assert summary.losses[0] == pytest.approx(expected, rel=1e-4)  # packed = unpacked, through the loop
    assert [h.record_ids for h in loop.history][0] == [loop.records[i].id for i in first]
    assert sum("prompt-lm loss" in r.getMessage() for r in caplog.records) == 3  # the objective's log line
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step-3"]
    # Its own figure, printed by shared code that knows nothing of it: the bar, the summary table, /metrics.
    tokens = [
        float(sum(len(p) - 1 for p in (loop.feed.text_prompt(i) for i in loop.objective.plan(k).batch)))
        for k in range(3)
    ]
    text = console.export_text()
    assert f"prompt tokens {tokens[-1]:.0f} v0" in text  # the bar's last words
    assert re.search(rf"prompt tokens \(first -> last\)\s*│\s*{tokens[0]:.4g} -> {tokens[-1]:.4g}", text)
    assert summary.series("prompt tokens") == tokens
    assert m.OBJECTIVE_FIGURE.labels("prompt_lm/tokens")._value.get() == tokens[-1]


def test_the_spec_s_trainer_choices_are_the_registry_s_and_the_crd_s() -> None:
    """spec.trainer's enum in the committed CRD is the registry's names, and each entry is the objective it names."""
    import yaml
    from rmsft_operator.crd import spec_schema

    from learner.train.objectives import Objective, objective_class
    from rmsft.jobspec.objectives import OBJECTIVES

    root = Path(__file__).resolve().parents[2]
    crd = yaml.safe_load((root / "charts/rmsft/crds/rolloutmatchingjobs.yaml").read_text())
    committed = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["trainer"]
    assert committed["enum"] == spec_schema()["properties"]["trainer"]["enum"] == list(OBJECTIVES)
    for name in OBJECTIVES:
        cls = objective_class(name)
        assert issubclass(cls, Objective) and cls.name == name


def test_an_unknown_trainer_names_the_objectives_there_are(
    tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    from learner.train.objectives import objective_for

    job = make_job(tiny_model_dir, data_path, tmp_path / "ck")
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"trainer": "dpo"})})
    with pytest.raises(ValueError, match=r"spec.trainer 'dpo' names no objective \(known: grpo, rollout_matching\)"):
        objective_for(job)
