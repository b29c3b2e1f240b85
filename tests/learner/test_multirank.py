"""Data-parallel learner on CPU (gloo): 2 ranks under torchrun against one real rollout server (HF
backend, greedy) must end with the same trainable parameters as 1 rank on the same global batch;
rank 0 alone talks to the server; each rank trains on its contiguous share. The same check runs
with DeepSpeed ZeRO-2, through `rmsft train` (with a resume), and for a rank-0 failure.

Each run is a subprocess (tests/learner/multirank_worker.py or `rmsft_cli train`), so no process
group leaks into the pytest process.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from rmsft.jobspec import parse_job
from rmsft_dev.synthetic import write_synthetic_dataset

slow = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multirank_worker.py")
PROMPTS_PER_STEP = 4  # global: 2 per rank
STEPS = 3


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from rollout_svc.launcher import RolloutServer

    log = tmp_path_factory.mktemp("serve") / "rollout.log"
    srv = RolloutServer.start(tiny_model_dir, backend="hf", max_model_len=1024, log_path=log, timeout=180)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=16, seed=0)


def write_job(
    path: Path, model_dir: Path, data: Path, ckpt: Path, *, steps: int = STEPS, colocate: bool = False, **training
) -> Path:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    spec["rollout"].update(maxModelLen=1024, enableLora=False, engine="hf")
    if colocate:  # every rank decodes with its own replica of the training model (spec.rollout.engine hf)
        spec["rollout"].pop("replicas")
        spec["rollout"]["mode"] = "colocate"
    spec["sync"]["mode"] = "full"  # the HF backend serves no adapters
    t = spec["training"]
    # Every step's segments fit one row per rank, so no carry buffer differs between 1 and 2 ranks.
    t.update(steps=steps, prompts_per_step=PROMPTS_PER_STEP, packing_length=4096, lr=2e-3)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 2}
    t["rollout"].update(max_tokens=48, temperature=0.0, generate_batch_size=4, request_timeout_s=60)
    # Without the recipe's box terms: with them, 2 ranks and 1 drift apart by up to 3e-4 in 3 steps at lr 2e-3
    # (CIoU on the coordinates' expected values gives tiny gradients that Adam scales up, so the order of the
    # all-reduce's sums shows); every other term of the recipe is in, and packed = unpacked holds with them all
    # (tests/core/test_core_clean_prefix.py).
    t["loss"] = {"smooth_l1": 0.0, "ciou": 0.0}
    t.update(training)
    parse_job(doc)  # fail here, not in a subprocess, on a bad spec
    path.write_text(yaml.safe_dump(doc))
    return path


def _env() -> dict[str, str]:
    from rollout_svc.launcher import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    # `rmsft train` serves /metrics on spec.learner.metricsPort (9090) unless told otherwise: a
    # fixed port fails whenever anything else on the machine holds it.
    env["RMSFT_METRICS_PORT"] = str(free_port())
    return env


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]


def _run(cmd: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc


def _server_calls(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for method, value in re.findall(r'rmsft_rollout_requests_total\{[^}]*method="(\w+)"[^}]*\} ([0-9.e+]+)', text):
        out[method] = out.get(method, 0.0) + float(value)
    return out


def _train(server, job: Path, out: Path, ranks: int) -> tuple[list[dict], list[dict[str, torch.Tensor]], dict]:
    """Run the worker on `ranks` processes; returns per-rank reports, params, and the server calls made."""
    out.mkdir(parents=True, exist_ok=True)
    before = _server_calls(server)
    prefix = _torchrun(ranks) if ranks > 1 else [sys.executable]
    proc = _run([*prefix, str(WORKER), str(job), server.address, str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    after = _server_calls(server)
    calls = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    params = [torch.load(out / f"params-rank{r}.pt") for r in range(ranks)]
    return reports, params, calls


def _assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"trainable parameters differ by up to {worst:.3g}"


@pytest.fixture(scope="module")
def one_rank(server, tiny_model_dir, data_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one-rank")
    job = write_job(tmp / "job.yaml", tiny_model_dir, data_path, tmp / "ckpt")
    return _train(server, job, tmp / "out", 1)


def _check_two_ranks(one_rank, reports, params, calls) -> None:
    (base,), (base_params,), base_calls = one_rank
    r0, r1 = reports
    assert (r0["world_size"], r1["world_size"]) == (2, 2)
    # One run: rank 0 made its id and handed it out; every rollout either rank trained on carries it.
    assert r0["run_id"] == r1["run_id"] != base["run_id"]
    assert r0["rollout_run_ids"] == r1["rollout_run_ids"] == [r0["run_id"]]
    # Only rank 0 builds a pool / rollout client; the server saw exactly what one rank sends.
    assert r0["has_pool"] and r0["has_rollout_client"]
    assert not r1["has_pool"] and not r1["has_rollout_client"]
    assert calls.get("Generate", 0) == base_calls.get("Generate", 0) > 0
    assert calls.get("UpdateWeights", 0) == base_calls.get("UpdateWeights", 0) == STEPS
    assert len(r0["steps"]) == len(r1["steps"]) == len(base["steps"]) == STEPS
    for s0, s1, sb in zip(r0["steps"], r1["steps"], base["steps"], strict=True):
        assert s0["record_ids"] == s1["record_ids"] == sb["record_ids"]
        half = PROMPTS_PER_STEP // 2
        # Each rank trained on its contiguous share, in at least one row of its own.
        assert s0["local_record_ids"] == sb["record_ids"][:half]
        assert s1["local_record_ids"] == sb["record_ids"][half:]
        assert s0["local_rows"] >= 1 and s1["local_rows"] >= 1 and s1["local_tokens"] > 0
        assert s0["rows"] == s0["local_rows"] + s1["local_rows"]
        # Rank 0 holds the whole batch's rollouts, rank 1 its share; all from the current weights.
        assert s0["rollout_ids"] == sb["record_ids"] and s1["rollout_ids"] == sb["record_ids"][half:]
        assert s0["rollout_versions"] == s1["rollout_versions"] == [s0["weight_version"]]
        # Global loss and F1 counts: the same on both ranks, and as one rank computed them.
        assert s0["loss"] == pytest.approx(s1["loss"], abs=1e-9)
        assert s0["loss"] == pytest.approx(sb["loss"], rel=1e-5, abs=1e-6)
        assert (s0["matched"], s0["fp"], s0["fn"]) == (s1["matched"], s1["fp"], s1["fn"])
        assert (s0["matched"], s0["fp"], s0["fn"]) == (sb["matched"], sb["fp"], sb["fn"])
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])  # ranks hold identical weights
    _assert_params_close(params[0], base_params, atol=1e-5)
    # Training moved the weights (LoRA B starts at zero): the comparison is not between untouched copies.
    assert max(v.abs().max().item() for k, v in base_params.items() if "lora_B" in k) > 1e-4


@slow
def test_two_ranks_equal_one_rank(server, one_rank, tiny_model_dir, data_path, tmp_path) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_model_dir, data_path, tmp_path / "ckpt")
    reports, params, calls = _train(server, job, tmp_path / "out", 2)
    _check_two_ranks(one_rank, reports, params, calls)
    state = torch.load(tmp_path / "ckpt" / f"step-{STEPS}" / "state.pt", weights_only=False)
    assert state["world_size"] == 2  # each rank's carry buffer and RNG: its own part
    assert sorted(p.name for p in (tmp_path / "ckpt" / f"step-{STEPS}").glob("rank-*.pt")) == ["rank-0.pt", "rank-1.pt"]


@slow
def test_two_colocated_ranks_equal_one_rank_with_a_server(
    server, one_rank, tiny_model_dir, data_path, tmp_path
) -> None:
    """spec.rollout.mode colocate on 2 ranks: each rank's in-process engine generates its own share (same
    per-prompt seeds), rank 0 gathers the batch's rollouts; the result is the one-rank server run's."""
    (base,), (base_params,), _ = one_rank
    job = write_job(tmp_path / "job.yaml", tiny_model_dir, data_path, tmp_path / "ckpt", colocate=True)
    reports, params, calls = _train(server, job, tmp_path / "out", 2)
    assert calls.get("Generate", 0) == 0 and calls.get("UpdateWeights", 0) == 0  # no server involved
    r0, r1 = reports
    assert not r0["has_pool"] and r0["has_rollout_client"] and r1["has_rollout_client"]
    half = PROMPTS_PER_STEP // 2
    for s0, s1, sb in zip(r0["steps"], r1["steps"], base["steps"], strict=True):
        assert s0["record_ids"] == sb["record_ids"] and s0["rollout_ids"] == sb["record_ids"]
        assert s1["rollout_ids"] == sb["record_ids"][half:]
        assert (s0["matched"], s0["fp"], s0["fn"]) == (sb["matched"], sb["fp"], sb["fn"])
        assert s0["loss"] == pytest.approx(s1["loss"], abs=1e-9)
        assert s0["loss"] == pytest.approx(sb["loss"], rel=1e-5, abs=1e-6)
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    _assert_params_close(params[0], base_params, atol=1e-5)


@slow
@pytest.mark.parametrize("deepspeed_stage", [2, 3], ids=["zero2", "zero3"])
def test_two_ranks_deepspeed_equal_one_rank(
    server, one_rank, tiny_model_dir, data_path, tmp_path, deepspeed_stage
) -> None:
    """ZeRO-2 shards gradients and optimizer state; ZeRO-3 the parameters too, so every sync
    gathers them on all ranks while rank 0 exports: the servers still see what one rank sends."""
    pytest.importorskip("deepspeed")
    job = write_job(
        tmp_path / "job.yaml", tiny_model_dir, data_path, tmp_path / "ckpt", deepspeed_stage=deepspeed_stage
    )
    reports, params, calls = _train(server, job, tmp_path / "out", 2)
    assert reports[0]["deepspeed"] and reports[1]["deepspeed"]
    _check_two_ranks(one_rank, reports, params, calls)


@slow
@pytest.mark.parametrize("deepspeed_stage", [0, 2, 3], ids=["torch", "zero2", "zero3"])
def test_rmsft_train_under_torchrun_resumes(
    server, one_rank, tiny_model_dir, data_path, tmp_path, deepspeed_stage
) -> None:
    """`torchrun -m rmsft_cli train`: 2 steps, then a resumed run to STEPS, ends where one rank does
    (with ZeRO-2 the optimizer partitions and fp32 master weights come back from the checkpoint)."""
    if deepspeed_stage:
        pytest.importorskip("deepspeed")
    ckpt = tmp_path / "ckpt"
    cmd = [*_torchrun(2), "-m", "rmsft_cli", "train", "--servers", server.address, "--config"]
    ds = {"deepspeed_stage": deepspeed_stage}
    first = _run([*cmd, str(write_job(tmp_path / "a.yaml", tiny_model_dir, data_path, ckpt, steps=2, **ds))])
    assert first.returncode == 0, first.stderr[-8000:]
    assert "step 2 v2 loss" in first.stderr  # rank 0's one-line-per-step log
    assert first.stderr.count("step 2 v2 loss") == 1  # ... and only rank 0's
    second = _run([*cmd, str(write_job(tmp_path / "b.yaml", tiny_model_dir, data_path, ckpt, **ds))])
    assert second.returncode == 0, second.stderr[-8000:]
    assert "resumed from step 2" in second.stderr
    assert f"step {STEPS} v3 loss" in second.stderr  # re-synced once on resume (v2 -> v3)
    state = torch.load(ckpt / f"step-{STEPS}" / "state.pt", weights_only=False)
    assert state["step"] == STEPS and state["world_size"] == 2
    (base,), (base_params,), _ = one_rank
    logged = [float(x) for x in re.findall(r"step \d+ v\d+ loss ([0-9.]+)", first.stderr + second.stderr)]
    assert logged == pytest.approx([s["loss"] for s in base["steps"]], abs=2e-4)
    _assert_params_close(state["model"], base_params, atol=1e-5)


@slow
def test_two_ranks_with_rollouts_ahead_equal_one_rank(server, tiny_model_dir, data_path, tmp_path) -> None:
    """max_staleness 1 (learner/train/overlap.py): rank 0 generates the next step's rollouts while every rank
    trains; both ranks accept the lagged version, and 2 ranks still end where 1 rank does."""
    runs = {}
    for ranks in (1, 2):
        job = write_job(
            tmp_path / f"job{ranks}.yaml",
            tiny_model_dir,
            data_path,
            tmp_path / f"ckpt{ranks}",
            rollout={
                "max_tokens": 48,
                "temperature": 0.0,
                "generate_batch_size": 4,
                "request_timeout_s": 60,
                "max_staleness": 1,
            },
        )
        runs[ranks] = _train(server, job, tmp_path / f"out{ranks}", ranks)
    (base,), (base_params,), base_calls = runs[1]
    (r0, r1), params, calls = runs[2]
    assert calls.get("Generate", 0) == base_calls.get("Generate", 0) > 0
    for s0, s1, sb in zip(r0["steps"], r1["steps"], base["steps"], strict=True):
        # the first step's rollouts come from the first sync; later ones from one version before the step's
        lag = 0 if s0["step"] == 1 else 1
        assert (
            s0["rollout_versions"] == s1["rollout_versions"] == sb["rollout_versions"] == [s0["weight_version"] - lag]
        )
        assert s0["loss"] == pytest.approx(s1["loss"], abs=1e-9)
        assert s0["loss"] == pytest.approx(sb["loss"], rel=1e-5, abs=1e-6)
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    _assert_params_close(params[0], base_params, atol=1e-5)


@slow
def test_two_ranks_evaluate_held_out_and_export(server, tiny_model_dir, data_path, tmp_path) -> None:
    """Held-out evaluation and the end-of-run export under two ranks: rank 0 evaluates (after a sync every rank
    joins) and exports, rank 1 waits in the same collectives instead of deadlocking."""
    held = write_synthetic_dataset(tmp_path / "held.jsonl", n=4, seed=1)
    job = write_job(
        tmp_path / "job.yaml",
        tiny_model_dir,
        data_path,
        tmp_path / "ckpt",
        eval={"data": str(held), "every": 2, "max_samples": 4, "max_tokens": 32},
    )
    reports, _, calls = _train(server, job, tmp_path / "out", 2)
    r0, r1 = reports
    assert [e[0] for e in r0["evaluations"]] == [2, STEPS] and r1["evaluations"] == []
    assert all(0.0 <= f1 <= 1.0 for _, f1, _ in r0["evaluations"])
    # The syncs: before the first step, after steps 1 and 2, and one for the last step's evaluation.
    assert calls.get("UpdateWeights", 0) == STEPS + 1
    assert r0["exported"] and (Path(r0["exported"]) / "config.json").is_file() and r1["exported"] is None
    assert (tmp_path / "ckpt" / "run.json").is_file()


@slow
def test_rank0_failure_stops_every_rank(tiny_model_dir, data_path, tmp_path) -> None:
    """No server answers: rank 0 fails waiting for it, and rank 1 exits too, naming rank 0's error."""
    from rollout_svc.launcher import free_port

    job = write_job(tmp_path / "job.yaml", tiny_model_dir, data_path, tmp_path / "ckpt")
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["training"]["rollout"]["request_timeout_s"] = 2
    doc["spec"]["rollout"]["startupTimeout"] = "3s"  # the learner waits this long at start (pool_wait_seconds)
    job.write_text(yaml.safe_dump(doc))
    t0 = time.monotonic()
    proc = _run(
        [*_torchrun(2), "-m", "rmsft_cli", "train", "--servers", f"127.0.0.1:{free_port()}", "--config", str(job)],
        timeout=300,
    )
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 240
    err = re.sub(r"\s+", " ", proc.stderr)
    assert "rollout servers not ready" in err  # rank 0's own error
    assert "learner rank 0 failed while waiting for the rollout servers" in err  # rank 1's


# -- fast checks (no processes, no servers) ---------------------------------------------------------


def test_shares_are_contiguous_balanced_and_cover_the_batch() -> None:
    from learner.train.ranks import share_bounds

    for n in range(1, 20):
        for ws in range(1, min(n, 6) + 1):
            bounds = [share_bounds(n, ws, r) for r in range(ws)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_single_rank_collectives_are_identity_and_guard_reraises() -> None:
    from learner.train.ranks import Ranks

    ranks = Ranks.single()
    assert (ranks.rank, ranks.world_size, ranks.is_main, ranks.enabled) == (0, 1, True, False)
    assert ranks.sum([1, 2.5]) == [1.0, 2.5] and ranks.scatter_from_main(["a"]) == "a"
    with pytest.raises(KeyError, match="boom"), ranks.guard("testing"):
        raise KeyError("boom")


def test_unsupported_deepspeed_setups_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from learner.train.zero import require_deepspeed

    with pytest.raises(RuntimeError, match="deepspeed_stage 4 is not supported"):
        require_deepspeed(4)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an absent package looks like to import
    with pytest.raises(RuntimeError, match="needs DeepSpeed, which cannot be imported.*deepspeed_stage: 0"):
        require_deepspeed(2)
