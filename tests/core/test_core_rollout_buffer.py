"""Rollout buffer: with m_steps = 3, every sample is trained on in exactly 3 optimizer steps."""

from __future__ import annotations

from collections import Counter

import pytest

from learner.core.rollout_buffer import RolloutBuffer, RolloutBufferError


def batches(n_samples: int, batch_size: int) -> list[list[int]]:
    return [list(range(i, min(i + batch_size, n_samples))) for i in range(0, n_samples, batch_size)]


@pytest.mark.parametrize(("n_samples", "batch_size", "m_steps"), [(10, 4, 3), (12, 4, 3), (7, 7, 3), (9, 2, 1)])
def test_each_sample_gets_exactly_m_steps_optimizer_steps(n_samples, batch_size, m_steps):
    loader = batches(n_samples, batch_size)
    buffer: RolloutBuffer[list[int], list[str]] = RolloutBuffer(m_steps)
    e_steps = []
    uses: Counter[int] = Counter()

    def e_step(raw: list[int]) -> list[str]:
        e_steps.append(tuple(raw))
        return [f"target-{i}" for i in raw]

    steps = 0
    for step in range(len(loader) * m_steps):  # as the training loop does: batch index = step // m_steps
        built = buffer.get(loader[step // m_steps], e_step)
        uses.update(int(t.split("-")[1]) for t in built)
        steps += 1
    assert steps == len(loader) * m_steps
    assert e_steps == [tuple(b) for b in loader]  # each raw batch rolled out exactly once, in order
    assert uses == Counter({i: m_steps for i in range(n_samples)})
    assert buffer.e_steps == len(loader)


def test_a_new_batch_every_step_is_caught_instead_of_skipping_samples():
    buffer: RolloutBuffer[list[int], list[int]] = RolloutBuffer(3)
    loader = batches(8, 2)
    buffer.get(loader[0], list)
    with pytest.raises(RolloutBufferError, match="same batch"):
        buffer.get(loader[1], list)


def test_equal_batches_rebuilt_by_index_are_accepted():
    buffer: RolloutBuffer[list[int], int] = RolloutBuffer(3)
    builds = []
    for step in range(6):
        raw = list(range(step // 3 * 2, step // 3 * 2 + 2))  # a fresh but equal list every step
        buffer.get(raw, lambda r: builds.append(tuple(r)) or len(builds))
    assert builds == [(0, 1), (2, 3)]


def test_failed_e_step_keeps_previous_state():
    buffer: RolloutBuffer[str, str] = RolloutBuffer(1)
    assert buffer.get("a", str.upper) == "A"

    def boom(raw: str) -> str:
        raise RuntimeError("rollout failed")

    with pytest.raises(RuntimeError):
        buffer.get("b", boom)
    assert buffer.e_steps == 1
    assert buffer.get("b", str.upper) == "B"


def test_m_steps_validation():
    with pytest.raises(ValueError, match="m_steps"):
        RolloutBuffer(0)
    with pytest.raises(ValueError, match="m_steps"):
        RolloutBuffer(1.5)  # type: ignore[arg-type]
