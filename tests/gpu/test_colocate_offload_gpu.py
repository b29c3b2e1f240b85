"""The offload context on CUDA (learner/train/offload.py): what the CPU cannot show. During the block the
training state's device memory is handed back (torch.cuda.memory_allocated drops by what moved), the host
copies are pinned, and afterwards everything is back on the GPU, bit for bit, in the same objects; the same for
ZeRO-2 through DeepSpeed's offload_states. Skipped, saying why, without CUDA (the plan, the exactness and the
exception paths are proven on the CPU: tests/learner/test_colocate_offload.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


def _model(tiny_model_dir: Path) -> torch.nn.Module:
    from learner.train.policy import load_policy
    from rmsft.jobspec import TrainingConfig

    cfg = TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, "finetune": "full"})
    return load_policy(tiny_model_dir, cfg).model


def _one_step(step: Any) -> None:
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(0)).to(step.device)
    step.begin()
    step.backward(step.forward(input_ids=ids, labels=ids).loss)
    step.finish(1, 1e-3)


def _snapshot(model: torch.nn.Module, step: Any) -> dict[str, torch.Tensor]:
    out = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    out |= {n + ".grad": p.grad.cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt = getattr(step, "optimizer", None)
    if opt is not None and not hasattr(step, "ds_engine"):
        out |= {f"opt{i}.{k}": v.cpu().clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        bits = a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)
        assert a[k].dtype == b[k].dtype and torch.equal(*bits), k


def test_plain_step_offload_frees_the_gpu_and_comes_back_bit_for_bit(tiny_model_dir: Path) -> None:
    from learner.train.offload import offloaded
    from learner.train.ranks import Ranks
    from learner.train.updater import PlainUpdater

    device = torch.device("cuda", 0)
    model = _model(tiny_model_dir).to(device)
    step = PlainUpdater(model, Ranks.single(), lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, device=device)
    _one_step(step)
    objects = [id(p) for p in model.parameters()]
    before = _snapshot(model, step)
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated(device)
    with offloaded(step, model, params=True, optimizer=True) as report:
        during = torch.cuda.memory_allocated(device)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert all(p.is_pinned() and p.grad.is_pinned() for p in model.parameters() if p.grad is not None)
        assert all(v.device.type == "cpu" for st in step.optimizer.state.values() for v in st.values())
        # every byte that moved left the GPU (the allocator's count; a little slack for its rounding)
        assert resident - during >= report.total_bytes * 0.99, (resident, during, report)
        assert report.freed_bytes == resident - during
        scratch = torch.empty(report.total_bytes // 4, device=device)  # the engine can have that memory
        del scratch
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) == resident
    assert {p.device for p in model.parameters()} == {device} and [id(p) for p in model.parameters()] == objects
    _same(before, _snapshot(model, step))
    _one_step(step)  # and training goes on on the GPU


def test_zero2_offload_through_deepspeed_frees_the_gpu(tiny_model_dir: Path) -> None:
    pytest.importorskip("deepspeed")
    from learner.train.offload import offloaded
    from learner.train.ranks import Ranks
    from learner.train.updater import ZeroUpdater

    model = _model(tiny_model_dir)
    step = ZeroUpdater(
        model, Ranks.single(), stage=2, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, device=torch.device("cuda", 0)
    )
    try:
        _one_step(step)
        before = _snapshot(model, step)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated(step.device)
        with offloaded(step, model, params=True, optimizer=True) as report:
            assert report.via == "deepspeed" and report.freed_bytes is not None
            weights = sum(p.numel() * 4 for p in model.parameters())
            # fp32 weights + fp32 master partition + Adam's two moments, at least
            assert resident - torch.cuda.memory_allocated(step.device) >= 3 * weights, report
        torch.cuda.synchronize()
        assert {p.device for p in model.parameters()} == {step.device}
        # back to about what it was (DeepSpeed may rebuild a buffer or two in its own sizes)
        assert abs(torch.cuda.memory_allocated(step.device) - resident) <= resident // 20
        _same(before, _snapshot(model, step))
        _one_step(step)
    finally:
        step.close()
