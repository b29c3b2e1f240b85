"""A real Prometheus for the dashboard tests: Debian's `prometheus` binary (scripts/setup-cluster.sh installs the
package), started by the test with its own config, a tmp storage dir and a free port on 127.0.0.1 (the package's
own service, where systemd starts one, is never used), scraping targets the test names through a file_sd file;
and every panel query of charts/rmsft/dashboards/*.json, with Grafana's template variables substituted as Grafana
does, evaluated through its HTTP API."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiers import unavailable

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "charts/rmsft/dashboards").glob("*.json"))
SCRAPE_INTERVAL_S = 1
_LABEL_VALUES = re.compile(r"^label_values\(\s*([^,]+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)$")
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Panel:
    dashboard: str
    title: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.title!r}: {self.expr}"


def dashboard_panels(path: Path) -> tuple[list[Panel], list[dict[str, Any]]]:
    """Every target expr of every panel (rows' nested panels too), and the dashboard's template variables."""
    dash = json.loads(path.read_text())
    found: list[Panel] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            found.extend(
                Panel(path.stem, p.get("title", "?"), t["expr"]) for t in p.get("targets", []) if t.get("expr")
            )
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    return found, dash.get("templating", {}).get("list", [])


class Prometheus:
    """`prometheus` on 127.0.0.1:<free port>, scraping every second what `set_targets` names."""

    def __init__(self, where: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            unavailable(
                "dashboards-against-Prometheus",
                "no `prometheus` binary: Debian's package (apt-get install "
                "prometheus; scripts/setup-cluster.sh installs it as root)",
            )
        self.targets_file = where / "targets.json"
        self.targets_file.write_text("[]")
        config = where / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # YAML is a superset of JSON
                    "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
                    # file_sd: the targets' ports are known only once the run prints them; Prometheus watches the file.
                    "scrape_configs": [{"job_name": "rmsft", "file_sd_configs": [{"files": [str(self.targets_file)]}]}],
                }
            )
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = where / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={where / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.wait(lambda: self._ready(), 30, "Prometheus to answer /-/ready")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"waited {timeout_s:.0f} s for {what}; prometheus log: {self.log.read_text()[-2000:]}"
                )
            time.sleep(0.2)

    def set_targets(self, targets: list[tuple[str, dict[str, str]]]) -> None:
        """(host:port, labels) to scrape; written whole, then renamed, so Prometheus never reads half a file."""
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [t], "labels": labels} for t, labels in targets]))
        tmp.replace(self.targets_file)

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # a bad query: 400 with Prometheus's reason
            body = json.load(e)
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def scrapes_since(self, t: float) -> int:
        """The fewest scrapes any target has had since time `t` (samples of `up` after it; a rate() needs two)."""
        now = time.time()
        window = max(1, int(now - t))  # whole seconds, none before t
        result = self.api("query", query=f"count_over_time(up[{window}s])", time=now)["result"]
        return min((int(float(r["value"][1])) for r in result), default=0)

    def targets_up(self) -> dict[str, str]:
        """scrape URL -> health ("up", "down", "unknown") of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def variable_values(prom: Prometheus, variables: list[dict[str, Any]], start: float, end: float) -> dict[str, str]:
    """Each template variable as Grafana substitutes it in a Prometheus query: a `label_values(metric, label)`
    variable with "All" selected becomes the regex `(v1|v2|...)` of the values Prometheus has over the window
    (the variable's own query, evaluated here); the datasource variable is not in any expr."""
    out: dict[str, str] = {}
    for var in variables:
        if var.get("type") == "datasource":
            continue
        m = _LABEL_VALUES.match(var.get("query") or "")
        assert var.get("type") == "query" and m, (
            f"template variable {var.get('name')!r} of a kind this test cannot substitute yet: {var}"
        )
        values = prom.api(f"label/{m[2]}/values", **{"match[]": m[1], "start": start, "end": end})
        assert values, f"variable {var['name']!r} ({var['query']}) has no values: its panels would all be empty"
        # Regex-escaped, then each backslash doubled inside PromQL's double-quoted string (Grafana does the same).
        out[var["name"]] = "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in values) + ")"
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m[1] or m[2]
        assert name in values, f"`${name}` in {expr!r} is no template variable this test substitutes"
        return values[name]

    return _VARIABLE.sub(one, expr)


def series_with_data(prom: Prometheus, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    """The series `expr` gives over [start, end] (a range query, as a Grafana panel runs it) that hold at least one
    number: a histogram_quantile over no observations is NaN at every point, which a panel draws as nothing."""
    result = prom.api("query_range", query=expr, start=start, end=end, step=SCRAPE_INTERVAL_S)["result"]
    return [s for s in result if any(not math.isnan(float(v)) for _, v in s["values"])]


def used_variables(panels: list[Panel], variables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The template variables some of `panels` query: a variable no panel uses changes no query (the operator
    dashboard's `namespace` is read from a learner metric, which a scrape of the operator alone has none of)."""
    names = {m[1] or m[2] for p in panels for m in _VARIABLE.finditer(p.expr)}
    return [v for v in variables if v.get("name") in names]


def empty_panels(
    prom: Prometheus, path: Path, start: float, end: float, keep=lambda panel: True
) -> tuple[list[Panel], list[str]]:
    """Evaluates the panels of dashboard `path` that `keep` selects over [start, end]: (those evaluated, the ones
    that draw nothing, each described with its query). The check every dashboard test shares."""
    panels, variables = dashboard_panels(path)
    chosen = [p for p in panels if keep(p)]
    values = variable_values(prom, used_variables(chosen, variables), start, end)
    return chosen, [str(p) for p in chosen if not series_with_data(prom, substitute(p.expr, values), start, end)]


def dashboard(stem: str) -> Path:
    return next(p for p in DASHBOARDS if p.stem == stem)


# Panels set by a `spec.trainer: grpo` step only (labelled gauges: the stat, each reward's name), evaluated against a
# GRPO run (tests/learner/test_grpo_trainer.py), not the rollout-matching run of tests/test_dashboards_prometheus.py.
GRPO_PANELS = {("training", "Reward"), ("training", "Reward by part")}
