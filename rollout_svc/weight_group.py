"""Transport nccl, the server's side: joining the learner's weight-transfer group (JoinWeightGroup) and an
UpdateWeights call whose header lists a FULL update that then comes over the group, not the stream. The learner's
side is learner/sync/group.py; the engines' is `join_weight_group` / `receive_weights`
(rollout_engine.weight_transfer_gloo registers the CPU backend)."""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import grpc
from rmsft_protos import rollout_pb2

from rmsft.weight_wire import FULL, StagedTensor, StreamReader, WireError, set_version, version_of
from rmsft.weight_wire.outcomes import GROUP_READY_METADATA
from rmsft.weight_wire.transfer import JOIN_SLACK_S, receive_bound_s, update_info, worker_init_info
from rollout_engine import metrics
from rollout_engine.engine import EngineDead, EngineError, tied_head_alias
from rollout_svc.runner import RunnerStopped

if TYPE_CHECKING:
    from rmsft.weight_wire import WeightVersion
    from rollout_engine.config import ServeConfig
    from rollout_engine.engine import Engine, TransferEngine
    from rollout_svc.runner import EngineRunner
    from rollout_svc.staging import StagedWeights

log = logging.getLogger(__name__)


def within(bound_s: float, what: str, fn: Any) -> Any:
    """`fn()`, but not waited for past `bound_s`: an engine stuck in a group operation (an NCCL collective whose
    peer is gone waits for ever, and so would this server, its gate closed and its update lock held) is EngineDead,
    so the server exits to be restarted and the learner re-syncs it. `fn` runs on a thread of its own, left behind
    when the bound passes (the process is exiting)."""
    done = threading.Event()
    out: list[Any] = [None, None]

    def run() -> None:
        try:
            out[0] = fn()
        except BaseException as e:  # raised on the caller's thread below
            out[1] = e
        finally:
            done.set()

    threading.Thread(target=run, name="rmsft-group-op", daemon=True).start()
    if not done.wait(bound_s):
        raise EngineDead(
            f"{what} did not end within {bound_s:g}s (the weight-transfer group's deadline for each of its "
            "operations): the engine is stuck in the group"
        )
    if out[1] is not None:
        raise out[1]
    return out[0]


class GroupMember:
    """RolloutServicer's weight-transfer group calls (a mixin: one room for transport nccl). It reads and writes
    the servicer's state: `cfg`, `engine`, `runner`, `_update_lock` (held by UpdateWeights when it hands over),
    `_group_id` (the group the engine is in, "" for none), `_tied`, `_full_names`, `_rollback`, `_adapter_dir`,
    `_last_*`; and calls its `_abort_unless_ready`, `_finish`, `_dead`, `_expected_for`, `_record_version`."""

    if TYPE_CHECKING:  # that state and those calls, as RolloutServicer defines them
        cfg: ServeConfig
        engine: Engine | None
        runner: EngineRunner | None
        _update_lock: threading.Lock
        _group_id: str
        _tied: bool
        _full_names: frozenset[str]
        _rollback: StagedWeights | None
        _rollback_is_checkpoint: bool
        _adapter_dir: str | None
        _last_applied: list[StagedTensor]
        _last_bytes: int
        _last_apply_seconds: float

        def _abort_unless_ready(self, method: str, context: Any) -> None: ...
        @staticmethod
        def _finish(method: str, context: Any, code: grpc.StatusCode, message: str) -> Any: ...
        def _dead(self, reason: str) -> None: ...
        def _expected_for(self, header: rollout_pb2.WeightHeader) -> Any: ...
        def _record_version(
            self, weights: WeightVersion, adapter: str, tensors: list[StagedTensor], nbytes: int, apply_seconds: float
        ) -> None: ...

    # the group's deadline for each operation and its bucket size, as the last join set them
    _group_timeout_s: float = 300.0
    _group_bucket_bytes: int = 0

    def JoinWeightGroup(self, request, context):
        """Join the learner's weight-transfer group (rank 0 is the learner): replaces any group this server was in.
        Runs with no Generate call running, as an apply does: the engine's workers block in the rendezvous."""
        self._abort_unless_ready("JoinWeightGroup", context)
        if not self.cfg.weight_transfer:
            self._finish(
                "JoinWeightGroup",
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server was started without --weight-transfer (spec.sync.transport nccl starts servers "
                "with it); full weights reach it over gRPC",
            )
        if not self._update_lock.acquire(blocking=False):
            self._finish(
                "JoinWeightGroup", context, grpc.StatusCode.ABORTED, "a weight update is in progress on this server"
            )
        try:
            timeout_s = request.timeout_s or 300.0
            info = worker_init_info(
                self.cfg.weight_transfer,
                master_address=request.master_address,
                master_port=request.master_port,
                world_size=request.world_size,
                rank_offset=request.rank_offset,
                timeout_s=timeout_s,
                bucket_bytes=request.bucket_bytes,
            )
            self._group_id = ""  # the old group is left whatever happens next
            engine = cast("TransferEngine", self.engine)
            self.runner.call(
                lambda: within(
                    timeout_s + JOIN_SLACK_S,
                    "joining the weight-transfer group",
                    lambda: engine.join_weight_group(info),
                )
            )
            self._group_id = request.group_id
            self._group_timeout_s, self._group_bucket_bytes = timeout_s, request.bucket_bytes
        except EngineDead as e:
            self._dead(str(e))
            self._finish("JoinWeightGroup", context, grpc.StatusCode.UNAVAILABLE, str(e))
        except (EngineError, RunnerStopped) as e:
            self._finish(
                "JoinWeightGroup",
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"joining weight-transfer group {request.group_id} failed: {e}",
            )
        finally:
            self._update_lock.release()
        log.info(
            "joined weight-transfer group %s (%s, ranks %d..%d of %d)",
            request.group_id,
            self.cfg.weight_transfer,
            request.rank_offset,
            request.rank_offset + self.engine.tensor_parallel_size - 1,
            request.world_size,
        )
        metrics.REQUESTS.labels(method="JoinWeightGroup", code="OK").inc()
        return rollout_pb2.JoinWeightGroupReply(
            group_id=request.group_id, ranks=self.engine.tensor_parallel_size, bucket_bytes=request.bucket_bytes
        )

    def _update_over_group(self, header, rest, context, t0: float):
        """An UpdateWeights stream whose header lists the tensors of a FULL update coming over the weight-transfer
        group: check the listing, drain, say ready (initial metadata), wait for the learner's go (the trailer), then
        receive and load. Called off before the go (the stream ended, cancelled): nothing applied. Under the update
        lock (taken by UpdateWeights)."""
        assert self.runner is not None, "UpdateWeights passed _abort_unless_ready"
        try:
            tensors = self._check_group_update(header)
            self.runner.call(lambda: self._receive_over_group(header, tensors, rest, context))
        except WireError as e:
            if e.reason == "truncated" and not context.is_active():
                e.reason = "cancelled"
            metrics.WEIGHT_SYNC_FAILURES.labels(reason=e.reason).inc()
            log.warning("weight update over group refused (%s): %s", e.reason, e)
            self._finish("UpdateWeights", context, getattr(grpc.StatusCode, e.code), str(e))
        except EngineDead as e:
            metrics.WEIGHT_SYNC_FAILURES.labels(reason="apply").inc()
            self._group_id = ""
            self._dead(str(e))
            self._finish(
                "UpdateWeights",
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"{e}; this server is exiting to be restarted, and starts again from the checkpoint",
            )
        except (EngineError, RunnerStopped) as e:
            metrics.WEIGHT_SYNC_FAILURES.labels(reason="apply").inc()
            # The group broke (its deadline passed, the learner called the update off or closed its end): this
            # server leaves it, so the learner builds a new one before the next update over a group; the gate
            # reopens (runner.call returned) on the version it had, and the update lock is released below.
            self._group_id = ""
            self._finish("UpdateWeights", context, grpc.StatusCode.UNAVAILABLE, f"{e}: nothing was applied")
        finally:
            self._update_lock.release()
        metrics.WEIGHT_SYNC_SECONDS.labels(mode="full").observe(time.perf_counter() - t0)
        metrics.REQUESTS.labels(method="UpdateWeights", code="OK").inc()
        return set_version(
            rollout_pb2.UpdateReply(
                tensors_applied=len(self._last_applied),
                bytes_received=self._last_bytes,
                apply_seconds=self._last_apply_seconds,
            ),
            self.runner.weights,
        )

    def _check_group_update(self, header) -> list[StagedTensor]:
        group = header.transfer_group
        if header.mode != FULL:
            raise WireError("a weight-transfer group carries FULL updates only (adapters go over gRPC)")
        if group.group_id != self._group_id:
            raise WireError(
                f"the update goes over weight-transfer group {group.group_id or '(none)'}; this server is "
                f"in {self._group_id or 'none'} (the learner rebuilds the group)",
                code="FAILED_PRECONDITION",
                reason="group",
            )
        if header.relay_to or header.HasField("shared_file"):
            raise WireError("a transfer-group update neither relays nor names a shared file")
        table, optional, require_all = self._expected_for(header)
        reader = StreamReader(expected=table, optional=optional, require_all=require_all)
        reader.on_header(header)
        reader.on_listing(group.tensors)
        return reader.tensors

    def _receive_over_group(self, header, tensors: list[StagedTensor], rest, context) -> None:
        context.send_initial_metadata(GROUP_READY_METADATA)
        try:
            go = next(rest)
        except StopIteration:
            raise WireError(
                "the learner called the update off before sending (another member was not ready): nothing was applied",
                reason="truncated",
            ) from None
        if go.WhichOneof("kind") != "trailer":
            raise WireError("a transfer-group update is a header and a trailer only")
        t0 = time.perf_counter()
        # With tied embeddings the learner sends the embedding only; load it under the head's name too.
        head = tied_head_alias(self._tied, [t.name for t in tensors])
        # A server started with --weight-transfer (JoinWeightGroup refuses others) runs such an engine.
        engine = cast("TransferEngine", self.engine)
        info = update_info(self.cfg.weight_transfer, [(t.name, t.spec) for t in tensors], head)
        bound = receive_bound_s(self._group_timeout_s, [t.spec.nbytes for t in tensors], self._group_bucket_bytes)
        within(bound, "receiving the update over the weight-transfer group", lambda: engine.receive_weights(info))
        engine.reset_prefix_cache()
        self._full_names = self._full_names | frozenset(t.name for t in tensors)
        if self._rollback is not None:  # the last gRPC stream is older than what serves now: no rollback copy
            self._rollback.cleanup()
            self._rollback = None
        self._rollback_is_checkpoint = False
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None
        self._record_version(
            version_of(header), "", tensors, sum(t.spec.nbytes for t in tensors), time.perf_counter() - t0
        )


def peek_group_header(chunks):
    """(the stream, unchanged, and the header when it is a transfer-group update, else None). The first chunk is
    read here and put back in front of the rest."""
    it = iter(chunks)
    try:
        first = next(it)
    except StopIteration:
        return iter(()), None
    if first.WhichOneof("kind") == "header" and first.header.HasField("transfer_group"):
        return it, first.header
    return itertools.chain([first], it), None
