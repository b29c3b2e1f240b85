"""Rollout buffer: one E-step (rollout + match + targets), `m_steps` M-steps (optimizer steps).

Public API
- `RolloutBuffer(m_steps)`: `.get(raw_batch, build)` returns the built batch for this step,
  calling `build(raw_batch)` (the E-step) on the first of every `m_steps` steps and reusing the
  result otherwise. The loop hands it the same raw batch for each of an E-step's `m_steps` steps (the
  training loop's `order.batch(step // m_steps)`); it checks the batch equals the one it was built from, so
  a loop that pulls a new batch every step fails loudly instead of silently skipping data.
- `m_steps = 1` is the default: a fresh E-step every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

R = TypeVar("R")
B = TypeVar("B")


class RolloutBufferError(RuntimeError):
    pass


def _check_m_steps(m_steps: int) -> int:
    if not isinstance(m_steps, int) or m_steps < 1:
        raise ValueError(f"m_steps must be an integer >= 1, got {m_steps!r}")
    return m_steps


def _same_batch(a: object, b: object) -> bool:
    """Identity or equality; batches whose `==` is not a plain bool (tensors) pass unchecked."""
    if a is b:
        return True
    try:
        eq = a == b
    except Exception:
        return True
    return eq if isinstance(eq, bool) else True


class RolloutBuffer(Generic[R, B]):
    def __init__(self, m_steps: int = 1) -> None:
        self.m_steps = _check_m_steps(m_steps)
        self._raw: R | None = None
        self._built: B | None = None
        self._uses = 0
        self.e_steps = 0

    @property
    def uses_left(self) -> int:
        return 0 if self._built is None else self.m_steps - self._uses

    def get(self, raw_batch: R, build: Callable[[R], B]) -> B:
        if self._built is None or self._uses >= self.m_steps:
            built = build(raw_batch)  # on failure the old state stays untouched
            self._raw, self._built, self._uses = raw_batch, built, 0
            self.e_steps += 1
        elif not _same_batch(raw_batch, self._raw):
            raise RolloutBufferError(
                f"raw batch changed after {self._uses} of {self.m_steps} M-steps: hand the same batch to each of "
                "an E-step's m_steps optimizer steps (batch index = step // m_steps)"
            )
        self._uses += 1
        return self._built  # type: ignore[return-value]
