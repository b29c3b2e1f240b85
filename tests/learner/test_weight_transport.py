"""Both weight-sync transports end to end against real servers: `RolloutServicer` + the HF engine
behind real gRPC servers on loopback (as `rmsft serve --backend hf` registers them), the learner's
`WeightSyncClient` on the other side.

- grpc: the learner sends one stream, to the first server; each server relays it to the next.
- shm: the learner writes one file in a shared dir; every server reads it.

Faults on both: a server killed mid-sync (the others apply; it is fenced and re-synced once back),
a full staging filesystem (RESOURCE_EXHAUSTED, nothing applied); on shm also a truncated or altered
file (refused, old weights intact) and a learner killed mid-write (no file left behind).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
import torch
from hf_servers import InProcessServer, bump, fresh_model
from rmsft_protos import rollout_pb2

import learner.sync.client as sync_client_module
from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient, WeightSyncError
from rmsft.weight_wire import (
    FRESH,
    FULL,
    SharedUpdate,
    TensorSpec,
    WeightVersion,
    dtype_name,
    update_weights_raw,
    version_of,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pool_of(tiny_model_dir: Path, tmp_path: Path):
    made: list[InProcessServer] = []
    shared = tmp_path / "shared"
    shared.mkdir()

    def start(n: int) -> list[InProcessServer]:
        for _ in range(n):
            made.append(InProcessServer(tiny_model_dir, tmp_path / f"stage-{len(made)}", shared=shared))
        return made[-n:]

    start.shared = shared
    start.restart = lambda old: (
        made.append(InProcessServer(tiny_model_dir, old.staging, shared=shared, port=old.port)) or made[-1]
    )
    yield start
    for s in made:
        s.close()


@pytest.fixture
def model(tiny_model_dir: Path):
    return fresh_model(tiny_model_dir)


PROBE = "model.layers.0.mlp.up_proj.weight"


def _bump(model, value: float) -> torch.Tensor:
    """Give the model new weights (every parameter moved) and return the probe tensor's new value."""
    return bump(model, value)[PROBE]


def _client(pool: ServerPool, model, transport: str, shared: Path, **kw) -> WeightSyncClient:
    return WeightSyncClient(
        pool,
        model,
        dtype="float32",
        transport=transport,
        shared_dir=str(shared) if transport == "shm" else "",
        timeout_s=60,
        **kw,
    )


def _shared_files(shared: Path) -> list[str]:
    return sorted(p.name for p in shared.iterdir())


def _count_calls(monkeypatch) -> list[str]:
    """The UpdateWeights calls the learner itself makes (relayed ones are the servers')."""
    calls: list[str] = []
    real = sync_client_module.update_weights_raw

    def counting(channel):
        calls.append(channel)
        return real(channel)

    monkeypatch.setattr(sync_client_module, "update_weights_raw", counting)
    return calls


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_every_server_applies_an_update_the_learner_sends_once(pool_of, model, transport, monkeypatch) -> None:
    servers = pool_of(3)
    calls = _count_calls(monkeypatch)
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model, transport, pool_of.shared)
        for version in (1, 2):
            want = _bump(model, 0.01)
            report = client.sync(version)
            assert sorted(report.acked) == sorted(s.address for s in servers), report
            assert all(pool.status(s).weight_version == version for s in pool.servers)
            for s in servers:
                assert torch.equal(s.param(PROBE), want)
    # grpc: one stream per sync, to the head, which relays; shm: one small call per server, one file
    assert len(calls) == (2 if transport == "grpc" else 6)
    assert _shared_files(pool_of.shared) == []  # removed once every server answered
    for s in servers:  # no server keeps tensor bytes of its own in staging with shm
        held = sum(p.stat().st_size for p in s.staging.iterdir())
        if transport == "shm":
            assert held < 64 << 10, held
        else:  # the rollback copy: the last update
            assert held >= report.tensor_bytes


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_dead_server_is_fenced_the_others_apply_and_it_is_resynced_when_back(pool_of, model, transport) -> None:
    servers = pool_of(3)
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model, transport, pool_of.shared)
        client.sync(1)
        servers[1].close()  # the middle one: with grpc the head must relay around it
        want = _bump(model, 0.02)
        report = client.sync(2)
        alive = [servers[0].address, servers[2].address]
        assert sorted(report.acked) == sorted(alive)
        assert list(report.unreachable) == [servers[1].address]
        assert not pool.servers[1].state.up  # fenced: no rollout goes to it
        for s in (servers[0], servers[2]):
            assert torch.equal(s.param(PROBE), want)
        back = pool_of.restart(servers[1])  # a restarted pod: same address, checkpoint weights
        assert pool.status(pool.servers[1], fresh_channel=True).weight_version == 0  # the re-probe
        client.resync_server(pool.servers[1])
        assert pool.status(pool.servers[1]).weight_version == 2
        assert torch.equal(back.param(PROBE), want)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_server_killed_mid_sync_does_not_stop_the_others(pool_of, model, transport, monkeypatch) -> None:
    servers = pool_of(3)
    victim = servers[1]
    real_export = sync_client_module.full_export

    def export_that_kills_midway(*a, **kw):
        export = real_export(*a, **kw)

        class Killing:
            specs = export.specs

            def __iter__(self):
                for i, item in enumerate(export):
                    if i == len(export.specs) // 2:
                        victim.close()
                    yield item

        return Killing()

    monkeypatch.setattr(sync_client_module, "full_export", export_that_kills_midway)
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model, transport, pool_of.shared)
        want = _bump(model, 0.03)
        report = client.sync(1)
        assert sorted(report.acked) == sorted([servers[0].address, servers[2].address]), report
        assert victim.address in report.unreachable
        for s in (servers[0], servers[2]):
            assert torch.equal(s.param(PROBE), want)
    assert _shared_files(pool_of.shared) == []


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_full_staging_is_resource_exhausted_and_applies_nothing(pool_of, model, transport, monkeypatch) -> None:
    import shutil as real_shutil

    servers = pool_of(2)
    before = servers[0].param(PROBE).detach().clone()
    tiny = real_shutil.disk_usage("/")._replace(free=1 << 10)
    # grpc: the servers' staging dir is full; shm: the shared dir the learner writes into is
    target = (
        "rollout_svc.staging.shutil.disk_usage" if transport == "grpc" else "rmsft.weight_wire.shared.shutil.disk_usage"
    )
    monkeypatch.setattr(target, lambda _p: tiny)
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model, transport, pool_of.shared)
        _bump(model, 0.04)
        with pytest.raises(WeightSyncError, match="RESOURCE_EXHAUSTED"):
            client.sync(1)
        assert all(version_of(pool.status(s)) == FRESH for s in pool.servers)  # run id and number both kept
    for s in servers:
        assert torch.equal(s.param(PROBE), before)
        assert not any(p.suffix == ".bin" for p in s.staging.iterdir())
    assert _shared_files(pool_of.shared) == []


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_the_run_id_travels_with_every_version_relayed_or_shared(pool_of, model, transport) -> None:
    """A weight version is (run id, number): every server applies, reports and acknowledges the pair (the
    relayed ones too), and another learner run's pool takes none of them for current at the same number
    until its own re-sync."""
    servers = pool_of(3)
    mine = WeightVersion("3fa2c1d09e77", 1)
    with ServerPool([s.address for s in servers], run_id=mine.run_id) as pool:
        client = _client(pool, model, transport, pool_of.shared)
        report = client.sync(1)
        assert report.run_id == mine.run_id
        assert {a: version_of(r) for a, r in report.acked.items()} == {s.address: mine for s in servers}
        assert [version_of(pool.status(s)) for s in pool.servers] == [mine] * 3
        assert all(pool.is_current(s) for s in pool.servers)
        assert [s.servicer.runner.weights for s in servers] == [mine] * 3
    with ServerPool([s.address for s in servers], run_id="9b0e5d2c4a11") as other:
        other.set_current_version(1)
        other.refresh()
        assert not any(other.is_current(s) for s in other.servers)  # same number, another run's weights
        _client(other, model, transport, pool_of.shared).resync_server(other.servers[0])
        assert [other.is_current(s) for s in other.servers] == [True, False, False]
        assert servers[0].servicer.runner.weights == WeightVersion("9b0e5d2c4a11", 1)


# -- shm: the file itself -----------------------------------------------------------------------


def _shared_update(model, shared: Path, version: int) -> tuple[SharedUpdate, bytes]:
    named = [(n, p.detach()) for n, p in model.named_parameters() if n != "lm_head.weight"]
    specs = [(n, TensorSpec(dtype_name(t.dtype), tuple(t.shape))) for n, t in named]
    update = SharedUpdate.create(shared, specs, number=version, mode=FULL)
    return update, update.write(named)


def _send_header_and_trailer(address: str, update: SharedUpdate, digest: bytes) -> rollout_pb2.UpdateReply:
    chunks = [
        rollout_pb2.WeightChunk(header=update.header).SerializeToString(),
        rollout_pb2.WeightChunk(trailer=rollout_pb2.WeightTrailer(digest=digest)).SerializeToString(),
    ]
    with grpc.insecure_channel(address) as channel:
        return update_weights_raw(channel)(iter(chunks), timeout=30)


@pytest.mark.parametrize("damage", ["altered", "truncated", "digest"])
def test_a_damaged_shared_file_is_refused_and_the_old_weights_stay(pool_of, model, damage) -> None:
    (server,) = pool_of(1)
    before = server.param(PROBE).detach().clone()
    _bump(model, 0.05)
    update, digest = _shared_update(model, pool_of.shared, 1)
    try:
        if damage == "altered":
            with open(update.path, "r+b") as f:
                f.seek(update.header.total_bytes // 2)
                byte = f.read(1)
                f.seek(update.header.total_bytes // 2)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif damage == "truncated":
            os.truncate(update.path, update.header.total_bytes - 4096)
        else:
            digest = bytes(len(digest))
        with pytest.raises(grpc.RpcError) as err:
            _send_header_and_trailer(server.address, update, digest)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("digest" if damage != "truncated" else "truncated") in err.value.details()
    finally:
        update.remove()
    assert server.servicer.runner.version == 0
    assert torch.equal(server.param(PROBE), before)


def test_a_shared_file_outside_the_servers_dir_is_refused(pool_of, model, tmp_path) -> None:
    (server,) = pool_of(1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    update, digest = _shared_update(model, elsewhere, 1)
    try:
        with pytest.raises(grpc.RpcError) as err:
            _send_header_and_trailer(server.address, update, digest)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "RMSFT_SHARED_WEIGHTS_DIR" in err.value.details()
    finally:
        update.remove()


_DYING_LEARNER = textwrap.dedent("""
    import os, sys, time
    import grpc
    from rmsft_protos import rollout_pb2
    from rmsft.weight_wire import FULL, SharedUpdate, TensorSpec, update_weights_raw
    shared, address = sys.argv[1], sys.argv[2]
    specs = [("model.layers.0.mlp.up_proj.weight", TensorSpec("F32", (64, 32)))]
    update = SharedUpdate.create(shared, specs, number=1, mode=FULL)
    def requests():
        yield rollout_pb2.WeightChunk(header=update.header).SerializeToString()
        time.sleep(600)
    with grpc.insecure_channel(address) as channel:
        call = update_weights_raw(channel).future(requests(), timeout=600)
        call.initial_metadata()  # as the learner does: the server has the file open
        os.pwrite(update._fd, bytes(4096), 0)  # part of the data
        print("writing", flush=True)
        time.sleep(600)  # "mid-write": killed here
""")


def test_a_learner_killed_mid_write_leaves_no_file_behind(pool_of, tmp_path) -> None:
    (server,) = pool_of(1)
    script = tmp_path / "dying_learner.py"
    script.write_text(_DYING_LEARNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pool_of.shared), server.address], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert len(_shared_files(pool_of.shared)) == 1
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while _shared_files(pool_of.shared) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _shared_files(pool_of.shared) == []  # the server saw the call end and removed it
    finally:
        proc.kill()
        proc.wait()
    assert server.servicer.runner.version == 0


def test_a_sync_interrupted_mid_write_is_abandoned_whole_and_quietly(pool_of, model, monkeypatch, caplog) -> None:
    """A signal stopping the run (KeyboardInterrupt in the learner's thread) while the shared file is written:
    every server's call is cancelled, none applies anything, the file is removed, and nothing is logged as an
    error (the user stopped the run; gRPC's request thread is not made to fail)."""
    servers = pool_of(2)
    before = servers[0].param(PROBE).detach().clone()
    real_write = SharedUpdate.write

    def interrupted(self, *a, **kw):
        os.pwrite(self._fd, bytes(4096), 0)  # part of the data
        raise KeyboardInterrupt

    monkeypatch.setattr(SharedUpdate, "write", interrupted)
    with ServerPool([s.address for s in servers]) as pool, caplog.at_level(logging.ERROR):
        client = _client(pool, model, "shm", pool_of.shared)
        _bump(model, 0.05)
        with pytest.raises(KeyboardInterrupt):
            client.sync(1)
        assert all(version_of(pool.status(s)) == FRESH for s in pool.servers)
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        monkeypatch.setattr(SharedUpdate, "write", real_write)
        want = _bump(model, 0.0)
        assert sorted(client.sync(2).acked) == sorted(s.address for s in servers)  # the next sync goes through
    for s in servers:
        assert not torch.equal(s.param(PROBE), before) and torch.equal(s.param(PROBE), want)
    assert _shared_files(pool_of.shared) == []


def test_a_server_relays_only_to_its_allowed_peers(pool_of, model) -> None:
    """Issue 41: `relay_to` comes from the caller; a server forwards weights only to the peers its `relay_allow`
    names (the operator: the job's own StatefulSet pods; `rmsft local`: loopback). An update whose relay list names
    another address is refused whole, with the reason (the learner stops: a configuration to fix), and applies
    nothing there; within the allowed peers the same update goes through."""
    servers = pool_of(2)
    before = servers[0].param(PROBE).detach().clone()
    servers[0].servicer.cfg.relay_allow = "rollout-*.pool.team-a.svc:50051"  # not the loopback address it relays to
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model, "grpc", pool_of.shared)
        _bump(model, 0.01)
        with pytest.raises(
            WeightSyncError,
            match=rf"PERMISSION_DENIED: relay to {servers[1].address} refused: not "
            r"among this server's peers \(--relay-allow rollout-\*",
        ):
            client.sync(1)
        assert torch.equal(servers[0].param(PROBE), before)  # nothing applied where it was refused
        servers[0].servicer.cfg.relay_allow = "127.0.0.1:*"
        report = client.sync(2)
    assert sorted(report.acked) == sorted(s.address for s in servers), report
