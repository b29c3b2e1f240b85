"""Ordered, fenced rollouts over the server pool.

`RolloutClient.generate` splits N prompts contiguously over the ordered servers, sends the chunks
concurrently (blocking calls on worker threads), and puts every completion back at its input index. By
default each server gets its whole share in one call (cut only to bound the message size), so its engine
sees every prompt at once; the server's engine batches calls continuously, so more calls in flight join
the same running batch. A chunk
whose server fails is sent again, unchanged (same prompts, same seeds), to the least-loaded healthy
server, so the output never depends on which server answered. Every completion must carry the
learner's current weight version, run id and number (`rmsft.weight_wire.version`): a server that holds
another version (FAILED_PRECONDITION, a wrong version in its reply, or a stale GetStatus), including
another run's weights under the same number, is re-synced through the `resync` callback before it
gets work again, and a stale completion is never returned.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from rmsft_protos import rollout_pb2

from learner.rollouts.pool import NoServerAvailableError, RolloutServer, ServerPool, describe_rpc_error
from learner.rollouts.requests import (
    FINISH_REASONS,
    AllServersDownError,
    Chunk,
    Rollout,
    RolloutError,
    RolloutRequest,
    StaleRolloutError,
    check_versions,
    sampling_params,
    split_into_chunks,
    to_prompt_proto,
)
from learner.tracking.metrics import PHASE_SECONDS, ROLLOUT_REQUESTS, ROLLOUT_RETRIES
from rmsft import pause_points
from rmsft.weight_wire import WeightVersion, set_version, version_of

__all__ = [
    "AllServersDownError",
    "Chunk",
    "NoServerAvailableError",
    "Rollout",
    "RolloutClient",
    "RolloutError",
    "RolloutRequest",
    "StaleRolloutError",
    "check_versions",
    "split_into_chunks",
    "sampling_params",
]

# The request itself is wrong: sending it to another server cannot help.
_FATAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED}
# The server is alive but busy: retry the chunk elsewhere without marking the server down.
_BUSY_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED}


def _message_bytes(prompt: rollout_pb2.Prompt, sampling: rollout_pb2.SamplingParams) -> int:
    """A prompt's share of a Generate call's messages: its request bytes, and a bound on its reply (n completions,
    each echoing the prompt ids and carrying up to max_tokens ids, ~3 bytes each, plus 4-byte log-probs)."""
    n = sampling.n or 1
    per_token = 3 + (5 if sampling.logprobs else 0)
    return prompt.ByteSize() + n * (3 * len(prompt.token_ids) + per_token * sampling.max_tokens + 32)


@dataclass
class _Call:
    """Book-keeping of one `generate` call."""

    expected: WeightVersion | None  # every completion must carry it (None: no fencing)
    sampling: rollout_pb2.SamplingParams
    prompts: list[rollout_pb2.Prompt]
    results: list[Rollout | None]
    queues: dict[int, deque[Chunk]]
    orphans: deque[Chunk] = field(default_factory=deque)
    inflight: dict[int, int] = field(default_factory=dict)  # server index -> running chunks
    resyncing: set[int] = field(default_factory=set)
    resynced: set[int] = field(default_factory=set)
    excluded: dict[int, str] = field(default_factory=dict)  # server index -> why, for this call
    failures: dict[Chunk, list[str]] = field(default_factory=dict)
    accepted: list[tuple[Chunk, RolloutServer, rollout_pb2.GenerateResponse]] = field(default_factory=list)
    stale_refused: int = 0  # completions thrown away because of their weight version
    pending: int = 0  # futures not yet reported


class RolloutClient:
    """Sends rollouts to a `ServerPool`.

    timeout_s: deadline of each Generate call (one chunk); when it passes, the server aborts the call's
    requests. generate_batch_size: most prompts per Generate call (0 = a server's whole share in one call,
    cut only where its prompts pass MAX_CHUNK_BYTES). max_inflight_per_server: Generate calls outstanding
    per server; they all join the server engine's running batch, so the default does not throttle (a user
    who sets a small generate_batch_size still feeds the engine 16 chunks at once). max_attempts: tries per
    chunk before the rollout fails (default: number of servers + 1). resync: called as `resync(server)` to push the
    learner's current weights to a server that holds another version; it must raise on failure.

    Each `generate` first applies a changed server list (`ServerPool.follow`): servers that left get
    no share, new ones are fenced (re-synced through `resync`) before they get any.
    """

    def __init__(
        self,
        pool: ServerPool,
        *,
        timeout_s: float = 600.0,
        generate_batch_size: int = 0,
        max_attempts: int | None = None,
        max_inflight_per_server: int = 16,
        resync: Callable[[RolloutServer], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_inflight_per_server < 1:
            raise ValueError(f"max_inflight_per_server must be >= 1, got {max_inflight_per_server}")
        self.pool = pool
        self.timeout_s = timeout_s
        self.generate_batch_size = generate_batch_size
        self._fixed_attempts = max_attempts
        self.max_inflight = max_inflight_per_server
        self.resync = resync
        self._threads_for = 0  # pool size the executors below were made for
        self._fit_threads()

    @property
    def max_attempts(self) -> int:
        return self._fixed_attempts or len(self.pool.servers) + 1

    def _fit_threads(self) -> None:
        """One re-sync thread and `max_inflight` call threads per server; remade when the pool grew
        (servers file), between calls, when the old executors have no work left."""
        n = max(1, len(self.pool.servers))
        if n <= self._threads_for:
            return
        old = (self._resync_pool, self._call_pool) if self._threads_for else ()
        self._resync_pool: ThreadPoolExecutor = ThreadPoolExecutor(max_workers=n, thread_name_prefix="resync")
        # Blocking calls on worker threads: grpc's `.future()` starts a channel-spin thread per call
        # (about 1 ms each), which is most of the learner's per-call overhead.
        self._call_pool: ThreadPoolExecutor = ThreadPoolExecutor(
            max_workers=n * self.max_inflight, thread_name_prefix="generate"
        )
        self._threads_for = n
        for ex in old:
            ex.shutdown(wait=False)

    def close(self) -> None:
        self._resync_pool.shutdown(wait=False, cancel_futures=True)
        self._call_pool.shutdown(wait=False, cancel_futures=True)

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: rollout_pb2.SamplingParams | Mapping[str, Any] | None = None,
        *,
        weight_version: int | None = None,
    ) -> list[Rollout]:
        """Completions for `requests`, in input order, all produced by weight version `weight_version` of the
        pool's run (default: the pool's current version; when neither is set, no version is enforced). With
        `sampling.n` = k, the k samples of request i are at [i*k, (i+1)*k), in sample order."""
        if not requests:
            return []
        t0 = time.perf_counter()
        self.pool.follow_or_wait(self.timeout_s)
        self._fit_threads()
        current = self.pool.current_version
        if weight_version is not None and current is not None and weight_version != current:
            raise ValueError(
                f"generate(weight_version={weight_version}) but the pool's current version is {current}: "
                "servers are re-synced to the pool's version, so the two must agree"
            )
        number = weight_version if weight_version is not None else current
        expected = None if number is None else self.pool.version(number)
        params = sampling_params(sampling)
        call = _Call(
            expected=expected,
            sampling=params,
            prompts=[to_prompt_proto(r) for r in requests],
            results=[None] * (len(requests) * (params.n or 1)),
            queues={s.index: deque() for s in self.pool.servers},
        )
        self.pool.refresh_due()
        planned = self._initial_servers(call)
        if not planned and self.pool.wait_for_a_server(f"{len(requests)} prompt(s)"):
            call.excluded.clear()
            planned = self._initial_servers(call)
        if not planned:
            raise AllServersDownError(
                f"no rollout server can take the {len(requests)} prompt(s): " + self._describe(call)
            )
        sizes = [_message_bytes(p, params) for p in call.prompts]
        for chunk in split_into_chunks(len(requests), len(planned), self.generate_batch_size, sizes):
            call.queues[planned[chunk.slot].index].append(chunk)

        events: queue.Queue = queue.Queue()
        self._pump(call, events)
        if call.pending and number is not None:  # tests: stopped with the calls out (rmsft.pause_points)
            pause_points.pause_at("generate", number)
        while call.pending:
            kind, server, chunk, payload = events.get()
            call.pending -= 1
            if kind == "resync":
                self._on_resync(call, server, payload)
            else:
                call.inflight[server.index] -= 1
                fut, early = payload
                self._on_generate(call, server, chunk, fut, early=early)
            self._pump(call, events)
            # Converting replies after the next chunk went out overlaps it with the server's work.
            self._materialize(call)

        missing = [i for i, r in enumerate(call.results) if r is None]
        if missing:  # _pump only stops with work left when nothing can take it
            if call.stale_refused:
                assert expected is not None, "only a fenced call refuses stale completions"
                raise StaleRolloutError(
                    f"{len(missing)} of {len(call.results)} completion(s) are missing from weight version "
                    f"{expected.describe()}; {call.stale_refused} stale completion(s) were refused: "
                    + self._describe(call)
                )
            k = params.n or 1
            again = sorted({i // k for i in missing})
            # Waited for only when every server is down (a server that is up but failed the chunks has had its
            # attempts); then once one is back.
            if self.pool.up_servers() or not self.pool.wait_for_a_server(
                f"{len(missing)} completion(s) left when every server failed"
            ):
                raise AllServersDownError(
                    f"{len(missing)} of {len(call.results)} completion(s) could not be generated, no rollout "
                    f"server left: " + self._describe(call)
                )
            # A server came back (a restart, a recreated pod): the prompts still missing, again; their seeds are
            # theirs, so the answers are the ones the lost calls would have given.
            redo = self.generate([requests[i] for i in again], sampling, weight_version=weight_version)
            for j, i in enumerate(again):
                call.results[i * k : (i + 1) * k] = redo[j * k : (j + 1) * k]
        results: list[Rollout] = call.results  # type: ignore[assignment]
        if expected is not None:
            check_versions(results, expected)
        ROLLOUT_REQUESTS.inc(len(requests))
        PHASE_SECONDS.labels("generate").observe(time.perf_counter() - t0)
        return results

    # -- planning -------------------------------------------------------------------------------
    def _initial_servers(self, call: _Call) -> list[RolloutServer]:
        """Servers that get a share: up and current, or up and about to be re-synced."""
        planned = []
        for s in self.pool.servers:
            with self.pool.lock:
                up, held, err = s.state.up, s.state.weights, s.state.last_error
            if not up:
                call.excluded[s.index] = err or "down"
            elif call.expected is None or held == call.expected:
                planned.append(s)
            elif self._start_resync_ok(
                call, s, f"holds weight version {_version_text(held)}, learner at {call.expected.describe()}"
            ):
                planned.append(s)  # gets its share once the re-sync is done
        return planned

    def _start_resync_ok(self, call: _Call, server: RolloutServer, why: str) -> bool:
        """Mark `server` for a re-sync in this call; False (and excluded) when that is not possible."""
        if self.resync is None:
            call.excluded[server.index] = f"{why}; no resync callback configured"
            return False
        if server.index in call.resynced:
            call.excluded[server.index] = f"{why}, still after a re-sync"
            self.pool.mark_down(server, call.excluded[server.index])
            return False
        call.resyncing.add(server.index)
        return True

    def _least_loaded(self, call: _Call, candidates: list[RolloutServer]) -> RolloutServer:
        return min(
            candidates,
            key=lambda s: (sum(map(len, call.queues[s.index])) + call.inflight.get(s.index, 0), s.index),
        )

    def _pump(self, call: _Call, events: queue.Queue) -> None:
        """Start re-syncs, hand orphaned chunks to servers, and keep every usable server busy."""
        for idx in sorted(call.resyncing):
            server = self.pool.servers[idx]
            if idx not in call.resynced:
                call.resynced.add(idx)
                call.pending += 1
                assert self.resync is not None, "a server is marked for re-sync only with a resync callback"
                fut = self._resync_pool.submit(self.resync, server)

                def resynced(f: Future[None], s: RolloutServer = server) -> None:
                    events.put(("resync", s, None, f))

                fut.add_done_callback(resynced)
        for idx in call.excluded:  # what waits for a server that gets no more work goes to the others
            self._orphan_queue(call, self.pool.servers[idx])
        usable = [s for s in self.pool.servers if s.index not in call.excluded and s.index not in call.resyncing]
        waiting = [self.pool.servers[i] for i in sorted(call.resyncing) if i not in call.excluded]
        while call.orphans and (usable or waiting):
            chunk = call.orphans.popleft()
            call.queues[self._least_loaded(call, usable or waiting).index].append(chunk)
        for s in usable:
            q = call.queues[s.index]
            while q and call.inflight.get(s.index, 0) < self.max_inflight:
                self._send(call, s, q.popleft(), events)
        if not call.pending:  # nothing running: any work left is stranded
            for q in call.queues.values():
                call.orphans.extend(q)
                q.clear()

    def _send(self, call: _Call, server: RolloutServer, chunk: Chunk, events: queue.Queue) -> None:
        req = rollout_pb2.GenerateRequest(prompts=call.prompts[chunk.start : chunk.stop], sampling=call.sampling)
        if call.expected is not None:
            set_version(req, call.expected)  # the server refuses unless it holds this run's version
        call.inflight[server.index] = call.inflight.get(server.index, 0) + 1
        call.pending += 1
        fut = self._call_pool.submit(server.stub.Generate, req, timeout=self.timeout_s, metadata=self.pool.metadata)
        # Sent before any re-sync of this server in this call: should one start meanwhile (another chunk was
        # refused), this chunk's refusal or stale answer says nothing about the re-sync (see `_sent_before`).
        early = server.index not in call.resynced
        fut.add_done_callback(lambda f: events.put(("generate", server, chunk, (f, early))))

    # -- outcomes -------------------------------------------------------------------------------
    def _on_resync(self, call: _Call, server: RolloutServer, fut: Any) -> None:
        call.resyncing.discard(server.index)
        err = fut.exception()
        if err is None:  # the sync client recorded the version the server acknowledged
            self.pool.mark_up(server)
            return
        why = f"re-sync to weight version {_version_text(call.expected)} failed: {err}"
        call.excluded[server.index] = why
        self.pool.mark_down(server, why)
        self._orphan_queue(call, server)

    @staticmethod
    def _sent_before(call: _Call, server: RolloutServer, early: bool) -> bool:
        """The chunk went out before a re-sync of `server` that this call has started since: its answer
        came from the weights the re-sync replaces, so a refusal or a stale answer is expected and is no
        reason to re-sync again or to give up on the server."""
        return early and server.index in call.resynced

    def _on_generate(
        self, call: _Call, server: RolloutServer, chunk: Chunk, fut: Future, *, early: bool = False
    ) -> None:
        try:
            reply: rollout_pb2.GenerateResponse = fut.result()
        except grpc.RpcError as e:
            self._on_rpc_error(call, server, chunk, e, early=early)
            return
        comps = reply.completions
        n = call.sampling.n or 1
        problem = ""
        if len(comps) != len(chunk) * n:
            problem = f"answered {len(comps)} completions for {len(chunk)} prompts x {n} samples"
        else:
            for k, c in enumerate(comps):
                p = call.prompts[chunk.start + k // n]
                if c.request_id and p.request_id and c.request_id != p.request_id:
                    problem = f"answered request id {c.request_id!r} for {p.request_id!r}"
                    break
                if c.sample_index != k % n:
                    problem = f"answered sample {c.sample_index} of {p.request_id!r} where sample {k % n} belongs"
                    break
        if problem:
            call.excluded[server.index] = f"bad reply: {problem}"
            self.pool.mark_down(server, call.excluded[server.index])
            self._retry(call, server, chunk, "bad_reply", problem)
            return
        versions = {version_of(c) for c in comps}
        if call.expected is not None and versions != {call.expected}:
            # The server ignored the fence (another version, or another run's weights under this number);
            # its answers must not reach training.
            got = ", ".join(sorted(v.describe() for v in versions))
            why = f"replied with weight version(s) {got}, learner at {call.expected.describe()}"
            call.stale_refused += len(comps)
            if not self._sent_before(call, server, early):
                self.pool.mark_stale(server, version_of(reply), why)
                self._start_resync_ok(call, server, why)
            self._retry(call, server, chunk, "stale_version", why)
            return
        call.accepted.append((chunk, server, reply))
        if not server.state.up or server.state.weights != version_of(reply):
            self.pool.mark_up(server, weights=version_of(reply))

    def _materialize(self, call: _Call) -> None:
        n = call.sampling.n or 1
        for chunk, server, reply in call.accepted:
            for i, c in enumerate(reply.completions):
                call.results[chunk.start * n + i] = Rollout(
                    request_id=c.request_id or call.prompts[chunk.start + i // n].request_id,
                    prompt_token_ids=list(c.prompt_token_ids),
                    token_ids=list(c.token_ids),
                    finish_reason=FINISH_REASONS.get(c.finish_reason, "finish_reason_unspecified"),
                    weight_version=c.weight_version,
                    weight_run_id=c.weight_run_id,
                    server=server.address,
                    sample_index=c.sample_index,
                    logprobs=list(c.logprobs) if call.sampling.logprobs else None,
                    version_spans=[
                        (WeightVersion(s.weight_run_id, s.weight_version), s.start, s.end) for s in c.version_spans
                    ],
                )
        call.accepted.clear()

    def _on_rpc_error(
        self, call: _Call, server: RolloutServer, chunk: Chunk, e: grpc.RpcError, *, early: bool = False
    ) -> None:
        code = e.code()
        why = describe_rpc_error(e)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or ""):
            raise RolloutError(
                f"prompts [{chunk.start}, {chunk.stop}) on {server.name}: a message exceeded gRPC's size limit "
                f"— {why}; "
                "set spec.training.rollout.generate_batch_size to send fewer prompts per call"
            )
        if code in _FATAL_CODES:
            raise RolloutError(
                f"server {server.name} rejected prompts [{chunk.start}, {chunk.stop}) — {why}; "
                "the request itself is invalid, so it is not retried elsewhere"
            )
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            if not self._sent_before(call, server, early):  # else: refused by the weights its re-sync replaces
                self.pool.mark_stale(server, None, why)
                self._start_resync_ok(call, server, why)
        elif code not in _BUSY_CODES:
            call.excluded[server.index] = why
            self.pool.mark_down(server, why)
        self._retry(call, server, chunk, code.name.lower(), why)

    def _retry(self, call: _Call, server: RolloutServer, chunk: Chunk, reason: str, why: str) -> None:
        tries = call.failures.setdefault(chunk, [])
        tries.append(f"{server.name}: {why}")
        if len(tries) >= self.max_attempts:
            raise RolloutError(
                f"prompts [{chunk.start}, {chunk.stop}) failed {len(tries)} times, giving up: " + " | ".join(tries)
            )
        ROLLOUT_RETRIES.labels(reason=reason).inc()
        call.orphans.append(chunk)
        if server.index in call.excluded or server.index in call.resyncing:
            self._orphan_queue(call, server)

    def _orphan_queue(self, call: _Call, server: RolloutServer) -> None:
        q = call.queues[server.index]
        call.orphans.extend(q)
        q.clear()

    def _describe(self, call: _Call) -> str:
        parts = []
        for s in self.pool.servers:
            why = call.excluded.get(s.index) or s.state.last_error or "no error recorded"
            parts.append(f"{s.name}: {why}")
        return "; ".join(parts)


def _version_text(weights: WeightVersion | None) -> str:
    return "unknown" if weights is None else weights.describe()
