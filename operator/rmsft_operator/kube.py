"""Kubernetes API access as plain dicts, with in-place retries for transient errors.

Objects travel as JSON dicts (no client models) so what the operator renders is exactly what it
sends. Transient failures (5xx, 429, connection errors) are retried with exponential backoff;
whatever still fails is raised as `ApiError` and the kopf handler retries the whole reconcile.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rmsft.jobspec import API_GROUP, API_VERSION, PLURAL
from rmsft_operator import metrics
from rmsft_operator.config import OperatorConfig

log = logging.getLogger("rmsft_operator.kube")
MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"Kubernetes API error {status}: {message}")


def _transient(status: int) -> bool:
    return status == 0 or status == 429 or status >= 500


def load_client_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # The client reads $KUBECONFIG once, when it is imported: read it now instead.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)


# kind -> (API prefix, plural) for the objects the operator owns.
RESOURCES: dict[str, tuple[str, str]] = {
    "Secret": ("/api/v1", "secrets"),
    "Pod": ("/api/v1", "pods"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Job": ("/apis/batch/v1", "jobs"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "RolloutMatchingJob": (f"/apis/{API_GROUP}/{API_VERSION}", PLURAL),
}


class Kube:
    """Raw REST over the `kubernetes` client's configured connection (auth, TLS, host)."""

    def __init__(self, cfg: OperatorConfig, api_client: client.ApiClient | None = None) -> None:
        self.cfg = cfg
        self.api = api_client or client.ApiClient()

    def _once(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Any:
        m, url, headers, payload, post = self.api.param_serialize(
            method=method,
            resource_path=path,
            body=body,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(m, url, headers, payload, post, _request_timeout=(5, 30))
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason, http_resp=resp.response)
        return json.loads(data) if data else {}

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
        expected: tuple[int, ...] = (),
    ) -> Any:
        """`expected`: statuses that are answers, not errors (a 404 on get-before-create): raised as
        ApiError like the rest but not counted in rmsft_operator_errors_total."""
        delay = self.cfg.api_backoff_seconds
        for attempt in range(self.cfg.api_retries + 1):
            try:
                return self._once(method, path, body, content_type, query)
            except ApiException as exc:
                status = int(exc.status or 0)
                if status in expected:
                    raise ApiError(status, f"{method} {path}: {_reason(exc)}") from None
                metrics.ERRORS.labels(code=str(status)).inc()
                if not _transient(status) or attempt == self.cfg.api_retries:
                    raise ApiError(status, f"{method} {path}: {_reason(exc)}") from None
            except OSError as exc:  # connection refused/reset (urllib3 errors derive from OSError)
                metrics.ERRORS.labels(code="connection").inc()
                if attempt == self.cfg.api_retries:
                    raise ApiError(0, f"{method} {path}: {exc}") from None
            metrics.API_RETRIES.inc()
            log.info("retrying %s %s in %.2fs (attempt %d)", method, path, delay, attempt + 1)
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        out = f"{prefix}/namespaces/{namespace}/{plural}"
        if name:
            out += f"/{name}"
        if sub:
            out += f"/{sub}"
        return out

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", self.path(kind, namespace, name), expected=(404,))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def ensure(self, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create `obj` unless it exists; returns (live object, created?). Idempotent."""
        kind, meta = obj["kind"], obj["metadata"]
        # A Secret is created, never read (the chart grants `create` only on Secrets): a 409 says it is there.
        live = None if kind == "Secret" else self.get(kind, meta["namespace"], meta["name"])
        if live is not None:
            return live, False
        try:
            live = self.request("POST", self.path(kind, meta["namespace"]), obj)
            metrics.CHILDREN_CREATED.labels(kind=kind).inc()
            return (live or obj), True
        except ApiError as exc:
            if exc.status != 409:
                raise
        # 409: created meanwhile (a concurrent pass, or our own write whose response was lost).
        if kind == "Secret":
            return obj, False
        live = self.get(kind, meta["namespace"], meta["name"])
        if live is None:
            raise ApiError(409, f"{kind} {meta['name']} conflicts but cannot be read")
        return live, False

    def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        sub: str | None = None,
        expected: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        return self.request("PATCH", self.path(kind, namespace, name, sub), body, MERGE_PATCH, expected=expected)

    def delete(self, kind: str, namespace: str, name: str, uid: str, expected: tuple[int, ...] = ()) -> None:
        """Deletes the object `name` only while it is the one with `uid` (a precondition: never a namesake created
        since it was observed); its dependents go through the garbage collector."""
        self.request(
            "DELETE",
            self.path(kind, namespace, name),
            {"propagationPolicy": "Background", "preconditions": {"uid": uid}},
            expected=expected,
        )

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        items = (
            self.request("GET", f"/api/v1/namespaces/{namespace}/pods", query=[("labelSelector", selector)]).get(
                "items"
            )
            or []
        )
        # filter here too: not every API (kmock) honours labelSelector
        return [p for p in items if labels.items() <= ((p.get("metadata") or {}).get("labels") or {}).items()]

    def list_events(self, namespace: str, field_selector: str) -> list[dict[str, Any]]:
        return (
            self.request(
                "GET", f"/api/v1/namespaces/{namespace}/events", query=[("fieldSelector", field_selector)]
            ).get("items")
            or []
        )

    def namespace_labels(self, name: str) -> dict[str, str] | None:
        """A namespace's labels (its Pod Security level), None when it cannot be read. A denial is
        not fatal: it only costs the early refusal of an shm job (a chart whose RBAC predates it)."""
        try:
            ns = self.request("GET", f"/api/v1/namespaces/{name}", expected=(403, 404))
        except ApiError as exc:
            if exc.status not in (403, 404):
                raise
            log.warning("cannot read namespace %s (%s): its Pod Security level is not checked", name, exc)
            return None
        return dict(((ns or {}).get("metadata") or {}).get("labels") or {})

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get("RolloutMatchingJob", namespace, name)

    def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any], expected: tuple[int, ...] = ()
    ) -> dict[str, Any]:
        return self.patch("RolloutMatchingJob", namespace, name, {"status": status}, sub="status", expected=expected)


def _reason(exc: ApiException) -> str:
    try:
        payload = json.loads(exc.body or "{}")
        return str(payload.get("message") or exc.reason)
    except (ValueError, TypeError):
        return str(exc.reason)
