"""Shared pieces of the trainer's fast tests: a tiny job against in-process fake rollout servers
(real gRPC on loopback, deterministic fake engines: tests/learner/learner_fakes.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def make_job(model_dir: Path, data: Path, ckpt: Path, *, steps: int = 2, **training: Any):
    """configs/local-tiny.yaml shrunk to seconds: 2 prompts a step, 16 new tokens, no retries wait."""
    from rmsft.jobspec import parse_job

    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations", None)
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    t = spec["training"]
    t.update(steps=steps, prompts_per_step=2, packing_length=1024, packing_buffer=16)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 2}
    t["rollout"].update(max_tokens=16, generate_batch_size=1, request_timeout_s=30)
    for key, value in training.items():
        t[key] = value
    return parse_job(doc)
