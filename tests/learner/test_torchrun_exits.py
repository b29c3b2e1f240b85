"""A learner of 2 ranks as a learner pod runs it (issue 60): `rmsft torchrun --standalone --nproc-per-node 2 -m
rmsft_cli train`, gloo on the CPU, the tiny text model with its engine in the ranks (colocate, HF) and every step a
ground-truth step (no server, no sampling: seconds a run).

- SIGTERM to the container's command mid-run (what the kubelet sends, through tini): torchrun passes it to both
  ranks, they agree on a step, save it and exit 143; the container exits 143; the resumed run's losses equal an
  uninterrupted run's.
- A refused configuration on rank 0 only (the checkpoint of another run, a lineage refusal): the container exits 2,
  rank 1 with rank 0's code, where torchrun alone exits 1.
- A transient error (EIO) on rank 1 mid-run: the container exits 75, retryable, and the retry resumes from the
  periodic checkpoint with the uninterrupted run's losses.
- `rmsft train` as PID 1 of its own PID namespace (a container without an init): a SIGTERM while it still loads is
  handled from its first line, not ignored to the grace period's SIGKILL.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from learner.train.checkpoint_files import list_checkpoints
from rmsft.exit_codes import CONFIG_EXIT, RETRY_EXIT, STOPPED_EXIT
from rmsft.jobspec import parse_job
from rmsft.pause_points import FAIL_AT_ENV
from rmsft_dev.synthetic import write_synthetic_dataset

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
STEP_LINE = re.compile(r"step (\d+) v\d+ loss ([0-9.]+)")


def write_job(path: Path, model_dir: Path, data: Path, ckpt: Path, **training) -> Path:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    spec["rollout"] = {"mode": "colocate", "engine": "hf", "maxModelLen": 1024, "enableLora": False}
    spec["sync"]["mode"] = "full"
    t = spec["training"]
    # Ground-truth steps only: the engine in the ranks never generates, so a step is a forward/backward.
    t.update(steps=STEPS, warm_start_steps=STEPS, prompts_per_step=4, packing_length=2048, lr=2e-3)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 2}
    t["rollout"].update(max_tokens=16, request_timeout_s=60)
    t.update(training)
    parse_job(doc)  # a bad spec fails here, not in a subprocess
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=32, seed=0)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    # TINI_SUBREAPER: tini is not PID 1 here (it is in the pod), and says so on every start without it
    env.update(OMP_NUM_THREADS="1", RMSFT_METRICS_PORT="0", PYTHONUNBUFFERED="1", TINI_SUBREAPER="1", **extra)
    return env


def container_command(job: Path, ranks: int = 2, wrapper: bool = True) -> list[str]:
    """The learner container's command as operator/rmsft_operator/render.py writes it (tini and all), or with
    `wrapper` False the plain torchrun it replaced."""
    launch = (
        ["tini", "--", sys.executable, "-m", "rmsft_cli", "torchrun"]
        if wrapper
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    return [*launch, "--standalone", "--nproc-per-node", str(ranks), "-m", "rmsft_cli", "train", "--config", str(job)]


def _run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in STEP_LINE.findall(text)}


@pytest.fixture(scope="module")
def straight(tiny_model_dir: Path, data_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run's per-step losses (rank 0's log)."""
    tmp = tmp_path_factory.mktemp("straight")
    proc = _run(container_command(write_job(tmp / "job.yaml", tiny_model_dir, data_path, tmp / "ckpt")))
    assert proc.returncode == 0, proc.stderr[-6000:]
    losses = _losses(proc.stderr)
    assert sorted(losses) == list(range(1, STEPS + 1)), proc.stderr[-3000:]
    return losses


def test_sigterm_mid_run_saves_the_agreed_step_exits_143_and_resumes_as_if_never_stopped(
    straight: dict[int, float], tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    job = write_job(tmp_path / "job.yaml", tiny_model_dir, data_path, ckpt)
    proc = subprocess.Popen(container_command(job), cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    sent = threading.Event()
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if not sent.is_set() and STEP_LINE.search(line) and int(STEP_LINE.search(line).group(1)) >= 2:
            proc.send_signal(signal.SIGTERM)  # to tini, PID 1's stand-in: it passes it on, as in the pod
            sent.set()
    rc = proc.wait(timeout=120)
    err = "".join(lines)
    assert sent.is_set(), err[-4000:]
    assert rc == STOPPED_EXIT, err[-6000:]
    # Rank 0's line names the checkpoint, whichever of the two reasons below it stopped for.
    found = re.search(
        r"stopped \((?:SIGTERM|another rank was asked to stop)\) after step (\d+): checkpoint (\S+) written", err
    )
    assert found, err[-6000:]
    step = int(found.group(1))
    assert 2 <= step < STEPS
    assert [p.name for p in list_checkpoints(ckpt)] == [f"step-{step}"]
    # Both ranks stop at that one step. torchrun's agent passes SIGTERM to each rank in turn, so a rank may reach the
    # step's agreement before its own signal lands: it then stops because "another rank was asked to stop"; either
    # way each stops after the agreed step and exits 143 (checked below from the wrapper's verdict).
    stops = re.findall(r"stopped \((SIGTERM|another rank was asked to stop)\) after step (\d+)", err)
    assert len(stops) == 2 and {int(s) for _, s in stops} == {step}, err[-6000:]
    assert ("SIGTERM", str(step)) in stops, err[-6000:]
    assert "rmsft torchrun: torchrun exited" in err and "rank 0: 143, rank 1: 143" in err
    resumed = _run(container_command(job))
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert f"resumed from step {step}" in resumed.stderr
    after = _losses(resumed.stderr)
    assert sorted(after) == list(range(step + 1, STEPS + 1))
    assert [after[s] for s in sorted(after)] == pytest.approx([straight[s] for s in sorted(after)], abs=2e-4)

    # The same folder under a job with another seed: rank 0 refuses the checkpoint (another run's lineage), rank 1
    # exits with rank 0's code, and so does the container: 2, where torchrun alone says 1.
    other = write_job(tmp_path / "other.yaml", tiny_model_dir, data_path, ckpt, seed=7)
    refused = _run(container_command(other))
    assert refused.returncode == CONFIG_EXIT, refused.stderr[-6000:]
    assert "belongs to another run" in refused.stderr
    assert "rank 0: 2, rank 1: 2" in refused.stderr
    plain = _run(container_command(other, wrapper=False))
    assert plain.returncode == 1  # what the failure policy saw before: never "a refused configuration"


def test_a_transient_error_on_rank_1_mid_run_exits_retryable_and_the_retry_resumes(
    straight: dict[int, float], tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    """Rank 1 raises EIO building step 5's segments (as a CUDA error or EIO on the claim would): the container exits
    75, which the Job's podFailurePolicy counts and retries; the retry (the same command on the same claim, as the
    Job's next pod runs it) resumes from the periodic checkpoint of step 4 and trains steps 5-12 as the uninterrupted
    run did."""
    ckpt = tmp_path / "ckpt"
    job = write_job(tmp_path / "job.yaml", tiny_model_dir, data_path, ckpt)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["training"]["checkpoint"]["every"] = 2
    job.write_text(yaml.safe_dump(doc))
    proc = _run(container_command(job), **{FAIL_AT_ENV: "step:5@1"})
    err = re.sub(r"\s+", " ", proc.stderr)
    assert proc.returncode == RETRY_EXIT, proc.stderr[-6000:]
    assert "injected fault at step:5" in err
    assert "learner rank 1 failed while building training segments" in err  # rank 0's message names rank 1
    assert "rank 0: 75, rank 1: 75" in err
    assert sorted(_losses(proc.stderr)) == [1, 2, 3, 4]
    assert [p.name for p in list_checkpoints(ckpt)][-1] == "step-4"

    retry = _run(container_command(job))  # attempt 2: the fault was transient
    assert retry.returncode == 0, retry.stderr[-6000:]
    assert "resumed from step 4" in retry.stderr
    after = _losses(retry.stderr)
    assert sorted(after) == list(range(5, STEPS + 1))
    assert [after[s] for s in sorted(after)] == pytest.approx([straight[s] for s in sorted(after)], abs=2e-4)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) for a PID namespace")
def test_rmsft_train_as_pid_1_stops_on_sigterm_while_it_loads(
    tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    """PID 1 of a PID namespace gets no default action for a signal it has no handler for: without the handler on
    `rmsft train`'s first line a SIGTERM while torch imports and the model loads was ignored (the kubelet's SIGKILL
    came at the end of the grace period)."""
    if subprocess.run(["unshare", "-Urpf", "true"], capture_output=True).returncode != 0:
        pytest.skip("unprivileged user and PID namespaces are not allowed here")
    job = write_job(tmp_path / "job.yaml", tiny_model_dir, data_path, tmp_path / "ckpt")
    proc = subprocess.Popen(
        ["unshare", "-Urpf", "--kill-child", sys.executable, "-m", "rmsft_cli", "train", "--config", str(job)],
        cwd=ROOT,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)  # in its imports or the model's load: before any step
    child = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert child, "the namespace's PID 1 did not start"
    t0 = time.monotonic()
    os.kill(int(child[0]), signal.SIGTERM)  # from outside the namespace, as the runtime signals a container
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30, "SIGTERM was ignored: the run went on"
    assert proc.returncode == STOPPED_EXIT, err[-4000:]
    assert "before the first step: nothing new to save" in err
    assert not STEP_LINE.search(err)


ZERO2_FULL = {"deepspeed_stage": 2, "finetune": "full"}
PARTITION_STEPS = 4  # resumed at 2: steps 3 and 4 both step from the restored partitions


def test_zero2_full_each_rank_writes_and_reads_its_own_partition(
    tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    """Issue 60 item 5: two ranks under ZeRO-2 with `finetune: full`. Each rank's `rank-<r>.pt` holds its own
    optimizer partition only (the two fp32 master partitions are halves that together are the saved model);
    stopped after 2 steps and resumed, the run's losses equal an uninterrupted one's (a rank that loaded another's
    partition steps the wrong master weights from step 3 on)."""
    import torch

    pytest.importorskip("deepspeed")
    steps = {"steps": PARTITION_STEPS, "warm_start_steps": PARTITION_STEPS}
    straight = _run(
        container_command(
            write_job(
                tmp_path / "straight.yaml", tiny_model_dir, data_path, tmp_path / "straight", **ZERO2_FULL, **steps
            )
        )
    )
    assert straight.returncode == 0, straight.stderr[-6000:]
    want = _losses(straight.stderr)
    assert sorted(want) == list(range(1, PARTITION_STEPS + 1)), straight.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    first = _run(
        container_command(
            write_job(
                tmp_path / "a.yaml",
                tiny_model_dir,
                data_path,
                ckpt,
                **ZERO2_FULL,
                steps=2,
                warm_start_steps=PARTITION_STEPS,
            )
        )
    )
    assert first.returncode == 0, first.stderr[-6000:]
    folder = ckpt / "step-2"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["rank-0.pt", "rank-1.pt", "state.pt"]
    state = torch.load(folder / "state.pt", weights_only=False)
    assert "zero_optimizer" not in str(list(state)) and state["optimizer"] is None  # no partition in rank 0's file
    parts = [torch.load(folder / f"rank-{r}.pt", weights_only=False)["zero_optimizer"] for r in (0, 1)]
    masters = [torch.cat([t.reshape(-1) for t in p["single_partition_of_fp32_groups"]]) for p in parts]
    whole = torch.cat([v.float().reshape(-1) for v in state["model"].values()])
    assert masters[0].numel() + masters[1].numel() == whole.numel()  # each rank holds half, not the whole
    assert abs(masters[0].numel() - masters[1].numel()) <= 2 * len(state["model"])  # halves, up to alignment
    assert torch.equal(torch.cat(masters), whole)  # rank 0's half, then rank 1's: the model at step 2
    moments = [
        sum(
            v.numel()
            for s in p["base_optimizer_state"]["state"].values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        for p in parts
    ]
    assert moments == [2 * m.numel() for m in masters]  # Adam's two moments, of its own half only

    resumed = _run(
        container_command(write_job(tmp_path / "b.yaml", tiny_model_dir, data_path, ckpt, **ZERO2_FULL, **steps))
    )
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "resumed from step 2" in resumed.stderr
    after = _losses(resumed.stderr)
    assert sorted(after) == [3, 4], resumed.stderr[-3000:]
    assert [after[s] for s in (3, 4)] == pytest.approx([want[3], want[4]], abs=2e-4)
