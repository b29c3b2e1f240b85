"""`rmsft eval CHECKPOINT_OR_MODEL DATA`: the held-out evaluation of a checkpoint, on rollout servers it starts.

The model is a Hugging Face folder, or a learner checkpoint (`step-<n>`, or a checkpoint dir: its newest),
which is first exported to a temporary folder (`learner.train.export.export_checkpoint`, merged weights). Local
rollout servers are started on it the way `rmsft local` starts them (same serve options from the job spec),
the records are answered greedily and scored exactly as the training loop scores `training.eval`
(`learner.evaluation.held_out`): F1 at an IoU threshold and COCO mAP. The figures are printed, and with `--out` also
written to `<out>/eval.json` with pictures of the first answers under `<out>/pictures/`.

The job spec decides the output format, the matcher and the image bounds: `--config`, else the run.json
beside a checkpoint, else the defaults (coordexp) with `--format` / `--coordinates` applied.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from learner.core.codec import output_format
from learner.evaluation.held_out import Evaluation
from rmsft.jobspec import API_GROUP, API_VERSION, KIND, RolloutMatchingJob, load_job, parse_job


@dataclass(frozen=True)
class EvalOptions:
    config: Path | None = None
    image_root: str | None = None
    max_samples: int = 64
    max_tokens: int | None = None
    iou: float = 0.5
    out: Path | None = None
    format: str | None = None  # overrides the job's training.format
    coordinates: str | None = None  # overrides training.format_options.coordinates
    pictures: int = 4
    work_dir: Path = Path(".rmsft/eval")


def _default_job(model: Path, data: Path) -> RolloutMatchingJob:
    return parse_job(
        {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "metadata": {"name": "eval"},
            "spec": {"model": {"path": str(model)}, "training": {"data": {"path": str(data)}}},
        },
        source="rmsft eval defaults",
    )


def _job(target: Path, data: Path, opts: EvalOptions, checkpoint: Path | None) -> RolloutMatchingJob:
    if opts.config is not None:
        job = load_job(opts.config)
    elif checkpoint is not None:
        from learner.train.export import job_for_checkpoint

        job = job_for_checkpoint(checkpoint)
    else:
        job = _default_job(target, data)
    training = job.spec.training
    update: dict[str, Any] = {}
    if opts.format is not None:
        update["format"] = opts.format
    if opts.coordinates is not None:
        update["format_options"] = training.format_options.model_copy(update={"coordinates": opts.coordinates})
    if update:
        # Validated like a manifest: a bad --format is refused with the key named.
        manifest = job.to_manifest()
        manifest["spec"]["training"].update(training.model_copy(update=update).model_dump(mode="json"))
        job = parse_job(manifest, source="rmsft eval options")
    job.spec.rollout.replicas = 1
    return job


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def run_eval(target: str | Path, data: str | Path, opts: EvalOptions, console: Console | None = None) -> Evaluation:
    """Evaluate `target` (model folder or learner checkpoint) on the records of `data`; see the module doc."""
    console = console or Console(stderr=True, soft_wrap=True)
    target, data = Path(target), Path(data)
    checkpoint = None
    if not _is_model_folder(target):
        from learner.train.export import resolve_checkpoint

        checkpoint = resolve_checkpoint(target)  # ExportError when it is neither
    job = _job(target, data, opts, checkpoint)
    with tempfile.TemporaryDirectory(prefix="rmsft-eval-") as tmp:
        model_dir = target
        if checkpoint is not None:
            from learner.train.export import export_checkpoint

            model_dir = Path(tmp) / "model"
            with console.status(f"exporting {checkpoint} (merged weights) to a temporary folder"):
                export_checkpoint(checkpoint, model_dir, config=opts.config)
        job.spec.model.path = str(model_dir)
        return _evaluate_model(job, data, opts, console)


def _evaluate_model(job: RolloutMatchingJob, data: Path, opts: EvalOptions, console: Console) -> Evaluation:
    from learner.core.vocab import VocabView
    from learner.data.dataset import load_dataset
    from learner.evaluation.held_out import EvalSetup, evaluate
    from learner.local import start_servers
    from learner.rollouts.client import RolloutClient
    from learner.rollouts.pool import ServerPool
    from learner.train.config import core_configs
    from rmsft.model_folder import is_vision_language

    cfg, vision = job.spec.training, job.spec.model.vision
    records, images = load_dataset(data, opts.image_root, vision.max_image_pixels)
    records = records[: opts.max_samples]
    model_dir = Path(job.spec.model.path)
    core = core_configs(cfg)
    processor = None
    if is_vision_language(model_dir):
        from learner.data.episode import vision_token_ids
        from learner.train.policy import load_processor

        processor = load_processor(model_dir, vision)
        tokenizer = processor.tokenizer
        vision_ids = vision_token_ids(tokenizer)
    else:
        from transformers import AutoTokenizer

        tokenizer, vision_ids = AutoTokenizer.from_pretrained(model_dir), frozenset()
    vocab = VocabView.from_hf_tokenizer(tokenizer, coord_tokens=output_format(cfg.format).coord_tokens)
    size = None
    if core.fmt.needs_image_size:
        from learner.data.vision import resized_image_size

        def size(rec):  # a record of `records`
            imgs = images.load(rec)
            return resized_image_size(processor, imgs[0].pil()) if imgs and processor is not None else None

    setup = EvalSetup(vocab=vocab, fmt=core.fmt, matching=core.matching, vision_ids=vision_ids, image_size=size)

    servers = start_servers(job, opts.work_dir / "logs", console)
    pool = client = None
    try:
        pool = ServerPool([s.address for s in servers], auth_token=servers[0].token or None)
        pool.wait_ready(timeout_s=cfg.rollout.request_timeout_s)
        client = RolloutClient(pool, timeout_s=cfg.rollout.request_timeout_s)
        with console.status(f"answering {len(records)} record(s) greedily"):
            # The model as served, never synced: no version to enforce.
            ev = evaluate(
                client,
                records,
                images,
                setup,
                version=None,
                max_tokens=opts.max_tokens or cfg.rollout.max_tokens,
                iou=opts.iou,
            )
    finally:
        for part in (client, pool):
            if part is not None:
                part.close()
        for s in servers:
            s.stop()
    _report(ev, images, opts, console)
    return ev


def _report(ev: Evaluation, images: Any, opts: EvalOptions, console: Console) -> None:
    table = Table(title=f"rmsft eval: {len(ev.records)} record(s)", show_header=False)
    for name, value in ev.scalars().items():
        table.add_row(name.removeprefix("eval/"), f"{value:.4f}")
    console.print(table)
    if opts.out is None:
        return
    opts.out.mkdir(parents=True, exist_ok=True)
    from learner.evaluation.draw import save_rollout_pictures

    paths = save_rollout_pictures(ev.pictures(images, opts.pictures), opts.out / "pictures")
    doc = {
        "records": len(ev.records),
        "iou": ev.iou,
        "figures": ev.scalars(),
        "per_record": [{"id": r.id, "predicted": p} for r, p in zip(ev.records, ev.predictions, strict=True)],
    }
    (opts.out / "eval.json").write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"figures in {opts.out / 'eval.json'}, {len(paths)} picture(s) in {opts.out / 'pictures'}")
