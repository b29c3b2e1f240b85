"""Dashboards may only query metrics that some component declares (and so exports).

Declared names come from the three metrics modules, read with `ast` (no imports, so this test
needs neither torch nor vLLM). A PromQL query mentions a metric as an `rmsft_*` identifier;
histogram series (`_bucket`, `_sum`, `_count`) and counter `_created` map to their base name.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
METRIC_MODULES = ["rollout_svc/metrics.py", "learner/metrics.py", "operator/rmsft_operator/metrics.py"]
DASHBOARDS = sorted((ROOT / "charts/rmsft/dashboards").glob("*.json"))
_NAME = re.compile(r"(?<![A-Za-z0-9_:])(rmsft_[A-Za-z0-9_]+)")
_KINDS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}


def declared_metrics() -> dict[str, str]:
    """name -> kind for every prometheus_client metric constructed in the metrics modules."""
    out: dict[str, str] = {}
    for rel in METRIC_MODULES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _KINDS:
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    out[first.value] = node.func.id
    return out


def exported_series(declared: dict[str, str]) -> set[str]:
    """Series names Prometheus will see for the declared metrics."""
    names: set[str] = set()
    for name, kind in declared.items():
        base = name.removesuffix("_total") if kind == "Counter" else name
        if kind == "Counter":
            names |= {f"{base}_total", f"{base}_created"}
        elif kind in ("Histogram", "Summary"):
            names |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
        else:
            names.add(name)
    return names


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target, including panels nested in rows."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    found.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        if isinstance(q, str) and "rmsft_" in q:
            found.append((f"variable {var.get('name')}", q))
    return found


def unknown_metrics(expr: str, allowed: set[str]) -> list[str]:
    return [m for m in _NAME.findall(expr) if m not in allowed]


def test_every_metrics_module_declares_metrics() -> None:
    declared = declared_metrics()
    for prefix in ("rmsft_rollout_", "rmsft_learner_", "rmsft_operator_"):
        assert any(n.startswith(prefix) for n in declared), prefix


def test_checker_catches_an_undeclared_metric() -> None:
    allowed = exported_series(declared_metrics())
    assert unknown_metrics("rate(rmsft_rollout_generate_seconds_bucket[5m])", allowed) == []
    assert unknown_metrics("rate(rmsft_rollout_tokens_per_second[5m])", allowed) == \
        ["rmsft_rollout_tokens_per_second"]
    assert unknown_metrics("rmsft_learner_global_step_bucket", allowed) == ["rmsft_learner_global_step_bucket"]


def test_there_are_dashboards() -> None:
    assert {d.stem for d in DASHBOARDS} >= {"training", "rollout", "weight-sync", "operator"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_dashboard_queries_only_exported_metrics(path: Path) -> None:
    allowed = exported_series(declared_metrics())
    dash = json.loads(path.read_text())
    queries = panel_queries(dash)
    assert queries, f"{path.name} has no queries"
    bad = [(title, m) for title, expr in queries for m in unknown_metrics(expr, allowed)]
    assert not bad, f"{path.name} queries metrics no component exports: {bad}"
    for title, expr in queries:
        assert _NAME.search(expr), f"{path.name} panel {title!r} queries no rmsft metric: {expr}"


def test_dashboards_cover_the_required_views() -> None:
    text = " ".join(expr for d in DASHBOARDS for _, expr in panel_queries(json.loads(d.read_text())))
    for needed in ("rmsft_learner_phase_seconds", "rmsft_rollout_generated_tokens_total",
                   "rmsft_rollout_generate_seconds", "rmsft_rollout_weight_sync_seconds",
                   "rmsft_rollout_weight_sync_bytes_total", "rmsft_learner_packing_fill_ratio",
                   "rmsft_rollout_ready", "rmsft_operator_reconciles_total", "rmsft_operator_jobs"):
        assert needed in text, needed
