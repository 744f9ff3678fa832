"""Requests the tenants' rate limits refused, for ``GET /metrics`` (counted in Redis by every API process).

Labelled ``tenant_id`` on purpose: which tenant is throttled is what an operator asks of it. Its cardinality is
bounded: one series per tenant ever refused and limit (at most six: requests and tokens of three buckets), and
tenants are disabled, never deleted, so the set grows with the tenants alone; an aggregate sums
``without (tenant_id)`` (README.md's ``/metrics``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from app.services.rate_limits import refusals


class RateLimitCollector(Collector):
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("coserve:rate_limited_requests",
                                     "Requests refused (429) by their tenant's rate limits, by the limit reached "
                                     "(requests, tokens; counting_requests, message_batches_requests: their own "
                                     "buckets').",
                                     labels=["tenant_id", "limit"])
        for (tenant, limit), n in sorted(refusals(self.redis_url).items()):
            family.add_metric([tenant, limit], n)
        yield family
