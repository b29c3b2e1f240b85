"""The learner's one training loop, read top to bottom in `TrainingLoop.run`:

    step     the step kind's rollouts -> targets -> packed rows -> one optimizer step (`_train_step`)
    publish  the step's figures: log line, /metrics, TensorBoard (`_publish`)
    sync     the new weights to the rollout engines, when the next step samples (`_samples_at`)
    checkpoint, held-out evaluation, and at the end the last checkpoint, pictures and the export.

What a step is belongs to the objective, a subclass that supplies `_train_step`, `_samples_at`, its packer and
its figures: `learner.train.rollout_matching.Trainer` (rollout-matching SFT; the recipe's channel-A steps teach
the ground truth, channel-B steps the model's own answers) and `learner.train.grpo.GrpoTrainer`. Everything
else is written once here: setup, the rollout source (server pool or in-process engine), weight sync, checkpoints
and resume, evaluation, export, reporting. Who gets which rollouts between ranks, the channel schedule and the
staleness window are `learner.train.handout`'s.

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

import json
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from learner.core.packing import PackedRow, Packer
from learner.data.dataset import load_dataset
from learner.data.episode import vision_token_ids
from learner.data.images import ImageStore
from learner.data.order import DataOrder
from learner.data.records import Record
from learner.data.vision import VisionPrompt, render_prompt, resized_image_size
from learner.evaluation.held_out import EvalSetup, Evaluation, evaluate
from learner.rollouts.colocate import colocated_rollouts
from learner.rollouts.interface import RolloutSource, SourceInfo
from learner.rollouts.pool import ServerPool, ServersFile
from learner.sync.client import WeightSyncClient
from learner.tracking import metrics as m
from learner.tracking.run_record import run_record, write_run_record
from learner.tracking.tracker import Tracker, check_writable
from learner.train import zero
from learner.train.checkpoint_files import check_checkpoint_dir
from learner.train.checkpointer import Checkpointer, TrainState
from learner.train.config import core_configs, learning_rate
from learner.train.export import export_trained
from learner.train.handout import RolloutHandout
from learner.train.overlap import RolloutsAhead
from learner.train.policy import Policy, load_policy, prompt_ids
from learner.train.ranks import Ranks
from learner.train.reporting import RunReporter, write_eval_pictures, write_rollout_pictures
from learner.train.results import StepResult, Summary
from learner.train.server_setup import build_server_rollouts
from learner.train.start_checks import check_images_fit, check_memory_plan, collective_timeout_s
from learner.train.step import PlainStep, ZeroStep, gathered_weights, make_step, resolve_device
from rmsft.jobspec import RolloutMatchingJob
from rmsft.weight_wire import new_run_id

__all__ = ["TrainingLoop"]

log = logging.getLogger("rmsft.learner")

# One row's loss and the metrics summed beside it (device tensors), given the row on the device, its logits and
# what `prepare` computed for it before the forward.
RowLoss = Callable[[PackedRow, torch.Tensor, Any], tuple[torch.Tensor, Mapping[str, torch.Tensor]]]


class StopRequested(Exception):  # noqa: N818 - a request, not an error
    """The run was asked to stop (`TrainingLoop.request_stop`: SIGTERM to `rmsft train`, i.e. an eviction, a node
    drain, a preemption): raised on every rank after the step in progress, once the checkpoint of that step is
    written, so a restart resumes there instead of at the last periodic checkpoint."""

    def __init__(self, why: str, step: int, checkpoint: Path | None) -> None:
        where = f"checkpoint {checkpoint} written" if checkpoint is not None else "its checkpoint written by rank 0"
        super().__init__(f"stopped ({why}) after step {step}: {where}; a restart resumes from it")
        self.why, self.step, self.checkpoint = why, step, checkpoint


class TrainingLoop(RolloutHandout, ABC):
    """The learner loop (module doc); an objective subclass says what one step is. Under torchrun (WORLD_SIZE > 1)
    or with `process_group`, one rank of a data-parallel group: only rank 0 builds the server pool and talks to the
    rollout servers. `addresses`: the ordered server list, or a `ServersFile` the pool follows during the run.
    `device` overrides `training.device` (tests run a step on the `meta` device)."""

    def __init__(
        self,
        job: RolloutMatchingJob,
        addresses: Sequence[str] | ServersFile,
        *,
        auth_token: str | None = None,
        model_path: str | Path | None = None,
        on_step: Callable[[StepResult], None] | None = None,
        process_group: torch.distributed.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.job = job
        self.cfg = job.spec.training
        self.on_step = on_step  # called on every rank with that rank's StepResult
        self.on_eval: Callable[[Evaluation], None] | None = None  # rank 0, after each held-out evaluation
        self.ranks = Ranks(process_group) if process_group is not None else Ranks.from_env(collective_timeout_s(job))
        # Where rollouts come from (learner.rollouts.interface): rank 0's server pool, or an engine in every rank
        # (colocate). `pool` and `sync_client` are the server pool's parts (None with colocate).
        self.rollouts: RolloutSource | None = None
        self.pool: ServerPool | None = None
        self.sync_client: WeightSyncClient | None = None
        self.ahead: RolloutsAhead | None = None  # rank 0: rollouts generated ahead of training (overlap.py)
        self._resumed_ahead: list[dict] = []  # rank 0: a checkpoint's batches ahead, put back by _begin
        self._fresh_start_done = False  # an earlier run's checkpoints moved aside (`_begin`, runs not resumed)
        self.train_step: PlainStep | ZeroStep | None = None
        self.state = TrainState()
        self.history: list[StepResult] = []
        self.evaluations: list[Evaluation] = []
        self.reporter: RunReporter | None = None  # rank 0's TensorBoard and held-out reports
        self.exported: Path | None = None
        self._stop_why: str | None = None  # request_stop's reason (set from a signal handler)
        try:
            self._setup(job, addresses, auth_token, model_path, device)
        except BaseException:
            self.close()
            raise

    def _setup(self, job: RolloutMatchingJob, addresses: Sequence[str] | ServersFile, auth_token: str | None,
               model_path: str | Path | None, device: torch.device | str | None) -> None:
        ranks, cfg = self.ranks, self.cfg
        if not ranks.is_main:
            log.setLevel(logging.WARNING)  # the one-line-per-step log is rank 0's
        # This run's identity, in every weight version it announces: rank 0's, on every rank.
        self.state.run_id = ranks.broadcast_from_main(new_run_id() if ranks.is_main else None)
        if ranks.is_main:
            m.set_run(self.state.run_id)
            log.info("learner run %s (this process's own; a restart makes a new one)", self.state.run_id)
        if cfg.prompts_per_step < ranks.world_size:
            raise ValueError(
                f"spec.training.prompts_per_step ({cfg.prompts_per_step}) is the global batch and must be "
                f">= the number of learner ranks ({ranks.world_size})"
            )
        with ranks.guard("checking spec.training.checkpoint.dir (rank 0)"):
            if ranks.is_main:  # the rank that writes checkpoints; before anything is paid for
                check_checkpoint_dir(cfg.checkpoint.dir)
                check_writable(Path(cfg.tensorboard_dir))  # TensorBoard's folder: now, not after training
        with ranks.guard("checking the memory plan"):
            check_memory_plan(job, log_it=ranks.is_main)  # before anything is loaded: say which knob to turn
        with ranks.guard("loading the data and the model"):
            if cfg.deepspeed_stage:
                zero.require_deepspeed(cfg.deepspeed_stage)
            vision = job.spec.model.vision
            # Every image is opened and checked here, before anything is paid for.
            self.images: ImageStore
            self.records, self.images = load_dataset(cfg.data.path, cfg.data.image_root, vision.max_image_pixels)
            self.eval_records: list[Record] = []
            self.eval_images: ImageStore | None = None
            if cfg.eval.data and ranks.is_main:  # held-out records: rank 0 evaluates
                held, self.eval_images = load_dataset(cfg.eval.data, cfg.eval.image_root, vision.max_image_pixels)
                self.eval_records = held[: cfg.eval.max_samples]
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
            self.device = torch.device(device) if device is not None else resolve_device(cfg.device)
            self.policy: Policy = load_policy(model_path or job.spec.model.path, cfg, job.spec.model.dtype, vision)
            check_images_fit(self.records, self.policy, vision.max_images_per_prompt, cfg.data.path)
        self.model = self.policy.model.to(self.device)
        ranks.broadcast_params([p for p in self.model.parameters() if p.requires_grad])  # rank 0's init (LoRA)
        if ranks.rank:
            torch.manual_seed(cfg.seed + ranks.rank)  # e.g. dropout masks differ per rank
            random.seed(cfg.seed + ranks.rank)
        with ranks.guard("setting up the optimizer step"):
            self.train_step = make_step(self.model, ranks, cfg, device=self.device,
                                        autocast_dtype=self.policy.autocast_dtype)
        self.device = self.train_step.device  # DeepSpeed may have placed the module itself
        self.core = core_configs(cfg)
        self.order = DataOrder(len(self.records), cfg.prompts_per_step, cfg.seed)
        self.packer = self._make_packer()
        self.checkpointer = Checkpointer(cfg, ranks, self.model, self.train_step, self.packer, self.state)
        model_dir = model_path or job.spec.model.path
        # No servers at all (server mode): a plain SFT run (every step a warm-start step, no held-out evaluation)
        # needs none, e.g. the pretraining of `rmsft local`'s tiny model (learner.local.pretrain_tiny_model).
        self.no_rollouts = (not job.spec.rollout.colocated and not isinstance(addresses, ServersFile)
                            and not list(addresses))
        if self.no_rollouts and (cfg.warm_start_steps < cfg.steps or cfg.eval.data):
            raise ValueError("no rollout servers given: only a run whose every step is a warm-start step "
                             "(training.warm_start_steps >= training.steps) and that has no training.eval.data "
                             "runs without them")
        if job.spec.rollout.colocated:
            with ranks.guard("starting the in-process rollout engine"):
                self.rollouts = colocated_rollouts(
                    job, self.model, self.policy.tokenizer, run_id=self.state.run_id, world_size=ranks.world_size,
                    rank=ranks.rank, model_dir=model_dir, vision_language=self.policy.is_vision_language,
                    around_generation=self._around_generation,
                )
        else:
            with ranks.guard("connecting to the rollout servers (rank 0)"):
                if ranks.is_main and not self.no_rollouts:  # the only rank that talks to rollout servers
                    # Every E-step's rollouts go through it (max_staleness 0: generated inline, as always).
                    self.ahead = RolloutsAhead(lambda reqs, sampling, v: self.rollouts.generate(
                        reqs, sampling, weight_version=v), cfg.rollout.max_staleness)
                    source = build_server_rollouts(
                        job, addresses, self.model, run_id=self.state.run_id, auth_token=auth_token,
                        checkpoint_dir=model_dir, vision_language=self.policy.is_vision_language,
                        zero3=cfg.deepspeed_stage == 3,
                        fence_resync=self.ahead.fenced_resync,  # none while weights move
                    )
                    self.rollouts, self.pool, self.sync_client = source, source.pool, source.sync_client
                    self.ahead.abort = source.abort  # close(): a call still running ahead is ended, then waited for
        self._prompt_cache: dict[int, list[int]] = {}  # text models: a record's prompt ids
        self._step_prompts: dict[int, VisionPrompt] = {}  # vision-language models: this E-step's renderings
        self.pictures: list[Path] = []
        self.eval_pictures: list[Path] = []
        # Image/video tokens a rollout may sample: its answer is cut before the first (episode.vision_safe_response).
        self.vision_token_ids = (vision_token_ids(self.policy.tokenizer) if self.policy.is_vision_language
                                 else frozenset())
        self._retries_at_start = m.counter_total(m.ROLLOUT_RETRIES)
        self._served_step = -1  # the step whose weights the servers hold (after a sync)
        self._setup_objective()

    # -- what the objective supplies --------------------------------------------------------------
    def _setup_objective(self) -> None:
        """The objective's own parts, once the loop's are set up."""

    @abstractmethod
    def _make_packer(self) -> Packer:
        """This rank's packer (one per rank, lives across steps; the checkpoint keeps its carry buffer)."""

    @abstractmethod
    def _train_step(self, t0: float) -> StepResult:
        """Optimizer step `state.step + 1`: its rollouts (or ground truth), targets, packed rows, the update."""

    @abstractmethod
    def _samples_at(self, step: int) -> bool:
        """Optimizer step `step` (0-based) starts from fresh rollouts, so the engines need the weights before it."""

    def _step_metrics(self, r: StepResult) -> None:
        """The objective's own gauges of a step (the loop sets the step, its time, fill and total loss)."""

    @abstractmethod
    def _step_line(self, r: StepResult) -> str:
        """Rank 0's one log line of a step."""

    # -- the loop -------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> Summary:
        """Train until training.steps (or `max_steps` more steps); returns the summary."""
        t_start = time.perf_counter()
        st = self.state
        target = self._begin(max_steps)  # reporter, run.json, servers ready, first sync
        ck_every = self.cfg.checkpoint.every
        while st.step < target:
            result = self._train_step(time.perf_counter())  # rollouts -> targets -> rows -> optimizer step
            st.step += 1
            self.history.append(result)
            self._publish(result)
            # The engines need these weights when the next step samples (a channel-A step, the warm start's
            # included, generates nothing, so they wait for the weights of the step before one that does).
            if st.step < target and self._samples_at(st.step):
                self._sync()
            due = bool(ck_every) and st.step % ck_every == 0
            saved = self.save() if due else None
            if self._eval_due(target):
                self.evaluate_held_out()
            why = self._stop_agreed()
            if why is not None:  # the step is whole: keep it, then stop (a restart resumes here)
                raise StopRequested(why, st.step, saved if due else self.save())
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
            self.reporter = RunReporter(Tracker(self.cfg.tensorboard_dir, run_name=self.job.metadata.name,
                                                config=self.job.to_manifest(), resume_step=st.step + 1))
        self._log_start(target)
        if self.no_rollouts:  # no servers to wait for or to sync (a plain SFT run)
            return target
        with self.ranks.guard("waiting for the rollout servers (rank 0)"):
            if self.rollouts is not None:
                self.rollouts.wait_ready(timeout_s=self.cfg.rollout.request_timeout_s)
        # Batches ahead (of a checkpoint, or of this process's previous run() call) keep their lag behind the
        # weights across the sync below, which announces the same weights under a new number.
        if self.ahead is not None:
            self.ahead.drain()  # a batch still generating is kept too (saved() takes complete ones)
        ahead = self.ahead.saved(self._served_version()) if self.ahead is not None else []
        self._sync()  # once before the first rollout, and again on resume
        if self.ahead is not None:
            self.ahead.restore(ahead or self._resumed_ahead, st.version)
            self._resumed_ahead = []
        return target

    def _end(self, t_start: float) -> Summary:
        """The last checkpoint (unless one was just saved), rollout pictures, the export, the summary."""
        st, ck_every = self.state, self.cfg.checkpoint.every
        if ck_every == 0 or st.step % ck_every:
            self.save()
        if self.ranks.is_main:
            if self.policy.is_vision_language:  # the last rollouts drawn on their images
                self.pictures = write_rollout_pictures(self.history, self.records, self.images,
                                                       self.cfg.checkpoint.dir, self.eval_setup(self.images),
                                                       iou=self.cfg.eval.iou)
            self.eval_pictures = write_eval_pictures(self.evaluations[-1] if self.evaluations else None,
                                                     self.eval_images, self.cfg.checkpoint.dir,
                                                     self.cfg.eval.pictures)
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
        if self._served_step != self.state.step:
            self._sync()
        ev = None
        # Every rank enters the guard (its failure agreement is collective); rank 0 alone talks to the servers.
        with self._phase("eval"), self.ranks.guard("evaluating the held-out records (rank 0)"):
            if self.ranks.is_main:
                ev = evaluate(self.rollouts, self.eval_records, self.eval_images, self.eval_setup(self.eval_images),
                              version=self.state.version, iou=self.cfg.eval.iou, step=self.state.step,
                              max_tokens=self.cfg.eval.max_tokens or self.cfg.rollout.max_tokens)
                self.evaluations.append(ev)
                self.reporter.evaluation(ev, self.eval_images, self.cfg.eval.pictures)
        if ev is not None and self.on_eval:
            self.on_eval(ev)
        return ev

    def eval_setup(self, images: ImageStore) -> EvalSetup:
        """How this run's answers to records whose images `images` holds are scored: its vocabulary, output
        format (bound to each image's resized size when it measures in resized pixels) and matcher."""
        size = None
        if self.core.fmt.needs_image_size:
            def size(rec: Record) -> tuple[int, int] | None:
                imgs = images.load(rec)
                return resized_image_size(self.policy.processor, imgs[0].pil()) if imgs else None
        return EvalSetup(vocab=self.policy.vocab, fmt=self.core.fmt, matching=self.core.matching,
                         vision_ids=self.vision_token_ids, image_size=size)

    def export(self) -> Path | None:
        """The trained model as a Hugging Face folder at `training.export` (rank 0 writes it; with ZeRO-3 every
        rank gathers the weights first). A folder that cannot be written is an error: the export is what a
        user takes away, but the checkpoint just saved still holds the weights (`rmsft export` redoes it)."""
        out = Path(self.cfg.export_dir)
        with self._phase("export"), self.ranks.guard(f"exporting the model to {out} (rank 0)"), \
                gathered_weights(self.train_step, self.model):
            if self.ranks.is_main:
                self.exported = export_trained(self.model, self.policy, out, adapter_only=self.cfg.export.adapter,
                                               base_model_dir=self.job.spec.model.path)
                log.info("trained model exported to %s (%s)", self.exported,
                         "adapter" if self.cfg.export.adapter else "merged weights")
        return self.exported

    # -- one optimizer step ---------------------------------------------------------------------
    def _step_result(self, t0: float, **fields: Any) -> StepResult:
        """The step's result: the loop's fields (step number, weight version, rank, seconds) and the objective's."""
        return StepResult(step=self.state.step + 1, weight_version=self.state.version, rank=self.ranks.rank,
                          seconds=time.perf_counter() - t0, **fields)

    def _optimize(self, rows: Sequence[PackedRow], lr: float, row_loss: RowLoss,
                  prepare: Callable[[int, PackedRow], Any] | None = None) -> dict[str, torch.Tensor]:
        """Forward/backward of every row on the training device, then the optimizer step. `row_loss` gives each
        row's share of the step's loss (normalised by the step's global totals, so the rows' gradients add up to the
        pooled loss's); `prepare(i, row)` what row i needs before its forward (e.g. reference log-probs). Returns
        the loss and metrics summed over the rows as device tensors: no host reads, so it runs with the parameters
        on `meta`."""
        step = self.train_step
        sums: dict[str, torch.Tensor] = {}
        step.begin()
        for i, cpu_row in enumerate(rows):
            row = cpu_row.to(step.device)
            before = prepare(i, row) if prepare is not None else None
            with self._phase("forward"), step.autocast():
                logits = step.forward(**row.model_inputs()).logits
                loss, metrics = row_loss(row, logits, before)
            with self._phase("backward"):
                step.backward(loss)
            for k, v in (("loss", loss.detach()), *metrics.items()):
                sums[k] = sums[k] + v if k in sums else v
            m.TRAINED_TOKENS.inc(row.length)
        with self._phase("optimizer"):
            step.finish(len(rows), lr)
        return sums

    # -- sync, checkpoints ----------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Push the learner's current weights to every server as a new version (evaluations between
        steps, e.g. during a warm start that does not sync)."""
        self._sync()

    def _sync(self) -> None:
        # The sync policy (learner/train/overlap.py): no Generate call in flight across a weight update, including
        # one whose batch was abandoned.
        if self.ahead is not None and self.ahead.pending():
            with self._phase("sync_drain"):
                self.ahead.drain()
        version = self.state.version + 1
        # ZeRO-3: whole weights on every rank while rank 0 exports them (collective).
        with self._phase("sync"), self.ranks.guard(f"syncing weight version {version}"), \
                gathered_weights(self.train_step, self.model):
            if self.rollouts is not None:  # rank 0's pool, or every rank's in-process engine
                self.rollouts.sync(version)  # counts bytes and sets the version gauge itself
        self.state.version = version  # only once the engines confirmed it (sync raises otherwise)
        self._served_step = self.state.step  # likewise: a failed sync leaves the servers on the last version
        if self.ahead is not None:
            self.ahead.synced()

    def _served_version(self) -> int:
        """The version number that serves the model's current weights: the last synced one, or the next when the
        weights moved since (a batch ahead keeps its lag behind these weights across a checkpoint or a re-sync)."""
        return self.state.version + (self._served_step != self.state.step)

    def save(self) -> Path | None:
        if self.ahead is not None:  # rank 0: the rollouts generated ahead go into the checkpoint (overlap.py)
            self.checkpointer.extra["rollouts_ahead"] = self.ahead.saved(self._served_version())
        return self.checkpointer.save()

    def resume(self) -> bool:
        """Continue from the newest checkpoint (False when there is none). The run id stays this run's:
        the next sync announces a version no server can already hold (module doc)."""
        found = self.checkpointer.resume()
        if found:
            self._served_step = -1  # the servers hold none of the checkpoint's weights under this run's id
            self._resumed_ahead = list(self.checkpointer.loaded_extra.get("rollouts_ahead", []))
        return found

    def gathered_trainable_state(self) -> dict[str, torch.Tensor]:
        return self.checkpointer.gathered_trainable_state()

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def engine(self) -> object | None:
        """The DeepSpeed engine, when training.deepspeed_stage > 0."""
        return getattr(self.train_step, "engine", None)

    def _around_generation(self) -> AbstractContextManager:
        """Colocate: what happens to the training state while the in-process engine decodes: parameters and/or
        optimizer state to host memory (spec.rollout.colocate offloadModel / offloadOptimizer), back after."""
        c = self.job.spec.rollout.colocate
        if not (c.offload_model or c.offload_optimizer):
            return nullcontext()
        from learner.train.offload import offloaded

        return offloaded(self.train_step, self.model, params=c.offload_model, optimizer=c.offload_optimizer)

    # -- reporting ------------------------------------------------------------------------------
    @contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add_phase(name, time.perf_counter() - t0)

    def _add_phase(self, name: str, seconds: float) -> None:
        m.PHASE_SECONDS.labels(name).observe(seconds)
        self.state.phase_seconds[name] = self.state.phase_seconds.get(name, 0.0) + seconds

    def _vision_prompt(self, idx: int) -> VisionPrompt:
        """The learner's rendering of a record's prompt with its images (read through the image store's
        cache, the same bytes the servers got); rendered once per E-step (pixels are not kept longer)."""
        if idx not in self._step_prompts:
            rec = self.records[idx]
            images = [img.pil() for img in self.images.load(rec)]
            self._step_prompts[idx] = render_prompt(self.policy.processor, [m.model_dump() for m in rec.messages],
                                                    images)
        return self._step_prompts[idx]

    def _prompt_ids(self, idx: int) -> list[int]:
        """The learner's prompt ids of a record (with its images expanded, for a vision-language model)."""
        return self._vision_prompt(idx).input_ids if self.policy.is_vision_language else self._prompt(idx)

    def _prompt(self, idx: int) -> list[int]:
        if idx not in self._prompt_cache:
            msgs = [msg.model_dump() for msg in self.records[idx].messages]
            self._prompt_cache[idx] = prompt_ids(self.policy.tokenizer, msgs)
        return self._prompt_cache[idx]

    def _log_start(self, target: int) -> None:
        if self.ranks.is_main:
            source = self.rollouts.describe() if self.rollouts is not None else SourceInfo("none", (), "none", "none")
            record = run_record(self.job, servers=list(source.servers), rollout_mode=source.mode,
                                sync_mode=source.sync_mode, sync_transport=source.sync_transport,
                                world_size=self.ranks.world_size,
                                model_dir=self.job.spec.model.path, data_path=self.cfg.data.path,
                                image_root=self.cfg.data.image_root, eval_data_path=self.cfg.eval.data,
                                eval_image_root=self.cfg.eval.image_root)
            # Which run this is, and which runs wrote the checkpoint it resumed from (oldest first).
            st = self.state
            record["run_id"] = st.run_id
            if st.resumed is not None:
                record["resumed_from"] = {"step": st.resumed.step, "weight_version": st.resumed.weights.number,
                                          "run_id": st.resumed.weights.run_id, "run_ids": list(st.resumed.run_ids)}
            try:
                path = write_run_record(self.cfg.checkpoint.dir, record)
                log.info("run record (servers, seeds, versions, hashes, resolved spec): %s", path)
            except OSError as exc:  # the checkpoint dir was writable at start: say so, keep training
                log.warning("could not write run.json to %s: %s", self.cfg.checkpoint.dir, exc)
            # The record itself in the log too (the spec is long and already in run.json: left out here).
            log.info("run: %s", json.dumps({k: v for k, v in record.items() if k != "job"}, default=str))
            log.info(
                "rmsft learner run %s: %d record(s), %s, sync %s, seed %d, steps %d -> %d, ranks %d, "
                "device %s%s", self.state.run_id, len(self.records),
                f"servers {list(source.servers)}" if source.mode != "colocate" else "rollout engine in-process",
                self.job.spec.sync.mode if source.mode == "server" else source.sync_mode,
                self.cfg.seed, self.state.step, target, self.ranks.world_size, self.device,
                f", DeepSpeed ZeRO-{self.cfg.deepspeed_stage}" if self.engine is not None else "",
            )

    def _publish(self, r: StepResult) -> None:
        m.GLOBAL_STEP.set(r.step)
        m.STEP_SECONDS.observe(r.seconds)
        m.PACKING_FILL.set(r.fill)
        m.LOSS.labels("total").set(r.loss)
        self._step_metrics(r)
        if self.ranks.is_main:
            self.reporter.step(r, self.state.phase_seconds, learning_rate(self.cfg, r.step - 1))
            log.info("%s", self._step_line(r))
        if self.on_step:
            self.on_step(r)

    def summary(self, wall: float) -> Summary:
        losses = [h.loss for h in self.history]
        return Summary(
            steps=self.state.step, first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"), losses=losses,
            # Rollout F1 of steps that sampled (a channel-A step's empty answers score 0 and say nothing).
            f1=[h.stats.f1 for h in self.history if h.stats and h.channel == "B"],
            weight_version=self.state.version,
            run_id=self.state.run_id,
            phase_seconds=dict(self.state.phase_seconds), wall_seconds=wall,
            retries=int(m.counter_total(m.ROLLOUT_RETRIES) - self._retries_at_start), history=list(self.history),
            pictures=list(self.pictures), evaluations=[(e.step, e.f1, e.map) for e in self.evaluations],
            eval_iou=self.cfg.eval.iou, held_out=[e.figures() for e in self.evaluations],
            eval_pictures=list(self.eval_pictures),
            log_dir=Path(self.cfg.tensorboard_dir) if self.ranks.is_main else None, exported=self.exported,
        )

    def close(self) -> None:
        for part in (self.ahead, self.rollouts, self.train_step, self.reporter):
            if part is not None:
                part.close()
        self.train_step = None
        self.ranks.close()

