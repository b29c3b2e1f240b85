"""Transport nccl's control path end to end against real servers (`RolloutServicer` + the HF engine behind real gRPC
servers on loopback), with the CPU backend (`rmsft_gloo`): the learner's `WeightSyncClient` builds a weight-transfer
group over gRPC (`JoinWeightGroup`), announces each FULL update in an `UpdateWeights` header, and broadcasts the
tensors over the group once every member said ready.

The real vLLM engine's side of the same path is tests/rollout/test_weight_transfer_gloo.py and the `rmsft local`
test in tests/learner/test_e2e_local.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest
import torch
from hf_servers import InProcessServer, bump, fresh_model
from rmsft_protos import rollout_pb2

from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient, WeightSyncError
from rmsft.weight_wire import WeightVersion, update_weights_raw, version_of
from rmsft.weight_wire.transfer import receive
from rollout_engine.engine import EngineDead

pytest.importorskip("vllm")  # the gloo group is opened with vLLM's stateless helper

PROBE = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture
def servers_of(tiny_model_dir: Path, tmp_path: Path):
    made: list[InProcessServer] = []

    def start(n: int, weight_transfer: str = "rmsft_gloo") -> list[InProcessServer]:
        for _ in range(n):
            made.append(
                InProcessServer(tiny_model_dir, tmp_path / f"stage-{len(made)}", weight_transfer=weight_transfer)
            )
        return made[-n:]

    start.restart = lambda old: (
        made.append(
            InProcessServer(  # same address, a new process's state
                tiny_model_dir, old.staging, port=old.port, weight_transfer="rmsft_gloo"
            )
        )
        or made[-1]
    )
    yield start
    for s in made:
        s.close()


@pytest.fixture
def model(tiny_model_dir: Path):
    return fresh_model(tiny_model_dir)


def _client(pool: ServerPool, model) -> WeightSyncClient:
    return WeightSyncClient(
        pool, model, dtype="float32", transport="nccl", group_backend="rmsft_gloo", group_timeout_s=20, timeout_s=60
    )


def _holds(server: InProcessServer, want: dict[str, torch.Tensor]) -> bool:
    params = dict(server.engine.hf.named_parameters())
    return all(torch.equal(params[n], t) for n, t in want.items())


def test_every_server_receives_each_full_update_over_one_group(servers_of, model, caplog) -> None:
    servers = servers_of(3)
    run = "3fa2c1d09e77"
    with ServerPool([s.address for s in servers], run_id=run) as pool:
        client = _client(pool, model)
        for number in (1, 2):
            want = bump(model, 0.01)
            with caplog.at_level(logging.WARNING, logger="rmsft.learner.sync"):
                report = client.sync(number)
            assert not [r.message for r in caplog.records if "over gRPC" in r.message]  # not the fallback
            assert {a: version_of(r) for a, r in report.acked.items()} == {
                s.address: WeightVersion(run, number) for s in servers
            }
            assert all(_holds(s, want) for s in servers)
            assert [s.servicer.runner.weights for s in servers] == [WeightVersion(run, number)] * 3
        assert client.group.builds == 1  # built once, used twice
        assert {pool.status(s).weight_group for s in pool.servers} == {client.group.id}
    for s in servers:  # the bytes never touched the servers' staging dirs
        assert sum(p.stat().st_size for p in s.staging.iterdir()) == 0


def test_a_restarted_server_is_resynced_over_grpc_and_joins_the_next_group(servers_of, model) -> None:
    servers = servers_of(2)
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model)
        client.sync(1)
        first_group = client.group.id
        servers[1].close()
        back = servers_of.restart(servers[1])  # base weights, in no group
        pool.mark_down(pool.servers[1], "restarted")
        assert pool.status(pool.servers[1], fresh_channel=True).weight_group == ""
        client.resync_server(pool.servers[1])  # over gRPC: the group is not involved
        assert back.servicer.runner.weights == pool.current
        assert sum(p.stat().st_size for p in back.staging.iterdir()) > 0  # it came as a staged stream
        want = bump(model, 0.02)
        report = client.sync(2)
        assert sorted(report.acked) == sorted(s.address for s in servers)
        assert client.group.builds == 2 and client.group.id != first_group  # rebuilt with the restarted one
        assert _holds(servers[0], want) and _holds(back, want)


def test_a_server_gone_between_syncs_costs_one_grpc_sync_and_the_group_is_rebuilt_without_it(
    servers_of, model, caplog
) -> None:
    servers = servers_of(3)
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model)
        client.sync(1)
        servers[2].close()
        want = bump(model, 0.03)
        with caplog.at_level(logging.WARNING, logger="rmsft.learner.sync"):
            report = client.sync(2)  # it does not answer: this one goes over gRPC, no collective waits for it
        assert any("over gRPC" in r.message and "did not answer" in r.message for r in caplog.records)
        assert sorted(report.acked) == sorted(s.address for s in servers[:2])
        assert servers[2].address in report.unreachable
        want = bump(model, 0.03)
        report = client.sync(3)
        assert client.group.members == tuple(s.address for s in servers[:2]) and client.group.builds == 2
        assert sorted(report.acked) == sorted(s.address for s in servers[:2])
        assert all(_holds(s, want) for s in servers[:2])


def test_a_member_lost_mid_broadcast_costs_one_sync_not_a_hang(servers_of, model, caplog) -> None:
    """A server that dies after the first tensor of an update (its group aborted, as a killed process's is): the
    learner's broadcast gives up within the group timeout instead of hanging; the other member, which holds every
    bucket it got in buffers of its own until the learner commits the update, loads nothing and keeps serving version
    1 whole; none claims version 2, and the sync fails naming each. The lost one, restarted, is re-synced over gRPC
    and the next sync builds a new group."""
    servers = servers_of(2)
    lost = servers[1]
    with ServerPool([s.address for s in servers], run_id="6b1e0c9d2a44") as pool:
        client = WeightSyncClient(
            pool, model, dtype="float32", transport="nccl", group_backend="rmsft_gloo", group_timeout_s=8, timeout_s=60
        )
        client.sync(1)
        first_group = client.group.id

        def dies_after_one_tensor(info: dict) -> None:
            group = lost.engine._group
            next(receive(group, info["names"][:1], info["dtype_names"][:1], info["shapes"][:1]))
            group.abort()  # the process is gone: its sockets close
            raise EngineDead("killed mid-broadcast")

        lost.engine.receive_weights = dies_after_one_tensor
        bump(model, 0.04)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rmsft.learner.sync"), pytest.raises(WeightSyncError) as e:
            client.sync(2)  # no server holds version 2: none acknowledges it
        took = time.monotonic() - t0
        assert took < 2 * 8 + 10, took  # the group timeout bounds it: no hang
        assert any("failed mid-update" in r.message for r in caplog.records), [r.message for r in caplog.records]
        said = str(e.value)
        assert f"{lost.address}: UNAVAILABLE: killed mid-broadcast" in said
        # The other member: nothing loaded, still ready, out of the broken group, on version 1.
        assert f"{servers[0].address}: UNAVAILABLE" in said and "nothing was loaded" in said
        assert servers[0].servicer.ready and not lost.servicer.ready
        assert pool.status(pool.servers[0]).weight_group == ""
        assert all(s.servicer.runner.weights == WeightVersion("6b1e0c9d2a44", 1) for s in servers)  # never 2
        lost.close()
        back = servers_of.restart(lost)
        pool.mark_down(pool.servers[1], "restarted")
        client.resync_server(pool.servers[1])  # over gRPC, as the rollout client does before it gives it work
        want = bump(model, 0.05)
        report = client.sync(3, servers=pool.servers)
        assert sorted(report.acked) == sorted(s.address for s in servers)
        assert client.group.id != first_group
        assert _holds(servers[0], want) and _holds(back, want)


def test_a_server_without_weight_transfer_gets_the_update_over_grpc(servers_of, model, caplog) -> None:
    servers = servers_of(1) + servers_of(1, weight_transfer="")
    with ServerPool([s.address for s in servers]) as pool:
        client = _client(pool, model)
        want = bump(model, 0.01)
        with caplog.at_level(logging.WARNING, logger="rmsft.learner.sync"):
            report = client.sync(1)
        assert sorted(report.acked) == sorted(s.address for s in servers)
        assert all(_holds(s, want) for s in servers)
        said = " ".join(r.message for r in caplog.records)
        assert "not formed" in said and "started without --weight-transfer" in said


def _group_update(address: str, header: rollout_pb2.WeightHeader, go: bool = True):
    chunks = [rollout_pb2.WeightChunk(header=header).SerializeToString()]
    if go:
        chunks.append(rollout_pb2.WeightChunk(trailer=rollout_pb2.WeightTrailer()).SerializeToString())
    with grpc.insecure_channel(address) as channel:
        return update_weights_raw(channel)(iter(chunks), timeout=30)


def _listing(model, group_id: str, **override) -> rollout_pb2.WeightHeader:
    named = [(n, p) for n, p in model.state_dict().items() if n != "lm_head.weight"]
    tensors = [rollout_pb2.SharedTensor(name=n, dtype="F32", shape=list(t.shape)) for n, t in named]
    for name, shape in override.items():
        next(t for t in tensors if t.name == name.replace("__", ".")).shape[:] = shape
    return rollout_pb2.WeightHeader(
        version=5,
        run_id="3fa2c1d09e77",
        mode=1,
        tensor_count=len(tensors),
        total_bytes=sum(t.numel() * 4 for _, t in named),
        transfer_group=rollout_pb2.TransferGroup(group_id=group_id, tensors=tensors),
    )


def test_an_update_for_another_group_or_with_a_wrong_listing_is_refused_before_any_broadcast(servers_of, model) -> None:
    (server,) = servers_of(1)
    with ServerPool([server.address]) as pool:
        client = _client(pool, model)
        client.sync(1)
        held = server.servicer.runner.weights
        with pytest.raises(grpc.RpcError) as e:
            _group_update(server.address, _listing(model, "not-this-one"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "rebuilds the group" in e.value.details()
        bad = _listing(model, client.group.id, **{"model__layers__0__mlp__up_proj__weight": [3, 3]})
        with pytest.raises(grpc.RpcError) as e:
            _group_update(server.address, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "up_proj" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # called off after ready: the stream ends without the go
            _group_update(server.address, _listing(model, client.group.id), go=False)
        assert "called the update off" in e.value.details()
        assert server.servicer.runner.weights == held  # nothing applied, the fence still names sync 1
        # and the group still works for the learner
        want = bump(model, 0.05)
        client.sync(2)
        assert _holds(server, want) and client.group.builds == 1


def test_a_bucketed_group_sync_lands_whole_on_every_server_with_one_broadcast_per_bucket(servers_of, model) -> None:
    """spec.sync.bucketMegabytes > 0: the learner packs the update into buckets, each server's engine unpacks them by
    the header's listing with the bucket size it agreed at the join, and holds the learner's weights bit for bit."""
    from rmsft.weight_wire.transfer import plan_buckets

    servers = servers_of(2)
    bucket = 64 << 10  # the tiny model's tensors: several buckets, some holding many tensors
    with ServerPool([s.address for s in servers], run_id="5d0c3b2a1e99") as pool:
        client = WeightSyncClient(
            pool,
            model,
            dtype="float32",
            transport="nccl",
            group_backend="rmsft_gloo",
            group_timeout_s=20,
            timeout_s=60,
            group_bucket_bytes=bucket,
        )
        want = bump(model, 0.01)
        report = client.sync(1)
        assert sorted(report.acked) == sorted(s.address for s in servers)
        assert all(_holds(s, want) for s in servers)
        assert [s.servicer.runner.weights for s in servers] == [WeightVersion("5d0c3b2a1e99", 1)] * 2
        sizes = [t.numel() * 4 for _, t in model.named_parameters()]
        plan = plan_buckets(sizes, bucket)
        assert client.group.sender.collectives == len(plan) < len(sizes)


def test_a_server_that_does_not_echo_the_bucket_size_is_not_taken_into_the_group(
    servers_of, model, caplog, monkeypatch
) -> None:
    """A server image older than the buckets drops JoinWeightGroupRequest.bucket_bytes (it would read the broadcasts
    as one tensor each): its reply says 0, the learner builds no group with it and the update goes over gRPC."""
    (server,) = servers_of(1)
    import rollout_svc.weight_group as server_side

    class OlderProtos:  # the server's view of the protos, as an image built before the field was
        def __getattr__(self, name):
            return getattr(rollout_pb2, name)

        @staticmethod
        def JoinWeightGroupReply(**kw):
            return rollout_pb2.JoinWeightGroupReply(**{k: v for k, v in kw.items() if k != "bucket_bytes"})

    monkeypatch.setattr(server_side, "rollout_pb2", OlderProtos())
    with ServerPool([server.address]) as pool:
        client = WeightSyncClient(
            pool,
            model,
            dtype="float32",
            transport="nccl",
            group_backend="rmsft_gloo",
            group_timeout_s=20,
            timeout_s=60,
            group_bucket_bytes=1 << 20,
        )
        want = bump(model, 0.02)
        with caplog.at_level(logging.WARNING, logger="rmsft.learner.sync"):
            report = client.sync(1)
        assert sorted(report.acked) == [server.address] and _holds(server, want)
        said = " ".join(r.message for r in caplog.records)
        assert "over gRPC" in said and "unpacks buckets of 0 bytes, the learner sends 1048576" in said, said
        assert client.group.id == ""  # no group: the next full sync tries again


@pytest.mark.parametrize(("spec_mb", "want"), [(None, 512 << 20), (64, 64 << 20), (0, 0)])
def test_spec_sync_bucket_megabytes_reaches_the_learners_group(spec_mb, want) -> None:
    """spec.sync.bucketMegabytes (default 512 MiB) is the bucket size the learner's group sends and asks its members
    to unpack with; 0 keeps one broadcast per tensor."""
    import copy

    import yaml

    from learner.train.server_setup import build_server_rollouts
    from rmsft.jobspec import parse_job

    doc = copy.deepcopy(
        yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "local-tiny.yaml").read_text())
    )
    sync = {**(doc["spec"].get("sync") or {}), "transport": "nccl"}
    if spec_mb is not None:
        sync["bucketMegabytes"] = spec_mb
    doc["spec"]["sync"] = sync
    rollouts = build_server_rollouts(
        parse_job(doc),
        ["127.0.0.1:9"],
        object(),
        run_id="x",
        auth_token=None,
        checkpoint_dir="/tmp",
        vision_language=False,
        zero3=False,
    )
    assert rollouts.sync_client.group.bucket_bytes == want
