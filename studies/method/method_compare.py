"""Plain SFT against the rollout-matching recipes, from one start, over seeds, on the grid visual task.

Usage: python studies/method/method_compare.py [--settings readme,crowd,row]
           [--arms sft,gen1,gen2,gen2_ref,gen2_rows,gen2_b]
           [--seeds 0,1,2] [--steps 60] [--warm 20] [--ratio R] [--eval-every 0] [--heldout 32]
           [--split heldout|validation] [--model DIR] [--work .rmsft/method-compare] [--out studies/method/results]
           [--name method_compare] [--replot [CSV ...]]

Run it from the repository root (the README job's paths are relative to it). Every run of a setting and seed
starts from the same point: the setting's start (`readme`: the README job's pretrained tiny Qwen3-VL, its
`spec.model.path`, built by its annotations when absent; `crowd` and `row`: assets/tiny-vl-dense-model, that model
taught to write long lists by studies/method/dense_start.py; `--model` for another) trained `--warm` plain-SFT steps
(channel A, ground truth only) by the README job once, checkpointed, and evaluated. Every arm resumes that
checkpoint (weights, optimizer state, data order, learning-rate schedule) and trains to `--steps` optimizer steps in
total with the README job's optimizer, loss and data:
- `sft`: plain SFT continued (every step channel A: `warm_start_steps = steps`);
- `gen1`: the first-generation rollout-matching objective (`training.recipe: {generation: 1}`): every step
  trains on the model's own answer, unmatched predictions kept with no loss;
- `gen2`: the second-generation recipe with the README job's channel-B ratio (its `training.recipe.channel_b_ratio`
  when it sets one, else 0.25; `--ratio` overrides) and the README job's losses: mostly ground-truth steps, some
  clean-prefix rollout steps;
- `gen2_ref`: the same with the reference's losses (the recipe's defaults: SmoothL1 and CIoU on the expected box,
  small soft CE, W1 and hard CE; docs/method.md), not the README job's;
- `gen2_rows`: gen2 with the duplicate rule's centre radius at ROWS_CENTER_RADIUS (0.5) instead of its default 0.8,
  which calls about a sixth of the true objects of the row setting duplicates of their neighbours (docs/benchmarks.md);
- `gen2_b`: the same recipe with `channel_b_ratio: 1.0` (rollout matching on every step).
Seeds (`--seeds`) set `training.seed` (data order) and `training.rollout.seed` (sampling); the data are the same.

Held-out evaluation (the trainer's own: greedy answers from the servers on `--heldout` records rendered with another
seed) at the end of the warm start, every `--eval-every` steps, and at the end: label-aware F1@0.5 (a prediction
counts with the right box and label), geometry-only F1, label-aware and class-agnostic COCO mAP, the answers'
truncation rate, duplicate rate and predicted/ground-truth count ratio; also the training rollouts' rates (means
over the run's rollout-matching steps), tokens trained (warm start included) and wall seconds (the arm's own,
warm start excluded: that is shared).

Settings: `readme` is the README job's task (4 x 4 cells, 1-2 objects, answers up to ~90 tokens); `crowd` is crowded
images (6 x 6 cells, 3-8 one-cell objects, answers up to ~350 tokens), where duplicates and truncation show; `row`
is a row of 3-6 same-label tall rectangles side by side with up to 2 other shapes (people in a queue, bottles on a
shelf: rmsft_dev.synthetic.make_row_sample), where duplicate control and dead anchors decide the target.

Validation and held-out: `--split validation` evaluates on a validation set (rendered with seed 20_000) and writes
its own ledger (NAME-validation.csv): choose settings (steps, ratio, losses) there; the default `--split heldout`
evaluates on the held-out set (seed 10_000), to be reported once the settings are chosen. The training set is
rendered with seed 0, the dense start's with seeds of its own.

Outputs: OUT/NAME.csv, one row per evaluation of every run (the ledger: a run whose final row is there, for the same
steps, warm start, held-out size and ratio, is skipped, so an interrupted grid resumes where it stopped; warm-start
checkpoints stay under `--work`); OUT/NAME.png, per setting and figure the final value of each arm as the mean over
seeds with min-max bars (the warm-start point dotted); OUT/NAME-curves.png when runs were evaluated three or more
times (`--eval-every`): F1 and mAP at every evaluation, mean over seeds, the points that follow a channel-B step
filled (the recipe's B steps close each block of 1 / ratio steps, so `--eval-every 40` at ratio 0.1 only sees the
model right after one; `--eval-every 5` shows both); a table, and one `RESULT key=value ...` line with, per
setting, arm and figure, the mean over seeds and its min and max (`<setting>_<arm>_<figure>=mean`,
`..._min`, `..._max`; arm `warm` is the shared starting point). `--replot` rebuilds the plot, table and RESULT line
from the CSV (or the CSVs given) without training.

Paired comparison: OUT/NAME-records.csv keeps every final evaluation's label-aware counts per held-out record
(matched, false positives, false negatives). From it each arm is compared with plain SFT on the same records and
seeds: the difference of label-aware F1@0.5 with a 95% interval from a two-level paired bootstrap (seeds drawn with
replacement, then records, the same records for both arms), printed and in the RESULT line as
`<setting>_<arm>_minus_sft_f1` (`_lo`, `_hi`); each recipe arm is compared with generation 1 the same way
(`<setting>_<arm>_minus_gen1_f1`). A ledger from before the counts were kept gives no interval.
OUT/NAME-detections.jsonl.gz keeps every final evaluation's boxes per record (ground truth, and the predictions in
the order written); from it the label-aware COCO mAP differences get the same paired bootstrap
(`<setting>_<arm>_minus_sft_map`, `..._minus_gen1_map`; 1000 draws, each mAP recomputed on the drawn records:
studies/method/paired.py). Runs from before the detections were kept give no mAP interval.

Smoke mode (what tests/learner/test_method_compare.py runs): `--steps 2 --warm 1 --heldout 2 --seeds 0
--settings readme --arms sft,gen2_b`.
"""

from __future__ import annotations

import argparse
import copy
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

# The study's own modules sit beside this script (a script's folder is on sys.path).
from compare_ledger import (  # the ledger: what runs leave on disk, read back
    ARMS,
    KEY,
    append_detection_rows,
    append_record_rows,
    append_rows,
    detections_ledger,
    detections_of,
    done_runs,
    final_rows,
    key_of,
    other_ledgers,
    read_detection_rows,
    read_record_rows,
    read_rows,
    records_ledger,
)

# The report's and the bootstrap's names are re-exported: tests and readers reach the whole comparison through
# this one script.
from compare_report import (  # noqa: F401  (table, intervals and pictures from a ledger)
    Paired,
    after_channel_b,
    paired_differences,
    plot_curves,
    plot_paired,
    report,
    spread,
)
from dense_start import CROWD_GRID, ROW_GRID  # the start and the settings share their layouts
from paired import RecordMatches, paired_bootstrap  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

README_JOB = ROOT / "configs" / "local-tiny-vl.yaml"
DENSE_START = ROOT / "assets" / "tiny-vl-dense-model"
# gen2_rows: a radius under which same-label neighbours one cell apart in a row are not duplicates of each other
# (tall 1 x 2-cell boxes on 6 x 6 cells: 0.8 flags 17% of the row setting's true objects, 0.5 none).
ROWS_CENTER_RADIUS = 0.5
SPLIT_SEEDS = {"heldout": 10_000, "validation": 20_000}
DEFAULT_RATIO = 0.25


@dataclass(frozen=True)
class Setting:
    name: str
    grid: dict  # write_visual_dataset's keyword arguments: the layout and its grid
    max_tokens: int
    start: Path | None = None  # the model every arm starts from; None: the README job's (or --model)
    records: int = 1024
    # Rough seconds per step (channel A, channel B) and per evaluation of 64 records on 2 idle cores, for the first
    # estimate (later ones come from the runs already in the CSVs).
    cost: tuple[float, float, float] = (1.5, 6.0, 10.0)
    # Packed rows per optimizer step: enough for a step's segments, so every step trains on its own targets (one
    # 2048-token row holds 8 README answers but only 3-4 crowded ones: the rest would wait in the packer's carry
    # buffer and the arms would train on the same backlog of warm-start segments).
    grad_accumulation: int = 1


SETTINGS = {
    "readme": Setting("readme", {"layout": "grid", "cells": 4, "max_objects": 2}, max_tokens=96),
    "crowd": Setting("crowd", CROWD_GRID, max_tokens=360, start=DENSE_START, cost=(0.6, 6.0, 4.0), grad_accumulation=3),
    # Up to 8 objects of about 43 tokens each and the end.
    "row": Setting("row", ROW_GRID, max_tokens=400, start=DENSE_START, cost=(0.7, 6.0, 5.0), grad_accumulation=3),
}


@dataclass(frozen=True)
class Plan:
    steps: int
    warm: int
    heldout: int
    eval_every: int
    ratio: float  # gen2's channel-B ratio


def readme_doc() -> dict:
    return yaml.safe_load(README_JOB.read_text())


def readme_ratio(doc: dict) -> float | None:
    recipe = doc["spec"]["training"].get("recipe") or {}
    return recipe.get("channel_b_ratio")


def arm_ratio(arm: str, plan: Plan) -> float:
    """The share of post-warm-start steps that are rollout matching (the CSV's `ratio`)."""
    if arm.startswith("gen2") and arm != "gen2_b":
        return plan.ratio
    return {"sft": 0.0, "gen1": 1.0, "gen2_b": 1.0, "warm": 0.0}[arm]


def make_job(setting: Setting, arm: str, seed: int, plan: Plan, model: Path, data: Path, held: Path, ckpt: Path):
    """The README job with this arm's recipe (`warm`: the shared warm start, the README job's recipe)."""
    from rmsft.jobspec import RecipeConfig, parse_job

    doc = copy.deepcopy(readme_doc())
    doc["metadata"].pop("annotations", None)
    doc["metadata"]["name"] = f"compare-{setting.name}-{arm.replace('_', '-')}-s{seed}"
    doc["spec"]["model"]["path"] = str(model)
    t = doc["spec"]["training"]
    t.update(steps=plan.steps, warm_start_steps=plan.steps if arm == "sft" else plan.warm, seed=seed)
    recipe = dict(t.get("recipe") or {})
    if arm == "gen1":  # the first objective: every second-generation key goes
        recipe = {k: v for k, v in recipe.items() if k not in RecipeConfig.SECOND_ONLY and k != "generation"}
        recipe["generation"] = 1
    elif arm in ("gen2", "gen2_ref", "gen2_rows", "gen2_b"):
        recipe.update(generation=2, channel_b_ratio=arm_ratio(arm, plan))
    if arm == "gen2_ref":  # the recipe's own defaults, which are the reference's (docs/method.md)
        t.pop("loss", None)
    if arm == "gen2_rows":
        recipe["duplicates"] = {**(recipe.get("duplicates") or {}), "center_radius": ROWS_CENTER_RADIUS}
    if recipe:
        t["recipe"] = recipe
    t["data"]["path"] = str(data)
    t["eval"] = {
        "data": str(held),
        "every": 0 if arm == "warm" else plan.eval_every,
        "max_samples": plan.heldout,
        "pictures": 0,
    }
    t["rollout"]["max_tokens"] = setting.max_tokens
    t["rollout"]["seed"] = seed
    # Long crowded answers are many segments per row: room for them (64, the README job's, overflowed in `crowd`).
    t["packing_buffer"] = 256
    t["grad_accumulation"] = setting.grad_accumulation
    # Every arm continues the shared warm start, which another job (`...-warm-...`) wrote: asked for, not refused.
    t["checkpoint"] = {"dir": str(ckpt), "every": 0, "keep": 1, "resume_any": arm != "warm"}
    t["export"] = {"enabled": False}
    return parse_job(doc)


def train(job, servers, *, resume: bool, max_steps: int | None, tokens_before: int) -> list[dict]:
    """Train `job` (resumed from its checkpoint folder when `resume`) and return one row per held-out evaluation."""
    from learner.train.build import build_loop

    rows: list[dict] = []
    tokens = tokens_before
    b_stats = []
    t0 = time.perf_counter()
    trainer = build_loop(job, [s.address for s in servers], auth_token=servers[0].token or None)
    try:
        if resume and not trainer.resume():
            raise RuntimeError(f"no warm-start checkpoint in {job.spec.training.checkpoint.dir}")

        def on_step(r) -> None:
            nonlocal tokens
            tokens += r.local_tokens
            if r.figures.channel == "B" and r.figures.stats is not None and r.figures.stats.rollouts:
                b_stats.append(r.figures.stats)

        def on_eval(ev) -> None:
            fig, at = ev.figures(), ev.stats[ev.iou]
            n = len(b_stats)
            row = {
                "step": ev.step,
                "f1": fig.f1,
                "f1_geometry": fig.f1_geometry,
                "precision": at.precision,
                "recall": at.recall,
                "map": fig.map,
                "map_agnostic": fig.map_agnostic,
                "map_50": ev.coco["map_50"],
                "truncation_rate": fig.truncation_rate,
                "duplicate_rate": fig.duplicate_rate,
                "predicted_per_gt": fig.count_ratio,
                "predicted_per_answer": fig.predicted_per_answer,
                "gt_per_record": fig.gt_per_record,
                "train_truncation_rate": sum(s.truncation_rate for s in b_stats) / n if n else math.nan,
                "train_duplicate_rate": sum(s.duplicate_rate for s in b_stats) / n if n else math.nan,
                "train_predicted_per_gt": sum(s.count_ratio for s in b_stats) / n if n else math.nan,
                "tokens_trained": tokens,
                "wall_s": time.perf_counter() - t0,
                "per_record": list(ev.per_record),
                "detections": detections_of(ev),
            }
            rows.append(row)
            print(f"  {job.metadata.name} step {ev.step}: {ev.describe()}", flush=True)

        trainer.on_step = on_step
        trainer.on_eval = on_eval
        trainer.run(max_steps)
    finally:
        trainer.close()
    return rows


def run_key(setting: str, arm: str, seed: int, plan: Plan) -> tuple:
    return (setting, arm, seed, plan.steps, plan.warm, plan.heldout, round(arm_ratio(arm, plan), 6))


def estimate(todo: list[tuple], rows: list[dict], plan: Plan, history: list[dict] | None = None) -> float:
    """Seconds the runs `todo` ((setting, arm, seed)) should take (servers' start aside): each (setting, arm)'s
    median wall in the ledger for the same steps, else in `history` (the other ledgers beside it: another held-out
    size or split costs about the same), else the setting's rough per-step costs."""
    total = 0.0
    for setting, arm, _seed in todo:
        n = plan.warm if arm == "warm" else plan.steps - plan.warm  # steps this run trains
        for source in (rows, history or []):
            seen = [
                r["wall_s"]
                for r in source
                if r["setting"] == setting
                and r["arm"] == arm
                and r["steps"] == plan.steps
                and r["warm"] == plan.warm
                and r["step"] == (plan.warm if arm == "warm" else plan.steps)
            ]
            if seen:
                total += statistics.median(seen)
                break
        else:
            a_s, b_s, eval_s = SETTINGS[setting].cost
            b = 0 if arm == "warm" else round(arm_ratio(arm, plan) * n)
            evals = 1 + (n // plan.eval_every if plan.eval_every and arm != "warm" else 0)
            total += (n - b) * a_s + b * b_s + evals * eval_s * plan.heldout / 64
    return total


# ---------------------------------------------------------------- the grid


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    readme = readme_doc()
    t = readme["spec"]["training"]
    ap.add_argument("--settings", default="readme,crowd,row")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=int(t["steps"]), help="optimizer steps in all (README job's)")
    ap.add_argument(
        "--warm",
        type=int,
        default=int(t.get("warm_start_steps", 0)),
        help="ground-truth steps every arm shares (README job's)",
    )
    ap.add_argument(
        "--ratio",
        type=float,
        default=None,
        help=f"gen2's channel-B ratio (default: the README job's, else {DEFAULT_RATIO})",
    )
    ap.add_argument("--eval-every", type=int, default=0, help="held-out evaluations between (0: warm start and end)")
    ap.add_argument("--heldout", type=int, default=32, help="records evaluated (of the held-out or validation set)")
    ap.add_argument(
        "--split",
        choices=tuple(SPLIT_SEEDS),
        default="heldout",
        help="evaluate on the held-out set (report) or the validation set (choose settings)",
    )
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="start model of every setting (default: each setting's: the README job's, the dense start)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=ROOT / ".rmsft" / "method-compare",
        help="data, warm-start checkpoints and server logs (kept for resuming)",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument(
        "--name",
        default=None,
        help="ledger and plot name (default: method_compare; -validation is "
        "appended for --split validation, so that a validation ledger is never taken for a held-out one)",
    )
    ap.add_argument(
        "--replot",
        nargs="*",
        type=Path,
        default=None,
        help="no training: plot, table and RESULT line from the CSV (or these CSVs)",
    )
    args = ap.parse_args(argv)
    args.name = args.name or "method_compare"
    if args.split == "validation" and not args.name.endswith("-validation"):
        args.name += "-validation"
    ledger = args.out / f"{args.name}.csv"
    if args.replot is not None:
        csvs = args.replot or [ledger]
        records: dict[tuple, list[tuple[int, int, int]]] = {}
        detections: dict[tuple, RecordMatches] = {}
        for path in csvs:
            records.update(read_record_rows(records_ledger(path)))
            detections.update(read_detection_rows(detections_ledger(path)))
        print(report(read_rows(csvs), args.out, args.name, 0.0, records, detections))
        return

    settings = [SETTINGS[s] for s in args.settings.split(",")]
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        sys.exit(f"--arms: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if not 1 <= args.warm < args.steps:
        sys.exit(f"--warm must be at least 1 and below --steps ({args.steps}), got {args.warm}")
    ratio = args.ratio if args.ratio is not None else readme_ratio(readme)
    ratio = DEFAULT_RATIO if ratio is None else float(ratio)
    plan = Plan(steps=args.steps, warm=args.warm, heldout=args.heldout, eval_every=args.eval_every, ratio=ratio)
    source = "--ratio" if args.ratio is not None else "README job" if readme_ratio(readme) is not None else "default"
    print(f"gen2 channel-B ratio {ratio:g} ({source})")

    rows = read_rows([ledger])
    done = done_runs(rows)
    todo = [
        (s.name, a, seed)
        for s in settings
        for seed in seeds
        for a in arms
        if run_key(s.name, a, seed, plan) not in done
    ]
    warm_todo = sorted({(s, "warm", seed) for s, _a, seed in todo if run_key(s, "warm", seed, plan) not in done})
    skipped = len(settings) * len(seeds) * len(arms) - len(todo)
    print(
        f"{len(todo)} run(s) to train, {len(warm_todo)} warm start(s), {skipped} already in {ledger}; "
        f"estimate {estimate(todo + warm_todo, rows, plan, other_ledgers(ledger)) / 60:.0f} min"
    )
    if todo:
        train_grid(todo, settings, plan, args, rows, ledger)
        rows = read_rows([ledger])
    print(
        report(
            rows,
            args.out,
            args.name,
            sum(r["wall_s"] for r in final_rows_list(rows)),
            read_record_rows(records_ledger(ledger)),
            read_detection_rows(detections_ledger(ledger)),
        )
    )


def final_rows_list(rows: list[dict]) -> list[dict]:
    return [r for v in final_rows(rows).values() for r in v]


def train_grid(todo: list[tuple], settings: list[Setting], plan: Plan, args, rows: list[dict], ledger: Path) -> None:
    from rich.console import Console

    from learner.local import prepare_inputs, start_servers
    from rmsft.jobspec import load_job
    from rmsft_dev.synthetic import write_visual_dataset

    console = Console(stderr=True)
    history = other_ledgers(ledger)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = load_job(README_JOB)
    if args.model is None:
        prepare_inputs(base, console)  # the README job's start (and data), built when absent
        readme_model = Path(base.spec.model.path).resolve()
    else:
        readme_model = args.model.resolve()
    models = {
        s.name: readme_model if args.model is not None or s.start is None else s.start.resolve() for s in settings
    }
    missing = sorted({str(m) for m in models.values() if not (m / "config.json").exists()})
    if missing:
        sys.exit(
            f"no start model in {', '.join(missing)} (assets/tiny-vl-dense-model is shipped; "
            "python studies/method/dense_start.py builds it again)"
        )
    by_name = {s.name: s for s in settings}
    # One pair of servers for every run: each trainer's first FULL sync puts its own weights on them.
    unused = work / "unused.jsonl"  # the servers read the model and spec.rollout only
    # The servers load the first setting's start; every run's first sync puts its own weights (same architecture).
    servers = start_servers(
        make_job(settings[0], "warm", 0, plan, models[settings[0].name], unused, unused, work / "unused"),
        work / "logs",
        console,
    )
    t_grid = time.perf_counter()
    try:
        for i, (name, arm, seed) in enumerate(todo):
            s = by_name[name]
            model = models[s.name]
            split = "" if args.split == "heldout" else f"-{args.split}"
            tag = f"{s.name}-s{seed}-n{plan.steps}-w{plan.warm}-h{plan.heldout}{split}"
            data = work / f"{s.name}-train.jsonl"
            held = work / f"{s.name}-{'held' if args.split == 'heldout' else 'val'}{plan.heldout}.jsonl"
            if not data.exists():
                write_visual_dataset(data, n=s.records, seed=0, **s.grid)
            if not held.exists():
                write_visual_dataset(held, n=plan.heldout, seed=SPLIT_SEEDS[args.split], **s.grid)
            warm_dir = work / f"{tag}-warm"
            warm_key = run_key(s.name, "warm", seed, plan)
            if warm_key not in done_runs(rows) or not any(warm_dir.glob("step-*")):
                console.print(f"[bold]{s.name} seed {seed}: warm start[/bold], {plan.warm} ground-truth steps")
                shutil.rmtree(warm_dir, ignore_errors=True)
                got = train(
                    make_job(s, "warm", seed, plan, model, data, held, warm_dir),
                    servers,
                    resume=False,
                    max_steps=plan.warm,
                    tokens_before=0,
                )
                new = [{**dict(zip(KEY, warm_key, strict=True)), **r} for r in got]
                if warm_key not in done_runs(rows):
                    append_rows(ledger, new)
                    append_record_rows(records_ledger(ledger), new)
                    append_detection_rows(detections_ledger(ledger), new)
                    rows += new
            warm_tokens = next(r["tokens_trained"] for r in rows if key_of(r) == warm_key and r["step"] == plan.warm)
            arm_dir = work / f"{tag}-{arm}"
            shutil.rmtree(arm_dir, ignore_errors=True)
            shutil.copytree(warm_dir, arm_dir, ignore=shutil.ignore_patterns("tensorboard"))
            console.print(
                f"[bold]{s.name} / {arm} / seed {seed}[/bold] ({i + 1} of {len(todo)}): "
                f"steps {plan.warm + 1}..{plan.steps} resumed from the warm start"
            )
            got = train(
                make_job(s, arm, seed, plan, model, data, held, arm_dir),
                servers,
                resume=True,
                max_steps=None,
                tokens_before=warm_tokens,
            )
            key = run_key(s.name, arm, seed, plan)
            new = [{**dict(zip(KEY, key, strict=True)), **r} for r in got]
            append_rows(ledger, new)
            append_record_rows(records_ledger(ledger), new)
            append_detection_rows(detections_ledger(ledger), new)
            rows += new
            shutil.rmtree(arm_dir, ignore_errors=True)
            left = todo[i + 1 :]
            console.print(
                f"  {s.name} / {arm} / seed {seed}: {new[-1]['wall_s']:.0f}s; {len(left)} run(s) left, "
                f"about {estimate(left, rows, plan, history) / 60:.0f} min "
                f"({(time.perf_counter() - t_grid) / 60:.0f} min so far)"
            )
    finally:
        for srv in servers:
            srv.stop()


if __name__ == "__main__":
    main()
