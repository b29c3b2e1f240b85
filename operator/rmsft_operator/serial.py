"""At most one reconcile pass per job at a time.

Child events arrive in bursts (a StatefulSet and a Job change together, each pod going Ready is
an event). Passes for one job run one after another; a child event that arrives while a pass is
running is folded into a single extra pass after it, so no event is lost and no two passes race
on the same job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class PerKeyRunner:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy: set[Hashable] = set()
        self._again: set[Hashable] = set()

    def run(self, key: Hashable, fn: Callable[[int], T], wait: bool) -> T | None:
        """Run `fn(pass_index)` for `key`. With `wait=False` and a pass already running, ask that
        pass to run once more and return None instead of waiting."""
        with self._cond:
            while key in self._busy:
                if not wait:
                    self._again.add(key)
                    return None
                self._cond.wait()
            self._busy.add(key)
        index = 0
        try:
            while True:
                result = fn(index)
                index += 1
                with self._cond:
                    if key in self._again:
                        self._again.discard(key)
                        continue
                    self._release(key)
                    return result
        except BaseException:
            with self._cond:
                self._release(key)
            raise

    def _release(self, key: Hashable) -> None:
        self._busy.discard(key)
        self._cond.notify_all()
