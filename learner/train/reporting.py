"""What rank 0 reports about a run besides its one log line per step: TensorBoard scalars per step,
held-out evaluations (log line, Prometheus gauges, TensorBoard scalars and pictures with boxes drawn;
label-aware F1 and mAP as the headline, geometry-only F1 and class-agnostic mAP beside them, the answers'
truncation and duplicate rates and object counts).

The loop decides when; this room only says where each figure goes, so the step loop stays readable.
Tags: `train/*` (loss and its parts, fill, rows, learning rate, step seconds), then the objective's own
(`StepFigures.scalars`: rollout matching's `train/f1`, precision, recall, ...; GRPO's `grpo/*`: reward mean/std,
each reward, clip fraction, ratio, KL, completion length), `time/*` (seconds per phase in the step),
`sync/bytes` (bytes streamed to the servers since the start), `eval/*` (see
`learner.evaluation.held_out.Evaluation.scalars`), images under `eval/<record id>`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from learner.data.images import ImageStore
from learner.data.records import Record
from learner.evaluation.draw import draw_detections, save_rollout_pictures
from learner.evaluation.held_out import EvalSetup, Evaluation, score
from learner.rollouts.interface import SourceInfo
from learner.tracking import metrics as m
from learner.tracking.run_record import run_record, write_run_record
from learner.tracking.tracker import Tracker
from learner.train.checkpointer import TrainState
from learner.train.results import StepResult
from rmsft.jobspec import RolloutMatchingJob

log = logging.getLogger("rmsft.learner")


class PhaseClock:
    """Times the phases of a run's steps: seconds per phase summed into the train state (the step log's, the
    checkpoint's) and observed on /metrics. The loop and its objective share one."""

    def __init__(self, state: TrainState) -> None:
        self.state = state

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the block as phase `name`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        m.PHASE_SECONDS.labels(name).observe(seconds)
        self.state.phase_seconds[name] = self.state.phase_seconds.get(name, 0.0) + seconds


def log_run_start(
    job: RolloutMatchingJob,
    st: TrainState,
    source: SourceInfo | None,
    *,
    records: int,
    target: int,
    world_size: int,
    device: torch.device,
    deepspeed: bool,
) -> None:
    """Rank 0, as a run starts (or resumes): run.json in the checkpoint folder (servers, seeds, versions, hashes,
    the resolved spec; which run this is and which runs wrote the checkpoint it resumed from) and the run's first
    log lines. A run.json that cannot be written is a warning: the folder was writable at start."""
    cfg = job.spec.training
    source = source or SourceInfo("none", (), "none", "none")
    record = run_record(
        job,
        servers=list(source.servers),
        rollout_mode=source.mode,
        sync_mode=source.sync_mode,
        sync_transport=source.sync_transport,
        world_size=world_size,
        model_dir=job.spec.model.path,
        data_path=cfg.data.path,
        image_root=cfg.data.image_root,
        eval_data_path=cfg.eval.data,
        eval_image_root=cfg.eval.image_root,
    )
    record["run_id"] = st.run_id
    if st.resumed is not None:  # oldest first
        record["resumed_from"] = {
            "step": st.resumed.step,
            "weight_version": st.resumed.weights.number,
            "run_id": st.resumed.weights.run_id,
            "run_ids": list(st.resumed.run_ids),
        }
    try:
        path = write_run_record(cfg.checkpoint.dir, record)
        log.info("run record (servers, seeds, versions, hashes, resolved spec): %s", path)
    except OSError as exc:
        log.warning("could not write run.json to %s: %s", cfg.checkpoint.dir, exc)
    # The record itself in the log too (the spec is long and already in run.json: left out here).
    log.info("run: %s", json.dumps({k: v for k, v in record.items() if k != "job"}, default=str))
    log.info(
        "rmsft learner run %s: %d record(s), %s, sync %s, seed %d, steps %d -> %d, ranks %d, device %s%s",
        st.run_id,
        records,
        f"servers {list(source.servers)}" if source.mode != "colocate" else "rollout engine in-process",
        job.spec.sync.mode if source.mode == "server" else source.sync_mode,
        cfg.seed,
        st.step,
        target,
        world_size,
        device,
        f", DeepSpeed ZeRO-{cfg.deepspeed_stage}" if deepspeed else "",
    )


class RunReporter:
    """Rank 0's reports of one run into `tracker` (a no-op tracker when tracking is off)."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self._phases_seen: dict[str, float] = {}
        self._sync_bytes_at_start = m.counter_total(m.WEIGHT_SYNC_BYTES)

    def step(self, r: StepResult, phase_seconds: Mapping[str, float], lr: float) -> None:
        """A step's figures: the loop's own, and the objective's (`r.figures.scalars()`)."""
        values = {
            "train/loss": r.loss,
            "train/fill": r.fill,
            "train/rows": float(r.rows),
            "train/step_seconds": r.seconds,
            "train/lr": lr,
        }
        values.update({f"train/{k}": v for k, v in r.parts.items()})
        values.update(r.figures.scalars())
        # Phase seconds are cumulative in the training loop's state: report this step's share of each.
        for name, total in phase_seconds.items():
            values[f"time/{name}"] = total - self._phases_seen.get(name, 0.0)
        self._phases_seen = dict(phase_seconds)
        values["sync/bytes"] = m.counter_total(m.WEIGHT_SYNC_BYTES) - self._sync_bytes_at_start
        self.tracker.scalars(r.step, values)

    def evaluation(self, ev: Evaluation, images: ImageStore | None, pictures: int) -> None:
        log.info("step %d %s", ev.step, ev.describe())
        m.EVAL_STEP.set(ev.step)
        fig = ev.figures()
        m.EVAL_F1.set(ev.f1)
        m.EVAL_F1_GEOMETRY.set(ev.f1_geometry)
        m.EVAL_MAP.set(ev.coco["map"])
        m.EVAL_MAP50.set(ev.coco["map_50"])
        m.EVAL_MAP_AGNOSTIC.set(ev.map_agnostic)
        m.EVAL_TRUNCATION.set(fig.truncation_rate)
        m.EVAL_DUPLICATES.set(fig.duplicate_rate)
        m.EVAL_PREDICTED_PER_GT.set(fig.count_ratio)
        self.tracker.scalars(ev.step, ev.scalars())
        if images is not None and pictures:
            for item in ev.pictures(images, pictures):
                self.tracker.image(
                    ev.step,
                    f"eval/{item.record_id}",
                    draw_detections(item.image, item.ground_truth, item.predicted, title=item.title),
                )
        self.tracker.flush()

    def close(self) -> None:
        self.tracker.close()


def write_rollout_pictures(
    history: Sequence[StepResult],
    records: Sequence[Record],
    images: ImageStore,
    checkpoint_dir: str,
    setup: EvalSetup,
    *,
    iou: float,
    limit: int = 4,
) -> list[Path]:
    """Rank 0: the last fresh rollouts of a vision-language run drawn on their images (predicted and ground-truth
    objects) under <checkpoint.dir>/rollouts/. A picture that cannot be written is a warning: the trained model is
    what the run is for."""
    last = next((h for h in reversed(history) if h.rollouts), None)
    if last is None:
        return []
    by_id = {r.id: r for r in records}
    shown = [(rec, r.token_ids) for r in last.rollouts if (rec := by_id.get(r.request_id)) is not None]
    # Parsed with the run's own format, exactly as held-out answers are.
    scored = score([rec for rec, _ in shown], [ids for _, ids in shown], setup, iou=iou, step=last.step)
    items = scored.pictures(images, limit, label="rollout")
    out = Path(checkpoint_dir) / "rollouts"
    try:
        paths = save_rollout_pictures(items, out)
    except OSError as exc:
        log.warning("could not write rollout pictures to %s: %s", out, exc)
        return []
    log.info("rollout pictures (predicted and ground-truth objects) of step %d: %s", last.step, out)
    return paths


def write_eval_pictures(
    ev: Evaluation | None, images: ImageStore | None, checkpoint_dir: str, pictures: int
) -> list[Path]:
    """Rank 0: the last held-out evaluation's answers drawn on their images under <checkpoint.dir>/heldout/
    (TensorBoard has every evaluation's; this folder is what a newcomer opens after the run)."""
    if ev is None or images is None or not pictures:
        return []
    out = Path(checkpoint_dir) / "heldout"
    try:
        return save_rollout_pictures(ev.pictures(images, pictures), out)
    except OSError as exc:
        log.warning("could not write held-out pictures to %s: %s", out, exc)
        return []
