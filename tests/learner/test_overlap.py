"""Rollouts that overlap training (spec.training.rollout.max_staleness, learner/train/overlap.py).

The prefetcher alone against a fake `generate` callable (admission, the staleness window, drops, checkpoints, the
re-sync fence), then the real training loop against in-process fake rollout servers (tests/learner/learner_fakes.py,
deterministic: a completion is a function of its prompt and seed, so runs can be compared rollout for rollout):
staleness 0 is the synchronous loop, staleness 1 trains only within the bound, a server killed while the next
step's rollouts are in flight fails over with the same seeds, a learner restarted mid-run resumes exactly."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from learner_fakes import FakeServer
from trainer_fixtures import make_job

from learner.rollouts.client import Rollout
from learner.train.overlap import ResyncRefusedError, RolloutsAhead


# -- the prefetcher alone -------------------------------------------------------------------------
class _Gen:
    """A `generate(requests, sampling, weight_version)` that records its calls; each can be held back."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[tuple[str, ...], int]] = []
        self.delay_s = delay_s
        self.inflight = 0
        self.max_inflight = 0
        self.lock = threading.Lock()
        self.started = threading.Event()  # set once a call has begun

    def __call__(self, requests, sampling, version: int) -> list[Rollout]:
        with self.lock:
            self.calls.append((tuple(requests), version))
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        self.started.set()
        time.sleep(self.delay_s)
        with self.lock:
            self.inflight -= 1
        return [Rollout(r, [1], [2], "stop", version, "fake", weight_run_id="run") for r in requests]


def test_staleness_zero_generates_inline_and_never_ahead() -> None:
    gen = _Gen()
    ahead = RolloutsAhead(gen, 0)
    assert not ahead.submit(1, ["b"], None, 1)  # nothing is ever generated ahead
    taken = ahead.take(0, ["a"], None, 1)
    assert (taken.staleness, taken.version, [r.request_id for r in taken.rollouts]) == (0, 1, ["a"])
    assert gen.calls == [(("a",), 1)] and ahead.ahead() == []
    ahead.close()


def test_admission_bounds_the_batches_ahead_and_one_call_runs_at_a_time() -> None:
    gen = _Gen(delay_s=0.05)
    ahead = RolloutsAhead(gen, 2)
    assert ahead.submit(1, ["b"], None, 1) and ahead.submit(2, ["c"], None, 1)
    assert not ahead.submit(3, ["d"], None, 1)  # admission: 2 ahead at most
    assert not ahead.submit(1, ["b"], None, 1)  # already ahead
    assert ahead.ahead() == [1, 2]
    ahead.drain()
    assert gen.max_inflight == 1 and [v for _, v in gen.calls] == [1, 1]
    taken = ahead.take(1, ["b"], None, 2)
    assert (taken.staleness, taken.dropped, len(gen.calls)) == (1, 0, 2)  # the batch ahead, not a new call
    ahead.close()


def test_a_batch_beyond_the_window_is_dropped_and_regenerated_with_the_same_requests() -> None:
    gen = _Gen()
    ahead = RolloutsAhead(gen, 1)
    ahead.submit(1, ["b0", "b1"], None, 1)
    ahead.drain()
    taken = ahead.take(1, ["b0", "b1"], None, 3)  # two versions later: older than max_staleness 1
    assert (taken.staleness, taken.version, taken.dropped) == (0, 3, 2)
    assert gen.calls == [(("b0", "b1"), 1), (("b0", "b1"), 3)]  # same requests (same seeds), current version
    assert ahead.stats.dropped == 2 and ahead.stats.staleness == [0]
    ahead.close()


def test_batches_for_e_steps_already_passed_free_their_admission_slots() -> None:
    gen = _Gen()
    ahead = RolloutsAhead(gen, 1)
    ahead.submit(3, ["c"], None, 1)
    ahead.drain()
    taken = ahead.take(5, ["e"], None, 1)  # the loop is past E-step 3: its batch will never be taken
    assert (taken.dropped, ahead.ahead()) == (1, []) and ahead.submit(6, ["f"], None, 1)
    ahead.close()


def test_batches_ahead_survive_a_checkpoint_with_their_lag() -> None:
    gen = _Gen()
    ahead = RolloutsAhead(gen, 1)
    ahead.submit(4, ["x"], None, 7)
    ahead.drain()  # complete (a batch still generating is not waited for: see the mid-overlap test)
    saved = ahead.saved(8)  # the weights the checkpoint holds are (or will be) served as version 8
    assert [(s["key"], s["lag"]) for s in saved] == [(4, 1)]
    ahead.close()
    again = RolloutsAhead(_Gen(), 1)
    again.restore(saved, 12)  # the resumed run serves those weights as version 12
    taken = again.take(4, ["x"], None, 12)
    assert (taken.staleness, taken.version, taken.rollouts[0].weight_version) == (1, 11, 7)
    assert again._generate.calls == []  # nothing regenerated
    again.close()


def test_a_failed_call_ahead_fails_the_step_that_takes_it_and_is_left_out_of_checkpoints() -> None:
    def broken(requests, sampling, version):
        raise RuntimeError("all servers down")

    ahead = RolloutsAhead(broken, 1)
    ahead.submit(1, ["b"], None, 1)
    ahead.drain()
    assert ahead.saved(1) == []
    with pytest.raises(RuntimeError, match="all servers down"):
        ahead.take(1, ["b"], None, 1)
    ahead.close()


def test_resyncs_are_refused_while_the_weights_move() -> None:
    ahead = RolloutsAhead(_Gen(), 1)
    pushed: list[str] = []
    resync = ahead.fenced_resync(pushed.append)
    resync("s0")  # before any step: the model holds the synced weights
    ahead.take(0, ["a"], None, 1)  # the learner trains from here on
    with pytest.raises(ResyncRefusedError):
        resync("s1")
    ahead.synced()
    resync("s2")
    assert pushed == ["s0", "s2"]
    ahead.close()


class _Held(_Gen):
    """A `_Gen` whose calls for the requests in `hold` block until `release` is set (or `abort` is called)."""

    def __init__(self, hold: set[str]) -> None:
        super().__init__()
        self.hold = hold
        self.release = threading.Event()
        self.started = threading.Event()
        self.aborted = 0

    def __call__(self, requests, sampling, version: int) -> list[Rollout]:
        with self.lock:
            self.calls.append((tuple(requests), version))
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.hold & set(requests):
                self.started.set()
                if not self.release.wait(20):
                    raise RuntimeError("never released")
                if self.aborted:
                    raise RuntimeError("aborted")
            return [Rollout(r, [1], [2], "stop", version, "fake", weight_run_id="run") for r in requests]
        finally:
            with self.lock:
                self.inflight -= 1

    def abort(self) -> None:
        self.aborted += 1
        self.release.set()


def _release_later(gen: _Held, after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, gen.release.set)
    timer.start()
    return timer


def test_a_batch_abandoned_by_take_is_waited_for_so_no_call_runs_across_the_next_sync() -> None:
    gen = _Held({"c"})
    ahead = RolloutsAhead(gen, 2)
    try:
        ahead.submit(3, ["c"], None, 1)
        ahead.submit(4, ["d"], None, 1)  # queued behind 3: never started when 5 is taken
        assert gen.started.wait(5)
        timer = _release_later(gen, 0.3)
        taken = ahead.take(5, ["e"], None, 1)  # the loop is past E-steps 3 and 4: both abandoned
        # What take returns with is a pool with nothing running: the trainer may sync now.
        assert gen.inflight == 0 and not ahead.pending()
        assert gen.max_inflight == 1  # E-step 5 was not generated beside the abandoned call
        assert [r for r, _ in gen.calls] == [("c",), ("e",)]  # 4 was cancelled before it started
        assert taken.dropped == 1 and [r.request_id for r in taken.rollouts] == ["e"]
        timer.join()
    finally:
        gen.release.set()
        ahead.close()


def test_a_sync_waits_for_a_call_whose_batch_was_replaced_by_restore() -> None:
    gen = _Held({"x"})
    ahead = RolloutsAhead(gen, 1)
    try:
        ahead.submit(2, ["x"], None, 1)
        assert gen.started.wait(5)
        timer = _release_later(gen, 0.3)
        ahead.restore([], 5)  # a resume puts other batches in place of the running one
        assert gen.inflight == 0 and not ahead.pending() and ahead.ahead() == []
        timer.join()
    finally:
        gen.release.set()
        ahead.close()


def test_close_during_a_call_ends_it_before_returning() -> None:
    gen = _Held({"b"})
    ahead = RolloutsAhead(gen, 1, abort=gen.abort)
    ahead.submit(1, ["b"], None, 1)
    assert gen.started.wait(5)
    t0 = time.perf_counter()
    ahead.close()  # the trainer closes the client and the pool right after this
    assert gen.aborted == 1 and gen.inflight == 0
    assert time.perf_counter() - t0 < 5
    # Without an abort hook, close waits for the running call.
    slow = _Gen(delay_s=0.3)
    ahead = RolloutsAhead(slow, 1)
    ahead.submit(1, ["b"], None, 1)
    assert slow.started.wait(5)  # the call runs: close must wait for it, not drop it
    ahead.close()
    assert slow.inflight == 0 and len(slow.calls) == 1


def test_a_checkpoint_mid_overlap_keeps_the_overlap() -> None:
    gen = _Held({"y"})
    ahead = RolloutsAhead(gen, 2)
    try:
        ahead.submit(1, ["x"], None, 3)
        ahead.submit(2, ["y"], None, 3)
        assert gen.started.wait(5)  # 1 is complete, 2 generating
        t0 = time.perf_counter()
        saved = ahead.saved(4)  # a checkpoint while 2 generates: not waited for
        assert time.perf_counter() - t0 < 1 and ahead.pending()
        assert [(b["key"], b["lag"], [r.request_id for r in b["rollouts"]]) for b in saved] == [(1, 1, ["x"])]
        gen.release.set()
        taken = ahead.take(2, ["y"], None, 4)  # the running batch was kept and is trained on as usual
        assert (taken.staleness, [r.request_id for r in taken.rollouts], len(gen.calls)) == (1, ["y"], 2)
    finally:
        gen.release.set()
        ahead.close()


# -- the trainer against fake servers -------------------------------------------------------------
def _job(model: Path, data: Path, ckpt: Path, staleness: int, steps: int = 4, **kw):
    job = make_job(model, data, ckpt, steps=steps, **kw)
    job.spec.training.rollout.max_staleness = staleness
    return job


def _trainer(job, addresses: list[str]):
    from learner.train.build import build_loop

    return build_loop(job, addresses)


def _run(job, addresses: list[str], max_steps: int | None = None):
    trainer = _trainer(job, addresses)
    try:
        trainer.run(max_steps)
    finally:
        trainer.close()
    return trainer


def _rollouts(trainer) -> list[list[tuple[str, tuple[int, ...]]]]:
    return [[(r.request_id, tuple(r.token_ids)) for r in h.rollouts] for h in trainer.history]


def _events(servers: list[FakeServer]) -> list[str]:
    """Server 0's updates and Generate calls, in order (status probes left out; repeats collapsed)."""
    ev = [e.split(":")[0] for e in servers[0].engine.events if e != "status"]
    return [e for i, e in enumerate(ev) if i == 0 or ev[i - 1] != e]


def test_staleness_zero_is_the_synchronous_loop(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    addrs = [s.address for s in servers]
    sync = _run(_job(tiny_model_dir, data_path, tmp_path / "a", 0), addrs)
    # sync before the first rollout, then each step's rollouts from exactly the version synced before them
    assert [h.weight_version for h in sync.history] == [1, 2, 3, 4]
    for h in sync.history:
        assert {r.weight_version for r in h.rollouts} == {h.weight_version}
    # nothing is generated while weights are applied or ahead of the sync: update, generate, update, ...
    assert _events(servers) == ["update", "generate"] * 4
    assert sync.ahead.stats.staleness == [0, 0, 0, 0] and sync.ahead.stats.dropped == 0
    # Staleness 1 trains on the same rollouts (the fake engine's answers depend on prompt and seed only), so
    # the same losses, one version older after the first step.
    for s in servers:
        s.engine.events.clear()
    over = _run(_job(tiny_model_dir, data_path, tmp_path / "b", 1), addrs)
    assert _rollouts(over) == _rollouts(sync)
    assert [h.loss for h in over.history] == pytest.approx([h.loss for h in sync.history], rel=1e-6)
    assert over.ahead.stats.staleness == [0, 1, 1, 1]
    assert [{r.weight_version for r in h.rollouts} for h in over.history] == [{1}, {1}, {2}, {3}]


def test_staleness_one_overlaps_generation_with_training_within_the_bound(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    for s in servers:
        s.engine.delay_s = 0.3  # generation long enough to see it run during training
    trainer = _trainer(_job(tiny_model_dir, data_path, tmp_path, 1, steps=5), [s.address for s in servers])
    inflight_during_training = []

    def on_step(r) -> None:  # after the optimizer step, before the sync: the next batch is generating
        inflight_during_training.append(sum(s.engine.inflight for s in servers))

    trainer.on_step = on_step
    try:
        trainer.run()
    finally:
        trainer.close()
    for h in trainer.history:
        versions = {r.weight_version for r in h.rollouts}
        assert all(0 <= h.weight_version - v <= 1 for v in versions), (h.step, h.weight_version, versions)
    assert trainer.ahead.stats.staleness == [0, 1, 1, 1, 1]
    assert any(inflight_during_training[:-1])  # the pool generated while the learner trained


def test_an_extra_sync_makes_the_batch_ahead_too_stale_it_is_dropped_and_regenerated(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    addrs = [s.address for s in servers]
    reference = _run(_job(tiny_model_dir, data_path, tmp_path / "ref", 1), addrs)
    trainer = _trainer(_job(tiny_model_dir, data_path, tmp_path / "run", 1), addrs)

    def on_step(r) -> None:
        if r.step == 2:  # e.g. benchmarks/local_run.py's evaluation: a sync between the loop's own
            trainer.sync_weights()

    trainer.on_step = on_step
    try:
        trainer.run()
    finally:
        trainer.close()
    # step 3's batch (version 2) meets the learner at version 4: dropped, regenerated at 4 with the same seeds
    assert trainer.ahead.stats.staleness == [0, 1, 0, 1] and trainer.ahead.stats.dropped == 2
    assert [{r.weight_version for r in h.rollouts} for h in trainer.history] == [{1}, {1}, {4}, {4}]
    assert _rollouts(trainer) == _rollouts(reference)


def test_a_server_killed_while_the_next_rollouts_are_in_flight_fails_over_with_the_same_seeds(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    addrs = [s.address for s in servers]
    reference = _run(_job(tiny_model_dir, data_path, tmp_path / "ref", 1), addrs)
    servers[1].engine.delay_s = 3.0  # server 1's share of step 2's rollouts is still generating after step 1
    trainer = _trainer(_job(tiny_model_dir, data_path, tmp_path / "run", 1), addrs)
    killed: list[int] = []

    def on_step(r) -> None:
        if r.step == 1:
            killed.append(servers[1].engine.inflight)
            servers[1].stop()  # its in-flight Generate fails; the chunk goes to server 0, unchanged

    trainer.on_step = on_step
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    assert killed and killed[0] >= 1  # it died with next-step rollouts in flight
    assert summary.steps == 4 and summary.retries >= 1
    assert _rollouts(trainer) == _rollouts(reference)  # same seeds, same order, nothing lost
    for h in trainer.history[2:]:
        assert {r.server for r in h.rollouts} == {servers[0].address}
    assert trainer.ahead.stats.dropped == 0


def test_a_server_needing_a_resync_while_the_learner_trains_is_left_to_the_next_sync(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    """Between `take` and the sync the learner's weights are no version: a server that turns stale then (here:
    it suddenly holds weights of another run) is not re-synced with them; its chunks go to the other server and
    the next sync brings it back."""
    from rmsft.weight_wire import WeightVersion

    addrs = [s.address for s in servers]
    reference = _run(_job(tiny_model_dir, data_path, tmp_path / "ref", 2, steps=3), addrs)
    for s in servers:
        s.engine.delay_s = 1.5  # the batches ahead are still generating when step 1 has trained
    trainer = _trainer(_job(tiny_model_dir, data_path, tmp_path / "run", 2, steps=3), addrs)
    refused: list[str] = []
    resync = trainer.rollouts.client.resync

    def recording(server) -> None:
        try:
            resync(server)
        except Exception as exc:
            refused.append(type(exc).__name__)
            raise

    trainer.rollouts.client.resync = recording

    def on_step(r) -> None:
        if r.step == 1:
            servers[1].engine.hold(WeightVersion("otherrun0001", 99))

    trainer.on_step = on_step
    try:
        trainer.run()
    finally:
        trainer.close()
    assert "ResyncRefusedError" in refused
    assert _rollouts(trainer) == _rollouts(reference)  # same seeds, nothing lost
    for h in trainer.history:
        assert {r.weight_run_id for r in h.rollouts} == {trainer.state.run_id}
        assert all(0 <= h.weight_version - r.weight_version <= 2 for r in h.rollouts)
    assert servers[1].engine.weights == trainer.state.weights  # the next sync brought it back


def test_a_learner_restarted_mid_run_resumes_exactly(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    addrs = [s.address for s in servers]
    straight = _run(_job(tiny_model_dir, data_path, tmp_path / "a", 1), addrs)
    first = _run(_job(tiny_model_dir, data_path, tmp_path / "b", 1), addrs, max_steps=2)  # checkpoint at step 2
    calls_before = sum(len(s.engine.calls) for s in servers)
    resumed = _trainer(_job(tiny_model_dir, data_path, tmp_path / "b", 1), addrs)
    try:
        assert resumed.resume() and resumed.step == 2
        resumed.run()
    finally:
        resumed.close()
    assert [h.step for h in resumed.history] == [3, 4]
    # Step 3 trains on the batch the first life generated ahead (saved in its checkpoint), not a new one.
    assert {r.weight_run_id for r in resumed.history[0].rollouts} == {first.state.run_id}
    assert resumed.ahead.stats.staleness == straight.ahead.stats.staleness[2:] == [1, 1]
    assert _rollouts(resumed) == _rollouts(straight)[2:]
    assert [h.loss for h in resumed.history] == pytest.approx([h.loss for h in straight.history[2:]], rel=1e-5)
    # generate_batch_size 1 and 2 prompts: a batch is one call per server; only step 4's batch was generated
    assert sum(len(s.engine.calls) for s in servers) - calls_before == len(servers)


def test_a_learner_crashing_mid_run_resumes_from_its_periodic_checkpoint_exactly(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    addrs = [s.address for s in servers]
    straight = _run(_job(tiny_model_dir, data_path, tmp_path / "a", 1, steps=5), addrs)
    ck = {"dir": str(tmp_path / "b"), "every": 2, "keep": 2}
    crashing = _trainer(_job(tiny_model_dir, data_path, tmp_path / "b", 1, steps=5, checkpoint=ck), addrs)

    def crash(r) -> None:
        if r.step == 3:  # step 4's rollouts are generating: lost with the process, not in any checkpoint
            raise KeyboardInterrupt("learner killed")

    crashing.on_step = crash
    with pytest.raises(KeyboardInterrupt):
        try:
            crashing.run()
        finally:
            crashing.close()
    resumed = _trainer(_job(tiny_model_dir, data_path, tmp_path / "b", 1, steps=5, checkpoint=ck), addrs)
    try:
        assert resumed.resume() and resumed.step == 2  # step-2's checkpoint holds step 3's batch ahead
        resumed.run()
    finally:
        resumed.close()
    assert resumed.ahead.stats.staleness == straight.ahead.stats.staleness[2:] == [1, 1, 1]
    assert _rollouts(resumed) == _rollouts(straight)[2:]
    assert [h.loss for h in resumed.history] == pytest.approx([h.loss for h in straight.history[2:]], rel=1e-5)


def test_grpo_with_staleness_one_trains_within_the_bound(
    tmp_path: Path, tiny_model_dir: Path, servers: list[FakeServer]
) -> None:
    import copy

    import yaml
    from trainer_fixtures import ROOT

    from learner.train.build import build_loop
    from rmsft.jobspec import parse_job
    from rmsft_dev.synthetic import write_answer_dataset

    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-grpo.yaml").read_text()))
    doc["metadata"].pop("annotations", None)
    doc["spec"]["model"]["path"] = str(tiny_model_dir)
    t = doc["spec"]["training"]
    t.update(steps=3, prompts_per_step=2)
    t["data"]["path"] = str(write_answer_dataset(tmp_path / "answers.jsonl", n=8, seed=0))
    t["checkpoint"] = {"dir": str(tmp_path / "ck"), "every": 0, "keep": 2}
    t["export"] = {"enabled": False}
    t["rollout"].update(request_timeout_s=30, max_staleness=1)
    t["grpo"].update({"group_size": 2, "max_tokens": 4})
    trainer = build_loop(parse_job(doc), [s.address for s in servers])
    try:
        trainer.run()
    finally:
        trainer.close()
    assert trainer.ahead.stats.staleness == [0, 1, 1]
    for h in trainer.history:
        assert h.rollouts and {h.weight_version - r.weight_version for r in h.rollouts} <= {0, 1}


def test_a_failed_sync_leaves_the_servers_weights_where_they_were(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, servers: list[FakeServer]
) -> None:
    """The sync bookkeeping advances only once the servers confirmed: after a failed sync the trainer still knows
    they hold the previous step's weights, so a held-out evaluation syncs first and a checkpoint's batches ahead
    keep the right lag."""
    trainer = _trainer(_job(tiny_model_dir, data_path, tmp_path, 1, steps=4), [s.address for s in servers])
    try:
        trainer.run(max_steps=1)  # synced once before the step; the step moved the weights past that version
        version = trainer.state.version
        assert trainer.feed.served_version() == version + 1  # the bookkeeping under test

        def broken(v: int) -> None:
            raise RuntimeError("weight sync failed on every server")

        real, trainer.rollouts.sync = trainer.rollouts.sync, broken
        with pytest.raises(RuntimeError, match="weight sync failed"):
            trainer.sync_weights()
        assert trainer.state.version == version
        assert trainer.feed.served_version() == version + 1  # still not served
        trainer.rollouts.sync = real
        trainer.sync_weights()  # a retry goes through and only then counts
        assert (trainer.state.version, trainer.feed.served_version()) == (version + 1, version + 1)
    finally:
        trainer.close()
