"""Rollout buffer: one E-step (rollout + match + targets), `m_steps` M-steps (optimizer steps).

Public API
- `RepeatingLoader(loader, m_steps)`: yields every raw batch of `loader` `m_steps` times in a row
  (`len` = len(loader) * m_steps), so a training loop that pulls one raw batch per optimizer step
  neither skips nor duplicates samples across an epoch when it reuses built batches.
- `RolloutBuffer(m_steps)`: `.get(raw_batch, build)` returns the built batch for this step,
  calling `build(raw_batch)` (the E-step) on the first of every `m_steps` steps and reusing the
  result otherwise. It checks the raw batch equals the one it was built from (a loop that pulls from
  the plain loader instead of `RepeatingLoader` fails loudly instead of silently skipping data;
  an equal batch rebuilt by index, e.g. `order.batch(step // m_steps)`, is fine).
- `m_steps = 1` is the default: a fresh E-step every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
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


class RepeatingLoader(Generic[R]):
    def __init__(self, loader: Iterable[R], m_steps: int = 1) -> None:
        self.loader = loader
        self.m_steps = _check_m_steps(m_steps)

    def __iter__(self) -> Iterator[R]:
        for raw in self.loader:
            for _ in range(self.m_steps):
                yield raw

    def __len__(self) -> int:
        return len(self.loader) * self.m_steps  # type: ignore[arg-type]


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
                f"raw batch changed after {self._uses} of {self.m_steps} M-steps: wrap the data loader "
                "in RepeatingLoader(loader, m_steps) so each raw batch is pulled m_steps times"
            )
        self._uses += 1
        return self._built  # type: ignore[return-value]
