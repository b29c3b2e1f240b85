"""The learner's one training loop, read top to bottom in `TrainingLoop.run`:

    step     the objective's plan -> its rows -> forward/loss/backward/optimizer (`_train_step`, one place)
    publish  the step's figures: log line, /metrics, TensorBoard (`_publish`)
    sync     the new weights to the rollout engines, when the next step samples (its plan says so)
    checkpoint, held-out evaluation, and at the end the last checkpoint, pictures and the export.

The loop holds two collaborators. The **objective** (`learner.train.objectives`, chosen by `spec.trainer` from a
registry) says what a step trains on and its loss: rollout-matching SFT (channel-A steps teach the ground truth,
channel-B steps the model's own answers) or GRPO. The **rollout feed** (`learner.train.feed`) is what a step reads
from the engines: prompts, rollouts handed out between ranks, the staleness window, and what the engines serve.
Everything else is written once here: weight sync, checkpoints and resume, evaluation, export, reporting. The parts
are made before the loop, in the order a real start pays for them, by `learner.train.build.build_loop`.

One optimizer step = `grad_accumulation` packed rows (micro-steps). Several ranks (torchrun, or a process group
passed in) train data-parallel: rank 0 alone owns the server pool, generates the whole global batch
(`prompts_per_step` is global) and hands each rank a contiguous share; every rank builds its own segments into its
own packer. The step's loss is normalised by totals over all ranks, gradients are summed over ranks before
clipping, and every rank takes the same optimizer step, so the result is one process training on all the rows.
Rank 0 then syncs the servers. See learner/train/ranks.py.

Each learner process is one run with an id of its own (rank 0 makes it, the others receive it), new after every
restart: weight versions are (run id, number), so what a resumed learner announces is never taken for what the
run that wrote its checkpoint announced (`rmsft.weight_wire.version`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from learner.core.head import row_outputs
from learner.core.packing import PackedRow, Packer
from learner.data.images import ImageStore
from learner.data.order import DataOrder
from learner.data.records import Record
from learner.evaluation.held_out import EvalSetup, Evaluation, evaluate
from learner.rollouts.interface import RolloutSource
from learner.rollouts.pool import ServerPool
from learner.rollouts.server_home import WeightSender
from learner.tracking import metrics as m
from learner.tracking.tracker import tracker_of
from learner.train.checkpoint_owner import WriterLock
from learner.train.checkpointer import Checkpointer, TrainState
from learner.train.config import CoreConfigs, learning_rate
from learner.train.export import export_trained
from learner.train.feed import RolloutFeed
from learner.train.objectives import Built, Objective
from learner.train.objectives.base import Prepare, RowLoss
from learner.train.overlap import RolloutsAhead
from learner.train.policy import Policy
from learner.train.ranks import Ranks
from learner.train.reporting import PhaseClock, RunReporter, log_run_start, write_eval_pictures, write_rollout_pictures
from learner.train.results import StepResult, Summary, publish_figures
from learner.train.updater import Updater, ZeroUpdater, gathered_weights
from rmsft.jobspec import RolloutMatchingJob

__all__ = ["LoopParts", "StopRequested", "TrainingLoop"]

log = logging.getLogger("rmsft.learner")


T = TypeVar("T")


def _open(part: T | None) -> T:
    """A part of the loop that is None only after `close` let go of it (the updater), or on ranks other than 0 (the
    reporter, the evaluation's images): here, in an open loop on the rank that has it."""
    assert part is not None, "a part of an open loop, on a rank that has it"
    return part


@dataclass
class LoopParts:
    """What a training loop is made of (`learner.train.build.build_loop` makes them; `TrainingLoop` runs over them)."""

    job: RolloutMatchingJob
    objective: Objective
    ranks: Ranks
    state: TrainState
    phases: PhaseClock  # the step's phase seconds (shared with the objective)
    lineage: dict[str, str]  # what checkpoints record of the run's job
    writer_lock: WriterLock | None  # rank 0's lock on the checkpoint folder (None on other ranks)
    records: list[Record]
    images: ImageStore
    eval_records: list[Record]  # held-out records: rank 0's (empty on other ranks)
    eval_images: ImageStore | None
    device: torch.device
    policy: Policy
    model: torch.nn.Module
    updater: Updater
    core: CoreConfigs
    order: DataOrder
    packer: Packer
    checkpointer: Checkpointer
    no_rollouts: bool  # server mode with no servers: a run that samples nothing and evaluates nothing
    rollouts: RolloutSource | None  # rank 0's server pool, or an engine in every rank (colocate)
    pool: ServerPool | None  # the server pool's parts (None with colocate and on ranks other than 0)
    sync_client: WeightSender | None
    ahead: RolloutsAhead | None  # rank 0: rollouts generated ahead of training (overlap.py)
    feed: RolloutFeed


class StopRequested(Exception):  # a request, not an error
    """The run was asked to stop (`TrainingLoop.request_stop`: SIGTERM to `rmsft train`, i.e. an eviction, a node
    drain, a preemption): raised on every rank after the step in progress, once the checkpoint of that step is
    written, so a restart resumes there instead of at the last periodic checkpoint."""

    def __init__(self, why: str, step: int, checkpoint: Path | None) -> None:
        where = f"checkpoint {checkpoint} written" if checkpoint is not None else "its checkpoint written by rank 0"
        super().__init__(f"stopped ({why}) after step {step}: {where}; a restart resumes from it")
        self.why, self.step, self.checkpoint = why, step, checkpoint


class TrainingLoop:
    """The learner loop (module doc), over parts `learner.train.build.build_loop` made (`LoopParts`): build one with
    `build_loop(job, addresses, ...)`. Under torchrun (WORLD_SIZE > 1) or with a process group, one rank of a
    data-parallel group: only rank 0 holds the server pool and talks to the rollout servers."""

    def __init__(self, parts: LoopParts, *, on_step: Callable[[StepResult], None] | None = None) -> None:
        self.job, self.cfg = parts.job, parts.job.spec.training
        self.objective, self.ranks, self.state, self.phases = parts.objective, parts.ranks, parts.state, parts.phases
        self.on_step = on_step  # called on every rank with that rank's StepResult
        self.on_eval: Callable[[Evaluation], None] | None = None  # rank 0, after each held-out evaluation
        self.lineage, self._writer_lock = parts.lineage, parts.writer_lock  # what checkpoints record; rank 0's lock
        self.records, self.images = parts.records, parts.images
        self.eval_records, self.eval_images = parts.eval_records, parts.eval_images
        self.device, self.policy, self.model = parts.device, parts.policy, parts.model
        self.updater: Updater | None = parts.updater  # None once closed
        self.core, self.order, self.packer = parts.core, parts.order, parts.packer
        self.checkpointer = parts.checkpointer
        # Where rollouts come from (learner.rollouts.interface): rank 0's server pool, or an engine in every rank
        # (colocate). `pool` and `sync_client` are the server pool's parts (None with colocate).
        self.no_rollouts, self.rollouts, self.ahead = parts.no_rollouts, parts.rollouts, parts.ahead
        self.pool, self.sync_client = parts.pool, parts.sync_client
        self.feed = parts.feed  # prompts, rollouts, what the engines serve (learner/train/feed.py)
        self._fresh_start_done = False  # an earlier run's checkpoints moved aside (`_begin`, runs not resumed)
        self.history: list[StepResult] = []
        self.evaluations: list[Evaluation] = []
        self.reporter: RunReporter | None = None  # rank 0's TensorBoard and held-out reports
        self.exported: Path | None = None
        self.pictures: list[Path] = []
        self.eval_pictures: list[Path] = []
        self._stop_why: str | None = None  # request_stop's reason (set from a signal handler)
        self._retries_at_start = m.counter_total(m.ROLLOUT_RETRIES)

    # -- the loop -------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> Summary:
        """Train until training.steps (or `max_steps` more steps); returns the summary."""
        t_start = time.perf_counter()
        st = self.state
        target = self._begin(max_steps)  # reporter, run.json, servers ready, first sync
        ck_every, ck_seconds = self.cfg.checkpoint.every, 60.0 * self.job.spec.checkpoint_minutes  # 0: none by time
        self.checkpointer.last_save_t = time.monotonic()  # every_minutes counts from here
        while st.step < target:
            result = self._train_step(time.perf_counter())  # plan -> rows -> forward/backward/optimizer
            st.step += 1
            self.history.append(result)
            self._publish(result)
            # The engines need these weights when the next step samples (a step that generates nothing, e.g. rollout
            # matching's ground-truth steps, waits for the weights of the step before one that does).
            if st.step < target and self.objective.plan(st.step).samples:
                self.sync_weights()
            saved = self.save() if self.checkpointer.due(st.step, ck_every, ck_seconds) else None
            if self._eval_due(target):
                self.evaluate_held_out()
            why = self._stop_agreed()
            if why is not None:  # the step is whole: keep it, then stop (a restart resumes here)
                raise StopRequested(why, st.step, saved if self.checkpointer.saved_step == st.step else self.save())
        return self._end(t_start)

    def request_stop(self, why: str) -> None:
        """Stop after the step in progress, with a checkpoint of it (`StopRequested`). Only sets a field: safe from
        a signal handler, and the step in progress (a collective on several ranks) is never cut midway."""
        self._stop_why = why

    def _stop_agreed(self) -> str | None:
        """The reason to stop now, agreed by every rank: one rank asked is every rank stopping at this same step
        (the checkpoint is collective). One small all-reduce per step on several ranks, nothing on one."""
        why = self._stop_why
        if self.ranks.enabled:
            asked = self.ranks.sum([0.0 if why is None else 1.0])[0]
            why = (why or "another rank was asked to stop") if asked > 0 else None
        return why

    def _begin(self, max_steps: int | None) -> int:
        """Start (or resume) a run: rank 0's reporter and run.json, the servers ready, weights synced once
        before the first rollout. Returns the step to stop at."""
        st = self.state
        target = self.cfg.steps if max_steps is None else min(self.cfg.steps, st.step + max_steps)
        if st.resumed is None and not self._fresh_start_done:  # once: a later run() call continues this run
            with self.ranks.guard("moving an earlier run's checkpoints aside (rank 0)"):
                self.checkpointer.start_fresh()
            self._fresh_start_done = True
        if self.ranks.is_main and self.reporter is None:
            # After resume(): TensorBoard hides what a crashed run wrote past its last checkpoint.
            self.reporter = RunReporter(tracker_of(self.job, resume_step=st.step + 1))
        self._log_start(target)
        if self.no_rollouts:  # no servers to wait for or to sync (a plain SFT run)
            return target
        with self.ranks.guard("waiting for the rollout servers (rank 0)"):
            if self.rollouts is not None:
                self.rollouts.wait_ready(timeout_s=self.job.spec.pool_wait_seconds)
        held = self.feed.hold_ahead()  # batches ahead keep their lag behind the weights across this sync
        self.sync_weights()  # once before the first rollout, and again on resume
        self.feed.restore_ahead(held)
        return target

    def _end(self, t_start: float) -> Summary:
        """The last checkpoint (unless one was just saved), rollout pictures, the export, the summary."""
        st, ck_every = self.state, self.cfg.checkpoint.every
        if (ck_every == 0 or st.step % ck_every) and self.checkpointer.saved_step != st.step:  # not twice
            self.save()
        if self.ranks.is_main:
            if self.policy.is_vision_language:  # the last rollouts drawn on their images
                self.pictures = write_rollout_pictures(
                    self.history,
                    self.records,
                    self.images,
                    self.cfg.checkpoint.dir,
                    self.eval_setup(self.images),
                    iou=self.cfg.eval.iou,
                )
            self.eval_pictures = write_eval_pictures(
                self.evaluations[-1] if self.evaluations else None,
                self.eval_images,
                self.cfg.checkpoint.dir,
                self.cfg.eval.pictures,
            )
        if st.step >= self.cfg.steps and self.cfg.export.enabled:
            self.export()
        return self.summary(time.perf_counter() - t_start)

    # -- held-out evaluation, export ------------------------------------------------------------
    def _eval_due(self, target: int) -> bool:
        """Every `eval.every` steps and after the last step of the run (same answer on every rank)."""
        every = self.cfg.eval.every
        return bool(self.cfg.eval.data) and (self.state.step == target or (every > 0 and self.state.step % every == 0))

    def evaluate_held_out(self) -> Evaluation | None:
        """Greedy answers to `training.eval`'s records from the servers holding this step's weights (synced
        first when they hold older ones), scored and reported (log, /metrics, TensorBoard). Every rank calls
        it (a sync is collective); rank 0 returns the evaluation, other ranks None."""
        if self.ahead is not None:
            self.ahead.drain()  # one generate call at a time on the client
        if self.feed.served_step != self.state.step:
            self.sync_weights()
        ev = None
        # Every rank enters the guard (its failure agreement is collective); rank 0 alone talks to the servers.
        with self.phases.time("eval"), self.ranks.guard("evaluating the held-out records (rank 0)"):
            if self.ranks.is_main:
                ev = evaluate(
                    _open(self.rollouts),
                    self.eval_records,
                    _open(self.eval_images),
                    step=self.state.step,
                    setup=self.eval_setup(_open(self.eval_images)),
                    version=self.state.version,
                    iou=self.cfg.eval.iou,
                    max_tokens=self.cfg.eval.max_tokens or self.cfg.rollout.max_tokens,
                )
                self.evaluations.append(ev)
                _open(self.reporter).evaluation(ev, _open(self.eval_images), self.cfg.eval.pictures)
        if ev is not None and self.on_eval:
            self.on_eval(ev)
        return ev

    def eval_setup(self, images: ImageStore) -> EvalSetup:
        """How this run's answers to records whose images `images` holds are scored (`RolloutFeed.eval_setup`)."""
        return self.feed.eval_setup(images, self.core.fmt, self.core.matching)

    def export(self) -> Path | None:
        """The trained model as a Hugging Face folder at `training.export` (rank 0 writes it; with ZeRO-3 every
        rank gathers the weights first). A folder that cannot be written is an error: the export is what a
        user takes away, but the checkpoint just saved still holds the weights (`rmsft export` redoes it)."""
        out = Path(self.cfg.export_dir)
        with (
            self.phases.time("export"),
            self.ranks.guard(f"exporting the model to {out} (rank 0)"),
            gathered_weights(_open(self.updater), self.model),
        ):
            if self.ranks.is_main:
                self.exported = export_trained(
                    self.model,
                    self.policy,
                    out,
                    adapter_only=self.cfg.export.adapter,
                    base_model_dir=self.job.spec.model.path,
                )
                log.info(
                    "trained model exported to %s (%s)",
                    self.exported,
                    "adapter" if self.cfg.export.adapter else "merged weights",
                )
        return self.exported

    # -- one optimizer step ---------------------------------------------------------------------
    def _train_step(self, t0: float) -> StepResult:
        """Optimizer step `state.step + 1`, the whole of it."""
        st, objective = self.state, self.objective
        plan = objective.plan(st.step)  # what the step needs: a pure function of the step index
        built = objective.build(plan)  # this rank's rows: rollouts (or the ground truth) -> targets -> packed rows
        totals, n_rows, fill = self._update(built)  # forward, loss, backward, optimizer over every rank's rows
        out = objective.outcome(built, totals)  # its rollouts, loss parts and own figures
        return StepResult(
            step=st.step + 1,
            weight_version=st.version,
            rank=self.ranks.rank,
            seconds=time.perf_counter() - t0,
            record_ids=[self.records[i].id for i in plan.batch],
            loss=totals["loss"],
            rows=n_rows,
            fill=fill,
            local_rows=len(built.rows),
            local_tokens=sum(r.length for r in built.rows),
            local_record_ids=list(built.local_ids),
            rollouts=out.rollouts,
            parts=out.parts,
            figures=out.figures,
        )

    def _update(self, built: Built) -> tuple[dict[str, float], int, float]:
        """One optimizer step on every rank's rows. The loss is normalised by the objective's totals over all ranks
        (exchanged before the forward), so the step is one process training on all the rows. Returns the device
        step's sums over rows and ranks, the number of rows and their mean fill."""
        *totals, n_rows, fill_sum = self.ranks.sum(
            [*self.objective.denominators(built), len(built.rows), sum(r.fill for r in built.rows)]
        )
        if not n_rows:
            raise RuntimeError(
                f"the step packed into no row on any rank ({self.objective.name}: empty rollouts and "
                "an empty carry buffer)"
            )
        lr = learning_rate(self.cfg, self.state.step)
        with self.ranks.guard("forward/backward"):
            sums = self.device_step(built, totals, lr)
        keys = self.objective.loss_keys  # the only host reads of the step: after it, once
        return (
            dict(zip(keys, self.ranks.sum([float(sums[k]) for k in keys]), strict=True)),
            int(n_rows),
            fill_sum / n_rows,
        )

    def device_step(self, built: Built, totals: Sequence[float], lr: float) -> dict[str, torch.Tensor]:
        """Forward/backward of every row on the training device, then the optimizer step. The objective's row loss
        gives each row's share of the step's loss (normalised by the step's global `totals`, so the rows' gradients
        add up to the pooled loss's), its `prepare` what a row needs before its forward. Returns the loss and
        metrics summed over the rows as device tensors: no host reads, so it runs with the parameters on `meta`."""
        row_loss, prepare = self.objective.row_loss(built, totals)
        return self._optimize(built.rows, lr, row_loss, prepare)

    def _optimize(
        self, rows: Sequence[PackedRow], lr: float, row_loss: RowLoss, prepare: Prepare | None = None
    ) -> dict[str, torch.Tensor]:
        updater = _open(self.updater)
        sums: dict[str, torch.Tensor] = {}
        mode = self.cfg.loss.logits if self.objective.chunked_logits else "full"  # chunked: a RowHead, see below
        updater.begin()
        for i, cpu_row in enumerate(rows):
            row = cpu_row.to(updater.device)
            before = prepare(i, row) if prepare is not None else None
            with self.phases.time("forward"), updater.autocast():
                logits = row_outputs(updater.forward, self.model, row.model_inputs(), mode, self.cfg.loss.logits_chunk)
                loss, metrics = row_loss(row, logits, before)
            with self.phases.time("backward"):
                updater.backward(loss)
            for k, v in (("loss", loss.detach()), *metrics.items()):
                sums[k] = sums[k] + v if k in sums else v
            m.TRAINED_TOKENS.inc(row.length)
        with self.phases.time("optimizer"):
            updater.finish(len(rows), lr)
        return sums

    # -- sync, checkpoints ----------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Push the learner's current weights to every engine as a new version (before each step that samples, and
        when an evaluation finds the engines behind); every rank calls it (collective under ZeRO-3 and colocate)."""
        with self.phases.time("sync_drain"):
            self.feed.before_sync()  # no Generate call in flight across a weight update (overlap.py)
        version = self.state.version + 1
        # ZeRO-3: whole weights on every rank while rank 0 exports them (collective).
        with (
            self.phases.time("sync"),
            self.ranks.guard(f"syncing weight version {version}"),
            gathered_weights(_open(self.updater), self.model),
        ):
            if self.rollouts is not None:  # rank 0's pool, or every rank's in-process engine
                self.rollouts.sync(version)  # counts bytes and sets the version gauge itself
        self.state.version = version  # only once the engines confirmed it (sync raises otherwise)
        self.feed.synced()  # likewise: a failed sync leaves the servers on the last version

    def save(self) -> Path | None:
        self.checkpointer.extra.update(self.feed.state_dict())  # rank 0's rollouts generated ahead (overlap.py)
        return self.checkpointer.save()

    def resume(self) -> bool:
        """Continue from the newest checkpoint (False when there is none). The run id stays this run's:
        the next sync announces a version no server can already hold (module doc)."""
        found = self.checkpointer.resume()
        if found:  # the servers hold none of the checkpoint's weights under this run's id
            self.feed.load_state_dict(self.checkpointer.loaded_extra)
        return found

    step = property(lambda self: self.state.step, doc="The last optimizer step done (state.step).")
    version = property(lambda self: self.state.version, doc="The learner's weight version number (state.version).")

    @property
    def deepspeed_engine(self) -> object | None:
        """The DeepSpeed engine, when training.deepspeed_stage > 0 (not a rollout engine)."""
        return self.updater.ds_engine if isinstance(self.updater, ZeroUpdater) else None

    # -- reporting ------------------------------------------------------------------------------
    def _log_start(self, target: int) -> None:
        if self.ranks.is_main:  # run.json and the run's first log lines
            log_run_start(
                self.job,
                self.state,
                self.rollouts.describe() if self.rollouts is not None else None,
                records=len(self.records),
                target=target,
                world_size=self.ranks.world_size,
                device=self.device,
                deepspeed=self.deepspeed_engine is not None,
            )

    def _publish(self, r: StepResult) -> None:
        m.GLOBAL_STEP.set(r.step)
        m.STEP_SECONDS.observe(r.seconds)
        m.PACKING_FILL.set(r.fill)
        m.LOSS.labels("total").set(r.loss)
        for k, v in r.parts.items():
            m.LOSS.labels(k).set(v)
        publish_figures(r.figures)  # the objective's own: /metrics' generic figure gauge, and its own gauges
        if self.ranks.is_main:
            _open(self.reporter).step(r, self.state.phase_seconds, learning_rate(self.cfg, r.step - 1))
            log.info("%s", self.objective.line(r))
        if self.on_step:
            self.on_step(r)

    def summary(self, wall: float) -> Summary:
        return Summary.of_run(
            self.state,
            self.history,
            self.evaluations,
            wall_seconds=wall,
            eval_iou=self.cfg.eval.iou,
            retries=int(m.counter_total(m.ROLLOUT_RETRIES) - self._retries_at_start),
            pictures=list(self.pictures),
            eval_pictures=list(self.eval_pictures),
            exported=self.exported,
            log_dir=Path(self.cfg.tensorboard_dir)
            if self.ranks.is_main and "tensorboard" in self.cfg.report_to
            else None,
        )

    def close(self) -> None:
        for part in (self.ahead, self.rollouts, self.updater, self.reporter, self.objective, self._writer_lock):
            if part is not None:
                part.close()
        self.updater = None
        self.ranks.close()
