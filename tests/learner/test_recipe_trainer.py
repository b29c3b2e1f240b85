"""The second-generation recipe in the real training loop (tiny model, fake rollout servers over real gRPC):
channel A steps generate nothing and sync nothing, B steps sample an anchor and explorers, the schedule resumes
exactly from a checkpoint, generation 1 stays what it was."""

from __future__ import annotations

import pytest
from trainer_fixtures import make_job


def _trainer(job, servers):
    from learner.train.build import build_loop

    return build_loop(job, [s.address for s in servers])


def _run(job, servers):
    trainer = _trainer(job, servers)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    return trainer, summary


def _seeds(servers) -> list[int]:
    return sorted(seed for s in servers for call in s.engine.calls for _, seed in call)


def test_channels_follow_the_schedule_and_a_steps_neither_generate_nor_sync(
    tmp_path, tiny_model_dir, data_path, servers
) -> None:
    recipe = {"channel_b_ratio": 0.5, "explorers": {"count": 0}}
    trainer, summary = _run(
        make_job(tiny_model_dir, data_path, tmp_path, steps=5, warm_start_steps=1, recipe=recipe), servers
    )
    # Step 1: the warm start; then A B A B (ratio 0.5 counted from the end of the warm start).
    assert [h.figures.channel for h in trainer.history] == ["A", "A", "B", "A", "B"]
    assert [bool(h.rollouts and h.rollouts[0].token_ids) for h in trainer.history] == [False, False, True, False, True]
    generated = sum(len(c) for s in servers for c in s.engine.calls)
    assert generated == 2 * 2  # two B steps x prompts_per_step
    # Weights go out once at the start and before each B step only (the engines hold versions 1..3).
    assert sorted({u.header.version for s in servers for u in s.engine.updates}) == [1, 2, 3]
    assert [h.weight_version for h in trainer.history] == [1, 1, 2, 2, 3]
    # The rollout F1 of the summary counts B steps only.
    assert len(summary.series("f1")) == 2
    # Channel A trains on the whole ground truth: every A step's answer is empty and every object missed.
    assert all(
        h.figures.stats.matched == 0 and h.figures.stats.false_negatives > 0
        for h in trainer.history
        if h.figures.channel == "A"
    )
    # TensorBoard gets the objective's own figures (Objective.scalars): the channel of every step, the rollout
    # figures of the B steps only.
    from learner.tracking.tracker import read_events

    scalars, _ = read_events(summary.log_dir)
    assert [v for _, v in scalars["train/channel_b"]] == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert [s for s, _ in scalars["train/f1"]] == [3, 5] and [v for _, v in scalars["train/f1"]] == summary.series("f1")
    assert [s for s, _ in scalars["train/dead_anchors"]] == [3, 5] and "grpo/reward_mean" not in scalars


def test_anchor_is_greedy_and_explorers_sample_apart(tmp_path, tiny_model_dir, data_path, servers) -> None:
    from learner.train.feed import EXPLORER_SEED_OFFSET

    recipe = {"channel_b_ratio": 1.0, "explorers": {"count": 2, "temperature": 0.7}}
    trainer, summary = _run(make_job(tiny_model_dir, data_path, tmp_path, steps=2, recipe=recipe), servers)
    # Per step: the anchors greedy, one sample each; the explorers at their temperature, two each.
    assert sorted({x for s in servers for x in s.engine.samplings}) == [(0.0, 1), (0.7, 2)]
    anchors = [s for s in _seeds(servers) if s < EXPLORER_SEED_OFFSET]
    explorers = [s for s in _seeds(servers) if s >= EXPLORER_SEED_OFFSET]
    assert len(anchors) == len(explorers) == 2 * 2  # prompts_per_step x steps, one call each way
    assert [s - EXPLORER_SEED_OFFSET for s in explorers] == anchors
    assert summary.steps == 2 and all(h.figures.channel == "B" and h.rollouts for h in trainer.history)


def test_what_only_the_explorers_found_reaches_the_targets(
    tmp_path, tiny_model_dir, data_path, servers, tiny_tokenizer
) -> None:
    """The anchor (greedy) answers nothing; the explorers answer every object the prompt states (the text task's
    prompt lists them): each one is a ground-truth object the anchor missed and an explorer found, and the targets
    take it as recovered. Without the explorers' answers in the targets, nothing is recovered."""
    import re

    from learner.core.codec import CoordExpFormat, DetObject

    def answer(ids: list[int], temperature: float, seed: int | None) -> list[int]:
        stated = re.findall(r"(\w+) at \[(\d+), (\d+), (\d+), (\d+)\]", tiny_tokenizer.decode(ids))
        objects = [DetObject(desc, "bbox_2d", tuple(map(int, box))) for desc, *box in stated] if temperature else []
        text = CoordExpFormat().render(objects)
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]

    for s in servers:
        s.engine.answer = answer
    recipe = {"channel_b_ratio": 1.0, "explorers": {"count": 2, "temperature": 0.7}}
    trainer, _ = _run(make_job(tiny_model_dir, data_path, tmp_path, steps=2, recipe=recipe), servers)
    stats = [h.figures.stats for h in trainer.history]
    gt = sum(st.gt_objects for st in stats)
    assert gt >= 2 * 2  # two prompts a step, one object or more each
    assert [st.matched for st in stats] == [0, 0]  # the anchors found nothing
    assert sum(st.recovered for st in stats) == gt  # every object, through the explorers


def test_schedule_resumes_exactly_from_a_checkpoint(tmp_path, tiny_model_dir, data_path, servers) -> None:
    recipe = {"channel_b_ratio": 0.5, "explorers": {"count": 0}}
    straight, _ = _run(make_job(tiny_model_dir, data_path, tmp_path / "a", steps=4, recipe=recipe), servers)
    _run(make_job(tiny_model_dir, data_path, tmp_path / "b", steps=3, recipe=recipe), servers)
    resumed = _trainer(make_job(tiny_model_dir, data_path, tmp_path / "b", steps=4, recipe=recipe), servers)
    try:
        assert resumed.resume() and resumed.step == 3
        resumed.run()
    finally:
        resumed.close()
    assert [h.figures.channel for h in straight.history] == ["A", "B", "A", "B"]
    assert [(h.step, h.figures.channel) for h in resumed.history] == [(4, "B")]
    assert resumed.history[0].record_ids == straight.history[3].record_ids
    assert resumed.history[0].loss == pytest.approx(straight.history[3].loss, rel=1e-5)


def test_generation_1_samples_every_step_with_its_own_targets(tmp_path, tiny_model_dir, data_path, servers) -> None:
    trainer, _ = _run(make_job(tiny_model_dir, data_path, tmp_path, steps=2, recipe={"generation": 1}), servers)
    assert [h.figures.channel for h in trainer.history] == ["B", "B"]
    core = trainer.core
    assert core.recipe.clean is None and core.recipe.explorers == 0
    assert (core.matching.iou_gate, core.weights.soft_ce, core.weights.smooth_l1) == (0.3, 1.0, 0.0)
    assert "geo" in trainer.history[0].parts and trainer.history[0].parts["geo"] == 0.0


def test_recipe_settings_are_refused_by_name(tiny_model_dir, data_path, tmp_path) -> None:
    from rmsft.jobspec import JobSpecError

    with pytest.raises(JobSpecError, match=r"spec.training.recipe: channel_b_ratio applies to recipe generation 2"):
        make_job(tiny_model_dir, data_path, tmp_path, recipe={"generation": 1, "channel_b_ratio": 0.5})
    with pytest.raises(JobSpecError, match=r"spec.training.recipe.explorers.count must be 0 with"):
        make_job(
            tiny_model_dir,
            data_path,
            tmp_path,
            recipe={"explorers": {"count": 1}},
            rollout={"max_tokens": 16, "max_staleness": 1},
        )
    with pytest.raises(JobSpecError, match=r"channel_b_ratio"):
        make_job(tiny_model_dir, data_path, tmp_path, recipe={"channel_b_ratio": 1.5})


def test_a_model_that_writes_the_other_format_is_named_once(
    tmp_path, tiny_model_dir, data_path, servers, caplog
) -> None:
    """Issue 61: a checkpoint trained in the reference's CoordJSON, run with training.format coordexp, parses to no
    object on every B step; after three such steps the run says once which format its answers are in."""
    import logging

    from transformers import AutoTokenizer

    from learner.core.codec import COORDJSON, DetObject
    from learner.core.vocab import VocabView

    vocab = VocabView.from_hf_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    answer = list(vocab.encode(COORDJSON.render([DetObject("cat", "bbox_2d", (10, 20, 300, 400))]))) + [vocab.eos_id]
    for s in servers:
        s.engine.answer = lambda _ids, _t, _seed: answer
    recipe = {"channel_b_ratio": 1.0, "explorers": {"count": 0}}
    with caplog.at_level(logging.WARNING, logger="rmsft.learner"):
        trainer, _ = _run(make_job(tiny_model_dir, data_path, tmp_path, steps=5, recipe=recipe), servers)
    assert all(
        h.figures.channel == "B" and h.figures.stats.predicted == 0 and h.figures.stats.gt_objects > 0
        for h in trainer.history
    )
    said = [r.getMessage() for r in caplog.records if "training.format" in r.getMessage()]
    assert len(said) == 1 and "set spec.training.format: coordjson" in said[0]
