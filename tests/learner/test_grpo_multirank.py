"""GRPO data-parallel on CPU (gloo), through `rmsft train` (which picks the learner from spec.trainer): 2 torchrun
ranks against one real rollout server (HF backend, processed log-probs, as a GRPO job's servers run) end with
the same weights, losses and rewards as 1 rank on the same global batch. Rank 0 samples every group; each rank
scores and trains the whole groups of its share of prompts; the loss is normalised over both ranks' tokens."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_multirank import _run, _torchrun

from rmsft.jobspec import parse_job
from rmsft_dev.synthetic import write_answer_dataset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
_STEP = re.compile(r"step (\d+) v(\d+) loss (\S+) reward (\S+) ")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from rollout_svc.launcher import RolloutServer

    log = tmp_path_factory.mktemp("serve") / "rollout.log"
    srv = RolloutServer.start(
        tiny_model_dir, backend="hf", max_model_len=1024, logprobs_mode="processed", log_path=log, timeout=180
    )
    yield srv
    srv.stop()


def write_job(path: Path, model_dir: Path, data: Path, ckpt: Path) -> Path:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-grpo.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    spec["rollout"].update(maxModelLen=1024, engine="hf")
    t = spec["training"]
    t.update(steps=STEPS, prompts_per_step=4, lr=2e-3)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 1}
    t["export"] = {"enabled": False}
    t["rollout"].update(request_timeout_s=60, max_tokens=64)  # (< maxModelLen; what held-out answers would use)
    # The widest reward: a few steps of a random model see non-zero advantages.
    t["grpo"].update(
        group_size=4,
        temperature=0.7,
        max_tokens=4,
        rewards=[{"name": "rmsft_dev.synthetic:CoordAnswerReward", "params": {"width": 1000}}],
    )
    parse_job(doc)
    path.write_text(yaml.safe_dump(doc))
    return path


def _train(server, tmp: Path, model_dir: Path, data: Path, ranks: int) -> tuple[list[tuple], dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    job = write_job(tmp / "job.yaml", model_dir, data, tmp / "ckpt")
    prefix = _torchrun(ranks) if ranks > 1 else [sys.executable]
    proc = _run([*prefix, "-m", "rmsft_cli", "train", "--servers", server.address, "--config", str(job)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    steps = [(int(s), int(v), float(loss), float(r)) for s, v, loss, r in _STEP.findall(proc.stderr)]
    assert [s[:2] for s in steps] == [(k, k) for k in range(1, STEPS + 1)], proc.stderr[-4000:]  # rank 0's lines
    state = torch.load(tmp / "ckpt" / f"step-{STEPS}" / "state.pt", weights_only=False)
    assert state["world_size"] == ranks
    return steps, state["model"]


def test_two_ranks_equal_one_rank(server, tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_answer_dataset(tmp_path / "answers.jsonl", n=16, seed=0)
    one, one_params = _train(server, tmp_path / "one", tiny_model_dir, data, 1)
    two, two_params = _train(server, tmp_path / "two", tiny_model_dir, data, 2)
    for (_, _, loss1, reward1), (_, _, loss2, reward2) in zip(one, two, strict=True):
        # As logged (%.3f, %.4f): the same samples, scored on both ranks and pooled; the same loss.
        assert reward2 == pytest.approx(reward1, abs=1.5e-3)
        assert loss2 == pytest.approx(loss1, abs=1.5e-4)
    # The weights: the same updates up to float noise. Not to 1e-5 as for rollout matching: the advantages of a
    # group sum to zero, so many parameters' gradients nearly cancel, and AdamW turns the summation-order noise
    # of such a gradient into a sizeable share of a step (its update is about lr * sign(g) whatever |g|).
    from safetensors.torch import load_file

    init = load_file(str(tiny_model_dir / "model.safetensors"))
    assert one_params.keys() == two_params.keys() and init.keys() & one_params.keys()
    moved = max((one_params[k] - init[k]).abs().max().item() for k in init.keys() & one_params.keys())
    worst = max((one_params[k] - two_params[k]).abs().max().item() for k in one_params)
    assert moved > 1e-3  # 3 steps of AdamW at lr 2e-3 moved the weights
    assert worst <= 0.05 * moved, f"trainable parameters differ by up to {worst:.3g} (moved up to {moved:.3g})"
    off = sum(int(((one_params[k] - two_params[k]).abs() > 1e-5).sum()) for k in one_params)
    total = sum(v.numel() for v in one_params.values())
    assert off <= 1e-4 * total, f"{off} of {total} weights differ by more than 1e-5"  # a handful, not a pattern
