"""The training loop's fast tier: the real training loop (tiny model, real packing, losses, AdamW, FULL
weight streams) against in-process fake rollout servers, each test in seconds. The real-vLLM
end-to-end tests (test_e2e_local.py) stay for what only a real engine shows."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
from learner_fakes import FakeServer
from trainer_fixtures import make_job


def _run(job, addresses: list[str], **kw):
    from learner.train.build import build_loop

    trainer = build_loop(job, addresses, **kw)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    return trainer, summary


def test_rollout_buffer_reuses_each_e_step_for_m_steps(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    job = make_job(tiny_model_dir, data_path, tmp_path, steps=4, buffer={"enabled": True, "m_steps": 2})
    trainer, summary = _run(job, [s.address for s in servers])
    assert summary.steps == 4
    # rollouts at steps 1 and 3 only; weights synced before the first rollout and before step 3's
    assert [bool(h.rollouts) for h in trainer.history] == [True, False, True, False]
    assert [h.weight_version for h in trainer.history] == [1, 1, 2, 2]
    assert sorted({u.header.version for s in servers for u in s.engine.updates}) == [1, 2]
    generated = sum(len(c) for s in servers for c in s.engine.calls)
    assert generated == 2 * 2  # two E-steps x prompts_per_step, nothing generated for M-steps
    # every M-step of one E-step trained on the same record ids
    assert trainer.history[0].record_ids == trainer.history[1].record_ids


def test_a_run_resumed_inside_an_e_step_equals_the_uninterrupted_run(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    """Issue 41: a checkpoint between an E-step's M-steps (m_steps 2, a checkpoint every step) used to stop the
    resumed run with RolloutBufferError (the built rows were not in the checkpoint) and to skip the sync before the
    next E-step (the sync decision read the buffer's state, not the step). The checkpoint now keeps each rank's rows
    of the E-step in progress and the plan is a function of the step: the resumed run trains what the uninterrupted
    one did, and syncs before the next E-step."""
    from learner.train.build import build_loop

    addrs = [s.address for s in servers]
    buffer = {"enabled": True, "m_steps": 2}
    every = {"dir": str(tmp_path / "ck"), "every": 1, "keep": 2}
    straight, _ = _run(make_job(tiny_model_dir, data_path, tmp_path / "a", steps=6, buffer=buffer), addrs)
    first, _ = _run(
        make_job(tiny_model_dir, data_path, tmp_path / "ck", steps=3, buffer=buffer, checkpoint=every), addrs
    )
    resumed = build_loop(
        make_job(tiny_model_dir, data_path, tmp_path / "ck", steps=6, buffer=buffer, checkpoint=every), addrs
    )
    try:
        assert resumed.resume() and resumed.step == 3  # inside E-step 1 (steps 3 and 4, 1-based)
        resumed.run()
    finally:
        resumed.close()
    steps = resumed.history
    assert [h.step for h in steps] == [4, 5, 6]
    assert [h.record_ids for h in steps] == [h.record_ids for h in straight.history[3:]]
    assert [bool(h.rollouts) for h in steps] == [False, True, False]  # step 4 reuses E-step 1's rows, as straight
    assert [h.loss for h in steps] == pytest.approx([h.loss for h in straight.history[3:]], rel=1e-5)
    v = steps[0].weight_version
    assert v == first.version + 1  # the resume's sync before its first step
    assert [h.weight_version for h in steps] == [v, v + 1, v + 1]  # and the sync before E-step 2: not skipped
    assert all(max(u.header.version for u in s.engine.updates) == v + 1 for s in servers)  # what they serve


def test_resume_continues_where_the_checkpoint_left(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    addrs = [s.address for s in servers]
    straight, _ = _run(make_job(tiny_model_dir, data_path, tmp_path / "a", steps=3), addrs)
    first, _ = _run(make_job(tiny_model_dir, data_path, tmp_path / "b", steps=2), addrs)
    from learner.train.build import build_loop

    resumed = build_loop(make_job(tiny_model_dir, data_path, tmp_path / "b", steps=3), addrs)
    try:
        assert resumed.resume() and (resumed.step, resumed.version) == (2, first.version)
        resumed.run()
    finally:
        resumed.close()
    assert [h.step for h in resumed.history] == [3]
    assert resumed.history[0].record_ids == straight.history[2].record_ids
    assert resumed.history[0].loss == pytest.approx(straight.history[2].loss, rel=1e-5)


def test_a_stop_request_ends_the_run_after_its_step_with_a_checkpoint(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    """What `rmsft train` does on SIGTERM (an eviction, a drain, a preemption): the step in progress finishes, its
    checkpoint is written though none was due (checkpoint.every 0), the run stops; resumed, it trains on as if never
    stopped (issue 41)."""
    from learner.train.build import build_loop
    from learner.train.checkpoint_files import list_checkpoints
    from learner.train.loop import StopRequested

    addrs = [s.address for s in servers]
    straight, _ = _run(make_job(tiny_model_dir, data_path, tmp_path / "a", steps=3), addrs)
    ckpt = tmp_path / "b"
    stopped = build_loop(
        make_job(tiny_model_dir, data_path, ckpt, steps=3),
        addrs,
        on_step=lambda r: stopped.request_stop("SIGTERM") if r.step == 2 else None,
    )
    try:
        with pytest.raises(StopRequested, match=r"stopped \(SIGTERM\) after step 2: checkpoint .*step-2 written"):
            stopped.run()
    finally:
        stopped.close()
    assert [h.step for h in stopped.history] == [1, 2]
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-2"]
    resumed = build_loop(make_job(tiny_model_dir, data_path, ckpt, steps=3), addrs)
    try:
        assert resumed.resume() and resumed.step == 2
        resumed.run()
    finally:
        resumed.close()
    assert [h.step for h in resumed.history] == [3]
    assert resumed.history[0].loss == pytest.approx(straight.history[2].loss, rel=1e-5)


def test_a_checkpoint_is_saved_once_every_minutes_have_passed(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 60: training.checkpoint.every_minutes saves after the first step that ends that long after the last save
    (checkpoint.every 0 here); the clock restarts at the save. Unset, it is 30 with a checkpoint claim."""
    from learner.train import checkpointer as clock_module
    from learner.train.build import build_loop
    from learner.train.checkpoint_files import list_checkpoints

    clock = [1000.0]
    monkeypatch.setattr(clock_module.time, "monotonic", lambda: clock[0])

    def on_step(r) -> None:
        clock[0] += 70.0 if r.step == 2 else 1.0  # step 2 ends more than a minute after the start

    ckpt = tmp_path / "ckpt"
    job = make_job(
        tiny_model_dir,
        data_path,
        ckpt,
        steps=4,
        checkpoint={"dir": str(ckpt), "every": 0, "keep": 5, "every_minutes": 1},
    )
    trainer = build_loop(job, [s.address for s in servers], on_step=on_step)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-2", "step-4"]  # by time, then the end's
    assert job.spec.checkpoint_minutes == 1
    job.spec.training.checkpoint.every_minutes = None
    assert job.spec.checkpoint_minutes == 0  # no claim: an emptyDir keeps nothing for a later attempt
    job.spec.learner.checkpoint_claim = "pvc"
    assert job.spec.checkpoint_minutes == 30


def test_a_fresh_run_moves_an_earlier_runs_checkpoints_aside(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    """Issue 41: pruning keeps the highest steps in the folder, so a fresh run beside an earlier run's step-3 and
    step-4 deleted each checkpoint of its own right after writing it, and --resume then continued the other run.
    The earlier checkpoints now go to earlier-runs/ first, whole; the new run's own are kept and resumed from."""
    import torch

    from learner.train.build import build_loop
    from learner.train.checkpoint_files import EARLIER_RUNS, list_checkpoints

    addrs = [s.address for s in servers]
    ckpt = tmp_path / "ckpt"
    every = {"dir": str(ckpt), "every": 1, "keep": 2}
    earlier, _ = _run(make_job(tiny_model_dir, data_path, ckpt, steps=4, checkpoint=every), addrs)
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-3", "step-4"]
    fresh, _ = _run(make_job(tiny_model_dir, data_path, ckpt, steps=2, checkpoint=every), addrs)
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-1", "step-2"]  # its own, not pruned away
    aside = list((ckpt / EARLIER_RUNS).iterdir())
    assert len(aside) == 1 and aside[0].name.endswith(f"-before-run-{fresh.state.run_id}")
    assert sorted(p.name for p in aside[0].iterdir()) == ["step-3", "step-4"]
    assert torch.load(aside[0] / "step-4" / "state.pt", weights_only=False)["run_id"] == earlier.state.run_id
    resumed = build_loop(make_job(tiny_model_dir, data_path, ckpt, steps=3, checkpoint=every), addrs)
    try:
        assert resumed.resume() and resumed.step == 2 and resumed.state.resumed.weights.run_id == fresh.state.run_id
    finally:
        resumed.close()
    # A job with another seed is another run: its resume is refused before anything is loaded, unless asked for.
    from learner.train.checkpoint_owner import CheckpointLineageError

    other = build_loop(make_job(tiny_model_dir, data_path, ckpt, steps=3, checkpoint=every, seed=5), addrs)
    try:
        with pytest.raises(CheckpointLineageError, match=r"spec.training.seed 0 \(this job: 5\)"):
            other.resume()
        assert other.step == 0
    finally:
        other.close()
    anyway = build_loop(
        make_job(tiny_model_dir, data_path, ckpt, steps=3, seed=5, checkpoint={**every, "resume_any": True}), addrs
    )
    try:
        assert anyway.resume() and anyway.step == 2
    finally:
        anyway.close()


def test_a_server_dying_mid_run_fails_over(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    from learner.train.build import build_loop

    job = make_job(tiny_model_dir, data_path, tmp_path, steps=3)
    trainer = build_loop(job, [s.address for s in servers])

    def on_step(r) -> None:
        if r.step == 1:  # the engine dies after step 1's sync: its Generate calls fail from now on
            servers[1].engine.fail_generate = grpc.StatusCode.UNAVAILABLE

    trainer.on_step = on_step
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    assert summary.steps == 3 and summary.retries >= 1
    for h in trainer.history[1:]:
        assert {r.server for r in h.rollouts} == {servers[0].address}
        assert {r.weight_version for r in h.rollouts} == {h.weight_version}


def test_a_server_answering_with_another_version_is_fenced(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    servers[1].engine.reply_version = 99  # a server that claims weights the learner never sent
    trainer, summary = _run(make_job(tiny_model_dir, data_path, tmp_path, steps=2), [s.address for s in servers])
    assert summary.steps == 2
    for h in trainer.history:  # nothing from the wrong version was trained on
        assert h.rollouts and {r.weight_version for r in h.rollouts} == {h.weight_version}
        assert {r.server for r in h.rollouts} == {servers[0].address}


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_bf16_run_completes(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer], finetune: str
) -> None:
    import math

    import torch

    job = make_job(tiny_model_dir, data_path, tmp_path, steps=2, precision="bf16", finetune=finetune)
    trainer, summary = _run(job, [s.address for s in servers])
    assert summary.steps == 2 and all(math.isfinite(x) for x in summary.losses)
    trained = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
    assert trained == {torch.float32}  # what AdamW updates stays fp32
    if finetune == "lora":
        assert torch.bfloat16 in {p.dtype for p in trainer.model.parameters() if not p.requires_grad}


def test_warm_start_trains_on_ground_truth_without_generating(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    job = make_job(tiny_model_dir, data_path, tmp_path, steps=4, warm_start_steps=2)
    trainer, summary = _run(job, [s.address for s in servers])
    assert summary.steps == 4
    warm, fresh = trainer.history[:2], trainer.history[2:]
    assert all(r.finish_reason != "warm_start" and r.token_ids for h in fresh for r in h.rollouts)
    # Warm-start steps: empty answers (the targets are the whole ground truth), nothing generated.
    assert all(r.token_ids == [] and r.finish_reason == "warm_start" for h in warm for r in h.rollouts)
    assert all(h.figures.stats.false_negatives > 0 and h.figures.stats.matched == 0 for h in warm)
    generated = [r for s in servers for c in s.engine.calls for r in c]
    assert len(generated) == 2 * 2  # steps 3 and 4 only
    # No sync nobody reads: version 1 before the run, version 2 after the last warm-start step, then per step.
    assert [h.weight_version for h in trainer.history] == [1, 1, 2, 3]
    assert all(math.isfinite(h.loss) for h in trainer.history)


def test_learning_rate_schedules() -> None:
    from learner.train.config import learning_rate
    from rmsft.jobspec import TrainingConfig

    cfg = TrainingConfig(
        data={"path": "d.jsonl"}, lr=1.0, steps=10, warmup_steps=2, lr_schedule="cosine", lr_min_ratio=0.1
    )
    lrs = [learning_rate(cfg, s) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warmup, then the peak
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))  # decays monotonically
    assert abs(lrs[-1] - 0.1) < 1e-9  # to the floor at the last step
    constant = TrainingConfig(data={"path": "d.jsonl"}, lr=1.0, steps=10, warmup_steps=2)
    assert [learning_rate(constant, s) for s in range(10)] == [0.5] + [1.0] * 9


def test_training_says_once_how_many_boxes_it_clamps(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 64: a box reaching outside its image is clamped to the edges by the grid conversion; the run says so
    once, with the count, instead of training on other boxes than the file's without a word."""
    import json
    import logging

    records = [json.loads(line) for line in data_path.read_text().splitlines()]
    total = sum(len(r["objects"]) for r in records)
    for r in records[:2]:  # two records, one box each, past the right edge and above the top
        r["objects"][0]["bbox_2d"] = [-4, -4, r["width"] + 10, 20]
    data = tmp_path / "outside.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    with caplog.at_level(logging.WARNING, logger="rmsft.learner"):
        _run(make_job(tiny_model_dir, data, tmp_path / "ck", steps=2), [s.address for s in servers])
    said = [r.getMessage() for r in caplog.records if "reach outside" in r.getMessage()]
    assert said == [
        f"{data}: 2 of {total} objects (in 2 records) reach outside their image's width x height: "
        f"training clamps them to its edges (first: record 'synthetic-0' object 1 bbox_2d "
        f"[-4.0, -4.0, {records[0]['width'] + 10}.0, 20.0] in 512x512)"
    ]
