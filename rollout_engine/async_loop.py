"""Driving an asyncio engine from grpc's threads: a loop on a thread of its own, and the Future of one call's work
on it, whose cancellation completes only once the work has really stopped."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future


class EngineCall(Future):
    """The Future of one call's engine work. `cancel()` asks the loop to cancel the call's task, and the Future
    counts as cancelled only once the task has sent its aborts to the engine: a weight apply that waited for this
    call (EngineRunner's drain) then reaches the engine after the aborts, never beside live requests."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self._task: asyncio.Task | None = None
        self._cancel_asked = False

    def start(self, coro) -> None:
        """On the loop: run `coro`, settling this Future from its outcome."""
        if self._cancel_asked:
            coro.close()
            super().cancel()
            return
        self._task = self._loop.create_task(coro)
        self._task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Task) -> None:
        if task.cancelled():
            super().cancel()
        elif task.exception() is not None:
            self.set_exception(task.exception())
        else:
            self.set_result(task.result())

    def cancel(self) -> bool:
        if self.done():
            return False

        def ask() -> None:
            self._cancel_asked = True
            if self._task is not None:
                self._task.cancel()

        self._loop.call_soon_threadsafe(ask)
        return True


class EventLoopThread:
    """An asyncio loop on a daemon thread; `run` hands it a coroutine from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rmsft-vllm-loop", daemon=True)
        self._thread.start()

    def run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, coro, timeout: float | None = None):
        return self.run(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
