"""The gate between Generate calls and weight applies.

Generate calls run concurrently: each is handed to the engine as soon as it is admitted, and an engine
with `submit` (vLLM's asynchronous engine) adds its requests to the batch already running (continuous
batching). A weight apply (`call`) is exclusive: it closes the gate to new calls, waits for the calls
already running to finish (drain), runs alone, and opens the gate again. So a completion is produced by
exactly one weight version, and every answer carries the version that produced it. A weight version is
the pair (run id, number) of `rmsft.weight_wire.WeightVersion`, held as one value (`weights`) and
replaced only by an apply, so no reader ever sees one half of an update's version with the other
half of the previous one.

Drain, not abort: the learner syncs between steps, when its own rollouts are done, so what still runs at
an apply is a call whose answer is still valid for the version it was admitted under; aborting it would
throw away finished work and force a retry. A call whose client gave up (deadline passed, connection
gone) is aborted in the engine (`cancel`), so a straggler cannot hold an apply for longer than the
learner's own deadline. (An engine without `submit`, the HF debugging backend, cannot abort a call that
already runs: cancelling drops only calls still queued for its single thread.)

In flight, not drained (`call(fn, keep=True)`, an update whose header asks `keep_generating`): with rollouts
generated ahead, the call still running at a sync is the next step's batch, and draining makes the sync wait
for its longest answer. An engine that can pause its requests where they are (vLLM's `pause_generation(mode=
"keep")`: `pause_keep` / `resume`) is paused instead; the gate still holds new calls back, `fn` applies, and
the paused requests resume on the new weights. Such an engine labels its weights (`label_weights`), so every
answer says which version sampled which of its tokens (`GenOutput.version_spans`); the version a call returns
stays the one it was admitted under: its answers' oldest tokens are never older. An engine that cannot is
drained as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, cast

from rmsft.weight_wire import FRESH, WeightVersion, mismatch_message
from rollout_engine import metrics
from rollout_engine.engine import BatchingEngine, Engine, GenItem, GenOutput, InFlightEngine

log = logging.getLogger(__name__)


class VersionMismatch(Exception):
    """A call fenced to a weight version the server does not hold (another number, or another run's)."""

    def __init__(self, expected: WeightVersion, actual: WeightVersion):
        super().__init__(mismatch_message(expected, actual))
        self.expected, self.actual = expected, actual


class RunnerStopped(RuntimeError):
    """The server is shutting down: the call was refused or its running requests were aborted."""


class Cancelled(RuntimeError):
    """The caller went away (deadline passed, connection closed): its requests were aborted in the engine."""


class EngineRunner:
    def __init__(self, engine: Engine, weights: WeightVersion = FRESH):
        self.engine = engine
        # The weight version served: set only by an apply (inside `call`), both halves at once.
        self.weights = weights
        self.active_adapter = ""
        self._cv = threading.Condition()
        self._running: set[Future] = set()  # engine work of admitted Generate calls
        self._applying = 0  # weight applies waiting for, or holding, the gate
        self._waiting = 0  # Generate calls held at the gate by an apply
        self._apply_mutex = threading.Lock()  # one apply at a time
        self._stopped = False
        self.keeping = False  # inside `call(fn, keep=True)`: running requests are paused, not drained
        self._kept_from: WeightVersion | None = None  # the version the last apply replaced, when it was in flight
        # An engine without `submit` (the HF backend) is not thread-safe: one call at a time, in arrival order.
        self._serial = None if hasattr(engine, "submit") else ThreadPoolExecutor(1, thread_name_prefix="rmsft-engine")

    @property
    def version(self) -> int:
        """The number of the weight version served (its run: `weights.run_id`)."""
        return self.weights.number

    # Generate ------------------------------------------------------------------------------------
    def generate(
        self,
        items: list[GenItem],
        expected_version: WeightVersion | None,
        on_cancel: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> tuple[list[GenOutput], WeightVersion]:
        """Run `items` under one weight version and return (outputs, that version). `expected_version`: refuse
        (VersionMismatch) unless that is the version served. `on_cancel(fn)` registers `fn` to be called when
        the caller goes away (grpc's `context.add_callback`); it aborts the requests."""
        with self._cv:
            metrics.QUEUE_DEPTH.inc()
            self._waiting += 1
            try:
                while self._applying and not self._stopped:  # an apply waits: no new work until it is done
                    self._cv.wait()
            finally:
                self._waiting -= 1
                metrics.QUEUE_DEPTH.dec()
            if self._stopped:
                raise RunnerStopped("server shutting down")
            version = self.weights
            # Checked here as well as on arrival: a weight update may have landed while this call waited.
            if expected_version is not None and not self.accepts(expected_version):
                raise VersionMismatch(expected_version, version)
            if expected_version is not None:
                version = expected_version  # the previous version, after an in-flight apply: see `accepts`
            fut = self._submit(items)
            self._running.add(fut)
            metrics.INFLIGHT.set(len(self._running))
        try:
            # grpc's add_callback answers False when the RPC already ended (its deadline passed while this call
            # waited at the gate): then nobody waits for the answer, so abort at once.
            if on_cancel is not None and on_cancel(fut.cancel) is False:
                fut.cancel()
            return fut.result(), version
        except CancelledError:
            raise (
                RunnerStopped("server shutting down: the call's requests were aborted")
                if self._stopped
                else Cancelled("the call was cancelled: its requests were aborted")
            ) from None
        finally:
            with self._cv:
                self._running.discard(fut)
                metrics.INFLIGHT.set(len(self._running))
                self._cv.notify_all()

    def accepts(self, expected: WeightVersion) -> bool:
        """Whether a call fenced to `expected` may run: the version served, or the one an in-flight apply just
        replaced (until the next apply). A call of the learner's batch ahead that reached the gate while that apply
        ran is then generated by the new weights and still reported under the version it was fenced to: never
        newer than its tokens', which is what the learner's staleness bound needs (its sibling calls, paused and
        resumed, are the same). After a drained apply only the version served is."""
        return expected == self.weights or (self._kept_from is not None and expected == self._kept_from)

    def _submit(self, items: list[GenItem]) -> Future:
        if self._serial is None:  # the engine has `submit` (__init__)
            return cast(BatchingEngine, self.engine).submit(items)
        return self._serial.submit(self.engine.generate, items)

    # Weight applies ------------------------------------------------------------------------------
    @property
    def can_keep(self) -> bool:
        """Whether the engine can apply under paused running requests (`call(fn, keep=True)` without a drain)."""
        return hasattr(self.engine, "pause_keep") and hasattr(self.engine, "resume")

    def call(self, fn: Callable[[], Any], keep: bool = False) -> Any:
        """Run `fn` with no Generate call running: close the gate, drain the running calls, run, reopen. With
        `keep` and an engine that `can_keep`: close the gate, pause the running calls' requests in the engine,
        run, resume them, reopen (module doc); `fn` gets to know through `keeping`.

        `fn` runs without the condition's lock held (calls arriving meanwhile wait at the gate, `_applying`), so
        `stop` can always proceed, even when `fn` hangs on a dying engine."""
        keep = keep and self.can_keep
        with self._apply_mutex:
            with self._cv:
                if self._stopped:
                    raise RunnerStopped("server shutting down")
                self._applying += 1
                try:
                    while self._running and not self._stopped and not keep:
                        self._cv.wait()
                    if self._stopped:
                        raise RunnerStopped("server shutting down")
                except BaseException:
                    self._applying -= 1
                    self._cv.notify_all()
                    raise
            before = self.weights
            try:
                if not keep:
                    self._kept_from = None
                    return fn()
                kept = self.running_calls
                cast(InFlightEngine, self.engine).pause_keep()  # `keep` is asked of such an engine only
                self.keeping = True
                try:
                    out = fn()
                    self._kept_from = before if self.weights != before else self._kept_from
                    return out
                finally:
                    self.keeping = False
                    self._resume()
                    metrics.INFLIGHT_UPDATES.inc()
                    metrics.KEPT_CALLS.inc(kept)
            finally:
                with self._cv:
                    self._applying -= 1
                    self._cv.notify_all()

    def _resume(self) -> None:
        """After an in-flight apply: the paused requests go on (a dead engine has nothing to resume; its calls
        fail on their own, and the server exits)."""
        try:
            cast(InFlightEngine, self.engine).resume()
        except Exception:
            dead = getattr(self.engine, "dead_reason", lambda: "")()
            if not dead:
                raise
            log.warning("not resuming generation after the weight update: %s", dead)

    # Shutdown ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Refuse new work and abort what runs (each aborted call fails with RunnerStopped)."""
        with self._cv:
            self._stopped = True
            running = list(self._running)
            self._cv.notify_all()
        for fut in running:
            fut.cancel()
        if self._serial is not None:
            self._serial.shutdown(wait=False, cancel_futures=True)

    @property
    def running_calls(self) -> int:
        with self._cv:
            return len(self._running)

    @property
    def applies(self) -> int:
        """Weight applies waiting for the gate or holding it (what tests and status wait on, not sleeps)."""
        with self._cv:
            return self._applying

    @property
    def waiting_calls(self) -> int:
        """Generate calls that arrived while an apply held or waited for the gate, still held there."""
        with self._cv:
            return self._waiting
