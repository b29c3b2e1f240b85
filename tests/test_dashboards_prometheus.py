"""The Grafana dashboards against a real Prometheus (tests/promql.py: Debian's `prometheus`, started here) scraping
a short `rmsft local` run: the learner's /metrics and its rollout server's, every second. Every panel query of
charts/rmsft/dashboards/*.json, its template variables substituted as Grafana does, is evaluated over the run's
window through the HTTP API (a range query, as a panel runs it) and must give at least one series with a number;
the failure lists every panel that would draw nothing. tests/test_dashboards.py checks only the metric names.

Labels: the dashboards select on the Kubernetes labels a cluster scrape attaches (`namespace`, `pod`); a local
scrape has none, so the targets file gives each target the labels its pod would carry (one namespace, the pod's
name), and the same queries match.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from promql import DASHBOARDS, GRPO_PANELS, Panel, Prometheus, empty_panels, series_with_data, substitute

from rmsft_dev.synthetic import write_synthetic_dataset

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "rmsft-local"
STEPS = 24  # about 20 s of steps here: enough scrapes of the learner for every rate() window

# Not evaluated here, each with why and where it is: a panel added to a dashboard is evaluated unless named here.
ELSEWHERE = {  # whole dashboards
    "operator": "the operator's rmsft_operator_* come from the kopf operator, which needs a Kubernetes API: "
    "tests/envtest/test_envtest_operator.py evaluates them against a Prometheus scraping it",
}
# GRPO's labelled gauges (stat, reward) are set by a `spec.trainer: grpo` step only; this run is the rollout-matching
# trainer (the GRPO row's unlabelled gauges, exported at 0, are evaluated here). A GRPO run evaluates them:
# tests/learner/test_grpo_trainer.py.
NOT_HERE = GRPO_PANELS


def _job(tiny_model_dir: Path, where: Path) -> Path:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(tiny_model_dir)
    spec["rollout"].update(replicas=1, maxModelLen=1024)
    t = spec["training"]
    t.update(steps=STEPS, packing_length=1024, prompts_per_step=2)
    t["data"]["path"] = str(write_synthetic_dataset(where / "train.jsonl", n=16, seed=0))
    # The held-out row: an evaluation in the middle of the run, scraped while the run goes on.
    t["eval"] = {
        "data": str(write_synthetic_dataset(where / "heldout.jsonl", n=4, seed=1)),
        "every": 8,
        "max_samples": 4,
    }
    # The rollouts-ahead row (staleness histogram): one step generated ahead.
    t["rollout"].update(max_tokens=48, max_staleness=1)
    t["checkpoint"] = {"dir": str(where / "ckpt"), "every": 0, "keep": 1}
    job = where / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    return job


class Run:
    """`rmsft local JOB` in a subprocess; its output lines collected as they come."""

    def __init__(self, job: Path, work: Path) -> None:
        env = {
            **os.environ,
            "COLUMNS": "200",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rmsft_cli", "local", str(job), "--work-dir", str(work)],
            cwd=work.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def endpoints(self) -> dict[str, str]:
        """pod name -> host:port of the /metrics endpoints the run printed so far."""
        found = {}
        for line in list(self.lines):
            if m := re.search(r"learner /metrics: http://(127\.0\.0\.1:\d+)/metrics", line):
                found["learner"] = m[1]
            if m := re.search(r"rollout server (\d+): .*/metrics http://(127\.0\.0\.1:\d+)/metrics", line):
                found[f"rollout-{m[1]}"] = m[2]
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


@pytest.mark.vllm
@pytest.mark.slow
def test_every_dashboard_panel_returns_data_from_a_local_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    prom = Prometheus(tmp_path)
    run = Run(_job(tiny_model_dir, tmp_path), tmp_path / "work")
    try:
        start = time.time()
        # The endpoints are printed as the run starts, before the servers load: each is scraped from when it is
        # known, so the series cover the whole run.
        seen: dict[str, str] = {}

        def all_known() -> bool:
            assert run.proc.poll() is None, f"rmsft local ended before its endpoints were printed:\n{run.output}"
            now = run.endpoints()
            if now != seen:
                seen.update(now)
                prom.set_targets(
                    [(addr, {"namespace": NAMESPACE, "pod": f"local-tiny-{pod}"}) for pod, addr in sorted(seen.items())]
                )
            return {"learner", "rollout-0"} <= set(seen)

        prom.wait(all_known, 300, "the run to print the learner's and the server's /metrics")

        def both_up() -> bool:
            up = prom.targets_up()
            assert run.proc.poll() is None, f"rmsft local ended before both targets were up ({up}):\n{run.output}"
            return sorted(up.values()) == ["up", "up"]

        prom.wait(both_up, 60, "both targets up")
        code = run.proc.wait(300)
        end = time.time()
        errors = {t["labels"]["pod"]: t["lastError"] for t in prom.api("targets")["activeTargets"]}
        assert code == 0, run.output[-4000:]
    finally:
        run.stop()
    try:
        empty: list[str] = []
        evaluated = 0
        for path in DASHBOARDS:
            if path.stem in ELSEWHERE:
                continue
            chosen, nothing = empty_panels(prom, path, start, end, lambda p: (p.dashboard, p.title) not in NOT_HERE)
            evaluated += len(chosen)
            empty += nothing
        assert evaluated > 50, evaluated
        # Each component's series come from its own target: a learner exporting the servers' rmsft_rollout_* at 0
        # adds a flat series to every per-pod rollout panel (and a server's version 0 to "Weight version").
        # Evaluated every 5 s: a step longer than the run evaluates at `start` alone, before the first scrape, and
        # finds nothing (the run here takes about 30 s).
        by_pod = {
            (s["metric"]["__name__"].split("_")[1], s["metric"]["pod"])
            for s in prom.api("query_range", query='{__name__=~"rmsft_.*"}', start=start, end=end, step=5)["result"]
        }
        # How the scrapes went, for the failure message: a scrape that times out ingests nothing.
        scrapes = {
            r["metric"]["pod"]: r["value"][1]
            for r in prom.api(
                "query",
                query=f"sum by (pod) (sum_over_time(up[{int(end - start) + 1}s])) / sum by (pod) "
                f"(count_over_time(up[{int(end - start) + 1}s]))",
                time=end,
            )["result"]
        }
        assert not empty, (
            "panels that draw nothing over a whole `rmsft local` run:\n"
            + "\n".join(empty)
            + f"\nshare of scrapes that succeeded: {scrapes}; last scrape errors: {errors}"
        )
        assert by_pod == {("learner", "local-tiny-learner"), ("rollout", "local-tiny-rollout-0")}, by_pod
    finally:
        prom.stop()


def test_an_empty_panel_is_reported(tmp_path: Path) -> None:
    """The check itself, on a Prometheus with no targets: a query that matches nothing gives no series."""
    prom = Prometheus(tmp_path)
    try:
        now = time.time()
        assert series_with_data(prom, "vector(1)", now - 5, now)
        assert series_with_data(prom, 'rmsft_learner_global_step{namespace=~"(x)"}', now - 5, now) == []
        # NaN at every point (a quantile over no observations) draws nothing either.
        assert series_with_data(prom, "vector(0) / 0", now - 5, now) == []
        assert substitute('up{namespace=~"$namespace"}', {"namespace": "(a|b)"}) == 'up{namespace=~"(a|b)"}'
        with pytest.raises(AssertionError, match="no template variable"):
            substitute('up{pod=~"$pod"}', {"namespace": "(a)"})
        assert Panel("d", "t", "e").dashboard == "d"
    finally:
        prom.stop()
