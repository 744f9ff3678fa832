"""The API's HTTP series as ``vllm serve`` exports them (prometheus-fastapi-instrumentator: ``http_requests_total``,
``http_request_duration_seconds``, request and response sizes), per route template and method. A path no route
matches counts under the handler ``none``, and a method outside HTTP's under ``other``, so a client cannot add series
by asking for new URLs or making up methods.

The series are this process's (each API process counts its own requests, as each ``vllm serve`` does)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator, metrics

# vLLM's exclusions (scrapes and probes say nothing of the service's traffic), and coserve's own probes
UNCOUNTED = ("/metrics", "/health", "/healthz", "/readyz", "/load", "/ping", "/version")
# HTTP's methods (RFC 9110, and PATCH): any other a client sends is labelled OTHER_METHOD
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
OTHER_METHOD = "other"


def instrument(api: FastAPI) -> CollectorRegistry:
    """Counts ``api``'s requests from here on; returns the registry holding the series, for ``GET /metrics``."""
    registry = CollectorRegistry(auto_describe=True)  # the app's own: several apps in a process do not clash
    Instrumentator(excluded_handlers=list(UNCOUNTED), should_group_untemplated=True, registry=registry).add(
        bounded_methods(metrics.default(registry=registry))).instrument(api)
    return registry


def bounded_methods(instrumentation: Callable[[metrics.Info], None]) -> Callable[[metrics.Info], None]:
    """``instrumentation`` with a method outside ``HTTP_METHODS`` labelled ``OTHER_METHOD``."""
    def instrument(info: metrics.Info) -> None:
        if info.method not in HTTP_METHODS:
            info.method = OTHER_METHOD
        instrumentation(info)
    return instrument
