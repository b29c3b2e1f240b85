"""vLLM's own Prometheus metrics that rmsft's dashboards query.

These are NOT registered by rmsft. The rollout server runs vLLM's `AsyncLLM` with stats logging on,
and vLLM's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) then registers them in the default
prometheus_client registry of the server process, so they are served on the same /metrics as
rollout_engine/metrics.py. This module only *declares* the ones charts/rmsft/dashboards rely on, as data:
tests/test_dashboards.py treats it as the source of truth for `vllm:*` names, and
`missing_vllm_metrics()` lets a test with a running engine check that vLLM still registers them (a
vLLM upgrade that renames one then fails loudly instead of leaving an empty panel).

Names are the ones vLLM passes to prometheus_client (checked against vLLM 0.32.0), which is also the
metric *family* name a registry reports. What Prometheus scrapes differs by kind:
  counter   `vllm:prompt_tokens` -> `vllm:prompt_tokens_total` (+ `_created`)
  histogram `vllm:time_to_first_token_seconds` -> `..._bucket`, `..._sum`, `..._count` (+ `_created`)
  gauge     exposed unchanged
vLLM labels every one of them with `model_name` and `engine` (the engine index, "0" for one engine
per server); Prometheus adds `namespace`/`pod` when it scrapes the server.

Import-light on purpose: prometheus_client only, never vllm.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import REGISTRY, CollectorRegistry


class VllmMetric(NamedTuple):
    kind: str  # prometheus_client type as a registry reports it: "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ("model_name", "engine")


VLLM_METRICS: dict[str, VllmMetric] = {
    "vllm:kv_cache_usage_perc": VllmMetric("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:num_requests_running": VllmMetric("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": VllmMetric("gauge", "Number of requests waiting to be processed."),
    "vllm:num_preemptions": VllmMetric("counter", "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": VllmMetric("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens": VllmMetric("counter", "Number of generation tokens processed."),
    "vllm:time_to_first_token_seconds": VllmMetric("histogram", "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": VllmMetric("histogram", "Histogram of inter-token latency in seconds."),
    "vllm:e2e_request_latency_seconds": VllmMetric("histogram", "Histogram of e2e request latency in seconds."),
}


def exposed_series(name: str, kind: str) -> tuple[str, ...]:
    """Sample names Prometheus scrapes for one declared metric (what a PromQL query may mention)."""
    if kind == "counter":
        base = name.removesuffix("_total")
        return (f"{base}_total", f"{base}_created")
    if kind == "histogram":
        return (name, f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created")
    return (name,)


def missing_vllm_metrics(registry: CollectorRegistry = REGISTRY) -> list[str]:
    """Declared names that `registry` does not hold as a metric of the declared kind, sorted.

    Compares metric families from `registry.collect()`: a family is listed even while a labelled
    metric has no children yet, and a counter's family name never carries `_total` (prometheus_client
    strips it), which is why VLLM_METRICS names counters without it. A name registered with another
    kind counts as missing: the series the dashboards query (`_total`, `_bucket`) would not exist.
    """
    have = {family.name: family.type for family in registry.collect()}
    return sorted(name for name, metric in VLLM_METRICS.items() if have.get(name) != metric.kind)
