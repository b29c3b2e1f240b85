"""The suite's own clock (issue 40): what each run spends, where, and a budget it must stay inside.

Registered by tests/conftest.py. On the process that reports (the only one without xdist, the controller
with it):
- the terminal summary gives the run's wall time, the test time per tier (cluster, envtest, gpu, vllm,
  other: a test's tier is the first of those markers it carries) and the slowest 30 tests (setup, call and
  teardown together, so a module's expensive fixture shows on the test that paid for it);
- `.rmsft/test-times.json` keeps the same figures for `scripts/test_times.py`, which prints the table
  docs/development.md shows and rewrites tests/durations.json;
- a whole run (`make test` as CI runs it: pytest's testpaths, no -k, -m, --deselect, --lf or --ff) that
  takes longer than `rmsft_suite_budget_s` (pyproject.toml, the one place the budget is written) fails,
  saying by how much and where the time went, so a slow addition is seen in the change that adds it.

Under xdist it schedules. Every test belongs to a work unit that one process runs whole: the cluster tier and
the envtest tier are one unit each (each shares one expensive bring-up: a node and an image, a control plane),
any other test goes with its module (which shares the module's fixtures). The units are handed out longest
first (tests/durations.json: the seconds each took in a measured run), so the processes end close together
instead of one waiting on a long unit picked up last; within a unit the file order is kept. (xdist's own
`loadgroup` cannot be used: it renames node ids through an attribute pytest 9 no longer reads.)"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = Path(__file__).resolve().parent / "durations.json"
# where a run writes its figures; RMSFT_TEST_TIMES moves it (tests/test_suite_clock.py runs pytest inside pytest)
TIMES_OUT = Path(os.environ.get("RMSFT_TEST_TIMES") or ROOT / ".rmsft" / "test-times.json")
TIERS = ("cluster", "envtest", "gpu", "vllm")  # a test's tier: the first of these markers it carries, else "other"
GROUPED_TIERS = ("cluster", "envtest")  # one work unit each: one bring-up shared by the tier's tests
SLOWEST = 30
UNKNOWN_UNIT_S = 5.0  # a unit tests/durations.json has not measured yet (a new module) is scheduled as this long


def tier_of(names: Any) -> str:
    return next((t for t in TIERS if t in names), "other")


def slowest(tests: dict[str, list[Any]], n: int = SLOWEST) -> list[tuple[str, list[Any]]]:
    """The n slowest of {nodeid: [tier, seconds]}, slowest first (the summary and scripts/test_times.py)."""
    return sorted(tests.items(), key=lambda kv: -kv[1][1])[:n]


def work_unit(nodeid: str) -> str:
    """The work unit of a test: its tier for the grouped tiers (each is a folder), else its module's path."""
    path = nodeid.split("::", 1)[0]
    return next((t for t in GROUPED_TIERS if path.startswith(f"tests/{t}/")), path)


def _whole_run(config: pytest.Config) -> bool:
    """True for the run CI makes: every test under testpaths, nothing selected away or reordered by cache."""
    opt = config.option
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not getattr(opt, "keyword", "")
        and not getattr(opt, "markexpr", "")
        and not getattr(opt, "deselect", None)
        and not getattr(opt, "lf", False)
        and not getattr(opt, "failedfirst", False)
    )


def unit_order(units: list[str], known: dict[str, float]) -> dict[str, int]:
    """Each unit's place in the queue: longest first by its measured seconds (LPT: what is left at the end is
    short, so the workers finish together), a unit never measured as UNKNOWN_UNIT_S, ties in file order."""
    first_seen = {u: i for i, u in enumerate(dict.fromkeys(units))}
    ordered = sorted(first_seen, key=lambda u: (-known.get(u, UNKNOWN_UNIT_S), first_seen[u]))
    return {u: i for i, u in enumerate(ordered)}


class SuiteClock:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.worker = hasattr(config, "workerinput")
        self.t0 = time.monotonic()
        self.tests: dict[str, list[Any]] = {}  # nodeid -> [tier, seconds]
        self.tier_timings: dict[str, dict[str, float]] = {}  # bring-up figures a tier reports (cluster)
        self.over_budget: str | None = None

    # -- scheduling (xdist) ----------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        # On each worker, the order the units are queued in: the controller's queue follows the order the
        # workers collected (with --no-loadscope-reorder), and a worker runs its items by their place in it.
        if not self.worker:
            return  # one process: file order, as pytest runs it
        rank = unit_order([work_unit(it.nodeid) for it in items], _load_durations())
        items.sort(key=lambda it: rank[work_unit(it.nodeid)])  # stable: each unit keeps its own test order

    @pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without it
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getoption("dist") != "loadscope":
            return None  # another mode asked for by name: xdist's own
        from xdist.scheduler import LoadScopeScheduling

        class UnitScheduling(LoadScopeScheduling):
            """xdist's loadscope with this suite's work units as the scopes."""

            def _split_scope(self, nodeid: str) -> str:
                return work_unit(nodeid)

        return UnitScheduling(config, log)

    # -- measuring (the reporting process) ------------------------------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        entry = self.tests.setdefault(report.nodeid, [tier_of(report.keywords), 0.0])
        entry[1] += report.duration
        for key, value in report.user_properties:
            if key == "tier timings":
                self.tier_timings.update(value)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.worker:
            return
        wall = time.monotonic() - self.t0
        tiers: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for tier, seconds in self.tests.values():
            tiers[tier][0] += 1
            tiers[tier][1] += seconds
        self.summary = {
            "wall_s": round(wall, 1),
            "workers": _workers(self.config),
            "whole_run": _whole_run(self.config),
            "tiers": {t: {"tests": n, "seconds": round(s, 1)} for t, (n, s) in sorted(tiers.items())},
            "tier_timings": {k: {n: round(v, 1) for n, v in d.items()} for k, d in self.tier_timings.items()},
            "tests": {nodeid: [tier, round(s, 2)] for nodeid, (tier, s) in self.tests.items()},
        }
        if self.tests:
            try:
                TIMES_OUT.parent.mkdir(parents=True, exist_ok=True)
                TIMES_OUT.write_text(json.dumps(self.summary, indent=1) + "\n")
            except OSError:  # a read-only checkout still runs its tests; the figures are in the summary
                pass
        budget = _budget(self.config)
        if budget is not None and self.summary["whole_run"] and wall > budget:
            self.over_budget = (
                f"the suite took {wall:.0f} s, over its budget of {budget:.0f} s (rmsft_suite_budget_s in "
                f"pyproject.toml) by {wall - budget:.0f} s: see the slowest tests above; make the new test cheaper "
                '(share the fixture that pays, docs/development.md "Test time") rather than raising the budget'
            )
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.worker or not self.tests:
            return
        s = self.summary
        tr = terminalreporter
        tr.section("suite time")
        tiers = ", ".join(f"{t} {v['tests']} tests {v['seconds']:.0f} s" for t, v in s["tiers"].items())
        tr.write_line(f"wall {s['wall_s']:.0f} s on {s['workers']} worker(s); test time by tier: {tiers}")
        for tier, figures in s["tier_timings"].items():
            tr.write_line(f"{tier} bring-up: " + ", ".join(f"{k} {v:.0f} s" for k, v in figures.items()))
        slow = slowest(s["tests"])
        tr.write_line(f"slowest {len(slow)} tests (setup + call + teardown):")
        for nodeid, (tier, seconds) in slow:
            tr.write_line(f"  {seconds:8.1f} s  {tier:8s} {nodeid}")
        if self.over_budget:
            tr.write_line(f"FAILED: {self.over_budget}", red=True, bold=True)


def _load_durations() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text())["units"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def _budget(config: pytest.Config) -> float | None:
    raw = str(config.getini("rmsft_suite_budget_s") or "").strip()
    return float(raw) if raw else None


def _workers(config: pytest.Config) -> int:
    n = getattr(config.option, "numprocesses", None)
    return int(n) if isinstance(n, int) and n > 0 and getattr(config.option, "dist", "no") != "no" else 1


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "rmsft_suite_budget_s",
        "a whole run (make test, as CI runs it) must end within this many "
        "seconds of pytest's own time, else it fails (tests/suite_clock.py)",
        default="",
    )
