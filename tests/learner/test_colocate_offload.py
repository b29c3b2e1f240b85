"""The offload context (learner/train/offload.py), proven on the CPU.

- Placement, the way tests/learner/test_placement.py proves it: the training state of a step on the `meta`
  device (the stand-in accelerator) and the plan of moves, which reads no data: every parameter, gradient and
  optimizer-state tensor on the accelerator goes to the host, each once, nothing else. `meta` tensors have no
  values, so the moves themselves cannot run there (and refuse, saying so).
- The moves themselves, with real data: training on the CPU with the context around a stand-in generation
  between steps equals training without it bit for bit (losses, parameters, optimizer state), while during the
  block every moved tensor has new host storage and the old one is freed. The "accelerator" is the CPU too
  here, so this proves identity, exactness and release, not a device change (tests/gpu/ has the CUDA one).
- An exception inside the block, or half-way out, brings everything back.
- ZeRO through DeepSpeed's own offload_states/reload_states, which run on DeepSpeed's CPU accelerator here:
  what that proves is the calls, their states and DeepSpeed re-linking its partitions bit for bit; its copies
  are CPU to CPU (`.to("cpu")` of a CPU tensor is the tensor itself), so the device change is the GPU's to show.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from learner.train import offload
from learner.train.offload import OffloadReport, offload_moves, offloaded


def _policy(tiny_model_dir: Path, **training: Any) -> torch.nn.Module:
    from learner.train.policy import load_policy
    from rmsft.jobspec import TrainingConfig

    cfg = TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, **training})
    return load_policy(tiny_model_dir, cfg).model


def _plain_step(model: torch.nn.Module, device: str = "cpu") -> Any:
    from learner.train.ranks import Ranks
    from learner.train.updater import PlainUpdater

    return PlainUpdater(
        model, Ranks.single(), lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, device=torch.device(device)
    )


def _rows(n: int = 3, length: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 500, (1, length), generator=g) for _ in range(n)]


def _train_step(step: Any, ids: torch.Tensor) -> float:
    """One optimizer step on one row, the way the trainer drives a step strategy."""
    step.begin()
    ids = ids.to(step.device)
    loss = step.forward(input_ids=ids, labels=ids).loss
    step.backward(loss)
    step.finish(1, 1e-2)
    return float(loss.detach())


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state(step: Any, model: torch.nn.Module) -> dict[str, bytes]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = _bits(p)
        if p.grad is not None:
            out[name + ".grad"] = _bits(p.grad)
    for i, st in enumerate(step.optimizer.state.values()):
        for k, v in st.items():
            out[f"opt{i}.{k}"] = _bits(v)
    return out


def _tensors(step: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, gradient and optimizer-state tensor, by name (the objects themselves)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p
        if p.grad is not None:
            out[name + ".grad"] = p.grad
    for i, st in enumerate(step.optimizer.state.values()):
        out |= {f"opt{i}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


def _fake_generation() -> None:
    """What the engine would do meanwhile: its own work, touching no training tensor."""
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    (a @ a).sum()


# -- placement on meta ---------------------------------------------------------------------------------------


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture()
def meta_step(tiny_model_dir: Path) -> tuple[Any, torch.nn.Module]:
    """A LoRA policy on meta after one optimizer step: parameters (frozen base and adapters), the adapters'
    gradients and AdamW's moments all on the stand-in accelerator; AdamW's step counters on the host."""
    model = _policy(tiny_model_dir, finetune="lora").to("meta")
    step = _plain_step(model, "meta")
    step.begin()
    for p in step.params:
        p.grad = torch.zeros_like(p)
    step.optimizer.step()
    return step, model


@pytest.mark.parametrize(("params", "optimizer"), [(True, True), (True, False), (False, True)])
def test_the_plan_sends_every_accelerator_tensor_to_the_host_once(
    meta_step: Any, params: bool, optimizer: bool
) -> None:
    step, model = meta_step
    on_device = {name: t for name, t in _tensors(step, model).items() if t.device.type == "meta"}
    kinds = {
        name: "grad" if name.endswith(".grad") else "optimizer" if name.startswith("opt") else "param"
        for name in on_device
    }
    assert set(kinds.values()) == {"param", "grad", "optimizer"}
    assert any(not p.requires_grad for p in model.parameters())  # the frozen base moves too

    with _OpRecorder() as ops:  # the plan reads no tensor: no op at all runs on the way
        moves = offload_moves(step, model, params=params, optimizer=optimizer)
    assert ops.seen == []
    wanted = {
        id(t)
        for name, t in on_device.items()
        if (kinds[name] != "optimizer" and params) or (kinds[name] == "optimizer" and optimizer)
    }
    planned = [id(mv.tensor) for mv in moves]
    assert len(planned) == len(set(planned)) and set(planned) == wanted  # all of them, each once, nothing else
    assert all(mv.device == torch.device("meta") for mv in moves)
    assert sum(mv.nbytes for mv in moves) == sum(
        t.numel() * t.element_size() for t in on_device.values() if id(t) in wanted
    )
    # the host-side state stays where it is (AdamW's step counters)
    assert all(t.device.type == "cpu" for name, t in _tensors(step, model).items() if name not in on_device)


def test_tied_weights_move_once_and_views_of_one_buffer_are_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head often is: one Parameter
    step = _plain_step(model)
    assert len(offload_moves(step, model, params=True, optimizer=False)) == 1
    flat = torch.zeros(8)
    a, b = torch.nn.Parameter(flat[:4]), torch.nn.Parameter(flat[4:])  # a flat buffer's views (ZeRO-1/2 style)
    views = torch.nn.ParameterList([a, b])
    with pytest.raises(RuntimeError, match="shares its storage"):
        offload_moves(_plain_step(views), views, params=True, optimizer=False)


def test_meta_has_no_data_to_move_and_says_so(meta_step: Any) -> None:
    step, model = meta_step
    with pytest.raises(ValueError, match="meta"), offloaded(step, model, params=True, optimizer=True):
        pass
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_both_flags_off_is_a_no_op(meta_step: Any) -> None:
    step, model = meta_step
    with offloaded(step, model, params=False, optimizer=False) as report:
        assert {p.device.type for p in model.parameters()} == {"meta"}
    assert report == OffloadReport()


# -- real data: bit for bit ----------------------------------------------------------------------------------


def _run(
    tiny_model_dir: Path,
    finetune: str,
    around: Callable[[Any, torch.nn.Module], Any] | None,
) -> tuple[list[float], dict[str, bytes], list[OffloadReport]]:
    torch.manual_seed(0)
    model = _policy(tiny_model_dir, finetune=finetune)
    step = _plain_step(model)
    losses, reports = [], []
    for ids in _rows():
        if around is None:
            _fake_generation()
        else:
            reports.append(around(step, model))
        losses.append(_train_step(step, ids))
    return losses, _state(step, model), reports


@pytest.mark.parametrize("finetune", ["lora", "full"])
@pytest.mark.parametrize(("params", "optimizer"), [(True, True), (True, False), (False, True)])
def test_training_with_offload_around_generation_is_bit_identical(
    tiny_model_dir: Path, finetune: str, params: bool, optimizer: bool
) -> None:
    def around(step: Any, model: torch.nn.Module) -> OffloadReport:
        tensors = _tensors(step, model)
        objects = {name: id(t) for name, t in tensors.items()}
        storages = {name: StorageWeakRef(t.untyped_storage()) for name, t in tensors.items()}
        before = _state(step, model)
        # what must move, named independently of the plan: the training device is the CPU here, so every tensor
        # of the kinds asked for (AdamW's step counters included)
        moved = {id(t) for name, t in tensors.items() if (optimizer if name.startswith("opt") else params)}
        with offloaded(step, model, params=params, optimizer=optimizer) as report:
            # the device copies are gone (nothing else held them), the host ones hold the same bits
            for name, t in tensors.items():
                assert storages[name].expired() == (id(t) in moved), name
                assert t.device.type == "cpu"
            assert _state(step, model) == before
            _fake_generation()
        assert {name: id(t) for name, t in _tensors(step, model).items()} == objects  # the same objects
        assert _state(step, model) == before
        assert all(any(k is p for p in step.params) for k in step.optimizer.state)  # keyed by the same objects
        return report

    plain = _run(tiny_model_dir, finetune, None)
    off = _run(tiny_model_dir, finetune, around)
    assert off[0] == plain[0]  # the losses, exactly
    assert off[1] == plain[1]  # parameters, gradients, optimizer state: bit for bit
    first, later = off[2][0], off[2][1]
    assert later.via == "torch" and later.tensors > 0 and later.freed_bytes is None  # (no CUDA counter here)
    assert (later.moved_bytes["param"] > 0) == params and (later.moved_bytes["optimizer"] > 0) == optimizer
    assert first.moved_bytes["optimizer"] == 0 and first.moved_bytes["grad"] == 0  # before any step: none yet
    assert later.offload_s > 0 and later.reload_s > 0


def test_an_exception_inside_the_block_brings_everything_back(tiny_model_dir: Path) -> None:
    model = _policy(tiny_model_dir, finetune="full")
    step = _plain_step(model)
    _train_step(step, _rows()[0])
    objects = {name: id(t) for name, t in _tensors(step, model).items()}
    before = _state(step, model)
    with pytest.raises(RuntimeError, match="engine died"), offloaded(step, model, params=True, optimizer=True) as r:
        raise RuntimeError("engine died")
    assert r.reload_s > 0
    assert {name: id(t) for name, t in _tensors(step, model).items()} == objects
    assert _state(step, model) == before
    _train_step(step, _rows()[1])  # and training goes on


def test_a_failure_half_way_out_brings_back_what_had_moved(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _policy(tiny_model_dir, finetune="full")
    step = _plain_step(model)
    _train_step(step, _rows()[0])
    tensors = _tensors(step, model)
    storages = {name: StorageWeakRef(t.untyped_storage()) for name, t in tensors.items()}
    before = _state(step, model)
    real, calls = offload._to_host, []

    def flaky(t: torch.Tensor, host: torch.device, pin: bool) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 5:
            raise MemoryError("host memory is full")
        return real(t, host, pin)

    monkeypatch.setattr(offload, "_to_host", flaky)
    with pytest.raises(MemoryError), offloaded(step, model, params=True, optimizer=True):
        pytest.fail("the block must not run when the offload failed")
    assert _state(step, model) == before
    assert sum(s.expired() for s in storages.values()) == 4  # four had moved (and came back), the rest never left


# -- ZeRO through DeepSpeed ----------------------------------------------------------------------------------


def _zero_run(tiny_model_dir: Path, stage: int, flags: tuple[bool, bool] | None) -> tuple[list[float], list[bytes]]:
    pytest.importorskip("deepspeed")
    from learner.train.ranks import Ranks
    from learner.train.updater import ZeroUpdater

    torch.manual_seed(0)
    model = _policy(tiny_model_dir, finetune="full")
    step = ZeroUpdater(
        model, Ranks.single(), stage=stage, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, device=torch.device("cpu")
    )
    try:
        losses = []
        for ids in _rows():
            if flags is None:
                _fake_generation()
            else:
                with offloaded(step, model, params=flags[0], optimizer=flags[1]) as report:
                    assert report.via == "deepspeed"
                    done = step.ds_engine.optimizer.offloaded_states
                    assert {s.value for s in done} >= ({"lp_params"} if flags[0] else set()) | (
                        {"hp_params", "optim_states"} if flags[1] else set()
                    )
                    _fake_generation()
                assert not step.ds_engine.optimizer.offloaded_states
            losses.append(_train_step(step, ids))
        from learner.train.zero import gathered

        with gathered(step.ds_engine, model):
            weights = [_bits(p) for p in model.parameters()]
        return losses, weights
    finally:
        step.close()


@pytest.mark.parametrize(("stage", "flags"), [(2, (True, True)), (3, (True, False))], ids=["zero2", "zero3"])
def test_zero_offload_through_deepspeed_is_bit_identical(
    tiny_model_dir: Path, stage: int, flags: tuple[bool, bool]
) -> None:
    assert _zero_run(tiny_model_dir, stage, flags) == _zero_run(tiny_model_dir, stage, None)


def test_zero3_optimizer_offload_is_refused_and_an_exception_reloads(tiny_model_dir: Path) -> None:
    pytest.importorskip("deepspeed")
    from learner.train.ranks import Ranks
    from learner.train.updater import ZeroUpdater

    model = _policy(tiny_model_dir, finetune="full")
    step = ZeroUpdater(
        model, Ranks.single(), stage=3, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, device=torch.device("cpu")
    )
    try:
        with (
            pytest.raises(RuntimeError, match="offloadOptimizer.*FusedAdam"),
            offloaded(step, model, params=True, optimizer=True),
        ):
            pass
        assert not step.ds_engine.optimizer.offloaded_states
        with pytest.raises(RuntimeError, match="engine died"), offloaded(step, model, params=True, optimizer=False):
            assert step.ds_engine.optimizer.offloaded_states
            raise RuntimeError("engine died")
        assert not step.ds_engine.optimizer.offloaded_states  # reloaded on the way out
        assert _train_step(step, _rows()[0]) > 0  # and training goes on
    finally:
        step.close()
