"""Colocate with a sleeping engine: the order of wake, weight push, offload and sleep. The push reads the training
parameters, so it must run where they are whole and on the device: inside the trainer's sync (its ZeRO-3 gather)
and never inside the offload context. vLLM's sleep mode is CUDA's, so the engine here is a recorder."""

from __future__ import annotations

import contextlib

import pytest

from learner.rollouts.colocate.engine import EngineError, InProcessVllm
from learner.rollouts.colocate.groups import TpGroup
from learner.rollouts.colocate.rollouts import ColocatedRollouts
from learner.rollouts.requests import RolloutRequest


class _Engine:
    backend = "vllm"

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def sleep(self, level: int) -> None:
        self.events.append(f"sleep{level}")

    def wake_up(self) -> None:
        self.events.append("wake")


def _source(level: int, events: list[str], monkeypatch: pytest.MonkeyPatch) -> ColocatedRollouts:
    @contextlib.contextmanager
    def offloaded():
        events.append("offload")
        yield
        events.append("restore")

    src = ColocatedRollouts(
        _Engine(events),
        model=None,
        run_id="run-a",
        group=TpGroup(1, 0, 1),
        sleep_level=level,
        around_generation=offloaded,
    )
    monkeypatch.setattr(src, "_push", lambda: events.append("push"))
    monkeypatch.setattr(src, "_call", lambda reqs, sp, n: events.append("generate") or [])
    return src


@pytest.mark.parametrize("level", [1, 2])
def test_a_sync_while_asleep_pushes_at_once_awake(level: int, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    src = _source(level, events, monkeypatch)
    assert events == [f"sleep{level}"]  # asleep from the start: the memory goes to training
    events.clear()
    src.sync(1)
    # Woken, written, asleep again: within the sync (the trainer's gather), not deferred to generation time.
    assert events == ["wake", "push", f"sleep{level}"]


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        (1, ["wake", "offload", "generate", "restore", "sleep1"]),
        # Level 2 dropped the weights: they go back before the training state leaves the device.
        (2, ["wake", "push", "offload", "generate", "restore", "sleep2"]),
    ],
)
def test_generation_wakes_and_writes_before_the_offload(
    level: int, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    src = _source(level, events, monkeypatch)
    src.sync(1)
    events.clear()
    src.generate([RolloutRequest(token_ids=[1, 2], request_id="r")], {"max_tokens": 4}, weight_version=1)
    assert events == expected


def test_a_vision_model_without_cache_resets_is_refused() -> None:
    class _Llm:
        def reset_prefix_cache(self) -> bool:
            return True

        llm_engine = object()

    engine = object.__new__(InProcessVllm)
    engine.llm, engine.vision = _Llm(), object()
    with pytest.raises(EngineError, match="vision features cached under the old weights"):
        engine.reset_caches()
