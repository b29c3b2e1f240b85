"""Transport nccl on the real vLLM CPU engine: `rmsft serve --weight-transfer rmsft_gloo` (rmsft's gloo engine,
registered in vLLM's registry from every engine worker: rollout_engine/weight_transfer_gloo.py) and the learner's
`WeightSyncClient(transport="nccl")`. After each sync over the group the server's greedy answers, fenced to the
version just synced, equal HF's with those weights (the tied head included: the learner sends the embedding once,
the server loads it under both names); the original weights synced back give the first answers again.

The control path's faults (restarts, refusals, a lost member) are in tests/learner/test_weight_group.py, on the HF
engine."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from rmsft_protos import rollout_pb2, rollout_pb2_grpc
from rollout_svc_helpers import hf_greedy, hf_model, prompt_ids

from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient, WeightSyncError
from rmsft.weight_wire import WeightVersion, set_version, version_of
from rmsft.weight_wire.transfer import receive_bound_s
from rollout_svc.launcher import RolloutServer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def group_srv(tiny_model_dir: Path):
    pytest.importorskip("vllm")
    with RolloutServer.start(tiny_model_dir, dtype="float32", weight_transfer="rmsft_gloo", timeout=400) as s:
        yield s


def test_a_vllm_server_synced_over_a_gloo_group_answers_as_hf_with_those_weights(
    group_srv, tiny_model_dir, tiny_tokenizer
) -> None:
    model = hf_model(tiny_model_dir)
    assert model.config.tie_word_embeddings  # what the head alias is for
    prompts = prompt_ids(tiny_tokenizer)[:4]
    eos = tiny_tokenizer.eos_token_id
    base = hf_greedy(model, prompts, 16, eos)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    run = "5c0ffee1d2a3"
    with ServerPool([group_srv.address], run_id=run) as pool, grpc.insecure_channel(group_srv.address) as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        client = WeightSyncClient(
            pool,
            model,
            dtype="float32",
            transport="nccl",
            group_backend="rmsft_gloo",
            group_timeout_s=60,
            timeout_s=120,
        )
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        report = client.sync(1)
        assert version_of(report.acked[group_srv.address]) == WeightVersion(run, 1)
        assert client.group.builds == 1 and pool.status(pool.servers[0]).weight_group == client.group.id
        perturbed = hf_greedy(model, prompts, 16, eos)
        assert perturbed != base  # the weights moved...
        assert _fenced(stub, group_srv.metadata(), prompts, WeightVersion(run, 1)) == perturbed  # ...whole
        with torch.no_grad():
            model.load_state_dict(original)
        client.sync(2)
        assert _fenced(stub, group_srv.metadata(), prompts, WeightVersion(run, 2)) == base
        assert client.group.builds == 1  # the same group, twice


def _fenced(stub, metadata, prompts: list[list[int]], version: WeightVersion) -> list[list[int]]:
    """Greedy answers, served only under `version` (the learner's fence: run id and number)."""
    req = set_version(rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(max_tokens=16)), version)
    for i, ids in enumerate(prompts):
        req.prompts.add(token_ids=ids, request_id=f"r{i}")
    reply = stub.Generate(req, metadata=metadata, timeout=120)
    assert version_of(reply) == version
    return [list(c.token_ids) for c in reply.completions]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (vLLM's engine core and the workers it spawns), not `pid` itself."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def test_a_server_whose_engine_stalls_in_a_group_update_gives_up_at_its_bound_and_exits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 60, item 3, the members' side of the deadline: the server's own process answers, its engine does not
    (every engine process stopped, as a worker stuck in an NCCL collective whose peer is gone would be). The
    learner's sync fails within its deadline naming it; the server, its update lock held and its gate closed while
    it waits on the engine, gives up at `receive_bound_s` (the deadline for each of the update's collectives, its
    start and finish), says why and exits to be restarted: it never claims the version, and never waits for ever."""
    deadline = 3.0
    run = "7e57a11ed0c4"
    srv = RolloutServer.spawn(
        tiny_model_dir, dtype="float32", weight_transfer="rmsft_gloo", log_path=tmp_path / "serve.log"
    )
    stopped: list[int] = []
    try:
        srv.wait_healthy(400)
        model = hf_model(tiny_model_dir)
        with ServerPool([srv.address], run_id=run) as pool:
            client = WeightSyncClient(
                pool,
                model,
                dtype="float32",
                transport="nccl",
                group_backend="rmsft_gloo",
                group_timeout_s=deadline,
                timeout_s=120,
                group_bucket_bytes=1 << 30,  # one bucket: the bound is the deadline x 3
            )
            client.sync(1)
            assert client.group.updates == 1
            sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
            bound = receive_bound_s(deadline, sizes, 1 << 30)
            assert bound == 3 * deadline
            stopped = _descendants(srv.proc.pid)
            assert stopped, "no engine process below the server"
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError, match="deadline"):
                client.sync(2)
            assert time.monotonic() - t0 < 2 * deadline + 10
            code = srv.proc.wait(timeout=bound + 60)  # not for ever
            took = time.monotonic() - t0
        assert code == 1, srv.log_tail()
        assert took >= bound - 0.5, took  # not before the bound: a slow member is not a stuck one
        log = srv.log_path.read_text(errors="replace")
        assert f"receiving the update over the weight-transfer group did not end within {bound:g}s" in log, log[-3000:]
        assert not re.search(r"weights v2 of run \S+ applied", log), log[-3000:]  # never claimed
    finally:
        for pid in stopped:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        srv.stop()
