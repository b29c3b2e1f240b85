"""Prometheus metrics of the operator. Dashboards may only query names defined here,
in rollout_engine/metrics.py or in learner/tracking/metrics.py (tests/test_dashboards.py checks)."""

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "rmsft_operator_reconciles_total", "Reconcile passes over a RolloutMatchingJob", ["trigger", "result"]
)
ERRORS = Counter("rmsft_operator_errors_total", "Kubernetes API errors seen by the operator", ["code"])
API_RETRIES = Counter("rmsft_operator_api_retries_total", "Kubernetes API calls retried after an error")
RECONCILE_SECONDS = Histogram(
    "rmsft_operator_reconcile_duration_seconds",
    "Wall time of one reconcile pass",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOBS = Gauge("rmsft_operator_jobs", "RolloutMatchingJobs known to the operator by phase", ["phase"])
CHILDREN_CREATED = Counter("rmsft_operator_children_created_total", "Child objects created", ["kind"])
