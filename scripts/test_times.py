"""The suite's time, from the figures the last `make test` wrote (.rmsft/test-times.json, tests/suite_clock.py).

    python scripts/test_times.py            # the Markdown docs/development.md shows ("Test time"): tiers, slowest 30
    python scripts/test_times.py --update   # also rewrite tests/durations.json (the work units' seconds, which
                                            # make test's two processes take longest first)

Only a whole run (`make test` with no selection) updates tests/durations.json: a partial run would drop the
units it did not run."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from suite_clock import DURATIONS, SLOWEST, TIMES_OUT, slowest, work_unit  # noqa: E402


def markdown(times: dict) -> str:
    lines = [
        f"Wall {times['wall_s'] / 60:.1f} min on {times['workers']} worker(s).",
        "",
        "| tier | tests | test time (s) |",
        "|---|---:|---:|",
    ]
    for tier, v in times["tiers"].items():
        lines.append(f"| {tier} | {v['tests']} | {v['seconds']:.0f} |")
    for tier, figures in times.get("tier_timings", {}).items():
        lines += ["", f"{tier} bring-up: " + ", ".join(f"{k} {v:.0f} s" for k, v in figures.items()) + "."]
    lines += ["", f"Slowest {SLOWEST} tests (setup + call + teardown):", "", "| s | tier | test |", "|---:|---|---|"]
    lines += [f"| {s:.0f} | {tier} | `{nodeid}` |" for nodeid, (tier, s) in slowest(times["tests"])]
    return "\n".join(lines)


def units(times: dict) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for nodeid, (_tier, seconds) in times["tests"].items():
        out[work_unit(nodeid)] += seconds
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update", action="store_true", help="rewrite tests/durations.json from a whole run")
    ap.add_argument("--times", type=Path, default=TIMES_OUT, help=f"the figures (default {TIMES_OUT})")
    args = ap.parse_args()
    if not args.times.exists():
        sys.exit(f"{args.times} not found: run `make test` first (it writes the figures at the end)")
    times = json.loads(args.times.read_text())
    print(markdown(times))
    if args.update:
        if not times.get("whole_run"):
            sys.exit("not updating tests/durations.json: the figures are of a partial run (run `make test` whole)")
        DURATIONS.write_text(
            json.dumps(
                {
                    "about": "seconds each xdist work unit took in a whole `make test` "
                    "(tests/suite_clock.py schedules the longest first); "
                    "regenerate with `python scripts/test_times.py --update`",
                    "units": units(times),
                },
                indent=1,
            )
            + "\n"
        )
        print(f"\nwrote {DURATIONS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
