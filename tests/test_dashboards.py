"""Dashboards may only query metrics that some component declares (and so exports).

rmsft's own names come from the three metrics modules, read with `ast` (no imports, so this test
needs neither torch nor vLLM). vLLM's own names (`vllm:*`, registered by vLLM's PrometheusStatLogger
in the rollout server process) come from rollout_engine/vllm_metrics.py, which imports only
prometheus_client. A PromQL query mentions a metric as an `rmsft_*` or `vllm:*` identifier;
histogram series (`_bucket`, `_sum`, `_count`) and counter `_total`/`_created` map to their base name.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rollout_engine.vllm_metrics import VLLM_METRICS, exposed_series, missing_vllm_metrics

ROOT = Path(__file__).resolve().parents[1]
METRIC_MODULES = ["rollout_engine/metrics.py", "learner/tracking/metrics.py", "operator/rmsft_operator/metrics.py"]
DASHBOARDS = sorted((ROOT / "charts/rmsft/dashboards").glob("*.json"))
_NAME = re.compile(r"(?<![A-Za-z0-9_:])(rmsft_[A-Za-z0-9_]+|vllm:[A-Za-z0-9_:]+)")
_KINDS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
# What the rollout dashboard's vLLM row must show: KV-cache usage, running/waiting requests,
# preemptions, token counters, time to first token (as the series names its queries use).
VLLM_VIEWS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
)


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


def allowed_series() -> set[str]:
    """Every series name a dashboard may query: rmsft's own and the declared vLLM ones."""
    vllm = {s for name, m in VLLM_METRICS.items() for s in exposed_series(name, m.kind)}
    return exported_series(declared_metrics()) | vllm


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
        if isinstance(q, str) and ("rmsft_" in q or "vllm:" in q):
            found.append((f"variable {var.get('name')}", q))
    return found


def unknown_metrics(expr: str, allowed: set[str]) -> list[str]:
    return [m for m in _NAME.findall(expr) if m not in allowed]


def test_every_metrics_module_declares_metrics() -> None:
    declared = declared_metrics()
    for prefix in ("rmsft_rollout_", "rmsft_learner_", "rmsft_operator_"):
        assert any(n.startswith(prefix) for n in declared), prefix


def test_checker_catches_an_undeclared_metric() -> None:
    allowed = allowed_series()
    assert unknown_metrics("rate(rmsft_rollout_generate_seconds_bucket[5m])", allowed) == []
    assert unknown_metrics("rate(rmsft_rollout_tokens_per_second[5m])", allowed) == ["rmsft_rollout_tokens_per_second"]
    assert unknown_metrics("rmsft_learner_global_step_bucket", allowed) == ["rmsft_learner_global_step_bucket"]


def test_checker_catches_an_undeclared_vllm_metric() -> None:
    allowed = allowed_series()
    ok = 'histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{pod="a"}[5m])))'
    assert unknown_metrics(ok, allowed) == []
    assert unknown_metrics("rate(vllm:prompt_tokens_total[1m]) / vllm:kv_cache_usage_perc", allowed) == []
    assert unknown_metrics("vllm:made_up_metric", allowed) == ["vllm:made_up_metric"]
    assert unknown_metrics("sum(rate(vllm:made_up_metric_total[5m]))", allowed) == ["vllm:made_up_metric_total"]
    # A counter is scraped only as `<name>_total`, never under its bare name; gauges get no `_total`.
    assert unknown_metrics("vllm:num_preemptions", allowed) == ["vllm:num_preemptions"]
    assert unknown_metrics("vllm:num_requests_running_total", allowed) == ["vllm:num_requests_running_total"]


def test_there_are_dashboards() -> None:
    assert {d.stem for d in DASHBOARDS} >= {"training", "rollout", "weight-sync", "operator"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_dashboard_queries_only_exported_metrics(path: Path) -> None:
    allowed = allowed_series()
    dash = json.loads(path.read_text())
    queries = panel_queries(dash)
    assert queries, f"{path.name} has no queries"
    bad = [(title, m) for title, expr in queries for m in unknown_metrics(expr, allowed)]
    assert not bad, f"{path.name} queries metrics no component exports: {bad}"
    for title, expr in queries:
        assert _NAME.search(expr), f"{path.name} panel {title!r} queries no rmsft or vLLM metric: {expr}"


def test_dashboards_cover_the_required_views() -> None:
    text = " ".join(expr for d in DASHBOARDS for _, expr in panel_queries(json.loads(d.read_text())))
    for needed in (
        "rmsft_learner_phase_seconds",
        "rmsft_rollout_generated_tokens_total",
        "rmsft_rollout_generate_seconds",
        "rmsft_rollout_weight_sync_seconds",
        "rmsft_rollout_weight_sync_bytes_total",
        "rmsft_learner_packing_fill_ratio",
        "rmsft_rollout_ready",
        "rmsft_operator_reconciles_total",
        "rmsft_operator_jobs",
        *VLLM_VIEWS,
    ):
        assert needed in text, needed


def test_training_dashboard_has_the_grpo_row() -> None:
    dash = json.loads((ROOT / "charts/rmsft/dashboards/training.json").read_text())
    rows = [p for p in dash["panels"] if p.get("type") == "row" and p.get("title") == "GRPO"]
    assert len(rows) == 1
    below = [p for p in dash["panels"] if p.get("type") != "row" and p["gridPos"]["y"] > rows[0]["gridPos"]["y"]]
    text = " ".join(t["expr"] for p in below for t in p.get("targets", []))
    for needed in (
        'rmsft_learner_reward{stat="mean"',
        'rmsft_learner_reward{stat="std"',
        "rmsft_learner_reward_part",
        "rmsft_learner_grpo_clip_fraction_ratio",
        "rmsft_learner_grpo_zero_std_groups_ratio",
        "rmsft_learner_grpo_kl",
        "rmsft_learner_completion_length_tokens",
    ):
        assert needed in text, needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_training_dashboard_has_the_rollouts_ahead_row() -> None:
    dash = json.loads((ROOT / "charts/rmsft/dashboards/training.json").read_text())
    rows = [p for p in dash["panels"] if p.get("type") == "row" and p.get("title") == "Rollouts ahead"]
    assert len(rows) == 1
    below = [p for p in dash["panels"] if p.get("type") != "row" and p["gridPos"]["y"] > rows[0]["gridPos"]["y"]]
    text = " ".join(t["expr"] for p in below for t in p.get("targets", []))
    for needed in (
        "rmsft_learner_rollout_wait_seconds_total",
        "rmsft_learner_pool_idle_seconds_total",
        "rmsft_learner_rollout_staleness_versions_bucket",
        "rmsft_learner_stale_rollouts_dropped_total",
    ):
        assert needed in text, needed


def _rollout_dashboard() -> dict[str, Any]:
    return json.loads((ROOT / "charts/rmsft/dashboards/rollout.json").read_text())


def test_rollout_dashboard_has_the_vllm_engine_row() -> None:
    dash = _rollout_dashboard()
    rows = [p for p in dash["panels"] if p.get("type") == "row" and p.get("title") == "vLLM engine"]
    assert len(rows) == 1
    row_y = rows[0]["gridPos"]["y"]
    # An expanded row owns the top-level panels below it; a collapsed one nests them.
    below = rows[0]["panels"] or [p for p in dash["panels"] if p.get("type") != "row" and p["gridPos"]["y"] > row_y]
    text = " ".join(t["expr"] for p in below for t in p.get("targets", []))
    for needed in VLLM_VIEWS:
        assert needed in text, needed
    assert "histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket" in text
    assert "histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket" in text
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_every_declared_vllm_metric_is_on_a_dashboard() -> None:
    """vllm_metrics.py declares what dashboards rely on, no more: an unused name would make
    missing_vllm_metrics() demand a metric nothing needs."""
    used = {m for d in DASHBOARDS for _, expr in panel_queries(json.loads(d.read_text())) for m in _NAME.findall(expr)}
    unused = [n for n, m in VLLM_METRICS.items() if not used & set(exposed_series(n, m.kind))]
    assert not unused


# prometheus_client classes, constructed below the way vLLM's PrometheusStatLogger constructs them.
_CLASSES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def _register(registry: CollectorRegistry, names: list[str]) -> None:
    for name in names:
        m = VLLM_METRICS[name]
        _CLASSES[m.kind](name, m.help, list(m.labels), registry=registry).labels("tiny", "0")


def test_missing_vllm_metrics_reports_what_is_not_registered() -> None:
    assert missing_vllm_metrics(CollectorRegistry()) == sorted(VLLM_METRICS)

    registry = CollectorRegistry()
    present = ["vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:time_to_first_token_seconds"]
    _register(registry, present)
    # prometheus_client strips a trailing `_total` from a Counter's name: this counter registers (and
    # collect() reports) the family `vllm:generation_tokens`, scraped as `vllm:generation_tokens_total`,
    # exactly as vLLM's `Counter(name="vllm:generation_tokens")` does. So VLLM_METRICS names counters
    # without `_total`, and either spelling at registration counts as present.
    Counter("vllm:generation_tokens_total", "spelled with _total", ["model_name", "engine"], registry=registry)
    # Registered under a declared name but as another kind: the `_total` series a dashboard rates would
    # not exist, so it counts as missing.
    Gauge("vllm:num_preemptions", "a gauge, not a counter", ["model_name", "engine"], registry=registry)
    expected = sorted(set(VLLM_METRICS) - {*present, "vllm:generation_tokens"})
    assert "vllm:num_preemptions" in expected
    assert missing_vllm_metrics(registry) == expected

    full = CollectorRegistry()
    _register(full, list(VLLM_METRICS))
    assert missing_vllm_metrics(full) == []


def test_dashboard_vllm_series_are_what_prometheus_client_exposes() -> None:
    """Metrics built as vLLM builds them expose every `vllm:*` series the dashboards query."""
    registry = CollectorRegistry()
    _register(registry, list(VLLM_METRICS))
    scraped = {
        s.name for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples
    }
    queried = {
        m
        for d in DASHBOARDS
        for _, expr in panel_queries(json.loads(d.read_text()))
        for m in _NAME.findall(expr)
        if m.startswith("vllm:")
    }
    assert queried >= set(VLLM_VIEWS)
    assert queried <= scraped, sorted(queried - scraped)


def test_installed_vllm_declares_the_metrics_dashboards_query() -> None:
    """Cross-check VLLM_METRICS against the installed vLLM's PrometheusStatLogger source, read with `ast`
    (vLLM is not imported): each name must be constructed there with the declared kind."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    loggers = Path(next(iter(spec.submodule_search_locations))) / "v1/metrics/loggers.py"
    assert loggers.is_file(), f"{loggers} is gone: find where vLLM now builds its Prometheus metrics"
    kinds = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}
    built: dict[str, str] = {}
    for node in ast.walk(ast.parse(loggers.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in kinds:
            for kw in node.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    built[kw.value.value] = kinds[node.func.attr]
    wrong = {n: (m.kind, built.get(n)) for n, m in VLLM_METRICS.items() if built.get(n) != m.kind}
    assert not wrong, f"declared kind vs what {loggers} builds: {wrong}"


def test_training_dashboard_shows_the_held_out_evaluation() -> None:
    """The held-out F1 and mAP the learner exports after each evaluation (learner/tracking/metrics.py) have a
    panel, and it draws nothing before the first evaluation (the gauges read 0 then, `eval_step` 0)."""
    dash = json.loads((ROOT / "charts/rmsft/dashboards/training.json").read_text())
    panels = [p for p in dash["panels"] if p.get("title") == "Held-out F1 / mAP"]
    assert len(panels) == 1
    exprs = [t["expr"] for t in panels[0]["targets"]]
    shown = {m for e in exprs for m in _NAME.findall(e)}
    assert {"rmsft_learner_eval_f1", "rmsft_learner_eval_map", "rmsft_learner_eval_map50"} <= shown
    assert len(exprs) == 3
    for expr in exprs:
        assert re.search(r"\band on \(namespace, pod\) \(rmsft_learner_eval_step\{[^}]*\} > 0\)", expr), expr
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_dashboard_panels_do_not_overlap(path: Path) -> None:
    """Grafana stacks overlapping panels on each other: a panel added on a taken cell would hide one."""
    cells: dict[tuple[int, int], str] = {}
    for p in json.loads(path.read_text())["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{path.name}: {p.get('title')!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p.get("title", "?")


def test_monitoring_page_lists_exactly_the_declared_metrics() -> None:
    """docs/monitoring.md's reference tables name every metric the components declare, and nothing else."""
    text = (ROOT / "docs/monitoring.md").read_text()
    listed = set(re.findall(r"^\| `(rmsft_[a-z0-9_]+)` \|", text, flags=re.M))
    assert listed == set(declared_metrics())


def _reasons_in(paths: list[Path], pattern: str) -> set[str]:
    return {m for p in paths for m in re.findall(pattern, p.read_text())}


def test_every_failure_reason_is_exported_at_zero_from_the_start() -> None:
    """The failure panels ("Rejected or failed updates", "Learner retries on another server") draw 0, not "no data",
    in a healthy run: every reason the code can count is exported before the first failure. A reason added to the
    code but not to the list fails here."""
    from learner.tracking import metrics as learner_metrics
    from rollout_engine import metrics as rollout_metrics

    server_code = [p for d in ("rmsft/weight_wire", "rollout_svc", "rollout_engine") for p in (ROOT / d).glob("*.py")]
    # WireError(..., reason="x") and WEIGHT_SYNC_FAILURES.labels(reason="x"); finish_reason="stop" is no such reason.
    counted = _reasons_in(server_code, r'(?<![A-Za-z_])reason="([a-z_]+)"') | {"malformed"}  # WireError's default
    assert {"busy", "apply", "truncated", "relay_refused"} <= counted, counted  # the scan finds what it should
    retried = _reasons_in([ROOT / "learner/rollouts/client.py"], r'self\._retry\(call, server, chunk, "([a-z_]+)"')
    assert retried == {"bad_reply", "stale_version"}, retried
    for counter, reasons, must in (
        (rollout_metrics.WEIGHT_SYNC_FAILURES, rollout_metrics.WEIGHT_SYNC_FAILURE_REASONS, counted),
        (
            learner_metrics.ROLLOUT_RETRIES,
            learner_metrics.ROLLOUT_RETRY_REASONS,
            retried | {"unavailable", "deadline_exceeded", "resource_exhausted"},
        ),
    ):
        assert must <= set(reasons), f"{counter._name}: add {sorted(must - set(reasons))} to its reasons tuple"
        exported = {s.labels["reason"] for mf in counter.collect() for s in mf.samples if s.name.endswith("_total")}
        assert set(reasons) <= exported, f"{counter._name}: not exported before a failure: {set(reasons) - exported}"
