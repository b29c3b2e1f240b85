"""`build_loop`: a training loop's parts made, in the order a real start pays for them, then the loop over them.

What can be refused is refused before anything is paid for: the objective (a reward's name), the batch against the
ranks, the checkpoint folder (writable, this run its one writer), the trackers, the memory plan, every image. Then
the data and the model load, the optimizer step is set up, and the rollouts are wired: rank 0's server pool (with
the rollouts ahead of training) or an in-process engine on every rank (colocate). Last, the objective is handed
what it reads of these parts (`ObjectiveInputs`): it never reaches back into the loop.

A start that fails part-way closes what it made, latest first (the engines, the optimizer's process groups, the
checkpoint folder's writer lock, the ranks), so a retry in the same process finds nothing held.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch

from learner.data.dataset import load_dataset
from learner.data.images import ImageStore
from learner.data.order import DataOrder
from learner.data.records import Record, outside_frame
from learner.rollouts.colocate import colocated_rollouts
from learner.rollouts.interface import RolloutSource
from learner.rollouts.pool import ServersFile
from learner.rollouts.server_home import ServerRollouts
from learner.tracking import metrics as m
from learner.tracking.tracker import check_trackers
from learner.train import zero
from learner.train.checkpoint_files import check_checkpoint_dir
from learner.train.checkpoint_owner import WriterLock, lineage_of
from learner.train.checkpointer import Checkpointer, TrainState
from learner.train.config import core_configs
from learner.train.feed import RolloutFeed
from learner.train.loop import LoopParts, TrainingLoop
from learner.train.objectives import Objective, objective_for
from learner.train.objectives.base import ObjectiveInputs
from learner.train.offload import around_generation
from learner.train.overlap import RolloutsAhead
from learner.train.policy import Policy, load_policy
from learner.train.ranks import Ranks
from learner.train.reporting import PhaseClock
from learner.train.results import StepResult
from learner.train.server_setup import server_rollouts_ahead
from learner.train.start_checks import check_images_fit, check_memory_plan, collective_timeout_s
from learner.train.updater import Updater, make_updater, resolve_device
from rmsft.jobspec import RolloutMatchingJob
from rmsft.weight_wire import new_run_id

__all__ = ["build_loop", "claim_checkpoint_dir"]

log = logging.getLogger("rmsft.learner")


def claim_checkpoint_dir(root: str, run_id: str, job: str) -> WriterLock:
    """Rank 0, before anything is paid for: `root` must be writable, and this run its one writer for as long as it
    lives (checkpoint_owner.WriterLock: a second learner waits for it, then stops naming the holder)."""
    check_checkpoint_dir(root)
    return WriterLock(root, run_id=run_id, job=job, on_wait=log.warning)


def build_loop(
    job: RolloutMatchingJob,
    addresses: Sequence[str] | ServersFile,
    *,
    auth_token: str | None = None,
    model_path: str | Path | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    objective: Objective | None = None,
) -> TrainingLoop:
    """The training loop of `job`. `objective`: what a step is (default: the one `spec.trainer` names, from
    `learner.train.objectives.OBJECTIVES`). Under torchrun (WORLD_SIZE > 1) or with `process_group`, one rank of a
    data-parallel group: only rank 0 builds the server pool and talks to the rollout servers. `addresses`: the
    ordered server list, or a `ServersFile` the pool follows during the run. `device` overrides `training.device`
    (tests run a step on the `meta` device). `on_step` is called on every rank with that rank's `StepResult`."""
    # What can fail in the objective (a reward's name) fails before anything is paid for.
    objective = objective if objective is not None else objective_for(job)
    with ExitStack() as made:  # what a failed start closes, latest first
        made.callback(objective.close)
        ranks = Ranks(process_group) if process_group is not None else Ranks.from_env(collective_timeout_s(job))
        made.callback(ranks.close)
        parts = _make_parts(
            job, addresses, objective, ranks, made, auth_token=auth_token, model_path=model_path, device=device
        )
        loop = TrainingLoop(parts, on_step=on_step)
        made.pop_all()  # the loop owns them now (`TrainingLoop.close`)
    return loop


def _make_parts(
    job: RolloutMatchingJob,
    addresses: Sequence[str] | ServersFile,
    objective: Objective,
    ranks: Ranks,
    made: ExitStack,
    *,
    auth_token: str | None,
    model_path: str | Path | None,
    device: torch.device | str | None,
) -> LoopParts:
    cfg = job.spec.training
    if not ranks.is_main:
        log.setLevel(logging.WARNING)  # the one-line-per-step log is rank 0's
    state = TrainState()
    # This run's identity, in every weight version it announces: rank 0's, on every rank.
    state.run_id = ranks.broadcast_from_main(new_run_id() if ranks.is_main else None)
    if ranks.is_main:
        m.set_run(state.run_id)
        log.info("learner run %s (this process's own; a restart makes a new one)", state.run_id)
    if cfg.prompts_per_step < ranks.world_size:
        raise ValueError(
            f"spec.training.prompts_per_step ({cfg.prompts_per_step}) is the global batch and must be "
            f">= the number of learner ranks ({ranks.world_size})"
        )
    lineage, writer_lock = lineage_of(job), None
    with ranks.guard("checking spec.training.checkpoint.dir (rank 0)"):
        if ranks.is_main:  # the rank that writes checkpoints; before anything is paid for
            writer_lock = claim_checkpoint_dir(cfg.checkpoint.dir, state.run_id, lineage["job"])
            made.callback(writer_lock.close)
            check_trackers(cfg.report_to, cfg.tensorboard_dir)  # installed, writable: now, not after training
    with ranks.guard("checking the memory plan"):
        check_memory_plan(job, log_it=ranks.is_main)  # before anything is loaded: say which knob to turn
    with ranks.guard("loading the data and the model"):
        if cfg.deepspeed_stage:
            zero.require_deepspeed(cfg.deepspeed_stage)
        vision = job.spec.model.vision
        # Every image is opened and checked here, before anything is paid for.
        records, images = load_dataset(cfg.data.path, cfg.data.image_root, vision.max_image_pixels)
        if (outside := outside_frame(records)).objects and ranks.is_main:  # once per run, not per rank
            log.warning("%s: %s", cfg.data.path, outside.line(sum(len(r.objects) for r in records)))
        eval_records: list[Record] = []
        eval_images: ImageStore | None = None
        if cfg.eval.data and ranks.is_main:  # held-out records: rank 0 evaluates
            held, eval_images = load_dataset(cfg.eval.data, cfg.eval.image_root, vision.max_image_pixels)
            eval_records = held[: cfg.eval.max_samples]
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        on = torch.device(device) if device is not None else resolve_device(cfg.device)
        policy = load_policy(model_path or job.spec.model.path, cfg, job.spec.model.dtype, vision)
        check_images_fit(records, policy, vision.max_images_per_prompt, cfg.data.path)
    model = policy.model.to(on)
    ranks.broadcast_params([p for p in model.parameters() if p.requires_grad])  # rank 0's init (LoRA)
    if ranks.rank:
        torch.manual_seed(cfg.seed + ranks.rank)  # e.g. dropout masks differ per rank
        random.seed(cfg.seed + ranks.rank)
    with ranks.guard("setting up the optimizer step"):
        updater = make_updater(model, ranks, cfg, device=on, autocast_dtype=policy.autocast_dtype)
    made.callback(updater.close)
    order = DataOrder(len(records), cfg.prompts_per_step, cfg.seed)
    packer = objective.make_packer()  # one per rank, lives across steps
    checkpointer = Checkpointer(
        cfg, ranks, model, updater, packer, state, parts={"objective": objective}, lineage=lineage
    )
    rollouts, ahead, no_rollouts = _rollouts(
        job,
        addresses,
        objective,
        ranks,
        state,
        policy,
        model,
        updater,
        made,
        auth_token=auth_token,
        model_dir=model_path or job.spec.model.path,
    )
    feed = RolloutFeed(
        cfg=cfg,
        ranks=ranks,
        state=state,
        order=order,
        records=records,
        images=images,
        policy=policy,
        source=rollouts,
        ahead=ahead,
    )
    phases, core = PhaseClock(state), core_configs(cfg)
    objective.attach(
        ObjectiveInputs(  # last: what the objective reads of the parts above
            feed=feed,
            ranks=ranks,
            state=state,
            order=order,
            records=records,
            images=images,
            policy=policy,
            model=model,
            updater=updater,
            packer=packer,
            core=core,
            phases=phases,
        )
    )
    server = rollouts if isinstance(rollouts, ServerRollouts) else None  # what only server mode has
    return LoopParts(
        job=job,
        objective=objective,
        ranks=ranks,
        state=state,
        phases=phases,
        lineage=lineage,
        writer_lock=writer_lock,
        records=records,
        images=images,
        eval_records=eval_records,
        eval_images=eval_images,
        device=updater.device,  # DeepSpeed may have placed the module itself
        policy=policy,
        model=model,
        updater=updater,
        core=core,
        order=order,
        packer=packer,
        checkpointer=checkpointer,
        no_rollouts=no_rollouts,
        rollouts=rollouts,
        pool=server.pool if server is not None else None,
        sync_client=server.sync_client if server is not None else None,
        ahead=ahead,
        feed=feed,
    )


def _rollouts(
    job: RolloutMatchingJob,
    addresses: Sequence[str] | ServersFile,
    objective: Objective,
    ranks: Ranks,
    state: TrainState,
    policy: Policy,
    model: torch.nn.Module,
    updater: Updater,
    made: ExitStack,
    *,
    auth_token: str | None,
    model_dir: str | Path,
) -> tuple[RolloutSource | None, RolloutsAhead | None, bool]:
    """Where rollouts come from (learner.rollouts.interface): rank 0's server pool with its rollouts ahead, or an
    engine in every rank (colocate); and whether the run has no servers at all."""
    cfg = job.spec.training
    # No servers at all (server mode): a run whose objective samples nothing and that has no held-out evaluation
    # needs none, e.g. the pretraining of `rmsft local`'s tiny model (learner.local.pretrain_tiny_model).
    no_rollouts = not job.spec.rollout.colocated and not isinstance(addresses, ServersFile) and not list(addresses)
    if no_rollouts:
        why = objective.needs_rollouts() or (
            "training.eval.data is set: the held-out evaluation asks the servers" if cfg.eval.data else None
        )
        if why:
            raise ValueError(f"no rollout servers given, and this run needs them: {why}")
    rollouts: RolloutSource | None = None
    ahead: RolloutsAhead | None = None
    if job.spec.rollout.colocated:
        with ranks.guard("starting the in-process rollout engine"):
            rollouts = colocated_rollouts(
                job,
                model,
                policy.tokenizer,
                run_id=state.run_id,
                world_size=ranks.world_size,
                rank=ranks.rank,
                model_dir=model_dir,
                vision_language=policy.is_vision_language,
                around_generation=partial(around_generation, job, updater, model),
            )
            made.callback(rollouts.close)
    else:
        with ranks.guard("connecting to the rollout servers (rank 0)"):
            if ranks.is_main and not no_rollouts:  # the only rank that talks to rollout servers
                rollouts, ahead = server_rollouts_ahead(
                    job,
                    addresses,
                    model,
                    run_id=state.run_id,
                    auth_token=auth_token,
                    checkpoint_dir=model_dir,
                    vision_language=policy.is_vision_language,
                )
                made.callback(rollouts.close)
                made.callback(ahead.close)  # first: it ends a call still running ahead on the pool
    return rollouts, ahead, no_rollouts
