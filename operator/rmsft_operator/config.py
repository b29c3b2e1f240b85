"""Operator timings and switches, read from the environment so tests and small clusters can
shorten them without code changes (the Helm chart sets them from values.yaml)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise SystemExit(f"{name}={raw!r} must be >= 0")
    return value


PULL_POLICIES = ("Always", "IfNotPresent", "Never")


def _pull_policy(name: str, default: str) -> str:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw not in PULL_POLICIES:
        raise SystemExit(f"{name}={raw!r} must be one of {', '.join(PULL_POLICIES)}")
    return raw


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 30.0  # periodic reconcile of every job (safety net for missed events)
    retry_backoff_seconds: float = 5.0  # kopf handler retry delay after a failed reconcile
    api_retries: int = 3  # in-place retries of one API call on 5xx/429/connection errors
    api_backoff_seconds: float = 0.5  # first in-place retry delay (doubles each time)
    consistency_seconds: float = 5.0  # kopf: wait this long for its own patch to come back
    watch_timeout_seconds: float = 300  # server-side watch timeout (reconnects after it)
    metrics_port: int = 8080  # 0 disables the operator's /metrics endpoint
    # kopf's cluster scanning lists namespaces and CRDs cluster-wide; a namespaced install (and
    # the kmock tests) turn it off and watch the exact namespaces given on the command line.
    scanning: bool = True
    # Read status.step / status.weightVersion from the learner pod's /metrics (0 disables).
    progress_timeout_seconds: float = 1.0
    # The operator's own image, which the shm cleanup Job runs (render.render_shm_cleanup); the chart
    # sets it from its image values. Empty (`rmsft operator` run outside the chart, which cannot know
    # its image): each cleanup Job runs its job's own image instead, under the same least privilege
    # (the pod's security context limits it, not the image); the operator says so at start.
    image: str = ""
    image_pull_policy: str = "IfNotPresent"
    # The operator's own namespace (the chart sets it): where it posts the Event of a CRD version mismatch
    # (crd_check). Empty: outside the chart; the mismatch is then only logged.
    namespace: str = ""

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            resync_seconds=_float("RMSFT_OPERATOR_RESYNC_SECONDS", cls.resync_seconds) or cls.resync_seconds,
            retry_backoff_seconds=_float("RMSFT_OPERATOR_RETRY_BACKOFF_SECONDS", cls.retry_backoff_seconds),
            api_retries=int(_float("RMSFT_OPERATOR_API_RETRIES", cls.api_retries)),
            api_backoff_seconds=_float("RMSFT_OPERATOR_API_BACKOFF_SECONDS", cls.api_backoff_seconds),
            consistency_seconds=_float("RMSFT_OPERATOR_CONSISTENCY_SECONDS", cls.consistency_seconds),
            watch_timeout_seconds=_float("RMSFT_OPERATOR_WATCH_TIMEOUT_SECONDS", cls.watch_timeout_seconds),
            metrics_port=int(_float("RMSFT_OPERATOR_METRICS_PORT", cls.metrics_port)),
            progress_timeout_seconds=_float("RMSFT_OPERATOR_PROGRESS_TIMEOUT_SECONDS", cls.progress_timeout_seconds),
            image=os.environ.get("RMSFT_OPERATOR_IMAGE", "").strip(),
            image_pull_policy=_pull_policy("RMSFT_OPERATOR_IMAGE_PULL_POLICY", cls.image_pull_policy),
            scanning=os.environ.get("RMSFT_OPERATOR_SCANNING", "true").lower() not in ("0", "false", "no"),
            namespace=os.environ.get("RMSFT_OPERATOR_NAMESPACE", "").strip(),
        )
