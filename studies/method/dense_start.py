"""The start of the crowded and row settings of studies/method/method_compare.py: the README job's shipped start
(assets/tiny-vl-grid-model, 1-2 objects on a 4 x 4 grid) taught to write long lists, by plain SFT on dense scenes.

Usage: python studies/method/dense_start.py [--steps 1500] [--records 4096] [--out assets/tiny-vl-dense-model]
           [--work .rmsft/dense-start] [--check-every 100]

Why a start of its own: moved to crowded images by a short warm start, the README start wrote so few valid long
lists (held-out label-aware F1 0.07 on the crowded setting, docs/benchmarks.md) that every arm of the comparison
stayed at the floor: the comparison measured noise. A real user starts rollout matching from a model that already
answers the task; this is that model for dense scenes. It is trained once and shipped (assets/README.md: another
CPU gives other weights), with its digests in `<out>.sha256`, which tests/test_assets.py checks.

What it trains on: `--records` images rendered with seeds of their own (never the comparison's training,
validation or held-out records): half the crowded setting's layout (6 x 6 cells, 3-8 one-cell shapes), half the row
setting's (a row of 3-6 same-label tall rectangles side by side, up to 2 other shapes). The README job's optimizer,
its coordinate losses and recipe generation 1's targets (as the README start's own pretraining), every step on the
ground truth (channel A), in this process, no rollout servers. Deterministic on one machine.

Every `--check-every` steps (and at the end) it prints the loss; at the end one `RESULT` line with the steps, the
records, the final loss and the wall seconds. Resumable: a run stopped midway continues from its last checkpoint
under `--work` (checkpoints every `--check-every` steps).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

README_JOB = ROOT / "configs" / "local-tiny-vl.yaml"
# The layouts (rmsft_dev.synthetic.write_visual_dataset keywords) the comparison's crowd and row settings render;
# studies/method/method_compare.py imports them from here, so the start and the settings cannot drift apart.
CROWD_GRID = {"layout": "grid", "cells": 6, "max_objects": 8, "min_objects": 3, "max_cells": 1}
ROW_GRID = {"layout": "row", "cells": 6, "min_row": 3, "max_row": 6, "max_others": 2}
# Data seeds of the start's own records: the comparison renders its training set with seed 0, its validation set
# with 20_000 and its held-out set with 10_000.
START_SEEDS = {"crowd": 30_000, "row": 31_000}


def write_start_data(path: Path, records: int) -> Path:
    """`records` records, half crowded and half rows, interleaved, in one JSONL at `path`."""
    from rmsft_dev.synthetic import write_visual_dataset

    parts = []
    for name, grid in (("crowd", CROWD_GRID), ("row", ROW_GRID)):
        part = path.with_name(f"{path.stem}-{name}.jsonl")
        if not part.exists():
            write_visual_dataset(part, n=records // 2, seed=START_SEEDS[name], **grid)
        # Image paths are relative to the part's folder, which is `path`'s: the merged file keeps them.
        parts.append(part.read_text().splitlines())
    lines = [line for pair in zip(*parts, strict=True) for line in pair]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def start_job(model: Path, data: Path, work: Path, steps: int, check_every: int, out: Path):
    from rmsft.jobspec import parse_job

    doc = copy.deepcopy(yaml.safe_load(README_JOB.read_text()))
    doc["metadata"] = {"name": "dense-start"}
    doc["spec"]["model"]["path"] = str(model)
    t = doc["spec"]["training"]
    t.update(
        steps=steps,
        warm_start_steps=steps,
        data={"path": str(data)},
        eval={},
        checkpoint={"dir": str(work / "checkpoints"), "every": check_every, "keep": 1},
        export={"enabled": True, "dir": str(out)},
    )
    # Recipe generation 1's targets and the README job's coordinate losses, as the README start's pretraining.
    t["recipe"] = {"generation": 1}
    # A step's eight crowded answers (up to ~350 tokens each, 36 image tokens) are two or three 2048-token rows.
    t["grad_accumulation"] = 3
    t["packing_buffer"] = 256
    return parse_job(doc)


def digests(folder: Path) -> str:
    return "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sorted(folder.iterdir()) if p.is_file()
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--records", type=int, default=4096)
    ap.add_argument("--model", type=Path, default=None, help="start (default: the README job's spec.model.path)")
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "tiny-vl-dense-model")
    ap.add_argument("--work", type=Path, default=ROOT / ".rmsft" / "dense-start")
    ap.add_argument("--check-every", type=int, default=100)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.records < 2 or args.check_every < 1:
        sys.exit("--steps and --check-every must be >= 1 and --records >= 2")

    from learner.train.build import build_loop

    readme = yaml.safe_load(README_JOB.read_text())
    model = (args.model or README_JOB.parent / readme["spec"]["model"]["path"]).resolve()  # the job file's folder
    if not (model / "config.json").exists():
        sys.exit(f"{model}: no model there (the README job's start is shipped in assets/; `--model` for another)")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.jsonl"
    if not data.exists():
        print(f"rendering {args.records} dense images into {work}", flush=True)
        write_start_data(data, args.records)
    out = args.out.resolve()
    job = start_job(model, data, work, args.steps, args.check_every, out)
    loop = build_loop(job, [])
    t0 = time.perf_counter()
    losses: list[float] = []
    try:
        resumed = loop.resume()
        print(f"{'resumed' if resumed else 'started'}: {args.steps} plain SFT steps from {model}", flush=True)

        def on_step(r) -> None:
            losses.append(r.loss)
            if r.step % args.check_every == 0 or r.step == args.steps:
                rate = (time.perf_counter() - t0) / len(losses)
                print(
                    f"  step {r.step}/{args.steps} loss {r.loss:.4f} ({rate:.1f} s/step, about "
                    f"{rate * (args.steps - r.step) / 60:.0f} min left)",
                    flush=True,
                )

        loop.on_step = on_step
        loop.run()
    finally:
        loop.close()
    wall = time.perf_counter() - t0
    (out.parent / f"{out.name}.sha256").write_text(digests(out))
    (work / "made.json").write_text(
        json.dumps(
            {
                "steps": args.steps,
                "records": args.records,
                "model": str(model),
                "final_loss": losses[-1] if losses else None,
            }
        )
    )
    print(f"exported to {out} (digests in {out.name}.sha256)")
    print(
        f"RESULT steps={args.steps} records={args.records} final_loss={losses[-1] if losses else float('nan'):.4f} "
        f"wall_s={wall:.0f}"
    )


if __name__ == "__main__":
    main()
