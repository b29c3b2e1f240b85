"""Shared-token auth: every call must carry `authorization: Bearer <token>` (or `x-rmsft-token`).

The gRPC health service is exempt so Kubernetes' built-in gRPC probes (which cannot send
metadata) keep working; it reveals nothing but readiness.
"""

from __future__ import annotations

import hmac

import grpc

from rollout_engine import metrics

_EXEMPT_PREFIX = "/grpc.health.v1.Health/"


def _token_of(metadata) -> str:
    for key, value in metadata or ():
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
        if key == "x-rmsft-token":
            return value.strip()
    return ""


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_EXEMPT_PREFIX):
            return continuation(handler_call_details)
        given = _token_of(handler_call_details.invocation_metadata).encode()
        if given and hmac.compare_digest(given, self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        name = method.rsplit("/", 1)[-1]
        metrics.REQUESTS.labels(method=name, code="UNAUTHENTICATED").inc()
        msg = "missing or wrong auth token (send metadata 'authorization: Bearer <token>')"

        def deny(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
