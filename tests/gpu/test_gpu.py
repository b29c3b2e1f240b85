"""What only a GPU can show, ready for the day one is lent: bf16 packed loss = unpacked on CUDA, a
ZeRO-2 two-rank step on NCCL, and a FULL export read from CUDA. Skipped, saying why, without CUDA
(everything else about placement is proven on the CPU: tests/learner/test_placement.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


def _policy(tiny_model_dir: Path, **training):
    from learner.train.policy import load_policy
    from rmsft.jobspec import TrainingConfig

    cfg = TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, **training})
    return load_policy(tiny_model_dir, cfg), cfg


def _segments(vocab, n: int = 4, length: int = 48):
    from learner.core.targets import IGNORE_INDEX, Segment

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 500, (length,), generator=g).tolist()
        cpos = (length - 4, length - 2)
        bins = (17, 900)
        for p, b in zip(cpos, bins, strict=True):
            ids[p] = vocab.coord_token_ids[b]
        labels = [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]
        out.append(Segment(tuple(ids), tuple(labels), cpos, bins, prompt_len=length // 2, prefix_len=0))
    return out


def test_bf16_packed_loss_equals_unpacked_on_cuda(tiny_model_dir: Path) -> None:
    from learner.core.losses import compute_loss
    from learner.core.packing import pack

    policy, _ = _policy(tiny_model_dir, precision="bf16")
    model = policy.model.to("cuda")
    segs = _segments(policy.vocab)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    with torch.no_grad(), autocast:
        row = pack(segs).to("cuda")
        packed = compute_loss(model(**row.model_inputs()).logits, row, policy.vocab.coord_token_ids).loss
        alone = []
        for s in segs:
            r = pack([s]).to("cuda")
            alone.append(compute_loss(model(**r.model_inputs()).logits, r, policy.vocab.coord_token_ids))
    # token-level mean of the whole row vs the count-weighted mean of the segments
    ce = sum(o.parts["ce"] * o.parts["ce_count"].to("cuda") for o in alone) / sum(o.parts["ce_count"] for o in alone)
    assert packed.device.type == "cuda"
    assert float(packed) == pytest.approx(float(ce + sum(o.parts["coord"] for o in alone) / len(alone)), rel=3e-2)


def test_full_export_reads_from_cuda_and_leaves_no_copy(tiny_model_dir: Path) -> None:
    from learner.sync.weights import full_named_tensors

    policy, _ = _policy(tiny_model_dir, finetune="lora")
    model = policy.model.to("cuda")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    names = [name for name, _ in full_named_tensors(model, dtype=torch.bfloat16)]
    torch.cuda.synchronize()
    assert names and torch.cuda.memory_allocated() - base < 1 << 20  # nothing kept on the device
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for a two-rank NCCL step")
def test_zero2_two_ranks_on_nccl(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two torchrun ranks, each on its own GPU (training.device auto = cuda:LOCAL_RANK), ZeRO-2 over
    NCCL, against a fake rollout server: the run completes and both ranks hold the same weights."""
    pytest.importorskip("deepspeed")
    import yaml

    sys.path.insert(0, str(ROOT / "tests/learner"))
    from learner_fakes import FakeEngine, FakeServer
    from trainer_fixtures import make_job

    from rmsft_dev.synthetic import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "train.jsonl", n=8, seed=0)
    job = make_job(tiny_model_dir, data, tmp_path / "ckpt", steps=2, deepspeed_stage=2, precision="bf16")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.to_manifest()))
    server = FakeServer(FakeEngine())
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(ROOT / "tests/learner/multirank_worker.py"),
                str(job_file),
                server.address,
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    p0, p1 = (torch.load(tmp_path / f"params-rank{r}.pt") for r in (0, 1))
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
