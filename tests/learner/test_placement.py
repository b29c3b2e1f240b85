"""Device placement proven without a GPU: a whole training step (rows, losses, backward, clipping,
AdamW) with the policy's parameters on the `meta` device, under a dispatch mode that records every
op given a tensor that is not on the training device. On a GPU that would be a device-mismatch
crash, or silent work on the CPU; here it is a test failure naming the op."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_fakes import FakeEngine, FakeServer, chat_renderer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trainer_fixtures import make_job

# Explicit moves: where a tensor is *put* on the device (PackedRow.to, Module.to).
_MOVES = {"aten._to_copy.default", "aten.copy_.default", "aten.lift_fresh.default"}


class DeviceFence(TorchDispatchMode):
    """Records ops whose tensor inputs are off `device` (0-dim CPU tensors are scalars, allowed on
    any device by torch itself, so they are allowed here too).

    Host reads (`.item()`, `bool(t)`) of a meta tensor have no value to return. The step makes one
    per forward, in transformers' own mask code ("is this row packed?", answered False: it is), and
    none of its own; each is counted, so a test can say how many it allows."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.violations: list[str] = []
        self.host_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if str(func) == "aten._local_scalar_dense.default" and args[0].device.type == "meta":
            self.host_reads += 1
            return False
        if str(func) not in _MOVES:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.device != self.device and t.dim() > 0:
                    self.violations.append(f"{func}: a {t.device} tensor of shape {tuple(t.shape)}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rmsft_dev.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n=8, seed=0)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[FakeServer]:
    s = FakeServer(FakeEngine(render=chat_renderer(str(tiny_model_dir))))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def step_inputs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, data_path: Path, server: FakeServer
) -> tuple[Any, list[float]]:
    """Real packed rows of one step (built on the CPU by a CPU trainer) and the step's loss denominators."""
    from learner.train.build import build_loop

    job = make_job(tiny_model_dir, data_path, tmp_path_factory.mktemp("ck"), steps=1)
    trainer = build_loop(job, [server.address])
    seen: list[tuple[Any, list[float]]] = []
    real = trainer.device_step

    def spy(built: Any, totals: list[float], lr: float) -> dict[str, torch.Tensor]:
        seen.append((built, list(totals)))
        return real(built, totals, lr)

    trainer.device_step = spy  # type: ignore[method-assign]
    try:
        trainer.run()
    finally:
        trainer.close()
    built, totals = seen[0]
    assert built.rows and all(r.input_ids.device.type == "cpu" for r in built.rows) and totals[0] > 0
    return built, totals


def _meta_trainer(tmp_path: Path, tiny_model_dir: Path, data_path: Path, server: FakeServer, **training: Any):
    from learner.train.build import build_loop

    return build_loop(make_job(tiny_model_dir, data_path, tmp_path, **training), [server.address], device="meta")


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_whole_step_runs_on_the_training_device(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, server: FakeServer, step_inputs: Any, finetune: str
) -> None:
    built, totals = step_inputs
    rows = built.rows
    trainer = _meta_trainer(tmp_path, tiny_model_dir, data_path, server, finetune=finetune)
    try:
        assert trainer.device == torch.device("meta")
        assert {p.device.type for p in trainer.model.parameters()} == {"meta"}
        fence = DeviceFence("meta")
        with fence:
            sums = trainer.device_step(built, totals, lr=1e-3)
        assert fence.violations == [], "\n".join(fence.violations[:20])
        assert fence.host_reads == len(rows)  # transformers' packed-mask check, once per forward
        assert {k: v.device.type for k, v in sums.items()} == dict.fromkeys(sums, "meta")
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None and p.grad.device.type == "meta" for p in trained)
        state = trainer.updater.optimizer.state
        assert state and all(v.device.type == "meta" for s in state.values() for v in s.values() if v.dim())
        # ...and the FULL export reads the weights where they are (merges included), in the serving dtype
        from learner.sync.weights import full_export

        with fence:
            exported = [(n, t.device.type, t.dtype) for n, t in full_export(trainer.model, dtype=torch.bfloat16)]
        assert fence.violations == [], "\n".join(fence.violations[:20])
        assert exported and {(d, dt) for _, d, dt in exported} == {("meta", torch.bfloat16)}
    finally:
        trainer.close()


def test_the_fence_catches_a_row_left_on_the_cpu(
    tmp_path: Path,
    tiny_model_dir: Path,
    data_path: Path,
    server: FakeServer,
    step_inputs: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: forget the one `.to(device)` of the rows and the test above would fail."""
    from learner.core.packing import PackedRow

    built, totals = step_inputs
    trainer = _meta_trainer(tmp_path, tiny_model_dir, data_path, server)
    monkeypatch.setattr(PackedRow, "to", lambda self, device: self)
    try:
        fence = DeviceFence("meta")
        crashed = ""
        try:
            with fence:
                trainer.device_step(built, totals, lr=1e-3)
        except RuntimeError as exc:  # what a GPU would do with the same mistake
            crashed = str(exc)
        assert "embedding" in " ".join(fence.violations) and "device" in crashed, (fence.violations[:5], crashed)
    finally:
        trainer.close()


def test_deepspeed_rows_follow_the_engine_device(
    tmp_path: Path, tiny_model_dir: Path, data_path: Path, server: FakeServer, step_inputs: Any
) -> None:
    """ZeRO: DeepSpeed places the module itself (cuda:LOCAL_RANK on GPUs); the step's device is the
    engine's, and every row reaches the engine there."""
    pytest.importorskip("deepspeed")
    from learner.train.build import build_loop

    built, totals = step_inputs
    job = make_job(tiny_model_dir, data_path, tmp_path, deepspeed_stage=2, precision="bf16")
    trainer = build_loop(job, [server.address])
    try:
        engine = trainer.deepspeed_engine
        assert trainer.device == torch.device(engine.device)
        # the matching precision section: DeepSpeed's own mixed precision off, fp32 trainable weights
        assert not engine.bfloat16_enabled() and not engine.fp16_enabled()
        assert {p.dtype for p in engine.module.parameters() if p.requires_grad} == {torch.float32}
        seen: list[torch.device] = []
        real = engine.forward

        def spy(**inputs: Any) -> Any:
            seen.extend(t.device for t in inputs.values() if isinstance(t, torch.Tensor))
            return real(**inputs)

        engine.forward = spy
        trainer.device_step(built, totals, lr=1e-3)
        assert seen and set(seen) == {trainer.device}
        assert {p.device for p in engine.module.parameters()} == {trainer.device}
    finally:
        trainer.close()


def test_auto_device_is_the_ranks_gpu_when_cuda_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from learner.train.updater import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="spec.training.device"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cpu") == torch.device("cpu")
