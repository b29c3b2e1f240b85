"""The `RolloutService` gRPC servicer: Generate, UpdateWeights, GetStatus; JoinWeightGroup and the updates over a
weight-transfer group (transport nccl) are rollout_svc.weight_group's."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import cast

import grpc
from rmsft_protos import rollout_pb2, rollout_pb2_grpc

from rmsft.serving_dtype import SERVE_DTYPES, served_spec, serving_dtype_name
from rmsft.weight_wire import (
    ADAPTER,
    FRESH,
    FULL,
    WeightVersion,
    WireError,
    set_version,
    version_of,
)
from rmsft.weight_wire.outcomes import SHARED_OPENED_METADATA, relayed_metadata
from rollout_engine import metrics
from rollout_engine.config import ServeConfig
from rollout_engine.engine import (
    Engine,
    EngineDead,
    EngineError,
    EngineInputError,
    InFlightEngine,
    MortalEngine,
    checkpoint_table,
    tied_lm_head,
)
from rollout_engine.prompts import PromptError, build_items, samples_per_prompt
from rollout_svc.relay import Relay, relay_deadline
from rollout_svc.runner import Cancelled, EngineRunner, RunnerStopped, VersionMismatch
from rollout_svc.staging import (
    StagedWeights,
    Stager,
    adapter_expectation,
    full_expectation,
    write_adapter_dir,
)
from rollout_svc.weight_group import GroupMember, peek_group_header

log = logging.getLogger(__name__)

_FINISH = {"stop": rollout_pb2.STOP, "length": rollout_pb2.LENGTH, "abort": rollout_pb2.ABORT}
_MODE_NAME = {FULL: "full", ADAPTER: "adapter"}


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class RolloutServicer(GroupMember, rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, cfg: ServeConfig, on_broken=None):
        self.cfg = cfg
        self.engine: Engine | None = None
        self.runner: EngineRunner | None = None
        self.ordinal = cfg.resolved_replica_ordinal()
        self.stager = Stager(cfg.resolved_staging_dir(), cfg.max_frame_bytes, cfg.resolved_shared_weights_dir())
        if self.stager.removed_at_start:
            log.info(
                "removed %d staging file(s) of rollout servers that are gone: %s",
                len(self.stager.removed_at_start),
                ", ".join(self.stager.removed_at_start),
            )
        # How this server calls its peers when it relays an update: the pool shares one token, and
        # (with TLS) one certificate chain, which then also serves as the roots to trust.
        token = cfg.resolved_auth_token()
        self._peer_metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._peer_roots = Path(cfg.tls_cert).read_bytes() if cfg.tls_cert else None
        self._table = checkpoint_table(cfg.model)
        self._tied = tied_lm_head(cfg.model)
        # FULL weights arrive in the dtype the engine serves in (`--dtype`, auto = the checkpoint's),
        # what the learner casts to; the engine's loader copies them into its parameters.
        try:
            self._serve_dtype = serving_dtype_name(cfg.dtype, cfg.model)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self._full_table = {name: served_spec(spec, self._serve_dtype) for name, spec in self._table.items()}
        self._admit_lock = threading.Lock()
        self._admitted = 0
        self._update_lock = threading.Lock()
        self._adapter_ids = itertools.count(1)
        self._adapter_dir: str | None = None
        self._rollback: StagedWeights | None = None  # last applied FULL stream
        self._rollback_is_checkpoint = True  # no FULL applied yet: the checkpoint is the rollback
        # Tensors FULL updates have changed since the checkpoint loaded; every later FULL update must
        # carry them (so the last stream alone, over the checkpoint, rebuilds the served weights).
        self._full_names: frozenset[str] = frozenset()
        self._broken = ""
        self._closing = False
        self._on_broken = on_broken
        self._last_applied: list = []
        self._group_id = ""  # transport nccl: the learner's weight-transfer group the engine is in ("" = none)
        self._last_bytes = 0
        self._last_apply_seconds = 0.0
        metrics.READY.set(0)
        metrics.set_weights(FRESH)

    # lifecycle ------------------------------------------------------------------------------
    def attach(self, engine) -> None:
        self.engine = engine
        self.runner = EngineRunner(engine)
        # The engine's weight labels (GenOutput.version_spans) -> the versions they stand for: vLLM's engine core
        # starts as "default" (the checkpoint's weights), then every apply labels its version (`_record_version`).
        self._labels: dict[str, WeightVersion] = {"default": self.runner.weights}
        self._label_ids = itertools.count(1)
        metrics.READY.set(1)
        if hasattr(engine, "dead_reason"):
            threading.Thread(target=self._watch_engine, name="rmsft-engine-watch", daemon=True).start()

    def _watch_engine(self, every_s: float = 0.5) -> None:
        """Notice an engine that died while idle (its process killed, say): nothing else would until the next
        call, and the readiness probe and the learner's failover must react now."""
        engine = cast(MortalEngine, self.engine)  # attach() watches only an engine with dead_reason
        while not self._closing and not self._broken:
            reason = engine.dead_reason()
            if reason and not self._closing:
                self._dead(reason)
                return
            time.sleep(every_s)

    @property
    def ready(self) -> bool:
        return self.runner is not None and not self._broken

    def shutting_down(self) -> None:
        """From now on an engine that stops is not a dead one (Ctrl-C reaches vLLM's engine process too)."""
        self._closing = True

    def close(self) -> None:
        self.shutting_down()
        metrics.READY.set(0)
        if self.runner is not None:
            self.runner.stop()
        if self.engine is not None:
            self.engine.close()
        if self._rollback is not None:
            self._rollback.cleanup()
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)

    # helpers --------------------------------------------------------------------------------
    @staticmethod
    def _finish(method: str, context, code: grpc.StatusCode, message: str):
        metrics.REQUESTS.labels(method=method, code=code.name).inc()
        context.abort(code, message)

    def _abort_unless_ready(self, method: str, context) -> None:
        try:
            self._require_ready()
        except _Abort as e:
            self._finish(method, context, e.code, str(e))

    def _require_ready(self) -> None:
        if self._broken:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"server is broken: {self._broken}")
        if self.runner is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")

    # Generate -------------------------------------------------------------------------------
    def Generate(self, request, context):
        t0 = time.perf_counter()
        with self._admit_lock:
            if self._admitted >= self.cfg.max_concurrent_requests:
                self._finish(
                    "Generate",
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"server is at its limit of {self.cfg.max_concurrent_requests} concurrent "
                    "Generate calls; retry later or on another replica",
                )
            self._admitted += 1
        try:
            self._require_ready()
            # The fence is the pair (run id, number): another run's weights under the same number are refused.
            expected = version_of(request)
            if expected is not None and not self.runner.accepts(expected):
                raise VersionMismatch(expected, self.runner.weights)
            items = build_items(request, self.engine)
            # The callback runs when the call ends for any reason; when the client went away (deadline passed,
            # cancelled, connection closed) that aborts its requests in the engine.
            outs, version = self.runner.generate(items, expected, on_cancel=context.add_callback)
        except _Abort as e:
            self._finish("Generate", context, e.code, str(e))
        except PromptError as e:
            self._finish("Generate", context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except VersionMismatch as e:
            self._finish(
                "Generate",
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{e}; sync weights first or drop expected_weight_version",
            )
        except EngineInputError as e:
            self._finish("Generate", context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDead as e:
            self._dead(str(e))
            self._finish(
                "Generate",
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"{e}; this server is exiting to be restarted: retry on another server",
            )
        except EngineError as e:
            self._finish("Generate", context, grpc.StatusCode.INTERNAL, str(e))
        except Cancelled as e:
            self._finish("Generate", context, grpc.StatusCode.CANCELLED, str(e))
        except RunnerStopped as e:
            self._finish("Generate", context, grpc.StatusCode.UNAVAILABLE, f"{e}; retry on another server")
        finally:
            with self._admit_lock:
                self._admitted -= 1
        reply = set_version(rollout_pb2.GenerateResponse(), version)
        n = samples_per_prompt(request.sampling)
        n_prompt = n_gen = 0
        for k, out in enumerate(outs):
            c = set_version(
                reply.completions.add(
                    prompt_token_ids=out.prompt_token_ids,
                    token_ids=out.token_ids,
                    finish_reason=_FINISH.get(out.finish_reason, rollout_pb2.FINISH_REASON_UNSPECIFIED),
                    request_id=request.prompts[k // n].request_id,
                    sample_index=k % n,
                    logprobs=out.logprobs or (),
                ),
                version,
            )
            for weights, start, end in self._spans(out, version):
                set_version(c.version_spans.add(start=start, end=end), weights)
            n_prompt += len(out.prompt_token_ids) if k % n == 0 else 0
            n_gen += len(out.token_ids)
        metrics.PROMPTS.inc(len(request.prompts))
        metrics.IMAGES.inc(sum(len(p.images) for p in request.prompts))
        metrics.PROMPT_TOKENS.inc(n_prompt)
        metrics.GENERATED_TOKENS.inc(n_gen)
        metrics.GENERATE_SECONDS.observe(time.perf_counter() - t0)
        metrics.REQUESTS.labels(method="Generate", code="OK").inc()
        return reply

    def _spans(self, out, admitted: WeightVersion) -> list[tuple[WeightVersion, int, int]]:
        """Which version sampled which of `out`'s tokens: the engine's labelled spans, mapped to versions, or one
        span of the version the call was admitted under (an engine without labels runs no call across an apply).
        A label the server does not know (none should be) reads as the admitted version."""
        n = len(out.token_ids)
        spans = [(self._labels.get(label, admitted), s, e) for label, s, e in (out.version_spans or []) if e > s]
        if not spans or spans[0][1] != 0 or spans[-1][2] != n:
            return [(admitted, 0, n)] if n else []
        merged: list[tuple[WeightVersion, int, int]] = []
        for weights, s, e in spans:  # neighbours under one version (a label re-set to the same) are one span
            if merged and merged[-1][0] == weights:
                merged[-1] = (weights, merged[-1][1], e)
            else:
                merged.append((weights, s, e))
        return merged

    def _mark_broken(self, reason: str, *, fatal: bool = False) -> None:
        """Refuse everything from now on (UNAVAILABLE naming `reason`) and tell the process: NOT_SERVING, and
        with `fatal` (a dead engine) exit to be restarted."""
        self._broken = reason
        metrics.READY.set(0)
        if self._on_broken:
            self._on_broken(reason, fatal=fatal)

    def _dead(self, reason: str) -> None:
        if self._broken or self._closing:  # both the watcher and a failing call may notice; a shutdown is not death
            return
        log.error("engine dead: %s", reason)
        self._mark_broken(reason, fatal=True)

    # UpdateWeights --------------------------------------------------------------------------
    def _check_header(self, header) -> None:
        assert self.engine is not None and self.runner is not None, "attached: callers passed _require_ready"
        if header.mode == ADAPTER:
            if not self.engine.lora_enabled:
                raise WireError(
                    "ADAPTER sync needs a server started with --enable-lora; this one serves "
                    f"backend={self.engine.backend} without LoRA (use FULL sync)",
                    code="FAILED_PRECONDITION",
                    reason="lora_disabled",
                )
            try:
                cfg = json.loads(header.adapter_config_json)
            except ValueError as e:
                raise WireError(f"adapter_config_json is not JSON: {e}") from e
            if not isinstance(cfg, dict):
                raise WireError("adapter_config_json must be a JSON object")
            rank = int(cfg.get("r", 0) or 0)
            ranks = [rank, *map(int, (cfg.get("rank_pattern") or {}).values())]
            if rank <= 0 or max(ranks) > self.engine.max_lora_rank:
                raise WireError(
                    f"adapter rank {max(ranks)} is outside 1..{self.engine.max_lora_rank} (server --max-lora-rank)",
                    code="FAILED_PRECONDITION",
                    reason="lora_rank",
                )

    def _expected_for(self, header):
        if header.mode == FULL:
            return full_expectation(dict(self._full_table), self._tied, self._full_names)
        return adapter_expectation(self._table, json.loads(header.adapter_config_json)), set(), False

    def UpdateWeights(self, request_iterator, context):
        t0 = time.perf_counter()
        mode = "unknown"
        self._abort_unless_ready("UpdateWeights", context)
        if not self._update_lock.acquire(blocking=False):
            metrics.WEIGHT_SYNC_FAILURES.labels(reason="busy").inc()
            self._finish(
                "UpdateWeights", context, grpc.StatusCode.ABORTED, "another weight update is in progress on this server"
            )
        try:
            request_iterator, group_header = peek_group_header(request_iterator)
        except grpc.RpcError:
            self._update_lock.release()
            self._finish("UpdateWeights", context, grpc.StatusCode.CANCELLED, "weight stream broken off")
        if group_header is not None:
            return self._update_over_group(group_header, request_iterator, context, t0)
        staged = None
        modes: list[int] = []  # the header's mode, once it arrived (for the error message)
        relays: list[Relay] = []  # the relay to header.relay_to, once the header asked for one

        def on_header(header) -> Relay | None:
            modes.append(header.mode)
            self._check_header(header)
            if not header.relay_to:
                return None
            refused = [t for t in header.relay_to if not self.cfg.relay_allowed(t)]
            if refused:  # only the job's own servers: a caller cannot make this server stream weights elsewhere
                raise WireError(
                    f"relay to {', '.join(refused)} refused: not among this server's peers "
                    f"(--relay-allow {self.cfg.relay_allow})",
                    code="PERMISSION_DENIED",
                    reason="relay_refused",
                )
            relays.append(
                Relay(
                    header,
                    metadata=self._peer_metadata,
                    root_certificates=self._peer_roots,
                    deadline=relay_deadline(context.time_remaining(), len(header.relay_to)),
                )
            )
            return relays[0]

        try:
            staged = self.stager.stage(
                request_iterator,
                self._expected_for,
                on_header=on_header,
                on_shared_open=lambda: context.send_initial_metadata(SHARED_OPENED_METADATA),
            )
            mode = _MODE_NAME[staged.header.mode]
            metrics.WEIGHT_SYNC_BYTES.labels(mode=mode).inc(staged.bytes_received)
            if staged.header.mode == FULL:
                # keep_generating: applied under the running calls, paused (an engine that cannot is drained);
                # ADAPTER updates always drain (the running requests hold the old adapter).
                self.runner.call(lambda: self._apply_full(staged), keep=staged.header.keep_generating)
                staged = None  # kept as the rollback copy
            else:
                self._apply_adapter(staged)
        except WireError as e:
            if e.reason == "truncated" and not context.is_active():
                e.reason = "cancelled"  # grpc ends the request iterator quietly on a client cancel
            message = str(e)
            if e.reason == "dtype" and modes == [FULL]:
                message += (
                    f": this server serves {self._serve_dtype_text()}, and FULL weights must be sent in "
                    "that dtype (the learner casts to spec.model.dtype)"
                )
            metrics.WEIGHT_SYNC_FAILURES.labels(reason=e.reason).inc()
            log.warning("weight update refused (%s): %s", e.reason, message)
            self._refuse(context, relays, getattr(grpc.StatusCode, e.code), message)
        except EngineDead as e:
            metrics.WEIGHT_SYNC_FAILURES.labels(reason="apply").inc()
            self._dead(str(e))
            self._refuse(
                context,
                relays,
                grpc.StatusCode.UNAVAILABLE,
                f"{e}; this server is exiting to be restarted, and starts again from the checkpoint",
            )
        except RunnerStopped as e:
            metrics.WEIGHT_SYNC_FAILURES.labels(reason="apply").inc()
            self._refuse(context, relays, grpc.StatusCode.UNAVAILABLE, f"{e}: nothing was applied")
        except EngineError as e:
            metrics.WEIGHT_SYNC_FAILURES.labels(reason="apply").inc()
            self._refuse(
                context,
                relays,
                grpc.StatusCode.INTERNAL,
                f"{e}; the previous weights ({self.runner.weights}) are still serving",
            )
        except grpc.RpcError as e:
            # The client cancelled or the connection dropped mid-stream: nothing was applied.
            metrics.WEIGHT_SYNC_FAILURES.labels(reason="cancelled").inc()
            log.warning("weight stream broken off: %s", e)
            self._refuse(context, relays, grpc.StatusCode.CANCELLED, "weight stream broken off")
        finally:
            if staged is not None:
                staged.cleanup()
            self._update_lock.release()
        elapsed = time.perf_counter() - t0
        metrics.WEIGHT_SYNC_SECONDS.labels(mode=mode).observe(elapsed)
        metrics.REQUESTS.labels(method="UpdateWeights", code="OK").inc()
        return set_version(
            rollout_pb2.UpdateReply(
                tensors_applied=len(self._last_applied),
                bytes_received=self._last_bytes,
                apply_seconds=self._last_apply_seconds,
                relayed=self._relayed(relays),
            ),
            self.runner.weights,
        )

    @staticmethod
    def _relayed(relays: list[Relay]) -> list[rollout_pb2.RelayOutcome]:
        """What the servers this one relayed to answered (waits for them; the relay's deadline is
        inside the caller's)."""
        if not relays:
            return []
        try:
            return relays[0].wait()
        finally:
            relays[0].close()

    def _refuse(self, context, relays: list[Relay], code: grpc.StatusCode, message: str) -> None:
        """Abort the call; a relayed update still reports what the servers downstream answered
        (trailing metadata), so its caller does not send them the update again."""
        outcomes = self._relayed(relays)
        if outcomes:
            context.set_trailing_metadata(relayed_metadata(outcomes))
        self._finish("UpdateWeights", context, code, message)

    def _serve_dtype_text(self) -> str:
        names: dict[str | None, str | None] = {v: k for k, v in SERVE_DTYPES.items()}
        served = names.get(self._serve_dtype, self._serve_dtype)
        if self.cfg.dtype == "auto":
            return f"{served} (--dtype auto: the checkpoint's dtype)"
        return f"{served} (--dtype {self.cfg.dtype})"

    def _apply_full(self, staged: StagedWeights) -> None:
        assert self.engine is not None and self.runner is not None, "attached: callers passed _require_ready"
        t0 = time.perf_counter()
        names = frozenset(t.name for t in staged.tensors)
        try:
            self.engine.apply_full(staged.index_path)
        except EngineDead:
            staged.cleanup()  # no rollback into a dead engine: the process restarts from the checkpoint
            raise
        except EngineError as e:
            prev = self._rollback.index_path if self._rollback else None
            if prev is None and not self._rollback_is_checkpoint:
                self._mark_broken(f"FULL apply failed ({e}) and no rollback copy is kept")
                staged.cleanup()
                raise
            try:
                # Tensors the failed update named that no earlier update did still hold checkpoint
                # values before it: reload the checkpoint first, then the last stream on top.
                if prev is not None and names - self._full_names:
                    self.engine.apply_full(None)
                self.engine.apply_full(prev)
                if self._adapter_dir:  # the reload dropped the adapter that belongs to this version
                    self.engine.apply_adapter(self._adapter_dir, next(self._adapter_ids), self.runner.active_adapter)
                self._reset_caches()
            except EngineError as e2:
                self._mark_broken(f"FULL apply failed ({e}) and rollback failed ({e2})")
            staged.cleanup()
            raise
        self._reset_caches()
        self._full_names = self._full_names | names
        if self._rollback is not None:
            self._rollback.cleanup()
        self._rollback_is_checkpoint = False
        if self.cfg.keep_rollback_copy:
            self._rollback = staged
        else:
            self._rollback = None
            staged.cleanup()
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None
        self._set_version(staged, "", time.perf_counter() - t0)

    def _reset_caches(self) -> None:
        """After a weight change: the engine's caches, and under an in-flight apply the paused requests' KV (they
        are recomputed under the new weights when they resume)."""
        assert self.engine is not None and self.runner is not None, "attached: callers passed _require_ready"
        if self.runner.keeping:  # only an engine that can keep its requests keeps them
            cast(InFlightEngine, self.engine).reset_prefix_cache(running=True)
        else:
            self.engine.reset_prefix_cache()

    def _apply_adapter(self, staged: StagedWeights) -> None:
        adapter_id = next(self._adapter_ids)
        name = f"rmsft-v{staged.header.version}-{adapter_id}"
        out_dir = ""
        try:
            # A folder of its own: servers on one machine share /dev/shm, and the same version and adapter id
            # on two of them once made one server truncate the adapter_config.json the other's vLLM was reading.
            out_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=self.stager.staging_dir)
            write_adapter_dir(staged, out_dir)
        except Exception as e:
            if out_dir:
                shutil.rmtree(out_dir, ignore_errors=True)
            raise EngineError(f"cannot write adapter folder {out_dir or self.stager.staging_dir}: {e}") from e

        def apply() -> None:
            assert self.engine is not None, "attached: callers passed _require_ready"
            t0 = time.perf_counter()
            try:
                self.engine.apply_adapter(out_dir, adapter_id, name)
            except EngineError:
                shutil.rmtree(out_dir, ignore_errors=True)
                raise
            self.engine.reset_prefix_cache()
            if self._adapter_dir:
                shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = out_dir
            self._set_version(staged, name, time.perf_counter() - t0)

        assert self.runner is not None, "attached: callers passed _require_ready"
        try:
            self.runner.call(apply)
        except RunnerStopped:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise

    def _set_version(self, staged: StagedWeights, adapter: str, apply_seconds: float) -> None:
        self._record_version(version_of(staged.header), adapter, staged.tensors, staged.bytes_received, apply_seconds)

    def _record_version(
        self, weights: WeightVersion, adapter: str, tensors: list, nbytes: int, apply_seconds: float
    ) -> None:
        """The update applied: from now on the server holds its weight version, run id and number together
        (one assignment, inside the runner's apply, so no Generate call sees one without the other)."""
        assert self.runner is not None, "attached: callers passed _require_ready"
        self.runner.weights = weights
        self.runner.active_adapter = adapter
        if hasattr(self.engine, "label_weights"):  # tokens sampled from now on name this version
            label = f"w{next(self._label_ids)}"
            cast(InFlightEngine, self.engine).label_weights(label)
            self._labels[label] = weights
            while len(self._labels) > 64:  # no answer outlives that many updates (the learner's staleness <= 4)
                self._labels.pop(next(iter(self._labels)))
        self._last_applied = tensors
        self._last_bytes = nbytes
        self._last_apply_seconds = apply_seconds
        metrics.set_weights(weights)
        log.info("weights %s applied (%s, %d tensors, %d bytes)", weights, adapter or "full", len(tensors), nbytes)

    # GetStatus ------------------------------------------------------------------------------
    def GetStatus(self, request, context):
        metrics.REQUESTS.labels(method="GetStatus", code="OK").inc()
        eng, runner = self.engine, self.runner
        return set_version(
            rollout_pb2.StatusReply(
                model=self.cfg.model,
                tensor_parallel_size=self.cfg.tensor_parallel_size if eng is None else eng.tensor_parallel_size,
                replica_ordinal=self.ordinal,
                active_adapter=runner.active_adapter if runner else "",
                ready=self.ready,
                lora_enabled=bool(eng and eng.lora_enabled),
                backend=self.cfg.backend,
                max_lora_rank=eng.max_lora_rank if eng else 0,
                pid=os.getpid(),
                weight_group=self._group_id,
                weight_transfer=self.cfg.weight_transfer,
            ),
            runner.weights if runner else FRESH,
        )
