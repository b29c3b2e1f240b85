"""The report of studies/method/method_compare.py: from a grid's ledger (compare_ledger.py), the table, the
RESULT line, the paired comparisons with their 95% intervals (studies/method/paired.py), and the pictures: NAME.png
(final figures per arm), NAME-paired.png (the paired differences) and NAME-curves.png (every evaluation)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from compare_ledger import ARMS, final_rows, key_of
from paired import RecordMatches, paired_bootstrap

# Paired comparisons (arm, baseline): every arm against plain SFT, every recipe arm against generation 1.
BASELINES = ("sft", "gen1")
# What the table, plot and RESULT line summarise (the CSV has every figure).
SUMMARY = (
    "f1",
    "f1_geometry",
    "map",
    "map_agnostic",
    "truncation_rate",
    "duplicate_rate",
    "predicted_per_gt",
    "tokens_trained",
    "wall_s",
)
PANELS = (
    ("f1", "label-aware F1@0.5"),
    ("f1_geometry", "geometry F1@0.5"),
    ("map", "label-aware mAP"),
    ("truncation_rate", "truncated answers"),
    ("duplicate_rate", "duplicate objects"),
    ("predicted_per_gt", "predicted / true objects"),
)


def spread(values: list[float]) -> tuple[float, float, float]:
    """Mean, min and max of the finite values (NaN when none)."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan, math.nan, math.nan
    return sum(kept) / len(kept), min(kept), max(kept)


@dataclass(frozen=True)
class Paired:
    """One paired comparison: `arm` minus `baseline` on `setting`, of `figure` ("f1": label-aware F1@0.5, "map":
    label-aware COCO mAP), the observed difference and its 95% bootstrap interval, over `records` x `seeds`."""

    setting: str
    arm: str
    baseline: str
    figure: str
    diff: float
    lo: float
    hi: float
    records: int
    seeds: int

    def line(self) -> str:
        name = {"f1": "label-aware F1@0.5", "map": "label-aware mAP"}[self.figure]
        return (
            f"{self.setting}: {self.arm} - {self.baseline} {name} {self.diff:+.3f}, 95% interval "
            f"[{self.lo:+.3f}, {self.hi:+.3f}] (half-width {(self.hi - self.lo) / 2:.3f}; paired bootstrap over "
            f"{self.records} records x {self.seeds} seed(s))"
        )

    def part(self) -> str:
        key = f"{self.setting}_{self.arm}_minus_{self.baseline}_{self.figure}"
        return f"{key}={self.diff:.4g} {key}_lo={self.lo:.4g} {key}_hi={self.hi:.4g}"


def paired_differences(
    finals: dict[tuple[str, str], list[dict]],
    records: dict[tuple, list[tuple[int, int, int]]],
    settings: list[str],
    arms: list[str],
    detections: dict[tuple, RecordMatches] | None = None,
    *,
    map_draws: int = 1000,
    vary: str = "both",
) -> list[Paired]:
    """Each arm against plain SFT, and each recipe arm against generation 1, on the same held-out records and seeds
    (paired_bootstrap): label-aware F1@0.5 from the per-record counts and, where the detections were kept, COCO mAP.
    Arms without per-record counts (a ledger from before they were kept) are left out, as is the mAP of runs
    without detections. `vary`: which bootstrap level is drawn (paired_bootstrap)."""
    out = []

    def per_seed(table: dict, setting: str, arm: str) -> dict:
        got = {r["seed"]: table.get(key_of(r)) for r in finals.get((setting, arm), [])}
        return {k: v for k, v in got.items() if v}

    for setting in settings:
        for baseline in BASELINES:
            for arm in arms:
                if arm in ("sft", "warm", baseline) or (baseline == "gen1" and not arm.startswith("gen2")):
                    continue
                for figure, table, kw in (
                    ("f1", records, {}),
                    ("map", detections or {}, {"figure": RecordMatches.map, "draws": map_draws}),
                ):
                    base, other = per_seed(table, setting, baseline), per_seed(table, setting, arm)
                    seeds = sorted(set(base) & set(other))
                    if not seeds:
                        continue
                    d, lo, hi = paired_bootstrap(other, base, vary=vary, **kw)
                    out.append(Paired(setting, arm, baseline, figure, d, lo, hi, len(base[seeds[0]]), len(seeds)))
    return out


def plot_paired(diffs: list[Paired], path: Path, bar: float = 0.03) -> None:
    """OUT/NAME-paired.png: each paired difference with its 95% interval, F1 and mAP side by side, the +-`bar`
    lines of issue 43's bar (a difference resolved when its interval is narrower than 2 x bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [f for f in ("f1", "map") if any(p.figure == f for p in diffs)]
    names = list(dict.fromkeys(f"{p.setting}: {p.arm} - {p.baseline}" for p in diffs))
    fig, axes = plt.subplots(
        1, len(figures), figsize=(4.6 * len(figures), 0.5 * len(names) + 1.4), squeeze=False, sharey=True
    )
    for ax, figure in zip(axes[0], figures, strict=True):
        for p in diffs:
            if p.figure != figure:
                continue
            y = names.index(f"{p.setting}: {p.arm} - {p.baseline}")
            ax.errorbar(p.diff, y, xerr=[[p.diff - p.lo], [p.hi - p.diff]], fmt="o", color="k", capsize=3)
        ax.axvline(0.0, color="0.3", lw=0.8)
        for x in (-bar, bar):
            ax.axvline(x, color="0.6", lw=0.8, ls="--")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title({"f1": "label-aware F1@0.5", "map": "label-aware mAP"}[figure] + ": difference, 95%", fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle("paired on the same records and seeds (two-level bootstrap); dashed: +-0.03", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def after_channel_b(step: int, warm: int, ratio: float) -> bool:
    """Whether optimizer step `step` (1-based, the step an evaluation follows) of a run with `warm` warm-start steps
    and channel-B ratio `ratio` was rollout matching (the trainer's schedule: learner.core.schedule, counted from
    the first step after the warm start)."""
    from learner.core.schedule import is_channel_b

    return ratio > 0.0 and step > warm and is_channel_b(step - warm - 1, ratio)


def plot_curves(rows: list[dict], finals: dict[tuple[str, str], list[dict]], path: Path) -> bool:
    """OUT/NAME-curves.png: label-aware F1@0.5 and mAP at every evaluation, the mean over each arm's seeds, per
    setting; an evaluation that came right after a rollout-matching (channel B) step is drawn filled, one after a
    ground-truth step hollow (learner.core.schedule: the recipe's B steps close each block, so with `--eval-every`
    a multiple of 1 / ratio every evaluation follows one). False (nothing drawn) when no run has three or more
    evaluations."""
    curves: dict[tuple[str, str], dict[int, list[dict]]] = {}
    for (setting, arm), runs in finals.items():
        keys = {key_of(r) for r in runs}
        for r in rows:
            if key_of(r) in keys:
                curves.setdefault((setting, arm), {}).setdefault(r["step"], []).append(r)
    curves = {k: v for k, v in curves.items() if len(v) >= 3 and k[1] != "warm"}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(s for s, _ in curves))
    fig, axes = plt.subplots(len(settings), 2, figsize=(10, 3.2 * len(settings)), squeeze=False)
    for i, setting in enumerate(settings):
        for j, (key, label) in enumerate((("f1", "label-aware F1@0.5"), ("map", "label-aware mAP"))):
            ax = axes[i][j]
            for (s, arm), by_step in curves.items():
                if s != setting:
                    continue
                steps = sorted(by_step)
                means = [statistics.mean(float(r[key]) for r in by_step[t]) for t in steps]
                first = by_step[steps[-1]][0]
                (line,) = ax.plot(steps, means, lw=1, label=f"{arm} ({len(by_step[steps[-1]])} seed(s))")
                after_b = [after_channel_b(t, first["warm"], float(first["ratio"])) for t in steps]
                ax.scatter(
                    steps,
                    means,
                    s=14,
                    color=line.get_color(),
                    zorder=3,
                    facecolors=[line.get_color() if b else "white" for b in after_b],
                )
            ax.set_title(f"{setting}: {label} (filled: right after a channel-B step)", fontsize=9)
            ax.set_xlabel("optimizer step", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def report(
    rows: list[dict],
    out: Path,
    name: str,
    wall: float,
    records: dict[tuple, list[tuple[int, int, int]]] | None = None,
    detections: dict[tuple, RecordMatches] | None = None,
) -> str:
    """The plot OUT/NAME.png, a table on stdout and the RESULT line (returned) of the ledger `rows` (with
    `records`, the per-record counts, and `detections`: each arm against plain SFT and generation 1, paired)."""
    finals = final_rows(rows)
    settings = list(dict.fromkeys(s for s, _ in finals))
    arms = [a for a in ("warm", *ARMS) if any(a == arm for _, arm in finals)]
    parts = []
    print(f"{'setting':8} {'arm':7} {'seeds':5} " + " ".join(f"{k:>22}" for k in SUMMARY))
    for setting in settings:
        for arm in arms:
            finals_sa = finals.get((setting, arm))
            if not finals_sa:
                continue
            cells = []
            for k in SUMMARY:
                mean, lo, hi = spread([float(r[k]) for r in finals_sa])
                fmt = ".0f" if k in ("tokens_trained", "wall_s") else ".3f"
                cells.append(f"{mean:{fmt}} [{lo:{fmt}},{hi:{fmt}}]")
                parts.append(
                    f"{setting}_{arm}_{k}={mean:.4g} {setting}_{arm}_{k}_min={lo:.4g} {setting}_{arm}_{k}_max={hi:.4g}"
                )
            print(f"{setting:8} {arm:7} {len(finals_sa):5} " + " ".join(f"{c:>22}" for c in cells))
    print("(mean over seeds [min, max]; warm: the shared start every arm resumes)")
    diffs = paired_differences(finals, records or {}, settings, arms, detections)
    for p in diffs:
        print(p.line())
    parts += [p.part() for p in diffs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    trained = [a for a in arms if a != "warm"]
    fig, axes = plt.subplots(
        max(1, len(settings)), len(PANELS), figsize=(2.9 * len(PANELS), 2.8 * len(settings)), squeeze=False
    )
    for r, setting in enumerate(settings):
        for c, (key, label) in enumerate(PANELS):
            ax = axes[r][c]
            stats = [spread([float(x[key]) for x in finals.get((setting, a), [])]) for a in trained]
            means = [s[0] for s in stats]
            err = [
                [m - s[1] for m, s in zip(means, stats, strict=True)],
                [s[2] - m for m, s in zip(means, stats, strict=True)],
            ]
            ax.bar(range(len(trained)), means, yerr=err, capsize=3, color="0.6")
            if (setting, "warm") in finals:
                start = spread([float(x[key]) for x in finals[(setting, "warm")]])[0]
                ax.axhline(start, color="k", lw=0.8, ls=":", label="after the warm start")
            ax.set_xticks(range(len(trained)), trained, fontsize=7)
            seeds = len(finals.get((setting, trained[0]), [])) if trained else 0
            ax.set_title(f"{setting} ({seeds} seed{'s' if seeds != 1 else ''}): {label}", fontsize=9)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        "same start, same optimizer steps: mean over the seeds, bars min-max"
        + (f", {wall / 60:.0f} min" if wall else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)
    plt.close(fig)
    if diffs:
        plot_paired(diffs, out / f"{name}-paired.png")
    plot_curves(rows, finals, out / f"{name}-curves.png")
    return "RESULT " + " ".join(parts) + f" wall_s={wall:.1f}"
