"""The learner's training loop: rollouts -> segments -> packed rows -> optimizer step -> weight sync.

One optimizer step = `grad_accumulation` packed rows (micro-steps). With the rollout buffer on, an
E-step (rollouts + targets + packing) feeds `m_steps` optimizer steps; weights are synced only
before fresh rollouts (and once before the first), never per micro-step.

Several ranks (torchrun, or a process group passed in) train data-parallel: rank 0 alone owns the
server pool, generates the whole global batch (`prompts_per_step` is global) and hands each rank a
contiguous share; every rank builds its own segments into its own packer. The step's loss is the
token-level mean over all ranks' rows (target counts are summed over ranks first), gradients are
summed over ranks before clipping, and every rank takes the same optimizer step, so the result is
one process training on all the rows. Rank 0 then syncs the servers. See learner/train/ranks.py.

Each learner process is one run with an id of its own (rank 0 makes it, the others receive it), new
after every restart: weight versions are (run id, number), so what a resumed learner announces is never
taken for what the run that wrote its checkpoint announced (`rmsft.weight_wire.version`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from learner.core.losses import loss_sums
from learner.core.packing import PackedRow, Packer
from learner.core.rollout_buffer import RolloutBuffer
from learner.data.dataset import load_dataset
from learner.data.episode import (
    EpisodeStats,
    build_segments,
    check_rollout_prompts,
    vision_safe_response,
    vision_token_ids,
)
from learner.data.images import ImageStore
from learner.data.order import DataOrder
from learner.data.records import Record
from learner.data.vision import VisionPrompt, patch_size, render_prompt, resized_image_size, with_vision
from learner.evaluation.draw import save_rollout_pictures
from learner.evaluation.held_out import EvalSetup, Evaluation, evaluate, score
from learner.rollouts.client import Rollout
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
from learner.train.reporting import RunReporter
from learner.train.results import StepResult, Summary
from learner.train.server_setup import build_server_rollouts
from learner.train.step import PlainStep, ZeroStep, gathered_weights, make_step, resolve_device
from rmsft.jobspec import RolloutMatchingJob
from rmsft.weight_wire import new_run_id

__all__ = ["DataOrder", "StepResult", "Summary", "Trainer"]

log = logging.getLogger("rmsft.learner")


@dataclass
class _Built:
    rows: list[PackedRow]
    stats: EpisodeStats  # counts summed over ranks, timings of this rank
    rollouts: list[Rollout]  # rank 0: the whole batch; other ranks: their share
    local_ids: list[str]
    channel: str = "B"  # "B": rollout matching on fresh rollouts; "A": the ground truth (warm start too)


_PARTS = ("ce", "soft_ce", "w1", "gate", "coord", "geo", "ul")
_COUNTS = ("rollouts", "matched", "false_positives", "false_negatives", "dropped", "truncated", "response_tokens",
           "predicted", "gt_objects", "duplicates", "recovered", "fallback")


def collective_timeout_s(job: RolloutMatchingJob) -> float:
    """How long a rank may wait for the others: long enough for rank 0's rollouts (with retries)
    and a weight sync. RMSFT_DIST_TIMEOUT_S overrides."""
    env = os.environ.get("RMSFT_DIST_TIMEOUT_S")
    if env:
        return float(env)
    t = job.spec.training.rollout.request_timeout_s
    return max(1800.0, 3 * t + 2 * job.spec.sync.timeout_seconds)


class Trainer(RolloutHandout):
    """The learner loop. Under torchrun (WORLD_SIZE > 1) or with `process_group`, one rank of a
    data-parallel group: only rank 0 builds the server pool and talks to the rollout servers.
    `addresses`: the ordered server list, or a `ServersFile` the pool follows during the run.
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
        # Where rollouts come from (learner.rollouts.source): rank 0's server pool, or an engine in every rank
        # (colocate). `pool` and `sync_client` are the server pool's parts (None with colocate).
        self.rollouts: RolloutSource | None = None
        self.pool: ServerPool | None = None
        self.sync_client: WeightSyncClient | None = None
        self.ahead: RolloutsAhead | None = None  # rank 0: rollouts generated ahead of training (overlap.py)
        self._resumed_ahead: list[dict] = []  # rank 0: a checkpoint's batches ahead, put back by _begin
        self.train_step: PlainStep | ZeroStep | None = None
        self.state = TrainState()
        self.history: list[StepResult] = []
        self.evaluations: list[Evaluation] = []
        self.reporter: RunReporter | None = None  # rank 0's TensorBoard and held-out reports
        self.exported: Path | None = None
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
            _check_memory_plan(job, log_it=ranks.is_main)  # before anything is loaded: say which knob to turn
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
            _check_images_fit(self.records, self.policy, vision.max_images_per_prompt, cfg.data.path)
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
        self.buffer: RolloutBuffer = RolloutBuffer(self.core.m_steps)
        self.checkpointer = Checkpointer(cfg, ranks, self.model, self.train_step, self.packer, self.state)
        model_dir = model_path or job.spec.model.path
        # No servers at all (server mode): a plain SFT run (every step a warm-start step, no held-out evaluation)
        # needs none, e.g. the pretraining of `rmsft local`'s tiny model (learner.local.pretrain_tiny_model).
        self.offline = (not job.spec.rollout.colocated and not isinstance(addresses, ServersFile)
                        and not list(addresses))  # fmt: skip
        if self.offline and (cfg.warm_start_steps < cfg.steps or cfg.eval.data):
            raise ValueError("no rollout servers given: only a run whose every step is a warm-start step "
                             "(training.warm_start_steps >= training.steps) and that has no training.eval.data "
                             "runs without them")
        if job.spec.rollout.colocated:
            with ranks.guard("starting the in-process rollout engine"):
                self.rollouts = colocated_rollouts(
                    job, self.model, self.policy.tokenizer, run_id=self.state.run_id, world_size=ranks.world_size,
                    rank=ranks.rank, model_dir=model_dir, vision_language=self.policy.is_vision_language,
                    around_generation=self._around_generation,
                )  # fmt: skip
        else:
            with ranks.guard("connecting to the rollout servers (rank 0)"):
                if ranks.is_main and not self.offline:  # the only rank that talks to rollout servers
                    # Every E-step's rollouts go through it (max_staleness 0: generated inline, as always).
                    self.ahead = RolloutsAhead(lambda reqs, sampling, v: self.rollouts.generate(
                        reqs, sampling, weight_version=v), cfg.rollout.max_staleness)
                    source = build_server_rollouts(
                        job, addresses, self.model, run_id=self.state.run_id, auth_token=auth_token,
                        checkpoint_dir=model_dir, vision_language=self.policy.is_vision_language,
                        zero3=cfg.deepspeed_stage == 3,
                        fence_resync=self.ahead.fenced_resync,  # none while weights move
                    )  # fmt: skip
                    self.rollouts, self.pool, self.sync_client = source, source.pool, source.sync_client
                    self.ahead.abort = source.abort  # close(): a call still running ahead is ended, then waited for
        self._prompt_cache: dict[int, list[int]] = {}  # text models: a record's prompt ids
        self._step_prompts: dict[int, VisionPrompt] = {}  # vision-language models: this E-step's renderings
        self.pictures: list[Path] = []
        self.eval_pictures: list[Path] = []
        # Image/video tokens a rollout may sample: its answer is cut before the first (episode.vision_safe_response).
        self.vision_token_ids = (vision_token_ids(self.policy.tokenizer) if self.policy.is_vision_language
                                 else frozenset())  # fmt: skip
        self._retries_at_start = m.counter_total(m.ROLLOUT_RETRIES)
        self._served_step = -1  # the step whose weights the servers hold (after a sync)

    def _make_packer(self) -> Packer:
        """This rank's packer (one per rank, lives across steps; the checkpoint keeps its carry buffer)."""
        return Packer(*self.core.packing)

    # -- the loop -------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> Summary:
        """Train until training.steps (or `max_steps` more steps); returns the summary.
        Each step: rollouts -> targets -> pack (the E-step, reused for m_steps with the buffer on)
        -> forward/backward/optimizer on the packed rows -> weight sync before fresh rollouts."""
        t_start = time.perf_counter()
        st = self.state
        target = self._begin(max_steps)  # reporter, run.json, servers ready, first sync
        ck_every = self.cfg.checkpoint.every
        while st.step < target:
            t0 = time.perf_counter()
            batch = self.order.batch(st.step // self.core.m_steps)
            fresh = self.buffer.uses_left == 0
            built: _Built = self.buffer.get(batch, self._e_step)  # rollout -> targets -> pack
            loss, parts, n_rows, fill = self._m_step(built.rows)  # forward/backward/optimizer
            st.step += 1
            result = StepResult(
                step=st.step, weight_version=st.version, rollouts=built.rollouts if fresh else [],
                record_ids=[self.records[i].id for i in batch], loss=loss, parts=parts, channel=built.channel,
                stats=built.stats if fresh else None, rows=n_rows, fill=fill, seconds=time.perf_counter() - t0,
                rank=self.ranks.rank, local_record_ids=list(built.local_ids), local_rows=len(built.rows),
                local_tokens=sum(r.length for r in built.rows),
            )  # fmt: skip
            self.history.append(result)
            self._publish(result)
            # The next step starts with fresh rollouts: the servers need these weights (a channel-A step, the
            # warm start's included, generates nothing, so they wait for the weights of the step before a B step).
            if st.step < target and self.buffer.uses_left == 0 and self._channel_b(st.step // self.core.m_steps):
                self._sync()
            if ck_every and st.step % ck_every == 0:
                self.save()
            if self._eval_due(target):
                self.evaluate_held_out()
        return self._end(t_start)

    def _begin(self, max_steps: int | None) -> int:
        """Start (or resume) a run: rank 0's reporter and run.json, the servers ready, weights synced once
        before the first rollout. Returns the step to stop at."""
        st = self.state
        target = self.cfg.steps if max_steps is None else min(self.cfg.steps, st.step + max_steps)
        if self.ranks.is_main and self.reporter is None:
            # After resume(): TensorBoard hides what a crashed run wrote past its last checkpoint.
            self.reporter = RunReporter(Tracker(self.cfg.tensorboard_dir, run_name=self.job.metadata.name,
                                                config=self.job.to_manifest(), resume_step=st.step + 1))
        self._log_start(target)
        if self.offline:  # no servers to wait for or to sync (a plain SFT run)
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
        self.pictures = self._write_pictures()
        self.eval_pictures = self._write_eval_pictures()
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
                              max_tokens=self.cfg.eval.max_tokens or self.cfg.rollout.max_tokens)  # fmt: skip
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

    # -- E-step ---------------------------------------------------------------------------------
    def _e_step(self, batch: tuple[int, ...]) -> _Built:
        ranks = self.ranks
        self._step_prompts.clear()
        k = self.state.step // self.core.m_steps
        channel_b = self._channel_b(k)
        explorers = None
        with self._phase("rollout"):
            if not channel_b:
                # Channel A (the warm start's steps too): no generation; an empty answer makes the targets the whole
                # ground truth.
                everything = None
                if ranks.is_main:
                    reason = "warm_start" if self.state.step < self.cfg.warm_start_steps else "channel_a"
                    everything = [Rollout(self.records[idx].id, self._prompt_ids(idx), [], reason,
                                          self.state.version, "", weight_run_id=self.state.run_id)
                                  for idx in batch]  # fmt: skip
                outs = self._scatter(everything, len(batch))
            else:
                outs, everything = self._rollouts_for(k, self.core.sampling)
                if self.core.recipe.explorers:
                    explorers = self._explorer_rollouts(k)
        lo, hi = ranks.share(len(batch))
        mine = batch[lo:hi]
        with ranks.guard("building training segments"):
            if len(outs) != len(mine) or not self._within_window(outs):
                raise RuntimeError(f"rank {ranks.rank} got {len(outs)} rollout(s) for {len(mine)} prompt(s) "
                                   f"or a weight version outside {self.state.weights} minus max_staleness "
                                   f"{self.cfg.rollout.max_staleness}")  # fmt: skip
            recs = [self.records[i] for i in mine]
            vl = self.policy.is_vision_language
            vision = [self._vision_prompt(i) for i in mine] if vl else []
            mine_ids = [v.input_ids for v in vision] if vl else [self._prompt(i) for i in mine]
            check_rollout_prompts(recs, mine_ids, outs, self.policy.tokenizer)
            responses = [o.token_ids for o in outs]
            if vl:  # a sampled image/video token cannot be teacher-forced: the answer ends before it
                responses = [vision_safe_response(r, self.vision_token_ids) for r in responses]
            # A format in resized-image pixels (Qwen2.5-VL's) is bound to each record's image size.
            sizes = ([v.image_size(patch_size(self.policy.processor)) for v in vision]
                     if vl and self.core.fmt.needs_image_size else None)  # fmt: skip
            recipe = self.core.recipe
            segments, stats = build_segments(
                recs, mine_ids, [o.prompt_token_ids for o in outs], responses, self.policy.vocab,
                self.core.matching, self.core.targets, fmt=self.core.fmt, image_sizes=sizes,
                clean=recipe.clean, duplicates=recipe.duplicates, explorer_ids=explorers,
            )  # fmt: skip
            if vl:  # pixels and per-segment M-RoPE positions for the packed forward
                segments = [with_vision(self.model, seg, v) for seg, v in zip(segments, vision, strict=True)]
            self._add_phase("parse", stats.parse_s)
            self._add_phase("match", stats.match_s)
            self._add_phase("targets", stats.targets_s)
            with self._phase("pack"):
                self.packer.add(segments)
                rows = []
                for _ in range(self.cfg.grad_accumulation):
                    row = self.packer.next_row()
                    if row is None:
                        break
                    rows.append(row)
        if ranks.enabled:  # F1 and the counters are over the global batch
            totals = ranks.sum([getattr(stats, f) for f in _COUNTS])
            for f, v in zip(_COUNTS, totals, strict=True):
                setattr(stats, f, int(v))
        if ranks.is_main:
            m.OBJECTS.labels("matched").inc(stats.matched)
            m.OBJECTS.labels("fp").inc(stats.false_positives)
            m.OBJECTS.labels("fn").inc(stats.false_negatives)
            m.DROPPED_OBJECTS.inc(stats.dropped)
            m.TRUNCATED_ROLLOUTS.inc(stats.truncated)
        m.BUFFER_SEGMENTS.set(self.packer.pending)
        return _Built(rows, stats, everything if ranks.is_main else outs, [r.id for r in recs],
                      "B" if channel_b else "A")

    # -- M-step ---------------------------------------------------------------------------------
    def _m_step(self, rows: list[PackedRow]) -> tuple[float, dict[str, float], int, float]:
        """One optimizer step on this step's rows; the loss is the token-level mean over all rows
        of all ranks (same as one big packed row). Returns the loss, its parts, the number of rows
        over all ranks and their mean fill."""
        ce_total, coord_total, box_total, ul_total, n_rows, fill_sum = self.ranks.sum([
            sum(int((r.labels != -100).sum()) for r in rows),
            sum(int(r.coord_positions.numel()) for r in rows),
            sum(r.n_boxes for r in rows), sum(r.n_unlikelihood for r in rows),
            len(rows), sum(r.fill for r in rows),
        ])  # fmt: skip
        if not n_rows:
            raise RuntimeError("packer produced no row for this step (empty rollouts and carry buffer)")
        lr = learning_rate(self.cfg, self.state.step)
        with self.ranks.guard("forward/backward"):
            sums = self.device_step(rows, int(ce_total), int(coord_total), lr, int(box_total), int(ul_total))
        # The only host reads of the step: after it, once.
        total = self.ranks.sum([float(sums[k]) for k in ("loss", *_PARTS)])
        return total[0], dict(zip(_PARTS, total[1:], strict=True)), int(n_rows), fill_sum / n_rows

    def device_step(self, rows: list[PackedRow], ce_total: int, coord_total: int, lr: float, box_total: int = 0,
                    ul_total: int = 0) -> dict[str, torch.Tensor]:
        """Forward/backward of every row on the training device, then the optimizer step. Returns
        the loss and its parts summed over the rows, as tensors on the device (no host reads, so
        it runs with the parameters on `meta`)."""
        step, coord_ids, weights = self.train_step, self.policy.vocab.coord_token_ids, self.core.weights
        sums: dict[str, torch.Tensor] = {}
        step.begin()
        for cpu_row in rows:
            row = cpu_row.to(step.device)
            with self._phase("forward"), step.autocast():
                logits = step.forward(**row.model_inputs()).logits
                s = loss_sums(logits, row, coord_ids, weights.sigma)
                # Normalised by the step's global totals: summing rows' losses gives the pooled mean.
                out = s.normalised_by(ce_total, coord_total, box_total, ul_total).finish(weights)
            with self._phase("backward"):
                step.backward(out.loss)
            for k, v in (("loss", out.loss.detach()), *((k, out.parts[k]) for k in _PARTS)):
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

    def _write_pictures(self, limit: int = 4) -> list[Path]:
        """Rank 0: the last fresh rollouts of a vision-language run drawn on their images (predicted and
        ground-truth objects) under <checkpoint.dir>/rollouts/. A picture that cannot be written is a warning:
        the trained model is what the run is for."""
        last = next((h for h in reversed(self.history) if h.rollouts), None)
        if not self.ranks.is_main or not self.policy.is_vision_language or last is None:
            return []
        by_id = {r.id: r for r in self.records}
        shown = [(rec, r.token_ids) for r in last.rollouts if (rec := by_id.get(r.request_id)) is not None]
        # Parsed with the run's own format, exactly as held-out answers are.
        scored = score([rec for rec, _ in shown], [ids for _, ids in shown], self.eval_setup(self.images),
                       iou=self.cfg.eval.iou, step=last.step)
        items = scored.pictures(self.images, limit, label="rollout")
        out = Path(self.cfg.checkpoint.dir) / "rollouts"
        try:
            paths = save_rollout_pictures(items, out)
        except OSError as exc:
            log.warning("could not write rollout pictures to %s: %s", out, exc)
            return []
        log.info("rollout pictures (predicted and ground-truth objects) of step %d: %s", last.step, out)
        return paths

    def _write_eval_pictures(self) -> list[Path]:
        """Rank 0: the last held-out evaluation's answers drawn on their images under <checkpoint.dir>/heldout/
        (TensorBoard has every evaluation's; this folder is what a newcomer opens after the run)."""
        ev = self.evaluations[-1] if self.evaluations else None
        if ev is None or self.eval_images is None or not self.cfg.eval.pictures:
            return []
        out = Path(self.cfg.checkpoint.dir) / "heldout"
        try:
            return save_rollout_pictures(ev.pictures(self.eval_images, self.cfg.eval.pictures), out)
        except OSError as exc:
            log.warning("could not write held-out pictures to %s: %s", out, exc)
            return []

    def _vision_prompt(self, idx: int) -> VisionPrompt:
        """The learner's rendering of a record's prompt with its images (read through the image store's
        cache, the same bytes the servers got); rendered once per E-step (pixels are not kept longer)."""
        if idx not in self._step_prompts:
            rec = self.records[idx]
            images = [img.pil() for img in self.images.load(rec)]
            self._step_prompts[idx] = render_prompt(self.policy.processor, [m.model_dump() for m in rec.messages],
                                                    images)  # fmt: skip
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
                                eval_image_root=self.cfg.eval.image_root)  # fmt: skip
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
            )  # fmt: skip

    def _publish(self, r: StepResult) -> None:
        m.GLOBAL_STEP.set(r.step)
        m.STEP_SECONDS.observe(r.seconds)
        m.PACKING_FILL.set(r.fill)
        m.LOSS.labels("total").set(r.loss)
        for k, v in r.parts.items():
            m.LOSS.labels(k).set(v)
        if self.ranks.is_main:
            self.reporter.step(r, self.state.phase_seconds, learning_rate(self.cfg, r.step - 1))
            f1 = f"{r.stats.f1:.3f}" if r.stats and r.channel == "B" else ("reuse" if r.channel == "B" else "- (A)")
            log.info(
                "step %d v%d loss %.4f (ce %.4f coord %.4f) f1 %s rows %d fill %.3f %.2fs",
                r.step, r.weight_version, r.loss, r.parts.get("ce", 0.0), r.parts.get("coord", 0.0), f1,
                r.rows, r.fill, r.seconds,
            )  # fmt: skip
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
        )  # fmt: skip

    def close(self) -> None:
        for part in (self.ahead, self.rollouts, self.train_step, self.reporter):
            if part is not None:
                part.close()
        self.train_step = None
        self.ranks.close()


def _check_images_fit(records: Sequence[Record], policy: Policy, max_images: int, path: str) -> None:
    """Refuse at start what no server would take: images for a text model, more images than allowed."""
    with_images = [r for r in records if r.images]
    if with_images and not policy.is_vision_language:
        raise ValueError(f"{path}: {len(with_images)} record(s) carry images (first: {with_images[0].id!r}) but "
                         "spec.model.path is a text model; use a vision-language model or drop the images")
    over = [r.id for r in with_images if len(r.images) > max_images]
    if over:
        raise ValueError(f"{path}: {len(over)} record(s) carry more than spec.model.vision.maxImagesPerPrompt="
                         f"{max_images} images (first: {over[0]!r})")


def _check_memory_plan(job: RolloutMatchingJob, *, log_it: bool) -> None:
    """The job's memory plan (rmsft.memory_plan, what `rmsft plan` prints) against this machine's GPU memory:
    logged, and a job that cannot fit is refused before anything loads, naming the knob to turn. The plan is an
    estimate: RMSFT_MEMORY_PLAN=warn makes a refusal a warning, =off skips the plan (any other value but refuse,
    the default, is a MemoryPlanSettingError)."""
    from rmsft.memory_plan import MEMORY_PLAN_ENV, MemoryPlanError, ModelShapeError, memory_plan_setting, plan_memory

    setting = memory_plan_setting()
    if setting == "off":
        return
    gpu_memory = None
    if torch.cuda.is_available():
        gpu_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        plan = plan_memory(job, gpu_memory=gpu_memory)
    except ModelShapeError as exc:
        if log_it:
            log.warning("no memory plan: %s", exc)
        return
    if log_it:
        for line in plan.lines():
            log.info("memory plan: %s", line)
    if not plan.fits:
        if setting == "warn":
            log.warning("the memory plan says this job does not fit (%s=warn: going on): %s", MEMORY_PLAN_ENV,
                        plan.message())
            return
        raise MemoryPlanError(f"{plan.message()} ({MEMORY_PLAN_ENV}=warn goes on anyway: the plan is an estimate)",
                              plan)
