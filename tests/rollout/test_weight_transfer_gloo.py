"""Transport nccl on the real vLLM CPU engine: `rmsft serve --weight-transfer rmsft_gloo` (rmsft's gloo engine,
registered in vLLM's registry from every engine worker: rollout_engine/weight_transfer_gloo.py) and the learner's
`WeightSyncClient(transport="nccl")`. After each sync over the group the server's greedy answers, fenced to the
version just synced, equal HF's with those weights (the tied head included: the learner sends the embedding once,
the server loads it under both names); the original weights synced back give the first answers again.

The control path's faults (restarts, refusals, a lost member) are in tests/learner/test_weight_group.py, on the HF
engine."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from rmsft_protos import rollout_pb2, rollout_pb2_grpc
from rollout_svc_helpers import hf_greedy, hf_model, prompt_ids

from learner.rollouts.pool import ServerPool
from learner.sync.client import WeightSyncClient
from rmsft.weight_wire import WeightVersion, set_version, version_of
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
