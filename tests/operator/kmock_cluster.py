"""A kmock Kubernetes API emulator on a real HTTP port, run in its own thread and event loop so
that a real kopf operator (KopfRunner, another thread) and the synchronous test talk to it over
HTTP exactly as they would to an API server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kmock

# kopf waits for namespaces and CRDs in its discovery "backbone" before it starts watching.
CLUSTER_RESOURCES = {
    "v1/namespaces": "Namespace",
    "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
}
RESOURCES = {
    "rmsft.io/v1alpha1/rolloutmatchingjobs": ("RolloutMatchingJob", {"status"}),
    "v1/secrets": ("Secret", set()),
    "v1/configmaps": ("ConfigMap", set()),
    "v1/services": ("Service", set()),
    "v1/events": ("Event", set()),
    "v1/pods": ("Pod", {"status"}),
    "apps/v1/statefulsets": ("StatefulSet", {"status", "scale"}),
    "batch/v1/jobs": ("Job", {"status"}),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", set()),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
# kmock re-filters its whole request history for every new request (cost grows with it): keep
# only the recent tail. Reactions used by the tests therefore never rely on history slices.
HISTORY = 16


class Emulator(kmock.KubernetesEmulator):
    """kmock plus two things the tests need from a real API server: names for objects created
    with generateName (kopf's Events), and a bounded request log."""

    _generated = 0
    # (verb, apiGroup, plural[/subresource]) of every request not made by the test itself.
    operator_access: set[tuple[str, str, str]] = set()

    async def _handle(self, request: kmock.Request) -> Any:
        self._record_access(request)
        data = request.data if isinstance(request.data, dict) else None
        meta = data.get("metadata") if data else None
        if isinstance(meta, dict) and not meta.get("name") and meta.get("generateName"):
            Emulator._generated += 1
            meta["name"] = f"{meta['generateName']}{Emulator._generated:05d}"
        try:
            return await super()._handle(request)
        finally:
            if len(self._requests) > 2 * HISTORY:
                del self._requests[:-HISTORY]


def _verb(request: kmock.Request) -> str:
    method = str(getattr(request.method, "value", request.method)).upper()
    if method == "GET":
        if request.name:
            return "get"
        return "watch" if request.params.get("watch") in ("true", "1") else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method)


def _record(self: Emulator, request: kmock.Request) -> None:
    if request.resource is None or not request.resource.plural:
        return  # discovery
    if "Python-urllib" in request.headers.get("User-Agent", ""):
        return  # the test itself
    plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
    self.operator_access.add((_verb(request), request.resource.group or "", plural))


Emulator._record_access = _record  # type: ignore[attr-defined]


class KmockCluster:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.emulator: Emulator | None = None
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            for key, (kind, subresources) in RESOURCES.items():
                emulator.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=True, verbs=VERBS, subresources=subresources, singular=kind.lower()
                )
            for key, kind in CLUSTER_RESOURCES.items():
                emulator.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=False, verbs=VERBS, singular=kind.lower()
                )
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> KmockCluster:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("kmock did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def create_namespace(self, name: str) -> None:
        # kmock's URL parser cannot POST cluster-scoped core objects; seed the store directly.
        def seed() -> None:
            assert self.emulator is not None
            self.emulator.objects["v1/namespaces", None, name] = {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name},
            }

        self.call(seed)

    def call(self, fn: Any) -> Any:
        """Run `fn()` on kmock's loop (to install reactions or read objects safely)."""

        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(10)

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}],
        }
        path.write_text(json.dumps(cfg))
        return path

    # ------------------------------------------------------------------ plain HTTP client

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw) if raw else None
            except ValueError:
                return exc.code, raw.decode(errors="replace")

    def items(self, prefix: str, namespace: str, plural: str) -> list[dict[str, Any]]:
        status, body = self.request("GET", f"{prefix}/namespaces/{namespace}/{plural}")
        assert status == 200, (status, body)
        return body["items"]


NAMESPACE = "rmsft-test"
# Short timings so the real kopf operator reacts within a second (defaults are minutes-scale).
FAST_ENV = {
    "RMSFT_OPERATOR_RESYNC_SECONDS": "1",
    "RMSFT_OPERATOR_RETRY_BACKOFF_SECONDS": "0.5",
    "RMSFT_OPERATOR_API_RETRIES": "3",
    "RMSFT_OPERATOR_API_BACKOFF_SECONDS": "0.05",
    # kmock never bumps resourceVersion, so kopf would wait the whole consistency timeout after
    # each of its own patches.
    "RMSFT_OPERATOR_CONSISTENCY_SECONDS": "0.2",
    "RMSFT_OPERATOR_WATCH_TIMEOUT_SECONDS": "60",
    # kmock cannot list cluster-scoped namespaces: watch the exact namespace instead of scanning.
    "RMSFT_OPERATOR_SCANNING": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float = 40.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, TypeError, IndexError, AssertionError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
