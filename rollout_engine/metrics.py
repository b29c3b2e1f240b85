"""Prometheus metrics of rollouts (`rmsft_rollout_*`): the rollout server (`rollout_svc`) reports them all, the
colocated engine (learner/rollouts/colocate) the generation and weight-sync ones, so one dashboard reads both
modes. Dashboards may only query names defined here, in learner/tracking/metrics.py or in
rmsft_operator/metrics.py (tests/test_dashboards.py checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:  # pragma: no cover
    from rmsft.weight_wire import WeightVersion

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("rmsft_rollout_requests_total", "gRPC calls handled", ["method", "code"])
PROMPTS = Counter("rmsft_rollout_prompts_total", "Prompts generated")
IMAGES = Counter("rmsft_rollout_images_total", "Images in the prompts generated")
PROMPT_TOKENS = Counter("rmsft_rollout_prompt_tokens_total", "Prompt tokens processed")
GENERATED_TOKENS = Counter("rmsft_rollout_generated_tokens_total", "Completion tokens generated")
GENERATE_SECONDS = Histogram(
    "rmsft_rollout_generate_seconds", "Wall time of one Generate call", buckets=_LATENCY_BUCKETS
)
QUEUE_DEPTH = Gauge("rmsft_rollout_queue_depth", "Generate calls held at the gate while a weight update applies")
INFLIGHT = Gauge("rmsft_rollout_inflight_requests", "Generate calls whose requests are in the engine")
WEIGHT_SYNC_SECONDS = Histogram(
    "rmsft_rollout_weight_sync_seconds",
    "Receive + verify + apply time of one weight update",
    ["mode"],
    buckets=_LATENCY_BUCKETS,
)
WEIGHT_SYNC_BYTES = Counter("rmsft_rollout_weight_sync_bytes_total", "Tensor bytes received", ["mode"])
WEIGHT_SYNC_FAILURES = Counter(
    "rmsft_rollout_weight_sync_failures_total", "Rejected or failed weight updates", ["reason"]
)
# Every reason the server counts (rmsft.weight_wire.WireError's, whose default is "malformed", and the servicer's
# own), each exported at 0 from the start: a counter's labelled series exists only from its first .labels() call,
# and a dashboard must tell "no failure" (0) from "no data" (tests/test_dashboards.py keeps the list whole).
WEIGHT_SYNC_FAILURE_REASONS = (
    "name",
    "shape",
    "dtype",
    "count",
    "digest",
    "frame_size",
    "malformed",
    "truncated",
    "cancelled",
    "lora_disabled",
    "lora_rank",
    "staging_space",
    "busy",
    "apply",
    "shm_unavailable",
    "shm_path",
    "run_id",
    "group",
    "relay_refused",
)
for _reason in WEIGHT_SYNC_FAILURE_REASONS:
    WEIGHT_SYNC_FAILURES.labels(reason=_reason)
WEIGHT_VERSION = Gauge("rmsft_rollout_weight_version", "Weight version being served (its number)")
# Which learner run's weights are served: one series, value 1, labelled with the run id ("" before any
# update: the checkpoint's weights). A weight version is (run id, number): the number alone repeats.
WEIGHT_RUN = Gauge(
    "rmsft_rollout_weight_run_info", "Learner run whose weight version is being served (1 per run_id)", ["run_id"]
)
READY = Gauge("rmsft_rollout_ready", "1 when the engine is loaded and serving")
INFLIGHT_UPDATES = Counter(
    "rmsft_rollout_inflight_updates_total",
    "Weight updates applied under paused running requests (keep_generating), not drained",
)
KEPT_CALLS = Counter(
    "rmsft_rollout_kept_calls_total",
    "Generate calls running when an in-flight weight update paused them (resumed on the new weights)",
)


def set_weights(weights: WeightVersion) -> None:
    """Export the weight version served: its number, and its run as the only `rmsft_rollout_weight_run_info`
    series (the previous run's label goes)."""
    WEIGHT_VERSION.set(weights.number)
    WEIGHT_RUN.clear()
    WEIGHT_RUN.labels(run_id=weights.run_id).set(1)
