"""The learner follows the live server list (`rmsft train --servers-file`, the operator's ConfigMap
key `servers` mounted at /etc/rmsft/servers): servers that left get no work and are not waited for;
new ones are synced to the learner's current weights before they get any. Real gRPC servers on
loopback with fake engines (tests/learner/learner_fakes.py), no vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trainer_fixtures
from learner_fakes import FAKE_RUN, FakeEngine, FakeServer, chat_renderer, fake_tokens

from learner.rollouts.client import RolloutClient, RolloutRequest
from learner.rollouts.pool import ServerPool, ServersFile, ServersFileError, parse_server_list

ROOT = Path(__file__).resolve().parents[2]


def write_servers(path: Path, addresses: list[str]) -> None:
    """Replace the file in one rename, as the kubelet swaps a mounted ConfigMap."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(addresses))
    os.replace(tmp, path)


@pytest.fixture
def fakes(tiny_model_dir: Path):
    """Factory: fakes(n, version) -> FakeServers at that weight version (rendering chat prompts as servers of
    the tiny model do); all stopped afterwards."""
    made: list[FakeServer] = []
    render = chat_renderer(str(tiny_model_dir))

    def make(n: int, version: int = 0) -> list[FakeServer]:
        new = [FakeServer(FakeEngine(ordinal=len(made) + i, version=version, render=render)) for i in range(n)]
        made.extend(new)
        return new

    yield make
    for s in made:
        s.stop()


def requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(token_ids=[i % 5 + 1, i, 2], seed=10 + i, request_id=f"r{i}") for i in range(n)]


def check(out, reqs, version: int) -> None:
    assert [r.request_id for r in out] == [q.request_id for q in reqs]
    assert all(r.token_ids == fake_tokens(list(q.token_ids), q.seed) for r, q in zip(out, reqs, strict=True))
    assert {r.weight_version for r in out} == {version}


# -- the file ----------------------------------------------------------------------------------------
def test_the_file_is_read_in_order_and_bad_files_are_named(tmp_path: Path) -> None:
    f = tmp_path / "servers"
    f.write_text("b-1.svc:50051\n\n# comment\na-0.svc:50051  # trailing\n[::1]:7000\n")
    assert ServersFile(f).read() == ["b-1.svc:50051", "a-0.svc:50051", "[::1]:7000"]
    assert parse_server_list("h:1,h:2", "flag") == ["h:1", "h:2"]
    with pytest.raises(ServersFileError, match=f"{tmp_path / 'absent'} does not exist"):
        ServersFile(tmp_path / "absent").read()
    (tmp_path / "empty").write_text("\n# nothing\n")
    with pytest.raises(ServersFileError, match=f"{tmp_path / 'empty'} is empty"):
        ServersFile(tmp_path / "empty").read()
    (tmp_path / "bad").write_text("h:1\nno-port\n")
    with pytest.raises(ServersFileError, match=r"bad:2: 'no-port' is not host:port"):
        ServersFile(tmp_path / "bad").read()
    (tmp_path / "dupe").write_text("h:1\nh:1\n")
    with pytest.raises(ServersFileError, match=r"dupe: .*repeated: \['h:1'\]"):
        ServersFile(tmp_path / "dupe").read()


def test_poll_reports_real_changes_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "servers"
    write_servers(f, ["a:1", "b:1"])
    sf = ServersFile(f)
    assert sf.read() == ["a:1", "b:1"]
    assert sf.poll() is None
    write_servers(f, ["a:1", "b:1"])  # rewritten, same content: not a change
    assert sf.poll() is None
    write_servers(f, ["a:1"])
    assert sf.poll() == ["a:1"]
    assert sf.poll() is None
    write_servers(f, [])  # scaled to zero
    assert sf.poll() == []
    f.unlink()  # gone for a moment: keep what we have, say so once
    assert sf.poll() is None and sf.poll() is None
    assert sum("keeping the current rollout servers" in r.message for r in caplog.records) == 1


# -- the pool --------------------------------------------------------------------------------------
def test_pool_follows_membership_keeping_known_servers(tmp_path: Path, fakes) -> None:
    s0, s1, s2 = fakes(3, version=4)
    f = tmp_path / "servers"
    write_servers(f, [s0.address, s1.address])
    with ServerPool(ServersFile(f), reprobe_interval_s=0.0, run_id=FAKE_RUN) as pool:
        pool.set_current_version(4)
        pool.refresh()
        first = pool.servers[1]
        assert not pool.follow()  # unchanged: nothing to do
        write_servers(f, [s1.address, s2.address])
        assert pool.follow()
        assert [s.address for s in pool.servers] == [s1.address, s2.address]  # file order = split order
        assert pool.servers[0] is first and first.index == 0 and first.state.version == 4  # state kept
        assert pool.servers[1].state.version is None  # new: unknown until seen, so fenced
        assert not pool.is_current(pool.servers[1])


def test_scaled_down_pool_finishes_on_the_remaining_server(tmp_path: Path, fakes) -> None:
    s0, s1 = fakes(2, version=1)
    f = tmp_path / "servers"
    write_servers(f, [s0.address, s1.address])
    with ServerPool(ServersFile(f), reprobe_interval_s=0.0, run_id=FAKE_RUN) as pool:
        pool.set_current_version(1)
        client = RolloutClient(pool, generate_batch_size=2)
        reqs = requests(8)
        check(client.generate(reqs), reqs, 1)
        assert s1.engine.calls  # both served
        s1.stop()  # the pod is gone...
        write_servers(f, [s0.address])  # ...and the operator's list says so
        calls_before = len(s0.engine.calls)
        t0 = time.monotonic()
        out = client.generate(reqs)
        assert time.monotonic() - t0 < 5
        check(out, reqs, 1)
        assert {r.server for r in out} == {s0.address}
        assert len(s0.engine.calls) - calls_before == 4  # the whole batch, in chunks of 2, on the one left
        client.close()


def test_wait_ready_does_not_wait_for_a_server_that_left(tmp_path: Path, fakes) -> None:
    (s0,) = fakes(1)
    gone = FakeServer(FakeEngine(ordinal=9))
    gone.stop()
    f = tmp_path / "servers"
    write_servers(f, [s0.address, gone.address])
    with ServerPool(ServersFile(f), reprobe_interval_s=0.0, run_id=FAKE_RUN) as pool:
        threading.Timer(0.5, write_servers, (f, [s0.address])).start()
        t0 = time.monotonic()
        replies = pool.wait_ready(timeout_s=30, poll_s=0.1)
        assert time.monotonic() - t0 < 10 and len(replies) == 1
        assert [s.address for s in pool.servers] == [s0.address]


def test_added_server_is_resynced_before_it_gets_work(tmp_path: Path, fakes) -> None:
    s0, s1 = fakes(2, version=3)
    (new,) = fakes(1, version=0)  # a new pod on the checkpoint's weights
    f = tmp_path / "servers"
    write_servers(f, [s0.address, s1.address])
    resynced = []

    def resync(server) -> None:  # stands in for WeightSyncClient.resync_server
        resynced.append(server.address)
        engine = {s.address: s.engine for s in (s0, s1, new)}[server.address]
        engine.hold(pool.current)
        with engine.lock:
            engine.events.append("update:3")
        pool.mark_up(server, weights=pool.current)

    with ServerPool(ServersFile(f), reprobe_interval_s=0.0, run_id=FAKE_RUN) as pool:
        pool.set_current_version(3)
        client = RolloutClient(pool, resync=resync)
        write_servers(f, [s0.address, s1.address, new.address])
        reqs = requests(9)
        out = client.generate(reqs)
        check(out, reqs, 3)
        assert resynced == [new.address]
        assert new.engine.events.index("update:3") < new.engine.events.index("generate")
        assert [r.server for r in out] == [s0.address] * 3 + [s1.address] * 3 + [new.address] * 3
        client.close()


@pytest.mark.timeout(120)
def test_sync_reaches_servers_added_beyond_the_pools_first_size(tmp_path: Path, fakes, tiny_model_dir) -> None:
    """Every stream of a FULL sync must run at once (one encoder feeds them all): the sync client's
    threads grow with the pool, or a sync to the added servers would wait forever."""
    from transformers import AutoModelForCausalLM

    from learner.sync.client import WeightSyncClient

    s0, s1, s2 = fakes(3)
    f = tmp_path / "servers"
    write_servers(f, [s0.address])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with ServerPool(ServersFile(f), reprobe_interval_s=0.0, run_id=FAKE_RUN) as pool:
        sync = WeightSyncClient(pool, model, frame_bytes=64 << 10, timeout_s=60)
        sync.sync(1)
        write_servers(f, [s0.address, s1.address, s2.address])
        report = sync.sync(2)
        assert sorted(report.acked) == sorted(s.address for s in (s0, s1, s2))
        assert [u.header.version for u in s2.engine.updates] == [2]


# -- the trainer -----------------------------------------------------------------------------------
def make_job(model_dir: Path, data: Path, ckpt: Path, steps: int):
    return trainer_fixtures.make_job(model_dir, data, ckpt, steps=steps)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rmsft_dev.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=16, seed=0)


@pytest.mark.timeout(300)
def test_trainer_follows_the_pool_scaled_down_then_up(tmp_path: Path, fakes, tiny_model_dir, data_path) -> None:
    from learner.train.build import build_loop

    s0, s1 = fakes(2)
    f = tmp_path / "servers"
    write_servers(f, [s0.address, s1.address])
    added: list[FakeServer] = []
    s1_calls = []

    def on_step(r) -> None:
        if r.step == 1:  # scale 2 -> 1: the pod goes, the list follows
            s1.stop()
            s1_calls.append(len(s1.engine.calls))
            write_servers(f, [s0.address])
        elif r.step == 2:  # scale 1 -> 2: a new pod, a new address
            added.extend(fakes(1))
            write_servers(f, [s0.address, added[0].address])

    trainer = build_loop(make_job(tiny_model_dir, data_path, tmp_path / "ckpt", steps=4), ServersFile(f))
    trainer.on_step = on_step
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    assert summary.steps == 4 and summary.retries == 0  # nothing was sent to the server that left
    for h in trainer.history:
        assert {r.weight_version for r in h.rollouts} == {h.weight_version}
    assert [r.server for r in trainer.history[1].rollouts] == [s0.address] * 2
    assert [r.server for r in trainer.history[3].rollouts] == [s0.address, added[0].address]  # file order
    assert len(s1.engine.calls) == s1_calls[0]
    events = added[0].engine.events
    # Synced with the pool before the step's rollouts, to the version the step used.
    assert [u.header.version for u in added[0].engine.updates] == [3, 4]
    assert events.index("update:3") < events.index("generate")
    assert trainer.history[2].weight_version == 3


@pytest.mark.timeout(300)
def test_trainer_does_not_wait_for_a_server_removed_before_the_run(tmp_path, fakes, tiny_model_dir, data_path):
    from learner.train.build import build_loop

    s0, s1 = fakes(2)
    f = tmp_path / "servers"
    write_servers(f, [s0.address, s1.address])
    trainer = build_loop(make_job(tiny_model_dir, data_path, tmp_path / "ckpt", steps=2), ServersFile(f))
    try:
        s1.stop()  # scaled down before the learner got going; the kubelet updates the file later
        threading.Timer(1.0, write_servers, (f, [s0.address])).start()
        t0 = time.monotonic()
        summary = trainer.run()
        assert time.monotonic() - t0 < 25  # not request_timeout_s (30 s) of waiting for the gone server
    finally:
        trainer.close()
    assert summary.steps == 2
    assert {r.server for h in trainer.history for r in h.rollouts} == {s0.address}


# -- rmsft train -------------------------------------------------------------------------------------
def _train(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RMSFT_ROLLOUT_SERVERS")}
    return subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**full_env, **(env or {})},
    )


def test_train_needs_exactly_one_server_source_and_names_a_bad_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text((ROOT / "configs" / "local-tiny.yaml").read_text())
    for args, env in (
        ([], {}),
        (["--servers", "h:1", "--servers-file", str(tmp_path / "s")], {}),
        (["--servers", "h:1"], {"RMSFT_ROLLOUT_SERVERS_FILE": str(tmp_path / "s")}),
    ):
        res = _train("--config", str(job), *args, env=env)
        assert res.returncode == 2, res.stderr
        assert "give exactly one of --servers" in " ".join(res.stderr.split())
    (tmp_path / "empty").write_text("")
    for name, expected in (("absent", "does not exist"), ("empty", "is empty")):
        res = _train("--config", str(job), env={"RMSFT_ROLLOUT_SERVERS_FILE": str(tmp_path / name)})
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert f"rollout server list {tmp_path / name} {expected}" in " ".join(res.stderr.split())
