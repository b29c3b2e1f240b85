"""Weight versions that stay unique across learner restarts (issue 27): a version is (run id, number), the
run id new for every learner process, so no server holding another run's weights, or an earlier life's of
this one, is ever taken for current, whatever number it reports.

Real rollout servers without subprocesses: `RolloutServicer` + the HF engine behind gRPC on loopback
(tests/learner/hf_servers.py), the real `TrainingLoop` (tiny model) on the other side. A server is "held back"
by a TCP proxy in front of it that drops and refuses connections (tests/learner/net_faults.py): it keeps
running and keeps what it holds, unlike a restarted pod. Each test takes seconds (tiny model, 16 tokens).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hf_servers import InProcessServer
from net_faults import BlockingProxy
from rmsft_protos import rollout_pb2
from trainer_fixtures import make_job

from learner.train.build import build_loop
from learner.train.loop import TrainingLoop
from rmsft.weight_wire import (
    FRESH,
    FULL,
    SHARED_DIR_ENV,
    WeightVersion,
    iter_weight_chunks,
    set_version,
    version_of,
)
from rollout_engine import metrics as server_metrics


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rmsft_dev.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=16, seed=0)


@pytest.fixture
def servers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[InProcessServer]]:
    """Two servers taking both transports (grpc relayed, shm from `tmp_path / "shared"`)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    made = [InProcessServer(tiny_model_dir, tmp_path / f"stage-{i}", shared=shared) for i in range(2)]
    yield made
    for s in made:
        s.close()


def _job(tiny_model_dir: Path, data_path: Path, ckpt: Path, *, steps: int, every: int = 0):
    return make_job(
        tiny_model_dir, data_path, ckpt, steps=steps, checkpoint={"dir": str(ckpt), "every": every, "keep": 2}
    )


class _Killed(RuntimeError):
    """Stands in for SIGKILL: the loop stops where it is, no checkpoint written on the way out."""


class _Recorder:
    """What a learner saw and did, in order: servers' GetStatus answers, re-syncs done, completions accepted."""

    def __init__(self, trainer: TrainingLoop) -> None:
        self.events: list[tuple] = []
        pool, rollouts = trainer.pool, trainer.rollouts.client
        real_status = pool.status

        def status(server, *a, **kw) -> rollout_pb2.StatusReply:
            reply = real_status(server, *a, **kw)
            self.events.append(("status", server.address, version_of(reply), pool.current))
            return reply

        pool.status = status
        real_resync = rollouts.resync

        def resync(server) -> None:
            real_resync(server)
            self.events.append(("resynced", server.address, pool.current))

        rollouts.resync = resync
        real_materialize = rollouts._materialize

        def materialize(call) -> None:
            for _, server, reply in call.accepted:
                self.events.append(("accepted", server.address, {version_of(c) for c in reply.completions}))
            real_materialize(call)

        rollouts._materialize = materialize
        real_rpc_error = rollouts._on_rpc_error

        def on_rpc_error(call, server, chunk, e: grpc.RpcError, **kw) -> None:
            self.events.append(("refused", server.address, e.code(), e.details()))
            real_rpc_error(call, server, chunk, e, **kw)

        rollouts._on_rpc_error = on_rpc_error

    def of(self, kind: str, address: str | None = None, after: int = 0) -> list[tuple]:
        return [e for e in self.events[after:] if e[0] == kind and (address is None or e[1] == address)]


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_server_held_back_from_the_resumed_learners_first_sync_is_fenced_and_resynced(
    servers: list[InProcessServer],
    tiny_model_dir: Path,
    data_path: Path,
    tmp_path: Path,
    transport: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fault of issue 27: a learner checkpointing every 2 steps is killed after it synced v4 (past its
    checkpoint's v3). Its retry resumes from the checkpoint as a new run and syncs v4 of that run while one
    server is cut off; that server comes back holding the dead run's v4, the very number the live learner
    is at. It must be fenced, re-synced, and no completion of the dead run's weights may be trained on.
    grpc: the cut-off server is the relay's second hop; shm: the learner calls it directly."""
    a, b = servers
    proxy = BlockingProxy(b.address)
    addresses = [a.address, proxy.address]
    ckpt = tmp_path / "ckpt"
    if transport == "shm":
        monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path / "shared"))

    def job():
        j = _job(tiny_model_dir, data_path, ckpt, steps=6, every=2)
        j.spec.sync.transport = transport
        return j

    def killed_at_step_4(r) -> None:
        if r.step == 4:  # after the sync of v4 (following step 3), before step 4's checkpoint
            raise _Killed("learner killed")

    first = build_loop(job(), addresses, on_step=killed_at_step_4)
    try:
        assert first.sync_client.transport == transport
        with pytest.raises(_Killed):
            first.run()
        dead = first.state.run_id
        assert [h.weight_version for h in first.history] == [1, 2, 3, 4]
    finally:
        first.close()
    # Both servers hold the dead run's v4; its last checkpoint is step 2 at v3.
    assert [s.servicer.runner.weights for s in servers] == [WeightVersion(dead, 4)] * 2
    saved = torch.load(ckpt / "step-2" / "state.pt", weights_only=False)
    assert (saved["step"], saved["version"], saved["run_id"], saved["run_ids"]) == (2, 3, dead, [dead])
    assert not (ckpt / "step-4").exists()

    second = build_loop(job(), addresses)
    try:
        assert second.resume()
        live = second.state.run_id
        assert live != dead and (second.step, second.version) == (2, 3)
        pool, sync = second.pool, second.sync_client
        pool.reprobe_interval_s = 0.0  # a server that was down is probed again before every rollout
        seen = _Recorder(second)
        real_wait_ready, real_sync = pool.wait_ready, sync.sync

        def ready_then_cut_off(*a, **kw):
            replies = real_wait_ready(*a, **kw)
            proxy.block()  # b drops off the network just before the resumed learner's first sync
            return replies

        def sync_then_reconnect(version: int, *a, **kw):
            report = real_sync(version, *a, **kw)
            seen.events.append(("sync", version, sorted(report.acked), sorted(report.unreachable)))
            proxy.unblock()  # b is back, not restarted: it still holds what the dead learner sent
            return report

        pool.wait_ready, sync.sync = ready_then_cut_off, sync_then_reconnect
        summary = second.run()
    finally:
        second.close()
        proxy.close()
    assert summary.steps == 6 and summary.run_id == live and [h.step for h in second.history] == [3, 4, 5, 6]

    # The resumed learner's first sync (v4 of this run) reached a only: b was cut off.
    first_sync = seen.of("sync")[0]
    assert first_sync == ("sync", 4, [a.address], [proxy.address]), seen.events
    # b came back reporting the dead run's v4 while the learner was at v4 of its own run: same number.
    first_back = seen.of("status", proxy.address, after=seen.events.index(first_sync))[0]
    assert first_back[2:] == (WeightVersion(dead, 4), WeightVersion(live, 4)), seen.events
    # Fenced: nothing accepted from b before its re-sync to this run's version; work after it.
    resynced = seen.of("resynced", proxy.address)
    assert resynced and resynced[0][2].run_id == live
    at = seen.events.index(resynced[0])
    assert not [e for e in seen.events[:at] if e[0] == "accepted" and e[1] == proxy.address]
    assert [e for e in seen.events[at:] if e[0] == "accepted" and e[1] == proxy.address], "b never got work back"
    # Nothing the learner accepted or trained on came from another run's weights.
    for _, _, versions in seen.of("accepted"):
        assert {v.run_id for v in versions} == {live}
    for h in second.history:
        assert h.rollouts and {r.weights for r in h.rollouts} == {WeightVersion(live, h.weight_version)}
    assert b.servicer.runner.weights.run_id == live
    # The checkpoint records the lives that led to it; the run record says this one resumed from the dead one.
    final = torch.load(ckpt / "step-6" / "state.pt", weights_only=False)
    assert final["run_id"] == live and final["run_ids"] == [dead, live]
    record = json.loads((ckpt / "run.json").read_text())
    assert record["run_id"] == live
    assert record["resumed_from"] == {"step": 2, "weight_version": 3, "run_id": dead, "run_ids": [dead]}
    assert record["previous_runs"][-1]["run_id"] == dead


def test_two_learner_runs_against_one_pool_never_accept_each_others_rollouts(
    servers: list[InProcessServer], tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    """Two learners (two runs) against the same servers, each syncing in the middle of the other's step: at the
    same version number, each one's requests are refused by servers holding the other's weights (naming both
    runs), it re-syncs them, and trains only on completions of its own weights."""
    addresses = [s.address for s in servers]
    one = build_loop(_job(tiny_model_dir, data_path, tmp_path / "one", steps=1), addresses)
    two = build_loop(_job(tiny_model_dir, data_path, tmp_path / "two", steps=1), addresses)
    try:
        assert one.state.run_id != two.state.run_id
        seen = {t.state.run_id: _Recorder(t) for t in (one, two)}

        def interleave(trainer: TrainingLoop, other: TrainingLoop) -> None:
            """Before `trainer`'s rollouts, `other` syncs the servers to the version number `trainer` is at."""
            real_generate = trainer.rollouts.generate

            def generate(*a, **kw):
                assert other.state.version + 1 == trainer.state.version  # its next sync announces the same number
                other.sync_weights()
                assert [s.servicer.runner.weights for s in servers] == [other.state.weights] * 2
                assert trainer.state.weights.number == other.state.weights.number
                return real_generate(*a, **kw)

            trainer.rollouts.generate = generate

        interleave(one, two)
        interleave(two, one)
        one.run()
        two.run()
    finally:
        one.close()
        two.close()
    for me, other in ((one, two), (two, one)):
        events = seen[me.state.run_id]
        refusals = events.of("refused")
        assert refusals and all(code == grpc.StatusCode.FAILED_PRECONDITION for _, _, code, _ in refusals)
        for _, _, _, details in refusals:  # both runs named, same number: another run's weights
            assert f"run {me.state.run_id}" in details and f"run {other.state.run_id}" in details, details
            assert "another run's weights" in details
        assert {e[1] for e in events.of("resynced")} == {s.address for s in servers}
        (step,) = me.history
        mine = WeightVersion(me.state.run_id, step.weight_version)
        for _, _, versions in events.of("accepted"):
            assert versions == {mine}
        assert len(step.rollouts) == 2 and {r.weights for r in step.rollouts} == {mine}


def test_a_server_refuses_a_call_fenced_to_another_runs_version_naming_both(
    servers: list[InProcessServer], tiny_model_dir: Path
) -> None:
    """The server's half: (run id, number) applied together with the weights, reported in status, replies and
    completions, exported as a metric, and the fence compares both."""
    from transformers import AutoModelForCausalLM

    server = servers[0]
    with grpc.insecure_channel(server.address) as channel:
        from rmsft_protos import rollout_pb2_grpc

        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        status = stub.GetStatus(rollout_pb2.StatusRequest(), timeout=10)
        assert version_of(status) == FRESH  # no run, version 0: never current for any learner
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        mine = WeightVersion("3fa2c1d09e77", 22)
        reply = stub.UpdateWeights(
            iter_weight_chunks(model.state_dict().items(), number=22, run_id=mine.run_id, mode=FULL), timeout=60
        )
        assert version_of(reply) == mine
        assert version_of(stub.GetStatus(rollout_pb2.StatusRequest(), timeout=10)) == mine
        assert _run_info() == {mine.run_id: 1.0}

        def generate(expected: WeightVersion | None) -> rollout_pb2.GenerateResponse:
            req = rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(max_tokens=4))
            req.prompts.add(token_ids=[1, 2, 3], request_id="r0")
            if expected is not None:
                set_version(req, expected)
            return stub.Generate(req, timeout=60)

        out = generate(mine)
        assert version_of(out) == mine and {version_of(c) for c in out.completions} == {mine}
        for other in (WeightVersion("9b0e5d2c4a11", 22), WeightVersion("", 22), WeightVersion(mine.run_id, 21)):
            with pytest.raises(grpc.RpcError) as err:
                generate(other)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = err.value.details()
            assert details.startswith(
                f"expected weight version {other.describe()}, server has 22 of run {mine.run_id}"
            ), details
            assert "sync weights first" in details
        assert "another run's weights" in str(_details(generate, WeightVersion("9b0e5d2c4a11", 22)))
        assert version_of(generate(None)) == mine  # an unfenced call is served, labelled with the pair

        # A header whose run id cannot go into a log line or a label is refused; nothing changes.
        with pytest.raises(grpc.RpcError) as err:
            chunks = list(iter_weight_chunks(model.state_dict().items(), number=23, mode=FULL))
            chunks[0].header.run_id = 'bad id"'
            stub.UpdateWeights(iter(chunks), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "run id" in err.value.details()
        assert server.servicer.runner.weights == mine and _run_info() == {mine.run_id: 1.0}


def _details(generate, expected: WeightVersion) -> str:
    try:
        generate(expected)
    except grpc.RpcError as e:
        return e.details()
    raise AssertionError("not refused")


def _run_info() -> dict[str, float]:
    """rmsft_rollout_weight_run_info as this process exports it: run id -> value."""
    out = {}
    for family in server_metrics.WEIGHT_RUN.collect():
        for sample in family.samples:
            out[sample.labels["run_id"]] = sample.value
    return out


def test_a_run_id_is_new_for_every_learner_and_named_in_its_start_log(
    caplog, servers, tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    import logging

    from learner.tracking import metrics as learner_metrics

    caplog.set_level(logging.INFO, logger="rmsft.learner")
    t0 = time.monotonic()
    made = [
        build_loop(_job(tiny_model_dir, data_path, tmp_path / f"c{i}", steps=1), [servers[0].address]) for i in range(2)
    ]
    try:
        ids = [t.state.run_id for t in made]
        assert len(set(ids)) == 2 and all(re.fullmatch(r"[0-9a-f]{12}", i) for i in ids)
        assert [t.pool.run_id for t in made] == ids
        assert any(f"learner run {ids[1]}" in r.message for r in caplog.records)
        series = {s.labels["run_id"]: s.value for f in learner_metrics.RUN_INFO.collect() for s in f.samples}
        assert series == {ids[1]: 1.0}  # the newest learner of this process, the old label gone
    finally:
        for t in made:
            t.close()
    assert time.monotonic() - t0 < 120
