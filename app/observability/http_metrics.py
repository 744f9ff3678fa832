"""The API's HTTP series as ``vllm serve`` exports them (prometheus-fastapi-instrumentator: ``http_requests_total``,
``http_request_duration_seconds``, request and response sizes), per route template and method. A path no route
matches counts under the handler ``none``, so a client cannot add series by asking for new URLs.

The series are this process's (each API process counts its own requests, as each ``vllm serve`` does)."""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator

# vLLM's exclusions (scrapes and probes say nothing of the service's traffic), and coserve's own probes
UNCOUNTED = ("/metrics", "/health", "/healthz", "/readyz", "/load", "/ping", "/version")


def instrument(api: FastAPI) -> CollectorRegistry:
    """Counts ``api``'s requests from here on; returns the registry holding the series, for ``GET /metrics``."""
    registry = CollectorRegistry(auto_describe=True)  # the app's own: several apps in a process do not clash
    Instrumentator(excluded_handlers=list(UNCOUNTED), should_group_untemplated=True,
                   registry=registry).add().instrument(api)
    return registry
