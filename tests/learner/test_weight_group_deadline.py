"""The weight group's deadline (issue 60, item 3) with real server processes: two `rmsft serve --backend hf
--weight-transfer rmsft_gloo` processes (the HF engine runs in the server's own process, so SIGSTOP of the server is
SIGSTOP of its engine), the learner's `WeightSyncClient` in this process, the CPU group (gloo).

One server is stopped (SIGSTOP) mid-broadcast, right after the update's first broadcast went out: the learner's
sync fails within the group's deadline naming it, the other server keeps serving the previous whole version, and
after SIGCONT the stopped one never reports the new version until a later sync brings both to it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from hf_servers import bump, fresh_model
from rmsft_protos import rollout_pb2

from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient, WeightSyncError
from rmsft.weight_wire import WeightVersion, set_version, version_of
from rollout_svc.launcher import RolloutServer

pytest.importorskip("vllm")  # the gloo group is opened with vLLM's stateless helper

DEADLINE = 5.0
RUN = "5d0c2b7e9a13"


def _status(srv: RolloutServer) -> rollout_pb2.StatusReply:
    with srv.channel() as ch:
        return srv.stub(ch).GetStatus(rollout_pb2.StatusRequest(), timeout=10)


def _generate_version(srv: RolloutServer, expected: WeightVersion) -> WeightVersion:
    """One Generate call fenced to `expected`; the version its answer says produced it."""
    req = set_version(
        rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(max_tokens=2, temperature=0.0)), expected
    )
    req.prompts.add(token_ids=[1, 2, 3], request_id="r0")
    with srv.channel() as ch:
        return version_of(srv.stub(ch).Generate(req, timeout=60))


def test_a_server_stopped_mid_broadcast_is_cut_off_and_never_claims_the_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    for i in range(2):
        (tmp_path / f"stage-{i}").mkdir()
    servers = [
        RolloutServer.spawn(
            tiny_model_dir,
            backend="hf",
            weight_transfer="rmsft_gloo",
            staging_dir=str(tmp_path / f"stage-{i}"),
            log_path=tmp_path / f"serve-{i}.log",
        )
        for i in range(2)
    ]  # both start at once
    try:
        for s in servers:
            s.wait_healthy(120)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    # The stopped one is the group's last rank: gloo's root sends each broadcast to its members in turn, so a member
    # stalled first in that order would hold the others' bytes back too (then both are cut off, rightly).
    other, stopped = servers
    resumed = False
    try:
        model = fresh_model(tiny_model_dir)
        with ServerPool([s.address for s in servers], run_id=RUN) as pool:
            # One broadcast per tensor, so "mid-broadcast" is a moment between two of them.
            client = WeightSyncClient(
                pool,
                model,
                dtype="float32",
                transport="nccl",
                group_backend="rmsft_gloo",
                group_timeout_s=DEADLINE,
                timeout_s=120,
                group_bucket_bytes=0,
            )
            client.sync(1)
            v1 = WeightVersion(RUN, 1)
            assert [version_of(_status(s)) for s in servers] == [v1, v1]

            parts = client._update_parts

            def stopping_after_the_first_broadcast(mode: str, number: int):
                specs, tensors, config = parts(mode, number)

                def gen():
                    for i, item in enumerate(tensors):
                        # Asked for the third tensor: the first one's broadcast is done, the second is pending.
                        if i == 2:
                            os.kill(stopped.proc.pid, signal.SIGSTOP)
                        yield item

                return specs, gen(), config

            client._update_parts = stopping_after_the_first_broadcast  # type: ignore[method-assign]
            bump(model, 0.01)
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError) as e:
                client.sync(2)
            took = time.monotonic() - t0
            # The finish (or a stalled broadcast, then the answers) waits the deadline once or twice, not more.
            assert took < 2 * DEADLINE + 10, took
            said = str(e.value)
            assert f"Cut off (missed the group's deadline of {DEADLINE:g}s" in said, said
            cut_off = said.split("Cut off", 1)[1].split("The others:", 1)[0]
            assert stopped.address in cut_off and other.address not in cut_off, said
            client._update_parts = parts  # type: ignore[method-assign]

            # The other member loaded nothing: it serves version 1, whole (a call fenced to 1 runs on it).
            assert version_of(_status(other)) == v1
            assert _generate_version(other, v1) == v1

            os.kill(stopped.proc.pid, signal.SIGCONT)
            resumed = True
            # It runs again: its update ends (the group it was in is gone), and it leaves the group, still on 1.
            deadline = time.monotonic() + 60
            seen = []
            while time.monotonic() < deadline:
                status = _status(stopped)
                seen.append(version_of(status))
                if status.weight_group == "":
                    break
                time.sleep(0.2)
            assert seen and set(seen) == {v1}, seen
            assert _status(stopped).weight_group == ""
            assert _generate_version(stopped, v1) == v1

            # The next sync re-syncs it: a new group of both, both on the new version.
            report = client.sync(2, servers=pool.servers)
            v2 = WeightVersion(RUN, 2)
            assert sorted(report.acked) == sorted(s.address for s in servers)
            assert [version_of(_status(s)) for s in servers] == [v2, v2]
    finally:
        if not resumed:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        for s in servers:
            s.stop()
