"""Where the boxes of a method_compare grid go wrong: per setting and arm, from its detections ledger.

Usage: python studies/method/box_errors.py studies/method/results/NAME-detections.jsonl.gz [--setting row] [--step N]

F1@0.5 counts a box right at IoU 0.5; COCO mAP also asks for 0.55 ... 0.95. Two arms can tie on F1 and differ on mAP
because their right boxes are right by different margins. This reads every final evaluation kept in the ledger
(`NAME-detections.jsonl.gz`, studies/method/compare_ledger.py), pairs each prediction, in the order written, with the
unpaired ground-truth object of its label it overlaps most (IoU >= 0.5: COCO's greedy rule at its loosest
threshold), and prints per arm, over its seeds and records:
- the pairs, their mean IoU and the share at IoU >= 0.75 and >= 0.9;
- per box edge (x1, y1, x2, y2), the mean absolute and the mean signed error in pixels (signed: prediction minus
  truth; a positive y2 error is a box drawn too far down);
- the most common errors of each edge, rounded to whole pixels (on the grid tasks a box is off by whole cells).
Objects taller than 1.5 times their width ("tall": the row setting's) and the others are reported apart, and per
record-evaluation with tall pairs, whether none, some or all of them have a y2 off by more than a pixel (a whole
row drawn a cell too tall or short is one judgement of the row's height, then copied along it).
Last line: `RESULT <setting>_<arm>_iou75=... <setting>_<arm>_tall_y2_signed=... ...`.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
from compare_ledger import read_detection_docs  # the ledger's one reader

from learner.core.match import box_iou

EDGES = ("x1", "y1", "x2", "y2")


def pairs(truth: list[list], predicted: list[list], min_iou: float = 0.5) -> list[tuple[float, list[float], bool]]:
    """(IoU, [x1, y1, x2, y2] errors, tall) for each prediction paired with a ground-truth object: in the order
    written, each takes the unpaired object of its label it overlaps most, at IoU >= `min_iou`."""
    used: set[int] = set()
    out = []
    for label, *box in predicted:
        best, best_j = min_iou, None
        for j, (t_label, *t_box) in enumerate(truth):
            if j in used or t_label != label:
                continue
            v = box_iou(box, t_box)
            if v >= best:
                best, best_j = v, j
        if best_j is None:
            continue
        used.add(best_j)
        t_box = truth[best_j][1:]
        tall = (t_box[3] - t_box[1]) > 1.5 * (t_box[2] - t_box[0])
        out.append((best, [p - t for p, t in zip(box, t_box, strict=True)], tall))
    return out


def arm_pairs(path: Path, setting: str | None = None, step: int | None = None) -> dict[tuple[str, str], list[list]]:
    """(setting, arm) -> per record-evaluation of its runs' final evaluations, its pairs (a later line of the same
    run replaces an earlier one, as the ledger is read for the report)."""
    out: dict[tuple[str, str], list[list]] = {}
    for (run_setting, arm, *_), doc in read_detection_docs(path).items():
        if (setting is not None and run_setting != setting) or (step is not None and doc["step"] != step):
            continue
        got = out.setdefault((run_setting, arm), [])
        for truth, predicted in zip(doc["truth"], doc["predicted"], strict=True):
            got.append(pairs(truth, predicted))
    return out


def tall_rows(per_record: list[list]) -> Counter:
    """Record-evaluations with tall pairs, by how many of those have a y2 off by more than a pixel: "none", "some",
    "all"."""
    out: Counter = Counter()
    for found in per_record:
        tall = [p for p in found if p[2]]
        if tall:
            off = sum(abs(p[1][3]) > 1 for p in tall)
            out["none" if off == 0 else "all" if off == len(tall) else "some"] += 1
    return out


def summary(found: list[tuple[float, list[float], bool]]) -> dict:
    ious = np.array([p[0] for p in found], dtype=float)
    out = {
        "pairs": len(found),
        "iou": float(ious.mean()) if len(found) else float("nan"),
        "iou75": float((ious >= 0.75).mean()) if len(found) else float("nan"),
        "iou90": float((ious >= 0.9).mean()) if len(found) else float("nan"),
    }
    for shape, tall in (("tall", True), ("other", False)):
        errs = np.array([p[1] for p in found if p[2] is tall], dtype=float).reshape(-1, 4)
        out[shape] = {"pairs": len(errs)}
        for i, edge in enumerate(EDGES):
            col = errs[:, i]
            out[shape][edge] = {
                "abs": float(np.abs(col).mean()) if len(col) else float("nan"),
                "signed": float(col.mean()) if len(col) else float("nan"),
                "common": Counter(int(round(v)) for v in col).most_common(3),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ledger", type=Path, help="a grid's NAME-detections.jsonl.gz")
    ap.add_argument("--setting", default=None, help="only this setting (default: every one in the ledger)")
    ap.add_argument("--step", type=int, default=None, help="only evaluations at this step (default: every final)")
    args = ap.parse_args(argv)
    if not args.ledger.exists():
        raise SystemExit(
            f"{args.ledger}: no such detections ledger (studies/method/method_compare.py writes "
            "NAME-detections.jsonl.gz beside NAME.csv)"
        )
    parts = []
    for (setting, arm), per_record in sorted(arm_pairs(args.ledger, args.setting, args.step).items()):
        s = summary([p for found in per_record for p in found])
        rows = tall_rows(per_record)
        print(
            f"{setting} / {arm}: {s['pairs']} pairs, mean IoU {s['iou']:.4f}, IoU >= 0.75 {s['iou75']:.1%}, "
            f">= 0.9 {s['iou90']:.1%}; record-evaluations with tall objects: y2 off on all {rows['all']}, "
            f"some {rows['some']}, none {rows['none']}"
        )
        for shape in ("tall", "other"):
            t = s[shape]
            edges = "; ".join(
                f"{e} |{t[e]['abs']:.2f}| {t[e]['signed']:+.2f} (most: "
                + ", ".join(f"{v:+d} px x{n}" for v, n in t[e]["common"])
                + ")"
                for e in EDGES
            )
            print(f"  {shape} ({t['pairs']}): {edges}")
        key = f"{setting}_{arm}"
        parts += [
            f"{key}_iou75={s['iou75']:.4g}",
            f"{key}_iou={s['iou']:.4g}",
            f"{key}_tall_y2_signed={s['tall']['y2']['signed']:.4g}",
            f"{key}_tall_rows_off={rows['all']}",
        ]
    print("RESULT " + " ".join(parts))


if __name__ == "__main__":
    main()
