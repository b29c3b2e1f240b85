"""GPU placement of `rmsft local`: the planner's table, and `rmsft local` on simulated GPU machines
(torch.cuda patched, servers and learner replaced by fakes: no GPU, no vLLM, nothing started)."""

from __future__ import annotations

import copy
import io
import itertools
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from learner import local
from learner.gpu_assignment import CUDA_ENV, GpuAssignmentError, assign_gpus
from rmsft.jobspec import parse_job

ROOT = Path(__file__).resolve().parents[2]
GPU_JOB = yaml.safe_load((ROOT / "configs" / "job.yaml").read_text())  # 6 servers x TP 1 + a 2-GPU learner
CPU_JOB = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())


def gpu_doc(replicas: int = 6, tp: int = 1, learner: int = 2, device: str = "auto") -> dict:
    doc = copy.deepcopy(GPU_JOB)
    doc["spec"]["placement"]["gpusPerNode"] = 64  # the spec's node budget is not what is tested here
    doc["spec"]["rollout"].update(replicas=replicas, tensorParallelSize=tp)
    doc["spec"]["learner"]["gpus"] = learner
    doc["spec"]["training"]["device"] = device
    return doc


def gpu_job(replicas: int = 6, tp: int = 1, learner: int = 2, device: str = "auto"):
    return parse_job(gpu_doc(replicas, tp, learner, device))


# -- the planner ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("replicas", "tp", "learner", "available", "visible", "servers", "learner_env"),
    [
        (6, 1, 2, 8, None, ["0", "1", "2", "3", "4", "5"], "6,7"),  # configs/job.yaml
        (2, 2, 1, 8, None, ["0,1", "2,3"], "4"),
        (3, 2, 2, 8, None, ["0,1", "2,3", "4,5"], "6,7"),
        (1, 4, 4, 8, None, ["0,1,2,3"], "4,5,6,7"),
        (2, 1, 0, 4, None, ["0", "1"], ""),
        (2, 1, 2, 4, "4,5,6,7", ["4", "5"], "6,7"),  # the user's CUDA_VISIBLE_DEVICES, mapped back
        (1, 2, 1, 3, "7, 2,5", ["7,2"], "5"),
        (1, 1, 1, 2, "GPU-aaaa,GPU-bbbb", ["GPU-aaaa"], "GPU-bbbb"),  # UUIDs pass through as given
        (1, 1, 1, 2, "3,1,-1,0", ["3"], "1"),  # CUDA stops at the invalid entry: 2 devices visible
    ],
)
def test_plan_table(
    replicas: int, tp: int, learner: int, available: int, visible: str | None, servers: list[str], learner_env: str
) -> None:
    plan = assign_gpus(gpu_job(replicas, tp, learner), available, visible_devices=visible)
    assert plan.accelerated
    assert [plan.server_env(i)[CUDA_ENV] for i in range(replicas)] == servers
    assert plan.learner_env()[CUDA_ENV] == learner_env
    assert len(plan.learner) == learner


def test_every_fitting_plan_gives_disjoint_contiguous_gpus() -> None:
    for replicas, tp, learner, available in itertools.product(range(1, 5), (1, 2, 4), range(0, 4), (1, 4, 8, 16)):
        job = gpu_job(replicas, tp, learner)
        needed = replicas * tp + learner
        if needed > available:
            with pytest.raises(GpuAssignmentError, match=f"= {needed} GPUs needed, this machine has {available}"):
                assign_gpus(job, available)
            continue
        plan = assign_gpus(job, available)
        used = [k for g in plan.servers for k in g] + list(plan.learner)
        assert len(used) == len(set(used)) == needed and all(0 <= k < available for k in used)
        assert all(len(g) == tp and list(g) == list(range(g[0], g[0] + tp)) for g in plan.servers)


@pytest.mark.parametrize(
    ("replicas", "tp", "learner", "available", "visible", "message"),
    [
        (
            6,
            1,
            2,
            4,
            None,
            "spec.rollout.replicas 6 x spec.rollout.tensorParallelSize 1 + spec.learner.gpus 2 "
            "= 8 GPUs needed, this machine has 4",
        ),
        (
            3,
            2,
            1,
            6,
            None,
            "spec.rollout.replicas 3 x spec.rollout.tensorParallelSize 2 + spec.learner.gpus 1 "
            "= 7 GPUs needed, this machine has 6",
        ),
        (2, 1, 1, 2, "0,3", "= 3 GPUs needed, this machine has 2 visible (CUDA_VISIBLE_DEVICES=0,3)"),
        (
            2,
            1,
            1,
            0,
            None,
            "the job asks for GPUs (spec.placement.accelerator nvidia: spec.rollout.replicas 2 x "
            "spec.rollout.tensorParallelSize 1 + spec.learner.gpus 1 = 3 GPUs needed), but this "
            "machine has none; to run on CPUs set spec.placement.accelerator: none",
        ),
        (1, 1, 0, 0, "", "this machine has none (CUDA_VISIBLE_DEVICES='')"),
        (1, 1, 1, 2, "0", "CUDA_VISIBLE_DEVICES='0' names 1 device(s) but CUDA sees 2"),
    ],
)
def test_too_few_gpus_names_the_keys_and_numbers(
    replicas: int, tp: int, learner: int, available: int, visible: str | None, message: str
) -> None:
    with pytest.raises(GpuAssignmentError) as err:
        assign_gpus(gpu_job(replicas, tp, learner), available, visible_devices=visible)
    assert message in str(err.value)


def test_cpu_job_on_cpu_and_gpu_machines() -> None:
    job = parse_job(CPU_JOB)  # accelerator: none, learner.gpus 0
    cpu = assign_gpus(job, 0)
    assert not cpu.accelerated and cpu.server_env(0) == cpu.server_env(1) == {} and cpu.learner_device("auto") == "cpu"
    assert cpu.describe() == "on CPUs"
    gpu = assign_gpus(job, 8)  # GPUs hidden from the servers, as a CPU pod on a cluster sees none
    assert not gpu.accelerated and gpu.server_env(1) == {CUDA_ENV: ""} and gpu.learner_device("auto") == "cpu"
    with pytest.raises(GpuAssignmentError, match="spec.training.device cuda:0 asks for a GPU, but spec.placement.acc"):
        gpu.learner_device("cuda:0")
    with pytest.raises(
        GpuAssignmentError, match="spec.training.device cuda asks for a GPU, but this machine has no GPU"
    ):
        cpu.learner_device("cuda")


def test_a_learner_laid_out_for_a_clusters_pods_is_refused_by_rmsft_local() -> None:
    """Issue 45's learner.nodes and ranksPerPod describe a cluster's learner pods; `rmsft local` says so before
    anything starts instead of running something else than asked."""
    doc = copy.deepcopy(CPU_JOB)
    doc["spec"]["learner"].update(nodes=2, checkpointClaim="ck")
    doc["spec"]["sync"] = {**doc["spec"].get("sync", {}), "transport": "grpc"}
    with pytest.raises(GpuAssignmentError, match=r"spec.learner.nodes \(2\) spreads the learner over pods"):
        assign_gpus(parse_job(doc), 0)
    doc = copy.deepcopy(CPU_JOB)
    doc["spec"]["learner"]["ranksPerPod"] = 2
    with pytest.raises(GpuAssignmentError, match=r"spec.learner.ranksPerPod \(2\) runs several CPU ranks"):
        assign_gpus(parse_job(doc), 0)


@pytest.mark.parametrize(
    ("learner", "requested", "expected"),
    [
        (1, "auto", "cuda:6"),
        (1, "cuda", "cuda:6"),  # the learner's own GPU 0, as in its pod
        (1, "cuda:0", "cuda:6"),
        (1, "cpu", "cpu"),
        (0, "auto", "cpu"),  # not torch's auto: that would be cuda:0, rollout-0's GPU
        (2, "auto", "auto"),  # torchrun ranks: cuda:LOCAL_RANK among the learner's GPUs
        (2, "cpu", "cpu"),
        (1, "cuda:1", "spec.training.device cuda:1 is the learner's GPU 1, but spec.learner.gpus is 1"),
        (0, "cuda:0", "spec.training.device cuda:0 asks for a GPU, but spec.learner.gpus is 0"),
        (2, "cuda:0", "spec.training.device cuda:0 would put all 2 learner ranks (spec.learner.gpus) on one GPU"),
    ],
)
def test_learner_device(learner: int, requested: str, expected: str) -> None:
    plan = assign_gpus(gpu_job(6, 1, learner), 8)
    if expected.startswith("spec."):
        with pytest.raises(GpuAssignmentError, match=re.escape(expected)):
            plan.learner_device(requested)
    else:
        assert plan.learner_device(requested) == expected


# -- rmsft local on a simulated machine ---------------------------------------------------------
class FakeServer:
    def __init__(self, n: int, env: dict[str, str], options: dict) -> None:
        self.address, self.token, self.env, self.options = f"127.0.0.1:{5000 + n}", "s3cret", env, options
        self.metrics_port = 6000 + n  # printed by `rmsft local` as where to scrape it
        self.stopped = False

    def wait_healthy(self, timeout: float, cancel: object = None) -> None:
        pass

    def stop(self, timeout: float = 30.0) -> None:
        self.stopped = True

    def kill(self) -> None:
        self.stopped = True


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """A simulated machine: `machine(n, visible)` makes torch report n GPUs; records every server
    start, in-process learner and learner subprocess instead of running them."""
    from rollout_svc.launcher import RolloutServer

    calls: dict[str, list] = {"servers": [], "in_process": [], "torchrun": []}

    def fake_start(model, *, env, replica_ordinal, log_path, **options):
        srv = FakeServer(replica_ordinal, env, options)
        calls["servers"].append(srv)
        return srv

    def fake_build(job, addresses, *, auth_token, resume):
        calls.setdefault("built", []).append(job.spec.training.device)
        return f"learner on {job.spec.training.device}"

    def fake_in_process(job, addresses, *, auth_token, resume, console, loop=None):
        # The learner was built before the servers were awaited (rmsft local overlaps the two), and is this one.
        assert loop == f"learner on {job.spec.training.device}"
        calls["in_process"].append({"device": job.spec.training.device, "addresses": addresses, "token": auth_token})

    def fake_process(cmd, env, log_path, console):
        calls["torchrun"].append({"cmd": cmd, "env": env, "log": log_path})
        return calls.get("rc", 0)

    monkeypatch.setattr(RolloutServer, "spawn", staticmethod(fake_start))
    monkeypatch.setattr(local, "local_learner", fake_build)
    monkeypatch.setattr(local, "train_in_process", fake_in_process)
    monkeypatch.setattr(local, "run_learner_process", fake_process)
    # The simulated machine has no model folder: what these tests check is where every process runs.
    monkeypatch.setattr(local, "check_model", lambda path, fmt: f"{path} (not read: a simulated machine)")

    def make(n: int, visible: str | None = None) -> dict[str, list]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        if visible is None:
            monkeypatch.delenv(CUDA_ENV, raising=False)
        else:
            monkeypatch.setenv(CUDA_ENV, visible)
        return calls

    return make


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _quiet() -> Console:
    return Console(file=open(os.devnull, "w"))


def test_local_on_8_gpus_gives_every_process_its_own(machine, tmp_path: Path) -> None:
    calls = machine(8)
    job_path = _write(tmp_path, gpu_doc(6, 1, 2))  # configs/job.yaml's shape
    assert local.run_local(job_path, work_dir=tmp_path / "w", console=_quiet()) is None
    servers = calls["servers"]
    assert sorted(s.env[CUDA_ENV] for s in servers) == ["0", "1", "2", "3", "4", "5"]
    assert all(s.options["gpu_memory_utilization"] == 0.85 for s in servers)  # GPU serve options
    assert all(s.stopped for s in servers)
    assert not calls["in_process"]
    (run,) = calls["torchrun"]
    cmd = run["cmd"]
    assert cmd[1:-1] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "rmsft_cli",
        "train",
        "--config",
        str(job_path),
        "--servers",
        ",".join(f"127.0.0.1:{5000 + i}" for i in range(6)),
        "--no-resume",
        "--metrics-port",
    ]
    assert int(cmd[-1]) > 0  # rank 0's /metrics on a free port (`rmsft local --metrics-port`), never 9090
    assert run["env"][CUDA_ENV] == "6,7" and run["env"]["RMSFT_AUTH_TOKEN"] == "s3cret"
    assert "s3cret" not in cmd
    assert run["log"] == tmp_path / "w" / "logs" / "learner.log"
    used = [k for s in servers for k in s.env[CUDA_ENV].split(",")] + run["env"][CUDA_ENV].split(",")
    assert len(used) == len(set(used)) == 8


def test_local_one_learner_gpu_trains_in_process_on_it(machine, tmp_path: Path) -> None:
    calls = machine(8)
    local.run_local(_write(tmp_path, gpu_doc(3, 2, 1)), work_dir=tmp_path, console=_quiet())
    assert sorted(s.env[CUDA_ENV] for s in calls["servers"]) == ["0,1", "2,3", "4,5"]
    assert all(s.options["tensor_parallel_size"] == 2 for s in calls["servers"])
    assert calls["in_process"] == [
        {"device": "cuda:6", "addresses": [f"127.0.0.1:{5000 + i}" for i in range(3)], "token": "s3cret"}
    ]
    assert not calls["torchrun"]


def test_local_maps_the_users_visible_devices(machine, tmp_path: Path) -> None:
    calls = machine(4, visible="1,3,5,7")
    local.run_local(_write(tmp_path, gpu_doc(3, 1, 1)), work_dir=tmp_path, console=_quiet())
    assert sorted(s.env[CUDA_ENV] for s in calls["servers"]) == ["1", "3", "5"]
    # In-process the learner indexes this process's visible devices: the 4th is the user's 7.
    assert calls["in_process"][0]["device"] == "cuda:3"


def test_local_cpu_job(machine, tmp_path: Path) -> None:
    doc = copy.deepcopy(CPU_JOB)
    doc["metadata"].pop("annotations")  # nothing to build
    calls = machine(0)
    local.run_local(_write(tmp_path, doc), work_dir=tmp_path, console=_quiet())
    assert [CUDA_ENV in s.env for s in calls["servers"]] == [False, False]
    assert all(s.options["gpu_memory_utilization"] is None for s in calls["servers"])  # CPU serve options
    assert calls["in_process"][0]["device"] == "cpu"


def test_local_refuses_a_job_bigger_than_the_machine_before_starting_anything(machine, tmp_path: Path) -> None:
    calls = machine(4)
    job_path = _write(tmp_path, gpu_doc(6, 1, 2))
    message = (
        "spec.rollout.replicas 6 x spec.rollout.tensorParallelSize 1 + spec.learner.gpus 2 = 8 GPUs "
        "needed, this machine has 4"
    )
    with pytest.raises(GpuAssignmentError) as err:
        local.run_local(job_path, work_dir=tmp_path / "w", console=_quiet())
    assert str(err.value) == message
    assert calls == {"servers": [], "in_process": [], "torchrun": []}
    assert not (tmp_path / "w").exists()

    from rmsft_cli.app import app

    res = CliRunner().invoke(app, ["local", str(job_path), "--work-dir", str(tmp_path / "w")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"error: {message}" in " ".join(res.output.split())
    assert calls["servers"] == []


def test_local_reports_a_failed_torchrun_learner_and_stops_the_servers(machine, tmp_path: Path) -> None:
    calls = machine(8)
    calls["rc"] = 3
    out = io.StringIO()
    with pytest.raises(local.LearnerExitError) as err:
        local.run_local(_write(tmp_path, gpu_doc(6, 1, 2)), work_dir=tmp_path, console=Console(file=out, width=300))
    assert err.value.code == 3 and "the learner (2 torchrun ranks) exited with 3" in str(err.value)
    assert f"error: {err.value}" in out.getvalue()  # said on the console: SystemExit(3) prints nothing
    assert all(s.stopped for s in calls["servers"]) and len(calls["servers"]) == 6


def test_learner_process_output_is_streamed_and_logged(tmp_path: Path) -> None:
    out = io.StringIO()
    cmd = [sys.executable, "-c", "import os, sys; print('rank line', os.environ['X']); sys.exit(4)"]
    rc = local.run_learner_process(cmd, {"X": "42"}, tmp_path / "logs" / "learner.log", Console(file=out))
    assert rc == 4
    assert "rank line 42" in out.getvalue()
    assert (tmp_path / "logs" / "learner.log").read_text() == "rank line 42\n"
