"""One thread owns the engine. Concurrent Generate calls queue here and are merged into one
engine call (vLLM batches them together); weight applies run alone between batches, so a batch
never sees half-applied weights and every answer carries the version that produced it."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollout_svc import metrics
from rollout_svc.engine import Engine, EngineInputError, GenItem, GenOutput

log = logging.getLogger(__name__)


class VersionMismatch(Exception):
    def __init__(self, expected: int, actual: int):
        super().__init__(f"expected weight version {expected}, server has {actual}")
        self.expected, self.actual = expected, actual


@dataclass
class _GenJob:
    items: list[GenItem]
    expected_version: int | None
    future: Future = field(default_factory=Future)


@dataclass
class _CallJob:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


class EngineRunner:
    def __init__(self, engine: Engine, max_batch_prompts: int = 1024, version: int = 0):
        self.engine = engine
        self.max_batch_prompts = max_batch_prompts
        self.version = version
        self.active_adapter = ""
        self._jobs: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="rmsft-engine", daemon=True)
        self._thread.start()

    def generate(self, items: list[GenItem], expected_version: int | None) -> tuple[list[GenOutput], int]:
        job = _GenJob(items, expected_version)
        self._put(job)
        return job.future.result()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread with no generate in flight."""
        job = _CallJob(fn)
        self._put(job)
        return job.future.result()

    def _put(self, job) -> None:
        with self._cv:
            if self._stop:
                raise RuntimeError("engine runner stopped")
            self._jobs.append(job)
            metrics.QUEUE_DEPTH.set(sum(isinstance(j, _GenJob) for j in self._jobs))
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _take(self) -> list | None:
        with self._cv:
            while not self._jobs and not self._stop:
                self._cv.wait()
            if self._stop:
                pending, self._jobs = list(self._jobs), deque()
                for j in pending:
                    j.future.set_exception(RuntimeError("server shutting down"))
                return None
            first = self._jobs.popleft()
            batch = [first]
            if isinstance(first, _GenJob):
                n = len(first.items)
                while (self._jobs and isinstance(self._jobs[0], _GenJob)
                       and n + len(self._jobs[0].items) <= self.max_batch_prompts):
                    job = self._jobs.popleft()
                    n += len(job.items)
                    batch.append(job)
            metrics.QUEUE_DEPTH.set(sum(isinstance(j, _GenJob) for j in self._jobs))
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if isinstance(batch[0], _CallJob):
                job = batch[0]
                try:
                    job.future.set_result(job.fn())
                except BaseException as e:  # delivered to the caller
                    job.future.set_exception(e)
                continue
            self._run_generate(batch)

    def _run_generate(self, batch: list[_GenJob]) -> None:
        version = self.version
        runnable = []
        for job in batch:
            # Checked here as well as on arrival: a weight update may have landed in between.
            if job.expected_version is not None and job.expected_version != version:
                job.future.set_exception(VersionMismatch(job.expected_version, version))
            else:
                runnable.append(job)
        if not runnable:
            return
        items = [it for job in runnable for it in job.items]
        metrics.INFLIGHT.set(len(runnable))
        try:
            outs = self.engine.generate(items)
        except EngineInputError as e:
            if len(runnable) > 1:  # one call's bad prompt must not fail the calls merged with it
                for job in runnable:
                    self._run_generate([job])
                return
            runnable[0].future.set_exception(e)
            return
        except BaseException as e:
            for job in runnable:
                job.future.set_exception(e)
            return
        finally:
            metrics.INFLIGHT.set(0)
        pos = 0
        for job in runnable:
            job.future.set_result((outs[pos : pos + len(job.items)], version))
            pos += len(job.items)
