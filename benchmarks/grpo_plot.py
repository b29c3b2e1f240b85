"""Plot a GRPO run from its TensorBoard event files: mean reward per step (with the std over the step's
completions), and the share of groups whose rewards were all equal.

Usage: rmsft local configs/local-tiny-grpo.yaml
       python benchmarks/grpo_plot.py .rmsft/checkpoints-grpo/tensorboard [--out docs/img] [--name local_run_grpo]
Writes OUT/NAME.png and OUT/NAME.csv (every grpo/* scalar per step) and ends with a RESULT line.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dir")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--name", default="local_run_grpo")
    args = ap.parse_args()

    from learner.tracking.tracker import read_events

    scalars, _ = read_events(args.log_dir)
    tags = sorted(t for t in scalars if t.startswith("grpo/"))
    if "grpo/reward_mean" not in scalars:
        raise SystemExit(f"{args.log_dir}: no grpo/reward_mean scalars (not a GRPO run?)")
    steps = [s for s, _ in scalars["grpo/reward_mean"]]
    by_tag = {t: dict(scalars[t]) for t in tags}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{args.name}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *tags])
        for s in steps:
            w.writerow([s, *(f"{by_tag[t].get(s, float('nan')):.6g}" for t in tags)])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = [by_tag["grpo/reward_mean"][s] for s in steps]
    std = [by_tag["grpo/reward_std"][s] for s in steps]
    flat = [by_tag["grpo/zero_std_groups"][s] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, marker="o", ms=3, label="mean reward")
    ax.fill_between(
        steps,
        [m - d for m, d in zip(mean, std, strict=True)],
        [m + d for m, d in zip(mean, std, strict=True)],
        alpha=0.2,
        label="± std over completions",
    )
    ax.plot(steps, flat, ls="--", label="groups with equal rewards (share)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.set_title(f"GRPO: {Path(args.log_dir).parent.name}")
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=110)
    k = min(5, len(mean))
    print(
        f"RESULT steps={len(steps)} first_reward={mean[0]:.3f} last_reward={mean[-1]:.3f} "
        f"first{k}_mean={sum(mean[:k]) / k:.3f} last{k}_mean={sum(mean[-k:]) / k:.3f} max_reward={max(mean):.3f}"
    )


if __name__ == "__main__":
    main()
