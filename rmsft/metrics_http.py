"""The /metrics endpoint of every rmsft process that exports Prometheus metrics (`rmsft serve`, `rmsft train`,
`rmsft local`'s learner): prometheus_client's WSGI app, always in the classic text format (0.0.4).

Why not prometheus_client's own start_http_server: since 0.22 it answers a scraper that asks for OpenMetrics without
`escaping=allow-utf-8` (every Prometheus 2.x does: Debian's 2.42, what many clusters run) with names escaped to
underscores, `:` included, so vLLM's `vllm:kv_cache_usage_perc` is scraped as `vllm_kv_cache_usage_perc` and every
`vllm:*` panel of charts/rmsft/dashboards draws nothing. The text format keeps the names as they are for Prometheus 2
and 3 alike (tests/test_dashboards_prometheus.py scrapes through a real Prometheus 2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import Collector

CLASSIC_TEXT = "text/plain;version=0.0.4"


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape would flood the logs
        pass


class WithoutPrefix(Collector):
    """`registry` less the metric families whose name starts with `prefix`: the learner imports the rollout
    metrics module (the colocated engine reports through it) but, with rollout servers, has none of their
    figures; exporting them at 0 would add a flat learner series to every per-pod rollout panel."""

    def __init__(self, registry: Collector, prefix: str) -> None:
        self.registry, self.prefix = registry, prefix

    def collect(self) -> Iterable[Any]:
        return [mf for mf in self.registry.collect() if not mf.name.startswith(self.prefix)]


def learner_registry(*, colocated: bool) -> Collector:
    """What a learner serves: everything, with the colocated engine's rollout metrics; without the
    `rmsft_rollout_*` families when rollout servers report those themselves."""
    return REGISTRY if colocated else WithoutPrefix(REGISTRY, "rmsft_rollout_")


def start_metrics_server(port: int, addr: str = "0.0.0.0", registry: Collector = REGISTRY) -> WSGIServer:
    """Serve `registry` on http://addr:port/metrics from a daemon thread (port 0: a free one, `.server_port`);
    OSError when the port cannot be bound. `.shutdown()` and `.server_close()` stop it."""
    app = make_wsgi_app(registry)

    def classic(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ["HTTP_ACCEPT"] = CLASSIC_TEXT
        return app(environ, start_response)

    httpd = make_server(addr, port, classic, _Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics-http").start()
    return httpd
