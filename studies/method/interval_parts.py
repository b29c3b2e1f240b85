"""Where the width of method_compare's paired intervals comes from: seeds or held-out records.

    python studies/method/interval_parts.py studies/method/results/NAME.csv [--setting row]

For every paired comparison of the grid's ledger (compare_report.paired_differences), the 95% interval's half-width
three ways: both levels drawn (the interval the report prints), records alone (every seed in every draw: the part
more seeds cannot narrow, only a larger held-out set) and seeds alone (every record in every draw: the part more
seeds narrow, about as 1/sqrt(seeds)). Ends with a `RESULT` line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from compare_ledger import (
    detections_ledger,
    final_rows,
    read_detection_rows,
    read_record_rows,
    read_rows,
    records_ledger,
)
from compare_report import paired_differences


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ledger", type=Path, help="a method_compare ledger, NAME.csv")
    ap.add_argument("--setting", action="append", help="only this setting (repeatable; default: all)")
    ap.add_argument("--draws", type=int, default=1000, help="bootstrap draws of mAP (F1 draws 2000)")
    args = ap.parse_args(argv)
    if not args.ledger.exists():
        sys.exit(f"no ledger at {args.ledger}")
    finals = final_rows(read_rows([args.ledger]))
    settings = args.setting or sorted({s for s, _ in finals})
    arms = sorted({a for _, a in finals})
    records = read_record_rows(records_ledger(args.ledger))
    detections = read_detection_rows(detections_ledger(args.ledger))
    parts = {
        vary: paired_differences(finals, records, settings, arms, detections, map_draws=args.draws, vary=vary)
        for vary in ("both", "records", "seeds")
    }
    print(f"{'comparison':<28} {'figure':<6} {'seeds':>5} {'diff':>7} {'hw both':>8} {'records':>8} {'seeds':>8}")
    result = []
    for both, rec, sd in zip(parts["both"], parts["records"], parts["seeds"], strict=True):
        name = f"{both.setting}: {both.arm} - {both.baseline}"
        hws = [(p.hi - p.lo) / 2 for p in (both, rec, sd)]
        print(f"{name:<28} {both.figure:<6} {both.seeds:>5} {both.diff:>+7.3f} " + " ".join(f"{h:>8.3f}" for h in hws))
        key = f"{both.setting}_{both.arm}_minus_{both.baseline}_{both.figure}"
        result += [f"{key}_hw={hws[0]:.4g}", f"{key}_hw_records={hws[1]:.4g}", f"{key}_hw_seeds={hws[2]:.4g}"]
    print("(half-widths of 95% intervals: both levels drawn; records alone; seeds alone)")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
