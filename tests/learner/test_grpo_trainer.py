"""The GRPO objective (learner/train/objectives/grpo.py) end to end against real rollout servers without vLLM: the HF
engine behind real gRPC servers on loopback (tests/learner/hf_servers.py), reporting processed log-probs as
`rmsft serve --logprobs-mode processed` does for a GRPO job. configs/local-tiny-grpo.yaml's task (a
coordinate-token answer scored by rmsft_dev.synthetic:CoordAnswerReward), shrunk to seconds."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from hf_servers import InProcessServer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, N = 4, 4
WIDTH = 1000  # the reward's: every coordinate token earns some, so 3 steps of a random model see signal


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rmsft_dev.synthetic import write_answer_dataset

    return write_answer_dataset(tmp_path_factory.mktemp("answers") / "answers.jsonl", n=16, seed=0)


@pytest.fixture
def servers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[InProcessServer]]:
    made = [InProcessServer(tiny_model_dir, tmp_path / f"stage-{i}", logprobs_mode="processed") for i in range(2)]
    yield made
    for s in made:
        s.close()


def grpo_job(model_dir: Path, data: Path, ckpt: Path, *, steps: int = 3, grpo: dict | None = None, **training):
    from rmsft.jobspec import parse_job

    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-grpo.yaml").read_text()))
    doc["metadata"].pop("annotations", None)
    doc["spec"]["model"]["path"] = str(model_dir)
    t = doc["spec"]["training"]
    t.update(steps=steps, prompts_per_step=PROMPTS, lr=2e-3)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 2}
    t["export"] = {"enabled": False}
    t["rollout"].update(request_timeout_s=30)
    # A temperature other than 1: the learner's and the servers' log-probs only agree when both apply it.
    wide = [{"name": "rmsft_dev.synthetic:CoordAnswerReward", "params": {"width": WIDTH}}]
    t["grpo"].update({"group_size": N, "temperature": 0.7, "max_tokens": 4, "rewards": wide, **(grpo or {})})
    t.update(training)
    return parse_job(doc)


def run(job, addresses: list[str], resume: bool = False):
    from learner.train.build import build_loop

    trainer = build_loop(job, addresses)
    captured: list[torch.Tensor] = []
    objective = trainer.objective
    pack = objective._pack
    objective._pack = lambda groups, adv, *rest: captured.append(adv.clone()) or pack(groups, adv, *rest)
    try:
        if resume:
            assert trainer.resume()
        summary = trainer.run()
    finally:
        trainer.close()
    return trainer, summary, captured


def test_steps_are_fenced_scored_per_group_and_finite(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer]
) -> None:
    from learner.core.grpo import group_advantages
    from learner.data.records import load_records
    from learner.rewards.interface import RewardInput
    from learner.tracking import metrics as m
    from learner.tracking.tracker import read_events
    from rmsft_dev.synthetic import CoordAnswerReward

    trainer, summary, advantages = run(grpo_job(tiny_model_dir, answers, tmp_path), [s.address for s in servers])
    records = {r.id: r for r in load_records(answers)}
    tok = trainer.policy.tokenizer
    assert summary.steps == 3 and len(summary.series("reward")) == 3
    # The servers and the learner run the same weights at the same temperature: the mismatch is float noise only.
    assert len(summary.series("mismatch_kl")) == 3 and all(0.0 <= k < 1e-4 for k in summary.series("mismatch_kl"))
    assert [h.weight_version for h in trainer.history] == [1, 2, 3]  # a FULL sync before every step's samples
    for h, adv in zip(trainer.history, advantages, strict=True):
        # Every completion from the learner's version of that step: n per prompt, samples in order.
        assert len(h.rollouts) == PROMPTS * N and {r.weight_version for r in h.rollouts} == {h.weight_version}
        assert [r.sample_index for r in h.rollouts] == list(range(N)) * PROMPTS
        assert [r.request_id for r in h.rollouts[::N]] == h.record_ids
        assert all(r.logprobs is not None and len(r.logprobs) == len(r.token_ids) for r in h.rollouts)
        # The rewards are the task's, per completion; the advantages are normalised within each prompt's group.
        reward = CoordAnswerReward(width=WIDTH)
        want = [
            reward(RewardInput(records[r.request_id], tok.decode(r.token_ids, skip_special_tokens=True)))
            for r in h.rollouts
        ]
        g = h.figures
        assert g.reward_mean == pytest.approx(sum(want) / len(want))
        assert g.rewards["rmsft_dev.synthetic:CoordAnswerReward"] == pytest.approx(g.reward_mean)  # by spec name
        assert torch.allclose(adv, group_advantages(want, N))
        assert torch.allclose(adv.reshape(PROMPTS, N).sum(dim=1), torch.zeros(PROMPTS), atol=1e-5)
        assert (g.completions, g.groups) == (PROMPTS * N, PROMPTS)
        assert all(math.isfinite(v) for v in g.scalars().values()) and math.isfinite(h.loss)
        # Same weights, same temperature on both sides of the ratio: 1 up to float noise, nothing clipped.
        assert g.ratio_mean == pytest.approx(1.0, abs=1e-3) and g.clip_fraction == 0.0
        assert g.kl == 0.0 and g.completion_length == pytest.approx(4.0)  # no stop token in 4 random tokens
    assert m.REWARD.labels("mean")._value.get() == pytest.approx(summary.series("reward")[-1])
    scalars, _ = read_events(summary.log_dir)
    assert [v for _, v in scalars["grpo/reward_mean"]] == pytest.approx(summary.series("reward"))
    assert [v for _, v in scalars["grpo/mismatch_kl"]] == pytest.approx(summary.series("mismatch_kl"))
    assert {
        "grpo/clip_fraction",
        "grpo/kl",
        "grpo/completion_length",
        "grpo/reward/rmsft_dev.synthetic:CoordAnswerReward",
    } <= set(scalars)
    assert "train/channel_b" not in scalars  # rollout matching's channels are not GRPO's (issue 42)


def test_kl_to_the_reference_is_zero_until_the_adapters_move(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer]
) -> None:
    # LoRA starts as the identity (B = 0): the policy is the reference, so the k3 term is exactly 0; one step
    # later the adapters have moved and the KL is positive.
    job = grpo_job(
        tiny_model_dir, answers, tmp_path, steps=2, grpo={"kl_coef": 0.5}, finetune="lora", lora={"r": 8, "alpha": 16}
    )
    trainer, summary, _ = run(job, [s.address for s in servers])
    kls = [h.figures.kl for h in trainer.history]
    assert kls[0] == 0.0 and kls[1] > 0.0
    assert all(math.isfinite(h.loss) for h in trainer.history)


def test_resume_samples_and_trains_what_a_straight_run_does(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer]
) -> None:
    addrs = [s.address for s in servers]
    straight, _, _ = run(grpo_job(tiny_model_dir, answers, tmp_path / "a", steps=3), addrs)
    first, _, _ = run(grpo_job(tiny_model_dir, answers, tmp_path / "b", steps=2), addrs)
    resumed, _, _ = run(grpo_job(tiny_model_dir, answers, tmp_path / "b", steps=3), addrs, resume=True)
    assert [h.step for h in resumed.history] == [3] and resumed.history[0].weight_version == first.version + 1
    last, again = straight.history[2], resumed.history[0]
    assert [r.token_ids for r in again.rollouts] == [r.token_ids for r in last.rollouts]  # same seeds, same weights
    assert again.figures.reward_mean == pytest.approx(last.figures.reward_mean)
    assert again.loss == pytest.approx(last.loss, rel=1e-4, abs=1e-6)


def test_raw_log_probs_at_another_temperature_show_in_the_ratio(
    tmp_path: Path, tiny_model_dir: Path, answers: Path
) -> None:
    # Why GRPO servers report processed log-probs: raw ones (the model's own distribution) against the learner's
    # temperature-0.7 log-probs put the ratio far from 1 at the very first step, where the weights are equal.
    raw = [InProcessServer(tiny_model_dir, tmp_path / f"raw-{i}") for i in range(2)]
    try:
        trainer, _, _ = run(grpo_job(tiny_model_dir, answers, tmp_path / "ck", steps=1), [s.address for s in raw])
    finally:
        for s in raw:
            s.close()
    assert abs(trainer.history[0].figures.ratio_mean - 1.0) > 0.05
    assert trainer.history[0].figures.mismatch_kl > 1e-2  # what the mismatch metric is there to show


def test_an_unknown_reward_is_refused_before_anything_starts(
    tmp_path: Path, tiny_model_dir: Path, answers: Path
) -> None:
    from learner.rewards.interface import UnknownRewardError
    from learner.train.build import build_loop

    job = grpo_job(tiny_model_dir, answers, tmp_path, grpo={"rewards": [{"name": "detection"}, {"name": "nope"}]})
    with pytest.raises(UnknownRewardError, match=r"spec\.training\.grpo\.rewards\[1\] \(nope\): unknown reward"):
        build_loop(job, ["127.0.0.1:1"])


def test_spec_trainer_picks_the_objective(tiny_model_dir: Path, answers: Path, tmp_path: Path) -> None:
    from learner.train.objectives import Grpo, RolloutMatching, objective_for
    from rmsft.jobspec import load_job

    assert type(objective_for(grpo_job(tiny_model_dir, answers, tmp_path))) is Grpo
    assert type(objective_for(load_job(ROOT / "configs" / "local-tiny.yaml"))) is RolloutMatching
    with pytest.raises(ValueError, match="spec.trainer 'grpo'"):
        Grpo(load_job(ROOT / "configs" / "local-tiny.yaml"))


@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no-kl", "kl"])
def test_a_whole_grpo_step_runs_on_the_training_device(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer], kl_coef: float
) -> None:
    # As tests/learner/test_placement.py proves for rollout matching: rows built on the CPU, then the device step
    # (reference forward with the adapters disabled, policy forward, GRPO loss, backward, AdamW) with every
    # parameter on `meta`, flagging any op given a tensor off the device and counting host reads.
    from test_placement import DeviceFence

    from learner.train.build import build_loop

    kw = {"grpo": {"kl_coef": kl_coef}, "finetune": "lora", "lora": {"r": 8, "alpha": 16}}
    cpu = build_loop(grpo_job(tiny_model_dir, answers, tmp_path / "cpu", steps=1, **kw), [s.address for s in servers])
    seen = []
    real = cpu.device_step
    cpu.device_step = lambda *a, **k: seen.append(a) or real(*a, **k)
    try:
        cpu.run()
    finally:
        cpu.close()
    built, (n_tokens, n_seqs), _ = seen[0]
    rows = built.rows
    assert rows and n_tokens == PROMPTS * N * 4 and n_seqs == PROMPTS * N
    meta = build_loop(
        grpo_job(tiny_model_dir, answers, tmp_path / "meta", steps=1, **kw), ["127.0.0.1:1"], device="meta"
    )
    try:
        fence = DeviceFence("meta")
        with fence:
            sums = meta.device_step(built, (n_tokens, n_seqs), lr=1e-3)
        assert fence.violations == [], "\n".join(fence.violations[:20])
        # transformers' packed-mask check, once per forward (the reference forward is one more per row)
        assert fence.host_reads == len(rows) * (2 if kl_coef else 1)
        assert {k: v.device.type for k, v in sums.items()} == dict.fromkeys(sums, "meta")
        trained = [p for p in meta.model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None and p.grad.device.type == "meta" for p in trained)
    finally:
        meta.close()


def _one_step_totals(job, servers: list[InProcessServer]):
    """One step's trainer and the loss normalisers (completion tokens, completions) its device step got."""
    from learner.train.build import build_loop

    trainer = build_loop(job, [s.address for s in servers])
    seen = []
    real = trainer.device_step
    trainer.device_step = lambda *a, **k: seen.append(a) or real(*a, **k)
    try:
        trainer.run()
    finally:
        trainer.close()
    built, (n_tokens, n_seqs), _ = seen[0]
    trainer.built = built
    return trainer, int(n_tokens), int(n_seqs)


def test_dynamic_sampling_drop_leaves_flat_groups_out_of_the_loss(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer]
):
    # Records answer-<odd> get the sample index as reward (signal), the others 1 whatever they answer (flat).
    job = grpo_job(
        tiny_model_dir,
        answers,
        tmp_path,
        steps=1,
        grpo={"rewards": [{"name": "reward_plugins:odd_records_vary"}], "dynamic_sampling": "drop"},
    )
    trainer, n_tokens, n_seqs = _one_step_totals(job, servers)
    h = trainer.history[0]
    odd = sum(int(i.rsplit("-", 1)[1]) % 2 for i in h.record_ids)
    assert 0 < odd < PROMPTS  # the batch has both kinds (the data order is seeded)
    g = h.figures
    assert g.dropped_groups == PROMPTS - odd and g.zero_std_groups == pytest.approx((PROMPTS - odd) / PROMPTS)
    assert (n_seqs, n_tokens) == (odd * N, odd * N * 4)  # the normaliser counts the kept groups only
    assert h.figures.resampled_groups == 0 and h.figures.completions == PROMPTS * N


def test_dynamic_sampling_resample_is_bounded(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer]
):
    # The completion's length as reward: max_tokens 4 and no stop token in 4 random tokens -> every group is flat,
    # every round; 2 rounds resample all 4 groups twice, then all are dropped (one kept, fully masked: a row).
    job = grpo_job(
        tiny_model_dir,
        answers,
        tmp_path,
        steps=1,
        grpo={
            "rewards": [{"name": "reward_plugins:length_reward"}],
            "dynamic_sampling": "resample",
            "dynamic_sampling_rounds": 2,
        },
    )
    from learner.tracking import metrics as m

    before = m.RESAMPLED_GROUPS._value.get()
    trainer, n_tokens, n_seqs = _one_step_totals(job, servers)
    g = trainer.history[0].figures
    assert (g.resampled_groups, g.dropped_groups) == (2 * PROMPTS, PROMPTS)
    assert (n_tokens, n_seqs) == (0, 0) and trainer.history[0].loss == 0.0
    assert m.RESAMPLED_GROUPS._value.get() - before == 2 * PROMPTS


@pytest.mark.parametrize("rule", ["mask", "penalty"])
def test_overlong_answers_are_masked_or_penalised(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer], rule: str
):
    # Every answer is cut at max_tokens 4 (finish reason length).
    job = grpo_job(
        tiny_model_dir,
        answers,
        tmp_path,
        steps=1,
        grpo={"overlong": rule, "overlong_buffer": 2, "overlong_penalty": 0.5},
    )
    trainer, n_tokens, n_seqs = _one_step_totals(job, servers)
    h = trainer.history[0]
    assert all(r.finish_reason == "length" for r in h.rollouts)
    if rule == "mask":  # no token left in the loss; the answers still scored (the reward is the job's)
        assert (h.figures.overlong_masked, h.figures.overlong_penalised) == (PROMPTS * N, 0)
        assert (n_tokens, n_seqs) == (0, 0) and h.loss == 0.0
    else:  # -0.5 on every answer (4 >= 4 - 2 + 2): trained as usual, the reported reward stays the job's
        assert (h.figures.overlong_masked, h.figures.overlong_penalised) == (0, PROMPTS * N)
        assert (n_tokens, n_seqs) == (PROMPTS * N * 4, PROMPTS * N)
        scores = trainer.built.extra["scores"]
        assert trainer.built.extra["rewards"] == pytest.approx([r - 0.5 for r in scores.totals])
        assert h.figures.reward_mean == pytest.approx(sum(scores.totals) / len(scores.totals))


def test_inflight_syncs_with_rollouts_ahead_train_within_the_window(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer]
):
    # spec.training.rollout.inflight: the sync does not wait for the batch generating ahead and asks the servers to
    # keep generating; the HF backend cannot pause its requests, so these servers drain (the fallback), and every
    # answer is one span of the version it was fenced to, within max_staleness 1.
    job = grpo_job(
        tiny_model_dir,
        answers,
        tmp_path,
        steps=3,
        rollout={"max_staleness": 1, "inflight": True, "request_timeout_s": 30},
    )
    trainer, summary, _ = run(job, [s.address for s in servers])
    assert trainer.sync_client.keep_generating is True
    assert summary.steps == 3
    for h in trainer.history:
        assert all(
            len(r.version_spans) == 1 and r.version_spans[0] == (r.weights, 0, len(r.token_ids)) for r in h.rollouts
        )
        assert all(0 <= h.weight_version - r.weight_version <= 1 for r in h.rollouts)


def test_detection_completions_in_the_other_format_are_named_once(tmp_path: Path, tiny_model_dir: Path, caplog) -> None:
    """Issue 61, GRPO: a model that answers in CoordJSON, run with training.format coordexp and the detection
    reward, parses to no object; after three steps the run names the format its completions are in, once."""
    import logging

    from learner_fakes import FakeEngine, FakeServer, chat_renderer
    from transformers import AutoTokenizer

    from learner.core.codec import COORDJSON, DetObject
    from learner.core.vocab import VocabView
    from rmsft_dev.synthetic import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "det.jsonl", n=8, seed=0)
    vocab = VocabView.from_hf_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    answer = list(vocab.encode(COORDJSON.render([DetObject("cat", "bbox_2d", (10, 20, 300, 400))]))) + [vocab.eos_id]
    render = chat_renderer(str(tiny_model_dir))
    fakes = [FakeServer(FakeEngine(ordinal=i, render=render, answer=lambda _ids, _t, _s: answer)) for i in range(2)]
    try:
        job = grpo_job(tiny_model_dir, data, tmp_path / "ck", steps=4, grpo={"rewards": [{"name": "detection"}]})
        with caplog.at_level(logging.WARNING, logger="rmsft.learner"):
            run(job, [s.address for s in fakes])
    finally:
        for s in fakes:
            s.stop()
    said = [r.getMessage() for r in caplog.records if "training.format" in r.getMessage()]
    assert len(said) == 1 and "set spec.training.format: coordjson" in said[0]


def test_the_reward_panels_draw_a_grpo_run(
    tmp_path: Path, tiny_model_dir: Path, answers: Path, servers: list[InProcessServer]
) -> None:
    """The training dashboard's GRPO reward panels (promql.GRPO_PANELS: gauges labelled by stat and by reward, set by
    a GRPO step only, so the rollout-matching run of tests/test_dashboards_prometheus.py leaves them out) against a
    real Prometheus scraping this process's /metrics after a GRPO step: each must give a series with a number."""
    from prometheus_client import start_http_server
    from promql import GRPO_PANELS, Prometheus, dashboard, empty_panels, free_port

    run(grpo_job(tiny_model_dir, answers, tmp_path / "ckpt", steps=1), [s.address for s in servers])
    # The gauges hold the last step's values: this process's registry, served as a learner pod serves it.
    port = free_port()
    http, _ = start_http_server(port, addr="127.0.0.1")
    prom = Prometheus(tmp_path)
    try:
        prom.set_targets([(f"127.0.0.1:{port}", {"namespace": "grpo", "pod": "grpo-learner"})])
        start = time.time()
        # Two scrapes at least: the first one may be under way while the target file is read.
        prom.wait(
            lambda: (
                float(
                    (prom.api("query", query="count_over_time(up[1m])")["result"] or [{"value": [0, "0"]}])[0]["value"][
                        1
                    ]
                )
                >= 2
            ),
            30,
            "two scrapes of this process",
        )
        chosen, empty = empty_panels(
            prom, dashboard("training"), start - 5, time.time(), lambda p: (p.dashboard, p.title) in GRPO_PANELS
        )
        assert {(p.dashboard, p.title) for p in chosen} == GRPO_PANELS  # a renamed panel is no panel left out
        assert not empty, "GRPO panels that draw nothing after a GRPO step:\n" + "\n".join(empty)
    finally:
        prom.stop()
        http.shutdown()
        http.server_close()
