"""One producer, several consumers: a weight stream encoded once and fed to every server's
UpdateWeights call, with bounded memory.

Encoding (copy to bytes + sha256) costs as much CPU as sending, so encoding once per sync instead of
once per server keeps a sync to S servers about as cheap as a sync to one. Each consumer has a
bounded queue, so memory stays at `depth` frames per server; a slow server slows the producer (the
sync is only done when every server acknowledged anyway), and a consumer that goes away (its RPC
failed) is dropped so it can never block the others.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Fanout:
    """`Fanout(source, n).consumer(i)` yields every item of `source`, for i in range(n)."""

    def __init__(self, source: Iterable[Any], n: int, depth: int = 4) -> None:
        self._source = source
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=depth) for _ in range(n)]
        self._closed = [threading.Event() for _ in range(n)]
        self._thread = threading.Thread(target=self._produce, name="weight-fanout", daemon=True)
        self._started = False
        self._lock = threading.Lock()
        self.error: BaseException | None = None  # what broke the source, if anything

    def _put(self, i: int, item: Any) -> None:
        q, closed = self._queues[i], self._closed[i]
        while not closed.is_set():
            try:
                q.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _produce(self) -> None:
        try:
            for item in self._source:
                if all(c.is_set() for c in self._closed):
                    return
                for i in range(len(self._queues)):
                    self._put(i, item)
        except BaseException as e:  # handed to every consumer: their RPCs fail with it
            self.error = e
            for i in range(len(self._queues)):
                self._put(i, _Failed(e))
            return
        for i in range(len(self._queues)):
            self._put(i, _END)

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def consumer(self, i: int) -> Iterator[Any]:
        self._start()
        try:
            q, closed = self._queues[i], self._closed[i]
            while True:
                try:
                    item = q.get(timeout=0.05)
                except queue.Empty:
                    if closed.is_set():  # closed from outside (its call failed): nothing more comes
                        return
                    continue
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise RuntimeError(f"weight stream encoder failed: {item.error}") from item.error
                yield item
        finally:
            self.close(i)

    def close(self, i: int) -> None:
        """Consumer `i` is gone (finished, or its call failed): stop feeding it."""
        self._closed[i].set()
        q = self._queues[i]
        while True:  # free its frames now
            try:
                q.get_nowait()
            except queue.Empty:
                break
