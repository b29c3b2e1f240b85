"""Rollouts generated ahead of training, under a fenced staleness bound (`spec.training.rollout.max_staleness`).

`RolloutsAhead` is a bounded prefetcher around one callable, `generate(requests, sampling, weight_version) ->
list[Rollout]` (rank 0's `RolloutClient.generate`, or any other rollout source with that shape). The training loop asks
it for an E-step's rollouts with `take`, then `submit`s the next E-steps' requests; those generate on a background
thread while the learner trains.

The rules, all of them deterministic (a resumed or repeated run makes the same calls with the same seeds):

- **Admission.** At most `max_staleness` E-steps are submitted ahead and not yet taken (`submit` refuses more), so
  rank 0 holds at most `max_staleness` batches of completions besides the one training: prompts_per_step x n
  completions of at most `max_tokens` ids (plus as many float log-probs for GRPO) each; prompts' images stay in
  the dataset's cache, not here.
- **Version at submission.** A batch is generated with the weight version current when it was submitted, fenced
  exactly by the client (every completion of the call carries that version; none mixes versions).
- **Sync policy: drain, then apply.** Before the learner changes the servers' weights (`drain`, called by the
  trainer's sync), every submitted call is waited for. So no Generate call is ever in flight across a weight
  update, the client's fence stays exact per call, and the pool's version advances only once the servers that
  apply it have confirmed (`WeightSyncClient.sync`). The cost: a sync waits for the batch generating ahead; with
  generation time G and a step of T the step takes max(G, T) + sync instead of G + T.
- **In flight instead (`rollout.inflight`).** The loop's sync does not drain: the servers pause the running call's
  requests, apply and resume them (rollout_svc/runner.py), so a completion of that call may span two versions
  (`Rollout.version_spans`); it is still reported under the version it was submitted (fenced) with, its oldest
  tokens', which is the version `take` counts its staleness by. The rest of this doc holds as written.
- **Staleness window.** `take` computes staleness = learner version - the batch's version. Within
  `max_staleness` it is trained on; beyond it (e.g. an extra sync for a held-out evaluation moved the version
  twice) the whole batch is dropped (counted in rmsft_learner_stale_rollouts_dropped_total) and regenerated now
  with the same requests, hence the same per-prompt seeds, at the current version (staleness 0).
- **Re-syncs while training.** Once a batch was taken the learner's weights move (optimizer steps) although the
  pool still serves the last synced version; a server that needs a re-sync in that window (a restarted one) would
  be handed weights that are no version at all. `fenced_resync` refuses such re-syncs until the next sync; the
  client then takes that server out of the call (its chunks go to the others) and the next sync brings it back.
- **Every call is owned.** A batch that will never be taken (`take` moved past it, `restore` replaced it) is
  cancelled when it has not started, else waited for, so "nothing generates while weights change" holds for
  abandoned calls too; `pending` tells whether any call still runs. `close` cancels what has not started, asks
  the running call to stop (`abort`, e.g. closing the client's channels) and waits for it, so the client and the
  pool are never closed under a call.
- **Checkpoints.** `saved` returns the batches ahead that are complete, with their lag (versions behind the
  learner), without waiting for one still generating (the overlap goes on across a checkpoint); `restore` puts
  them back after a resume relative to the version the resumed run announces for the checkpoint's weights, so the
  resumed run trains on exactly the rollouts the uninterrupted one would have. A batch still generating when the
  checkpoint was written is not in it: a resumed run generates it when it is due (same requests, same seeds, at
  the resumed run's version). The training loop's checkpoints follow its syncs, which drain, so that only happens to a
  checkpoint between syncs (`buffer.m_steps` > 1).

`max_staleness` 0 is the synchronous loop: nothing is submitted ahead, `take` generates inline at the current
version, and the metrics below are kept all the same.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from learner.rollouts.client import Rollout, RolloutRequest
from learner.tracking import metrics as m

__all__ = ["GenerateFn", "RolloutsAhead", "ResyncRefusedError", "Taken"]

log = logging.getLogger("rmsft.learner")

GenerateFn = Callable[[Sequence[RolloutRequest], Any, int], list[Rollout]]


class ResyncRefusedError(RuntimeError):
    """A server re-sync asked for while the learner's weights are between versions (see the module doc)."""


@dataclass
class Taken:
    """An E-step's rollouts as `take` hands them out."""

    rollouts: list[Rollout]
    version: int  # the learner version (this run's numbering) they were generated with
    staleness: int  # learner version at `take` minus `version`
    waited_s: float  # learner time spent in `take` (waiting for the pool, or generating now); `drain` adds its own
    dropped: int = 0  # completions generated ahead, dropped as too stale, and regenerated here


@dataclass
class _Batch:
    key: int
    version: int
    future: Future


@dataclass
class AheadStats:
    """Totals since start (also exported as Prometheus metrics)."""

    waited_s: float = 0.0  # in `take` and in `drain`: all the learner's waiting on the pool
    pool_idle_s: float = 0.0
    dropped: int = 0
    staleness: list[int] = field(default_factory=list)  # per taken batch


class RolloutsAhead:
    """The bounded prefetcher (module doc). One background thread: submitted batches generate one after the
    other, in submission order. Not for concurrent use by several learner threads."""

    def __init__(
        self,
        generate: GenerateFn,
        max_staleness: int,
        *,
        abort: Callable[[], None] | None = None,
        close_timeout_s: float = 60.0,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._generate = generate
        self.max_staleness = max_staleness
        # Makes a running `generate` call return soon (it may raise); `close` calls it. None: close waits.
        self.abort = abort
        self._close_timeout_s = close_timeout_s
        self._ahead: dict[int, _Batch] = {}
        self._calls: set[Future] = set()  # every call submitted and not finished, taken, dropped or abandoned
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollouts-ahead") if max_staleness else None
        self._lock = threading.Lock()
        self._busy = 0
        self._last_end: float | None = None
        self._weights_moved = False
        self.stats = AheadStats()

    # -- the loop's calls -----------------------------------------------------------------------
    def take(self, key: int, requests: Sequence[RolloutRequest], sampling: Any, version: int) -> Taken:
        """E-step `key`'s rollouts: the batch submitted ahead when it is within the window, else generated now at
        `version` from `requests` (the same requests, so the same seeds, as the batch submitted for it)."""
        t0 = time.perf_counter()
        made_at, dropped = version, 0
        # Batches for E-steps before this one will never be taken (a loop that moved on, e.g. resumed elsewhere):
        # they must not hold admission slots.
        passed = [self._ahead.pop(k).future for k in sorted(self._ahead) if k < key]
        self._abandon(passed)
        dropped += sum(len(f.result()) for f in passed if not f.cancelled() and f.exception() is None)
        batch = self._ahead.pop(key, None)
        rollouts: list[Rollout] | None = None
        if batch is not None:
            rollouts = batch.future.result()  # a failure here fails the step, exactly as an inline call would
            made_at = batch.version
            if not 0 <= version - made_at <= self.max_staleness:
                dropped += len(rollouts)
                log.info(
                    "dropping E-step %d's %d rollout(s) of weight version %d (learner at %d, max_staleness "
                    "%d); regenerating them now",
                    key,
                    dropped,
                    made_at,
                    version,
                    self.max_staleness,
                )
                rollouts, made_at = None, version
        if rollouts is None:
            # One generate call at a time: the client is not made for concurrent calls (its executors are remade
            # when the server list grows), so a call still running ahead finishes first.
            self._settle()
            rollouts = self._timed(requests, sampling, version)
        waited = time.perf_counter() - t0
        staleness = version - made_at
        self._weights_moved = True  # the caller trains on them next: its weights leave `version`
        s = self.stats
        s.waited_s += waited
        s.dropped += dropped
        s.staleness.append(staleness)
        m.ROLLOUT_WAIT_SECONDS.inc(waited)
        m.ROLLOUT_STALENESS.observe(staleness)
        if dropped:
            m.STALE_ROLLOUTS_DROPPED.inc(dropped)
        return Taken(rollouts, made_at, staleness, waited, dropped)

    def submit(self, key: int, requests: Sequence[RolloutRequest], sampling: Any, version: int) -> bool:
        """Start generating E-step `key` at `version` in the background. False (nothing started) when it is
        already ahead or when `max_staleness` batches are; with max_staleness 0 nothing ever is."""
        if key in self._ahead or len(self._ahead) >= self.max_staleness or self._executor is None:
            return False
        fut = self._executor.submit(self._timed, requests, sampling, version)
        with self._lock:
            self._calls.add(fut)
        fut.add_done_callback(self._finished)
        self._ahead[key] = _Batch(key, version, fut)
        return True

    def pending(self) -> bool:
        """Whether any call submitted ahead still runs or waits to (abandoned ones included)."""
        with self._lock:
            return any(not f.done() for f in self._calls)

    def ahead(self) -> list[int]:
        """The E-steps submitted and not yet taken, in order."""
        return sorted(self._ahead)

    def drain(self) -> None:
        """Wait for every submitted call (the sync policy: nothing generates while weights change). A failed
        call is kept as it is: `take` raises its error, or a checkpoint leaves it out (regenerated on resume)."""
        if not self.pending():
            return
        t0 = time.perf_counter()
        self._settle()
        # Time the learner spends here is waiting for rollouts too (the pool still generating when it wants to sync).
        waited = time.perf_counter() - t0
        self.stats.waited_s += waited
        m.ROLLOUT_WAIT_SECONDS.inc(waited)

    def _settle(self) -> None:
        """Wait for every call submitted, abandoned ones included (their errors are `take`'s to raise)."""
        with self._lock:
            calls = list(self._calls)
        for fut in calls:
            with contextlib.suppress(Exception, CancelledError):  # surfaced by `take`
                fut.result()

    def _finished(self, fut: Future) -> None:
        with self._lock:
            self._calls.discard(fut)

    def _abandon(self, futures: Sequence[Future]) -> None:
        """Calls whose batches will never be taken: cancelled when not started, else waited for (one call at a
        time on the client, and no call across a sync). All cancelled first, so that none starts meanwhile."""
        running = [f for f in futures if not f.cancel()]
        for fut in running:
            with contextlib.suppress(Exception, CancelledError):
                fut.result()

    def synced(self) -> None:
        """The servers hold the learner's weights again (after a sync): re-syncs are safe."""
        self._weights_moved = False

    def fenced_resync(self, resync: Callable[[Any], None]) -> Callable[[Any], None]:
        """`resync` (the client's callback), refused while the learner's weights are between versions."""

        def guarded(server: Any) -> None:
            if self._weights_moved:
                raise ResyncRefusedError(
                    "the learner is training past the pool's weight version (rollouts ahead): "
                    "this server is brought up by the next weight sync"
                )
            resync(server)

        return guarded

    # -- checkpoints ----------------------------------------------------------------------------
    def saved(self, version: int) -> list[dict[str, Any]]:
        """The complete batches ahead, for a checkpoint: key, lag (versions behind `version`), rollouts. Nothing is
        waited for: a batch still generating goes on (and is taken as usual) but is not in the checkpoint, nor
        is one whose call failed; a resumed run generates those when they are due (same requests, same seeds)."""
        out = []
        for b in (self._ahead[k] for k in sorted(self._ahead)):
            if b.future.done() and not b.future.cancelled() and b.future.exception() is None:
                out.append({"key": b.key, "lag": version - b.version, "rollouts": b.future.result()})
        return out

    def restore(self, saved: Sequence[dict[str, Any]], version: int) -> None:
        """Put a checkpoint's batches back, `lag` versions behind `version` (the version under which the resumed
        run serves the checkpoint's weights)."""
        self._abandon([b.future for b in self._ahead.values()])
        self._ahead.clear()
        for item in list(saved)[: self.max_staleness]:
            fut: Future = Future()
            fut.set_result(list(item["rollouts"]))
            self._ahead[int(item["key"])] = _Batch(int(item["key"]), version - int(item["lag"]), fut)

    def close(self) -> None:
        """Stop the background thread before the client it calls is closed: calls not started are cancelled, a
        running one is asked to stop (`abort`) and waited for (at most `close_timeout_s`, then logged)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            if self.pending() and self.abort is not None:
                self.abort()
            with self._lock:
                calls = [f for f in self._calls if not f.done()]
            _, running = wait(calls, timeout=self._close_timeout_s)
            if running:
                log.warning(
                    "closing the rollouts-ahead prefetcher: a generate call still runs after %.0fs",
                    self._close_timeout_s,
                )
        self._ahead.clear()

    # -- internals ------------------------------------------------------------------------------
    def _timed(self, requests: Sequence[RolloutRequest], sampling: Any, version: int) -> list[Rollout]:
        """One generate call, with the pool's idle time before it accounted."""
        with self._lock:
            now = time.perf_counter()
            if self._busy == 0 and self._last_end is not None:
                idle = now - self._last_end
                self.stats.pool_idle_s += idle
                m.POOL_IDLE_SECONDS.inc(idle)
            self._busy += 1
        try:
            return self._generate(requests, sampling, version)
        finally:
            with self._lock:
                self._busy -= 1
                if self._busy == 0:
                    self._last_end = time.perf_counter()
