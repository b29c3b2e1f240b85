"""The suite's clock (tests/suite_clock.py, issue 40): a whole run over its budget fails and says where the time
went; a selected run is never held to the budget; the two test processes take the longest work units first, the
cluster and envtest tiers as one unit each. The runs here are pytest in a subprocess on a two-test project (a few
seconds), with the plugin registered as tests/conftest.py registers it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from suite_clock import UNKNOWN_UNIT_S, unit_order

HERE = Path(__file__).resolve().parent


def _project(tmp_path: Path, budget_s: float) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntestpaths = .\nrmsft_suite_budget_s = {budget_s}\n")
    (tmp_path / "conftest.py").write_text(
        "from suite_clock import SuiteClock, pytest_addoption  # noqa: F401\n\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(SuiteClock(config), 'rmsft-suite-clock')\n"
    )
    (tmp_path / "test_two.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(1.2)\n\ndef test_quick():\n    pass\n"
    )
    return tmp_path


def _pytest(project: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = project / "times.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "RMSFT_TEST_TIMES": str(out),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, json.loads(out.read_text())


def test_a_whole_run_over_its_budget_fails_and_says_where_the_time_went(tmp_path: Path) -> None:
    proc, times = _pytest(_project(tmp_path, budget_s=0.5))
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "2 passed" in proc.stdout, proc.stdout[-3000:]  # every test passed: the budget alone failed the run
    assert "over its budget of 0 s (rmsft_suite_budget_s in pyproject.toml)" in proc.stdout, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    slowest = lines.index("slowest 2 tests (setup + call + teardown):")
    assert "test_two.py::test_slow" in lines[slowest + 1], lines[slowest:]  # the slow one first
    assert times["whole_run"] is True and times["tiers"]["other"]["tests"] == 2, times
    assert times["tests"]["test_two.py::test_slow"][1] >= 1.2, times


def test_a_run_inside_its_budget_passes_and_a_selected_run_is_not_held_to_it(tmp_path: Path) -> None:
    inside, times = _pytest(_project(tmp_path, budget_s=300))
    assert inside.returncode == 0, inside.stdout[-3000:]
    assert "wall " in inside.stdout and "test time by tier: other 2 tests" in inside.stdout, inside.stdout[-3000:]
    assert times["whole_run"] is True, times

    tight = _project(tmp_path / "tight", budget_s=0.5)
    selected, times = _pytest(tight, "-k", "slow")
    assert selected.returncode == 0 and "over its budget" not in selected.stdout, selected.stdout[-3000:]
    assert times["whole_run"] is False and list(times["tests"]) == ["test_two.py::test_slow"], times


def test_two_workers_report_every_test_once_with_its_time(tmp_path: Path) -> None:
    """Under xdist the controller reports: each test once, its time, the budget still applied to the whole run."""
    proc, times = _pytest(_project(tmp_path, budget_s=0.5), "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder")
    assert proc.returncode == 1 and "2 passed" in proc.stdout, proc.stdout[-3000:]
    assert sorted(times["tests"]) == ["test_two.py::test_quick", "test_two.py::test_slow"], times
    assert times["workers"] == 2 and times["tests"]["test_two.py::test_slow"][1] >= 1.2, times


def test_units_are_queued_longest_first_in_file_order_on_ties() -> None:
    units = ["tests/a.py", "tests/a.py", "cluster", "tests/b.py", "envtest", "tests/new.py", "tests/c.py"]
    known = {"tests/a.py": 10.0, "cluster": 900.0, "tests/b.py": 300.0, "envtest": 120.0, "tests/c.py": 10.0}
    rank = unit_order(units, known)
    assert sorted(rank, key=rank.__getitem__) == [
        "cluster",
        "tests/b.py",
        "envtest",
        "tests/a.py",
        "tests/c.py",
        "tests/new.py",
    ]
    assert UNKNOWN_UNIT_S < 10.0  # a never-measured module waits behind the measured ones
